"""Architectures llama.cpp runs that qconvert does not write to GGUF (yet), each with why, so that the refusal
says what to use instead of a bare "not supported".

DeepSeek-V4 (llama.cpp's `deepseek4`) is not in the installed gguf 0.19's MODEL_ARCH: its architecture name,
tensor names (hyper-connections, compressed attention) and keys exist only in the gguf-py vendored with
llama.cpp's sources, which the package never imports at run time. Writing it needs an arch-local name and key
table (as archs/kimi_k3.py has for Kimi-K3) and a reader of its native checkpoints (`layers.N.attn.*` names, FP8
128x128 blocks and int8-packed MXFP4 experts): not done.
"""

from __future__ import annotations

from .base import register_not_written

_USE_LLAMA_CPP = "convert it with llama.cpp's convert_hf_to_gguf.py"
register_not_written("DeepseekV4ForCausalLM",
                     "llama.cpp's deepseek4, which the installed gguf 0.19 does not name and qconvert does not "
                     f"write; {_USE_LLAMA_CPP}")

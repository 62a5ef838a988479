"""Architectures llama.cpp runs that qconvert does not write to GGUF (yet), each with why, so that the refusal
says what to use instead of a bare "not supported".

Kimi-K3 (`kimi-k3`) is not in the installed gguf 0.19's MODEL_ARCH: its architecture name, tensor names (KDA)
and keys exist only in the gguf-py vendored with llama.cpp's sources, which the package never imports at run
time. Writing it needs an arch-local name and key table, as DeepSeek-V4 has (archs/deepseek4.py), and Kimi-K3
has no transformers class: not done.
"""

from __future__ import annotations

from .base import register_not_written

_USE_LLAMA_CPP = "convert it with llama.cpp's convert_hf_to_gguf.py"
register_not_written("KimiK3ForConditionalGeneration",
                     "llama.cpp's kimi-k3, which the installed gguf 0.19 does not name and qconvert does not "
                     f"write; {_USE_LLAMA_CPP}")

"""The GGUF files llama.cpp itself makes (llama_cpp.llama_model_quantize, the C llama-quantize) from an F32 GGUF
of a tiny random model 256 wide, for arch llama, qwen2 and qwen3, built once under tests/_fixtures/gguf_reader:
the sources of tests/formats/gguf/test_gguf_reader.py and tests/formats/gptq/test_gptq_consumers.py. Importing
this module skips a test module where llama_cpp is not installed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import fixtures

from qconvert.converters.plan import Options
from qconvert.converters.run import convert

llama_cpp = pytest.importorskip("llama_cpp")

ROOT = Path(__file__).parent.parent / "_fixtures" / "gguf_reader"
ARCHS = ("llama", "qwen2", "qwen3")
# llama.cpp file types (LlamaFileType) quantized from the F32 file; the K mixes also bring Q3_K/Q5_K/Q6_K;
# IQ4_NL (a codebook, no imatrix needed) stands for the types read as dense float32 through gguf-py
LLAMA_TYPES = {"q4_0": 2, "q8_0": 7, "q4_k_m": 15, "q6_k": 18, "q2_k": 10, "q3_k_m": 12, "q5_k_m": 17,
               "q4_1": 3, "q5_0": 8, "q5_1": 9, "f16": 1, "bf16": 32, "iq4_nl": 25}
OTHER_TYPES = {"q4_0": 2}


def _build_hf(out: Path, arch: str) -> None:
    """A 256-wide model (the fixtures' tokenizer) so that every row is whole 256-element K blocks."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=fixtures.VOCAB_SIZE, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=0)
    config, cls = {"llama": (LlamaConfig(head_dim=64, **common), LlamaForCausalLM),
                   "qwen2": (Qwen2Config(use_sliding_window=False, **common), Qwen2ForCausalLM),
                   "qwen3": (Qwen3Config(head_dim=64, use_sliding_window=False, **common), Qwen3ForCausalLM)}[arch]
    torch.manual_seed(11)
    model = cls(config)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * (torch.rand(p.shape, generator=gen) - 0.5))
            elif name.endswith(".bias"):
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    model.save_pretrained(str(out))
    fixtures.build_tokenizer(out)


def _llama_quantize(src: Path, dst: Path, ftype: int) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    assert rc == 0, f"llama_model_quantize failed ({rc})"


def _ensure(arch: str) -> dict[str, Path]:
    d = ROOT / arch
    types = LLAMA_TYPES if arch == "llama" else OTHER_TYPES
    files = {"hf": d / "hf", "f32": d / "f32.gguf", **{t: d / f"{t}.gguf" for t in types}}
    if not (d / ".done").exists():
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        _build_hf(files["hf"], arch)
        convert("hf", files["hf"], "gguf", files["f32"], Options(type="f32"), progress=False)
        for t, ftype in types.items():
            _llama_quantize(files["f32"], files[t], ftype)
        (d / ".done").write_text(json.dumps(sorted(files)))
    return files

"""The 256-wide tiny causal LMs (llama, qwen2, qwen3; K blocks need rows of 256) that llama-quantize's mixes
are checked on, built once under tests/_fixtures/gguf_presets (tests/formats/gguf/test_gguf_presets.py,
tests/apps/test_verify_logits.py)."""

from __future__ import annotations

from pathlib import Path

import torch

import fixtures

ROOT = Path(__file__).parent.parent / "_fixtures" / "gguf_presets"
# (arch, layers, tied embeddings): 8 llama layers exercise every branch of use_more_bits
MODELS = {"llama": ("llama", 8, False), "qwen2": ("qwen2", 2, True), "qwen3": ("qwen3", 3, False)}


def build_wide_model(out: Path, arch: str, layers: int, tie: bool, seed: int = 7) -> Path:
    """A tiny causal LM 256 wide (ffn 512, 4 heads of 64, 2 KV heads), fp16 safetensors + tokenizer."""
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)

    common = dict(vocab_size=fixtures.VOCAB_SIZE, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                  tie_word_embeddings=tie, bos_token_id=1, eos_token_id=0, pad_token_id=None)
    cfg, cls = {"llama": (LlamaConfig(head_dim=64, **common), LlamaForCausalLM),
                "qwen2": (Qwen2Config(use_sliding_window=False, **common), Qwen2ForCausalLM),
                "qwen3": (Qwen3Config(head_dim=64, use_sliding_window=False, **common), Qwen3ForCausalLM)}[arch]
    torch.manual_seed(seed)
    model = cls(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                v = 1.0 + 0.2 * (torch.rand(p.shape, generator=gen) - 0.5)
            elif name.endswith(".bias"):
                v = 0.02 * torch.randn(p.shape, generator=gen)
            elif "embed_tokens" in name:
                v = torch.randn(p.shape, generator=gen) * (p.shape[1] ** -0.5 if tie else 1.0)
            else:
                v = torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5
            p.copy_(v)
    model.to(torch.float16).save_pretrained(str(out), safe_serialization=True)
    fixtures.build_tokenizer(out)
    return out


def _cached(name: str, build) -> Path:
    d = ROOT / name
    if not (d / ".done").exists():
        import shutil

        shutil.rmtree(d, ignore_errors=True)
        d.with_name(f"{name}-f32.gguf").unlink(missing_ok=True)  # derived from the old model
        d.parent.mkdir(parents=True, exist_ok=True)
        build(d)
        (d / ".done").write_text("ok")
    return d


def model_dir(key: str) -> Path:
    arch, layers, tie = MODELS[key]
    return _cached(f"{key}_256", lambda d: build_wide_model(d, arch, layers, tie))

"""Memory while requantizing: a 2 GB bf16 model (written shard by shard into a temporary folder, never
into the repository) converted to Q4_K grows the converting process's peak RSS by well under 1 GB.

Peak memory is the kernel's ru_maxrss in a fresh process, measured as the increase over the same
process after a warm-up conversion of a small model (imports, allocator, code paths, the compiled
Q4_K searches), as in test_streaming.py. The conversion quantizes about 1.0e9 weights, about 30 s on
a 2-core machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from safetensors.torch import save_file

import fixtures

HIDDEN, FFN, VOCAB = 2048, 5632, fixtures.VOCAB_SIZE
LAYERS = 20  # 20 layers x 103 MB + embeddings: 2.06e9 bytes of bf16

PROBE = textwrap.dedent("""
    import json, resource, sys
    from pathlib import Path
    from qconvert.converters.plan import Options
    from qconvert.converters.run import convert
    src, out, small = map(Path, sys.argv[1:4])
    convert("hf", small, "gguf", out.with_name("warmup.gguf"), Options(type="q4_k", allow_requant=True), progress=False)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report = convert("hf", src, "gguf", out, Options(type="q4_k", allow_requant=True), progress=False)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    targets = sorted({r.plan.target for r in report.results})
    print(json.dumps({"base": base, "peak": peak, "targets": targets, "seconds": report.seconds}))
""")


def _config(layers: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
            "intermediate_size": FFN, "num_hidden_layers": layers, "num_attention_heads": 16,
            "num_key_value_heads": 16, "head_dim": 128, "vocab_size": VOCAB, "max_position_embeddings": 512,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1,
            "eos_token_id": 0, "torch_dtype": "bfloat16", "hidden_act": "silu"}


def write_bf16_model(out: Path, layers: int, seed: int = 0) -> int:
    """A llama-shaped bf16 checkpoint, one shard per layer, holding about one layer in memory."""
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0

    def shard(name: str, tensors: dict) -> None:
        nonlocal total
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        for k, v in tensors.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()

    def randn(*shape):
        return (torch.randn(shape, generator=gen) / shape[-1] ** 0.5).to(torch.bfloat16)

    shard("globals.safetensors", {"model.embed_tokens.weight": randn(VOCAB, HIDDEN),
                                  "lm_head.weight": randn(VOCAB, HIDDEN),
                                  "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16)})
    for i in range(layers):
        p = f"model.layers.{i}."
        shard(f"layer-{i:03d}.safetensors", {
            p + "self_attn.q_proj.weight": randn(HIDDEN, HIDDEN), p + "self_attn.k_proj.weight": randn(HIDDEN, HIDDEN),
            p + "self_attn.v_proj.weight": randn(HIDDEN, HIDDEN), p + "self_attn.o_proj.weight": randn(HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": randn(FFN, HIDDEN), p + "mlp.up_proj.weight": randn(FFN, HIDDEN),
            p + "mlp.down_proj.weight": randn(HIDDEN, FFN),
            p + "input_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16)})
    (out / "config.json").write_text(json.dumps(_config(layers)))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    fixtures.build_tokenizer(out)
    return total


def test_q4_k_of_a_2gb_bf16_model_grows_rss_under_1gb(tmp_path):
    src, small = tmp_path / "big", tmp_path / "small"
    total = write_bf16_model(src, LAYERS)
    assert total >= 2.0e9
    write_bf16_model(small, 1, seed=1)
    out = tmp_path / "out.gguf"
    proc = subprocess.run([sys.executable, "-c", PROBE, str(src), str(out), str(small)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    grown = result["peak"] - result["base"]
    print(f"bf16 {total / 1e9:.2f} GB -> Q4_K in {result['seconds']:.0f} s, peak RSS growth {grown / 1e6:.0f} MB")
    assert result["targets"] == ["F32", "Q4_K"]
    assert out.stat().st_size > 0.25 * total  # 4.5 bits of 16: the whole model was written
    assert grown < 1.0e9, grown / 1e6

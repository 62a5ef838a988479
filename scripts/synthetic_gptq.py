"""Write a synthetic GPTQ llama checkpoint of any size, sharded, for benchmarks and memory tests.

The codes are random and the scales plausible; the tokenizer and the rest of the config come from the
bundled tiny example, so the result converts to a GGUF that llama.cpp could load. Tensors are written
shard by shard, so making a multi-GB model needs about one shard of memory.

    python scripts/synthetic_gptq.py OUT --hidden 4096 --intermediate 11008 --layers 4 --shard-mb 512
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tiny-llama-gptq-4bit"
V1_SYM_ZERO_WORD = {4: 0x77777777, 8: 0x7F7F7F7F}  # v1 stores z - 1 in every field


def _module_tensors(gen, out_f, in_f, bits, group):
    n_groups = in_f // group
    qweight = torch.randint(-(2**31), 2**31 - 1, (in_f * bits // 32, out_f), dtype=torch.int32, generator=gen)
    scales = (torch.rand((n_groups, out_f), generator=gen) * 0.01 + 0.001).to(torch.float16)
    word = V1_SYM_ZERO_WORD[bits]
    qzeros = torch.full((n_groups, out_f * bits // 32), word - 2**32 if word >= 2**31 else word, dtype=torch.int32)
    g_idx = (torch.arange(in_f) // group).to(torch.int32)
    return {"qweight": qweight, "scales": scales, "qzeros": qzeros, "g_idx": g_idx}


def make_synthetic_gptq(out: Path, hidden: int = 1024, intermediate: int = 2816, layers: int = 8,
                        heads: int = 8, kv_heads: int = 8, bits: int = 4, group: int = 128,
                        shard_mb: float = 64, seed: int = 0) -> dict:
    """Write the checkpoint; returns {"shards": [...], "largest_shard_bytes": n, "bf16_bytes": n}."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    example = json.loads((EXAMPLE / "config.json").read_text())
    vocab = example["vocab_size"]
    shapes = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (hidden * kv_heads // heads, hidden),
              "self_attn.v_proj": (hidden * kv_heads // heads, hidden), "self_attn.o_proj": (hidden, hidden),
              "mlp.gate_proj": (intermediate, hidden), "mlp.up_proj": (intermediate, hidden),
              "mlp.down_proj": (hidden, intermediate)}
    shard_limit = int(shard_mb * 1024 * 1024)
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    weight_map: dict[str, str] = {}
    bf16_bytes = 0
    written: list[str] = []

    def flush():
        if not shards[-1]:
            return
        name = f"shard-{len(written) + 1:05d}.safetensors"
        save_file(shards[-1], str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shards[-1]})
        written.append(name)
        shards[-1] = {}
        sizes.append(0)

    def add(name, tensor):
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and sizes[-1] + nbytes > shard_limit:
            flush()
        shards[-1][name] = tensor
        sizes[-1] += nbytes

    add("model.embed_tokens.weight", (torch.randn((vocab, hidden), generator=gen) * 0.02).to(torch.float16))
    for i in range(layers):
        prefix = f"model.layers.{i}"
        add(f"{prefix}.input_layernorm.weight", torch.ones(hidden, dtype=torch.float16))
        add(f"{prefix}.post_attention_layernorm.weight", torch.ones(hidden, dtype=torch.float16))
        for module, (out_f, in_f) in shapes.items():
            for part, t in _module_tensors(gen, out_f, in_f, bits, group).items():
                add(f"{prefix}.{module}.{part}", t)
            bf16_bytes += out_f * in_f * 2
    add("model.norm.weight", torch.ones(hidden, dtype=torch.float16))
    add("lm_head.weight", (torch.randn((vocab, hidden), generator=gen) * 0.02).to(torch.float16))
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    config = {k: v for k, v in example.items() if k != "quantization_config"}
    config.update(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads)
    config["quantization_config"] = {"bits": bits, "group_size": group, "desc_act": False, "sym": True,
                                     "lm_head": False, "quant_method": "gptq", "method": "gptq",
                                     "checkpoint_format": "gptq", "format": "gptq", "pack_dtype": "int32"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (EXAMPLE / f).exists():
            shutil.copy(EXAMPLE / f, out / f)
    paths = [out / n for n in written]
    return {"shards": paths, "largest_shard_bytes": max(p.stat().st_size for p in paths), "bf16_bytes": bf16_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--bits", type=int, default=4, choices=(4, 8))
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--shard-mb", type=float, default=64)
    args = ap.parse_args()
    info = make_synthetic_gptq(args.out, args.hidden, args.intermediate, args.layers, bits=args.bits,
                               group=args.group, shard_mb=args.shard_mb)
    print(f"{len(info['shards'])} shards, largest {info['largest_shard_bytes'] / 1e6:.1f} MB, "
          f"{info['bf16_bytes'] / 1e9:.2f} GB of bf16-equivalent weights -> {args.out}")


if __name__ == "__main__":
    main()

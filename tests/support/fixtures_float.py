"""Float-quantized checkpoints built offline from the tiny dense models of fixtures.py / fixtures_archs.py.

FP8 (transformers' FineGrainedFP8 layout, `quant_method: fp8`: DeepSeek-V3, Kimi-K2, Qwen3-FP8):
- rule "transformers": transformers 5.24's own quantizer, integrations/finegrained_fp8.py Fp8Quantize (the op
  that writes FP8 checkpoints: amax per [rows, columns] tile, scale 448 / amax, weight_scale_inv = 1 / scale,
  values clamped and cast to float8_e4m3fn), which quantizes only weights whose shape tiles exactly;
- rule "deepseek": the same per-block rule over ceil-divided blocks, the edge blocks partial, as DeepSeek-V3's
  real checkpoints have them (kv_a_proj_with_mqa: 576 rows in 128-row blocks); transformers cannot load those on
  CPU (its Fp8Dequantize needs whole blocks), so their oracle is gptqmodel 7.6's dequantize_model
  (utils/model_dequant.py convert_fp8_shard, which expands padded block scales).
The linears quantized are DeepSeek's: every `*_proj.weight` of the decoder layers (attention, MLP, experts,
shared experts); the router (`mlp.gate.weight`), embeddings, norms and lm_head stay as they are.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FP8_MAX = 448.0  # float8_e4m3fn's largest value
_QUANTIZED = re.compile(r"^model\.layers\.\d+\..*_proj\.weight$")


def _fp8_tile_transformers(name: str, w: torch.Tensor, block: tuple[int, int],
                           scale_fmt: str | None = None) -> dict[str, torch.Tensor]:
    """transformers' Fp8Quantize._quantize_one itself, on one weight (untileable shapes come back unchanged);
    scale_fmt "ue8m0": weight_scale_inv rounded up to a power of two and stored as float8_e8m0fnu, as
    DeepSeek-V3.1 ships them."""
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    qc = SimpleNamespace(weight_block_size=block, scale_fmt=scale_fmt)
    return Fp8Quantize(SimpleNamespace(quantization_config=qc))._quantize_one(name, w)


def _fp8_ceil_blocks(name: str, w: torch.Tensor, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The same rule over ceil-divided blocks (zero-padded to whole blocks for the amax, then cropped)."""
    rows, cols = w.shape
    bh, bw = block
    nr, nc = -(-rows // bh), -(-cols // bw)
    x = torch.zeros(nr * bh, nc * bw, dtype=torch.float32)
    x[:rows, :cols] = w.to(torch.float32)
    tiles = x.view(nr, bh, nc, bw)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, FP8_MAX / torch.where(amax > 0, amax, torch.ones_like(amax)), torch.ones_like(amax))
    inv = (1.0 / scale).to(torch.float32)
    q = torch.clamp(tiles * scale[:, None, :, None], -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.view(nr * bh, nc * bw)[:rows, :cols].contiguous()
    return {name: q, name.rsplit(".", 1)[0] + ".weight_scale_inv": inv}


def fp8_checkpoint(src: Path, out: Path, block: tuple[int, int] = (128, 128), rule: str = "deepseek",
                   max_shard_bytes: int | None = None) -> Path:
    """An FP8 copy of the dense checkpoint folder `src` in `out` (rule "transformers" or "deepseek", see the
    module docstring), in shards of at most `max_shard_bytes` (one file when None) with an index."""
    src, out = Path(src), Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    quantize = {"transformers": _fp8_tile_transformers, "deepseek": _fp8_ceil_blocks,
                "transformers-ue8m0": lambda n, w, b: _fp8_tile_transformers(n, w, b, "ue8m0")}[rule]
    tensors: dict[str, torch.Tensor] = {}
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"] \
        if (src / "model.safetensors.index.json").exists() else None
    files = sorted(set(index.values())) if index else ["model.safetensors"]
    for f in files:
        with safe_open(str(src / f), "pt") as st:
            for name in st.keys():
                w = st.get_tensor(name)
                if _QUANTIZED.match(name) and w.dim() == 2:
                    tensors.update(quantize(name, w.to(torch.bfloat16), block))
                else:
                    tensors[name] = w.to(torch.bfloat16) if w.is_floating_point() else w
    _save_sharded(tensors, out, max_shard_bytes)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    if rule.endswith("ue8m0"):
        cfg["quantization_config"]["scale_fmt"] = "ue8m0"
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for side in src.iterdir():
        if side.suffix in (".json", ".txt", ".model") and side.name not in ("config.json",
                                                                             "model.safetensors.index.json"):
            shutil.copy2(side, out / side.name)
    return out


def _save_sharded(tensors: dict[str, torch.Tensor], out: Path, max_shard_bytes: int | None) -> None:
    if not max_shard_bytes:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    n = len(shards)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=2) + "\n")


def transformers_fp8_weights(path: Path) -> dict[str, torch.Tensor]:
    """transformers 5.24 loading the FP8 checkpoint on CPU (it dequantizes: Fp8Dequantize, bf16): every
    quantized linear's weight by its checkpoint name."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path))
    return {f"{n}.weight": m.weight.detach() for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and ".layers." in n}


def gptqmodel_fp8_weights(path: Path) -> dict[str, torch.Tensor]:
    """gptqmodel 7.6's offline FP8 dequantization of every shard (utils/model_dequant.py convert_fp8_shard,
    float32 output): the quantized weights by name."""
    from gptqmodel.utils.model_dequant import convert_fp8_shard, resolve_block_size

    cfg = json.loads((Path(path) / "config.json").read_text())
    block = resolve_block_size(cfg)
    found = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as reader:
            keys = [k for k in reader.keys() if k.endswith(".weight_scale_inv")]
            out = convert_fp8_shard(reader, torch.float32, block_shape=block)
        for k in keys:
            found[k[: -len("_scale_inv")]] = out[k[: -len("_scale_inv")]]
    return found


def deepseek_v3_fp8_shapes(hidden: int = 1024, inter: int = 2048, moe_inter: int = 512, experts: int = 32,
                           layers: int = 3, heads: int = 8, q_lora: int = 512, kv_lora: int = 256, nope: int = 128,
                           rope: int = 64, v: int = 128, vocab: int = 512) -> tuple[dict, list]:
    """(config.json, [(tensor name, shape, quantized?)]) of a DeepSeek-V3-shaped model: MLA with a q LoRA, the
    first layer dense, the rest MoE with a shared expert, named as DeepSeek-V3's checkpoints name them."""
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": hidden,
           "intermediate_size": inter, "moe_intermediate_size": moe_inter, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": heads, "n_routed_experts": experts,
           "num_experts_per_tok": 4, "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
           "routed_scaling_factor": 2.5, "norm_topk_prob": True, "q_lora_rank": q_lora, "kv_lora_rank": kv_lora,
           "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": v, "vocab_size": vocab,
           "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_interleave": True, "scoring_func": "sigmoid",
           "topk_method": "noaux_tc", "num_nextn_predict_layers": 0, "tie_word_embeddings": False, "bos_token_id": 1,
           "eos_token_id": 0, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
           "torch_dtype": "bfloat16"}
    t = [("model.embed_tokens.weight", (vocab, hidden), False)]
    for i in range(layers):
        p = f"model.layers.{i}."
        t += [(p + "input_layernorm.weight", (hidden,), False), (p + "post_attention_layernorm.weight", (hidden,), False),
              (p + "self_attn.q_a_proj.weight", (q_lora, hidden), True),
              (p + "self_attn.q_a_layernorm.weight", (q_lora,), False),
              (p + "self_attn.q_b_proj.weight", (heads * (nope + rope), q_lora), True),
              (p + "self_attn.kv_a_proj_with_mqa.weight", (kv_lora + rope, hidden), True),
              (p + "self_attn.kv_a_layernorm.weight", (kv_lora,), False),
              (p + "self_attn.kv_b_proj.weight", (heads * (nope + v), kv_lora), True),
              (p + "self_attn.o_proj.weight", (hidden, heads * v), True)]
        mlps = [("mlp.", inter)] if i == 0 else \
            [(f"mlp.experts.{e}.", moe_inter) for e in range(experts)] + [("mlp.shared_experts.", moe_inter)]
        if i > 0:
            t += [(p + "mlp.gate.weight", (experts, hidden), False), (p + "mlp.gate.e_score_correction_bias", (experts,),
                                                                         False)]
        for head, width in mlps:
            t += [(p + head + "gate_proj.weight", (width, hidden), True), (p + head + "up_proj.weight", (width, hidden), True),
                  (p + head + "down_proj.weight", (hidden, width), True)]
    t += [("model.norm.weight", (hidden,), False), ("lm_head.weight", (vocab, hidden), False)]
    return cfg, t


def write_random_fp8_model(out: Path, cfg: dict, tensors: list, max_shard_bytes: int, block=(128, 128),
                           seed: int = 0) -> Path:
    """A DeepSeek-style FP8 checkpoint of random weights written shard by shard (at most one shard in memory):
    quantized linears as e4m3 codes with a float32 weight_scale_inv per ceil-divided block (_fp8_ceil_blocks),
    the rest bf16 (norms 1, the correction bias float32)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    weight_map, files, size = {}, [], 0

    def flush():
        nonlocal shard, size
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            files.append(name)
            weight_map.update({k: name for k in shard})
            shard, size = {}, 0

    for name, shape, quantized in tensors:
        if quantized:
            w = torch.randn(shape, generator=gen) / float(shape[1]) ** 0.5
            parts = _fp8_ceil_blocks(name, w, block)
        elif name.endswith("norm.weight"):
            parts = {name: torch.ones(shape, dtype=torch.bfloat16)}
        elif name.endswith("correction_bias"):
            parts = {name: torch.zeros(shape, dtype=torch.float32)}
        else:
            parts = {name: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)}
        nbytes = sum(p.numel() * p.element_size() for p in parts.values())
        if size + nbytes > max_shard_bytes:
            flush()
        shard.update(parts)
        size += nbytes
    flush()
    n = len(files)
    renamed = {f: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, f in enumerate(files)}
    for old, new in renamed.items():
        (out / old).rename(out / new)
    index = {"metadata": {}, "weight_map": {k: renamed[v] for k, v in weight_map.items()}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    cfg = dict(cfg, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": list(block)})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out

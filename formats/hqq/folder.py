"""What both HQQ containers (transformers safetensors, hqq's qmodel.pt) share about the checkpoint folder: its
quantization_config, the completeness check of the decoder layers, the side files and the description."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from ...converters.errors import BadInput
from ..common.checkpoint import SIDE_FILES
from .layer import HqqLayer


# model types whose every decoder layer has these modules (transformers' Llama, Mistral, Qwen2, Qwen3): a
# checkpoint of one of them without one would convert into a model without it
_COMPLETE_CHECKED = frozenset({"llama", "mistral", "qwen2", "qwen3"})


_PER_LAYER = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
              "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def check_complete(config: dict, names: set[str], where: Path) -> None:
    """Every module config.json's model needs is there (`names`: `<module>.weight` of dense tensors and
    HQQ layers alike); checked only for the model types listed above."""
    from ...converters.validate import ConfigView

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in _COMPLETE_CHECKED or "num_hidden_layers" not in config:
        return
    view = ConfigView(config, where.parent / "config.json" if where.is_file() else where / "config.json")
    layers = view.int("num_hidden_layers", lo=1, hi=1 << 16)
    want = ["model.embed_tokens.weight", "model.norm.weight"]
    if not view.bool("tie_word_embeddings", default=False):
        want.append("lm_head.weight")
    want += [f"model.layers.{i}.{m}.weight" for i in range(layers) for m in _PER_LAYER]
    missing = [n for n in want if n not in names]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise BadInput(f"{len(missing)} module(s) the model needs (config.json: {layers} layers) are missing: "
                       f"{', '.join(missing[:3])}{more}", path=where, tensor=missing[0])


def folder_side_files(path: Path) -> dict[str, Path]:
    return {n: path / n for n in SIDE_FILES if (path / n).exists()}


def describe_checkpoint(fmt: str, container: str, layers: dict[str, HqqLayer], extra: dict) -> dict:
    schemes = Counter(f"{l.nbits_stored}-bit g{l.group_size} axis {l.axis} {l.packing} compute "
                      f"{str(l.compute_dtype)[6:]}{' view_as_float' if l.view_as_float else ''}"
                      for l in layers.values())
    return {"format": fmt, "container": container, "quantized_modules": len(layers), "schemes": dict(schemes),
            "layout": "W = (q - zero) * scale per group; axis 1: reshape(-1, gs) rows, axis 0: reshape(gs, -1) "
                      "columns; codes packed along dim 0 in slabs", **extra}


def quantization_config(cfg: dict, where: Path) -> dict:
    """config.json's quantization_config ({} when absent or empty); anything but an object is bad input."""
    if not cfg.get("quantization_config"):
        return {}
    from ...converters.validate import ConfigView

    return dict(ConfigView(cfg, where).view("quantization_config").data)

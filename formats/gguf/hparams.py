"""A model's hyper-parameters as llama.cpp's converter reads them from config.json: the rope settings of either
config layout (transformers < 5: `rope_theta` + `rope_scaling`; >= 5: `rope_parameters`), the head size, the
rope factor tables, and the sanity bounds every reader applies before any arithmetic. Shared by the
architecture entries (archs/), the metadata writer (metadata.py) and the reader (config.py); imports none of
them."""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from ...converters.errors import BadInput

DEFAULT_ROPE_THETA = 10000.0
DEFAULT_RMS_EPS = 1e-6
# sanity bounds on hyper-parameters before any arithmetic (the tensors decide the exact values)
MAX_WIDTH = 1 << 20  # hidden / ffn / head sizes
MAX_HEADS = 1 << 14
MAX_VOCAB = 1 << 24
FLOAT32_MAX = 3.4028234663852886e38  # GGUF stores rope and norm settings as FLOAT32


def require(config: Mapping, key: str) -> Any:
    value = config.get(key)
    if value is None:
        raise BadInput(f"config.json lacks {key}, which GGUF needs")
    return value


def rope_parameters(config: Mapping, layer_type: str = "full_attention") -> dict:
    """Rope settings as one dict: ``rope_theta`` (always present), ``rope_type`` ("default",
    "linear", "yarn", "llama3", "dynamic", ...) and the scaling fields (``factor``,
    ``original_max_position_embeddings``, ``low_freq_factor``, ...), from either config layout.
    ``layer_type``: which layers' settings, for models whose local and global layers rotate differently
    (Gemma 3: "sliding_attention" has its own base, transformers 4 called it ``rope_local_base_freq``)."""
    out: dict = {}
    params = config.get("rope_parameters")
    if isinstance(params, Mapping):
        # transformers 5: one dict (a dict of dicts keyed by layer type for hybrid models)
        # (gptqmodel's save of Gemma 4 leaves stray top-level rope_theta / rope_type beside the layer types' dicts:
        # transformers reads only the layer type's dict, so the dicts decide whenever there are any)
        nested = {k: v for k, v in params.items() if isinstance(v, Mapping)}
        # (DeepSeek-V4 keys them "main" and "compress", the compressed KV's own base, which transformers 5.24
        # saves first: the main attention's is the model's)
        if nested:
            params = nested.get(layer_type) or nested.get("full_attention") or nested.get("main") \
                or next(iter(nested.values()))
        out.update(params)
    if layer_type == "sliding_attention" and "rope_theta" not in out and config.get("rope_local_base_freq"):
        out["rope_theta"] = config["rope_local_base_freq"]
    scaling = config.get("rope_scaling")
    if isinstance(scaling, Mapping):
        for k, v in scaling.items():
            out.setdefault(k, v)
    if "rope_type" not in out and "type" in out:
        out["rope_type"] = out["type"]
    out.pop("type", None)
    if out.get("rope_theta") is None:
        out["rope_theta"] = config.get("rope_theta", DEFAULT_ROPE_THETA)
    out["rope_type"] = str(out.get("rope_type") or "default").lower()
    # transformers stores llama3's original context inside the rope dict; older configs had it top level
    if "original_max_position_embeddings" not in out and config.get("original_max_position_embeddings"):
        out["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    return out


def rope_freqs_tensor(config: Mapping) -> np.ndarray | None:
    """float32 ``[head_dim // 2]`` factors for the ``rope_freqs.weight`` tensor when the config uses
    llama-3 style rope scaling (``rope_type == "llama3"``), else ``None``.

    llama.cpp rotates pair i by ``pos * theta_i / factor_i``; transformers uses
    ``pos * inv_freq_llama_i``, hence ``factor_i = inv_freq_i / inv_freq_llama_i``.
    """
    rp = rope_parameters(config)
    if rp["rope_type"] != "llama3":
        return None
    hd = head_dim(config)
    base = float(rp["rope_theta"])
    factor = float(rp.get("factor", 8.0))
    low = float(rp.get("low_freq_factor", 1.0))
    high = float(rp.get("high_freq_factor", 4.0))
    old_ctx = float(rp.get("original_max_position_embeddings", 8192))
    inv_freq = 1.0 / (base ** (np.arange(0, hd, 2, dtype=np.int64).astype(np.float64) / hd))
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    factors = []
    for f in inv_freq:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1.0 / ((1.0 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def phi3_rope_dims(config: Mapping) -> int:
    """The dimensions Phi-3 rotates per head: partial_rotary_factor of hidden / heads (as llama.cpp's converter)."""
    rp = rope_parameters(config)
    rot = float(rp.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) or 1.0)
    return int(rot * int(config["hidden_size"])) // int(config["num_attention_heads"])


def longrope_attn_factor(config: Mapping) -> float:
    """Phi-3's long-context attention scale, sqrt(1 + ln(scale) / ln(original context)) with scale the
    context over the original (transformers' longrope default; llama.cpp's converter writes the same)."""
    rp = rope_parameters(config)
    orig = float(rp.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
                 or config["max_position_embeddings"])
    scale = float(config["max_position_embeddings"]) / orig
    return math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0


def head_dim(config: Mapping) -> int:
    """Attention head dimension: ``head_dim`` if set, else hidden_size // num_attention_heads."""
    hd = config.get("head_dim")
    if hd:
        return int(hd)
    try:
        return int(config["hidden_size"]) // int(config["num_attention_heads"])
    except KeyError as e:
        raise BadInput(f"config.json lacks {e.args[0]}") from None

"""EXAONE 4 (Exaone4ForCausalLM) as llama.cpp's `exaone4`: post-norms only (post_attention_norm, post_ffw_norm),
per-head q/k RMSNorm, NEOX rope (no q/k permutation).

Sliding windows: llama.cpp's exaone4 has local layers only in a 64-layer model (the 32B; load_arch_hparams
sets its window 4096 and pattern 4 unless the file says otherwise); every other size attends fully and rotates
in every layer, which is what transformers does with sliding_window null (the 1.2B). The converter writes the
window and a per-layer pattern (from layer_types, or the config's sliding_window_pattern) whenever the config
has a window; a config whose layers llama.cpp will not run as it asks is warned about (caveats).
"""

from __future__ import annotations

from typing import Mapping

import gguf

from ....converters.errors import BadInput
from .base import GgufArch, register_arch

EXAONE4_BLOCK = ("post_attention_layernorm", "post_feedforward_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                 "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj")
# the only depth llama.cpp's exaone4 gives sliding-window layers (load_arch_hparams: n_layer == 64)
SWA_LAYERS = 64


def exaone4_sliding(config: Mapping) -> list[bool] | None:
    """Which layers slide, as the converter reads the config (layer_types, else sliding_window_pattern as a
    string such as "LLLG" or a period); None when it has no window or no pattern."""
    if config.get("sliding_window") is None:
        return None
    n = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if isinstance(types, list):
        return [t == "sliding_attention" for t in types]
    pattern = config.get("sliding_window_pattern")
    if isinstance(pattern, str) and pattern:
        return [pattern[i % len(pattern)] == "L" for i in range(n)]
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        return [(i + 1) % pattern != 0 for i in range(n)]
    return None


def _exaone4_extra(writer: gguf.GGUFWriter, config: Mapping) -> None:
    if config.get("vocab_size") is not None:
        writer.add_vocab_size(int(config["vocab_size"]))
    params = config.get("rope_parameters")
    local = params.get("sliding_attention") if isinstance(params, Mapping) else None
    if isinstance(local, Mapping) and local.get("rope_theta") is not None:
        writer.add_rope_freq_base_swa(float(local["rope_theta"]))
    if config.get("sliding_window") is not None:
        writer.add_sliding_window(int(config["sliding_window"]))
        flags = exaone4_sliding(config)
        if flags is not None and len(flags) == int(config["num_hidden_layers"]):
            writer.add_sliding_window_pattern(flags)


def _exaone4_caveats(config: Mapping) -> list[str]:
    n = config.get("num_hidden_layers")
    flags = exaone4_sliding(config) or []
    if n != SWA_LAYERS and any(flags):
        return [f"layer_types has sliding_attention layers, but llama.cpp's exaone4 has sliding windows only in "
                f"{SWA_LAYERS}-layer models: every layer attends fully, with rope"]
    if n == SWA_LAYERS and config.get("sliding_window") is None:
        return ["sliding_window is null, but llama.cpp's exaone4 gives a 64-layer model a window of 4096 on 3 of "
                "every 4 layers"]
    return []


def _exaone4_config(cfg: dict, get, names, cv) -> None:
    n = cfg["num_hidden_layers"]
    window = get("attention.sliding_window", lo=0)
    cfg["pad_token_id"] = None  # the GGUF's padding token, if any, replaces it
    if not window and n != SWA_LAYERS:
        cfg.update(sliding_window=None, sliding_window_pattern=0, layer_types=["full_attention"] * n)
        return
    key = "exaone4.attention.sliding_window_pattern"
    flags = cv.get(key)
    if isinstance(flags, list):
        if len(flags) != n or not all(isinstance(f, bool) for f in flags):
            raise BadInput(f"metadata {key} is not {n} booleans (one per layer)", path=cv.path)
    else:  # a period p (load_swa_pattern; exaone4's default 4): layer i slides unless i % p == p - 1
        period = get("attention.sliding_window_pattern", 4, lo=0, hi=n)
        flags = [period == 0 or i % period < period - 1 for i in range(n)]
    if n != SWA_LAYERS:  # llama.cpp ignores the window and pattern below 64 layers
        flags = [False] * n
    cfg.update(sliding_window=window or 4096, layer_types=["sliding_attention" if f else "full_attention" for f in flags])
    local = get("rope.freq_base_swa", kind="float", lo=1e-30)
    if local is not None and local != cfg["rope_theta"]:
        theta = cfg.pop("rope_theta")
        cfg["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": theta},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": local}}


register_arch(GgufArch("exaone4", ("Exaone4ForCausalLM",), ("exaone4",), "Exaone4ForCausalLM", "exaone4",
                       extra_metadata=_exaone4_extra, norms=("post_attention_norm", "post_ffw_norm"),
                       block_extra=("attn_q_norm", "attn_k_norm"), caveats=_exaone4_caveats,
                       hf_block=EXAONE4_BLOCK, config_from_gguf=_exaone4_config))

"""OLMo 2 and OLMo 3 (Olmo2ForCausalLM, Olmo3ForCausalLM): llama.cpp runs both as `olmo2`, as its converter
writes them (conversion/olmo.py registers both classes under MODEL_ARCH.OLMO2; gguf-py has no olmo3).

The block has no pre-norms: RMSNorm after attention and after the MLP (post_attention_norm, post_ffw_norm),
and q/k RMSNorm over the whole projection (attn_q_norm is n_head * head_dim wide, attn_k_norm n_kv_head *
head_dim). Rope is NEOX (no q/k permutation). OLMo 3 adds sliding-window layers: the window
(attention.sliding_window) and a per-layer pattern (attention.sliding_window_pattern, true = sliding, from
layer_types) that llama.cpp's olmo2 reads (load_swa_pattern); OLMo 2 writes neither, and a GGUF without a
window reads back as OLMo 2.
"""

from __future__ import annotations

from typing import Mapping

import gguf

from .base import GgufArch, register_arch
from ....converters.errors import BadInput

OLMO2_BLOCK = ("post_attention_layernorm", "post_feedforward_layernorm", "self_attn.q_proj", "self_attn.k_proj",
               "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


def olmo3_layer_types(config: Mapping) -> list[str]:
    """OLMo 3's layer types: the config's, else its default (every 4th layer full, the rest sliding), as
    llama.cpp's converter assumes without layer_types."""
    n = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if isinstance(types, list) and len(types) == n:
        return [str(t) for t in types]
    return ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n)]


def _olmo2_extra(writer: gguf.GGUFWriter, config: Mapping) -> None:
    # the local layers' rope base, when the config keeps one per layer type (transformers 5's OLMo 3 does)
    params = config.get("rope_parameters")
    local = params.get("sliding_attention") if isinstance(params, Mapping) else None
    if isinstance(local, Mapping) and local.get("rope_theta") is not None:
        writer.add_rope_freq_base_swa(float(local["rope_theta"]))
    if config.get("sliding_window") is not None:  # OLMo 3 (Olmo2Config has no window)
        writer.add_sliding_window(int(config["sliding_window"]))
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in olmo3_layer_types(config)])


def _olmo2_config(cfg: dict, get, names, cv) -> None:
    window = get("attention.sliding_window", lo=0)
    cfg["attention_bias"] = False
    cfg["pad_token_id"] = None  # the GGUF's padding token, if any, replaces it; else not OLMo's default 1
    if not window:
        return
    n = cfg["num_hidden_layers"]
    key = "olmo2.attention.sliding_window_pattern"  # llama.cpp reads a per-layer array or a period
    flags = cv.get(key)
    if isinstance(flags, list):
        if len(flags) != n or not all(isinstance(f, bool) for f in flags):
            raise BadInput(f"metadata {key} is not {n} booleans (one per layer)", path=cv.path)
    else:  # a period p: layer i slides unless i % p == p - 1 (load_swa_pattern; olmo2's default p is 4)
        period = get("attention.sliding_window_pattern", 4, lo=0, hi=n)
        flags = [period == 0 or i % period < period - 1 for i in range(n)]
    pattern = flags
    cfg.update(architectures=["Olmo3ForCausalLM"], model_type="olmo3", sliding_window=window,
               layer_types=["sliding_attention" if p else "full_attention" for p in pattern])
    local = get("rope.freq_base_swa", kind="float", lo=1e-30)
    if local is not None and local != cfg["rope_theta"]:
        theta = cfg.pop("rope_theta")
        cfg["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": theta},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": local}}


register_arch(GgufArch("olmo2", ("Olmo2ForCausalLM", "Olmo3ForCausalLM"), ("olmo2", "olmo3"), "Olmo2ForCausalLM",
                       "olmo2", extra_metadata=_olmo2_extra, norms=("post_attention_norm", "post_ffw_norm"),
                       block_extra=("attn_q_norm", "attn_k_norm"), qk_norm_whole=True, hf_block=OLMO2_BLOCK,
                       config_from_gguf=_olmo2_config))

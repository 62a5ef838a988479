"""Phi-3 / Phi-4: fused qkv and gate_up projections, partial rotary dimensions and longrope factor tables."""

from __future__ import annotations

from typing import Mapping

import gguf

from .base import GgufArch, register_arch
from ..hparams import MAX_WIDTH, longrope_attn_factor, rope_parameters


PHI3_BLOCK = ("input_layernorm", "post_attention_layernorm", "self_attn.qkv_proj", "self_attn.o_proj",
              "mlp.gate_up_proj", "mlp.down_proj")


def _phi3_extra(writer: gguf.GGUFWriter, config: Mapping) -> None:
    rp = rope_parameters(config)
    n_embd, n_head = int(config["hidden_size"]), int(config["num_attention_heads"])
    rot = float(rp.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) or 1.0)
    writer.add_rope_dimension_count(int(rot * n_embd) // n_head)
    orig = rp.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
    writer.add_rope_scaling_orig_ctx_len(int(orig or config["max_position_embeddings"]))
    # Phi-4 has no sliding window; llama.cpp tells the two apart by a zero here
    writer.add_sliding_window(int(config.get("sliding_window") or 0))
    if rp.get("rope_type") in ("longrope", "su"):  # the factor tables are tensors (metadata.rope_tensors)
        writer.add_rope_scaling_attn_factors(longrope_attn_factor(config))


def _phi3_config(cfg: dict, get, names, cv) -> None:
    rope_dims = get("rope.dimension_count", lo=1, hi=MAX_WIDTH)
    if rope_dims is not None and rope_dims != cfg["head_dim"]:
        cfg["partial_rotary_factor"] = rope_dims / cfg["head_dim"]
    cfg["original_max_position_embeddings"] = get("rope.scaling.original_context_length",
                                                  cfg["max_position_embeddings"], lo=1)
    window = get("attention.sliding_window", 0, lo=0)
    cfg["sliding_window"] = window or None  # zero: Phi-4, no window
    cfg.setdefault("pad_token_id", None)


register_arch(GgufArch("phi3", ("Phi3ForCausalLM",), ("phi3",), "Phi3ForCausalLM", "phi3", extra_metadata=_phi3_extra,
                       attention=("attn_qkv", "attn_output"), dense_ffn=("ffn_up", "ffn_down"), hf_block=PHI3_BLOCK,
                       config_from_gguf=_phi3_config,
                       # llama.cpp's phi3 holds Phi-3's long/short factor tables (metadata.rope_tensors)
                       extra_rope_types=("longrope", "su")))

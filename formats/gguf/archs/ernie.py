"""ERNIE 4.5 MoE (Ernie4_5_MoeForCausalLM) as llama.cpp's `ernie4_5-moe`: dense lead layers
(moe_layer_start_index, leading_dense_block_count), then a routed layer every moe_layer_interval
(interleave_moe_layer_step): softmax scores with the correction bias moe_statics.e_score_correction_bias
(exp_probs_b, stored [1, experts] as HF has it) beside moe_num_shared_experts shared experts.

Keys as llama.cpp's converter writes them, including the shared experts' width, which it takes as
intermediate_size // num_key_value_heads (equal to moe_intermediate_size * moe_num_shared_experts in the released
21B-A3B: 12288 // 4 = 1536 * 2); a config where the two differ is warned about. The multi-token-prediction
block (model.mtp_*) is dropped as the converter drops it. ERNIE ships a SentencePiece tokenizer.model.
"""

from __future__ import annotations

import re
from typing import Mapping

import gguf

from .base import HF_DENSE_BLOCK, GgufArch, register_arch
from .mtp import skipped
from ..hparams import MAX_WIDTH

ERNIE_MOE_BLOCK = HF_DENSE_BLOCK + ("mlp.gate", "mlp.moe_statics.e_score_correction", "mlp.experts.gate_proj",
                                    "mlp.experts.up_proj", "mlp.experts.down_proj", "mlp.shared_experts.gate_proj",
                                    "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj")
# ERNIE's multi-token-prediction tensors (outside model.layers): llama.cpp's converter skips them
MTP_TENSORS = re.compile(r"^model\.mtp_(block|emb_norm|hidden_norm|linear_proj)\.")


def _shared_width(config: Mapping) -> int | None:
    """The shared experts' width as llama.cpp's converter writes it (see the module docstring)."""
    shared = config.get("moe_num_shared_experts")
    if not shared or config.get("intermediate_size") is None or not config.get("num_key_value_heads"):
        return None
    return int(config["intermediate_size"]) // int(config["num_key_value_heads"])


def _ernie_moe_extra(writer: gguf.GGUFWriter, config: Mapping) -> None:
    writer.add_expert_count(int(config["moe_num_experts"]))
    writer.add_expert_used_count(int(config["moe_k"]))
    writer.add_interleave_moe_layer_step(int(config.get("moe_layer_interval") or 1))
    writer.add_leading_dense_block_count(int(config.get("moe_layer_start_index") or 0))
    if config.get("moe_intermediate_size") is not None:
        writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
    if config.get("moe_num_shared_experts") is not None:
        writer.add_expert_shared_count(int(config["moe_num_shared_experts"]))
        if _shared_width(config) is not None:
            writer.add_expert_shared_feed_forward_length(_shared_width(config))


def _ernie_moe_caveats(config: Mapping) -> list[str]:
    out = []
    width, shared, moe = _shared_width(config), config.get("moe_num_shared_experts"), config.get("moe_intermediate_size")
    if width is not None and moe is not None and width != int(moe) * int(shared):
        out.append(f"the shared experts are moe_intermediate_size * moe_num_shared_experts = {int(moe) * int(shared)} "
                   f"wide but llama.cpp's converter states intermediate_size // num_key_value_heads = {width} "
                   "(expert_shared_feed_forward_length), as written here")
    end = config.get("moe_layer_end_index")
    n = config.get("num_hidden_layers")
    if isinstance(end, int) and isinstance(n, int) and end not in (-1, n - 1):
        out.append(f"moe_layer_end_index {end}: llama.cpp's ernie4_5-moe routes every interleaved layer to the last")
    return out


def _ernie_moe_config(cfg: dict, get, names, cv) -> None:
    n = cfg["num_hidden_layers"]
    n_expert = get("expert_count", required=True, lo=1, hi=1 << 16)
    moe_ff = get("expert_feed_forward_length", required=True, lo=1, hi=MAX_WIDTH)
    cfg.update(moe_num_experts=n_expert, moe_k=get("expert_used_count", required=True, lo=1, hi=n_expert),
               moe_intermediate_size=moe_ff, moe_num_shared_experts=get("expert_shared_count", 0, lo=0, hi=1 << 16),
               moe_layer_start_index=get("leading_dense_block_count", 0, lo=0, hi=n),
               moe_layer_interval=get("interleave_moe_layer_step", 1, lo=1, hi=n), moe_layer_end_index=n - 1,
               use_bias=bool(names and "blk.0.attn_q.bias" in names), pad_token_id=None)


register_arch(GgufArch("ernie4_5-moe", ("Ernie4_5_MoeForCausalLM",), ("ernie4_5_moe",), "Ernie4_5_MoeForCausalLM",
                       "ernie4_5_moe", moe=True, extra_metadata=_ernie_moe_extra, caveats=_ernie_moe_caveats,
                       hf_block=ERNIE_MOE_BLOCK, config_from_gguf=_ernie_moe_config, mtp=skipped(MTP_TENSORS, "llama.cpp's converter skips ERNIE's MTP block and "
                                                                         "its ernie4_5-moe does not load it")))

"""MiniMax-M2 (MiniMaxM2ForCausalLM) as llama.cpp's `minimax-m2`: every layer routed (Mixtral's
block_sparse_moe names: experts w1/w2/w3, the router `gate`), sigmoid scores with the correction bias
(exp_probs_b) and the top-k renormalised (llama.cpp's graph hard-codes the renormalisation), no shared expert;
q/k RMSNorm over the whole projection (attn_q_norm is heads * head_dim wide); NEOX rope over `rotary_dim` of each
head (rope.dimension_count), no q/k permutation.

The experts' width is config.json's intermediate_size, written both as feed_forward_length and
expert_feed_forward_length (as the converter writes them). transformers' MiniMax-M2 always routes by sigmoid:
expert_gating_func is written sigmoid (the converter takes it from the config's scoring_func, which the released
config sets to "sigmoid").

llm-compressor saves its quantized MiniMax-M2 with each expert as its own Linear, block_sparse_moe.experts.E.
gate_proj / up_proj / down_proj: converters/model_shapes.py names them as the release's w1 / w3 / w2 for every
writer (HfArchitecture renames), so this entry and gguf-py's name map see the release's names only.
"""

from __future__ import annotations

from typing import Mapping

import gguf

from .base import GgufArch, expert_keys, moe_config, register_arch
from ..hparams import head_dim, rope_parameters

MINIMAX_M2_BLOCK = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                    "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
                    "block_sparse_moe.gate", "block_sparse_moe.e_score_correction", "block_sparse_moe.experts.w1",
                    "block_sparse_moe.experts.w2", "block_sparse_moe.experts.w3")


def rotary_dims(config: Mapping) -> int:
    """The rotated dimensions of each head: rotary_dim (the released config's), else partial_rotary_factor."""
    if config.get("rotary_dim") is not None:
        return int(config["rotary_dim"])
    rot = float(rope_parameters(config).get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    return int(head_dim(config) * rot)


def _minimax_m2_extra(writer: gguf.GGUFWriter, config: Mapping) -> None:
    expert_keys(writer, config)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_feed_forward_length(int(config["intermediate_size"]))
    writer.add_rope_dimension_count(rotary_dims(config))


def _minimax_m2_caveats(config: Mapping) -> list[str]:
    if config.get("scoring_func") not in (None, "sigmoid"):
        return [f"scoring_func {config['scoring_func']!r}: transformers' and llama.cpp's MiniMax-M2 route by sigmoid"]
    return []


def _minimax_m2_config(cfg: dict, get, names, cv) -> None:
    moe_config(cfg, get, names, cv)
    cfg.pop("moe_intermediate_size", None)  # the experts are intermediate_size wide
    rot = get("rope.dimension_count", cfg["head_dim"], lo=1, hi=cfg["head_dim"])
    cfg.update(rotary_dim=rot, scoring_func="sigmoid", pad_token_id=None)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta"),
                              "partial_rotary_factor": rot / cfg["head_dim"]}
    cfg["rope_parameters"].update(cfg.pop("rope_scaling", {}))


register_arch(GgufArch("minimax-m2", ("MiniMaxM2ForCausalLM",), ("minimax_m2",), "MiniMaxM2ForCausalLM", "minimax_m2",
                       moe=True, extra_metadata=_minimax_m2_extra, caveats=_minimax_m2_caveats,
                       block_extra=("attn_q_norm", "attn_k_norm"), qk_norm_whole=True, hf_block=MINIMAX_M2_BLOCK,
                       config_from_gguf=_minimax_m2_config))

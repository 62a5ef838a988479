"""GLM-4.5 / GLM-4.6 (Glm4MoeForCausalLM) as llama.cpp's `glm4moe`: dense lead layers (first_k_dense_replace),
then routed experts (sigmoid scores with the correction bias exp_probs_b, top-k renormalised, scaled by
routed_scaling_factor) beside shared experts; q/k/v biases, optional per-head q/k RMSNorm, NEOX rope over
partial_rotary_factor of each head (rope.dimension_count), no q/k permutation.

Multi-token prediction: the config declares num_nextn_predict_layers MTP blocks after the trunk
(model.layers.<num_hidden_layers + i>.*). llama.cpp's converter keeps them by default: block_count counts them,
nextn_predict_layers says how many, their tensors are written (a checkpoint without them, as transformers saves
one, gives the "trunk only" file llama.cpp also loads); with --no-mtp neither the keys nor the tensors. qconvert
does the same (`mtp`, archs/mtp.py).

The tokenizer: GLM's converter looks its special tokens up by name ([gMASK] bos, <|user|> eot, <|endoftext|>
unk, <|observation|> eom); qconvert writes the tokenizer as it does for every byte-level BPE.
"""

from __future__ import annotations

from typing import Mapping

import gguf

from .base import SHARED_EXPERT, GgufArch, register_arch
from .mtp import layers_after_trunk
from ..hparams import MAX_WIDTH, head_dim, rope_parameters

GLM4_MOE_BLOCK = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                  "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj",
                  "mlp.up_proj", "mlp.down_proj", "mlp.gate", "mlp.gate.e_score_correction",
                  "mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj",
                  "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj")


def nextn_layers(config: Mapping) -> int:
    """The MTP blocks the config declares after the trunk (transformers 5 also reads them as num_mtp_layers)."""
    n = config.get("num_nextn_predict_layers", config.get("num_mtp_layers"))
    return int(n or 0)


def _glm4moe_extra(writer: gguf.GGUFWriter, config: Mapping) -> None:
    rot = float(rope_parameters(config).get("partial_rotary_factor", config.get("partial_rotary_factor", 0.5)))
    writer.add_rope_dimension_count(int(head_dim(config) * rot))
    writer.add_expert_count(int(config["n_routed_experts"]))
    writer.add_expert_used_count(int(config["num_experts_per_tok"]))
    if config.get("n_group") is not None:
        writer.add_expert_group_count(int(config["n_group"]))
    if config.get("topk_group") is not None:
        writer.add_expert_group_used_count(int(config["topk_group"]))
    writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
    writer.add_expert_shared_count(int(config.get("n_shared_experts") or 0))
    if config.get("first_k_dense_replace") is not None:
        writer.add_leading_dense_block_count(int(config["first_k_dense_replace"]))
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if config.get("routed_scaling_factor") is not None:
        writer.add_expert_weights_scale(float(config["routed_scaling_factor"]))
    if config.get("norm_topk_prob") is not None:
        writer.add_expert_weights_norm(bool(config["norm_topk_prob"]))


def declared_nextn(config: Mapping) -> int | None:
    """The MTP blocks GLM's config declares, None when it names none (llama.cpp's converter then writes no
    nextn_predict_layers)."""
    if config.get("num_nextn_predict_layers", config.get("num_mtp_layers")) is None:
        return None
    return nextn_layers(config)


# the MTP block: layers after the trunk, kept unless --no-mtp (Glm4MoeModel.filter_tensors)
GLM_MTP = layers_after_trunk(kept=True, declared=declared_nextn, config_key="num_nextn_predict_layers")


def _glm4moe_caveats(config: Mapping) -> list[str]:
    if config.get("n_group") not in (None, 1) or config.get("topk_group") not in (None, 1):
        return [f"n_group {config.get('n_group')} / topk_group {config.get('topk_group')}: llama.cpp's glm4moe "
                "routes over every expert, without group pruning"]
    return []


def _glm4moe_config(cfg: dict, get, names, cv) -> None:
    nextn = cfg.get("num_nextn_predict_layers", 0)  # config_from_gguf has taken the MTP blocks off the count
    n = cfg["num_hidden_layers"]
    n_expert = get("expert_count", required=True, lo=1, hi=1 << 16)
    rope_dims = get("rope.dimension_count", cfg["head_dim"] // 2, lo=1, hi=cfg["head_dim"])
    cfg.update(n_routed_experts=n_expert,
               num_experts_per_tok=get("expert_used_count", required=True, lo=1, hi=n_expert),
               moe_intermediate_size=get("expert_feed_forward_length", required=True, lo=1, hi=MAX_WIDTH),
               n_shared_experts=get("expert_shared_count", 0, lo=0, hi=1 << 16),
               first_k_dense_replace=get("leading_dense_block_count", 0, lo=0, hi=n),
               routed_scaling_factor=get("expert_weights_scale", 1.0, kind="float"),
               norm_topk_prob=bool(cv.bool("glm4moe.expert_weights_norm", default=False)),
               n_group=get("expert_group_count", 1, lo=1), topk_group=get("expert_group_used_count", 1, lo=1),
               num_nextn_predict_layers=nextn, attention_bias=bool(names and "blk.0.attn_q.bias" in names),
               use_qk_norm=bool(names and "blk.0.attn_q_norm.weight" in names), pad_token_id=None)
    rope = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta"),
            "partial_rotary_factor": rope_dims / cfg["head_dim"]}
    rope.update(cfg.pop("rope_scaling", {}))
    cfg["rope_parameters"] = rope


register_arch(GgufArch("glm4moe", ("Glm4MoeForCausalLM",), ("glm4_moe",), "Glm4MoeForCausalLM", "glm4_moe", moe=True,
                       extra_metadata=_glm4moe_extra, caveats=_glm4moe_caveats, mtp=GLM_MTP,
                       norms=("attn_norm", "post_attention_norm"), hf_block=GLM4_MOE_BLOCK,
                       # llama.cpp's glm4-moe loader: the router's score bias in every routed layer, the shared
                       # expert where the config has one
                       routed_extra=("exp_probs_b.bias",) + SHARED_EXPERT, shared_experts_key="n_shared_experts",
                       config_from_gguf=_glm4moe_config))

"""DeepSeek-V3 and Kimi-K2 as llama.cpp's `deepseek2`: multi-head latent attention (kv_b_proj split into the
k_b / v_b halves llama.cpp's MLA absorbs), routed and shared experts, the multi-token-prediction layer dropped."""

from __future__ import annotations

import re
from typing import Mapping

import gguf

import torch

from .base import SHARED_EXPERT, GgufArch, register_arch
from .mtp import layers_after_trunk
from ..hparams import MAX_WIDTH, rope_parameters


DEEPSEEK_BLOCK = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.q_a_proj",
                "self_attn.q_a_layernorm", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa",
                "self_attn.kv_a_layernorm", "self_attn.kv_b_proj", "self_attn.k_b_proj", "self_attn.v_b_proj",
                "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.gate",
                "mlp.gate.e_score_correction", "mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj",
                "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj")


# DeepSeek-V3's MTP layer (model.layers.<num_hidden_layers>): llama.cpp's converter skips it (DeepseekV2Model.skip_mtp)
DEEPSEEK_V3_MTP = layers_after_trunk(kept=False, dropped_because="llama.cpp's converter skips DeepSeek-V3's MTP "
                                     "layer and its deepseek2 does not load it")


def _deepseek2_extra(writer: gguf.GGUFWriter, config: Mapping) -> None:
    """DeepSeek-V2/V3 and Kimi-K2: the latent ranks, the head sizes after decompression, the dense lead
    layers, routed and shared experts and the router's rules (llama.cpp's deepseek2 loader reads these)."""
    n_layers = int(config["num_hidden_layers"])
    n_routed = config.get("n_routed_experts")
    lead = config.get("first_k_dense_replace")
    writer.add_leading_dense_block_count(int(lead if lead is not None else (0 if n_routed else n_layers)))
    writer.add_vocab_size(int(config["vocab_size"]))
    if config.get("q_lora_rank") is not None:
        writer.add_q_lora_rank(int(config["q_lora_rank"]))
    kv_lora, rope, nope, v = (int(config.get("kv_lora_rank", 512)), int(config["qk_rope_head_dim"]),
                              int(config["qk_nope_head_dim"]), int(config["v_head_dim"]))
    writer.add_kv_lora_rank(kv_lora)
    # the attention llama.cpp computes is MQA over [latent, rope] keys and latent values ...
    writer.add_key_length(kv_lora + rope)
    writer.add_value_length(kv_lora)
    # ... decompressed per head by attn_k_b / attn_v_b to the model's own head sizes
    writer.add_key_length_mla(nope + rope)
    writer.add_value_length_mla(v)
    writer.add_expert_feed_forward_length(int(config.get("moe_intermediate_size") or config["intermediate_size"]))
    if n_routed is not None:
        writer.add_expert_count(int(n_routed))
    if config.get("num_experts_per_tok") is not None:
        writer.add_expert_used_count(int(config["num_experts_per_tok"]))
    writer.add_expert_shared_count(int(config.get("n_shared_experts") or 0))
    if config.get("routed_scaling_factor") is not None:
        writer.add_expert_weights_scale(float(config["routed_scaling_factor"]))
    if config.get("norm_topk_prob"):
        writer.add_expert_weights_norm(True)
    if config.get("n_group") is not None:
        writer.add_expert_group_count(int(config["n_group"]))
    if config.get("topk_group") is not None:
        writer.add_expert_group_used_count(int(config["topk_group"]))
    # V3 routes by sigmoid scores (transformers' DeepseekV3 always does; its configs say scoring_func
    # "sigmoid"); llama.cpp assumes V2's softmax when the key is absent
    score = config.get("scoring_func") or ("sigmoid" if config.get("model_type") in ("deepseek_v3", "kimi_k2")
                                           else None)
    if score is not None:
        writer.add_expert_gating_func({"sigmoid": gguf.ExpertGatingFuncType.SIGMOID,
                                       "softmax": gguf.ExpertGatingFuncType.SOFTMAX}[score])
    writer.add_rope_dimension_count(rope)
    mscale_all = rope_parameters(config).get("mscale_all_dim")
    if mscale_all is not None:
        # llama.cpp's deepseek2 takes 0.1 * mscale_all_dim here (its converter's convention)
        writer.add_rope_scaling_yarn_log_mul(0.1 * float(mscale_all))


def _deepseek2_config(cfg: dict, get, names, cv) -> None:
    """DeepSeek-V3's config from the MLA keys: llama.cpp's key/value lengths are the latent attention's
    (kv_lora + rope, kv_lora over one KV head); the model's own head sizes are the *_mla lengths."""
    kv_lora = get("attention.kv_lora_rank", required=True, lo=1, hi=MAX_WIDTH)
    rope = get("rope.dimension_count", required=True, lo=1, hi=MAX_WIDTH)
    k_mla = get("attention.key_length_mla", required=True, lo=rope + 1, hi=MAX_WIDTH)
    cfg.pop("_value_head_dim", None)
    n_layers = cfg["num_hidden_layers"]
    n_expert = get("expert_count", lo=1, hi=1 << 16)
    cfg.update(num_key_value_heads=cfg["num_attention_heads"], head_dim=rope, qk_rope_head_dim=rope,
               qk_nope_head_dim=k_mla - rope, qk_head_dim=k_mla,
               v_head_dim=get("attention.value_length_mla", required=True, lo=1, hi=MAX_WIDTH),
               kv_lora_rank=kv_lora, q_lora_rank=get("attention.q_lora_rank", lo=1, hi=MAX_WIDTH),
               first_k_dense_replace=get("leading_dense_block_count", 0, lo=0, hi=n_layers),
               moe_intermediate_size=get("expert_feed_forward_length", required=True, lo=1, hi=MAX_WIDTH),
               n_routed_experts=n_expert,
               num_experts_per_tok=get("expert_used_count", required=n_expert is not None, lo=1, hi=n_expert or 1),
               n_shared_experts=get("expert_shared_count", 0, lo=0, hi=1 << 16),
               routed_scaling_factor=get("expert_weights_scale", 1.0, kind="float"),
               norm_topk_prob=bool(cv.bool("deepseek2.expert_weights_norm", default=False)),
               n_group=get("expert_group_count", 1, lo=1), topk_group=get("expert_group_used_count", 1, lo=1),
               rope_interleave=True, attention_bias=False, topk_method="noaux_tc")
    gating = get("expert_gating_func", lo=0, hi=3)
    cfg["scoring_func"] = "softmax" if gating == int(gguf.ExpertGatingFuncType.SOFTMAX) else "sigmoid"
    log_mul = get("rope.scaling.yarn_log_multiplier", kind="float")
    if log_mul is not None and "rope_scaling" in cfg:  # llama.cpp's deepseek2 holds 0.1 * mscale_all_dim
        cfg["rope_scaling"].update(mscale_all_dim=log_mul / 0.1, mscale=log_mul / 0.1)


# Kimi-K2 ships as DeepseekV3ForCausalLM (model_type kimi_k2). DeepSeek-V2 writes the tensors and keys
# llama.cpp's converter writes, but llama.cpp refused to load the tiny V2 built to test it (no q_lora):
# not listed until a test runs it
register_arch(GgufArch("deepseek2", ("DeepseekV3ForCausalLM",), ("deepseek_v3", "kimi_k2"), "DeepseekV3ForCausalLM",
                       "deepseek_v3", moe=True, mla=True, extra_metadata=_deepseek2_extra, mtp=DEEPSEEK_V3_MTP,
                       attention=("attn_kv_a_mqa", "attn_kv_a_norm", "attn_k_b", "attn_v_b", "attn_output"),
                       # llama.cpp's deepseek2 loader: the shared expert in every routed layer (its router bias is
                       # TENSOR_NOT_REQUIRED; V2-Lite's query has no low-rank pair)
                       routed_extra=SHARED_EXPERT, shared_experts_key="n_shared_experts",
                       hf_block=DEEPSEEK_BLOCK, config_from_gguf=_deepseek2_config))


# --------------------------------------------------------------------------------------------------
# DeepSeek's kv_b_proj: one HF tensor, two GGUF tensors
# --------------------------------------------------------------------------------------------------
_KV_B = re.compile(r"^(?P<head>.*\.self_attn\.)kv_b_proj\.weight$")
# the NativeForm (converters/records.py) a GGUF source's kv_b_proj record carries: the file's own attn_k_b /
# attn_v_b, read as any other GGUF tensor. The reader must merge them (every other target wants kv_b_proj), and
# the merge is a float32 decoding; a GGUF target takes the halves instead, so their types and bytes survive
KV_B_HALVES = "gguf-mla-halves"


def _mla_sizes(config: Mapping) -> tuple[int, int, int]:
    return int(config["num_attention_heads"]), int(config["qk_nope_head_dim"]), int(config["v_head_dim"])


def split_kv_b(kv_b, config: Mapping):
    """kv_b_proj [heads * (nope + v), kv_lora] -> (k_b [heads, kv_lora, nope], v_b [heads, v, kv_lora]):
    llama.cpp's MLA absorbs k_b into the query, so it wants each head's key rows transposed (its
    deepseek2 loader: attn_k_b {nope, kv_lora, heads}, attn_v_b {kv_lora, v, heads} in ggml order)."""
    n_head, nope, v = _mla_sizes(config)
    per_head = kv_b.reshape(n_head, nope + v, kv_b.shape[-1])
    return per_head[:, :nope].transpose(1, 2).contiguous(), per_head[:, nope:].contiguous()


def kv_b_value_rows(config: Mapping) -> torch.Tensor:
    """The output rows of kv_b_proj that v_b is made of, head by head: v_b = kv_b[rows] viewed as
    [heads, v, kv_lora]. v_b takes whole rows and leaves the input axis (kv_lora) as it is, so a grid whose
    groups run along the input is still that grid row-selected: its codes and scales can stay (the writer
    keeps v_b a grid). k_b cannot: its transpose puts kv_b's output rows along ggml's rows, and a GGUF block
    of 32 of them would need one scale where GPTQ-style grids have one per output row (k_b is dequantized)."""
    n_head, nope, v = _mla_sizes(config)
    return (torch.arange(n_head)[:, None] * (nope + v) + nope + torch.arange(v)).reshape(-1)


def merge_kv_b(k_b, v_b):
    """The inverse of :func:`split_kv_b`."""
    per_head = torch.cat([k_b.transpose(1, 2), v_b], dim=1)
    return per_head.reshape(-1, per_head.shape[-1]).contiguous()


def kv_b_parts(hf_name: str) -> tuple[str, str] | None:
    """The HF-style names of the two halves a kv_b_proj becomes (k_b_proj, v_b_proj), else None."""
    m = _KV_B.match(hf_name)
    return None if m is None else (f"{m['head']}k_b_proj.weight", f"{m['head']}v_b_proj.weight")

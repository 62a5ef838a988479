"""Qwen2, Qwen3 and their MoE variants (qwen2moe, qwen3moe)."""

from __future__ import annotations

from typing import Mapping

import gguf

from .base import HF_DENSE_BLOCK, SHARED_EXPERT, GgufArch, expert_keys, moe_config, register_arch
from ..hparams import MAX_WIDTH


QWEN_MOE_BLOCK = ("mlp.gate", "mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj",
                "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj",
                "mlp.shared_expert_gate")
# every routed layer's shared expert and its sigmoid gate, which llama.cpp's qwen2moe, qwen35moe and qwen3next loaders
# require (GgufArch.routed_extra)
QWEN_SHARED_EXPERT = ("ffn_gate_inp_shexp",) + SHARED_EXPERT


def qwen_moe_extra(writer: gguf.GGUFWriter, config: Mapping) -> None:
    expert_keys(writer, config)
    if config.get("moe_intermediate_size") is not None:
        writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
    if config.get("shared_expert_intermediate_size") is not None:
        writer.add_expert_shared_feed_forward_length(int(config["shared_expert_intermediate_size"]))


def _qwen3moe_caveats(config: Mapping) -> list[str]:
    # llama.cpp's qwen3moe graph always renormalises the chosen experts' weights (build_moe_ffn norm_w)
    if config.get("norm_topk_prob") is False:
        return ["norm_topk_prob is false but llama.cpp's qwen3moe always renormalises the top-k expert weights"]
    return []


def _qwen2moe_config(cfg: dict, get, names, cv) -> None:
    moe_config(cfg, get, names, cv)
    shared = get("expert_shared_feed_forward_length", lo=1, hi=MAX_WIDTH)
    cfg.update(num_experts=cfg["num_local_experts"], shared_expert_intermediate_size=shared or 0,
               norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=True,
               use_sliding_window=False)


def _qwen3moe_config(cfg: dict, get, names, cv) -> None:
    moe_config(cfg, get, names, cv)
    # llama.cpp's qwen3moe renormalises the top-k weights (build_moe_ffn norm_w), as Qwen3-MoE's configs ask
    cfg.update(num_experts=cfg["num_local_experts"], norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
               use_sliding_window=False, attention_bias=bool(names and "blk.0.attn_q.bias" in names))


register_arch(GgufArch("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), "Qwen2ForCausalLM", "qwen2"))
register_arch(GgufArch("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), "Qwen3ForCausalLM", "qwen3",
                       block_extra=("attn_q_norm", "attn_k_norm")))
register_arch(GgufArch("qwen2moe", ("Qwen2MoeForCausalLM",), ("qwen2_moe",), "Qwen2MoeForCausalLM", "qwen2_moe",
                       moe=True, extra_metadata=qwen_moe_extra, hf_block=HF_DENSE_BLOCK + QWEN_MOE_BLOCK,
                       routed_extra=QWEN_SHARED_EXPERT, config_from_gguf=_qwen2moe_config))
register_arch(GgufArch("qwen3moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), "Qwen3MoeForCausalLM", "qwen3_moe",
                       moe=True, extra_metadata=qwen_moe_extra, block_extra=("attn_q_norm", "attn_k_norm"),
                       caveats=_qwen3moe_caveats, hf_block=HF_DENSE_BLOCK + QWEN_MOE_BLOCK,
                       config_from_gguf=_qwen3moe_config))

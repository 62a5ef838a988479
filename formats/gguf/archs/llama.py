"""Llama, and the families llama.cpp runs as `llama`: Mistral, and Mixtral (llama with experts)."""

from __future__ import annotations

from typing import Mapping

import gguf

from .base import HF_DENSE_BLOCK, GgufArch, expert_keys, moe_config, register_arch


MIXTRAL_MOE_BLOCK = ("block_sparse_moe.gate", "block_sparse_moe.experts.w1", "block_sparse_moe.experts.w2",
                   "block_sparse_moe.experts.w3")


def _llama_extra(writer: gguf.GGUFWriter, config: Mapping) -> None:
    # Mixtral: arch llama with experts (llama.cpp reads llama.expert_count to build the MoE FFN)
    expert_keys(writer, config)


def _llama_config(cfg: dict, get, names, cv) -> None:
    if get("expert_count") is not None:  # llama with experts is Mixtral
        cfg.update(architectures=["MixtralForCausalLM"], model_type="mixtral", sliding_window=None)
        cfg.pop("attention_bias", None)
        cfg.pop("mlp_bias", None)
        moe_config(cfg, get, names, cv)


register_arch(GgufArch("llama", ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM"),
                       ("llama", "mistral", "mixtral"), "LlamaForCausalLM", "llama", permute_qk=True,
                       extra_metadata=_llama_extra, hf_block=HF_DENSE_BLOCK + MIXTRAL_MOE_BLOCK,
                       config_from_gguf=_llama_config))

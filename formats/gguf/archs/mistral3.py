"""Ministral 3 (Ministral3ForCausalLM, transformers' model_type `ministral3`): llama's blocks under its own
llama.cpp architecture `mistral3`, with YaRN and Llama-4's attention temperature.

What llama.cpp's mistral3 reads beyond llama (llama-model's mistral3 load_arch_hparams): YaRN's beta_fast /
beta_slow and `rope.scaling.yarn_log_multiplier` (the converter writes mscale_all_dim there), and
`attention.temperature_scale` (llama_4_scaling_beta): queries at position p are multiplied by
1 + beta * log(1 + floor(p / original context)), as transformers' get_llama_4_attn_scale does, with the floor's
divisor the YaRN original context (n_ctx_orig_yarn).

Its q/k rows are permuted as llama's (the converter's Mistral3 text model is a LlamaModel).
The vision tower of Mistral3ForConditionalGeneration is not this entry's: only the text model is written.
"""

from __future__ import annotations

from typing import Mapping

import gguf

from .base import GgufArch, llama_converter_keys, register_arch
from ..hparams import rope_parameters


def _mistral3_extra(writer: gguf.GGUFWriter, config: Mapping) -> None:
    llama_converter_keys(writer, config)
    rp = rope_parameters(config)
    if rp.get("mscale_all_dim") is not None:
        writer.add_rope_scaling_yarn_log_mul(float(rp["mscale_all_dim"]))
    if rp.get("llama_4_scaling_beta") is not None:
        writer.add_attn_temperature_scale(float(rp["llama_4_scaling_beta"]))


def _mistral3_caveats(config: Mapping) -> list[str]:
    # llama.cpp's YaRN takes its magnitude scale from yarn_log_multiplier (mscale_all_dim) alone; transformers
    # divides get_mscale(factor, mscale) by get_mscale(factor, mscale_all_dim), so a mscale other than 1
    # (with mscale_all_dim 0 or 1) would scale attention differently
    rp = rope_parameters(config)
    if rp.get("rope_type") == "yarn" and rp.get("mscale") not in (None, 1, 1.0):
        return [f"rope_parameters mscale {rp['mscale']} is not 1: llama.cpp's mistral3 reads only mscale_all_dim "
                "(yarn_log_multiplier)"]
    return []


def _mistral3_config(cfg: dict, get, names, cv) -> None:
    """YaRN back into rope_parameters, with the two mistral3 keys; no sliding window (llama.cpp's mistral3
    has none)."""
    rope = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
    rope.update(cfg.pop("rope_scaling", {}))
    log_mul = get("rope.scaling.yarn_log_multiplier", kind="float")
    if log_mul is not None:
        rope.update(mscale_all_dim=log_mul, mscale=1.0)
    beta = get("attention.temperature_scale", kind="float")
    if beta is not None:
        rope["llama_4_scaling_beta"] = beta
    if rope["rope_type"] == "yarn":
        rope["max_position_embeddings"] = cfg["max_position_embeddings"]
    # pad_token_id None: the GGUF's padding token, if any, replaces it; else not Ministral 3's default 11
    cfg.update(rope_parameters=rope, sliding_window=None, pad_token_id=None)


register_arch(GgufArch("mistral3", ("Ministral3ForCausalLM",), ("ministral3",), "Ministral3ForCausalLM", "ministral3",
                       permute_qk=True, extra_metadata=_mistral3_extra, caveats=_mistral3_caveats,
                       config_from_gguf=_mistral3_config))

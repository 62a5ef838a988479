"""Gemma 2 and Gemma 3 (text): norms stored as w + 1, the embedding as the output, local and global layers."""

from __future__ import annotations

from typing import Mapping

import gguf

from .base import HF_DENSE_BLOCK, GgufArch, register_arch
from ..hparams import rope_parameters


GEMMA_BLOCK = HF_DENSE_BLOCK + ("pre_feedforward_layernorm", "post_feedforward_layernorm")


def _gemma2_extra(writer: gguf.GGUFWriter, config: Mapping) -> None:
    # soft-capping of attention scores and of the final logits, and the sliding window of the local layers
    # (llama.cpp's gemma2 alternates local and global layers, as transformers' Gemma2 does)
    if config.get("attn_logit_softcapping") is not None:
        writer.add_attn_logit_softcapping(float(config["attn_logit_softcapping"]))
    if config.get("final_logit_softcapping") is not None:
        writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
    if config.get("sliding_window") is not None:
        writer.add_sliding_window(int(config["sliding_window"]))


def _gemma3_extra(writer: gguf.GGUFWriter, config: Mapping) -> None:
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
    if config.get("sliding_window_pattern") != 1 and config.get("sliding_window") is not None:
        writer.add_sliding_window(int(config["sliding_window"]))
    # the local layers rotate with their own base (transformers 5: rope_parameters.sliding_attention;
    # transformers 4: rope_local_base_freq)
    local = rope_parameters(config, layer_type="sliding_attention").get("rope_theta")
    if local is not None:
        writer.add_rope_freq_base_swa(float(local))


def _gemma_caveats(config: Mapping) -> list[str]:
    # llama.cpp scales Gemma attention by 1/sqrt(head_dim) (1/sqrt(hidden/heads) only for the 27B sizes);
    # transformers by query_pre_attn_scalar ** -0.5
    scalar, hd = config.get("query_pre_attn_scalar"), config.get("head_dim")
    if scalar is not None and hd is not None and int(scalar) != int(hd):
        return [f"query_pre_attn_scalar {scalar} differs from head_dim {hd}: llama.cpp scales attention by "
                "1/sqrt(head_dim) here (its 27B rule aside)"]
    return []


def _gemma_config(cfg: dict, get, names, cv, pattern: int) -> None:
    """Gemma 2 / 3: gelu-tanh FFN, the embedding as the output, attention scaled by 1/sqrt(head_dim) (what
    llama.cpp does for every size but 27B), local layers in llama.cpp's fixed pattern: gemma2 alternates
    (every 2nd layer global), gemma3 has 5 local then 1 global."""
    n = cfg["num_hidden_layers"]
    window = get("attention.sliding_window", lo=0)
    cfg.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=cfg["head_dim"],
               tie_word_embeddings=True, sliding_window=window,
               layer_types=["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)])
    cfg.pop("hidden_act", None)
    final = get("final_logit_softcapping", kind="float")
    cfg["final_logit_softcapping"] = final


def _gemma2_config(cfg: dict, get, names, cv) -> None:
    _gemma_config(cfg, get, names, cv, 2)
    cfg["attn_logit_softcapping"] = get("attn_logit_softcapping", kind="float")


def _gemma3_config(cfg: dict, get, names, cv) -> None:
    _gemma_config(cfg, get, names, cv, 6)
    local = get("rope.freq_base_swa", kind="float", lo=1e-30)
    full = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
    if "rope_scaling" in cfg:
        full.update(cfg.pop("rope_scaling"))
    cfg["rope_parameters"] = {"full_attention": full,
                              "sliding_attention": {"rope_type": "default", "rope_theta": local or 10000.0}}


register_arch(GgufArch("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), "Gemma2ForCausalLM", "gemma2", norm_shift=1.0,
                       extra_metadata=_gemma2_extra, norms=("attn_norm", "post_attention_norm", "ffn_norm",
                                                            "post_ffw_norm"),
                       tied_output_dropped=True, caveats=_gemma_caveats, hf_block=GEMMA_BLOCK,
                       config_from_gguf=_gemma2_config))
register_arch(GgufArch("gemma3", ("Gemma3ForCausalLM",), ("gemma3_text",), "Gemma3ForCausalLM", "gemma3_text",
                       norm_shift=1.0, extra_metadata=_gemma3_extra,
                       norms=("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"),
                       block_extra=("attn_q_norm", "attn_k_norm"), tied_output_dropped=True, caveats=_gemma_caveats,
                       hf_block=GEMMA_BLOCK, config_from_gguf=_gemma3_config))

"""gpt-oss: attention sinks, biases, a biased router, every layer routed, sliding and full layers, YaRN; the
experts fused and transposed in transformers' form, split into llama.cpp's stacks and merged back here."""

from __future__ import annotations

import re
from typing import Any, Mapping

import gguf

import torch

from ....converters.errors import BadInput
from .base import GgufArch, expert_keys, moe_config, register_arch
from ..hparams import rope_parameters


# gpt-oss: post_attention_layernorm is llama.cpp's attn_post_norm (the FFN's input norm); the experts'
# stacks are named as the per-layer stacks (split_gpt_oss_experts makes them from the fused tensors)
GPT_OSS_BLOCK = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
               "self_attn.v_proj", "self_attn.o_proj", "self_attn.sinks", "mlp.router", "mlp.experts.gate_proj",
               "mlp.experts.up_proj", "mlp.experts.down_proj")


def _gpt_oss_extra(writer: gguf.GGUFWriter, config: Mapping) -> None:
    """gpt-oss: the routed experts, the local layers' window and the experts' width, as llama.cpp's converter
    writes them (conversion/gpt_oss.py set_gguf_parameters: add_sliding_window(sliding_window),
    add_expert_feed_forward_length(intermediate_size)); llama.cpp's loader requires both keys
    (src/models/openai-moe.cpp load_arch_hparams)."""
    expert_keys(writer, config)
    if config.get("sliding_window") is None:
        raise BadInput("config.json lacks sliding_window, which llama.cpp's gpt-oss needs for its local layers")
    writer.add_sliding_window(int(config["sliding_window"]))
    writer.add_expert_feed_forward_length(int(config["intermediate_size"]))
    # llama.cpp's loader takes a per-layer sliding_window_pattern array before its default alternation
    # (load_swa_pattern); the converter never writes one, so a model with other layer_types would run with
    # the wrong masks: written only then (the file of a default model stays the converter's)
    types = config.get("layer_types")
    n = int(config["num_hidden_layers"])
    if isinstance(types, list) and types != gpt_oss_layer_types(n):
        if len(types) != n or any(t not in ("sliding_attention", "full_attention") for t in types):
            raise BadInput(f"layer_types must name sliding_attention or full_attention for each of the {n} layers")
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in types])


# llama.cpp's gpt-oss hard-codes the experts' clamped SwiGLU (llama-graph.cpp, LLM_FFN_SWIGLU_OAI_MOE: alpha
# 1.702, limit 7.0); its layer pattern without a sliding_window_pattern key is load_swa_pattern(ml, 2):
# sliding, full, sliding, ...
GPT_OSS_SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}


def gpt_oss_layer_types(n_layers: int) -> list[str]:
    """The attention of each layer as llama.cpp's gpt-oss runs it: even layers local, odd layers global."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]


def _gpt_oss_caveats(config: Mapping) -> list[str]:
    out = []
    for key, fixed in GPT_OSS_SWIGLU.items():
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise BadInput(f"{key} is {value!r}, not a number")  # a list or string: no float()
        if value is not None and abs(float(value) - fixed) > 1e-6:
            out.append(f"{key} is {value} but llama.cpp's gpt-oss always uses {fixed}")
    rp = rope_parameters(config)
    # transformers rounds YaRN's correction range only with truncate true; ggml always does
    # (ggml_rope_yarn_corr_dims floors the low and ceils the high dimension)
    if rp.get("rope_type") == "yarn" and rp.get("truncate") is False:
        out.append("rope_parameters.truncate is false but llama.cpp always rounds YaRN's correction range (as "
                   "transformers does with truncate true): the rotation of a few dimensions differs")
    return out


def _gpt_oss_config(cfg: dict, get, names, cv) -> None:
    """gpt-oss as llama.cpp runs it: experts intermediate_size wide (expert_feed_forward_length), biases
    everywhere, local layers in llama.cpp's pattern (sliding_window_pattern if the file has one, else every
    other layer from layer 0: load_swa_pattern(ml, 2)), YaRN with its correction range rounded (truncate
    true: ggml_rope_yarn_corr_dims), and the clamped SwiGLU's constants llama.cpp hard-codes."""
    moe_config(cfg, get, names, cv)
    if "num_local_experts" not in cfg:
        raise BadInput("GGUF metadata lacks gpt-oss.expert_count (gpt-oss routes every layer)")
    ff_exp = cfg.pop("moe_intermediate_size", None)
    if ff_exp is not None:
        cfg["intermediate_size"] = ff_exp
    n = cfg["num_hidden_layers"]
    key = "gpt-oss.attention.sliding_window_pattern"  # llama.cpp reads a per-layer array or a period
    flags = cv.get(key)
    if isinstance(flags, list):
        if len(flags) != n or not all(isinstance(f, bool) for f in flags):
            raise BadInput(f"metadata {key} is not {n} booleans (one per layer)", path=cv.path)
        types = ["sliding_attention" if f else "full_attention" for f in flags]
    else:
        pattern = get("attention.sliding_window_pattern", lo=0, hi=n)
        types = gpt_oss_layer_types(n) if pattern is None else [
            "sliding_attention" if pattern == 0 or i % pattern < pattern - 1 else "full_attention" for i in range(n)]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
    scaling = cfg.pop("rope_scaling", None)
    if scaling is not None:
        rope.update(scaling)
        if scaling["rope_type"] == "yarn":
            rope["truncate"] = True
    cfg.update(sliding_window=get("attention.sliding_window", required=True, lo=1), layer_types=types,
               rope_parameters=rope, attention_bias=bool(names and "blk.0.attn_q.bias" in names),
               tie_word_embeddings=False, **GPT_OSS_SWIGLU)


# gpt-oss: every layer routed (no dense FFN); post_attention_layernorm is the FFN's norm, named
# attn_post_norm by llama.cpp (gguf-py's GPT_OSS tensor list), and each layer has one sink per head
register_arch(GgufArch("gpt-oss", ("GptOssForCausalLM",), ("gpt_oss",), "GptOssForCausalLM", "gpt_oss", moe=True,
                       extra_metadata=_gpt_oss_extra, norms=("attn_norm", "post_attention_norm"),
                       block_extra=("attn_sinks",), caveats=_gpt_oss_caveats, hf_block=GPT_OSS_BLOCK,
                       config_from_gguf=_gpt_oss_config))


# --------------------------------------------------------------------------------------------------
# gpt-oss's fused experts: [experts, in, out] with gate and up interleaved <-> llama.cpp's stacks
# --------------------------------------------------------------------------------------------------
# --------------------------------------------------------------------------------------------------
# gpt-oss's fused experts: [experts, in, out] with gate and up interleaved <-> llama.cpp's stacks
# --------------------------------------------------------------------------------------------------
# transformers' GptOssExperts (models/gpt_oss/modeling_gpt_oss.py) holds, per layer,
#   gate_up_proj [experts, hidden, 2 * ffn]  (x @ gate_up_proj[e]; gate = columns 0::2, up = columns 1::2)
#   gate_up_proj_bias [experts, 2 * ffn]     (interleaved the same way)
#   down_proj [experts, ffn, hidden], down_proj_bias [experts, hidden]
# llama.cpp's converter (conversion/gpt_oss.py modify_tensors) transposes the weights to [experts, out, in]
# and takes every other row for gate (from 0) and up (from 1); the biases split the same way.
_GPT_OSS_EXPERT = re.compile(r"^(?P<head>.*\.mlp\.experts\.)(?P<what>gate_up_proj|down_proj)(?P<bias>_bias)?$")


def gpt_oss_expert_part(hf_name: str) -> tuple[str, str, bool] | None:
    """(`...mlp.experts.`, "gate_up_proj" or "down_proj", whether it is the bias) of one of gpt-oss's fused
    expert tensors, else None."""
    m = _GPT_OSS_EXPERT.match(hf_name)
    return None if m is None else (m["head"], m["what"], bool(m["bias"]))


def split_gpt_oss_experts(hf_name: str, tensor) -> list[tuple[str, object]]:
    """gpt-oss's fused expert tensor -> [(the stack's HF-style name, tensor in llama.cpp's [experts, out, in]
    order)]: gate_up_proj [E, h, 2f] -> gate_proj.weight, up_proj.weight [E, f, h]; gate_up_proj_bias
    [E, 2f] -> gate_proj.bias, up_proj.bias [E, f]; down_proj [E, f, h] -> down_proj.weight [E, h, f];
    down_proj_bias -> down_proj.bias."""
    head, what, bias = gpt_oss_expert_part(hf_name)
    suffix = ".bias" if bias else ".weight"
    t = tensor if bias else tensor.transpose(-1, -2)
    if what == "down_proj":
        return [(f"{head}down_proj{suffix}", t.contiguous())]
    return [(f"{head}gate_proj{suffix}", t[..., 0::2].contiguous() if bias else t[:, 0::2].contiguous()),
            (f"{head}up_proj{suffix}", t[..., 1::2].contiguous() if bias else t[:, 1::2].contiguous())]


def merge_gpt_oss_experts(gate, up=None, bias: bool = False):
    """The inverse of :func:`split_gpt_oss_experts`: gate and up stacks ([E, f, h] weights or [E, f] biases)
    -> gate_up_proj [E, h, 2f] (or gate_up_proj_bias [E, 2f]), interleaved; `up` None: down_proj's stack
    [E, h, f] -> down_proj [E, f, h] (a bias as it is)."""
    if up is None:
        return gate.contiguous() if bias else gate.transpose(-1, -2).contiguous()
    fused = torch.stack([gate, up], dim=-2 if not bias else -1)  # [E, f, 2, h] or [E, f, 2]
    fused = fused.reshape(gate.shape[0], 2 * gate.shape[1], *gate.shape[2:])
    return fused.contiguous() if bias else fused.transpose(-1, -2).contiguous()

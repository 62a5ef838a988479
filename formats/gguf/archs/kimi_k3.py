"""Kimi-K3 (KimiK3ForConditionalGeneration, remote code only: transformers has no class) as llama.cpp's
`kimi-k3`: the text model under `language_model.` (the vision tower and projector are left out, as llama.cpp's
converter leaves them), hybrid KDA (linear attention: n_head_kv 0 in the per-layer head_count_kv) and MLA
layers (`linear_attn_config.full_attn_layers`, 1-indexed), a dense lead, latent MoE layers (shared experts at
the model width, routed experts between routed_expert_down_proj / routed_expert_up_proj), the situ activation,
an MLA output gate, a full-rank KDA gate and cross-layer attention residuals (`<x>_res_norm` times
`<x>_res_proj`, fused into one score vector). Its routed experts ship as compressed-tensors
mxfp4-pack-quantized: `--type mxfp4` keeps their codes and exponents (GGML MXFP4, the converter's repack).

The installed gguf 0.19 has no kimi-k3 (no MODEL_ARCH, no tensor kinds SSM_G / ATTN_RES_SCORE / FFN_ROUTED_*,
no K3 keys), and the gguf-py vendored with llama.cpp's sources that has them is never imported at run time.
So the names and keys are this module's own table below; it mirrors llama.cpp's vendored gguf-py constants
(MODEL_ARCH_NAMES, MODEL_TENSORS[KIMI_K3], TENSOR_NAMES, tensor_mapping's HF names, Keys) and
tests/formats/gguf/test_gguf_archs_kimik3.py checks it against that gguf-py, so that drift is caught.
What the converter does beyond names (conversion/kimi_k3.py), redone here on the record stream:
`language_model.` stripped; the residual pairs fused (float32 product); the conv1d kernels reshaped to
[1, d_inner, 1, d_conv]; A_log stored as -exp(A_log) (the session's stored_values); dt_bias as ssm_dt.bias;
`self_attn.g_proj` told apart by layer kind (KDA: ssm_g, MLA: attn_gate); kv_b_proj split as DeepSeek's (mla).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Iterable, Iterator, Mapping

import gguf
import torch

from ....converters.errors import BadInput
from ....converters.records import Dense, TensorRecord, renamed
from .base import GgufArch, register_arch
from .qwen35 import a_log_values

KIMI_K3_ARCH = "kimi-k3"  # vendored gguf-py MODEL_ARCH_NAMES[MODEL_ARCH.KIMI_K3]

# --------------------------------------------------------------------------------------------------
# The name and key table (mirrors llama.cpp's vendored gguf-py: constants.py and tensor_mapping.py)
# --------------------------------------------------------------------------------------------------
# GGUF name -> the HF module (text model, `language_model.` stripped) llama.cpp's converter reads it from
KIMI_K3_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "output_res_score": "model.output_attn_res",  # converter-made: output_attn_res_norm * _proj
}
# per block (blk.{bid}. + the GGUF name) -> the HF module under model.layers.{bid}.
KIMI_K3_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_res_score": "self_attention_res",  # converter-made: self_attention_res_norm * _proj
    "ffn_res_score": "mlp_res",  # converter-made: mlp_res_norm * _proj
    # MLA (full-attention layers)
    "attn_q": "self_attn.q_proj",  # KDA layers' q too
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_gate": "self_attn.g_proj",  # MLA layers' output gate
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.k_b_proj",
    "attn_v_b": "self_attn.v_b_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    # KDA (linear-attention layers)
    "ssm_conv1d_q": "self_attn.q_conv1d",
    "ssm_conv1d_k": "self_attn.k_conv1d",
    "ssm_conv1d_v": "self_attn.v_conv1d",
    "ssm_f_a": "self_attn.f_a_proj",
    "ssm_f_b": "self_attn.f_b_proj",
    "ssm_beta": "self_attn.b_proj",
    "ssm_a": "self_attn.A_log",  # a bare parameter: no .weight
    "ssm_g": "self_attn.kda_g_proj",  # converter-made: a KDA layer's g_proj (_adapt_stream renames it)
    "ssm_dt": "self_attn.dt_proj",  # dt_bias, renamed dt_proj.bias as the converter does
    "ssm_norm": "self_attn.o_norm",
    # FFN: the dense lead, then the latent MoE
    "ffn_gate": "mlp.gate_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_gate_inp": "block_sparse_moe.gate",
    "exp_probs_b": "block_sparse_moe.gate.e_score_correction",  # e_score_correction_bias (names.py)
    "ffn_gate_exps": "block_sparse_moe.experts.w1",
    "ffn_down_exps": "block_sparse_moe.experts.w2",
    "ffn_up_exps": "block_sparse_moe.experts.w3",
    "ffn_gate_shexp": "block_sparse_moe.shared_experts.gate_proj",
    "ffn_down_shexp": "block_sparse_moe.shared_experts.down_proj",
    "ffn_up_shexp": "block_sparse_moe.shared_experts.up_proj",
    "ffn_routed_down": "block_sparse_moe.routed_expert_down_proj",
    "ffn_routed_up": "block_sparse_moe.routed_expert_up_proj",
    "ffn_routed_norm": "block_sparse_moe.routed_expert_norm",
}
# the HF modules above that no vendored TensorNameMap entry names: the converter makes these tensors itself
CONVERTER_MADE = frozenset({"output_res_score", "attn_res_score", "ffn_res_score", "ssm_g", "attn_gate"})
# the K3 keys gguf 0.19 lacks (vendored constants.Keys; types as its GGUFWriter.add_* write them)
KIMI_K3_KEYS = {
    "kda_head_dim": ("{arch}.kda.head_dim", "uint32"),
    "kda_gate_lower_bound": ("{arch}.kda.gate_lower_bound", "float32"),
    "expert_latent_length": ("{arch}.expert_latent_length", "uint32"),
    "situ_beta": ("{arch}.activation.situ_beta", "float32"),
    "situ_linear_beta": ("{arch}.activation.situ_linear_beta", "float32"),
    "attn_res_block_size": ("{arch}.attn_res.block_size", "uint32"),
}


# HF name -> GGUF name for names.py (GgufArch.name_table; names.py's ArchNameTable adds .weight / .bias)
KIMI_K3_NAME_TABLE = {**{hf: name for name, hf in KIMI_K3_GLOBAL_TENSORS.items()},
                      **{f"model.layers.0.{hf}": f"blk.0.{name}" for name, hf in KIMI_K3_BLOCK_TENSORS.items()}}


def _kimi_k3_caveats(config: Mapping) -> list[str]:
    """What the config asks that llama.cpp's kimi-k3 does not do (its converter writes no key for it)."""
    out = []
    if int(config.get("num_expert_group") or 1) > 1:
        out.append(f"num_expert_group is {config['num_expert_group']} but llama.cpp's kimi-k3 routes over all "
                   "experts (its converter writes no expert group count)")
    if int(config.get("moe_layer_freq") or 1) != 1:
        out.append(f"moe_layer_freq is {config['moe_layer_freq']} but llama.cpp's kimi-k3 loads routed experts in "
                   "every layer after the dense lead")
    return out


# --------------------------------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------------------------------
def _full_attn_layers(config: Mapping) -> set[int]:
    """The MLA layers, 0-indexed (linear_attn_config.full_attn_layers is 1-indexed, as KimiLinearConfig's
    is_kda_layer reads it)."""
    la = config.get("linear_attn_config")
    if not isinstance(la, Mapping) or not isinstance(la.get("full_attn_layers"), list):
        raise BadInput("config.json lacks linear_attn_config.full_attn_layers, which says Kimi-K3's MLA layers")
    return {int(i) - 1 for i in la["full_attn_layers"]}


def _head_count_kv(config: Mapping) -> list[int]:
    """One KV head (MLA served as MQA over the latent) on the full-attention layers, 0 on the KDA layers: how
    llama.cpp's kimi-k3 tells the recurrent layers (load_arch_hparams: is_recr = n_head_kv == 0)."""
    full = _full_attn_layers(config)
    return [1 if i in full else 0 for i in range(int(config["num_hidden_layers"]))]


def _add(writer: gguf.GGUFWriter, key: str, value) -> None:
    template, kind = KIMI_K3_KEYS[key]
    getattr(writer, f"add_{kind}")(template.format(arch=writer.arch), value)


def _kimi_k3_extra(writer: gguf.GGUFWriter, config: Mapping) -> None:
    """The keys conversion/kimi_k3.py set_gguf_parameters writes beyond the shared ones, with their types."""
    for key in ("linear_attn_config", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "num_experts", "moe_intermediate_size", "num_shared_experts",
                "first_k_dense_replace", "routed_scaling_factor", "activation_situ_beta",
                "activation_situ_linear_beta", "attn_res_block_size"):
        if config.get(key) is None:
            raise BadInput(f"config.json lacks {key}, which llama.cpp's kimi-k3 needs")
    if config.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise BadInput(f"moe_router_activation_func is {config['moe_router_activation_func']!r}; llama.cpp's "
                       "kimi-k3 routes with a sigmoid")
    if config.get("hidden_act", "situ") != "situ":
        raise BadInput(f"hidden_act is {config['hidden_act']!r}; llama.cpp's kimi-k3 runs situ")
    if not config.get("mla_use_nope", False):
        raise BadInput("mla_use_nope is not true; llama.cpp's kimi-k3 runs its MLA without rope")
    la = config["linear_attn_config"]
    writer.add_expert_count(int(config["num_experts"]))
    used = next((config[k] for k in ("num_experts_per_tok", "num_experts_per_token") if config.get(k) is not None),
                None)
    if used is None:
        raise BadInput("config.json lacks num_experts_per_token, which llama.cpp's kimi-k3 needs")
    writer.add_expert_used_count(int(used))
    if config.get("topk_group") is not None:  # written by the converter's shared keys (base.py), read by no graph
        writer.add_expert_group_used_count(int(config["topk_group"]))
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_vocab_size(int(config["vocab_size"]))
    writer.add_ssm_conv_kernel(int(la["short_conv_kernel_size"]))
    writer.add_kda_head_dim(int(la["head_dim"]))
    if la.get("gate_lower_bound") is not None:
        _add(writer, "kda_gate_lower_bound", float(la["gate_lower_bound"]))
    if config.get("q_lora_rank") is not None:
        writer.add_q_lora_rank(int(config["q_lora_rank"]))
    kv_lora, nope, rope, v = (int(config[k]) for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                                        "v_head_dim"))
    writer.add_kv_lora_rank(kv_lora)
    writer.add_rope_dimension_count(rope)
    # MLA served as MQA: the cache holds the compressed latent
    writer.add_key_length(kv_lora + rope)
    writer.add_value_length(kv_lora)
    writer.add_key_length_mla(nope + rope)
    writer.add_value_length_mla(v)
    writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
    writer.add_expert_shared_count(int(config["num_shared_experts"]))
    writer.add_leading_dense_block_count(int(config["first_k_dense_replace"]))
    writer.add_expert_weights_scale(float(config["routed_scaling_factor"]))
    writer.add_expert_weights_norm(bool(config.get("moe_renormalize", False)))
    if config.get("routed_expert_hidden_size") is not None:
        _add(writer, "expert_latent_length", int(config["routed_expert_hidden_size"]))
    _add(writer, "situ_beta", float(config["activation_situ_beta"]))
    _add(writer, "situ_linear_beta", float(config["activation_situ_linear_beta"]))
    _add(writer, "attn_res_block_size", int(config["attn_res_block_size"]))


# --------------------------------------------------------------------------------------------------
# The record stream as the converter shapes it
# --------------------------------------------------------------------------------------------------
_PREFIX = "language_model."
_RES = re.compile(r"^(?P<head>.*(?:self_attention_res|mlp_res|output_attn_res))_(?P<kind>norm|proj)\.weight$")
_CONV = re.compile(r"\.self_attn\.[qkv]_conv1d\.weight$")
_G_PROJ = re.compile(r"^model\.layers\.(?P<layer>0|[1-9][0-9]*)\.self_attn\.g_proj\.weight$")


def _dense(item) -> torch.Tensor:
    return item.tensor if isinstance(item, Dense) else item.dequantize(torch.float32)


def _fused_res(norm: TensorRecord, proj: TensorRecord, name: str) -> TensorRecord:
    """One score vector: res_norm * res_proj in float32 (both are only ever used as that product). The norm is
    an RMSNorm weight [hidden], the proj a Linear(hidden, 1) weight [1, hidden] (mlx-lm's kimi_k3 loads it so)."""
    if len(norm.shape) != 1 or tuple(proj.shape) not in ((1, norm.shape[0]), (norm.shape[0],)):
        raise BadInput(f"{norm.name} {list(norm.shape)} and {proj.name} {list(proj.shape)}: expected [hidden] and "
                       "[1, hidden]", tensor=norm.name)

    def load() -> Dense:
        return Dense(_dense(norm.load()).float().flatten() * _dense(proj.load()).float().flatten())

    return replace(norm, name=name, dtype="float32", load=load, params=None, native_type=None,
                   source_name=f"{norm.source_name or norm.name} * {proj.source_name or proj.name}")


def _conv(rec: TensorRecord, where) -> TensorRecord:
    """HF [d_inner, 1, d_conv] (or [d_inner, d_conv]) -> [1, d_inner, 1, d_conv]: ggml's
    {d_conv, 1, d_inner, 1}, a pure reshape (conv_step fastest in both)."""
    if len(rec.shape) not in (2, 3) or (len(rec.shape) == 3 and rec.shape[1] != 1):
        raise BadInput(f"conv1d kernel of shape {list(rec.shape)}: expected [d_inner, 1, d_conv]", path=where,
                       tensor=rec.name)
    d_inner, d_conv = rec.shape[0], rec.shape[-1]
    shape = (1, d_inner, 1, d_conv)

    def load() -> Dense:
        return Dense(_dense(rec.load()).reshape(shape))

    return replace(rec, shape=shape, load=load, dtype=rec.dtype if not rec.is_grid else "float32", params=None,
                   native_type=None)


def _adapt_stream(records: Iterable[TensorRecord], config: Mapping, where=None) -> Iterator[TensorRecord]:
    """The source's records as llama.cpp's converter sees them (see the module's docstring); a residual norm
    waits for its proj (its record only, nothing loaded) and an unpaired one is refused at the end."""
    full = _full_attn_layers(config)
    waiting: dict[str, TensorRecord] = {}
    for rec in records:
        name = rec.name[len(_PREFIX):] if rec.name.startswith(_PREFIX) else rec.name
        if name != rec.name:
            rec = renamed(rec, name=name, source_name=rec.source_name or rec.name)  # a lazy record stays lazy
        m = _RES.match(name)
        if m is not None:
            other = waiting.pop(m["head"], None)
            if other is None:
                waiting[m["head"]] = rec
                continue
            if _RES.match(other.name)["kind"] == m["kind"]:
                raise BadInput(f"{name} appears twice", path=where, tensor=name)
            norm, proj = (rec, other) if m["kind"] == "norm" else (other, rec)
            yield _fused_res(norm, proj, f"{m['head']}.weight")
            continue
        if _CONV.search(name):
            rec = _conv(rec, where)
        elif name.endswith(".self_attn.dt_bias"):
            rec = renamed(rec, name=name[: -len("dt_bias")] + "dt_proj.bias")
        elif (g := _G_PROJ.match(name)) is not None and int(g["layer"]) not in full:
            rec = renamed(rec, name=name.replace(".g_proj.", ".kda_g_proj."))  # the KDA layer's gate: ssm_g
        yield rec
    if waiting:
        head = sorted(waiting)[0]
        raise BadInput(f"{waiting[head].name} has no {'proj' if waiting[head].name.endswith('norm.weight') else 'norm'}"
                       " partner: Kimi-K3's residual scores are res_norm * res_proj", path=where,
                       tensor=waiting[head].name)


_TOWERS = re.compile(r"^(?:vision_tower|mm_projector)\.")


def _tower_dropped(name: str, config) -> str | None:
    """The vision tower and projector: llama.cpp's converter writes the text model here (the towers only into the
    mmproj file of its --mmproj run)."""
    return "a multimodal tower: llama.cpp's converter writes the text model only" if _TOWERS.match(name) else None


register_arch(GgufArch(
    KIMI_K3_ARCH, ("KimiK3ForConditionalGeneration",), ("kimi_k3",), "KimiK3ForConditionalGeneration", "kimi_k3",
    moe=True, mla=True, extra_metadata=_kimi_k3_extra, caveats=_kimi_k3_caveats,
    norms=("attn_norm", "ffn_norm", "attn_res_score", "ffn_res_score"),
    attention=("attn_kv_a_mqa", "attn_kv_a_norm", "attn_k_b", "attn_v_b", "attn_output"),
    # a KDA layer's own tensors, which tell it from an MLA layer (its attn_q/k/v/output share names with MLA's;
    # ssm_a, a bare tensor, and ssm_dt.bias are required too, but the check names .weight tensors only)
    linear_attention=("ssm_conv1d_q", "ssm_conv1d_k", "ssm_conv1d_v", "ssm_f_a", "ssm_f_b", "ssm_beta", "ssm_g",
                      "ssm_norm"),
    dropped_tensor=_tower_dropped,
    not_read="its residual scores are stored fused (res_norm * res_proj cannot be split back) and transformers "
             "has no Kimi-K3 class; convert from the compressed-tensors checkpoint instead",
    stored_values=a_log_values,  # A = -exp(A_log) in float32, as Qwen3.5's ssm_a (the converter folds it too)
    name_table=KIMI_K3_NAME_TABLE, head_count_kv=_head_count_kv, adapt_stream=_adapt_stream))

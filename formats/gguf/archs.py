"""The model families qconvert writes to GGUF and reads back: one record per llama.cpp architecture.

Each `GgufArch` says which Hugging Face classes map to it, how its hyper-parameters become `{arch}.*`
metadata (as llama.cpp's convert_hf_to_gguf.py writes them and its llama-model.cpp reads them), which
tensors every layer must have, and its tensor quirks:

- `permute_qk`: llama's q/k rows are reordered from HF's rotate-half rope to ggml's NORM rope (names.py);
- `norm_shift`: Gemma's RMSNorm multiplies by `1 + w` while llama.cpp multiplies by the stored value,
  so every `*norm.weight` is written as `w + 1` (and read back as `value - 1`);
- experts: HF keeps one 2-D tensor per expert (`...experts.<e>.gate_proj.weight`), GGUF one 3-D tensor
  per layer (`blk.N.ffn_gate_exps.weight`, experts outermost); the stacking is the writer's
  (writer.GgufSession), the naming `expert_name` here;
- gpt-oss keeps its experts fused and transposed ([experts, in, out], gate and up columns interleaved in
  gate_up_proj, biases per expert): `split_gpt_oss_experts` / `merge_gpt_oss_experts` here turn them into
  llama.cpp's stacks and back (the writer's adapt_records and the reader's records call them).

The names themselves come from gguf-py's `TensorNameMap` for the architecture (names.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Mapping

import gguf

__all__ = ["GgufArch", "ARCHS", "arch_by_name", "arch_for_config", "expert_name", "supported_classes",
           "gpt_oss_expert_part", "split_gpt_oss_experts", "merge_gpt_oss_experts"]

MetadataHook = Callable[[gguf.GGUFWriter, Mapping], None]


def _no_extra(writer: gguf.GGUFWriter, config: Mapping) -> None:
    return None


@dataclass(frozen=True)
class GgufArch:
    name: str  # general.architecture
    hf_classes: tuple[str, ...]  # config.json `architectures` entries that map here
    model_types: tuple[str, ...]  # config.json `model_type` values that map here (no `architectures`)
    hf_class: str  # the class gguf->hf writes
    model_type: str
    permute_qk: bool = False
    norm_shift: float = 0.0
    moe: bool = False  # has routed experts (ffn_*_exps)
    # the architecture's own keys, after the ones every family shares (metadata.add_model_metadata)
    extra_metadata: MetadataHook = _no_extra
    # per layer, the tensors llama.cpp's loader requires besides the attention / FFN ones below
    block_extra: tuple[str, ...] = ()
    attention: tuple[str, ...] = ("attn_q", "attn_k", "attn_v", "attn_output")
    norms: tuple[str, ...] = ("attn_norm", "ffn_norm")
    dense_ffn: tuple[str, ...] = ("ffn_gate", "ffn_up", "ffn_down")
    tied_output_dropped: bool = False  # llama.cpp's converter drops lm_head (Gemma: the embedding serves)
    # multi-head latent attention (DeepSeek): llama.cpp runs it as MQA over the compressed KV, so the shared
    # keys write one KV head and no per-head key/value length (the architecture's own keys do)
    mla: bool = False
    # layers at or beyond num_hidden_layers that llama.cpp's loader ignores (DeepSeek-V3's multi-token
    # prediction layer, model.layers.<num_hidden_layers>): dropped with a note instead of refused
    drops_extra_layers: bool = False
    # what the config asks that llama.cpp's graph for this architecture does not do (it hard-codes it):
    # a list of warnings for the user, the conversion goes on
    caveats: Callable[[Mapping], list[str]] = field(default=lambda config: [], repr=False)

    @property
    def enum(self) -> gguf.MODEL_ARCH:
        return _ENUM_BY_NAME[self.name]


_ENUM_BY_NAME = {name: enum for enum, name in gguf.MODEL_ARCH_NAMES.items()}


# --------------------------------------------------------------------------------------------------
# per-architecture metadata (the keys the shared writer does not know)
# --------------------------------------------------------------------------------------------------
def _expert_keys(writer: gguf.GGUFWriter, config: Mapping) -> None:
    # transformers 5 calls Qwen-MoE's count num_local_experts as Mixtral's; older configs num_experts
    if expert_count(config) is not None:
        writer.add_expert_count(int(expert_count(config)))
    if config.get("num_experts_per_tok") is not None:
        writer.add_expert_used_count(int(config["num_experts_per_tok"]))


def _llama_extra(writer: gguf.GGUFWriter, config: Mapping) -> None:
    # Mixtral: arch llama with experts (llama.cpp reads llama.expert_count to build the MoE FFN)
    _expert_keys(writer, config)


def _qwen_moe_extra(writer: gguf.GGUFWriter, config: Mapping) -> None:
    _expert_keys(writer, config)
    if config.get("moe_intermediate_size") is not None:
        writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
    if config.get("shared_expert_intermediate_size") is not None:
        writer.add_expert_shared_feed_forward_length(int(config["shared_expert_intermediate_size"]))


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
    from .metadata import rope_parameters

    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
    if config.get("sliding_window_pattern") != 1 and config.get("sliding_window") is not None:
        writer.add_sliding_window(int(config["sliding_window"]))
    # the local layers rotate with their own base (transformers 5: rope_parameters.sliding_attention;
    # transformers 4: rope_local_base_freq)
    local = rope_parameters(config, layer_type="sliding_attention").get("rope_theta")
    if local is not None:
        writer.add_rope_freq_base_swa(float(local))


def _phi3_extra(writer: gguf.GGUFWriter, config: Mapping) -> None:
    from .metadata import rope_parameters

    rp = rope_parameters(config)
    n_embd, n_head = int(config["hidden_size"]), int(config["num_attention_heads"])
    rot = float(rp.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) or 1.0)
    writer.add_rope_dimension_count(int(rot * n_embd) // n_head)
    orig = rp.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
    writer.add_rope_scaling_orig_ctx_len(int(orig or config["max_position_embeddings"]))
    # Phi-4 has no sliding window; llama.cpp tells the two apart by a zero here
    writer.add_sliding_window(int(config.get("sliding_window") or 0))
    if rp.get("rope_type") in ("longrope", "su"):  # the factor tables are tensors (metadata.rope_tensors)
        from .metadata import longrope_attn_factor

        writer.add_rope_scaling_attn_factors(longrope_attn_factor(config))


def _deepseek2_extra(writer: gguf.GGUFWriter, config: Mapping) -> None:
    """DeepSeek-V2/V3 and Kimi-K2: the latent ranks, the head sizes after decompression, the dense lead
    layers, routed and shared experts and the router's rules (llama.cpp's deepseek2 loader reads these)."""
    from .metadata import rope_parameters

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


def _gpt_oss_extra(writer: gguf.GGUFWriter, config: Mapping) -> None:
    """gpt-oss: the routed experts, the local layers' window and the experts' width, as llama.cpp's converter
    writes them (conversion/gpt_oss.py set_gguf_parameters: add_sliding_window(sliding_window),
    add_expert_feed_forward_length(intermediate_size)); llama.cpp's loader requires both keys
    (src/models/openai-moe.cpp load_arch_hparams)."""
    from ...converters.errors import BadInput

    _expert_keys(writer, config)
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
    from .metadata import rope_parameters

    out = []
    for key, fixed in GPT_OSS_SWIGLU.items():
        value = config.get(key)
        if value is not None and abs(float(value) - fixed) > 1e-6:
            out.append(f"{key} is {value} but llama.cpp's gpt-oss always uses {fixed}")
    rp = rope_parameters(config)
    # transformers rounds YaRN's correction range only with truncate true; ggml always does
    # (ggml_rope_yarn_corr_dims floors the low and ceils the high dimension)
    if rp.get("rope_type") == "yarn" and rp.get("truncate") is False:
        out.append("rope_parameters.truncate is false but llama.cpp always rounds YaRN's correction range (as "
                   "transformers does with truncate true): the rotation of a few dimensions differs")
    return out


def _qwen3moe_caveats(config: Mapping) -> list[str]:
    # llama.cpp's qwen3moe graph always renormalises the chosen experts' weights (build_moe_ffn norm_w)
    if config.get("norm_topk_prob") is False:
        return ["norm_topk_prob is false but llama.cpp's qwen3moe always renormalises the top-k expert weights"]
    return []


def _gemma_caveats(config: Mapping) -> list[str]:
    # llama.cpp scales Gemma attention by 1/sqrt(head_dim) (1/sqrt(hidden/heads) only for the 27B sizes);
    # transformers by query_pre_attn_scalar ** -0.5
    scalar, hd = config.get("query_pre_attn_scalar"), config.get("head_dim")
    if scalar is not None and hd is not None and int(scalar) != int(hd):
        return [f"query_pre_attn_scalar {scalar} differs from head_dim {hd}: llama.cpp scales attention by "
                "1/sqrt(head_dim) here (its 27B rule aside)"]
    return []


ARCHS: dict[str, GgufArch] = {a.name: a for a in (
    GgufArch("llama", ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM"),
             ("llama", "mistral", "mixtral"), "LlamaForCausalLM", "llama", permute_qk=True,
             extra_metadata=_llama_extra),
    GgufArch("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), "Qwen2ForCausalLM", "qwen2"),
    GgufArch("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), "Qwen3ForCausalLM", "qwen3",
             block_extra=("attn_q_norm", "attn_k_norm")),
    GgufArch("qwen2moe", ("Qwen2MoeForCausalLM",), ("qwen2_moe",), "Qwen2MoeForCausalLM", "qwen2_moe", moe=True,
             extra_metadata=_qwen_moe_extra),
    GgufArch("qwen3moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), "Qwen3MoeForCausalLM", "qwen3_moe", moe=True,
             extra_metadata=_qwen_moe_extra, block_extra=("attn_q_norm", "attn_k_norm"), caveats=_qwen3moe_caveats),
    GgufArch("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), "Gemma2ForCausalLM", "gemma2", norm_shift=1.0,
             extra_metadata=_gemma2_extra, norms=("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"),
             tied_output_dropped=True, caveats=_gemma_caveats),
    GgufArch("gemma3", ("Gemma3ForCausalLM",), ("gemma3_text",), "Gemma3ForCausalLM", "gemma3_text",
             norm_shift=1.0, extra_metadata=_gemma3_extra,
             norms=("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"),
             block_extra=("attn_q_norm", "attn_k_norm"), tied_output_dropped=True, caveats=_gemma_caveats),
    # Kimi-K2 ships as DeepseekV3ForCausalLM (model_type kimi_k2). DeepSeek-V2 writes the tensors and keys
    # llama.cpp's converter writes, but llama.cpp refused to load the tiny V2 built to test it (no q_lora):
    # not listed until a test runs it
    GgufArch("deepseek2", ("DeepseekV3ForCausalLM",), ("deepseek_v3", "kimi_k2"), "DeepseekV3ForCausalLM",
             "deepseek_v3", moe=True, mla=True,
             extra_metadata=_deepseek2_extra, drops_extra_layers=True,
             attention=("attn_kv_a_mqa", "attn_kv_a_norm", "attn_k_b", "attn_v_b", "attn_output")),
    GgufArch("phi3", ("Phi3ForCausalLM",), ("phi3",), "Phi3ForCausalLM", "phi3", extra_metadata=_phi3_extra,
             attention=("attn_qkv", "attn_output"), dense_ffn=("ffn_up", "ffn_down")),
    # gpt-oss: every layer routed (no dense FFN); post_attention_layernorm is the FFN's norm, named
    # attn_post_norm by llama.cpp (gguf-py's GPT_OSS tensor list), and each layer has one sink per head
    GgufArch("gpt-oss", ("GptOssForCausalLM",), ("gpt_oss",), "GptOssForCausalLM", "gpt_oss", moe=True,
             extra_metadata=_gpt_oss_extra, norms=("attn_norm", "post_attention_norm"), block_extra=("attn_sinks",),
             caveats=_gpt_oss_caveats),
)}


def arch_by_name(name: str) -> GgufArch | None:
    return ARCHS.get(name)


def supported_classes() -> list[str]:
    return sorted(c for a in ARCHS.values() for c in a.hf_classes)


def arch_for_config(config: Mapping) -> tuple[GgufArch | None, str]:
    """(the architecture of an HF config.json dict, or None; what the config names, for a refusal).
    `architectures[0]` decides; `model_type` is the fallback when there is no `architectures`."""
    archs = config.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if not isinstance(archs, list):  # an object or a number: named in the refusal
        archs = [archs]
    for a in ARCHS.values():
        if any(isinstance(c, str) and c in a.hf_classes for c in archs):
            return a, ""
    if not archs:
        mt = config.get("model_type")
        for a in ARCHS.values():
            if isinstance(mt, str) and mt in a.model_types:
                return a, ""
        return None, f"model_type {mt!r}" if mt else "no architectures/model_type in config.json"
    return None, f"architecture {', '.join(map(str, archs))}"


# `...experts.<e>.<rest>`: one expert's tensor of a MoE layer (Mixtral's block_sparse_moe.experts.3.w1,
# Qwen-MoE's mlp.experts.3.gate_proj); shared experts (`shared_expert.`, `shared_experts.`) do not match
_EXPERT = re.compile(r"^(?P<head>.*\.experts)\.(?P<index>0|[1-9][0-9]*)\.(?P<tail>.+)$")


def expert_name(hf_name: str) -> tuple[str, int] | None:
    """(the name of the stacked tensor the expert belongs to, the expert's index), or None:
    `model.layers.0.mlp.experts.3.up_proj.weight` -> (`model.layers.0.mlp.experts.up_proj.weight`, 3)."""
    m = _EXPERT.match(hf_name)
    if m is None:
        return None
    return f"{m['head']}.{m['tail']}", int(m["index"])


# config.json's key for the routed experts per MoE layer: Mixtral (and transformers 5's Qwen-MoE), older
# Qwen-MoE configs, DeepSeek
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def expert_count_key(config: Mapping) -> str | None:
    """The first of EXPERT_COUNT_KEYS the config sets, or None (a dense model)."""
    return next((key for key in EXPERT_COUNT_KEYS if config.get(key) is not None), None)


def expert_count(config: Mapping) -> int | None:
    """The routed experts per MoE layer config.json declares (Mixtral, Qwen-MoE, DeepSeek name it differently)."""
    key = expert_count_key(config)
    return None if key is None else config[key]


# --------------------------------------------------------------------------------------------------
# DeepSeek's kv_b_proj: one HF tensor, two GGUF tensors
# --------------------------------------------------------------------------------------------------
_KV_B = re.compile(r"^(?P<head>.*\.self_attn\.)kv_b_proj\.weight$")


def _mla_sizes(config: Mapping) -> tuple[int, int, int]:
    return int(config["num_attention_heads"]), int(config["qk_nope_head_dim"]), int(config["v_head_dim"])


def split_kv_b(kv_b, config: Mapping):
    """kv_b_proj [heads * (nope + v), kv_lora] -> (k_b [heads, kv_lora, nope], v_b [heads, v, kv_lora]):
    llama.cpp's MLA absorbs k_b into the query, so it wants each head's key rows transposed (its
    deepseek2 loader: attn_k_b {nope, kv_lora, heads}, attn_v_b {kv_lora, v, heads} in ggml order)."""
    n_head, nope, v = _mla_sizes(config)
    per_head = kv_b.reshape(n_head, nope + v, kv_b.shape[-1])
    return per_head[:, :nope].transpose(1, 2).contiguous(), per_head[:, nope:].contiguous()


def merge_kv_b(k_b, v_b):
    """The inverse of :func:`split_kv_b`."""
    per_head = __import__("torch").cat([k_b.transpose(1, 2), v_b], dim=1)
    return per_head.reshape(-1, per_head.shape[-1]).contiguous()


def kv_b_parts(hf_name: str) -> tuple[str, str] | None:
    """The HF-style names of the two halves a kv_b_proj becomes (k_b_proj, v_b_proj), else None."""
    m = _KV_B.match(hf_name)
    return None if m is None else (f"{m['head']}k_b_proj.weight", f"{m['head']}v_b_proj.weight")


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
    import torch

    if up is None:
        return gate.contiguous() if bias else gate.transpose(-1, -2).contiguous()
    fused = torch.stack([gate, up], dim=-2 if not bias else -1)  # [E, f, 2, h] or [E, f, 2]
    fused = fused.reshape(gate.shape[0], 2 * gate.shape[1], *gate.shape[2:])
    return fused.contiguous() if bias else fused.transpose(-1, -2).contiguous()

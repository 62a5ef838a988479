"""GGUF model metadata (hyper-parameters) for llama / qwen2 / qwen3, both directions.

* :func:`add_model_metadata` writes every ``{arch}.*`` and ``general.*`` key llama.cpp needs to load
  the model, as llama.cpp's convert_hf_to_gguf.py writes them and its llama-model.cpp reads them.
* :func:`rope_freqs_tensor` computes the ``rope_freqs.weight`` tensor llama-3 style rope scaling
  needs (llama.cpp divides each rotation frequency by its factor).
* :func:`config_from_gguf` rebuilds a config.json dict from a GGUF file's metadata.

Accepts both config.json layouts: transformers < 5 (``rope_theta`` + ``rope_scaling``) and
transformers >= 5 (``rope_parameters`` holding ``rope_theta``, ``rope_type`` and the scaling fields).
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

import gguf
import numpy as np

from ...converters.errors import BadInput, QConvertError
from ...converters.validate import ConfigView
from .archs import EXPERT_COUNT_KEYS, arch_by_name
from .names import SUPPORTED_ARCHS, head_dim, layer_index

__all__ = [
    "add_model_metadata",
    "rope_parameters",
    "rope_freqs_tensor",
    "config_from_gguf",
    "check_gguf_tensors",
    "check_writer_config",
    "layer_count",
    "config_json_path",
    "field_values",
]

logger = logging.getLogger(__name__)

_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_RMS_EPS = 1e-6
# sanity bounds on hyper-parameters before any arithmetic (the tensors decide the exact values)
MAX_WIDTH = 1 << 20  # hidden / ffn / head sizes
MAX_HEADS = 1 << 14
MAX_VOCAB = 1 << 24
_FLOAT32_MAX = 3.4028234663852886e38  # GGUF stores rope and norm settings as FLOAT32


def _require(config: Mapping, key: str) -> Any:
    value = config.get(key)
    if value is None:
        raise BadInput(f"config.json lacks {key}, which GGUF needs")
    return value


def rope_parameters(config: Mapping, layer_type: str = "full_attention") -> dict:
    """Rope settings as one dict: ``rope_theta`` (always present), ``rope_type`` ("default",
    "linear", "yarn", "llama3", "dynamic", ...) and the scaling fields (``factor``,
    ``original_max_position_embeddings``, ``low_freq_factor``, ...), from either config layout.
    ``layer_type``: which layers' settings, for models whose local and global layers rotate differently
    (Gemma 3: "sliding_attention" has its own base, transformers 4 called it ``rope_local_base_freq``)."""
    out: dict = {}
    params = config.get("rope_parameters")
    if isinstance(params, Mapping):
        # transformers 5: one dict (a dict of dicts keyed by layer type for hybrid models)
        if params and all(isinstance(v, Mapping) for v in params.values()):
            params = params.get(layer_type) or params.get("full_attention") or next(iter(params.values()))
        out.update(params)
    if layer_type == "sliding_attention" and "rope_theta" not in out and config.get("rope_local_base_freq"):
        out["rope_theta"] = config["rope_local_base_freq"]
    scaling = config.get("rope_scaling")
    if isinstance(scaling, Mapping):
        for k, v in scaling.items():
            out.setdefault(k, v)
    if "rope_type" not in out and "type" in out:
        out["rope_type"] = out["type"]
    out.pop("type", None)
    if out.get("rope_theta") is None:
        out["rope_theta"] = config.get("rope_theta", _DEFAULT_ROPE_THETA)
    out["rope_type"] = str(out.get("rope_type") or "default").lower()
    # transformers stores llama3's original context inside the rope dict; older configs had it top level
    if "original_max_position_embeddings" not in out and config.get("original_max_position_embeddings"):
        out["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    return out


def rope_freqs_tensor(config: Mapping) -> np.ndarray | None:
    """float32 ``[head_dim // 2]`` factors for the ``rope_freqs.weight`` tensor when the config uses
    llama-3 style rope scaling (``rope_type == "llama3"``), else ``None``.

    llama.cpp rotates pair i by ``pos * theta_i / factor_i``; transformers uses
    ``pos * inv_freq_llama_i``, hence ``factor_i = inv_freq_i / inv_freq_llama_i``.
    """
    rp = rope_parameters(config)
    if rp["rope_type"] != "llama3":
        return None
    hd = head_dim(config)
    base = float(rp["rope_theta"])
    factor = float(rp.get("factor", 8.0))
    low = float(rp.get("low_freq_factor", 1.0))
    high = float(rp.get("high_freq_factor", 4.0))
    old_ctx = float(rp.get("original_max_position_embeddings", 8192))
    inv_freq = 1.0 / (base ** (np.arange(0, hd, 2, dtype=np.int64).astype(np.float64) / hd))
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    factors = []
    for f in inv_freq:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1.0 / ((1.0 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def _phi3_rope_dims(config: Mapping) -> int:
    """The dimensions Phi-3 rotates per head: partial_rotary_factor of hidden / heads (as llama.cpp's converter)."""
    rp = rope_parameters(config)
    rot = float(rp.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) or 1.0)
    return int(rot * int(config["hidden_size"])) // int(config["num_attention_heads"])


def longrope_attn_factor(config: Mapping) -> float:
    """Phi-3's long-context attention scale, sqrt(1 + ln(scale) / ln(original context)) with scale the
    context over the original (transformers' longrope default; llama.cpp's converter writes the same)."""
    rp = rope_parameters(config)
    orig = float(rp.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
                 or config["max_position_embeddings"])
    scale = float(config["max_position_embeddings"]) / orig
    return math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0


def rope_tensors(config: Mapping, arch: str) -> list[tuple[str, np.ndarray]]:
    """The F32 tensors a rope scaling is stored as: llama-3's rope_freqs.weight, Phi-3's longrope
    rope_factors_long / rope_factors_short.weight (the factor tables, one per rotated pair)."""
    rp = rope_parameters(config)
    if rp["rope_type"] in ("longrope", "su") and arch == "phi3":
        return [("rope_factors_long.weight", np.asarray(rp["long_factor"], dtype=np.float32)),
                ("rope_factors_short.weight", np.asarray(rp["short_factor"], dtype=np.float32))]
    freqs = rope_freqs_tensor(config)
    return [] if freqs is None else [("rope_freqs.weight", freqs.astype(np.float32))]


def _default_name(config: Mapping) -> str:
    src = str(config.get("_name_or_path") or "").rstrip("/")
    return src.rsplit("/", 1)[-1] if src else "model"


def add_model_metadata(writer: gguf.GGUFWriter, config: Mapping, arch: str, *, file_type: int,
                       name: str | None = None) -> None:
    """Write the model hyper-parameters llama.cpp reads for ``arch`` (llama, qwen2, qwen3), plus
    ``general.file_type`` (a :class:`gguf.LlamaFileType` value), ``general.quantization_version``
    and ``general.name``. Tokenizer keys are written by ``tokenizer.add_tokenizer``; a llama-3 rope
    needs the caller to add ``rope_freqs.weight`` = :func:`rope_freqs_tensor` (F32)."""
    spec = arch_by_name(arch)
    if spec is None:
        raise QConvertError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHS)}")
    if getattr(writer, "arch", arch) != arch:
        raise ValueError(f"writer was opened for arch {writer.arch!r}, metadata is for {arch!r}")

    n_embd = int(_require(config, "hidden_size"))
    n_head = int(_require(config, "num_attention_heads"))
    n_kv = int(config.get("num_key_value_heads") or n_head)
    hd = head_dim(config)
    rp = rope_parameters(config)

    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name or _default_name(config))
    writer.add_context_length(int(_require(config, "max_position_embeddings")))
    writer.add_embedding_length(n_embd)
    writer.add_block_count(int(_require(config, "num_hidden_layers")))
    writer.add_feed_forward_length(int(_require(config, "intermediate_size")))
    writer.add_head_count(n_head)
    writer.add_head_count_kv(1 if spec.mla else n_kv)
    writer.add_rope_freq_base(float(rp["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps") or _DEFAULT_RMS_EPS))
    if not spec.mla and (config.get("head_dim") or hd * n_head != n_embd):
        writer.add_key_length(hd)
        writer.add_value_length(hd)
    if arch == "llama":
        if config.get("vocab_size") is not None:  # optional for llama.cpp, which counts the tokenizer's tokens
            writer.add_vocab_size(int(config["vocab_size"]))
        writer.add_rope_dimension_count(hd)

    _add_rope_scaling(writer, rp, arch)
    spec.extra_metadata(writer, config)
    for caveat in spec.caveats(config):
        logger.warning("%s; the GGUF runs as llama.cpp's %s does", caveat, arch)

    writer.add_file_type(int(file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _add_rope_scaling(writer: gguf.GGUFWriter, rp: Mapping, arch: str = "") -> None:
    rtype = rp["rope_type"]
    factor = rp.get("factor")
    if rtype == "default":
        return
    if rtype == "linear":
        if factor is None:
            raise BadInput("rope_scaling type linear without factor in config.json")
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(factor))
    elif rtype == "yarn":
        if factor is None:
            raise BadInput("rope_scaling type yarn without factor in config.json")
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(factor))
        if rp.get("original_max_position_embeddings"):
            writer.add_rope_scaling_orig_ctx_len(int(rp["original_max_position_embeddings"]))
        if rp.get("extrapolation_factor") is not None:
            writer.add_rope_scaling_yarn_ext_factor(float(rp["extrapolation_factor"]))
        attn = rp.get("attention_factor", rp.get("attn_factor"))
        if attn is not None:
            writer.add_rope_scaling_yarn_attn_factor(float(attn))
        if rp.get("beta_fast") is not None:
            writer.add_rope_scaling_yarn_beta_fast(float(rp["beta_fast"]))
        if rp.get("beta_slow") is not None:
            writer.add_rope_scaling_yarn_beta_slow(float(rp["beta_slow"]))
        # llama.cpp takes these from its context parameters, not from the file, for llama/qwen2/qwen3
        # (tested: non-default values change the logits by ~1 unless passed at run time)
        mscale = 1.0 + 0.1 * math.log(float(factor)) if float(factor) > 1 else 1.0
        runtime = []
        if attn is not None and abs(float(attn) - mscale) > 1e-6:
            runtime.append(f"--yarn-attn-factor {float(attn) / mscale:.6g}")
        if rp.get("beta_fast") is not None and float(rp["beta_fast"]) != 32.0:
            runtime.append(f"--yarn-beta-fast {float(rp['beta_fast']):g}")
        if rp.get("beta_slow") is not None and float(rp["beta_slow"]) != 1.0:
            runtime.append(f"--yarn-beta-slow {float(rp['beta_slow']):g}")
        if runtime:
            logger.warning("yarn rope settings that llama.cpp does not read from GGUF for this architecture; "
                           "run it with %s to match the source model", " ".join(runtime))
    elif rtype == "llama3" or rtype in _ARCH_ROPE_TYPES.get(arch, ()):
        pass  # carried by tensors: rope_freqs.weight, phi3's rope_factors_long/short.weight (rope_tensors)
    elif rtype == "dynamic":
        # dynamic NTK only changes rope beyond the trained context; llama.cpp has no equivalent
        logger.warning("rope_scaling type 'dynamic' is not representable in GGUF; written as plain rope "
                       "(identical within max_position_embeddings)")
    else:
        raise BadInput(f"rope_scaling type {rtype!r} cannot be stored in GGUF for this architecture "
                       "(supported: linear, yarn, llama3)")


# --------------------------------------------------------------------------------------------------
# GGUF -> config.json
# --------------------------------------------------------------------------------------------------


def field_values(fields: Any) -> dict[str, Any]:
    """Python values of a GGUF file's metadata: accepts a :class:`gguf.GGUFReader`, its ``fields``
    mapping (``ReaderField`` values) or an already plain ``{key: value}`` mapping."""
    if hasattr(fields, "fields") and not isinstance(fields, Mapping):
        fields = fields.fields
    out = {}
    for k, v in fields.items():
        out[k] = v.contents() if hasattr(v, "contents") and callable(v.contents) else v
    return out


def _typed(kv: Mapping, path: object) -> ConfigView:
    """Typed, range-checked reads of GGUF metadata values (a wrong type or range names the key)."""
    return ConfigView(dict(kv), path, prefix="metadata ")


def config_from_gguf(fields: Any, tensor_names: Iterable[str] | None = None, *, path: object = None) -> dict:
    """A config.json dict (transformers layout) from GGUF metadata, for llama / qwen2 / qwen3.

    ``fields``: a :class:`gguf.GGUFReader`, its ``.fields``, or a plain ``{key: value}`` dict.
    ``tensor_names`` (taken from the reader when one is passed) decides ``tie_word_embeddings``
    (no ``output.weight``) and llama's ``attention_bias`` / ``mlp_bias``; without it the model is
    assumed untied and bias-free. A llama-3 ``rope_freqs`` tensor is not turned back into
    ``rope_scaling`` (its parameters are not recoverable from the factors alone).
    Every value is type- and range-checked (BadInput naming ``path`` and the key); whether the values
    agree with the tensors is :func:`check_gguf_tensors`' job.
    """
    if tensor_names is None and hasattr(fields, "tensors") and not isinstance(fields, Mapping):
        tensor_names = [t.name for t in fields.tensors]
    kv = field_values(fields)
    arch = kv.get("general.architecture")
    if not isinstance(arch, str) or arch_by_name(arch) is None:
        raise QConvertError(f"GGUF architecture {arch!r:.60} cannot be turned into a config.json; "
                            f"supported: {', '.join(SUPPORTED_ARCHS)}", path=path)
    cv = _typed(kv, path)

    def get(key: str, default: Any = None, required: bool = False, kind: str = "int", **bounds) -> Any:
        full = f"{arch}.{key}"
        if full not in kv:
            if required:
                raise BadInput(f"GGUF metadata lacks {full}", path=path)
            return default
        return cv.int(full, **bounds) if kind == "int" else cv.float(full, **bounds)

    n_embd = get("embedding_length", required=True, lo=1, hi=MAX_WIDTH)
    n_head = get("attention.head_count", required=True, lo=1, hi=MAX_HEADS)
    n_kv = get("attention.head_count_kv", n_head, lo=1, hi=n_head)
    if n_head % n_kv:
        raise BadInput(f"metadata {arch}.attention.head_count {n_head} is not a multiple of "
                       f"{arch}.attention.head_count_kv {n_kv}", path=path)
    if f"{arch}.attention.key_length" in kv:
        hd = get("attention.key_length", lo=1, hi=MAX_WIDTH)
    elif n_embd % n_head:
        raise BadInput(f"metadata {arch}.embedding_length {n_embd} is not a multiple of "
                       f"{arch}.attention.head_count {n_head} (and no {arch}.attention.key_length is given)", path=path)
    else:
        hd = n_embd // n_head
    hd_v = get("attention.value_length", hd, lo=1, hi=MAX_WIDTH)
    tokens = kv.get("tokenizer.ggml.tokens")
    if tokens is not None and not isinstance(tokens, list):
        raise BadInput("metadata tokenizer.ggml.tokens is not an array", path=path)
    n_vocab = len(tokens) if tokens else get("vocab_size", lo=1, hi=MAX_VOCAB)
    if n_vocab is None:
        raise BadInput("GGUF metadata has neither tokenizer.ggml.tokens nor a vocab_size", path=path)
    spec = arch_by_name(arch)
    cls, model_type = spec.hf_class, spec.model_type
    cfg: dict[str, Any] = {
        "architectures": [cls],
        "model_type": model_type,
        "hidden_size": n_embd,
        "intermediate_size": get("feed_forward_length", required=True, lo=1, hi=MAX_WIDTH),
        "num_hidden_layers": get("block_count", required=True, lo=1),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": hd,
        "max_position_embeddings": get("context_length", required=True, lo=1),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", _DEFAULT_RMS_EPS, kind="float", lo=0.0, hi=1.0),
        "rope_theta": get("rope.freq_base", _DEFAULT_ROPE_THETA, kind="float", lo=1e-30),
        "vocab_size": int(n_vocab),
        "hidden_act": "silu",
    }
    if hd_v != hd:  # transformers has one head_dim: check_gguf_tensors refuses this after naming any bad shape
        cfg["_value_head_dim"] = hd_v
    names = set(tensor_names) if tensor_names is not None else None
    cfg["tie_word_embeddings"] = bool(names is not None and "output.weight" not in names)
    if arch == "llama":
        cfg["attention_bias"] = bool(names and "blk.0.attn_q.bias" in names)
        cfg["mlp_bias"] = bool(names and "blk.0.ffn_up.bias" in names)
    elif arch == "qwen3":
        cfg["attention_bias"] = bool(names and "blk.0.attn_q.bias" in names)
    if arch in ("qwen2", "qwen3"):
        cfg["use_sliding_window"] = False

    stype = cv.str(f"{arch}.rope.scaling.type", default=None)
    if stype in ("linear", "yarn"):
        scaling: dict[str, Any] = {"rope_type": stype,
                                   "factor": get("rope.scaling.factor", 1.0, kind="float", lo=1e-30)}
        if stype == "yarn":
            for key, hf, kind in (("rope.scaling.original_context_length", "original_max_position_embeddings", "int"),
                                  ("rope.scaling.yarn_ext_factor", "extrapolation_factor", "float"),
                                  ("rope.scaling.yarn_attn_factor", "attention_factor", "float"),
                                  ("rope.scaling.yarn_beta_fast", "beta_fast", "float"),
                                  ("rope.scaling.yarn_beta_slow", "beta_slow", "float")):
                if get(key, kind=kind) is not None:
                    scaling[hf] = get(key, kind=kind)
        cfg["rope_scaling"] = scaling

    if arch in _ARCH_CONFIG:
        _ARCH_CONFIG[arch](cfg, get, names, cv)
    for typ, key in (("bos", "tokenizer.ggml.bos_token_id"), ("eos", "tokenizer.ggml.eos_token_id"),
                     ("pad", "tokenizer.ggml.padding_token_id")):
        if key in kv:
            tid = cv.int(key, lo=0)
            if tid < n_vocab:  # llama.cpp ignores an id outside the vocabulary; so does the config
                cfg[f"{typ}_token_id"] = tid
    return cfg


def _moe_config(cfg: dict, get, names, cv) -> None:
    """The routed-expert fields every MoE family shares (transformers 5 names the count num_local_experts,
    as Mixtral always did, and still reads num_experts from older Qwen-MoE configs)."""
    n_expert = get("expert_count", lo=1, hi=1 << 16)
    if n_expert is None:
        return
    cfg["num_local_experts"] = n_expert
    cfg["num_experts_per_tok"] = get("expert_used_count", required=True, lo=1, hi=n_expert)
    ff_exp = get("expert_feed_forward_length", lo=1, hi=MAX_WIDTH)
    if ff_exp is not None:
        cfg["moe_intermediate_size"] = ff_exp


def _llama_config(cfg: dict, get, names, cv) -> None:
    if get("expert_count") is not None:  # llama with experts is Mixtral
        cfg.update(architectures=["MixtralForCausalLM"], model_type="mixtral", sliding_window=None)
        cfg.pop("attention_bias", None)
        cfg.pop("mlp_bias", None)
        _moe_config(cfg, get, names, cv)


def _qwen2moe_config(cfg: dict, get, names, cv) -> None:
    _moe_config(cfg, get, names, cv)
    shared = get("expert_shared_feed_forward_length", lo=1, hi=MAX_WIDTH)
    cfg.update(num_experts=cfg["num_local_experts"], shared_expert_intermediate_size=shared or 0,
               norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=True,
               use_sliding_window=False)


def _qwen3moe_config(cfg: dict, get, names, cv) -> None:
    _moe_config(cfg, get, names, cv)
    # llama.cpp's qwen3moe renormalises the top-k weights (build_moe_ffn norm_w), as Qwen3-MoE's configs ask
    cfg.update(num_experts=cfg["num_local_experts"], norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
               use_sliding_window=False, attention_bias=bool(names and "blk.0.attn_q.bias" in names))


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


def _phi3_config(cfg: dict, get, names, cv) -> None:
    rope_dims = get("rope.dimension_count", lo=1, hi=MAX_WIDTH)
    if rope_dims is not None and rope_dims != cfg["head_dim"]:
        cfg["partial_rotary_factor"] = rope_dims / cfg["head_dim"]
    cfg["original_max_position_embeddings"] = get("rope.scaling.original_context_length",
                                                  cfg["max_position_embeddings"], lo=1)
    window = get("attention.sliding_window", 0, lo=0)
    cfg["sliding_window"] = window or None  # zero: Phi-4, no window
    cfg.setdefault("pad_token_id", None)


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


def _gpt_oss_config(cfg: dict, get, names, cv) -> None:
    """gpt-oss as llama.cpp runs it: experts intermediate_size wide (expert_feed_forward_length), biases
    everywhere, local layers in llama.cpp's pattern (sliding_window_pattern if the file has one, else every
    other layer from layer 0: load_swa_pattern(ml, 2)), YaRN with its correction range rounded (truncate
    true: ggml_rope_yarn_corr_dims), and the clamped SwiGLU's constants llama.cpp hard-codes."""
    from .archs import GPT_OSS_SWIGLU, gpt_oss_layer_types

    _moe_config(cfg, get, names, cv)
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


_ARCH_CONFIG = {"deepseek2": _deepseek2_config, "llama": _llama_config, "qwen2moe": _qwen2moe_config, "qwen3moe": _qwen3moe_config,
                "gemma2": _gemma2_config, "gemma3": _gemma3_config, "phi3": _phi3_config,
                "gpt-oss": _gpt_oss_config}


# --------------------------------------------------------------------------------------------------
# the metadata against the tensors (both directions)
# --------------------------------------------------------------------------------------------------
_BLOCK_RE = re.compile(r"^blk\.(0|[1-9][0-9]*)\.")
# per layer of a MoE model, the routed FFN llama.cpp's loaders require in place of the dense one
_MOE_BLOCK = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def _required_block(arch: str, layer_names: set[str]) -> tuple[str, ...]:
    """The tensors llama.cpp's loader for `arch` requires in a layer (biases are optional). A MoE model's
    layer is routed when it holds any routed tensor (DeepSeek and Qwen-MoE may keep dense layers)."""
    spec = arch_by_name(arch)
    has_routed = any(n in layer_names for n in _MOE_BLOCK)
    has_dense = any(n in layer_names for n in spec.dense_ffn)
    routed = has_routed or (spec.moe and not has_dense)
    return spec.norms + spec.attention + spec.block_extra + (_MOE_BLOCK if routed else spec.dense_ffn)


def _expected_shapes(cfg: Mapping, keys: Mapping[str, str]) -> dict[str, tuple[tuple[int, ...], str]]:
    """GGUF base name (``blk.N.`` stripped) -> (HF-order shape, the metadata it follows from) for the
    weights and biases of a llama / qwen2 / qwen3 model. ``keys`` names each hyper-parameter."""
    e, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    k = keys

    def says(*names: str) -> str:
        return ", ".join(f"{k[n]} {cfg[n]}" for n in names)

    hdv = cfg.get("_value_head_dim", hd)
    q, kvr, qv, kvv = nh * hd, nkv * hd, nh * hdv, nkv * hdv
    vk = "_value_head_dim" if "_value_head_dim" in cfg else "head_dim"
    heads = ("num_attention_heads", "head_dim", "hidden_size")
    kv_heads = ("num_key_value_heads", "head_dim", "hidden_size")
    ffn = ("intermediate_size", "hidden_size")
    out = {
        "token_embd.weight": ((v, e), says("vocab_size", "hidden_size")),
        "output.weight": ((v, e), says("vocab_size", "hidden_size")),
        "output_norm.weight": ((e,), says("hidden_size")),
        "attn_norm.weight": ((e,), says("hidden_size")),
        "ffn_norm.weight": ((e,), says("hidden_size")),
        "attn_q.weight": ((q, e), says(*heads)),
        "attn_k.weight": ((kvr, e), says(*kv_heads)),
        "attn_v.weight": ((kvv, e), says("num_key_value_heads", vk, "hidden_size")),
        "attn_output.weight": ((e, qv), says("num_attention_heads", vk, "hidden_size")),
        "attn_q.bias": ((q,), says("num_attention_heads", "head_dim")),
        "attn_k.bias": ((kvr,), says("num_key_value_heads", "head_dim")),
        "attn_v.bias": ((kvv,), says("num_key_value_heads", vk)),
        "attn_output.bias": ((e,), says("hidden_size")),
        "attn_q_norm.weight": ((hd,), says("head_dim")),
        "attn_k_norm.weight": ((hd,), says("head_dim")),
        "ffn_gate.weight": ((f, e), says(*ffn)),
        "ffn_up.weight": ((f, e), says(*ffn)),
        "ffn_down.weight": ((e, f), says(*ffn)),
        "ffn_gate.bias": ((f,), says("intermediate_size")),
        "ffn_up.bias": ((f,), says("intermediate_size")),
        "ffn_down.bias": ((e,), says("hidden_size")),
        "rope_freqs.weight": ((hd // 2,), says("head_dim")),
        "post_attention_norm.weight": ((e,), says("hidden_size")),
        "post_ffw_norm.weight": ((e,), says("hidden_size")),
    }
    spec = arch_by_name(cfg.get("_arch", ""))
    if spec is not None and spec.mla:  # latent attention: its projections follow the lora ranks, not head_dim
        for name in [n for n in out if n.startswith(("attn_q.", "attn_k.", "attn_v.", "attn_output.", "attn_q_norm",
                                                       "attn_k_norm"))]:
            del out[name]
    if cfg.get("_arch") == "phi3":  # fused projections: q, k, v rows in one, gate and up rows in one
        out["attn_qkv.weight"] = ((q + 2 * kvr, e), says(*heads, "num_key_value_heads"))
        out["ffn_up.weight"] = ((2 * f, e), says(*ffn))
        del out["ffn_gate.weight"]
    n_exp, f_exp = cfg.get("_n_expert"), cfg.get("_expert_ff")
    if n_exp and f_exp:
        exp = ("_n_expert", "_expert_ff", "hidden_size")
        out["ffn_gate_inp.weight"] = ((n_exp, e), says("_n_expert", "hidden_size"))
        out["ffn_gate_exps.weight"] = ((n_exp, f_exp, e), says(*exp))
        out["ffn_up_exps.weight"] = ((n_exp, f_exp, e), says(*exp))
        out["ffn_down_exps.weight"] = ((n_exp, e, f_exp), says(*exp))
    if n_exp and f_exp:  # gpt-oss: the router's and every expert's biases
        out["ffn_gate_inp.bias"] = ((n_exp,), says("_n_expert"))
        out["ffn_gate_exps.bias"] = ((n_exp, f_exp), says("_n_expert", "_expert_ff"))
        out["ffn_up_exps.bias"] = ((n_exp, f_exp), says("_n_expert", "_expert_ff"))
        out["ffn_down_exps.bias"] = ((n_exp, e), says("_n_expert", "hidden_size"))
    out["attn_sinks.weight"] = ((nh,), says("num_attention_heads"))
    f_sh = cfg.get("_shared_ff")
    if f_sh:
        out["ffn_gate_shexp.weight"] = ((f_sh, e), says("_shared_ff", "hidden_size"))
        out["ffn_up_shexp.weight"] = ((f_sh, e), says("_shared_ff", "hidden_size"))
        out["ffn_down_shexp.weight"] = ((e, f_sh), says("_shared_ff", "hidden_size"))
    return out


_EXPERT_KEYS = (("_n_expert", EXPERT_COUNT_KEYS, "expert_count"),
                ("_expert_ff", ("moe_intermediate_size",), "expert_feed_forward_length"),
                ("_shared_ff", ("shared_expert_intermediate_size",), "expert_shared_feed_forward_length"))


def _expert_facts(config: Mapping, arch: str, cv: ConfigView, label) -> tuple[dict, dict]:
    """The sizes the expert tensors' shapes follow from (the routed experts, their FFN width, the shared
    expert's), as `_expected_shapes` reads them, and the key each came from (`label(config key)`, for
    the messages). Mixtral's experts are intermediate_size wide."""
    facts: dict = {"_arch": arch}
    keys: dict = {}
    for fact, config_keys, _ in _EXPERT_KEYS:
        for k in config_keys:
            if config.get(k) is not None:
                facts[fact] = cv.int(k, lo=0, hi=MAX_WIDTH)
                keys[fact] = label(k)
                break
    if facts.get("_n_expert") and not facts.get("_expert_ff"):
        facts["_expert_ff"] = int(config["intermediate_size"])
        keys["_expert_ff"] = label("intermediate_size")
    return facts, keys


def _layers_present(names: Iterable[str], path_of, label) -> int:
    """The number of layers the tensor names hold: blocks 0 .. n-1, each with at least one tensor (a
    gap is refused here, so that n is bounded by the tensor count, whatever index a name carries)."""
    first: dict[int, str] = {}
    for n in names:
        if n.startswith("blk."):
            m = _BLOCK_RE.match(n)
            if m is None:
                raise BadInput("block tensor name without a block number blk.N.", path=path_of(n), tensor=label(n))
            first.setdefault(int(m.group(1)), n)
    for expect, index in enumerate(sorted(first)):
        if index != expect:
            raise BadInput(f"the tensors skip layer {expect} (no blk.{expect}.* tensor) but name layer {index}",
                           path=path_of(first[index]), tensor=label(first[index]))
    return len(first)


def _check_against(cfg: Mapping, shapes: Mapping[str, tuple[int, ...]], keys: Mapping[str, str], arch: str,
                   path_of, label, layers_key: str, what: str) -> None:
    """``shapes``: GGUF name -> HF-order shape of every tensor present; ``path_of(name)`` the file to
    name (name None: the file of the metadata), ``label(name)`` the tensor name to show."""
    n_layers = cfg["num_hidden_layers"]
    present = _layers_present(shapes, path_of, label)
    if present != n_layers:
        span = f"blk.0 .. blk.{present - 1}" if present else "no blk.N tensors"
        raise BadInput(f"{layers_key} is {n_layers} but the {what} hold {present} layers ({span})",
                       path=path_of(None))
    required = ["token_embd.weight", "output_norm.weight"]
    in_layer: dict[int, set[str]] = {}
    for name in shapes:
        m = _BLOCK_RE.match(name)
        if m:
            in_layer.setdefault(int(m.group(1)), set()).add(name[m.end():].rsplit(".", 1)[0])
    for i in range(n_layers):  # bounded: n_layers equals the layers the tensors name
        required += [f"blk.{i}.{b}.weight" for b in _required_block(arch, in_layer.get(i, set()))]
    for name in required:
        if name not in shapes:
            raise BadInput("required tensor is missing (" + (f"{arch} needs it in each of the {n_layers} layers)"
                           if name.startswith("blk.") else f"every {arch} model has it)"),
                           path=path_of(None), tensor=label(name))
    expected = _expected_shapes(cfg, keys)
    order = {base: i for i, base in enumerate(expected)}

    def split(name: str) -> tuple[int, str]:
        m = _BLOCK_RE.match(name)
        return (int(m.group(1)), name[m.end():]) if m else (-1, name)

    # the model's tensors first, then layer by layer in the table's order: the first contradiction is named
    for name in sorted(shapes, key=lambda n: (split(n)[0], order.get(split(n)[1], len(order)), n)):
        shape, base = shapes[name], split(name)[1]
        want = expected.get(base)
        if want is not None and tuple(shape) != want[0]:
            raise BadInput(f"shape {list(shape)} contradicts the {'metadata' if what == 'tensors' else 'config'} "
                           f"({want[1]}), which give {list(want[0])}", path=path_of(name), tensor=label(name))


def check_gguf_tensors(cfg: Mapping, arch: str, shapes: Mapping[str, tuple[int, ...]], *, path: object = None,
                       where: Mapping[str, object] | None = None) -> None:
    """A GGUF's metadata (as :func:`config_from_gguf` turned it into ``cfg``) against its tensors:
    ``block_count`` equals the layers present, every tensor llama.cpp requires for them is there, and
    every known tensor has the shape the hyper-parameters give. ``shapes``: GGUF name -> HF-order shape."""
    keys = {"hidden_size": f"{arch}.embedding_length", "intermediate_size": f"{arch}.feed_forward_length",
            "vocab_size": "vocab size (tokenizer.ggml.tokens)", "head_dim": f"{arch}.attention.key_length",
            "num_attention_heads": f"{arch}.attention.head_count",
            "num_key_value_heads": f"{arch}.attention.head_count_kv", "num_hidden_layers": f"{arch}.block_count"}
    keys = dict(keys, _value_head_dim=f"{arch}.attention.value_length")
    metadata_key = {hf: f"{arch}.{g}" for _, hfs, g in _EXPERT_KEYS for hf in hfs}
    metadata_key["intermediate_size"] = f"{arch}.feed_forward_length"
    if arch == "gpt-oss":  # its config's intermediate_size is the experts' width (_gpt_oss_config)
        metadata_key["intermediate_size"] = keys["intermediate_size"] = f"{arch}.expert_feed_forward_length"
    facts, fact_keys = _expert_facts(cfg, arch, ConfigView(dict(cfg), path), lambda k: metadata_key.get(k, k))
    cfg = {**cfg, **facts}
    keys.update(fact_keys)
    where = where or {}
    _check_against(cfg, shapes, keys, arch, lambda n: where.get(n, path) if n else path, lambda n: n,
                   f"metadata {arch}.block_count", "tensors")
    if cfg.get("_value_head_dim", cfg["head_dim"]) != cfg["head_dim"]:
        raise BadInput(f"metadata {arch}.attention.value_length {cfg['_value_head_dim']} differs from "
                       f"{arch}.attention.key_length {cfg['head_dim']}: transformers' {arch} has one head_dim",
                       path=path)


# --------------------------------------------------------------------------------------------------
# the writer's inputs: config.json against the tensors being written
# --------------------------------------------------------------------------------------------------
def config_json_path(source) -> Path:
    """The file a source's config came from: config.json in a checkpoint folder, else the file itself."""
    p = Path(getattr(source, "path", "."))
    return p / "config.json" if p.is_dir() else p


def layer_count(config: Mapping, path: object) -> int:
    """num_hidden_layers as an integer >= 1 (whether the tensors agree is check_writer_config's job)."""
    return ConfigView(config, path).int("num_hidden_layers", lo=1)


_ROPE_TYPES = ("default", "linear", "yarn", "llama3", "dynamic")
_ARCH_ROPE_TYPES = {"phi3": ("longrope", "su")}  # llama.cpp's phi3 holds Phi-3's long/short factor tables


def _check_rope(config: Mapping, path: object, arch: str = "") -> None:
    """The rope settings GGUF can hold (what _add_rope_scaling and rope_freqs_tensor write), checked
    before writing: a type GGUF cannot store, a scaling without its factor, llama3 frequencies that
    would divide by zero."""
    cv = ConfigView(config, path)
    for key in ("rope_scaling", "rope_parameters"):  # a wrong type is named by its own key first
        cv.view(key, default=None)
    rp = rope_parameters(config)
    where = "rope_parameters" if isinstance(config.get("rope_parameters"), Mapping) else "rope_scaling"
    r = ConfigView(rp, path, prefix=f"{where}.")
    rtype = rp["rope_type"]
    allowed = _ROPE_TYPES + _ARCH_ROPE_TYPES.get(arch, ())
    if rtype not in allowed:
        raise BadInput(f"{where} type {rtype!r} cannot be stored in GGUF for this architecture "
                       f"(supported: {', '.join(t for t in allowed if t not in ('default', 'dynamic'))})", path=path)
    if rtype in ("longrope", "su"):
        rope_dims = _phi3_rope_dims(config)
        for key in ("long_factor", "short_factor"):
            factors = rp.get(key)
            if not isinstance(factors, list) or len(factors) != rope_dims // 2 or not all(
                    isinstance(f, (int, float)) and not isinstance(f, bool) for f in factors):
                raise BadInput(f"{where}.{key} must be a list of {rope_dims // 2} numbers (half the rotated "
                               "dimensions)", path=path)
    r.float("rope_theta", lo=1e-30, hi=_FLOAT32_MAX)
    if rtype in ("linear", "yarn"):
        r.float("factor", lo=1e-30, hi=_FLOAT32_MAX)
    if rtype == "llama3":
        r.float("factor", default=8.0, lo=1e-30, hi=_FLOAT32_MAX)
        low = r.float("low_freq_factor", default=1.0, lo=1e-30, hi=_FLOAT32_MAX)
        high = r.float("high_freq_factor", default=4.0, lo=1e-30, hi=_FLOAT32_MAX)
        r.int("original_max_position_embeddings", default=8192, lo=1, hi=2**32 - 1)
        if high <= low:
            raise BadInput(f"{where}.high_freq_factor {high} is not above low_freq_factor {low} (llama3 rope "
                           "interpolates between them)", path=path)


def check_writer_config(config: Mapping, arch: str, shapes: Mapping[str, tuple[int, ...]], path: object,
                        names: Mapping[str, str] | None = None, unmapped: Iterable[str] = ()) -> None:
    """The hyper-parameters a GGUF is written with (config.json's), type- and range-checked and compared
    with the tensors being written (``shapes``: GGUF name -> HF-order shape; ``names``: GGUF name ->
    the source's name, for the messages); BadInput naming ``path`` and the key. Run before anything
    is written, so a bad config stops the conversion."""
    cv = ConfigView(config, path)
    n_embd = cv.int("hidden_size", lo=1, hi=MAX_WIDTH)
    n_head = cv.int("num_attention_heads", lo=1, hi=MAX_HEADS)
    n_kv = cv.int("num_key_value_heads", default=n_head, lo=1, hi=n_head)
    if n_head % n_kv:
        raise BadInput(f"num_attention_heads {n_head} is not a multiple of num_key_value_heads {n_kv}", path=path)
    hd = cv.int("head_dim", default=None, lo=1, hi=MAX_WIDTH)
    if hd is None:
        if n_embd % n_head:
            raise BadInput(f"hidden_size {n_embd} is not a multiple of num_attention_heads {n_head} (and no "
                           "head_dim is given)", path=path)
        hd = n_embd // n_head
    cfg = {"hidden_size": n_embd, "num_attention_heads": n_head, "num_key_value_heads": n_kv, "head_dim": hd,
           "intermediate_size": cv.int("intermediate_size", lo=1, hi=MAX_WIDTH),
           "num_hidden_layers": cv.int("num_hidden_layers", lo=1),
           "vocab_size": cv.int("vocab_size", default=None, lo=1, hi=MAX_VOCAB)}
    cv.int("max_position_embeddings", lo=1, hi=2**32 - 1)
    cv.float("rms_norm_eps", default=None, lo=0.0, hi=1.0)
    cv.float("rope_theta", default=None, lo=1e-30, hi=_FLOAT32_MAX)
    cv.bool("tie_word_embeddings", default=None)
    _check_rope(config, path, arch)
    for key in ("rope_scaling", "rope_parameters"):
        sub = cv.view(key, default=None)
        if sub is None:
            continue
        groups = [sub] if not (sub.data and all(isinstance(v, Mapping) for v in sub.data.values())) else \
            [sub.view(k) for k in sub.data]
        for g in groups:
            g.str("rope_type", default=None)
            g.str("type", default=None)
            g.float("rope_theta", default=None, lo=1e-30, hi=_FLOAT32_MAX)
            g.float("factor", default=None, lo=1e-30, hi=_FLOAT32_MAX)
            g.int("original_max_position_embeddings", default=None, lo=1, hi=2**32 - 1)
            for name in ("low_freq_factor", "high_freq_factor", "extrapolation_factor", "attention_factor",
                         "attn_factor", "beta_fast", "beta_slow"):
                g.float(name, default=None, lo=-_FLOAT32_MAX, hi=_FLOAT32_MAX)
    facts, names_of_keys = _expert_facts(config, arch, cv, lambda k: k)
    cfg.update(facts)
    emb = shapes.get("token_embd.weight")
    if cfg["vocab_size"] is None:
        cfg["vocab_size"] = emb[0] if emb else 0
    for name in unmapped:  # a tensor of a layer the config does not count has no GGUF name
        layer = layer_index(name)
        if layer is not None and layer >= cfg["num_hidden_layers"]:
            raise BadInput(f"num_hidden_layers is {cfg['num_hidden_layers']} but the checkpoint has tensors of "
                           f"layer {layer} ({name})", path=path)
    keys = {k: k for k in cfg}
    keys.update(names_of_keys)
    names = names or {}
    _check_against(cfg, shapes, keys, arch, lambda n: path, lambda n: names.get(n, n), "num_hidden_layers",
                   "checkpoint's tensors")

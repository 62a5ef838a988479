"""GGUF model metadata (hyper-parameters) for llama / qwen2 / qwen3, both directions.

* :func:`add_model_metadata` writes every ``{arch}.*`` and ``general.*`` key llama.cpp needs to load
  the model (see shared/specs/gguf.md section 3).
* :func:`rope_freqs_tensor` computes the ``rope_freqs.weight`` tensor llama-3 style rope scaling
  needs (llama.cpp divides each rotation frequency by its factor).
* :func:`config_from_gguf` rebuilds a config.json dict from a GGUF file's metadata.

Accepts both config.json layouts: transformers < 5 (``rope_theta`` + ``rope_scaling``) and
transformers >= 5 (``rope_parameters`` holding ``rope_theta``, ``rope_type`` and the scaling fields).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Iterable, Mapping

import gguf
import numpy as np

from ...converters.errors import BadInput, QConvertError
from .names import SUPPORTED_ARCHS, head_dim

__all__ = [
    "add_model_metadata",
    "rope_parameters",
    "rope_freqs_tensor",
    "config_from_gguf",
    "field_values",
]

logger = logging.getLogger(__name__)

_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_RMS_EPS = 1e-6


def _require(config: Mapping, key: str) -> Any:
    value = config.get(key)
    if value is None:
        raise BadInput(f"config.json lacks {key}, which GGUF needs")
    return value


def rope_parameters(config: Mapping) -> dict:
    """Rope settings as one dict: ``rope_theta`` (always present), ``rope_type`` ("default",
    "linear", "yarn", "llama3", "dynamic", ...) and the scaling fields (``factor``,
    ``original_max_position_embeddings``, ``low_freq_factor``, ...), from either config layout."""
    out: dict = {}
    params = config.get("rope_parameters")
    if isinstance(params, Mapping):
        # transformers 5: one dict (a dict of dicts keyed by layer type for hybrid models)
        if params and all(isinstance(v, Mapping) for v in params.values()):
            params = params.get("full_attention") or next(iter(params.values()))
        out.update(params)
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


def _default_name(config: Mapping) -> str:
    src = str(config.get("_name_or_path") or "").rstrip("/")
    return src.rsplit("/", 1)[-1] if src else "model"


def add_model_metadata(writer: gguf.GGUFWriter, config: Mapping, arch: str, *, file_type: int,
                       name: str | None = None) -> None:
    """Write the model hyper-parameters llama.cpp reads for ``arch`` (llama, qwen2, qwen3), plus
    ``general.file_type`` (a :class:`gguf.LlamaFileType` value), ``general.quantization_version``
    and ``general.name``. Tokenizer keys are written by ``tokenizer.add_tokenizer``; a llama-3 rope
    needs the caller to add ``rope_freqs.weight`` = :func:`rope_freqs_tensor` (F32)."""
    if arch not in SUPPORTED_ARCHS:
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
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(float(rp["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps") or _DEFAULT_RMS_EPS))
    if config.get("head_dim") or hd * n_head != n_embd:
        writer.add_key_length(hd)
        writer.add_value_length(hd)
    if arch == "llama":
        writer.add_vocab_size(int(_require(config, "vocab_size")))
        writer.add_rope_dimension_count(hd)

    _add_rope_scaling(writer, rp)

    writer.add_file_type(int(file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _add_rope_scaling(writer: gguf.GGUFWriter, rp: Mapping) -> None:
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
    elif rtype == "llama3":
        pass  # carried by the rope_freqs.weight tensor (rope_freqs_tensor)
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
_HF_CLASS = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
             "qwen3": ("Qwen3ForCausalLM", "qwen3")}


def field_values(fields: Any) -> dict[str, Any]:
    """Python values of a GGUF file's metadata: accepts a :class:`gguf.GGUFReader`, its ``fields``
    mapping (``ReaderField`` values) or an already plain ``{key: value}`` mapping."""
    if hasattr(fields, "fields") and not isinstance(fields, Mapping):
        fields = fields.fields
    out = {}
    for k, v in fields.items():
        out[k] = v.contents() if hasattr(v, "contents") and callable(v.contents) else v
    return out


def config_from_gguf(fields: Any, tensor_names: Iterable[str] | None = None) -> dict:
    """A config.json dict (transformers layout) from GGUF metadata, for llama / qwen2 / qwen3.

    ``fields``: a :class:`gguf.GGUFReader`, its ``.fields``, or a plain ``{key: value}`` dict.
    ``tensor_names`` (taken from the reader when one is passed) decides ``tie_word_embeddings``
    (no ``output.weight``) and llama's ``attention_bias`` / ``mlp_bias``; without it the model is
    assumed untied and bias-free. A llama-3 ``rope_freqs`` tensor is not turned back into
    ``rope_scaling`` (its parameters are not recoverable from the factors alone).
    """
    if tensor_names is None and hasattr(fields, "tensors") and not isinstance(fields, Mapping):
        tensor_names = [t.name for t in fields.tensors]
    kv = field_values(fields)
    arch = kv.get("general.architecture")
    if arch not in _HF_CLASS:
        raise QConvertError(f"GGUF architecture {arch!r} cannot be turned into a config.json; "
                            f"supported: {', '.join(SUPPORTED_ARCHS)}")

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        full = f"{arch}.{key}"
        if full in kv:
            return kv[full]
        if required:
            raise BadInput(f"GGUF metadata lacks {full}")
        return default

    n_embd = int(get("embedding_length", required=True))
    n_head = int(get("attention.head_count", required=True))
    n_kv = int(get("attention.head_count_kv", n_head))
    hd = int(get("attention.key_length", n_embd // n_head))
    tokens = kv.get("tokenizer.ggml.tokens")
    n_vocab = len(tokens) if tokens is not None else get("vocab_size")
    if n_vocab is None:
        raise BadInput("GGUF metadata has neither tokenizer.ggml.tokens nor a vocab_size")
    cls, model_type = _HF_CLASS[arch]
    cfg: dict[str, Any] = {
        "architectures": [cls],
        "model_type": model_type,
        "hidden_size": n_embd,
        "intermediate_size": int(get("feed_forward_length", required=True)),
        "num_hidden_layers": int(get("block_count", required=True)),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": hd,
        "max_position_embeddings": int(get("context_length", required=True)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", _DEFAULT_RMS_EPS)),
        "rope_theta": float(get("rope.freq_base", _DEFAULT_ROPE_THETA)),
        "vocab_size": int(n_vocab),
        "hidden_act": "silu",
    }
    names = set(tensor_names) if tensor_names is not None else None
    cfg["tie_word_embeddings"] = bool(names is not None and "output.weight" not in names)
    if arch == "llama":
        cfg["attention_bias"] = bool(names and "blk.0.attn_q.bias" in names)
        cfg["mlp_bias"] = bool(names and "blk.0.ffn_up.bias" in names)
    elif arch == "qwen3":
        cfg["attention_bias"] = bool(names and "blk.0.attn_q.bias" in names)
    if arch in ("qwen2", "qwen3"):
        cfg["use_sliding_window"] = False

    stype = get("rope.scaling.type")
    if stype in ("linear", "yarn"):
        scaling: dict[str, Any] = {"rope_type": stype, "factor": float(get("rope.scaling.factor", 1.0))}
        if stype == "yarn":
            for key, hf in (("rope.scaling.original_context_length", "original_max_position_embeddings"),
                            ("rope.scaling.yarn_ext_factor", "extrapolation_factor"),
                            ("rope.scaling.yarn_attn_factor", "attention_factor"),
                            ("rope.scaling.yarn_beta_fast", "beta_fast"),
                            ("rope.scaling.yarn_beta_slow", "beta_slow")):
                if get(key) is not None:
                    scaling[hf] = get(key)
        cfg["rope_scaling"] = scaling

    for typ, key in (("bos", "tokenizer.ggml.bos_token_id"), ("eos", "tokenizer.ggml.eos_token_id"),
                     ("pad", "tokenizer.ggml.padding_token_id")):
        if key in kv:
            cfg[f"{typ}_token_id"] = int(kv[key])
    return cfg

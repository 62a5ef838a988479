"""GGUF model metadata written from config.json: every `{arch}.*` and `general.*` key llama.cpp needs to load the
model, as llama.cpp's convert_hf_to_gguf.py writes them and its llama-model.cpp reads them (the architecture's
own keys are its entry's hook: archs/), and the F32 tensors a rope scaling is stored as.

Accepts both config.json layouts: transformers < 5 (``rope_theta`` + ``rope_scaling``) and
transformers >= 5 (``rope_parameters`` holding ``rope_theta``, ``rope_type`` and the scaling fields).
"""

from __future__ import annotations

import logging
import math
import struct
from typing import Mapping

import gguf
import numpy as np

from ...converters.errors import BadInput, QConvertError
from .archs import arch_by_name
from .hparams import head_dim
from .names import supported_archs
from .hparams import DEFAULT_RMS_EPS, require, rope_freqs_tensor, rope_parameters


logger = logging.getLogger(__name__)


def rope_tensors(config: Mapping, arch: str) -> list[tuple[str, np.ndarray]]:
    """The F32 tensors a rope scaling is stored as: llama-3's rope_freqs.weight, Phi-3's longrope
    rope_factors_long / rope_factors_short.weight (the factor tables, one per rotated pair)."""
    rp = rope_parameters(config)
    if arch_by_name(arch).arch_rope_tensors is not None:
        return arch_by_name(arch).arch_rope_tensors(config)
    if rp["rope_type"] in arch_by_name(arch).extra_rope_types:
        return [("rope_factors_long.weight", np.asarray(rp["long_factor"], dtype=np.float32)),
                ("rope_factors_short.weight", np.asarray(rp["short_factor"], dtype=np.float32))]
    freqs = rope_freqs_tensor(config)
    return [] if freqs is None else [("rope_freqs.weight", freqs.astype(np.float32))]


def _default_name(config: Mapping) -> str:
    src = str(config.get("_name_or_path") or "").rstrip("/")
    return src.rsplit("/", 1)[-1] if src else "model"


class _KeysRead(dict):
    """config.json as the metadata functions read it, with the keys they read in order. The architectures' hooks
    (archs/*.py) convert dozens of keys with int() / float(); a value of another type there (a list where a count
    belongs: the fuzzer's `num_experts_per_tok: [1, 2]`) raises in the hook, and is refused naming the key that
    was read with a value no count or width can be, instead of as a crash."""

    def __init__(self, config: Mapping):
        super().__init__(config)
        self.read: list[str] = []

    def __getitem__(self, key):
        self.read.append(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.append(key)
        return super().get(key, default)

    def culprit(self, packing: bool = False) -> str | None:
        """The key to name. A conversion in a hook (int(config[k])) fails on the key it has just read: the most
        recently read key whose value is not a number (a list, a string, null, inf). gguf-py's packing fails
        later, on any key: with `packing`, the most recently read key holding a number outside [0, 2**32). None
        when no such key was read (the error is then ours, and stays a crash)."""
        def suspect(v) -> bool:
            numeric = isinstance(v, (int, float)) and not isinstance(v, bool)
            if packing:  # a hook may have turned a float into the count packed (sliding_window: -1e300)
                return numeric and not 0 <= v < 1 << 32
            if not numeric:
                return True
            return abs(v) >= 1 << 63 if isinstance(v, int) else not math.isfinite(v)

        for key in reversed(self.read):
            if key in self and suspect(dict.__getitem__(self, key)):
                return key
        return None


def add_model_metadata(writer: gguf.GGUFWriter, config: Mapping, arch: str, *, file_type: int,
                       name: str | None = None, mtp_blocks: int | None = None) -> None:
    """add_model_metadata_unchecked, with a config value its hooks cannot convert refused naming the key (the
    caller names the file)."""
    config = _KeysRead(config)
    try:
        add_model_metadata_unchecked(writer, config, arch, file_type=file_type, name=name, mtp_blocks=mtp_blocks)
        _check_packable(writer)  # gguf-py packs the values only when the header is written
    except (TypeError, ValueError, OverflowError, struct.error) as e:
        key = config.culprit(packing=isinstance(e, struct.error))
        if key is None:
            raise
        value = repr(dict.get(config, key))
        value = value if len(value) <= 60 else value[:57] + "..."
        raise BadInput(f"{key} is {value}: not a value llama.cpp's {arch} hyper-parameters can hold") from None


_INT_RANGES = {gguf.GGUFValueType.UINT8: (0, 1 << 8), gguf.GGUFValueType.UINT16: (0, 1 << 16),
               gguf.GGUFValueType.UINT32: (0, 1 << 32), gguf.GGUFValueType.UINT64: (0, 1 << 64),
               gguf.GGUFValueType.INT8: (-(1 << 7), 1 << 7), gguf.GGUFValueType.INT16: (-(1 << 15), 1 << 15),
               gguf.GGUFValueType.INT32: (-(1 << 31), 1 << 31), gguf.GGUFValueType.INT64: (-(1 << 63), 1 << 63)}


def _check_packable(writer: gguf.GGUFWriter) -> None:
    """Every integer key (or array element) within its GGUF type's range: a negative count from config.json
    (num_experts_per_tok: -1) would otherwise fail as a struct.error when the header is packed, long after the
    key that caused it was read."""
    for kv in writer.kv_data:
        for value in kv.values():
            kind = value.sub_type if value.type == gguf.GGUFValueType.ARRAY else value.type
            if kind in _INT_RANGES:
                lo, hi = _INT_RANGES[kind]
                items = value.value if value.type == gguf.GGUFValueType.ARRAY else [value.value]
                if any(not lo <= int(v) < hi for v in items):
                    raise struct.error("argument out of range")


def add_model_metadata_unchecked(writer: gguf.GGUFWriter, config: Mapping, arch: str, *, file_type: int,
                                 name: str | None = None, mtp_blocks: int | None = None) -> None:
    """Write the model hyper-parameters llama.cpp reads for ``arch`` (llama, qwen2, qwen3), plus
    ``general.file_type`` (a :class:`gguf.LlamaFileType` value), ``general.quantization_version``
    and ``general.name``. Tokenizer keys are written by ``tokenizer.add_tokenizer``; a llama-3 rope
    needs the caller to add ``rope_freqs.weight`` = :func:`rope_freqs_tensor` (F32). ``mtp_blocks``: the
    multi-token-prediction blocks the file keeps after the trunk (archs/mtp.py), counted in block_count and
    stated as nextn_predict_layers (None: no MTP block, and no such key)."""
    spec = arch_by_name(arch)
    if spec is None:
        raise QConvertError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(supported_archs())}")
    if getattr(writer, "arch", arch) != arch:
        raise ValueError(f"writer was opened for arch {writer.arch!r}, metadata is for {arch!r}")

    n_embd = int(require(config, "hidden_size"))
    n_head = int(require(config, "num_attention_heads"))
    n_kv = int(config.get("num_key_value_heads") or n_head)
    hd = head_dim(config)
    rp = rope_parameters(config)

    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name or _default_name(config))
    writer.add_context_length(int(require(config, "max_position_embeddings")))
    writer.add_embedding_length(n_embd)
    # the MTP blocks are blocks after the trunk (written before the architecture's keys, which may size per-layer
    # arrays by block_count: Qwen3.5's recurrent_layers)
    writer.add_block_count(int(require(config, "num_hidden_layers")) + (mtp_blocks or 0))
    if mtp_blocks is not None:
        writer.add_nextn_predict_layers(int(mtp_blocks))
    if spec.dense_ffn_width or config.get(spec.dense_ffn_key) is not None:
        writer.add_feed_forward_length(int(require(config, spec.dense_ffn_key)))
    writer.add_head_count(n_head)
    writer.add_head_count_kv(spec.head_count_kv(config) if spec.head_count_kv else 1 if spec.mla else n_kv)
    writer.add_rope_freq_base(float(rp["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps") or DEFAULT_RMS_EPS))
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
    elif rtype == "llama3" or rtype in arch_by_name(arch).extra_rope_types:
        pass  # carried by tensors: rope_freqs.weight, phi3's rope_factors_long/short.weight (rope_tensors)
    elif rtype == "dynamic":
        # dynamic NTK only changes rope beyond the trained context; llama.cpp has no equivalent
        logger.warning("rope_scaling type 'dynamic' is not representable in GGUF; written as plain rope "
                       "(identical within max_position_embeddings)")
    else:
        raise BadInput(f"rope_scaling type {rtype!r} cannot be stored in GGUF for this architecture "
                       "(supported: linear, yarn, llama3)")

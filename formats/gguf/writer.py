"""GGUF writer: a complete llama.cpp model (metadata, tokenizer, tensors), written as a stream.

The plan fixes every tensor's name, shape and type first, so the header and tensor infos are written
before any data; then each tensor is encoded and appended as it arrives from the source, and dropped.

Per tensor the target type is, in order: a `--tensor-type REGEX=TYPE` match; `--type` (quantized
tensors, or every 2-D weight of a dense source); the best aligned type for a grid (4-bit symmetric ->
Q4_0, 4-bit with zero points -> Q4_1, 8-bit symmetric -> Q8_0, 3/2-bit -> Q3_K/Q2_K, which requantize);
dense tensors keep their float type, and norms and other 1-D tensors are F32 as llama.cpp wants.
A grid read from a GGUF keeps its own ggml type by default, and when the target type is the source's
its blocks are copied byte for byte (`PackedCodes` layout "ggml:<TYPE>"; verdict exact, BitIdentical).
With `--split-max-size` the output is a set of `-0000i-of-0000N.gguf` parts (gguf-py's split writer).
`--type` may name one of llama-quantize's mixes (q4_k_m, q4_k_s, q5_k_m, q5_k_s, q6_k, q8_0, q3_k_m,
q2_k: presets.py), which picks the type per tensor as llama.cpp does and sets general.file_type.

A grid planned for Q4_K/Q5_K keeps its codes in every super-block whose 6-bit sub-block scales can
hold the grid's scales exactly (kernels/ggml/kquant_grid.py; the reason says how many blocks did); the
rest is requantized. `--imatrix FILE` weighs the K quantizers as llama-quantize --imatrix does, and
`--quantizer llama.cpp` requantizes with llama.cpp's own ggml_quantize_chunk (formats/common/ggml_codec.py).

`--type iq4_nl`, `iq4_xs`, `iq3_s`, `iq3_xxs`, `iq2_s`, `iq2_xs` and `iq2_xxs` (codebook types:
kernels/ggml/iq4_nl.py, iq4_xs.py, iq3_s.py, iq2.py, byte-identical to ggml's quantize_iq4_nl / _iq4_xs / _iq3_s /
_iq3_xxs / _iq2_s / _iq2_xs / _iq2_xxs, with the --imatrix weights too) requantize every source; no grid keeps
its codes in them (schemes.py). Their rows that are not whole 256-blocks fall back to IQ4_NL; an IQ2 / IQ3_XXS
tensor without an importance vector is refused, as llama-quantize refuses it (schemes.imatrix_refusal).
`--type iq1_s` / `iq1_m` are llama-quantize's mixes for those file types (presets.py), IQ1 tensors written by
kernels/ggml/iq1.py (ggml's quantize_iq1_s / _iq1_m bytes), an importance matrix required as for the IQ2 types. A
codebook tensor of a GGUF source (float32 carrying its blocks: reader.CodebookDense) keeps its type by default
as a grid does, and into its own type its blocks are copied.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping

import gguf
import numpy as np
import torch

from ...converters.checker import EXACT, NEAR_EXACT, REFUSED, REQUANTIZE, best_aligned, check, decide, describe_grid
from ...converters.errors import BadInput, QConvertError
from ...converters.model_shapes import canonical_name
from ...converters.validate import ConfigView
from ...converters.plan import BitIdentical, Options, TensorPlan, Writer, WriterSession, unknown_type
from ...converters.records import Dense, Grid, TensorRecord, renamed
from ...converters.run import finite_params
from ...kernels.ggml.layouts import CODEBOOK_LAYOUTS, GGUF_PY_UNKNOWN, TARGET_LAYOUTS  # grid, codebook (IQ4_*) types
from ...kernels.ggml.layouts import BlockLayout
from ..common.ggml_codec import QUANTIZERS, QuantHow
from .checks import check_writer_config, config_json_path, layer_count
from .metadata import add_model_metadata, rope_tensors
from .archs import (EXPERT_COUNT_KEYS, arch_by_name, expert_count_key, gpt_oss_expert_part, kv_b_parts,
                    split_gpt_oss_experts, split_kv_b)
from .archs import KV_B_HALVES, kv_b_value_rows
from .archs import llama4_expert_part, split_llama4_experts
from .archs.base import text_model_config
from .names import expert_of, gguf_arch, layer_index, gguf_tensor_name, inverse_permutation, qk_row_permutation
from .presets import PRESETS, ModelFacts, model_facts_from_gguf_names, preset_of, preset_type, quantized_by_llama_cpp
from .tokenizer import add_tokenizer
from .schemes import ALIGNED_CANDIDATES, GGUF_SCHEMES, default_grid_type, imatrix_refusal, k_fallback
from .split import GgufPart, GgufSplitOutput
from ..common.ggml_codec import SourceValues, available_kquants, encode_tensor, tensor_scale_of

__all__ = ["GgufWriter", "best_aligned_type", "default_grid_type", "FILE_TYPES"]

# general.file_type for the dominant tensor type: gguf-py's LlamaFileType MOSTLY_<TYPE>, except where
# llama-quantize names a type's file otherwise (a K type by its _M mix, F32 ALL_F32, IQ2_S by IQ2_M: 28 makes
# IQ2_XS, MXFP4 by its _MOE name)
_FILE_TYPE_NAMES = {"F32": "ALL_F32", "Q3_K": "MOSTLY_Q3_K_M", "Q4_K": "MOSTLY_Q4_K_M", "Q5_K": "MOSTLY_Q5_K_M",
                    "IQ2_S": "MOSTLY_IQ2_M", "MXFP4": "MOSTLY_MXFP4_MOE"}
FILE_TYPES = {t: int(gguf.LlamaFileType[_FILE_TYPE_NAMES.get(t, f"MOSTLY_{t}")]) for t in (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL",
    "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS", "MXFP4", "NVFP4", "Q1_0", "TQ1_0", "TQ2_0", "IQ1_S",
    "IQ1_M")}
FILE_TYPES["Q2_0"] = 41  # LLAMA_FTYPE_MOSTLY_Q2_0 (llama.h), which gguf 0.19's LlamaFileType lacks
# tensors a checkpoint may carry that llama.cpp recomputes itself
_DROPPED = re.compile(r"rotary_emb\.inv_freq$")
# an architecture's integer tables (GgufArch.integer_tensors: DeepSeek-V4's tid2eid), stored as ggml's I32; not a
# --type a weight can ask for, so kept out of TARGET_LAYOUTS and the scheme table
INTEGER_TABLE = BlockLayout("I32", int(gguf.GGMLQuantizationType.I32), 1, 4, 32, kind="int")
INTEGER_TABLE_DTYPES = ("int32", "int64")
_WRITABLE = tuple(GGUF_SCHEMES)


# tensors llama.cpp keeps in float32 whatever the file type (its converter and llama-quantize alike): the MoE
# routers, the linear attention's conv kernel (ssm_conv1d: ggml's ssm_conv aborts on any other type), and every
# tensor that is not a `.weight` (DeepSeek's router bias exp_probs_b.bias, gpt-oss's 2-D per-expert biases
# ffn_*_exps.bias: its converter's `new_name[-7:] not in (".weight", ...)` rule)
_F32_ALWAYS = re.compile(r"(?:\.ffn_gate_inp(?:_shexp)?\.weight|\.ssm_conv1d\.weight|\.exp_probs_b\.bias"
                         r"|\.ffn_(?:gate|up|down)_exps\.bias)$")


def _always_f32(out_name: str) -> bool:
    return bool(_F32_ALWAYS.search(out_name))


_FLOAT_TYPES = ("F32", "F16", "BF16")


def _kept_source_type(spec, rec: TensorRecord, options: Options) -> str | None:
    """The type a dense tensor keeps under a float --type where the architecture's converter keeps the stored
    type (GgufArch.float_type_keeps_source_types: float32 -> F32, 2-D bfloat16 -> BF16), else None."""
    if not spec.float_type_keeps_source_types or not options.type or options.type.strip().upper() not in _FLOAT_TYPES:
        return None
    if rec.dtype == "float32":
        return "F32"
    if rec.dtype == "bfloat16" and len(rec.shape) >= 2:
        return "BF16"
    return None


def _expert_count(source) -> int:
    key = expert_count_key(model_config(source))
    if key is None:
        raise BadInput("the checkpoint has expert tensors but config.json declares no expert count "
                       f"({' / '.join(EXPERT_COUNT_KEYS)})", path=config_json_path(source))
    return ConfigView(model_config(source), config_json_path(source)).int(key, lo=1, hi=1 << 16)


# experts already fused into 3-D tensors of every expert (transformers 5's own parameters, which some
# checkpoints are saved with): mlp.experts.gate_up_proj [experts, 2 * ffn, hidden], gate rows first (its
# forward chunks them in that order), and mlp.experts.down_proj [experts, hidden, ffn], with or without .weight
_FUSED_EXPERTS = re.compile(r"\.experts\.(?P<what>gate_up_proj|down_proj)(?:\.weight)?$")


def _fused_expert_records(rec: TensorRecord, where) -> list[TensorRecord]:
    """The stacked records of a fused expert tensor: gate_up_proj split into its gate and up halves (the
    GGUF has one stack each), down_proj as it is; named as the stacks of per-expert tensors map."""
    m = _FUSED_EXPERTS.search(rec.name)
    head = rec.name[: m.start()] + ".experts."
    if len(rec.shape) != 3 or rec.is_grid:
        raise BadInput(f"a fused expert tensor is a dense [experts, rows, columns] tensor, not {list(rec.shape)}"
                       + (" (quantized)" if rec.is_grid else ""), path=where, tensor=rec.name)
    if m["what"] == "down_proj":
        return [replace(rec, name=head + "down_proj.weight", source_name=rec.source_name or rec.name)]
    n, rows, cols = rec.shape
    if rows % 2:
        raise BadInput(f"gate_up_proj has {rows} rows per expert: not a gate and an up half", path=where,
                       tensor=rec.name)

    def half(i: int):
        return lambda: Dense(rec.load().tensor[:, i * (rows // 2):(i + 1) * (rows // 2)].contiguous())

    return [replace(rec, name=head + name, shape=(n, rows // 2, cols), load=half(i),
                    source_name=f"{rec.source_name or rec.name} ({'gate' if i == 0 else 'up'} half)")
            for i, name in enumerate(("gate_proj.weight", "up_proj.weight"))]


def _gpt_oss_expert_records(rec: TensorRecord, where) -> list[TensorRecord]:
    """The stacked records of one of gpt-oss's fused expert tensors, in llama.cpp's [experts, out, in] order
    (archs.split_gpt_oss_experts): gate_up_proj [E, hidden, 2 * ffn] -> gate_proj / up_proj.weight
    [E, ffn, hidden] (interleaved columns 0::2 / 1::2), down_proj [E, ffn, hidden] -> down_proj.weight
    [E, hidden, ffn], the biases split alike. Each record loads the source tensor and takes its part."""
    head, what, bias = gpt_oss_expert_part(rec.name)
    if rec.is_grid:  # a grid's blocks run along its rows: transposing it keeps no grid
        raise BadInput("gpt-oss's fused expert tensor is quantized here; only the dense [experts, in, out] form "
                       "is split by this path", path=where, tensor=rec.name)
    want = 2 if bias else 3
    if len(rec.shape) != want or (what == "gate_up_proj" and rec.shape[-1] % 2):
        raise BadInput(f"gpt-oss's {what}{'_bias' if bias else ''} is [experts, {'' if bias else 'in, '}out"
                       f"{' (gate and up interleaved)' if what == 'gate_up_proj' else ''}], not {list(rec.shape)}",
                       path=where, tensor=rec.name)
    if bias:
        shape = (rec.shape[0], rec.shape[1] // (2 if what == "gate_up_proj" else 1))
    else:
        shape = (rec.shape[0], rec.shape[2] // (2 if what == "gate_up_proj" else 1), rec.shape[1])

    def part(i: int):
        return lambda: Dense(split_gpt_oss_experts(rec.name, rec.load().tensor)[i][1])

    suffix = ".bias" if bias else ".weight"
    if what == "down_proj":
        return [replace(rec, name=f"{head}down_proj{suffix}", shape=shape, load=part(0),
                        source_name=rec.source_name or rec.name)]
    return [replace(rec, name=f"{head}{half}_proj{suffix}", shape=shape, load=part(i),
                    source_name=f"{rec.source_name or rec.name} ({half} columns {i}::2)")
            for i, half in enumerate(("gate", "up"))]


def _in_out_expert_records(rec: TensorRecord, where) -> list[TensorRecord]:
    """The stacked records of a fused, transposed expert tensor (Llama 4, archs.split_llama4_experts):
    gate_up_proj [E, hidden, 2 * ffn] -> gate_proj / up_proj.weight [E, ffn, hidden] (the gate columns first),
    down_proj [E, ffn, hidden] -> down_proj.weight [E, hidden, ffn]. Each record loads the source tensor and
    takes its part."""
    head, what = llama4_expert_part(rec.name)
    if rec.is_grid:  # a grid's blocks run along its rows: transposing it keeps no grid
        raise BadInput("the fused expert tensor is quantized here; only the dense [experts, in, out] form is split "
                       "by this path", path=where, tensor=rec.name)
    if len(rec.shape) != 3 or (what == "gate_up_proj" and rec.shape[-1] % 2):
        raise BadInput(f"{what} is [experts, in, out]{' (gate columns, then up)' if what == 'gate_up_proj' else ''}, "
                       f"not {list(rec.shape)}", path=where, tensor=rec.name)
    n, rows, cols = rec.shape
    shape = (n, cols // (2 if what == "gate_up_proj" else 1), rows)

    def part(i: int):
        return lambda: Dense(split_llama4_experts(what, rec.load().tensor)[i])

    if what == "down_proj":
        return [replace(rec, name=f"{head}down_proj.weight", shape=shape, load=part(0),
                        source_name=rec.source_name or rec.name)]
    return [replace(rec, name=f"{head}{half}_proj.weight", shape=shape, load=part(i),
                    source_name=f"{rec.source_name or rec.name} ({half} columns)")
            for i, half in enumerate(("gate", "up"))]


def model_config(source) -> Mapping:
    """config.json as llama.cpp's converter reads it: a multimodal class written as its text model
    (GgufArch.multimodal: Llama 4) gives its text model's config (text_model_config); any other checkpoint with a
    `text_config` has it moved to the root (the converter's ModelBase: {**hparams, **hparams["text_config"]};
    Kimi-K3's text model), so that the text model's keys are found; a config without one is returned as it is."""
    config = text_model_config(source.config)
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, Mapping) else config


def _kv_b_records(rec: TensorRecord, parts: tuple[str, str], config, where) -> list[TensorRecord]:
    """The two records a DeepSeek kv_b_proj becomes: k_b [heads, kv_lora, nope] and v_b [heads, v, kv_lora],
    each loading the source tensor and taking its half. A grid's v_b stays a grid (archs.kv_b_value_rows: whole
    output rows, the input axis untouched; its rows flattened as ggml lays out [heads, v, kv_lora]), so the
    planner keeps its codes wherever the target's blocks fit its groups, as for any other grid. k_b is kv_b's
    key rows transposed: a GGUF block would run across output rows, each with its own scale, so a grid is
    dequantized for it and k_b is dense, measured against the source's dequantization.

    A GGUF source's kv_b_proj is its reader's float32 merge of the file's own halves, which it carries as well
    (NativeForm archs.KV_B_HALVES): those are the two records then, each the file's tensor as read (its ggml type,
    its blocks), planned as any other tensor of a GGUF source (its type kept unless one is asked for)."""
    try:
        n_head, nope, v = (int(config[k]) for k in ("num_attention_heads", "qk_nope_head_dim", "v_head_dim"))
    except (KeyError, TypeError, ValueError):
        raise BadInput("config.json lacks num_attention_heads / qk_nope_head_dim / v_head_dim, which split "
                       "kv_b_proj for llama.cpp's MLA", path=where, tensor=rec.name) from None
    rows, kv_lora = rec.shape
    if rows != n_head * (nope + v):
        raise BadInput(f"shape {list(rec.shape)} contradicts the config (num_attention_heads {n_head} x "
                       f"(qk_nope_head_dim {nope} + v_head_dim {v}) rows)", path=where, tensor=rec.name)
    stored = rec.native_form(KV_B_HALVES)
    if stored is not None:
        # named as this writer names the halves (an MTP block or a multimodal prefix renamed before the split); their
        # block scales checked finite as every grid record's were as the source streamed (the merged record is dense)
        return list(finite_params([renamed(half, name=name) for half, name in zip(stored.load(), parts)], where))
    value_rows = kv_b_value_rows(config)
    source_name = rec.source_name or rec.name

    def key_half() -> Dense:
        item = rec.load()
        tensor = item.tensor if isinstance(item, Dense) else item.dequantize(torch.float32)
        return Dense(split_kv_b(tensor, config)[0])

    def value_half() -> Dense | Grid:
        item = rec.load()
        if isinstance(item, Grid):  # the same grid, its value rows taken (packed codes move as they are)
            return item.permute_rows(value_rows)
        return Dense(split_kv_b(item.tensor, config)[1])

    key_dtype = rec.dtype if not rec.is_grid else "float32"
    key = replace(rec, name=parts[0], shape=(n_head, kv_lora, nope), dtype=key_dtype, load=key_half, params=None,
                  native_type=None, native_forms=(), source_name=f"{source_name} (k half)")
    value_params = rec.params.permute_rows(value_rows) if rec.is_grid else None
    rec.release_params()  # the halves hold what they need; a giant's kv_b scales are read again on load
    value = replace(rec, name=parts[1], shape=(n_head, v, kv_lora), load=value_half, params=value_params,
                    native_type=None, native_forms=(), source_name=f"{source_name} (v half)")
    return [key, value]


def best_aligned_type(p, shape) -> tuple[str, str] | None:
    """(type, verdict) of the cheapest type that holds the grid exactly, else near-exactly."""
    best = best_aligned(p, shape, ALIGNED_CANDIDATES)
    return (best[0].name, best[1].verdict) if best else None


def _parse_type(text: str) -> str:
    key = text.strip().upper()
    if key not in _WRITABLE:
        known = [t.lower() for t in _WRITABLE] + [p for p in PRESETS if p.upper() not in _WRITABLE]
        raise unknown_type(text, known, "GGUF")
    return key


def _gguf_name(hf_name: str, spec, n_layers: int, keep_mtp: bool, config: Mapping) -> str | None:
    """The GGUF name of a record: a kept MTP block's (named as the layers after the trunk by adapt_records) as
    block num_hidden_layers + i, every other as gguf_tensor_name maps it within the trunk. A name a producer
    saves in place of the one the model's class loads (model_shapes.canonical_name: llm-compressor's per-expert
    MiniMax-M2 projections) is mapped as the name it stands for; the record keeps the source's name."""
    hf_name = canonical_name(hf_name, config)
    if keep_mtp and spec.mtp.is_mtp(hf_name, n_layers):
        return gguf_tensor_name(hf_name, spec.name, (layer_index(hf_name) or 0) + 1)
    return gguf_tensor_name(hf_name, spec.name, n_layers)


_BLOCK_INDEX = re.compile(r"^blk\.(0|[1-9][0-9]*)\.")


def _mtp_layers(plans: list[TensorPlan], n_layers: int) -> int:
    """The blocks after the trunk the planned tensors fill (a kept MTP block's)."""
    return len({int(m[1]) for p in plans if (m := _BLOCK_INDEX.match(p.out_name or "")) and int(m[1]) >= n_layers})


def _weights_path(source) -> Path:
    """What a refusal about the checkpoint's tensors names: its one weights file, else its folder."""
    folder = Path(source.path or ".")
    shards = source.weight_files()
    return folder / shards[0] if len(shards) == 1 else folder


def preset_facts(records, source, arch: str, n_layers: int, options: Options, keep_mtp: bool = False) -> ModelFacts:
    """What llama-quantize's rules look at (presets.model_facts_from_gguf_names), from the GGUF tensors
    these records will make: their names and shapes (experts stacked), the head counts as the GGUF
    states them (MLA: one KV head) and the tensors --tensor-type fixes (left out of llama.cpp's counters).
    Reads headers only: the records are not loaded."""
    spec = arch_by_name(arch)
    config = model_config(source)  # built once, not per record
    n_expert = _expert_count(source) if expert_count_key(config) is not None else 0
    shapes: dict[str, tuple[int, ...]] = {}
    manual = []
    for rec in records:
        if spec.tied_output_dropped and rec.name == "lm_head.weight":
            continue
        name = _gguf_name(rec.name, spec, n_layers, keep_mtp, config)
        if name is None or _DROPPED.search(rec.name):
            continue
        # a stacked tensor's shape; a config without an expert count is refused by _expert_count
        shapes[name] = rec.shape if expert_of(rec.name) is None else (n_expert or _expert_count(source), *rec.shape)
        if options.explicit_type(rec.name):
            manual.append(name)
    cfg = ConfigView(model_config(source), config_json_path(source))
    heads = cfg.int("num_attention_heads", lo=1, hi=1 << 14)
    kv_heads = 1 if spec.mla else cfg.int("num_key_value_heads", default=heads, lo=1, hi=heads)
    # llama-quantize's layer count is the file's block_count, kept MTP blocks included
    blocks = n_layers + len({int(m[1]) for n in shapes if (m := _BLOCK_INDEX.match(n)) and int(m[1]) >= n_layers})
    if keep_mtp:
        blocks = n_layers + (spec.mtp.count(source.config, blocks - n_layers) or 0)
    return model_facts_from_gguf_names(shapes, arch, blocks, heads, kv_heads, n_expert, manual=manual)


def _choose_type(explicit, options: Options, facts: ModelFacts | None, out_name: str, shape, default: str | None,
                 quantize_dense: bool) -> tuple[str | None, str]:
    """The ggml type a tensor asks for, in order: --tensor-type, a preset's rule, --type, `default`.
    `quantize_dense`: whether --type applies to this (dense) tensor. -> (type or None, rule note)."""
    if explicit:
        return _parse_type(explicit), ""
    preset = preset_of(options.type)
    if preset is not None and quantize_dense and quantized_by_llama_cpp(out_name, shape):
        chosen, rule = preset_type(preset, out_name, shape, facts)
        return chosen, f"[{rule}] "
    if options.type and preset is None and quantize_dense:
        return _parse_type(options.type), ""
    return default, ""


_IMATRIX_CACHE: dict = {}


def _imatrix_for(options: Options, out_name: str, shape, target: str, expert: int | None = None,
                 experts: int = 1) -> tuple[np.ndarray | None, str]:
    """The --imatrix weights of a tensor planned for a K type or an IQ type (llama-quantize weighs those
    quantizers with them), or None and a note: float32 [columns], or [slices, columns] for a stacked tensor whose
    slices (experts, MLA heads: the dims before the last two) each have their own.

    llama-imatrix writes one vector per slice for a 3-D tensor (ne0 x ne2 values) and llama-quantize requires that
    size there, quantizing slice i with values i*ne0 .. (i+1)*ne0. A record that is one expert of such a stack
    (`expert` of `experts`, GgufAction.expert) takes its own slice. One vector of ne0 values for a whole stack is
    also taken (every slice weighed alike), which llama-quantize would refuse."""
    path = options.extra.get("imatrix")
    if not path:
        return None, ""
    if TARGET_LAYOUTS[target].kind not in ("k", "codebook"):
        return None, "; imatrix not applied (qconvert uses it for the K types and the IQ types only)" if TARGET_LAYOUTS[target].kind == "legacy" else ""
    from .imatrix import read_imatrix

    key = str(Path(path).resolve())
    if key not in _IMATRIX_CACHE:
        _IMATRIX_CACHE.clear()
        _IMATRIX_CACHE[key] = read_imatrix(path)
    vec = _IMATRIX_CACHE[key].get(out_name)
    if vec is None:
        return None, "; no imatrix entry"
    columns = int(shape[-1])
    slices = experts if expert is not None else int(np.prod([int(d) for d in shape[:-2]], dtype=np.int64))
    if vec.size == columns:
        return vec, "; weighted by the imatrix"
    if slices > 1 and vec.size == columns * slices:
        per_slice = vec.reshape(slices, columns)
        if expert is not None:
            return np.ascontiguousarray(per_slice[expert]), f"; weighted by the imatrix (expert {expert}'s values)"
        return per_slice, "; weighted by the imatrix (one vector per slice)"
    if out_name == "token_embd.weight":  # llama-quantize ignores a mismatched embedding entry too
        return None, "; imatrix entry of the wrong size ignored"
    want = f"{columns}" + (f" or {columns} x {slices} = {columns * slices}" if slices > 1 else "")
    raise BadInput(f"imatrix entry has {vec.size} values, the tensor wants {want} (its {columns} columns"
                   + (f", per slice of {slices})" if slices > 1 else ")"), path=path, tensor=out_name)


@dataclass
class GgufAction:
    """What the session does with one tensor besides encoding it as its plan's target type."""

    drop: bool = False  # not written (llama.cpp recomputes it, or loads no such tensor)
    expert: int | None = None  # its index in the layer's stacked expert tensor
    file_type: int | None = None  # the general.file_type the asked --type names (a mix, or llama-quantize's)
    quant: QuantHow | None = None  # kept codes, an imatrix or llama.cpp's quantizer (common/ggml_codec.py)
    tensor_scale: float | None = None  # NVFP4 with a global scale: llama.cpp's `.scale` for this tensor
    # a llama-quantize mix: the tensor's dims as llama-quantize writes every tensor (ggml_n_dims: trailing 1s of
    # the ggml shape dropped; Kimi-K3's conv kernels {d_conv, 1, d_inner, 1} become {d_conv, 1, d_inner})
    ggml_n_dims: bool = False


def _attach_quant(plan: TensorPlan, options: Options, keep_codes: bool, experts: int = 1) -> None:
    """Record how a quantized target is encoded when it is not simply the reference quantizer (`experts`: the
    size of the stack a one-expert record joins)."""
    lay = TARGET_LAYOUTS[plan.target]
    if lay.kind == "float" or plan.verdict == REFUSED:
        return
    backend = options.extra.get("quantizer") or "qconvert"
    if backend not in QUANTIZERS:
        raise QConvertError(f"unknown --quantizer {backend!r}; choose one of: {', '.join(QUANTIZERS)}")
    imatrix, note = _imatrix_for(options, plan.out_name, plan.shape, plan.target, plan.action.expert,
                                 experts) if plan.verdict == REQUANTIZE else (None, "")
    plan.reason += note
    refusal = imatrix_refusal(plan.target, plan.out_name, imatrix is not None) if plan.verdict == REQUANTIZE else None
    if refusal:  # llama-quantize's rule for the IQ2 types (schemes.py)
        plan.verdict, plan.reason = REFUSED, refusal
        return
    if backend == "llama.cpp" and plan.verdict == REQUANTIZE:
        from ...kernels.ggml.libggml import available

        if not available():
            raise QConvertError("--quantizer llama.cpp needs llama-cpp-python installed")
        plan.reason += "; llama.cpp's quantizer"
    how = QuantHow(keep_codes=keep_codes, imatrix=imatrix,
                   backend=backend if plan.verdict == REQUANTIZE else "qconvert")
    if how.needed:
        plan.action.quant = how


class _TextModel:
    """A multimodal checkpoint as the GGUF of its text model sees it (archs.TextOfMultimodal: Llama 4's released
    class): the text model's config; everything else is the source's. Its records are renamed (the text model's
    prefix taken off) and its towers dropped by the writer's hooks."""

    def __init__(self, source, config: Mapping):
        self._source, self.config = source, config

    def __getattr__(self, name):
        return getattr(self._source, name)


class GgufWriter(Writer):
    name = "gguf"
    output_is_file = True
    copies_side_files = False  # the tokenizer goes into GGUF keys (tokenizer.py), read and checked there

    def __init__(self, arch: tuple[str, int] | None = None, keep_mtp: bool = True):
        self._arch_of_source = arch  # set by for_conversion: (GGUF architecture, layer count) of this model
        # the model's multi-token-prediction block is kept where llama.cpp's converter keeps it (False: --no-mtp)
        self._keep_mtp = keep_mtp
        self._facts: ModelFacts | None = None  # llama-quantize's view of the model, when --type names a mix
        self._tokenizer: dict | None = None  # the tokenizer keys, built once (check_model) for the session
        # grid records written as their codes only where the target holds them exactly, else as the float32 values
        # they were written as before (DeepSeek's v_b: _kv_b_records), planned as that dense tensor would be
        self._codes_only_if_exact: set[str] = set()

    def for_conversion(self, source, options: Options) -> "GgufWriter":
        """The writer for one conversion, holding the model's architecture (read once from config.json)."""
        where = config_json_path(source)
        config = model_config(source)
        return GgufWriter((gguf_arch(config, where), layer_count(config, where)), keep_mtp=not options.extra.get("no_mtp"))

    def _text(self, source):
        """The source as the hooks read it: a multimodal class written as its text model (archs.TextOfMultimodal) is
        seen through its text config (one view per source, kept), every other source as it is."""
        if isinstance(source, _TextModel):
            return source
        view = getattr(self, "_view", None)
        if view is not None and view._source is source:
            return view
        config = text_model_config(source.config)
        if config is source.config:
            return source
        view = _TextModel(source, config)
        if self._arch_of_source is not None:  # kept by a per-conversion writer only (the registered one holds no model)
            self._view = view
        return view

    def _tower(self, source, name: str) -> bool:
        """Whether an HF name is a tower's of a multimodal class written as its text model."""
        spec = arch_by_name(self._arch(source)[0])
        return isinstance(source, _TextModel) and spec.multimodal is not None and name.startswith(spec.multimodal.towers)

    def alternative_hint(self, scheme: str, verdict: str) -> str:
        return f"--type {scheme.lower()} ({verdict})"

    def plan_records(self, records, options: Options, source):
        """With a llama-quantize mix, the type of a tensor depends on the whole model (how many attention and
        expert tensors it has, as llama-quantize counts them first): the records are listed once and their
        facts taken before planning; otherwise each record is planned as it arrives."""
        source = self._text(source)
        if preset_of(options.type) is not None and self._facts is None:
            records = list(records)
            self._facts = preset_facts(records, source, *self._arch(source), options, self._keeps_mtp(source))
        return super().plan_records(records, options, source)

    def _arch(self, source) -> tuple[str, int]:
        if self._arch_of_source is None:  # called without for_conversion (a direct plan_tensor call)
            return self.for_conversion(source, Options())._arch_of_source
        return self._arch_of_source

    def adapt_records(self, records, source):
        """The source's records with DeepSeek's kv_b_proj split into the k_b / v_b halves llama.cpp's MLA
        loads (archs.split_kv_b), fused experts split into their stacks (gpt-oss's transposed, interleaved
        form by archs.split_gpt_oss_experts), a multimodal class's text model named without its prefix
        (archs.TextOfMultimodal), a kept MTP block named as the layers after the trunk (archs/mtp.py); every other
        record passes as it is."""
        source = self._text(source)
        arch, n_layers = self._arch(source)
        spec = arch_by_name(arch)
        if spec.adapt_stream is not None:  # the architecture's whole-stream transform first (archs/)
            records = spec.adapt_stream(records, model_config(source), config_json_path(source))
        prefix = spec.multimodal.prefix if isinstance(source, _TextModel) else None
        for rec in records:
            if prefix and rec.name.startswith(prefix):  # the text model's tensors, named as its own class names them
                rec = renamed(rec, name=spec.multimodal.renamed + rec.name[len(prefix):],  # lazy stays lazy
                              source_name=rec.source_name or rec.name)
            if self._keeps_mtp(source) and spec.mtp.is_mtp(rec.name, n_layers):
                # a kept MTP block is named as the layers after the trunk (Qwen3.5's mtp.* too: archs/mtp.py)
                named = spec.mtp.as_layer(rec.name, n_layers)
                if named != rec.name:
                    rec = renamed(rec, name=named, source_name=rec.source_name or rec.name)
            parts = kv_b_parts(rec.name) if spec.mla else None
            if parts is not None:
                key, value = _kv_b_records(rec, parts, model_config(source), config_json_path(source))
                # a grid's v_b split here keeps its codes only where exact; a GGUF file's own v_b is any grid
                if value.is_grid and rec.native_form(KV_B_HALVES) is None:
                    self._codes_only_if_exact.add(value.name)
                yield from (key, value)
            elif arch == "gpt-oss" and gpt_oss_expert_part(rec.name):
                yield from _gpt_oss_expert_records(rec, config_json_path(source))
            elif arch_by_name(arch).experts_in_out and llama4_expert_part(rec.name):
                yield from _in_out_expert_records(rec, config_json_path(source))
            elif _FUSED_EXPERTS.search(rec.name) and not spec.fused_gate_up_experts:
                yield from _fused_expert_records(rec, config_json_path(source))
            elif spec.to_gguf_record is not None:  # the architecture's own transforms (archs/)
                yield from spec.to_gguf_record(rec, model_config(source), config_json_path(source))
            else:
                yield rec

    def plan_tensor(self, rec: TensorRecord, options: Options, source) -> TensorPlan:
        source = self._text(source)
        arch, n_layers = self._arch(source)
        if _DROPPED.search(rec.name):
            return TensorPlan(rec.name, rec.shape, rec.dtype, "dropped", EXACT, "recomputed by llama.cpp",
                              action=GgufAction(drop=True))
        spec = arch_by_name(arch)
        if spec.tied_output_dropped and rec.name == "lm_head.weight":
            # llama.cpp's Gemma runs the embedding as the output projection and has no output tensor
            return TensorPlan(rec.name, rec.shape, rec.dtype, "dropped", EXACT,
                              f"{arch} uses the token embedding as its output (llama.cpp loads no output.weight)",
                              action=GgufAction(drop=True))
        if self._tower(source, rec.name):
            return TensorPlan(rec.name, rec.shape, rec.dtype, "dropped", EXACT,
                              "a multimodal tower: llama.cpp's converter writes the text model here and the tower "
                              "only into the mmproj file of its --mmproj run", action=GgufAction(drop=True))
        if spec.mtp is not None and spec.mtp.is_mtp(rec.name, n_layers) and not self._keeps_mtp(source):
            why = spec.mtp.dropped_because or ("left out (--no-mtp), as llama.cpp's converter does with --no-mtp; "
                                               "its runtime runs the trunk alone")
            return TensorPlan(rec.name, rec.shape, rec.dtype, "dropped", EXACT, f"multi-token prediction block: {why}",
                              action=GgufAction(drop=True))
        dropped = spec.dropped_tensor(rec.name, source.config)
        if dropped is not None:
            return TensorPlan(rec.name, rec.shape, rec.dtype, "dropped", EXACT, dropped, action=GgufAction(drop=True))
        out_name = _gguf_name(rec.name, spec, n_layers, self._keeps_mtp(source), model_config(source))
        if out_name is None:
            return TensorPlan(rec.name, rec.shape, rec.dtype, "?", REFUSED,
                              f"no GGUF tensor for it in arch {arch}; llama.cpp refuses extra tensors")
        if spec.integer_tensors is not None and spec.integer_tensors.search(out_name):
            # an integer table (DeepSeek-V4's token -> experts map), not a weight: I32 as llama.cpp's converter
            # casts it, whatever --type says
            if rec.is_grid or rec.dtype not in INTEGER_TABLE_DTYPES:
                return TensorPlan(rec.name, rec.shape, rec.dtype, "?", REFUSED,
                                  f"{out_name} is an integer table (int32 / int64), not {rec.dtype}", out_name=out_name)
            return TensorPlan(rec.name, rec.shape, rec.dtype, "I32", EXACT, "integer table stored as I32",
                              out_name=out_name, action=GgufAction())
        facts = self._facts
        if facts is None and preset_of(options.type) is not None:  # a direct call, without plan_records
            facts = preset_facts(self.adapt_records(source.records(), source), source, arch, n_layers, options,
                                 self._keeps_mtp(source))
        expert = expert_of(rec.name)
        # the shape llama.cpp's rules see: a stacked expert tensor's, experts outermost
        rule_shape = rec.shape if expert is None else (_expert_count(source), *rec.shape)
        explicit = options.explicit_type(rec.name)
        is_1d = len(rec.shape) == 1 or rec.name.endswith("norm.weight")
        fallback_note = ""
        rule_note = ""
        if rec.is_grid:
            p = rec.params
            # a GGUF source's grid keeps its own ggml type unless a type is asked for
            target, rule_note = _choose_type(explicit, options, facts, out_name, rule_shape,
                                             rec.native_type or default_grid_type(p), True)
            if spec.float_type_keeps_source_types and not explicit and target in _FLOAT_TYPES:
                # llama.cpp's converter writes the checkpoint's grids whatever --outtype (archs/deepseek4.py): FP4
                # as MXFP4 (its codes kept), FP8 blocks as Q8_0 of their values (a requantization)
                target, rule_note = rec.native_type or default_grid_type(p), f"kept as {arch}'s converter keeps it; "
            asked = _parse_type(target)
            target, fallback_note = k_fallback(asked, rule_shape, p)
            # a grid is [rows, in]; a record of more dims holds its leading dims flattened into the rows, as ggml
            # lays out a 3-D tensor (DeepSeek's v_b [heads, v, kv_lora]: _kv_b_records)
            grid_shape = (int(np.prod(rec.shape[:-1])), int(rec.shape[-1]))
            v = decide(p, grid_shape, GGUF_SCHEMES[target], ALIGNED_CANDIDATES, native=rec.native_type,
                       fallback=target if target != asked else "")
            src = describe_grid(p, rec.shape[-1])
            if rec.name in self._codes_only_if_exact and v.verdict != EXACT:
                # its codes cannot stay in this target: it is planned as its float32 values (the runner still hands
                # the writer the grid, which every dense target's encoder dequantizes)
                plan = self.plan_tensor(replace(rec, dtype="float32", params=None), options, source)
                plan.source = src
                plan.reason = f"dequantized, as {target} would not hold its grid exactly ({v.reason}); {plan.reason}"
                return plan
        else:
            src = rec.dtype
            keep_float = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}.get(rec.dtype, "F32")
            # a GGUF source's IQ4_NL / IQ4_XS tensor (dense float32 carrying its blocks: reader.CodebookDense)
            # keeps its type unless one is asked for, as a grid does, and that type copies its blocks
            codebook = rec.native_type if rec.native_type in CODEBOOK_LAYOUTS else None
            kept = _kept_source_type(spec, rec, options) if not explicit else None
            if kept is not None:  # the source's own type, as the architecture's converter keeps it (archs/)
                target, rule_note = kept, f"kept as {arch}'s converter keeps it; "
            elif (is_1d or _always_f32(out_name)) and not explicit:
                target = "F32"
            else:
                # --type names the type of a dense source's 2-D weights, and of a quantized source's grids only; a
                # llama-quantize mix (q4_k_m, q5_k_s...; not the names that are also plain types: q8_0, q6_k,
                # q2_k) covers every tensor llama-quantize would quantize, as llama.cpp's route does (a quantized
                # source's float head and embeddings included: FP8 DeepSeek-V3 to Q4_K_M)
                mix = preset_of(options.type) is not None and options.type.strip().upper() not in GGUF_SCHEMES
                quantize_dense = bool(codebook) or (len(rec.shape) >= 2 and (not source.quant_config or mix))
                target, rule_note = _choose_type(explicit, options, facts, out_name, rule_shape, codebook or keep_float,
                                                 quantize_dense)
            target, fallback_note = k_fallback(target, rule_shape, None)
            v = check(rec.dtype, rec.shape, GGUF_SCHEMES[target], native=codebook)
            stored = spec.stored_values(out_name)  # an elementwise map that rounds (archs/)
            if stored is not None and v.verdict == EXACT:
                v = replace(v, verdict=NEAR_EXACT, reason=f"{v.reason}; {stored[2]}")
            if spec.shifts_norm(out_name) and v.verdict == EXACT:
                v = replace(v, verdict=NEAR_EXACT, reason=f"{v.reason}; stored as {spec.norm_shift:g} + w as "
                            f"llama.cpp's {arch} reads its norms (the float32 addition rounds)")
        action = GgufAction(expert=expert)
        preset = preset_of(options.type)
        if preset is not None:
            action.file_type = preset.file_type  # general.file_type names the preset, not a tensor type
            action.ggml_n_dims = True
        elif options.type and options.type.strip().upper() in FILE_TYPES:
            # llama-quantize names the type asked for (IQ4_XS: 30) even where fallbacks outnumber it
            action.file_type = FILE_TYPES[options.type.strip().upper()]
        if rec.is_grid and target == "NVFP4" and v.keeps_codes:
            action.tensor_scale = tensor_scale_of(rec.params)
        plan = self.plan(rec, v, target, source=src, out_name=out_name, action=action,
                         reason_prefix=rule_note + fallback_note)
        _attach_quant(plan, options, keep_codes=bool(v.kept_blocks),
                      experts=_expert_count(source) if expert is not None else 1)
        if TARGET_LAYOUTS[target].kind == "k" and v.verdict == REQUANTIZE and available_kquants() is None:
            plan.verdict, plan.reason = REFUSED, f"the {target} quantizer is not available in this build"
        return plan

    def check_model(self, source, plans, options) -> None:
        source = self._text(source)
        arch, _ = self._arch(source)
        kept = [p for p in plans if p.out_name and p.out_name != "?" and not p.action.drop]
        shapes = {name: stack_shape(members) for name, members in
                  gguf_tensors_in_order(kept, _expert_count(source) if any(p.action.expert is not None for p in kept) else 0,
                                        config_json_path(source))}
        found = _mtp_layers(kept, self._arch(source)[1])
        declared = self._mtp_blocks(source, plans) or 0
        if found and found != declared:  # block_count would not cover them (llama.cpp's converter cannot map them)
            raise BadInput(f"config.json declares {declared} multi-token-prediction block(s) but the checkpoint holds "
                           f"{found}", path=config_json_path(source))
        check_writer_config(model_config(source), arch, shapes,
                            config_json_path(source), names={p.out_name: p.name for p in kept},
                            unmapped=[p.name for p in plans
                                      if not p.out_name and (p.action is None or not p.action.drop)],
                            mtp_blocks=found, source_path=_weights_path(source))
        # the tokenizer is built (and checked) here, once, so that dry runs see it too; the session writes it
        self._tokenizer_keys(source, plans)

    def _tokenizer_keys(self, source, plans: list[TensorPlan]) -> dict:
        """The tokenizer's GGUF keys {key: gguf GGUFValue}, built once per conversion on a writer without a file
        (the keys it adds beyond its own general.architecture)."""
        if self._tokenizer is None or self._arch_of_source is None:  # kept only by a per-conversion writer
            arch, _ = self._arch(source)
            probe = gguf.GGUFWriter(path=None, arch=arch)
            n_vocab = next((p.shape[0] for p in plans if p.out_name == "token_embd.weight"), None)
            if n_vocab is None:
                raise QConvertError("the model has no token embedding (model.embed_tokens.weight)", path=source.path)
            before = set(probe.kv_data[0])
            _add_tokenizer(probe, source, n_vocab)
            keys = {k: v for k, v in probe.kv_data[0].items() if k not in before}
            if self._arch_of_source is None:  # the registered writer (no for_conversion) holds no model's state
                return keys
            self._tokenizer = keys
        return self._tokenizer

    def writes_several_files(self, options: Options) -> bool:
        """With --split-max-size the output is a set of `-0000i-of-0000N.gguf` parts (see output.atomic_output)."""
        return bool(options.extra.get("split_max_size"))

    def _keeps_mtp(self, source) -> bool:
        """Whether this conversion writes the model's MTP block (where the converter keeps it, unless --no-mtp)."""
        spec = arch_by_name(self._arch(source)[0])
        return spec.mtp is not None and spec.mtp.kept and self._keep_mtp

    def _mtp_blocks(self, source, plans: list[TensorPlan]) -> int | None:
        """The MTP blocks the file states (block_count after the trunk, nextn_predict_layers), or None."""
        if not self._keeps_mtp(source):
            return None
        arch, n_layers = self._arch(source)
        kept = [p for p in plans if p.out_name and p.out_name != "?" and not p.action.drop]
        return arch_by_name(arch).mtp.count(source.config, _mtp_layers(kept, n_layers))

    def open(self, path: Path, source, plans: list[TensorPlan], options: Options) -> "GgufSession":
        source = self._text(source)
        return GgufSession(Path(path), source, plans, *self._arch(source), self._tokenizer_keys(source, plans),
                           split_max_size=int(options.extra.get("split_max_size") or 0),
                           mtp_blocks=self._mtp_blocks(source, plans))


    def open_split(self, folder: Path, name: str, source, plans: list[TensorPlan], options: Options):
        """The header of every output file, written by GgufSession itself, and where each tensor goes
        (split.GgufSplitOutput): parts of the conversion write their tensors there in any order."""
        source = self._text(source)
        scratch = Path(folder) / "header"
        scratch.mkdir(exist_ok=True)
        session = GgufSession(scratch / name, source, plans, *self._arch(source), self._tokenizer_keys(source, plans),
                              split_max_size=int(options.extra.get("split_max_size") or 0),
                              mtp_blocks=self._mtp_blocks(source, plans))
        return GgufSplitOutput(Path(folder), session)

    def open_part(self, folder: Path, source, plans: list[TensorPlan], options: Options, layout):
        source = self._text(source)
        part = GgufPart(Path(folder), layout)
        part.session = GgufSession.without_header(source, self._arch(source)[0], part.write)
        return part


def gguf_tensors_in_order(plans: list[TensorPlan], n_experts: int, where: object = None
                          ) -> list[tuple[str, list[TensorPlan]]]:
    """The GGUF tensors the planned records make, as (GGUF name, the plans that fill it), in the order
    their data can be written: a tensor is complete at its last record, so a stack of experts goes where
    its last expert arrives (the records arrive in this order again when the data is written, and only
    the experts of stacks not yet complete are held). A stack must hold each of the `n_experts` experts
    once, all of one shape and one target type (BadInput naming the stack otherwise)."""
    groups: dict[str, list[TensorPlan]] = {}
    last: dict[str, int] = {}
    for i, p in enumerate(plans):
        groups.setdefault(p.out_name, []).append(p)
        last[p.out_name] = i
    for name, members in groups.items():
        if members[0].action.expert is None:
            if len(members) > 1:
                raise BadInput(f"{len(members)} tensors of the checkpoint map to {name} ({members[0].name}, "
                               f"{members[1].name})", path=where, tensor=members[1].name)
            continue
        have = sorted(p.action.expert for p in members)
        if have != list(range(n_experts)):
            missing = sorted(set(range(n_experts)) - set(have))
            dup = sorted({e for e in have if have.count(e) > 1})
            what = (f"expert {missing[0]} is missing" if missing else
                    f"expert {dup[0]} appears twice" if dup else f"expert {have[-1]} is beyond the count")
            raise BadInput(f"config.json declares {n_experts} experts but {what} (stacked into {name})", path=where,
                           tensor=members[0].name)
        for p in members[1:]:
            if tuple(p.shape) != tuple(members[0].shape) or p.target != members[0].target:
                raise BadInput(f"expert {p.action.expert} is {list(p.shape)} as {p.target} but expert "
                               f"{members[0].action.expert} is {list(members[0].shape)} as {members[0].target}: "
                               f"one stacked tensor {name} holds them", path=where, tensor=p.name)
        members.sort(key=lambda p: p.action.expert)
    return sorted(groups.items(), key=lambda item: last[item[0]])


def stack_shape(members: list[TensorPlan]) -> tuple[int, ...]:
    """The HF-order shape of the GGUF tensor `members` fill: one record's, or the experts' stacked."""
    first = members[0]
    return tuple(first.shape) if first.action.expert is None else (len(members), *first.shape)


def _add_tokenizer(writer: gguf.GGUFWriter, source, n_vocab: int) -> None:
    """The tokenizer keys: copied verbatim from a GGUF source, else built from its tokenizer files."""
    if not source.write_gguf_tokenizer(writer):
        add_tokenizer(writer, Path(source.path), model_config(source), n_vocab)


class GgufSession(WriterSession):
    """Writes the planned tensors in order. With `split_max_size` (bytes) gguf-py starts a new part
    whenever the next tensor would overflow the current one; the parts are named
    `<stem>-0000i-of-0000N.gguf` next to `path` (llama.cpp loads the set from its first part)."""

    def __init__(self, path: Path, source, plans: list[TensorPlan], arch: str, n_layers: int, tokenizer: dict,
                 split_max_size: int = 0, mtp_blocks: int | None = None):
        self.writer = gguf.GGUFWriter(path=str(path), arch=arch, split_max_size=split_max_size)
        w = self.writer
        kept = [p for p in plans if not p.action.drop]
        counts: dict[str, int] = {}
        for p in kept:
            if len(p.shape) == 2:
                counts[p.target] = counts.get(p.target, 0) + 1
        dominant = max(counts, key=counts.get) if counts else "F32"
        preset_file_type = next((p.action.file_type for p in kept if p.action.file_type is not None), None)
        try:
            add_model_metadata(w, model_config(source), arch, mtp_blocks=mtp_blocks,
                               file_type=FILE_TYPES.get(dominant, 0) if preset_file_type is None else preset_file_type)
        except QConvertError as e:  # the hyper-parameters' refusals (metadata.py, archs/) name no file: the config's
            if e.path is not None:
                raise
            raise type(e)(e.detail, path=config_json_path(source), tensor=e.tensor) from None
        for key, value in tokenizer.items():  # the keys check_model built (GgufWriter._tokenizer_keys)
            w.add_key_value(key, value.value, value.type, sub_type=value.sub_type)
        self.extra = list(rope_tensors(model_config(source), arch))
        self._encode_as(source, arch)
        n_experts = _expert_count(source) if any(p.action.expert is not None for p in kept) else 0
        self.pending: dict[str, _ExpertSpill] = {}  # stacks of experts being filled
        self.reference: torch.Tensor | None = None  # the last add's source values (take_reference)
        self.spill_dir = Path(path).parent
        self.stack_size: dict[str, int] = {}
        for name, members in gguf_tensors_in_order(kept, n_experts, config_json_path(source)):
            first = members[0]
            lay = INTEGER_TABLE if first.target == INTEGER_TABLE.name else TARGET_LAYOUTS[first.target]
            shape = stack_shape(members)
            while first.action.ggml_n_dims and len(shape) > 1 and shape[0] == 1:  # ggml's outermost dims
                shape = shape[1:]
            rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
            nbytes = rows * lay.row_bytes(shape[-1])
            byte_shape = [*shape[:-1], lay.row_bytes(shape[-1])]  # gguf-py converts bytes back to elements
            if lay.ggml_type in GGUF_PY_UNKNOWN:  # Q2_0: gguf 0.19 has no sizes for it; the element shape as it is
                w.add_tensor_info(name, list(shape), np.dtype(np.int8), nbytes, raw_dtype=lay.ggml_type)
            else:
                w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes,
                                  raw_dtype=gguf.GGMLQuantizationType(lay.ggml_type))
            if first.action.expert is not None:
                self.stack_size[name] = len(members)
            scales = [m.action.tensor_scale for m in members]
            if any(v is not None for v in scales):  # NVFP4 global scales: llama.cpp's `.scale`, [1] or [experts]
                self.extra.append((name.removesuffix(".weight") + ".scale",
                                   np.array([1.0 if v is None else v for v in scales], dtype=np.float32)))
        for name, arr in self.extra:
            w.add_tensor_info(name, list(arr.shape), arr.dtype, arr.nbytes)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()

    @classmethod
    def without_header(cls, source, arch: str, write) -> "GgufSession":
        """A session that encodes each tensor as `add` does and hands its bytes to `write(plan, data)` instead
        of appending them: a part of a split conversion (split.py), whose driver wrote the header."""
        self = cls.__new__(cls)
        self._encode_as(source, arch)
        self.reference = None
        self._write = write
        return self

    def _encode_as(self, source, arch: str) -> None:
        """What `add` needs to encode a tensor, set in one place for the whole session and for a split part's
        headerless one (a field added to one and not the other broke the parts once)."""
        self.source, self.arch = source, arch
        self.spec = arch_by_name(arch)
        self.norm_shift = self.spec.norm_shift

    def add(self, plan: TensorPlan, item: Dense | Grid) -> torch.Tensor:
        if plan.action.drop:
            return item.dequantize(torch.float32)
        if plan.target == INTEGER_TABLE.name:  # an integer table (GgufArch.integer_tensors), its values as they are
            table = item.tensor.to(torch.int32)
            if not torch.equal(table.to(item.tensor.dtype), item.tensor):
                raise BadInput(f"{plan.out_name}: a value does not fit in int32", tensor=plan.name)
            self._write(plan, table.contiguous().view(torch.uint8).numpy().reshape(-1))
            self.reference = None
            return table.to(torch.float32)
        lay = TARGET_LAYOUTS[plan.target]
        perm = qk_row_permutation(plan.name, model_config(self.source), self.arch)
        if perm is not None:
            # a Grid, or reader.CodebookDense (IQ4_*), reorders its block bytes too
            item = item.permute_rows(perm) if hasattr(item, "permute_rows") else Dense(item.tensor[perm])
        shift = self.norm_shift if self.spec.shifts_norm(plan.out_name) else 0.0
        if shift:  # Gemma: llama.cpp multiplies by the stored norm, transformers by 1 + w
            item = Dense(item.dequantize(torch.float32) + shift)
        stored = self.spec.stored_values(plan.out_name)  # Qwen3.5's A = -exp(A_log): measured after the inverse
        if stored is not None:
            item = Dense(stored[0](item.dequantize(torch.float32)))
        source = SourceValues(item)
        data, decoded = encode_tensor(lay, plan.verdict, item, plan.action.quant, source=source)
        if shift:
            decoded = decoded - shift
        if stored is not None and not isinstance(decoded, BitIdentical):
            decoded = stored[1](decoded)
        self._write(plan, data.reshape(-1))
        ref = None if shift or stored is not None or isinstance(decoded, BitIdentical) else source.values
        if perm is not None and not isinstance(decoded, BitIdentical):
            decoded = decoded[inverse_permutation(perm)]
            ref = None if ref is None else ref[inverse_permutation(perm)]
        self.reference = ref
        return decoded

    def take_reference(self) -> torch.Tensor | None:
        """The float32 source values the last `add` dequantized to encode its tensor (in the record's row
        order), once, or None: the runner measures the error against them instead of dequantizing the
        source a second time."""
        ref, self.reference = self.reference, None
        return ref

    def _write(self, plan: TensorPlan, data: np.ndarray) -> None:
        """Append a tensor's bytes. An expert goes to its slot in a spill file until its stack is complete,
        then the stack is copied into the GGUF in chunks: the experts of a layer arrive interleaved across
        its three stacks (and may span shards), and holding them in memory would hold a layer."""
        if plan.action.expert is None:
            self.writer.write_tensor_data(data)
            return
        name = plan.out_name
        if name not in self.pending:
            self.pending[name] = _ExpertSpill(self.spill_dir, self.stack_size[name], data.nbytes)
        spill = self.pending[name]
        spill.put(plan.action.expert, data)
        if spill.complete:
            del self.pending[name]
            with spill:
                _write_tensor_from_file(self.writer, spill.file, spill.nbytes)

    def close(self) -> None:
        if self.pending:  # the plan guaranteed every expert; a source that changed under us is a bug
            for spill in self.pending.values():
                spill.file.close()
            raise AssertionError(f"experts never arrived for {sorted(self.pending)}")
        for _, arr in self.extra:
            self.writer.write_tensor_data(arr)
        self.writer.close()


class _ExpertSpill:
    """One stacked expert tensor being filled: an anonymous temporary file (gone when closed, or when the
    process ends) with a slot of `expert_bytes` per expert, written as the experts arrive in any order."""

    def __init__(self, folder: Path, count: int, expert_bytes: int):
        self.file = tempfile.TemporaryFile(dir=folder, prefix=".qconvert-experts-")
        self.count, self.expert_bytes, self.nbytes = count, expert_bytes, count * expert_bytes
        self.filled: set[int] = set()

    def put(self, index: int, data: np.ndarray) -> None:
        if data.nbytes != self.expert_bytes:  # the plan gave every expert one shape and type
            raise AssertionError(f"expert {index} encodes to {data.nbytes} bytes, not {self.expert_bytes}")
        os.pwrite(self.file.fileno(), np.ascontiguousarray(data).view(np.uint8).data, index * self.expert_bytes)
        self.filled.add(index)

    @property
    def complete(self) -> bool:
        return len(self.filled) == self.count

    def __enter__(self) -> "_ExpertSpill":
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()


_COPY_CHUNK = 4 << 20  # bytes of a spilled expert stack copied at once


def _write_tensor_from_file(writer: gguf.GGUFWriter, f, nbytes: int) -> None:
    """gguf-py's write_tensor_data for bytes held in a file: the next tensor info's data, padded to the
    alignment before and after as gguf-py pads, copied in chunks (never the whole tensor in memory)."""
    file_id = next(i for i, tensors in enumerate(writer.tensors) if tensors)
    fout = writer.fout[file_id]
    info = writer.tensors[file_id].pop(next(iter(writer.tensors[file_id])))
    if info.nbytes != nbytes:
        raise AssertionError(f"tensor info holds {info.nbytes} bytes, the stack {nbytes}")
    writer.write_padding(fout, fout.tell())
    f.seek(0)
    left = nbytes
    while left:
        chunk = f.read(min(_COPY_CHUNK, left))
        if not chunk:
            raise AssertionError("the expert spill file ended early")
        fout.write(chunk)
        left -= len(chunk)
    writer.write_padding(fout, nbytes)
    writer.state = gguf.gguf_writer.WriterState.WEIGHTS



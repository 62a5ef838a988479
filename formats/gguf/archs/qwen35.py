"""Qwen3.5 / Qwen3.6 (qwen35, and qwen35moe: every layer routed, a gated shared expert) and Qwen3-Next
(qwen3next: the same layers with fused linear-attention projections, no MRoPE, no value-head reorder): Gated-DeltaNet linear-attention layers between full-attention layers, MRoPE.

What llama.cpp's converter does beyond names (conversion/qwen.py: Qwen3NextModel and
_LinearAttentionVReorderBase.modify_tensors, _Qwen35MRopeMixin), each undone on the way back:

- every RMSNorm multiplies by 1 + w in transformers (Qwen3_5RMSNorm) and is stored as 1 + w (norm_shift),
  except the linear attention's gated norm (Qwen3_5RMSNormGated, w itself): `ssm_norm` stays as it is;
- A_log is stored as A = -exp(A_log) (`ssm_a`, no .weight suffix), dt_bias as `ssm_dt.bias`, the depthwise
  conv1d kernel [channels, 1, kernel] as [channels, kernel];
- with fewer key heads than value heads, the value heads are reordered from grouped by key head
  ([k0: v0 v1, k1: v0 v1]) to tiled ([k0 v0, k1 v0, k0 v1, k1 v1]) so that ggml broadcasts the keys
  instead of repeating them: the V rows of in_proj_qkv and the conv1d kernel, the rows of in_proj_z,
  in_proj_a and in_proj_b, A_log and dt_bias, and the columns of out_proj;
- the multi-token-prediction block (`mtp.*`) becomes the blocks after the trunk (`mtp`, archs/mtp.py: mtp.fc as
  blk.N.nextn.eh_proj, ...), or is left out with --no-mtp, as the converter does.

The full-attention q_proj holds each head's query and its output gate (2x rows: gated_query).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

import gguf
import torch

from ....converters.errors import BadInput
from ....converters.records import Dense, TensorRecord
from .base import HF_DENSE_BLOCK, GgufArch, StoredValues, moe_config, register_arch
from .mtp import qwen_mtp
from .qwen import QWEN_MOE_BLOCK, QWEN_SHARED_EXPERT, qwen_moe_extra
from ..hparams import MAX_HEADS, MAX_WIDTH, rope_parameters


LINEAR_ATTENTION_BLOCK = ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
                          "linear_attn.in_proj_a", "linear_attn.conv1d", "linear_attn.dt_proj",
                          "linear_attn.A_log", "linear_attn.norm", "linear_attn.out_proj")
# what llama.cpp's qwen35 loader requires of a linear-attention layer (ssm_a and ssm_dt.bias have no .weight)
_LINEAR_REQUIRED = ("attn_qkv", "attn_gate", "ssm_conv1d", "ssm_alpha", "ssm_beta", "ssm_norm", "ssm_out", "ssm_a",
                    "ssm_dt.bias")
# Qwen3.5's default MRoPE sections (time, height, width, extra), which llama.cpp's loader requires: its
# converter writes them when a config has none (_Qwen35MRopeMixin)
DEFAULT_MROPE_SECTION = [11, 11, 10, 0]
# the per-layer recurrent flags llama.cpp's hybrid loaders read; gguf 0.19 (PyPI) has no name for the key yet
# (the vendored gguf-py: Keys.Attention.RECURRENT_LAYERS)
RECURRENT_LAYERS_KEY = "{arch}.attention.recurrent_layers"


class LinearAttentionDims:
    """The Gated DeltaNet sizes of a config.json (checked: the value heads a multiple of the key heads)."""

    def __init__(self, config: Mapping, where: object = None):
        try:
            self.k_heads = int(config["linear_num_key_heads"])
            self.v_heads = int(config["linear_num_value_heads"])
            self.k_dim = int(config["linear_key_head_dim"])
            self.v_dim = int(config["linear_value_head_dim"])
        except (KeyError, TypeError, ValueError):
            raise BadInput("config.json lacks linear_num_key_heads / linear_num_value_heads / linear_key_head_dim / "
                           "linear_value_head_dim, which size the linear attention", path=where) from None
        if not (0 < self.k_heads <= MAX_HEADS and 0 < self.v_heads <= MAX_HEADS and 0 < self.k_dim <= MAX_WIDTH
                and 0 < self.v_dim <= MAX_WIDTH) or self.v_heads % self.k_heads:
            raise BadInput(f"linear_num_value_heads {self.v_heads} is not a positive multiple of "
                           f"linear_num_key_heads {self.k_heads} (or a head size is out of range)", path=where)
        self.per_k = self.v_heads // self.k_heads

    @property
    def reorders(self) -> bool:
        return self.per_k > 1


def _swap_heads(t: torch.Tensor, dim: int, outer: int, inner: int, size: int) -> torch.Tensor:
    """Along `dim` (outer x inner x size entries), exchange the outer and inner head indices: grouped
    [k][v_per_k] -> tiled [v_per_k][k] with (outer, inner) = (k heads, value heads per key head); the
    inverse with the two swapped."""
    shape = list(t.shape)
    dim %= len(shape)
    t = t.reshape(*shape[:dim], outer, inner, size, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).contiguous().reshape(shape)


def _reorder(kind: str, t: torch.Tensor, d: LinearAttentionDims, to_gguf: bool) -> torch.Tensor:
    """The value-head reorder of one linear-attention tensor (`kind` its HF module), or its inverse."""
    outer, inner = (d.k_heads, d.per_k) if to_gguf else (d.per_k, d.k_heads)
    if kind == "in_proj_qkv":  # only the V rows (after q and k)
        qk = 2 * d.k_heads * d.k_dim
        return torch.cat([t[:qk], _swap_heads(t[qk:], 0, outer, inner, d.v_dim)])
    if kind == "conv1d":  # channels: q, k, then v
        qk = 2 * d.k_heads * d.k_dim
        return torch.cat([t[:qk], _swap_heads(t[qk:], 0, outer, inner, d.v_dim)])
    if kind == "in_proj_z":
        return _swap_heads(t, 0, outer, inner, d.v_dim)
    if kind in ("in_proj_a", "in_proj_b", "A_log", "dt_bias"):
        return _swap_heads(t, 0, outer, inner, 1)
    if kind == "out_proj":  # its columns are the value heads
        return _swap_heads(t, 1, outer, inner, d.v_dim)
    return t


def _linear_kind(hf_name: str) -> str | None:
    """`in_proj_qkv`, `conv1d`, `A_log`, ... for a linear-attention tensor, else None."""
    head, sep, tail = hf_name.partition(".linear_attn.")
    if not sep:
        return None
    return tail.split(".")[0]


_A_LOG = (lambda a_log: -torch.exp(a_log), lambda a: torch.log(-a),
          "stored as A = -exp(A_log), as llama.cpp's ssm_a (float32 exp rounds)")


def a_log_values(gguf_name: str) -> StoredValues | None:
    """A_log is stored as A = -exp(A_log) (the writer's session applies it and measures after the log)."""
    return _A_LOG if gguf_name.endswith(".ssm_a") else None


def _dense(item) -> torch.Tensor:
    return item.tensor if isinstance(item, Dense) else item.dequantize(torch.float32)


def _qkvz_rows(d: LinearAttentionDims) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next's in_proj_qkvz rows ([q k v z] per key head) -> (the rows of [q_all k_all v_all], of z_all):
    what llama.cpp's converter splits it into (attn_qkv, attn_gate)."""
    kd, vd = d.k_dim, d.per_k * d.v_dim
    rows = torch.arange(d.k_heads * (2 * kd + 2 * vd)).reshape(d.k_heads, 2 * kd + 2 * vd)
    q, k, v, z = rows.split([kd, kd, vd, vd], dim=1)
    return torch.cat([q.reshape(-1), k.reshape(-1), v.reshape(-1)]), z.reshape(-1)


# the linear-attention projections whose value-head reorder moves whole rows (out_proj's moves columns)
_ROW_KINDS = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b")


def _rows_of(rec: TensorRecord, rows: torch.Tensor, name: str, what: str) -> TensorRecord:
    """The record of `rec`'s rows `rows` (a permutation or a subset), named `name`: a grid's rows with their
    codes and parameters (GridParams.permute_rows), a dense tensor's rows."""
    label = f"{rec.source_name or rec.name} ({what})"
    shape = (rows.numel(), *rec.shape[1:])
    if rec.is_grid:
        return replace(rec, name=name, shape=shape, params=rec.params.permute_rows(rows),
                       load=lambda: rec.load().permute_rows(rows), source_name=label)
    return replace(rec, name=name, shape=shape, load=lambda: Dense(rec.load().tensor[rows].contiguous()),
                   source_name=label)


def _to_gguf(tiled: bool):
    """The writer's hook (GgufArch.to_gguf_record): `tiled` reorders the value heads (Qwen3.5's converter),
    Qwen3-Next's fused in_proj_qkvz is split into in_proj_qkv and in_proj_z as llama.cpp stores them."""

    def to_gguf(rec: TensorRecord, config: Mapping, where: object = None) -> list[TensorRecord]:
        """A record as llama.cpp's converter stores it: the conv1d kernel squeezed, the value heads tiled
        (A_log's -exp is the session's: a_log_values), in_proj_qkvz split. A quantized record keeps its grid
        where its rows move, or its columns move by whole groups (out_proj); otherwise it is dequantized
        first; records outside the linear attention pass."""
        kind = _linear_kind(rec.name)
        if kind is None or kind == "norm":
            return [rec]
        d = LinearAttentionDims(config, where)
        dtype = rec.dtype if not rec.is_grid else "float32"
        if kind == "in_proj_qkvz":
            qkv, z = _qkvz_rows(d)
            if tuple(rec.shape[:1]) != (qkv.numel() + z.numel(),) or len(rec.shape) != 2:
                raise BadInput(f"in_proj_qkvz of shape {list(rec.shape)} contradicts the linear attention's "
                               f"sizes ({qkv.numel() + z.numel()} rows)", path=where, tensor=rec.name)
            head = rec.name[: rec.name.index(".in_proj_qkvz")]
            return [_rows_of(rec, rows, f"{head}.{part}.weight", f"{what} rows")
                    for part, rows, what in (("in_proj_qkv", qkv, "q, k, v"), ("in_proj_z", z, "z"))]
        if tiled and d.reorders and kind in _ROW_KINDS and len(rec.shape) == 2:
            # rows only: a quantized source's grid keeps its codes (whole rows move)
            rows = _reorder(kind, torch.arange(rec.shape[0]), d, to_gguf=True)
            return [_rows_of(rec, rows, rec.name, "value heads tiled")]
        if tiled and d.reorders and kind == "out_proj" and rec.is_grid and len(rec.shape) == 2:
            # out_proj's columns are the value heads: when a head's head_v_dim columns are whole groups (no
            # act-order), the reorder is a permutation of groups, so the codes keep their scales and a block
            # target (Q4_0 from a 4-bit g32 GPTQ) keeps them; otherwise it is dequantized below
            columns = _reorder(kind, torch.arange(rec.shape[1])[None], d, to_gguf=True)[0]
            order = rec.params.whole_group_order(columns)
            if order is not None:
                return [replace(rec, params=rec.params.permute_groups(order),
                                load=lambda: rec.load().permute_columns(columns, order),
                                source_name=f"{rec.source_name or rec.name} (value-head columns tiled)")]
        shape = tuple(rec.shape)
        if kind == "conv1d":
            if len(shape) != 3 or shape[1] != 1:
                raise BadInput(f"conv1d kernel of shape {list(shape)}: expected [channels, 1, kernel]", path=where,
                               tensor=rec.name)
            shape = (shape[0], shape[2])
        reorder = tiled and d.reorders
        if not reorder and kind != "conv1d":
            return [rec]

        def load() -> Dense:
            t = _dense(rec.load())
            if kind == "conv1d":
                t = t.reshape(shape)
            if reorder:
                t = _reorder(kind, t, d, to_gguf=True)
            return Dense(t.contiguous())

        return [replace(rec, shape=shape, dtype=dtype, load=load, params=None, native_type=None,
                        source_name=rec.source_name or rec.name)]

    return to_gguf


def _from_gguf(tiled: bool, fused: bool):
    """The reader's hook (GgufArch.from_gguf_record), the inverse of _to_gguf: (record, config, the file,
    `held`: records kept between calls) -> the records to yield (Qwen3-Next's in_proj_qkv waits in `held` for
    its in_proj_z, and the two are merged back into in_proj_qkvz)."""

    def from_gguf(rec: TensorRecord, config: Mapping, where: object, held: dict) -> list[TensorRecord]:
        kind = _linear_kind(rec.name)
        if kind is None or kind == "norm":
            return [rec]
        d = LinearAttentionDims(config, where)
        if fused and kind in ("in_proj_qkv", "in_proj_z"):
            head = rec.name[: rec.name.index(f".{kind}")]
            pair = held.setdefault(head, {})
            pair[kind] = rec
            if len(pair) < 2:
                return []
            del held[head]
            qkv, z = _qkvz_rows(d)
            order = torch.argsort(torch.cat([qkv, z]))  # row r of in_proj_qkvz is row order[r] of [qkv; z]
            a, b = pair["in_proj_qkv"], pair["in_proj_z"]
            if a.shape[0] != qkv.numel() or b.shape[0] != z.numel() or a.shape[1:] != b.shape[1:]:
                raise BadInput(f"{a.source_name or a.name} and {b.source_name or b.name} of shapes {list(a.shape)} "
                               f"and {list(b.shape)} do not make one in_proj_qkvz", path=where, tensor=a.name)

            def load() -> Dense:
                return Dense(torch.cat([_dense(a.load()), _dense(b.load())])[order].contiguous())

            return [replace(a, name=f"{head}.in_proj_qkvz.weight", shape=(qkv.numel() + z.numel(), *a.shape[1:]),
                            dtype="float32", load=load, params=None, native_type=None,
                            source_name=f"{a.source_name} + {b.source_name}")]
        shape = tuple(rec.shape)
        if kind == "conv1d":
            shape = (shape[0], 1, shape[1])
        reorder = tiled and d.reorders
        if not reorder and kind not in ("conv1d", "A_log"):
            return [rec]

        def load() -> Dense:
            t = _dense(rec.load())
            if kind == "A_log":
                t = _A_LOG[1](t.to(torch.float32))
            if reorder:
                t = _reorder(kind, t, d, to_gguf=False)
            return Dense(t.reshape(shape).contiguous())

        dtype = "float32" if kind == "A_log" or rec.is_grid else rec.dtype
        return [replace(rec, shape=shape, dtype=dtype, load=load, params=None, native_type=None)]

    return from_gguf


# --------------------------------------------------------------------------------------------------
# metadata, both ways
# --------------------------------------------------------------------------------------------------
def _layer_types(config: Mapping) -> list[str]:
    n = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types is None:  # transformers' default: every full_attention_interval-th layer is full attention
        interval = int(config.get("full_attention_interval") or 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in ("linear_attention", "full_attention")
                                                             for t in types):
        raise BadInput(f"layer_types must name linear_attention or full_attention for each of the {n} layers")
    return types


def _rope_dims(config: Mapping) -> int:
    hd = int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))
    factor = rope_parameters(config).get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))
    return int(hd * float(factor))


def _linear_attention_keys(writer: gguf.GGUFWriter, config: Mapping) -> None:
    """The keys Qwen3-Next and Qwen3.5 share (Qwen3NextModel.set_gguf_parameters): the Gated DeltaNet sizes as
    ssm.*, which layers are recurrent, the rotated part of each head."""
    d = LinearAttentionDims(config)
    writer.add_ssm_conv_kernel(int(config.get("linear_conv_kernel_dim") or 4))
    writer.add_ssm_state_size(d.k_dim)
    writer.add_ssm_group_count(d.k_heads)
    writer.add_ssm_time_step_rank(d.v_heads)
    writer.add_ssm_inner_size(d.v_dim * d.v_heads)
    # one flag per block the file holds: the MTP blocks after the trunk are full attention (block_count is written
    # first, metadata.add_model_metadata)
    flags = [t == "linear_attention" for t in _layer_types(config)]
    blocks = int(writer.kv_data[0][f"{writer.arch}.block_count"].value)
    writer.add_array(RECURRENT_LAYERS_KEY.format(arch=writer.arch), flags + [False] * (blocks - len(flags)))
    writer.add_full_attention_interval(int(config.get("full_attention_interval") or 4))
    writer.add_rope_dimension_count(_rope_dims(config))


def _qwen3next_extra(writer: gguf.GGUFWriter, config: Mapping) -> None:
    qwen_moe_extra(writer, config)
    _linear_attention_keys(writer, config)


def _qwen3next_caveats(config: Mapping) -> list[str]:
    out = []
    # llama.cpp's qwen3next graph always renormalises the chosen experts' weights and has no dense layers
    if config.get("norm_topk_prob") is False:
        out.append("norm_topk_prob is false but llama.cpp's qwen3next always renormalises the top-k expert weights")
    if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step") or 1) != 1:
        out.append("mlp_only_layers / decoder_sparse_step ask for dense layers, which llama.cpp's qwen3next lacks")
    return out


def _qwen35_extra(writer: gguf.GGUFWriter, config: Mapping) -> None:
    """The keys llama.cpp's converter adds for Qwen3.5 (Qwen3NextModel.set_gguf_parameters and
    _Qwen35MRopeMixin): the Gated DeltaNet sizes as ssm.*, which layers are recurrent, the rotated part of
    each head, and the MRoPE sections (required by llama.cpp's qwen35 loader)."""
    _linear_attention_keys(writer, config)
    section = rope_parameters(config).get("mrope_section")
    if section is None:
        writer.add_rope_dimension_sections(DEFAULT_MROPE_SECTION)
    else:
        writer.add_rope_dimension_sections([int(s) for s in (list(section) + [0, 0, 0, 0])[:4]])


def _qwen35moe_extra(writer: gguf.GGUFWriter, config: Mapping) -> None:
    qwen_moe_extra(writer, config)  # the routed and shared experts' counts and widths (Qwen2MoeModel's keys)
    _qwen35_extra(writer, config)


def _qwen35_config(cfg: dict, get, names, cv, arch: str = "qwen35", mrope: bool = True) -> None:
    """Qwen3_5TextConfig from the GGUF keys: the linear attention's sizes, the layer kinds, rope on
    rope.dimension_count of each head in the stored MRoPE sections (interleaved, as Qwen3.5's rotary does)."""
    v_heads = get("ssm.time_step_rank", required=True, lo=1, hi=MAX_HEADS)
    inner = get("ssm.inner_size", required=True, lo=1, hi=MAX_WIDTH * MAX_HEADS)
    if inner % v_heads:
        raise BadInput(f"metadata {arch}.ssm.inner_size {inner} is not a multiple of {arch}.ssm.time_step_rank "
                       f"{v_heads}", path=cv.path)
    n = cfg["num_hidden_layers"]  # the trunk (config_from_gguf has taken the MTP blocks off)
    flags = cv.get(RECURRENT_LAYERS_KEY.format(arch=arch))
    total = n + int(cfg.get("_mtp_blocks") or 0)
    if not isinstance(flags, list) or len(flags) != total or not all(isinstance(f, bool) for f in flags):
        raise BadInput(f"metadata {arch}.attention.recurrent_layers is not {total} booleans (one per block)",
                       path=cv.path)
    flags = flags[:n]
    rope_dims = get("rope.dimension_count", required=True, lo=2, hi=cfg["head_dim"])
    sections = cv.get(f"{arch}.rope.dimension_sections") if mrope else [0, 0, 0, 0]
    if not isinstance(sections, list) or len(sections) != 4 or not all(isinstance(s, int) for s in sections):
        raise BadInput(f"metadata {arch}.rope.dimension_sections is not 4 integers", path=cv.path)
    cfg.update(linear_conv_kernel_dim=get("ssm.conv_kernel", required=True, lo=1, hi=MAX_WIDTH),
               linear_key_head_dim=get("ssm.state_size", required=True, lo=1, hi=MAX_WIDTH),
               linear_num_key_heads=get("ssm.group_count", required=True, lo=1, hi=v_heads),
               linear_num_value_heads=v_heads, linear_value_head_dim=inner // v_heads,
               layer_types=["linear_attention" if f else "full_attention" for f in flags],
               attention_bias=False)
    if v_heads % cfg["linear_num_key_heads"]:
        raise BadInput(f"metadata {arch}.ssm.time_step_rank {v_heads} is not a multiple of {arch}.ssm.group_count "
                       f"{cfg['linear_num_key_heads']}", path=cv.path)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta"),
                              "partial_rotary_factor": rope_dims / cfg["head_dim"]}
    if mrope:
        cfg["rope_parameters"].update(mrope_section=list(sections[:3]), mrope_interleaved=True)
    cfg.pop("rope_scaling", None)


def _qwen3next_config(cfg: dict, get, names, cv) -> None:
    """Qwen3NextConfig: _qwen35_config without MRoPE, the routed experts in every layer (renormalised, as
    llama.cpp's graph does) and the gated shared expert."""
    _qwen35_config(cfg, get, names, cv, arch="qwen3next", mrope=False)
    moe_config(cfg, get, names, cv)
    if "num_local_experts" not in cfg:
        raise BadInput("GGUF metadata lacks qwen3next.expert_count (Qwen3-Next routes every layer)", path=cv.path)
    cfg.update(num_experts=cfg.pop("num_local_experts"), norm_topk_prob=True, decoder_sparse_step=1,
               mlp_only_layers=[], shared_expert_intermediate_size=get("expert_shared_feed_forward_length",
                                                                       required=True, lo=1, hi=MAX_WIDTH))


def _qwen35moe_config(cfg: dict, get, names, cv) -> None:
    """Qwen3_5MoeTextConfig: _qwen35_config plus the routed experts (every layer; transformers' router always
    renormalises the top-k weights, as llama.cpp's qwen35moe graph does) and the gated shared expert."""
    _qwen35_config(cfg, get, names, cv, arch="qwen35moe")
    moe_config(cfg, get, names, cv)
    if "num_local_experts" not in cfg:
        raise BadInput("GGUF metadata lacks qwen35moe.expert_count (Qwen3.5-MoE routes every layer)", path=cv.path)
    cfg["num_experts"] = cfg.pop("num_local_experts")
    cfg["shared_expert_intermediate_size"] = get("expert_shared_feed_forward_length", required=True, lo=1,
                                                 hi=MAX_WIDTH)


register_arch(GgufArch("qwen35", ("Qwen3_5ForCausalLM",), ("qwen3_5_text",), "Qwen3_5ForCausalLM", "qwen3_5_text",
                       norm_shift=1.0, unshifted_norms=("ssm_norm",), extra_metadata=_qwen35_extra,
                       norms=("attn_norm", "post_attention_norm"),
                       attention=("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm"),
                       linear_attention=_LINEAR_REQUIRED, gated_query=True, mtp=qwen_mtp("mtp_num_hidden_layers"),
                       hf_block=HF_DENSE_BLOCK + LINEAR_ATTENTION_BLOCK, config_from_gguf=_qwen35_config,
                       to_gguf_record=_to_gguf(tiled=True),
                       from_gguf_record=_from_gguf(tiled=True, fused=False), stored_values=a_log_values))
register_arch(GgufArch("qwen35moe", ("Qwen3_5MoeForCausalLM",), ("qwen3_5_moe_text",), "Qwen3_5MoeForCausalLM",
                       "qwen3_5_moe_text", moe=True, dense_ffn_width=False,
                       norm_shift=1.0, unshifted_norms=("ssm_norm",), extra_metadata=_qwen35moe_extra,
                       norms=("attn_norm", "post_attention_norm"),
                       attention=("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm"),
                       linear_attention=_LINEAR_REQUIRED, gated_query=True, mtp=qwen_mtp("mtp_num_hidden_layers"),
                       hf_block=HF_DENSE_BLOCK + LINEAR_ATTENTION_BLOCK + QWEN_MOE_BLOCK,
                       routed_extra=QWEN_SHARED_EXPERT, config_from_gguf=_qwen35moe_config,
                       to_gguf_record=_to_gguf(tiled=True),
                       from_gguf_record=_from_gguf(tiled=True, fused=False), stored_values=a_log_values))
# Qwen3-Next: its linear attention's projections fused per key head (in_proj_qkvz, split into attn_qkv and
# attn_gate; in_proj_ba kept as ssm_ba), value heads left grouped (its converter does not tile them)
register_arch(GgufArch("qwen3next", ("Qwen3NextForCausalLM",), ("qwen3_next",), "Qwen3NextForCausalLM", "qwen3_next",
                       moe=True, norm_shift=1.0, unshifted_norms=("ssm_norm",), extra_metadata=_qwen3next_extra,
                       norms=("attn_norm", "post_attention_norm"),
                       attention=("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm"),
                       linear_attention=("attn_qkv", "attn_gate", "ssm_conv1d", "ssm_ba", "ssm_norm", "ssm_out",
                                         "ssm_a", "ssm_dt.bias"), routed_extra=QWEN_SHARED_EXPERT,
                       gated_query=True, mtp=qwen_mtp(None), caveats=_qwen3next_caveats,
                       hf_block=HF_DENSE_BLOCK + LINEAR_ATTENTION_BLOCK + ("linear_attn.in_proj_ba",) + QWEN_MOE_BLOCK,
                       config_from_gguf=_qwen3next_config, to_gguf_record=_to_gguf(tiled=False),
                       from_gguf_record=_from_gguf(tiled=False, fused=True), stored_values=a_log_values))

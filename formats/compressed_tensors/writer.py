"""Writes compressed-tensors checkpoints (what vLLM loads, and transformers with compressed-tensors installed),
streaming tensors into safetensors shards: `pack-quantized` for integer grids, and for float grids (FP8, MXFP4,
NVFP4) the float format that holds their codes (`_add_float`).

Per quantized linear `<prefix>`: weight_packed int32 [out, ceil(in*b/32)] (schemes.pack_dense of the unsigned
codes), weight_scale [out, G] in the source's scale dtype, weight_shape int64 (out, in), and for an asymmetric
grid weight_zero_point int32 [ceil(out*b/32), G] (the unsigned zero points packed along the outputs). The
config has one config group per distinct scheme, targeting its modules by exact name, and the unquantized
linears and lm_head in `ignore`.

Float grids keep their codes: e4m3 under E8M0 exponents per 32 (OCP MXFP8) -> mxfp8-quantized (`weight`
F8_E4M3, `weight_scale` uint8 [out, in/32], as llm-compressor's MXFP8A16 writes it); other e4m3 -> float-quantized
(`weight` F8_E4M3 and `weight_scale` per tensor, channel, group or [rows, columns] block, as the source has them); e2m1 under E8M0 exponents per 32 -> mxfp4-pack-quantized
(`weight_packed` two codes a byte, even element low; `weight_scale` uint8); e2m1 under E4M3 scales per 16 ->
nvfp4-pack-quantized (`weight_scale` F8_E4M3 and `weight_global_scale` float32 [1], which compressed-tensors
divides the block scales by: a ModelOpt or GGUF global scale, a multiplier, is stored as its float32 reciprocal,
near-exact). The checker (schemes.CT_FLOAT) picks the first that holds the grid.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ...converters.checker import EXACT, NEAR_EXACT, REQUANTIZE, check
from ...converters.errors import QConvertError
from ...converters.plan import Options, TensorPlan, Writer, WriterSession
from ...converters.records import Dense, Grid, GridParams, TensorRecord, describe_record
from ..common.gptq_type import parse_gptq_type
from ..common.checkpoint import ShardWriter, copy_side_files, write_json
from ...kernels.floatq import float_to_e8m0, pack_fp4
from .schemes import CT_FLOAT, CT_PACK, pack_dense
from ..common.fp8_tiles import FP8_TILE, cast_to_fp8_tiles
from ...kernels.fp8_tiles import TILE

# --type for the FP8 128x128 target (E4M3 codes, power-of-two scale per tile; formats/common/fp8_tiles.py)
FP8_TILE_TYPES = ("fp8", "fp8-128x128-e8m0")
_FP8_TILES = "fp8-tiles"  # CtAction.float_format of that target

__all__ = ["CtWriter", "ct_rtn", "WeightScheme"]

_QUANTIZABLE = re.compile(r"^model\.layers\.\d+\..*_proj\.weight$")  # the decoder blocks' linears
_CT_VERSION = "0.19.0"  # the compressed-tensors whose layout this writes (quantization_config.version)


@dataclass(frozen=True)
class WeightScheme:
    bits: int
    group_size: int  # in_features (one group per row) is written as strategy "channel"
    symmetric: bool
    channel: bool

    def weights_args(self) -> dict:
        args = {"num_bits": self.bits, "type": "int", "symmetric": self.symmetric, "dynamic": False,
                "actorder": None, "block_structure": None, "observer": "memoryless_minmax", "observer_kwargs": {},
                "scale_dtype": None, "zp_dtype": None if self.symmetric else "torch.int8",
                "strategy": "channel" if self.channel else "group",
                "group_size": None if self.channel else self.group_size}
        return args


def ct_rtn(w: torch.Tensor, bits: int, group_size: int, sym: bool, scale_dtype: torch.dtype,
           compute_dtype: torch.dtype = torch.float32) -> Grid:
    """compressed-tensors' own round-to-nearest (quantization/utils/helpers.py calculate_qparams with the
    min-max observer, forward.py _quantize), in `compute_dtype` as it computes in the weight's dtype: min and
    max per group widened to include 0; symmetric: scale = max|x| / ((2**b - 1) / 2), zero 0; asymmetric:
    scale = (max - min) / (2**b - 1), zero = round(clamp(-2**(b-1) - min/scale)); a zero scale becomes the
    dtype's eps; q = round(clamp(x/scale + zero, -2**(b-1), 2**(b-1) - 1))."""
    out_f, in_f = w.shape
    gs = in_f if group_size <= 0 else group_size
    cd = compute_dtype
    x = w.to(cd).reshape(out_f, in_f // gs, gs)
    lo, hi = x.amin(-1).clamp(max=0), x.amax(-1).clamp(min=0)
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if sym:
        scale = torch.maximum(lo.abs(), hi) / ((qmax - qmin) / 2)
    else:
        scale = (hi - lo) / (qmax - qmin)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(scale.dtype).eps, dtype=scale.dtype), scale)
    scale = scale.to(scale_dtype)
    s = scale.to(cd)
    zero = torch.zeros_like(s) if sym else torch.round(torch.clamp(qmin - lo / s, qmin, qmax))
    q = torch.round(torch.clamp(x / s[..., None] + zero[..., None], qmin, qmax))
    offset = 1 << (bits - 1)
    codes = (q.to(torch.int16) + offset).to(torch.uint8).reshape(out_f, in_f)
    params = GridParams(bits=bits, group_size=gs, scales=scale, zeros=(zero.to(torch.int16) + offset))
    return Grid(params, codes=codes)


def _zero_point_form(p: GridParams) -> GridParams:
    """A min-form grid whose block mins are -d*z with integer z (checked by the scheme) as zero points."""
    if p.mins is None:
        return p
    d, m = p.scales.to(torch.float32), p.mins.to(torch.float32)
    z = torch.where(d != 0, -m / torch.where(d != 0, d, 1), 0).round().to(torch.int16)
    return GridParams(bits=p.bits, group_size=p.group_size, scales=p.scales, zeros=z, g_idx=p.g_idx)


@dataclass(frozen=True)
class CtAction:
    """How the session stores one tensor beyond copying it: a float grid's codes in the compressed-tensors float
    format `float_format`; a quantized embedding or head dequantized to `dense`; or requantized at `scheme`
    (plans whose verdict is requantize)."""

    float_format: str = ""
    dense: torch.dtype | None = None
    scheme: WeightScheme | None = None


class CtWriter(Writer):
    """compressed-tensors pack-quantized output."""

    name = "compressed-tensors"

    def plan_tensor(self, rec: TensorRecord, options: Options, source) -> TensorPlan:
        explicit = options.explicit_type(rec.name) or options.type
        if rec.lossy_standin:
            # a folded stand-in (rotated GPTQ down_proj): the plain weights leave the grid
            return self._requant_plan(rec, explicit or "4g128", rec.lossy_standin)
        if explicit and explicit.lower() in FP8_TILE_TYPES and _QUANTIZABLE.match(rec.name) and len(rec.shape) == 2:
            # FP8 in 128x128 tiles under power-of-two scales (formats/common/fp8_tiles.py): MXFP4 casts exactly
            d = check(rec.params if rec.is_grid else rec.dtype, rec.shape, FP8_TILE)
            return self.plan(rec, d, f"float-quantized {FP8_TILE.name}", action=CtAction(float_format=_FP8_TILES))
        if rec.is_grid and _QUANTIZABLE.match(rec.name) and rec.params.element is not None and not explicit:
            plan = self._float_plan(rec)
            if plan is not None:
                return plan
        if rec.is_grid and _QUANTIZABLE.match(rec.name):
            p = rec.params
            if explicit:
                want = parse_gptq_type(explicit)
                group = want.group_size if want.group_size > 0 else rec.shape[1]
                if (want.bits, group, want.sym) != (p.bits, p.group_size, p.symmetric):
                    return self._requant_plan(rec, explicit, "type differs from the source grid", describe_record(rec))
            d = check(p, rec.shape, CT_PACK)
            target = f"pack-quantized {p.bits}-bit " + (f"g{p.group_size}" if p.n_groups > 1 else "per-channel")
            action = None
            if d.verdict == REQUANTIZE:
                action = CtAction(scheme=WeightScheme(p.bits if 1 <= p.bits <= 8 else 4, p.group_size,
                                                      p.symmetric, p.n_groups == 1))
            return self.plan(rec, d, target, action=action)
        if rec.is_grid:
            # embeddings and the head stay float, as compressed-tensors models keep them (lm_head is ignored)
            return TensorPlan(rec.name, rec.shape, describe_record(rec), "float16", NEAR_EXACT,
                              "kept unquantized (compressed-tensors quantizes the decoder linears): dequantized "
                              "weights round once to fp16", out_name=rec.name, action=CtAction(dense=torch.float16))
        if explicit and len(rec.shape) == 2 and _QUANTIZABLE.match(rec.name):
            return self._requant_plan(rec, explicit, "dense weights quantized with compressed-tensors' min-max "
                                                     "round-to-nearest (no calibration)")
        return TensorPlan(rec.name, rec.shape, rec.dtype, rec.dtype, EXACT, "copied", out_name=rec.name)

    def _float_plan(self, rec: TensorRecord) -> TensorPlan | None:
        """A float grid into the first compressed-tensors float format that keeps its codes (None: none does, and
        the grid is planned as any other: requantized to pack-quantized). mxfp8-quantized is offered to OCP MXFP8
        sources only (E8M0 scales per 32 of a row: mlx mxfp8, Quark, compressed-tensors' own): an FP8 grid with
        power-of-two scales in 128x128 blocks (DeepSeek-V3.1's ue8m0) or per channel keeps its own layout in
        float-quantized, one scale per block rather than one per 32."""
        p = rec.params
        mx_source = p.scales.dtype == torch.float8_e8m0fnu and p.group_size == 32 and p.block_rows == 1
        for fmt, scheme in CT_FLOAT.items():
            if fmt == "mxfp8-quantized" and not mx_source:
                continue
            d = check(rec.params, rec.shape, scheme)
            if d.keeps_codes:
                return self.plan(rec, d, fmt, action=CtAction(float_format=fmt))
        return None

    def _requant_plan(self, rec: TensorRecord, type_name: str, why: str, src: str | None = None) -> TensorPlan:
        want = parse_gptq_type(type_name)
        group = want.group_size if want.group_size > 0 else rec.shape[1]
        scheme = WeightScheme(want.bits, group, want.sym, group >= rec.shape[1])
        return TensorPlan(rec.name, rec.shape, src or rec.dtype, f"pack-quantized {type_name}", REQUANTIZE, why,
                          out_name=rec.name, action=CtAction(scheme=scheme))

    def open(self, path: Path, source, plans: list[TensorPlan], options: Options) -> "CtSession":
        return CtSession(Path(path), source)


class CtSession(WriterSession):
    def __init__(self, path: Path, source):
        self.path, self.source = path, source
        self.shards = ShardWriter(path)
        self.schemes: dict[str, tuple] = {}  # prefix -> (bits, symmetric, group size or None: one group, in)
        self.float_schemes: dict[str, tuple[str, str]] = {}  # prefix -> (format, its weights args as JSON)
        self.dense_linears: list[str] = []

    def add(self, plan: TensorPlan, item: Dense | Grid) -> torch.Tensor:
        action: CtAction = plan.action or CtAction()
        if action.float_format == _FP8_TILES:
            return self._add_fp8_tiles(plan.name[: -len(".weight")], item)
        if action.float_format:
            return self._add_float(plan.name[: -len(".weight")], item, action.float_format)
        if action.dense is not None:
            item = Dense(item.dequantize(torch.float32).to(action.dense))
        elif plan.verdict == REQUANTIZE:
            s = action.scheme
            w = item.dequantize(torch.float32)
            if isinstance(item, Dense) and item.tensor.dtype in (torch.float16, torch.bfloat16):
                # compressed-tensors quantizes a model in its own dtype, scales in that dtype too
                scale_dtype = compute = item.tensor.dtype
            else:
                scale_dtype, compute = (item.params.scales.dtype if isinstance(item, Grid)
                                        else _model_dtype(self.source.config)), torch.float32
            item = ct_rtn(w, s.bits, s.group_size, s.symmetric, scale_dtype, compute)
        if isinstance(item, Grid):
            self._add_grid(plan.name[: -len(".weight")], item)
            return item.dequantize(torch.float32)
        if len(plan.shape) == 2 and _QUANTIZABLE.match(plan.name):
            self.dense_linears.append(plan.name[: -len(".weight")])
        self.shards.put(plan.name, item.tensor)
        return item.tensor.to(torch.float32)

    def _add_grid(self, prefix: str, grid: Grid) -> None:
        p = _zero_point_form(grid.params)
        out_f, in_f = grid.shape
        put = self.shards.put
        put(f"{prefix}.weight_packed", pack_dense(grid.codes, p.bits))
        put(f"{prefix}.weight_scale", p.scales.contiguous())
        put(f"{prefix}.weight_shape", torch.tensor([out_f, in_f], dtype=torch.int64))
        symmetric = p.symmetric
        if not symmetric:
            put(f"{prefix}.weight_zero_point", pack_dense(p.zeros.T.contiguous(), p.bits).T.contiguous())
        self.schemes[prefix] = (p.bits, symmetric, p.group_size if p.n_groups > 1 else None, in_f)

    def _add_float(self, prefix: str, grid: Grid, fmt: str) -> torch.Tensor:
        """A float grid's codes and scales as `fmt` stores them (module docstring); -> the float32 values
        compressed-tensors decompresses them to (before its cast to the model dtype)."""
        import json

        p = grid.params
        out_f, in_f = grid.shape
        put = self.shards.put
        args = {"num_bits": p.bits, "type": "float", "symmetric": True, "dynamic": False, "actorder": None,
                "observer": "memoryless_minmax", "observer_kwargs": {}, "zp_dtype": None, "scale_dtype": None,
                "block_structure": None, "group_size": None}
        if fmt == "mxfp8-quantized":
            # compressors/mxfp8: the E4M3 codes as they are, one uint8 E8M0 exponent per 32 (the checker made
            # sure each group's scale is a power of two an E8M0 byte holds)
            scales = float_to_e8m0(p.folded_scales()[:, torch.arange(0, in_f, 32) // p.group_size]).contiguous()
            put(f"{prefix}.weight", grid.codes.view(torch.float8_e4m3fn))
            put(f"{prefix}.weight_scale", scales)
            args.update(strategy="group", group_size=32, scale_dtype="torch.uint8")
            e = scales.view(torch.float8_e8m0fnu).to(torch.float32)
            values = (p.codebook[grid.codes.to(torch.int64)].view(out_f, -1, 32) * e[..., None]).view(out_f, in_f)
        elif fmt == "float-quantized":
            put(f"{prefix}.weight", grid.codes.view(torch.float8_e4m3fn))
            # E8M0 exponents (OCP MXFP8) as float32, which holds every one exactly (the checker's _ct_fp8)
            s = p.scales.to(torch.float32) if p.scales.dtype == torch.float8_e8m0fnu else p.scales
            if p.block_rows > 1:  # the source's 2-D blocks (DeepSeek's 128x128), one scale row per block of rows
                rows = s[:: p.block_rows].contiguous()
                args.update(strategy="block", block_structure=[p.block_rows, p.group_size])
            elif p.n_groups == 1 and bool((s == s[0, 0]).all()):
                rows = s[:1, :1].reshape(1).contiguous()
                args.update(strategy="tensor")
            else:
                rows = s.contiguous()
                args.update(strategy="channel" if p.n_groups == 1 else "group",
                            group_size=None if p.n_groups == 1 else p.group_size)
            put(f"{prefix}.weight_scale", rows)
            values = grid.dequantize(torch.float32)
        else:
            put(f"{prefix}.weight_packed", pack_fp4(grid.codes))
            if fmt == "mxfp4-pack-quantized":
                scales = float_to_e8m0(p.folded_scales()[:, torch.arange(0, in_f, 32) // p.group_size])
                put(f"{prefix}.weight_scale", scales.contiguous())
                args.update(strategy="group", group_size=32, scale_dtype="torch.uint8")
                e = scales.view(torch.float8_e8m0fnu).to(torch.float32)
                stored = (p.codebook[grid.codes.to(torch.int64)].view(out_f, -1, 32) * e[..., None]).view(out_f, in_f)
                values = stored
            else:
                has_global = p.global_scale is not None
                block = p.scales.to(torch.float32) if has_global else p.folded_scales()
                block = block[:, torch.arange(0, in_f, 16) // p.group_size].to(torch.float8_e4m3fn)
                if not has_global:
                    g = torch.tensor(1.0)
                elif p.global_scale_op == "div":
                    g = p.global_scale.to(torch.float32)
                else:  # a multiplier (ModelOpt, llama.cpp's .scale): compressed-tensors divides by its reciprocal
                    g = torch.tensor(1.0, dtype=torch.float32) / p.global_scale.to(torch.float32)
                put(f"{prefix}.weight_scale", block.contiguous())
                put(f"{prefix}.weight_global_scale", g.reshape(1).to(torch.float32))
                args.update(strategy="tensor_group", group_size=16)
                eff = block.to(torch.float32) / g  # forward_helpers._dequantize: scale / global_scale first
                values = (p.codebook[grid.codes.to(torch.int64)].view(out_f, -1, 16) * eff[..., None]).view(out_f, in_f)
        self.float_schemes[prefix] = (fmt, json.dumps(args, sort_keys=True))
        return values

    def _add_fp8_tiles(self, prefix: str, item: Dense | Grid) -> torch.Tensor:
        """float-quantized, strategy block [128, 128]: E4M3 codes and one power-of-two scale per tile, stored as
        float32 (which holds every E8M0 value; compressed-tensors multiplies in the scale's dtype, so the product
        is exact) -> the float32 values compressed-tensors decompresses them to."""
        import json

        codes, e8m0, values = cast_to_fp8_tiles(item)
        self.shards.put(f"{prefix}.weight", codes.view(torch.float8_e4m3fn))
        self.shards.put(f"{prefix}.weight_scale", e8m0.view(torch.float8_e8m0fnu).to(torch.float32).contiguous())
        args = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "actorder": None,
                "observer": "memoryless_minmax", "observer_kwargs": {}, "zp_dtype": None, "scale_dtype": None,
                "strategy": "block", "block_structure": list(TILE), "group_size": None}
        self.float_schemes[prefix] = ("float-quantized", json.dumps(args, sort_keys=True))
        return values

    def close(self) -> None:
        if not self.schemes and not self.float_schemes:
            raise QConvertError("nothing to write as compressed-tensors: the source has no quantized tensors "
                                "(pass --type, e.g. 4g128, with --allow-requant)", path=self.source.path)
        self.shards.close()
        write_json(self.path / "config.json", {**self.source.config, "quantization_config": self._quant_config()})
        copy_side_files(self.source, self.path)

    def _quant_config(self) -> dict:
        by_scheme: dict[WeightScheme, list[str]] = {}
        for prefix, s in merged_schemes(self.schemes).items():
            by_scheme.setdefault(s, []).append(prefix)
        groups = {}
        for i, (s, prefixes) in enumerate(by_scheme.items()):
            groups[f"group_{i}"] = {"targets": prefixes, "weights": s.weights_args(), "input_activations": None,
                                    "output_activations": None, "format": "pack-quantized"}
        by_float: dict[tuple[str, str], list[str]] = {}
        for prefix, key in self.float_schemes.items():
            by_float.setdefault(key, []).append(prefix)
        import json

        for (fmt, args), prefixes in by_float.items():
            groups[f"group_{len(groups)}"] = {"targets": prefixes, "weights": json.loads(args),
                                              "input_activations": None, "output_activations": None, "format": fmt}
        formats = {g["format"] for g in groups.values()}
        ignore = ["lm_head"] + self.dense_linears
        return {"quant_method": "compressed-tensors", "format": formats.pop() if len(formats) == 1 else
                "mixed-precision", "quantization_status": "compressed",
                "config_groups": groups, "ignore": ignore, "kv_cache_scheme": None, "sparsity_config": {},
                "transform_config": {}, "global_compression_ratio": None, "version": _CT_VERSION}


def merged_schemes(found: dict[str, tuple]) -> dict[str, WeightScheme]:
    """As few config groups as the grids allow: a module with one group per row takes the group size G of
    the multi-group modules of its bits and symmetry when its row is one group of G (compressed-tensors'
    _process_group unflattens a row into whole groups), else strategy channel. Fewer groups is
    what transformers 5.24 needs: its dequantizing loader decodes every dense module with the first config
    group's scheme (integrations/compressed_tensors.py get_dense_scheme), not the module's own."""
    sizes: dict[tuple, set] = {}
    for bits, sym, group, _ in found.values():
        if group is not None:
            sizes.setdefault((bits, sym), set()).add(group)
    merged = {}
    for prefix, (bits, sym, group, in_f) in found.items():
        shared = sizes.get((bits, sym), set())
        if group is None and len(shared) == 1 and in_f == next(iter(shared)):
            group = next(iter(shared))
        merged[prefix] = WeightScheme(bits, group or 0, sym, group is None)
    return merged


def _model_dtype(config: dict) -> torch.dtype:
    name = config.get("dtype") or config.get("torch_dtype") or "float16"
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(str(name), torch.float16)

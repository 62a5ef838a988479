"""compressed-tensors checkpoints (llm-compressor 0.14, compressed-tensors 0.19; see schemes.py for the layout).

Per quantized module `<prefix>` (tensors as compressed-tensors' compressors write them):
- pack-quantized: `weight_packed` int32 [out, ceil(in*b/32)], `weight_scale` [out, G] ([out, 1] per channel,
  [1] per tensor), `weight_shape` int [2] = (out, in), asymmetric group/channel: `weight_zero_point` int32
  [ceil(out*b/32), G] packed along the outputs; older files with actorder "group": `weight_g_idx` [in].
- int-quantized / naive-quantized: `weight` int8 [out, in] (signed codes), `weight_scale`, optional
  `weight_zero_point` int8 [out, G] (signed).
  Both become a Grid: codes = signed + 2**(b-1), zeros = signed zero + 2**(b-1) (the mid code when symmetric).
- float-quantized, and naive-quantized with float weights (the same compressor under two names in
  compressed-tensors 0.19; llm-compressor 0.14 labels weight-only fp8 so) (fp8 e4m3 `weight` + `weight_scale`:
  tensor, channel, group or [rows, columns] block
  strategy, blocks at the edges padded), nvfp4-pack-quantized (`weight_packed` uint8 two e2m1 codes per byte,
  low nibble first, fp8 `weight_scale` per 16, float32 `weight_global_scale`, the divisor of every block scale)
  and mxfp4-pack-quantized (the same packing, a uint8 E8M0 `weight_scale` per 32), and mxfp8-quantized
  (compressors/mxfp8: float-quantized's F8_E4M3 `weight`, a uint8 E8M0 `weight_scale` [out, in/32], which
  compressed-tensors decodes to bfloat16 powers of two, decompress_mx_scale): float grids (codes index the
  element format's values; converters/records.py), whose dequantization equals compressed-tensors' own
  decompression bit for bit once rounded to its dtype (forward_helpers._dequantize: the scale over the global
  scale in float32, the product, then the cast; every fp8/fp4 product with a block scale is exact in float32).
Activation quantization parameters (`input_scale`, ...) describe a runtime choice, not the weights; they are
listed in describe() and not carried.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from ...converters.errors import BadInput
from ...converters.records import Grid, GridParams, TensorRecord, unused_zeros
from ...converters.model_shapes import ModelShapes
from ..common.checkpoint import CheckpointDir, CheckpointSource
from ...kernels.floatq import element_table, unpack_fp4
from ..common.float_grids import RuntimeScales, refuse_unscaled_fp8
from .schemes import E4M3_FORMATS, FLOAT_FORMATS, FP4_FORMATS, INT_FORMATS, QuantArgs, parse_rules, unpack_dense
from ..common.quant_config import CheckpointConfig, read_config

__all__ = ["CtSource", "open_ct", "WEIGHT_PARTS"]

WEIGHT_PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
                "weight_global_scale")
# activation / kv-cache quantization parameters: not weights (see describe())
_RUNTIME_PARTS = ("input_scale", "input_zero_point", "input_global_scale", "output_scale", "output_zero_point",
                  "k_scale", "v_scale", "q_scale")
_SCALE_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}


def dtype_hint(args: QuantArgs) -> str:
    """The dtype compressed-tensors stores a weight_zero_point in, for messages."""
    return "I32 packed" if args.fmt == "pack-quantized" else "I8"


def _quant_config(conf: CheckpointConfig) -> dict:
    where = conf.path
    qc = conf.quantization()
    if qc is None or not qc.data:
        raise BadInput("no quantization_config in config.json", path=where)
    method = qc.str("quant_method", default="")
    if method != "compressed-tensors":
        raise BadInput(f"quantization_config.quant_method is {method!r}, not 'compressed-tensors'", path=where)
    for key in ("sparsity_config", "transform_config"):
        extra = qc.get(key)
        if extra is not None and not isinstance(extra, dict):  # an object or null in every producer's config
            raise BadInput(f"quantization_config.{key} is not an object", path=where)
        if extra and not (key == "sparsity_config" and extra.get("format") in (None, "dense")):
            raise BadInput(f"quantization_config.{key} is set: sparse or transformed (rotated) compressed-tensors "
                           "models are not read", path=where)
    status = qc.get("quantization_status", "compressed")
    if status not in ("compressed", "frozen"):
        raise BadInput(f"quantization_config.quantization_status is {status!r}: the weights are not stored "
                       "compressed", path=where)
    return qc.data


class CtSource(RuntimeScales, CheckpointSource):
    """A compressed-tensors checkpoint directory, read lazily module by module."""

    format_name = "compressed-tensors"

    def __init__(self, path: Path):
        self.path = Path(path)
        self.ckpt = CheckpointDir(self.path)
        conf = read_config(self.path)
        self.quant_config = _quant_config(conf)
        self.config = conf.model
        self.shapes = ModelShapes(self.config, self.path / "config.json")
        self.rules, self.global_format = parse_rules(self.quant_config, self.path / "config.json")
        self.modules = self._modules()
        scaled = {n for _, parts in self.modules.values() for n in parts.values()}
        refuse_unscaled_fp8(self.ckpt, scaled, "weight_scale")
        self.runtime_params = sorted(n for n in self.ckpt.location if n.rpartition(".")[2] in _RUNTIME_PARTS)

    # -- which modules are quantized, with which scheme -------------------------------------------
    def _modules(self) -> dict[str, tuple[QuantArgs, dict[str, str]]]:
        parts: dict[str, dict[str, str]] = {}
        for name in self.ckpt.location:
            prefix, _, part = name.rpartition(".")
            if part in WEIGHT_PARTS:
                parts.setdefault(prefix, {})[part] = name
        modules = {}
        for prefix, found in parts.items():
            where = self.ckpt.file_of(found[min(found)])
            if "weight_scale" not in found:
                stored = "weight_packed" if "weight_packed" in found else min(found)
                raise BadInput(f"{stored} without weight_scale", path=where, tensor=f"{prefix}.weight_scale")
            # matched by the stored name and, where the checkpoint is renamed, the class's (CheckpointSource names)
            names = self.module_names(prefix)
            ignored = any(self.rules.ignored(n) for n in names)
            args = None if ignored else next((a for a in map(self.rules.scheme_of, names) if a is not None), None)
            if args is None:
                why = "is in the ignore list" if ignored else "matches no config group target"
                raise BadInput(f"module is stored quantized but {why}", path=where, tensor=found["weight_scale"])
            if args.fmt in ("pack-quantized", *FP4_FORMATS) and "weight_packed" not in found:
                raise BadInput(f"format {args.format_label} but no weight_packed", path=where,
                               tensor=f"{prefix}.weight_packed")
            if args.fmt not in ("pack-quantized", *FP4_FORMATS) and f"{prefix}.weight" not in self.ckpt.location:
                raise BadInput(f"format {args.format_label} but no weight", path=where, tensor=f"{prefix}.weight")
            if (args.fmt in INT_FORMATS) != (args.type == "int"):
                raise BadInput(f"config group {args.group} has {args.type} weights in format {args.format_label}",
                               path=where, tensor=found["weight_scale"])
            if args.fmt in FLOAT_FORMATS and args.num_bits != (8 if args.fmt in E4M3_FORMATS else 4):
                raise BadInput(f"config group {args.group} has {args.num_bits}-bit weights in format "
                               f"{args.format_label}", path=where, tensor=found["weight_scale"])
            if args.fmt == "pack-quantized" and "weight_shape" not in found:
                raise BadInput("weight_packed without weight_shape", path=where, tensor=f"{prefix}.weight_shape")
            if args.fmt in INT_FORMATS and not args.symmetric and "weight_zero_point" not in found:
                raise BadInput(f"config group {args.group} is asymmetric but the module has no weight_zero_point",
                               path=where, tensor=f"{prefix}.weight_zero_point")
            if args.fmt == "nvfp4-pack-quantized" and "weight_global_scale" not in found:
                raise BadInput("nvfp4 weight_packed without weight_global_scale", path=where,
                               tensor=f"{prefix}.weight_global_scale")
            if f"{prefix}.weight" in self.ckpt.location:
                found["weight"] = f"{prefix}.weight"
            modules[prefix] = (args, found)
        return modules

    # -- header checks and the small parameters ---------------------------------------------------
    def _bad(self, msg: str, tensor: str) -> BadInput:
        return BadInput(msg, path=self.ckpt.file_of(tensor), tensor=tensor)

    def _dtype_is(self, tensor: str, allowed: tuple[str, ...]) -> str:
        got = self.ckpt.dtype(tensor)
        if got not in allowed:
            raise self._bad(f"dtype {got} is not {' or '.join(allowed)}", tensor)
        return got

    def _shape(self, args: QuantArgs, parts: dict[str, str]) -> tuple[int, int]:
        """(out, in): weight_shape for packed weights (checked against the packed words), else the weight's."""
        if "weight_packed" in parts and args.fmt == "pack-quantized":
            sname, pname = parts["weight_shape"], parts["weight_packed"]
            self._dtype_is(sname, ("I64", "I32"))
            if self.ckpt.shape(sname) != (2,):
                raise self._bad(f"weight_shape shape {self.ckpt.shape(sname)} is not (2,)", sname)
            out_f, in_f = (int(v) for v in self.ckpt.get(sname).tolist())
            self._dtype_is(pname, ("I32",))
            want = (out_f, -(-in_f * args.num_bits // 32))
            if out_f <= 0 or in_f <= 0 or self.ckpt.shape(pname) != want:
                raise self._bad(f"weight_packed shape {self.ckpt.shape(pname)} does not match weight_shape "
                                f"({out_f}, {in_f}) at {args.num_bits} bits: expected {want}", pname)
            return out_f, in_f
        if args.fmt in FP4_FORMATS:
            pname = parts["weight_packed"]
            self._dtype_is(pname, ("U8",))
            shape = self.ckpt.shape(pname)
            if len(shape) != 2:
                raise self._bad(f"weight_packed shape {shape} is not 2-D", pname)
            return shape[0], shape[1] * 2
        wname = parts["weight"]
        shape = self.ckpt.shape(wname)
        if len(shape) != 2:
            raise self._bad(f"weight shape {shape} is not 2-D", wname)
        if args.fmt in E4M3_FORMATS:
            self._dtype_is(wname, ("F8_E4M3",))
        else:
            self._dtype_is(wname, ("I8",))
        return shape

    def _groups(self, args: QuantArgs, in_f: int, tensor: str) -> tuple[int, int]:
        """(group size, number of groups) of a weight's scales, per strategy (forward.py _process_group; blocks:
        _process_block pads the last block of a row)."""
        if args.strategy == "block":
            width = args.block_structure[1]
            return width, -(-in_f // width)
        if args.strategy in ("group", "tensor_group"):
            if in_f % args.group_size:
                raise self._bad(f"in_features {in_f} is not a multiple of group_size {args.group_size}", tensor)
            return args.group_size, in_f // args.group_size
        return in_f, 1

    def _scales(self, args: QuantArgs, parts: dict[str, str], out_f: int, n_groups: int) -> torch.Tensor:
        """[out, n_groups] in the stored dtype (mxfp4's E8M0 bytes as float8_e8m0fnu); a per-tensor scale is
        expanded to every row, a block scale to every row of its block."""
        name = parts["weight_scale"]
        allowed = {"nvfp4-pack-quantized": ("F8_E4M3",), "mxfp4-pack-quantized": ("U8",),
                   "mxfp8-quantized": ("U8",)}.get(args.fmt, tuple(_SCALE_DTYPES))
        self._dtype_is(name, allowed)
        shape = self.ckpt.shape(name)
        rows = -(-out_f // args.block_structure[0]) if args.strategy == "block" else out_f
        want = ((1,), (1, 1)) if args.strategy == "tensor" else ((rows, n_groups),)
        if shape not in want:
            raise self._bad(f"weight_scale shape {shape} does not match {args.strategy} strategy of a ({out_f}, "
                            f"in) weight: expected {want[0]}", name)
        s = self.ckpt.get(name)
        if args.fmt in ("mxfp4-pack-quantized", "mxfp8-quantized"):
            if args.fmt == "mxfp8-quantized" and bool((s == 0xFF).any()):
                # 0xFF is E8M0's NaN; compressed-tensors would decode it to 2**128 = inf in bfloat16
                raise self._bad("an E8M0 scale is 0xFF (NaN)", name)
            s = s.view(torch.float8_e8m0fnu)
        if args.strategy == "block":
            return s.repeat_interleave(args.block_structure[0], dim=0)[:out_f].contiguous()
        return s.reshape(1, 1).expand(out_f, 1).contiguous() if args.strategy == "tensor" else s

    def _zeros(self, args: QuantArgs, parts: dict[str, str], out_f: int, n_groups: int) -> torch.Tensor:
        """Unsigned integer zero points [out, G] (the mid code when symmetric)."""
        mid = torch.full((out_f, n_groups), args.offset, dtype=torch.int16)
        name = parts.get("weight_zero_point")
        if name is None:
            return mid
        if args.symmetric:
            self._refuse_asymmetric_zeros(args, name, out_f, n_groups)
            return mid
        shape, dtype = self.ckpt.shape(name), self.ckpt.dtype(name)
        if args.fmt == "pack-quantized" and args.strategy != "tensor":
            self._dtype_is(name, ("I32",))
            want = (-(-out_f * args.num_bits // 32), n_groups)
            if shape != want:
                raise self._bad(f"weight_zero_point shape {shape} does not match {n_groups} groups x {out_f} outputs "
                                f"packed at {args.num_bits} bits: expected {want}", name)
            return unpack_dense(self.ckpt.get(name).T.contiguous(), args.num_bits, out_f).T.to(torch.int16).contiguous()
        self._dtype_is(name, ("I8",) if dtype == "I8" else ("I8", "I32"))
        want = ((1,), (1, 1)) if args.strategy == "tensor" else ((out_f, n_groups),)
        if shape not in want:
            raise self._bad(f"weight_zero_point shape {shape} is not {want[0]}", name)
        z = self.ckpt.get(name).to(torch.int16).reshape(-1, 1 if args.strategy == "tensor" else n_groups)
        z = z.expand(out_f, n_groups) + args.offset
        lo, hi = 0, (1 << args.num_bits) - 1
        if int(z.min()) < lo or int(z.max()) > hi:
            raise self._bad(f"weight_zero_point values leave the signed {args.num_bits}-bit range", name)
        return z.contiguous()

    def _refuse_asymmetric_zeros(self, args: QuantArgs, name: str, out_f: int, n_groups: int) -> None:
        """A weight_zero_point beside weights the config calls symmetric. compressed-tensors writes none
        (BaseCompressor._remove_symmetric_zp); files of older versions kept the symmetric ones, every signed
        zero point 0, which say nothing and are dropped. Any other zero point contradicts `symmetric: true`:
        compressed-tensors' own decompression applies the zero points it is given (naive_quantized.decompress),
        so dropping them would read other weights than the file's; refused, naming the config key."""
        shape, dtype = self.ckpt.shape(name), self.ckpt.dtype(name)
        packed = (-(-out_f * args.num_bits // 32), n_groups)
        if args.fmt == "pack-quantized" and shape == packed and dtype == "I32":
            # packed as an asymmetric one would be: unsigned fields, the symmetric zero point the mid code
            fields = unpack_dense(self.ckpt.get(name).T.contiguous(), args.num_bits, out_f)
            symmetric = bool((fields == args.offset).all())
        elif shape in ((1,), (1, 1), (out_f, n_groups)) and dtype in ("I8", "I32", "I64"):
            symmetric = not bool(self.ckpt.get(name).any())  # signed zero points, as stored
        else:
            # no layout a compressed-tensors writer stores: left unread, it could hold anything, so the
            # symmetric reading would be a guess
            raise self._bad(f"weight_zero_point {dtype} {shape} is in no layout compressed-tensors stores for a "
                            f"({out_f}, in) weight in {n_groups} group(s) (expected {dtype_hint(args)} "
                            f"{packed if args.fmt == 'pack-quantized' else (out_f, n_groups)})", name)
        if not symmetric:
            raise self._bad(f"zero points other than the symmetric ones, but config.json's quantization_config."
                            f"config_groups.{args.group}.weights.symmetric is true", name)

    def _g_idx(self, args: QuantArgs, parts: dict[str, str], in_f: int, group: int, n_groups: int):
        name = parts.get("weight_g_idx")
        if name is None:
            return None
        self._dtype_is(name, ("I32", "I64"))
        if self.ckpt.shape(name) != (in_f,):
            raise self._bad(f"weight_g_idx shape {self.ckpt.shape(name)} does not match {in_f} inputs", name)
        g = self.ckpt.get(name).to(torch.int64)
        if int(g.min()) < 0 or int(g.max()) >= n_groups:
            raise self._bad(f"weight_g_idx values {int(g.min())}..{int(g.max())} are out of range for {n_groups} "
                            "groups", name)
        natural = torch.arange(in_f, dtype=torch.int64) // group
        return None if torch.equal(g, natural) else g

    def _params(self, prefix: str) -> tuple[GridParams, tuple[int, int]]:
        args, parts = self.modules[prefix]
        out_f, in_f = self._shape(args, parts)
        primary = parts.get("weight_packed") or parts["weight"]
        self.shapes.check_linear(self.model_module(prefix), out_f, in_f, self.ckpt.file_of(primary), primary,
                                 f"{primary} shape")
        group, n_groups = self._groups(args, in_f, parts["weight_scale"])
        scales = self._scales(args, parts, out_f, n_groups)
        if args.fmt in FLOAT_FORMATS:
            self._refuse_float_zeros(args, parts)
            return self._float_params(args, parts, scales, group), (out_f, in_f)
        zeros = self._zeros(args, parts, out_f, n_groups)
        g_idx = self._g_idx(args, parts, in_f, group, n_groups)
        params = GridParams(bits=args.num_bits, group_size=group, scales=scales, zeros=zeros, g_idx=g_idx)
        return params, (out_f, in_f)

    def _refuse_float_zeros(self, args: QuantArgs, parts: dict[str, str]) -> None:
        """A float grid here has no zero point; compressed-tensors' dequantize subtracts one it is given, so a
        nonzero weight_zero_point beside float weights would be dropped from the values: refused."""
        name = parts.get("weight_zero_point")
        if name is not None and bool(self.ckpt.get(name).to(torch.float32).any()):
            raise self._bad(f"nonzero zero points beside {args.format_label} weights (config.json's quantization_config."
                            f"config_groups.{args.group}.weights.symmetric is {str(args.symmetric).lower()}): "
                            "float weights with zero points are not read", name)

    def _float_params(self, args: QuantArgs, parts: dict[str, str], scales: torch.Tensor, group: int) -> GridParams:
        """A float grid: e4m3 codes (float-quantized) or e2m1 codes (fp4 formats), nvfp4's global scale the
        divisor of its block scales (forward_helpers._dequantize: scale / global_scale)."""
        element = "e4m3" if args.fmt in E4M3_FORMATS else "e2m1"
        global_scale = None
        if args.fmt == "nvfp4-pack-quantized":
            gname = parts["weight_global_scale"]
            self._dtype_is(gname, ("F32", "BF16", "F16"))
            if self.ckpt.shape(gname) not in ((1,), (), (1, 1)):
                raise self._bad(f"weight_global_scale shape {self.ckpt.shape(gname)} is not one value", gname)
            global_scale = self.ckpt.get(gname).reshape(())
        rows = args.block_structure[0] if args.strategy == "block" else 1
        return GridParams(bits=8 if element == "e4m3" else 4, group_size=group, scales=scales,
                          zeros=unused_zeros(scales.shape), codebook=element_table(element),
                          global_scale=global_scale, global_scale_op="div", block_rows=rows)

    # -- loading -----------------------------------------------------------------------------------
    def _load_grid(self, prefix: str) -> Grid:
        args, parts = self.modules[prefix]
        params, (out_f, in_f) = self._params(prefix)
        if args.fmt in E4M3_FORMATS:
            return Grid(params, codes=self.ckpt.get(parts["weight"]).view(torch.uint8))
        if args.fmt in FP4_FORMATS:
            return Grid(params, codes=unpack_fp4(self.ckpt.get(parts["weight_packed"])))
        if args.fmt == "pack-quantized":
            codes = unpack_dense(self.ckpt.get(parts["weight_packed"]), args.num_bits, in_f)
        else:
            q = self.ckpt.get(parts["weight"]).to(torch.int16)
            lo, hi = -args.offset, args.offset - 1
            if int(q.min()) < lo or int(q.max()) > hi:
                raise self._bad(f"int8 weight values {int(q.min())}..{int(q.max())} leave the signed "
                                f"{args.num_bits}-bit range", parts["weight"])
            codes = (q + args.offset).to(torch.uint8)
        return Grid(params, codes=codes)

    # -- the ModelSource interface -----------------------------------------------------------------
    def records(self) -> Iterator[TensorRecord]:
        consumed = {n for _, parts in self.modules.values() for n in parts.values()}
        emitted = set()
        for shard in self.ckpt.shards:
            for name in self.ckpt.keys(shard):
                prefix, _, part = name.rpartition(".")
                if prefix in self.modules and prefix not in emitted:
                    emitted.add(prefix)
                    yield self.model_record(self._record(prefix, shard))  # under the class's name (checkpoint.py)
                    continue
                if name in consumed or part in _RUNTIME_PARTS:
                    continue
                yield self.checked_dense_record(name, shard)

    def _record(self, prefix: str, shard: str) -> TensorRecord:
        """The module's record from its headers: the scales and zero points are read when first used (planning,
        writing: `params_loader`), not held by the record from planning to writing."""
        args, parts = self.modules[prefix]
        shape = self._shape(args, parts)
        return TensorRecord(f"{prefix}.weight", shape, "grid", lambda p=prefix: self._load_grid(p),
                            source_file=shard, params_loader=lambda p=prefix: self._params(p)[0])

    def describe(self) -> dict:
        schemes = {}
        for prefix, (args, _) in self.modules.items():
            key = (f"{args.format_label} {args.type}{args.num_bits} {args.strategy}"
                   + (f" g{args.group_size}" if args.strategy in ("group", "tensor_group") else "")
                   + (f" {args.block_structure[0]}x{args.block_structure[1]}" if args.block_structure else "")
                   + (" sym" if args.symmetric else " asym") + (f" actorder {args.actorder}" if args.actorder else ""))
            schemes[key] = schemes.get(key, 0) + 1
        desc = {"format": self.format_name, "compression_format": self.global_format,
                "config_groups": sorted(self.quant_config.get("config_groups", {})),
                "ignore": self.rules.ignore, "schemes": schemes, "quantized_modules": len(self.modules),
                "shards": len(self.ckpt.shards),
                "layout": "int weights: codes = signed + 2**(b-1), packed densely LSB-first along inputs "
                          "(weight_packed int32); fp8 / mxfp8 / nvfp4 / mxfp4 weights are float grids (e4m3 / e2m1 "
                          "codes times block scales, nvfp4's divided by its global scale), equal to compressed-tensors' "
                          "own decompression",
                "ignored_files": self.ignored_files}
        self.describe_runtime(desc)
        if any(a.activations for a, _ in self.modules.values()):
            desc["activations"] = "activations are quantized at run time by the source's scheme; only the weights convert"
        return desc


def open_ct(path: Path, **_: object) -> CtSource:
    return CtSource(path)

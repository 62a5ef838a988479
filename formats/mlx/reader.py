"""Reading mlx-lm model folders (what `mlx_lm.convert -q` writes, and what our writer writes).

Layout (mlx-lm 0.32.2: utils.py load_model / quantize_model / save_config; mlx 0.32.4 nn.QuantizedLinear):
`model*.safetensors` (mlx_lm.load globs them; a `model.safetensors.index.json` maps the shards), tensors
named as in Hugging Face (mlx_lm/models/llama.py sanitize keeps the names, drops `lm_head` when tied). A
quantized linear or embedding `<p>` stores `<p>.weight` uint32 [out, in*bits/32] (codes packed along each
row, formats/mlx/packing.py), `<p>.scales` and `<p>.biases` [out, in/group] in the model dtype, W = scales *
q + biases. config.json's `quantization` = {group_size, bits, mode} plus per-module entries (a dict of
group_size/bits/mode, or false: left unquantized); mlx-lm copies it to `quantization_config` too.

A MoE layer's experts saved by mlx_lm.convert are stacked in switch layers (`<block>.switch_mlp.<proj>.*`, every
part with a leading [experts] axis; formats/mlx/experts.py): each is yielded as Hugging Face's per-expert records
(`<block>.experts.<e>.<proj>.weight`), read one expert's slice at a time.

Each quantized module is yielded as a min-form grid (scales, mins = biases) that dequantizes in the stored
dtype with two roundings, fp(fp(s*q) + b), which is mx.dequantize bit for bit.

The float modes (mode "mxfp8" / "mxfp4", mlx 0.32 quantize modes, group 32 only): `<p>.weight` uint32 packs
E4M3 bytes / E2M1 nibbles the same LSB-first way, `<p>.scales` uint8 [out, in/32] are E8M0 exponents, and
there are no biases: W = element(q) * 2^(e - 127). Such a module is the float grid the OCP MX readers give
(formats/common/float_grids.py); its float32 decode is mx.dequantize(..., mode, dtype=float32) bit for bit,
E2M1's code 8 decoding to -0.0 as mlx's does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from ...converters.errors import BadInput, QConvertError
from ...converters.records import Dense, Grid, GridParams, PackedCodes, TensorRecord
from ...converters.validate import ConfigView
from ...converters.model_shapes import ModelShapes
from ..common.checkpoint import CheckpointDir, CheckpointSource, dtype_name, read_json
from .packing import MLX_BITS, MLX_GROUPS, unpack_mlx
from ..common.quant_config import read_config
from .configs import from_mlx_lm
from ..common.float_grids import float_grid
from .experts import layout_for

__all__ = ["MlxSource", "open_mlx", "looks_like_mlx"]

_PARTS = ("weight", "scales", "biases")
_FLOAT_TAGS = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
_EMBEDDING_SUFFIX = "embed_tokens"
# mlx's float quantize modes -> (element format, the one bits and group_size mlx accepts for them)
_FLOAT_MODES = {"mxfp8": ("e4m3", 8, 32), "mxfp4": ("e2m1", 4, 32)}


def _quantization(cfg: dict, where: Path) -> dict:
    """config.json's `quantization` (mlx-lm's own key), else an mlx-shaped `quantization_config`
    (bits and group_size without a quant_method), validated: group_size, bits and mode of the default."""
    view = ConfigView(cfg, where)
    q = view.view("quantization", default=None)
    key = "quantization"
    if q is None:
        qc = cfg.get("quantization_config")
        if isinstance(qc, dict) and "bits" in qc and "group_size" in qc and "quant_method" not in qc:
            q, key = view.view("quantization_config"), "quantization_config"
    if q is None:
        raise BadInput("no quantization in config.json (an mlx-lm quantized model has quantization: {group_size, "
                       "bits}); an unquantized mlx folder reads as hf", path=where)
    _module_fields(q.data, where, key, None)
    return q.data


def _module_fields(entry: dict, where: Path, key: str, base: tuple[int, int, str] | None) -> tuple[int, int, str]:
    """(bits, group_size, mode) of the default entry (base None) or of a per-module entry over `base`."""
    view = ConfigView(entry, where, f"{key}.")
    bits = view.int("bits", default=None if base is None else base[0], lo=1, hi=32)
    group = view.int("group_size", default=None if base is None else base[1], lo=1, hi=1 << 20)
    if bits is None or group is None:
        raise BadInput(f"{key} needs bits and group_size (mlx-lm's load reads both)", path=where)
    mode = view.str("mode", default="affine" if base is None else base[2])
    if mode in _FLOAT_MODES:
        _, want_bits, want_group = _FLOAT_MODES[mode]
        if (bits, group) != (want_bits, want_group):
            raise BadInput(f"{key} is mode {mode} with bits {bits}, group_size {group}: mlx's {mode} takes only "
                           f"bits {want_bits}, group_size {want_group}", path=where)
        return bits, group, mode
    if mode != "affine":
        raise BadInput(f"{key}.mode is {mode!r}: qconvert reads mlx's affine, mxfp8 and mxfp4 modes", path=where)
    if bits not in MLX_BITS:
        raise BadInput(f"{key}.bits is {bits}: mlx's affine mode packs {', '.join(map(str, MLX_BITS))} bits",
                       path=where)
    if group not in MLX_GROUPS:
        raise BadInput(f"{key}.group_size is {group}: mlx's affine kernels take groups of "
                       f"{', '.join(map(str, sorted(MLX_GROUPS)))}", path=where)
    return bits, group, mode


class MlxSource(CheckpointSource):
    """An mlx-lm model folder, read lazily module by module."""

    format_name = "mlx"

    def __init__(self, path: Path):
        self.path = Path(path)
        self.ckpt = CheckpointDir(self.path)
        conf = read_config(self.path, quant_keys=("quantization", "quantization_config"))
        where = conf.path
        self.quant_config = _quantization(conf.raw, where)
        self.config = from_mlx_lm(conf.model)  # a Qwen3.5 text model nested by our writer, unnested
        self.shapes = ModelShapes(self.config, where)
        self.base = _module_fields(self.quant_config, where, "quantization", None)
        self.modules = {prefix: parts for prefix, parts in self.ckpt.group_modules(_PARTS, primary="weight").items()
                        if "scales" in parts or "biases" in parts}
        # a MoE layer's experts stacked in mlx-lm's switch layers (mlx_lm.convert's layout, formats/mlx/experts.py):
        # read as Hugging Face's per-expert tensors, one expert at a time
        self.layout = layout_for(self.config)
        self.expert_count = self.layout.expert_count(self.config) if self.layout is not None else None
        # a folder with stacked experts of an architecture whose sanitize then does nothing else holds the rest in
        # its output form too (Qwen3-Next: norms stored as 1 + w, conv1d axes; experts.Presanitized): read back
        stacked = self.layout is not None and any(self._stacked(n) for n in self.ckpt.location)
        self.presanitized = self.layout.sanitized if stacked else None

    def _stacked(self, name: str) -> bool:
        """Whether a tensor (or a module's weight) is a switch layer's stack of every expert."""
        return self.layout is not None and self.layout.expert_name(name, 0) is not None

    def _expert_slice(self, name: str, expert: int | None, where: Path) -> tuple[int, ...]:
        """The shape of one expert's slice of a stacked tensor (the shape itself when `expert` is None), checked
        against the config's expert count."""
        shape = tuple(self.ckpt.shape(name))
        if expert is None:
            return shape
        if self.expert_count is None:
            raise BadInput(f"a stacked switch layer, but config.json's {self.layout.count_key} is not a positive "
                           "integer", path=self.path / "config.json", tensor=name)
        if len(shape) < 2 or shape[0] != self.expert_count:
            raise BadInput(f"a switch layer stacks {self.layout.count_key} = {self.expert_count} experts along its "
                           f"first axis, got {list(shape)}", path=where, tensor=name)
        return shape[1:]

    # -- one module's parameters, from the headers first -------------------------------------------------
    def _scheme_of(self, prefix: str, where: Path) -> tuple[int, int, str]:
        entry = self.quant_config.get(prefix)
        if entry is False:
            raise BadInput(f"config.json's quantization says {prefix} is unquantized (false), but the file stores "
                           "its scales and biases", path=where, tensor=f"{prefix}.scales")
        if isinstance(entry, dict):
            return _module_fields(entry, self.path / "config.json", f"quantization.{prefix}", self.base)
        if entry is not None and entry is not True:
            raise BadInput(f"quantization.{prefix} is {entry!r:.40}: expected a JSON object or false",
                           path=self.path / "config.json")
        return self.base

    def _params(self, prefix: str, with_values: bool = True, expert: int | None = None
                ) -> tuple[GridParams | None, tuple[int, int], int]:
        """One module's grid parameters; of a switch layer, expert `expert`'s (its slice of every part)."""
        parts = self.modules[prefix]
        wname = parts["weight"]
        where = self.ckpt.file_of(wname)
        bits, group, mode = self._scheme_of(prefix, where)
        if mode in _FLOAT_MODES:
            return self._float_params(prefix, mode, bits, group, with_values, expert)
        for needed, partner in (("scales", "biases"), ("biases", "scales")):
            if needed not in parts:
                raise BadInput(f"{partner} without {needed}: mlx's affine mode stores W = scales * q + biases",
                               path=where, tensor=f"{prefix}.{needed}")
        wshape = self._packed_shape(wname, where, expert)
        sname, bname = parts["scales"], parts["biases"]
        sdtype, sshape = self.ckpt.dtype(sname), self._expert_slice(sname, expert, self.ckpt.file_of(sname))
        bdtype, bshape = self.ckpt.dtype(bname), self._expert_slice(bname, expert, self.ckpt.file_of(bname))
        if sdtype not in _FLOAT_TAGS or bdtype != sdtype:
            raise BadInput(f"scales ({sdtype}) and biases ({bdtype}) must be one float dtype (F16, BF16 or F32)",
                           path=self.ckpt.file_of(sname), tensor=sname)
        if len(sshape) != 2 or tuple(sshape) != tuple(bshape) or sshape[0] != wshape[0]:
            raise BadInput(f"scales {list(sshape)} and biases {list(bshape)} are not one [{wshape[0]}, groups] pair "
                           f"for weight {list(wshape)}", path=self.ckpt.file_of(sname), tensor=sname)
        out_features, words = wshape
        in_features, rest = divmod(words * 32, bits)
        self._check_inputs(self._expert_prefix(prefix, expert), wname, wshape, sshape, bits, group, where)
        if not with_values:
            return None, (out_features, in_features), bits
        scales, biases = self.ckpt.get(sname, expert), self.ckpt.get(bname, expert)
        params = GridParams(bits=bits, group_size=group, scales=scales, zeros=torch.zeros_like(scales), mins=biases,
                            compute_dtype=_FLOAT_TAGS[sdtype])
        return params, (out_features, in_features), bits

    def _expert_prefix(self, prefix: str, expert: int | None) -> str:
        return prefix if expert is None else self.layout.expert_name(prefix, expert)

    def _packed_shape(self, wname: str, where: Path, expert: int | None = None) -> tuple[int, int]:
        wdtype, wshape = self.ckpt.dtype(wname), self._expert_slice(wname, expert, where)
        if wdtype not in ("U32", "I32") or len(wshape) != 2 or min(wshape) < 1:
            what = "of each expert of a switch layer " if expert is not None else ""
            raise BadInput(f"packed weight {what}must be a 2-D uint32 tensor, got {wdtype} {list(wshape)}", path=where,
                           tensor=wname)
        return tuple(wshape)

    def _check_inputs(self, prefix: str, wname: str, wshape, sshape, bits: int, group: int, where: Path) -> None:
        """The packed words hold exactly the inputs the scales' groups describe, and the model expects them."""
        out_features, words = wshape
        in_features, rest = divmod(words * 32, bits)
        if rest or in_features != sshape[1] * group:
            raise BadInput(f"weight {list(wshape)} holds {words * 32 / bits:g} {bits}-bit codes per row, but scales "
                           f"{list(sshape)} in groups of {group} describe {sshape[1] * group} inputs", path=where,
                           tensor=wname)
        implied = f"weight {list(wshape)} at {bits} bits"
        if prefix.endswith(_EMBEDDING_SUFFIX):
            self.shapes.check_dense(f"{prefix}.weight", (out_features, in_features), where)
        else:
            self.shapes.check_linear(prefix, out_features, in_features, where, wname, implied)

    def _float_params(self, prefix: str, mode: str, bits: int, group: int, with_values: bool, expert: int | None):
        """A float-mode module (mxfp8 / mxfp4): uint32 words of element codes, uint8 E8M0 scales, no biases."""
        parts = self.modules[prefix]
        wname, sname = parts["weight"], parts.get("scales")
        where = self.ckpt.file_of(wname)
        if sname is None or "biases" in parts:
            extra = "scales" if sname is None else "biases"
            raise BadInput(f"mlx's {mode} mode stores weight and E8M0 scales only, but this module "
                           f"{'lacks' if sname is None else 'has'} {extra}", path=where, tensor=f"{prefix}.{extra}")
        wshape = self._packed_shape(wname, where, expert)
        sdtype, sshape = self.ckpt.dtype(sname), self._expert_slice(sname, expert, self.ckpt.file_of(sname))
        if sdtype != "U8" or len(sshape) != 2 or sshape[0] != wshape[0]:
            raise BadInput(f"{mode} scales must be uint8 E8M0 exponents [{wshape[0]}, groups], got {sdtype} "
                           f"{list(sshape)}", path=self.ckpt.file_of(sname), tensor=sname)
        self._check_inputs(self._expert_prefix(prefix, expert), wname, wshape, sshape, bits, group, where)
        shape = (wshape[0], wshape[1] * 32 // bits)
        if not with_values:
            return None, shape, bits
        # E2M1 code 8 is -0.0 in mlx's decode (measured: mx.dequantize gives a signed zero)
        e8m0 = self.ckpt.get(sname, expert).view(torch.float8_e8m0fnu)
        params = float_grid(_FLOAT_MODES[mode][0], e8m0, group)
        return params, shape, bits

    def _load_grid(self, prefix: str, expert: int | None = None) -> Grid:
        params, (_, in_features), bits = self._params(prefix, expert=expert)
        words = self.ckpt.get(self.modules[prefix]["weight"], expert)
        codes = unpack_mlx(words, bits, in_features)
        if params.codebook is not None:
            return Grid(params, codes)  # element codes: the float grid's writers pack them their own way
        # 2/4/8 bits: the row's bit stream is GPTQ's along the inputs, transposed (a GPTQ writer moves words)
        packed = PackedCodes(words.view(torch.int32).T.contiguous(), bits, "gptq-rows") if bits in (2, 4, 8) else None
        return Grid(params, codes, packed)

    # -- the ModelSource interface ---------------------------------------------------------------------
    def records(self) -> Iterator[TensorRecord]:
        """module_records' stream (every tensor in file order, a quantized module as one grid record), with each
        switch layer, quantized or not, split into its experts' records."""
        consumed = {n for parts in self.modules.values() for p, n in parts.items() if p != "weight"}
        for shard in self.ckpt.shards:
            for name in self.ckpt.keys(shard):
                if name in consumed:
                    continue
                prefix, _, part = name.rpartition(".")
                experts = range(self.expert_count or 0) if self._stacked(name) else [None]
                if self._stacked(name):
                    self._expert_slice(name, 0, self.ckpt.path / shard)  # the expert count, before any record
                for e in experts:
                    if part == "weight" and prefix in self.modules:
                        yield self._module_record(prefix, shard, e)
                    elif e is not None:
                        yield self._dense_expert_record(name, shard, e)
                    elif self.presanitized is not None:
                        yield self._presanitized_record(name, shard)
                    else:
                        self.shapes.check_dense(name, self.ckpt.shape(name), self.ckpt.path / shard,
                                                self.ckpt.dtype(name))
                        yield self.ckpt.dense_record(name, shard)

    def _presanitized_record(self, name: str, shard: str) -> TensorRecord:
        """A tensor of a folder in mlx-lm's sanitized form, as transformers holds it (a shifted norm as float32)."""
        form = self.presanitized
        shape = form.hf_shape(name, self.ckpt.shape(name))
        self.shapes.check_dense(name, shape, self.ckpt.path / shard, self.ckpt.dtype(name))
        shifted = len(shape) == 1 and name.endswith(form.shifted_norms)
        return TensorRecord(name, shape, "float32" if shifted else dtype_name(self.ckpt.dtype(name)),
                            lambda: Dense(form.from_mlx(name, self.ckpt.get(name))), source_file=shard)

    def _module_record(self, prefix: str, shard: str, expert: int | None = None) -> TensorRecord:
        params, shape, _ = self._params(prefix, expert=expert)
        # held until planned, then read again where used (`params_loader`): the scales, biases and zero points
        # (3/16 of the code bytes at 4 bits, groups of 64) of a giant MLX model are not all held from planning to
        # writing
        rec = TensorRecord(f"{self._expert_prefix(prefix, expert)}.weight", shape, "grid",
                           lambda p=prefix, e=expert: self._load_grid(p, e), source_file=shard,
                           params_loader=lambda p=prefix, e=expert: self._params(p, expert=e)[0])
        rec.params = params  # already read for the checks: the first use takes them
        return rec

    def _dense_expert_record(self, name: str, shard: str, expert: int) -> TensorRecord:
        """One expert of an unquantized switch layer (a module the quantization left float)."""
        out = self.layout.expert_name(name, expert)
        shape = self._expert_slice(name, expert, self.ckpt.path / shard)
        self.shapes.check_dense(out, shape, self.ckpt.path / shard, self.ckpt.dtype(name))
        return TensorRecord(out, shape, dtype_name(self.ckpt.dtype(name)),
                            lambda: Dense(self.ckpt.get(name, expert)), source_file=shard)

    def describe(self) -> dict:
        overrides = {k: v for k, v in self.quant_config.items() if k not in ("bits", "group_size", "mode")}
        return {"format": "mlx", "bits": self.base[0], "group_size": self.base[1], "mode": self.base[2],
                "per_module": len(overrides), "unquantized_modules": sum(1 for v in overrides.values() if v is False),
                "shards": len(self.ckpt.shards), "quantized_modules": len(self.modules),
                "layout": ("weight uint32 [out, in*bits/32] (each row one LSB-first bit stream); scales, biases "
                           "[out, in/group] in the model dtype; W = scales * q + biases") if self.base[2] == "affine"
                else (f"weight uint32 [out, in*bits/32] ({_FLOAT_MODES[self.base[2]][0]} codes, LSB first); scales "
                      "uint8 E8M0 [out, in/32]; W = element(q) * 2^(e-127)"),
                "ignored_files": self.ignored_files}


def open_mlx(path: Path, **_: object) -> MlxSource:
    return MlxSource(path)


def looks_like_mlx(path: Path) -> bool:
    """From the data: config.json carries mlx's quantization {bits, group_size} (no quant_method), and the
    weights hold a `<p>.biases` beside a uint32 `<p>.weight` (affine), or for the float modes (mode mxfp8 /
    mxfp4, which store no biases) a uint8 `<p>.scales` beside it. Weights whose headers cannot be read (a
    truncated shard) are left to the reader, which names the damaged file: the config alone claims them."""
    path = Path(path)
    if not (path.is_dir() and (path / "config.json").is_file()):
        return False
    try:
        cfg = read_json(path / "config.json")
    except QConvertError:
        return False
    q = cfg.get("quantization")
    if not isinstance(q, dict):
        qc = cfg.get("quantization_config")
        q = qc if isinstance(qc, dict) and "quant_method" not in qc else None
    if not (isinstance(q, dict) and "bits" in q and "group_size" in q):
        return False
    try:
        ckpt = CheckpointDir(path)
    except QConvertError:
        return True
    beside = ".scales" if q.get("mode") in _FLOAT_MODES else ".biases"
    try:
        return any(name.endswith(beside) and ckpt.dtype(name[: -len(beside)] + ".weight") in ("U32", "I32")
                   and (beside == ".biases" or ckpt.dtype(name) == "U8")
                   for name in ckpt.location if name[: -len(beside)] + ".weight" in ckpt)
    finally:
        ckpt.close()

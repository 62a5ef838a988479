"""Reading GPTQ checkpoints (gptqmodel / AutoGPTQ / transformers): v1 (`gptq`) and v2 (`gptq_v2`).

Per quantized linear `<prefix>`: `qweight` int32 [in*b/32, out] (codes packed along rows),
`qzeros` int32 [G, out*b/32] (packed along columns), `scales` fp16 [G, out], `g_idx` int32 [in],
optional `bias`. W = scales[g_idx] * (q - z). v2 stores the true zero point z; v1 stores z - 1 (layout.py).

Rotation (`"rotation": "hadamard" | "random"`, gptqmodel 7.6's quantization/rotation/): gptqmodel folds an exact Hadamard
into every `mlp.down_proj` and re-applies it to the activation at run time (everything else a rotation
does is already plain weights). Reading folds it into the weight, W_plain = W_q M^T (kernels/hadamard.py),
and yields that float tensor; runners mark it `requantize` (the target does not hold the rotated grid),
except for GPTQ output, which stores the rotated grid itself and keeps the `rotation` key (exact).

The v1/v2 label of the config is checked against the data: a symmetric tensor whose zero fields all
read 2**(b-1) - 1 is v1 data, all 2**(b-1) is v2 data. A label contradicted by the data is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from ...converters.errors import BadInput
from ...converters.records import Dense, Grid, GridParams, NativeForm, PackedCodes, TensorRecord
from ...converters.validate import ConfigView
from ...kernels.bitpack import SUPPORTED_PACK_BITS, chunk_geometry
from ...kernels.hadamard import UnsupportedHadamard, fold_online_hadamard, require_foldable
from ...converters.model_shapes import ModelShapes
from ..common.checkpoint import CheckpointDir, CheckpointSource, quantization_config_of
from .layout import decode_zeros
from .schemes import ModuleScheme
from ..common.quant_config import CheckpointConfig, config_bits, read_config


_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_PART_DTYPES = {"qweight": {"I32": "int32"}, "qzeros": {"I32": "int32"},
                "scales": {"F16": "float16", "BF16": "bfloat16", "F32": "float32"},
                "g_idx": {"I32": "int32", "I64": "int64"}}


def _quant_config(conf: CheckpointConfig) -> tuple[dict, Path, str]:
    """The quantization config (config.json's `quantization_config`, else quantize_config.json), the file
    it came from and the prefix naming its keys there."""
    qc = conf.quantization(fallback="quantize_config.json")
    if qc is None or not qc.data:
        raise BadInput("no quantization_config in config.json and no quantize_config.json", path=conf.path)
    method = qc.str("quant_method", default=None)
    if method is None:
        method = qc.str("method", default="gptq")
    if method.lower() != "gptq":
        raise BadInput(f"quant_method is {method!r}, not gptq", path=qc.path)
    return qc.data, qc.path, qc.prefix


def _zero_convention(qc: dict, where: Path | None = None, prefix: str = "") -> str:
    view = ConfigView(qc, where, prefix)
    key = "checkpoint_format" if qc.get("checkpoint_format") is not None else "format"
    fmt = view.str(key, default="gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise BadInput(f"{prefix}{key} {fmt!r} is not gptq or gptq_v2 (planar/marlin/bitblas layouts are not "
                       "GPTQ v1/v2)", path=where)
    return "v2" if fmt == "gptq_v2" else "v1"


def _scheme_fields(view: ConfigView, base: ModuleScheme | None) -> ModuleScheme:
    """bits/group_size/sym/desc_act of the config (base None) or of one `dynamic` override over `base`,
    typed and in range; gptqmodel refuses a group_size of 0 or below -1."""
    bits = config_bits(view) if base is None else config_bits(view, default=base.bits)
    group = view.int("group_size", default=-1 if base is None else base.group_size, lo=-1, hi=2**31 - 1)
    if group == 0:
        raise BadInput(f"{view.prefix}group_size is 0: expected -1 (one group per row) or a positive group size",
                       path=view.path)
    sym = view.bool("sym", default=True if base is None else base.sym)
    desc_act = view.bool("desc_act", default=False if base is None else base.desc_act)
    return ModuleScheme(bits, group, sym, desc_act)


@dataclass(frozen=True)
class _Rule:
    exclude: bool  # a `-:` rule: the matching modules stay unquantized
    regex: "re.Pattern"
    scheme: ModuleScheme | None


def _dynamic_rules(qc: dict, where: Path, prefix: str, base: ModuleScheme) -> list[_Rule]:
    """gptqmodel's `dynamic`: {"-:regex": {}} excludes the modules it matches, "+:regex" or a bare regex
    overrides bits/group_size/sym/desc_act for them. gptqmodel moves every key starting with "-" before
    the others, then the first key whose regex matches (re.match, from the start of the module name)
    decides (QuantizeConfig.__post_init__ and dynamic_get). Every key and value is checked here, also
    those that match no module."""
    dynamic = ConfigView(qc, where, prefix).view("dynamic", default=None)
    if dynamic is None:
        return []
    ordered = sorted(dynamic.data.items(), key=lambda kv: not kv[0].startswith("-"))
    rules = []
    for key, override in ordered:
        exclude = key.startswith("-:")
        pattern = key[2:] if key[:2] in ("-:", "+:") else key
        try:
            regex = re.compile(pattern)
        except (re.error, RecursionError, OverflowError) as e:
            at = f" (error at character {e.pos})" if getattr(e, "pos", None) is not None else ""
            raise BadInput(f"{dynamic.prefix.rstrip('.')} key {key[:80]!r} is not a valid regular expression{at}",
                           path=where) from None
        view = ConfigView(override, where, f"{dynamic.prefix}{key}.") if isinstance(override, dict) else None
        if view is None:
            raise BadInput(f"{dynamic.prefix}{key} is {_kind(override)}: expected a JSON object of overrides "
                           "(bits, group_size, sym, desc_act)", path=where)
        rules.append(_Rule(exclude, regex, None if exclude else _scheme_fields(view, base)))
    return rules


def _kind(value) -> str:
    return {list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number",
            type(None): "null"}.get(type(value), type(value).__name__)


def _module_scheme(base: ModuleScheme, rules: list[_Rule], names: str | tuple[str, ...]) -> ModuleScheme | None:
    """bits/group/sym/desc_act of one module (`names`: its name, or its stored name and its class's where the
    checkpoint is renamed, CheckpointSource.module_names): the first `dynamic` rule matching either, over the
    defaults. None means the module is excluded from quantization (a `-:` rule)."""
    names = (names,) if isinstance(names, str) else names
    for rule in rules:
        if any(rule.regex.match(module) for module in names):
            return None if rule.exclude else rule.scheme
    return base


class GptqSource(CheckpointSource):
    """A GPTQ checkpoint directory, read lazily tensor by tensor."""

    def __init__(self, path: Path, expect: str | None = None):
        self.path = Path(path)
        self.ckpt = CheckpointDir(self.path)
        conf = read_config(self.path)
        self.quant_config, qc_file, qc_prefix = _quant_config(conf)
        self.config = conf.model
        self.shapes = ModelShapes(self.config, self.path / "config.json")
        self.convention = _zero_convention(self.quant_config, qc_file, qc_prefix)
        self.format_name = "gptq-v2" if self.convention == "v2" else "gptq"
        self.rotation = _rotation_mode(self.quant_config, self.config, self.path / "config.json")
        self.scheme = _scheme_fields(ConfigView(self.quant_config, qc_file, qc_prefix), None)
        self.dynamic_rules = _dynamic_rules(self.quant_config, qc_file, qc_prefix, self.scheme)
        # group tensor names by quantized module prefix
        self.modules = self.ckpt.group_modules(_PARTS, primary="qweight")

    # -- reading one module ---------------------------------------------------------------------
    def _params(self, prefix: str) -> tuple[GridParams, tuple[int, int], str]:
        parts = self.modules[prefix]
        qweight_name = parts["qweight"]
        where = self.ckpt.file_of(qweight_name)
        self.ckpt.require_parts(prefix, parts, "qweight", ("qzeros", "scales"))
        scheme = _module_scheme(self.scheme, self.dynamic_rules, self.module_names(prefix))
        if scheme is None:
            raise BadInput("module is quantized in the file but excluded by a dynamic '-:' rule", path=where, tensor=qweight_name)
        bits = scheme.bits
        if bits not in SUPPORTED_PACK_BITS:
            raise BadInput(f"unsupported bits {bits}: GPTQ v1/v2 packs {', '.join(map(str, SUPPORTED_PACK_BITS))}"
                           " (5-7 bit files use the planar gptq_p layout)", path=where, tensor=qweight_name)
        # dtypes from the headers, before any data is read: gptqmodel packs qweight/qzeros in int32 (the
        # only pack_dtype of real checkpoints), keeps g_idx int32 and accepts fp16/bf16/fp32 scales
        for part, allowed in _PART_DTYPES.items():
            if part in parts and self.ckpt.dtype(parts[part]) not in allowed:
                raise BadInput(f"{part} dtype {self.ckpt.dtype(parts[part])} is not {' or '.join(allowed.values())}",
                               path=self.ckpt.file_of(parts[part]), tensor=parts[part])
        shapes = {part: self.ckpt.shape(name) for part, name in parts.items()}
        for part in ("qweight", "qzeros", "scales"):
            if len(shapes[part]) != 2:
                raise BadInput(f"{part} shape {shapes[part]} is not 2-D", path=self.ckpt.file_of(parts[part]),
                               tensor=parts[part])
        qshape = shapes["qweight"]
        codes_per_run, words_per_run = chunk_geometry(bits)  # 32 codes fill 3 words at 3 bits, 32/b words 1
        if qshape[0] % words_per_run:
            raise BadInput(f"qweight rows {qshape[0]} do not hold whole {bits}-bit codes", path=where, tensor=qweight_name)
        out_features = qshape[1]
        in_features = qshape[0] // words_per_run * codes_per_run
        if not in_features or not out_features:
            raise BadInput(f"qweight shape {qshape} is empty", path=where, tensor=qweight_name)
        if out_features % codes_per_run:
            raise BadInput(f"qweight has {out_features} outputs, which {bits}-bit qzeros cannot pack (a multiple of "
                           f"{codes_per_run} is needed)", path=where, tensor=qweight_name)
        self.shapes.check_linear(self.model_module(prefix), out_features, in_features, where, qweight_name,
                                 f"qweight shape {qshape} at {bits} bits")
        # a group at least as wide as the inputs is one group per row (gptqmodel's g_idx = k // group_size = 0)
        group_size = scheme.group_size if 0 < scheme.group_size < in_features else in_features
        if in_features % group_size:
            raise BadInput(f"in_features {in_features} is not a multiple of group_size {scheme.group_size}",
                           path=where, tensor=qweight_name)
        n_groups = in_features // group_size
        sname, zname = parts["scales"], parts["qzeros"]
        if shapes["scales"] != (n_groups, out_features):
            raise BadInput(f"scales shape {shapes['scales']} does not match qweight {qshape}: expected "
                           f"({n_groups}, {out_features}) for {in_features} inputs in groups of {group_size}",
                           path=self.ckpt.file_of(sname), tensor=sname)
        if shapes["qzeros"] != (n_groups, out_features // codes_per_run * words_per_run):
            raise BadInput(f"qzeros shape {shapes['qzeros']} does not match {n_groups} groups x {out_features} "
                           f"outputs at {bits} bits", path=self.ckpt.file_of(zname), tensor=zname)
        if "g_idx" in parts and shapes["g_idx"] != (in_features,):
            raise BadInput(f"g_idx shape {shapes['g_idx']} does not match qweight's {in_features} inputs",
                           path=self.ckpt.file_of(parts["g_idx"]), tensor=parts["g_idx"])
        if scheme.desc_act and "g_idx" not in parts and n_groups > 1:
            # act-order quantizes the inputs in a permuted order, so the group of input k is g_idx[k], not
            # k // group_size. gptqmodel's loader does not refuse a missing g_idx (it checks only that
            # every qweight is there) and keeps the buffer its QuantLinear starts with, the identity
            # order: a model that differs from the one quantized. With one group per row the order does
            # not matter.
            raise BadInput(f"{'dynamic override' if scheme is not self.scheme else 'config'} says desc_act true "
                           f"(act-order, {n_groups} groups), but the module has no g_idx to say which group each "
                           "input belongs to", path=where, tensor=f"{prefix}.g_idx")
        scales = self.ckpt.get(sname)
        qzeros = self.ckpt.get(zname)
        zeros = decode_zeros(qzeros, bits, self.convention)
        self._check_convention(zeros, bits, self.ckpt.file_of(parts["qzeros"]), parts["qzeros"])
        self._refuse_zeros_against_sym(scheme, zeros, bits, parts["qzeros"])
        g_idx = None
        if "g_idx" in parts:
            g = self.ckpt.get(parts["g_idx"]).to(torch.int64)
            if g.numel() and (int(g.min()) < 0 or int(g.max()) >= n_groups):
                raise BadInput(f"g_idx shape {tuple(g.shape)} or range does not match {in_features} inputs and "
                               f"{n_groups} groups", path=self.ckpt.file_of(parts["g_idx"]), tensor=parts["g_idx"])
            natural = torch.arange(in_features, dtype=torch.int64) // group_size
            g_idx = None if torch.equal(g, natural) else g
        params = GridParams(bits=bits, group_size=group_size, scales=scales.T.contiguous(),
                            zeros=zeros.T.contiguous(), g_idx=g_idx)
        return params, (out_features, in_features), qweight_name

    def _refuse_zeros_against_sym(self, scheme: ModuleScheme, zeros: torch.Tensor, bits: int, tensor: str) -> None:
        """`sym: true` beside qzeros that are not all the symmetric zero point 2**(b-1). gptqmodel 7.6 reads such
        a module two ways: its torch kernel (TorchQuantLinear, CPU) decodes qzeros and applies them, while Marlin
        (sym only: uint4b8 / uint8b128, a fixed zero point) drops them (marlin.py: qzeros replaced by an empty
        tensor). The flag contradicts the data and the file holds no one model: refused, naming both."""
        mid = 1 << (bits - 1)
        if not scheme.sym or bool((zeros == mid).all()):
            return
        bad = int((zeros != mid).sum())
        where = "a dynamic override" if scheme is not self.scheme else "config.json's quantization_config"
        raise BadInput(f"{where} says sym true but {bad} of {zeros.numel()} zero points are not the symmetric "
                       f"{mid} (gptqmodel's torch kernel applies them, Marlin drops them); set sym false if they "
                       "are meant", path=self.ckpt.file_of(tensor), tensor=tensor)

    def _check_convention(self, zeros: torch.Tensor, bits: int, where: Path, tensor: str) -> None:
        mid = 1 << (bits - 1)
        if not bool((zeros == zeros.flatten()[0]).all()):
            return  # asymmetric: the data cannot tell v1 from v2, the label stands
        z = int(zeros.flatten()[0])
        label = "gptq_v2" if self.convention == "v2" else "gptq"
        if self.convention == "v2" and z == mid - 1:
            raise BadInput(f"config says checkpoint_format {label!r} but every zero point reads {z}, the v1 "
                           f"convention for symmetric {bits}-bit ({mid} stored as {mid - 1}); set checkpoint_format "
                           "to \"gptq\"", path=where, tensor=tensor)
        if self.convention == "v1" and z == (mid + 1) % (1 << bits):
            raise BadInput(f"config says checkpoint_format {label!r} but every zero point reads {z}, i.e. the "
                           f"fields hold {mid}, the v2 convention; set checkpoint_format to \"gptq_v2\"",
                           path=where, tensor=tensor)

    def _load_grid(self, prefix: str, parsed: tuple | None = None) -> Grid:
        """The module's grid: its parameters parsed now, or as `_params` parsed them for its record (`parsed`: a
        rotated down_proj's native form), its codes read now."""
        params, _, qweight_name = parsed or self._params(prefix)
        qweight = self.ckpt.get(qweight_name)
        if qweight.dtype != torch.int32:
            raise BadInput(f"qweight dtype {qweight.dtype} is not int32", path=self.ckpt.file_of(qweight_name),
                           tensor=qweight_name)
        return Grid(params, packed=PackedCodes(qweight, params.bits, "gptq-rows"))

    # -- rotation (gptqmodel 7.6: quantization/rotation/rotation.py) ---------------------------------
    def _folded_record(self, prefix: str, shard: str) -> TensorRecord:
        """A down_proj of a rotated checkpoint: gptqmodel re-applies a Hadamard M to its input at run time
        (y = W_q (x M)), so the weight that means the same thing without that step is W_q M^T, a float
        tensor off the grid. It is yielded as that Dense tensor (what every target sees), with the stored
        grid kept as its native "rotated-grid" form for a target that carries the rotation itself (GPTQ /
        GPTQ-v2 output)."""
        parsed = self._params(prefix)
        params, shape, qweight_name = parsed
        try:
            require_foldable(shape[1])
        except UnsupportedHadamard as e:
            raise BadInput(f"rotation {self.rotation!r}: {e}", path=self.ckpt.file_of(qweight_name),
                           tensor=qweight_name) from None
        standin = (f"rotation {self.rotation!r}: gptqmodel re-applies a Hadamard transform to down_proj's input at "
                   f"run time and the target has no equivalent, so it is folded into the weights (W M^T), which "
                   f"leaves the {params.bits}-bit grid")
        grid = lambda: self._load_grid(prefix, parsed)  # noqa: E731
        return TensorRecord(f"{prefix}.weight", shape, "float32",
                            lambda: Dense(fold_online_hadamard(grid().dequantize(torch.float32))),
                            source_file=shard, lossy_standin=standin,
                            native_forms=(NativeForm("rotated-grid", grid,
                                                     {"params": params, "rotation": self.rotation}),))

    # -- the ModelSource interface ----------------------------------------------------------------
    def records(self) -> Iterator[TensorRecord]:
        return self.module_records(self.modules, "qweight", self._module_record)

    def _module_record(self, prefix: str, shard: str) -> TensorRecord:
        if self.rotation and _ONLINE_HADAMARD.search(prefix):
            return self._folded_record(prefix, shard)
        params, shape, _ = self._params(prefix)
        # held until planned, then parsed again where used (`params_loader`, and `_load_grid` with the codes): a
        # giant model's scales and zero points (1/16-1/64 of its code bytes) are not all held from planning to
        # writing, at the cost of parsing them again
        rec = TensorRecord(f"{prefix}.weight", shape, "grid", lambda p=prefix: self._load_grid(p), source_file=shard,
                           params_loader=lambda p=prefix: self._params(p)[0])
        rec.params = params  # already parsed for the shape: the first use takes them
        return rec

    def describe(self) -> dict:
        qc = self.quant_config
        desc = {"format": self.format_name, "zero_convention": self.convention,
                "bits": qc.get("bits"), "group_size": qc.get("group_size"), "sym": qc.get("sym"),
                "desc_act": qc.get("desc_act"), "dynamic": qc.get("dynamic") or {},
                "shards": len(self.ckpt.shards), "quantized_modules": len(self.modules),
                "layout": "qweight int32 [in*b/32, out] packed along inputs; qzeros [G, out*b/32]; scales fp16 [G, out]"}
        if self.rotation:
            desc["rotation"] = (f"{self.rotation}: online Hadamard before mlp.down_proj, folded into it on reading "
                                "(kept as is for GPTQ output)")
        desc["ignored_files"] = self.ignored_files
        return desc


ROTATIONS = ("hadamard", "random")  # gptqmodel's modes; both leave the same online Hadamard on down_proj
_ONLINE_HADAMARD = re.compile(r"(^|\.)mlp\.down_proj$")


def _rotation_mode(qc: dict, config: dict, where: Path) -> str | None:
    """The checkpoint's `rotation` (None when absent); unknown modes and unsupported sizes are refused."""
    mode = qc.get("rotation")
    if mode in (None, "", False):
        return None
    if mode not in ROTATIONS:
        raise BadInput(f"unknown rotation {mode!r}: gptqmodel defines {' and '.join(map(repr, ROTATIONS))}; "
                       "without knowing the run-time transform the weights cannot be read", path=where)
    return str(mode)


def open_gptq(path: Path, **_: object) -> GptqSource:
    return GptqSource(path)


def sniff_gptq(convention: str):
    def sniff(path: Path) -> bool:
        qc = quantization_config_of(path)
        if not isinstance(qc, dict) or not qc or str(qc.get("quant_method", qc.get("method", ""))).lower() != "gptq":
            return False
        try:
            return _zero_convention(qc) == convention
        except BadInput:  # an unreadable format label: the v1 reader opens it and names the key
            return convention == "v1"
    return sniff

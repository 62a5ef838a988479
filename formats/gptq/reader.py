"""GPTQ checkpoints (gptqmodel / AutoGPTQ / transformers): v1 (`gptq`) and v2 (`gptq_v2`).

Per quantized linear `<prefix>`: `qweight` int32 [in*b/32, out] (codes packed along rows),
`qzeros` int32 [G, out*b/32] (packed along columns), `scales` fp16 [G, out], `g_idx` int32 [in],
optional `bias`. W = scales[g_idx] * (q - z). v2 stores the true zero point z; v1 stores z - 1.

v1 decode: 2/4/8-bit words get the constant 0x55555555 / 0x11111111 / 0x01010101 added as whole
int32 words (wrapping), because gptqmodel's writer subtracted it as whole words and a zero point of 0
borrowed from its neighbour field; adding per field would decode the neighbour one too low. 3-bit zeros
are converted field by field (gptqmodel 7.6 does the same: utils/model.py, convert_gptq_v1_to_v2_format_module).

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

from ... import __version__
from ...converters.checker import (EXACT, REFUSED, REQUANTIZE, Decision, TargetScheme, check, check_grid_to_float,
                                describe_grid)
from ...converters.errors import BadInput, QConvertError
from ...converters.plan import Options, TensorPlan
from ...converters.records import Dense, Grid, GridParams, PackedCodes, RotatedForm, TensorRecord
from ...converters.validate import REQUIRED, ConfigView
from ...converters.registry import FormatEntry, register_format
from ...kernels.bitpack import SUPPORTED_PACK_BITS, chunk_geometry, pack_rows, unpack_rows
from ...kernels.hadamard import UnsupportedHadamard, fold_online_hadamard, require_foldable
from ...converters.model_shapes import ModelShapes
from ..common.checkpoint import (CheckpointDir, CheckpointSource, ShardWriter, copy_side_files, quantization_config_of,
                              read_json, write_json)

__all__ = ["GptqSource", "GptqWriter", "open_gptq", "V1_WORD_OFFSET"]

_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_PART_DTYPES = {"qweight": {"I32": "int32"}, "qzeros": {"I32": "int32"},
                "scales": {"F16": "float16", "BF16": "bfloat16", "F32": "float32"},
                "g_idx": {"I32": "int32", "I64": "int64"}}
# whole-word constant that turns v2 zero fields into v1 fields (one per field, 2/4/8-bit packing)
V1_WORD_OFFSET = {2: 0x55555555, 4: 0x11111111, 8: 0x01010101}
_DENSE_LINEAR = re.compile(r"^model\.layers\.\d+\..*_proj\.weight$")
_EMBEDDING = re.compile(r"(^|\.)embed_tokens\.weight$")


@dataclass(frozen=True)
class ModuleScheme:
    bits: int
    group_size: int  # -1 = one group per row
    sym: bool
    desc_act: bool


def _quant_config(path: Path, config: dict) -> tuple[dict, Path, str]:
    """The quantization config (config.json's `quantization_config`, else quantize_config.json), the file
    it came from and the prefix naming its keys there."""
    where = path / "config.json"
    qc = ConfigView(config, where).view("quantization_config", default=None)
    prefix = "quantization_config."
    qfile = path / "quantize_config.json"
    if (qc is None or not qc.data) and qfile.exists():
        qc, where, prefix = ConfigView(read_json(qfile), qfile), qfile, ""
    if qc is None or not qc.data:
        raise BadInput("no quantization_config in config.json and no quantize_config.json", path=path / "config.json")
    method = qc.str("quant_method", default=None)
    if method is None:
        method = qc.str("method", default="gptq")
    if method.lower() != "gptq":
        raise BadInput(f"quant_method is {method!r}, not gptq", path=where)
    return qc.data, where, prefix


def _zero_convention(qc: dict, where: Path | None = None, prefix: str = "") -> str:
    view = ConfigView(qc, where, prefix)
    key = "checkpoint_format" if qc.get("checkpoint_format") is not None else "format"
    fmt = view.str(key, default="gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise BadInput(f"{prefix}{key} {fmt!r} is not gptq or gptq_v2 (planar/marlin/bitblas layouts are not "
                       "GPTQ v1/v2)", path=where)
    return "v2" if fmt == "gptq_v2" else "v1"


MAX_BITS = 16  # what a module's bits may say before the supported widths are checked at its tensors


def config_bits(view: ConfigView, key: str = "bits", default=REQUIRED) -> int:
    """A bit width as gptqmodel reads one (_normalize_quant_bits): an integer, an integral float or a
    string of digits ("4"); anything else (a list, "four", true) is refused naming the key."""
    value = view.get(key)
    if isinstance(value, str) and value.strip().isdigit() and len(value) <= 4:
        return _in_range(view, key, int(value))
    if isinstance(value, float) and value.is_integer():
        return _in_range(view, key, int(value))
    return view.int(key, default=default, lo=1, hi=MAX_BITS)


def _in_range(view: ConfigView, key: str, bits: int) -> int:
    if not 1 <= bits <= MAX_BITS:
        raise BadInput(f"{view.prefix}{key} is {bits}: expected an integer in [1, {MAX_BITS}]", path=view.path)
    return bits


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


def _module_scheme(base: ModuleScheme, rules: list[_Rule], module: str) -> ModuleScheme | None:
    """bits/group/sym/desc_act of one module: the first matching `dynamic` rule over the defaults.
    None means the module is excluded from quantization (a `-:` rule)."""
    for rule in rules:
        if rule.regex.match(module):
            return None if rule.exclude else rule.scheme
    return base


def decode_zeros(qzeros: torch.Tensor, bits: int, convention: str) -> torch.Tensor:
    """[G, out*b/32] int32 -> [G, out] true zero points (int16)."""
    words = qzeros
    if convention == "v1" and bits in V1_WORD_OFFSET:
        w = (qzeros.to(torch.int64) & 0xFFFFFFFF) + V1_WORD_OFFSET[bits]
        words = (w & 0xFFFFFFFF).to(torch.int64)
        words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    z = unpack_rows(words.T.contiguous(), bits).T.to(torch.int16)
    if convention == "v1" and bits not in V1_WORD_OFFSET:  # 3-bit: field by field
        z = (z + 1) % (1 << bits)
    return z.contiguous()


def encode_zeros(zeros: torch.Tensor, bits: int, convention: str) -> torch.Tensor:
    """[G, out] true zero points -> [G, out*b/32] int32 in the given convention."""
    z = zeros.to(torch.int64)
    if convention == "v1" and bits not in V1_WORD_OFFSET:
        z = (z - 1) % (1 << bits)
    words = pack_rows(z.T.contiguous(), bits).T.contiguous()
    if convention == "v1" and bits in V1_WORD_OFFSET:
        w = ((words.to(torch.int64) & 0xFFFFFFFF) - V1_WORD_OFFSET[bits]) & 0xFFFFFFFF
        words = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)
    return words


class GptqSource(CheckpointSource):
    """A GPTQ checkpoint directory, read lazily tensor by tensor."""

    def __init__(self, path: Path, expect: str | None = None):
        self.path = Path(path)
        self.ckpt = CheckpointDir(self.path)
        cfg = read_json(self.path / "config.json")
        self.quant_config, qc_file, qc_prefix = _quant_config(self.path, cfg)
        self.config = {k: v for k, v in cfg.items() if k != "quantization_config"}
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
        scheme = _module_scheme(self.scheme, self.dynamic_rules, prefix)
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
        self.shapes.check_linear(prefix, out_features, in_features, where, qweight_name,
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

    def _load_grid(self, prefix: str) -> Grid:
        params, (out_features, in_features), qweight_name = self._params(prefix)
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
        grid kept as `rotated` for a target that carries the rotation itself (GPTQ / GPTQ-v2 output)."""
        params, shape, qweight_name = self._params(prefix)
        try:
            require_foldable(shape[1])
        except UnsupportedHadamard as e:
            raise BadInput(f"rotation {self.rotation!r}: {e}", path=self.ckpt.file_of(qweight_name),
                           tensor=qweight_name) from None
        standin = (f"rotation {self.rotation!r}: gptqmodel re-applies a Hadamard transform to down_proj's input at "
                   f"run time and the target has no equivalent, so it is folded into the weights (W M^T), which "
                   f"leaves the {params.bits}-bit grid")
        return TensorRecord(f"{prefix}.weight", shape, "float32",
                            lambda p=prefix: Dense(fold_online_hadamard(self._load_grid(p).dequantize(torch.float32))),
                            source_file=shard, lossy_standin=standin,
                            rotated=RotatedForm(lambda p=prefix: self._load_grid(p), params, self.rotation))

    # -- the ModelSource interface ----------------------------------------------------------------
    def records(self) -> Iterator[TensorRecord]:
        return self.module_records(self.modules, "qweight", self._module_record)

    def _module_record(self, prefix: str, shard: str) -> TensorRecord:
        if self.rotation and _ONLINE_HADAMARD.search(prefix):
            return self._folded_record(prefix, shard)
        params, shape, _ = self._params(prefix)
        return TensorRecord(f"{prefix}.weight", shape, "grid", lambda p=prefix: self._load_grid(p),
                            params=params, source_file=shard)

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


# ---------------------------------------------------------------------------------------------------
# Writer

# the GPTQ target schemes (the alignment checker's view of what each writer stores): packed 2/3/4/8-bit codes
# along the input features, integer zero points, fp16 scales, any group size, act-order index. v1 is
# written symmetric only (gptqmodel 7.6 loads asymmetric v1 only from files it wrote itself, which
# borrow one from the stored zero); v2 stores the zero point as it is.
GPTQ_SCHEMES = {
    "v1": TargetScheme("gptq", "gptq", zero="none", scale="fp16", act_order=True, code_bits=SUPPORTED_PACK_BITS),
    "v2": TargetScheme("gptq-v2", "gptq", zero="int", scale="fp16", act_order=True, code_bits=SUPPORTED_PACK_BITS),
}
_TYPE_RE = re.compile(r"^(?:gptq:)?(?:b|q)?(?P<bits>[2348])(?:bit)?[-_:]?g(?P<group>-?\d+)(?P<asym>a|-asym)?$")


def parse_gptq_type(text: str) -> ModuleScheme:
    """`4g128` / `q4g128` / `4bit-g128` (sym), `4g32a` (asym), `8g-1` (per-channel)."""
    m = _TYPE_RE.match(text.strip().lower())
    if not m:
        raise QConvertError(f"unknown GPTQ type {text!r}; write bits and group, e.g. 4g128, 4g32a (asym), 8g-1")
    return ModuleScheme(int(m["bits"]), int(m["group"]), not m["asym"], False)


class GptqWriter:
    """Writes a GPTQ checkpoint directory in the v1 or v2 zero convention, loadable by gptqmodel."""

    output_is_file = False

    def __init__(self, convention: str):
        self.convention = convention
        self.name = "gptq-v2" if convention == "v2" else "gptq"

    def plan_tensor(self, rec: TensorRecord, options: Options, source) -> TensorPlan:
        if rec.rotated is not None:
            return self._plan_rotated(rec, options, source)
        explicit = options.explicit_type(rec.name) or options.type
        if rec.is_grid:
            p = rec.params
            src = describe_grid(p, rec.shape[1])
            # GPTQ quantizes the decoder blocks' linears only: a quantized embedding (GGUF token_embd) or
            # output head is stored dequantized in fp16, as GPTQ models keep them. A quantized head would
            # load in gptqmodel (`lm_head: true`) but not in transformers: its GPTQ loader (optimum)
            # replaces the linears inside the blocks only, all with one bits/group_size, and leaves a
            # quantized head's weight uninitialized (random logits)
            if _EMBEDDING.search(rec.name) or rec.name == "lm_head.weight":
                v = check_grid_to_float(p, "F16")
                return TensorPlan(rec.name, rec.shape, src, "float16", v.verdict,
                                  f"kept unquantized as in GPTQ models: {v.reason}", out_name=rec.name,
                                  info={"dense": torch.float16})
            if explicit:
                want = parse_gptq_type(explicit)
                same = (want.bits == p.bits and (want.group_size if want.group_size > 0 else rec.shape[1]) == p.group_size
                        and (want.sym == p.symmetric or not want.sym))
                if not want.sym and self.convention == "v1":
                    return self._asym_v1_refusal(rec, src, explicit)
                if not same:
                    info = {"scheme": want}
                    view = rec.four_bit_view  # a source's own 4-bit form of the tensor (QQQ grouped)
                    if view is not None and want.bits == 4 and want.sym and want.group_size == view.group_size:
                        info["grid_view"] = view.load
                    return TensorPlan(rec.name, rec.shape, src, explicit, REQUANTIZE, "type differs from the source grid"
                                      + ("; the source's own 4-bit codes are kept" if "grid_view" in info else ""),
                                      alternative=self._aligned_type(p, rec.shape), out_name=rec.name, info=info)
            v = self._check_grid(p, rec.shape)
            target = f"gptq {p.bits}-bit g{p.group_size}" if p.n_groups > 1 else f"gptq {p.bits}-bit per-channel"
            if v.verdict == REFUSED and self.convention == "v1" and not p.symmetric and p.integer_zeros:
                return TensorPlan(rec.name, rec.shape, src, target, REFUSED, v.reason,
                                  alternative="gptq-v2 output (exact): qconvert 'SRC->gptq-v2'", out_name=rec.name)
            info = {}
            if v.verdict == REQUANTIZE:
                # v1 output is written symmetric: gptqmodel loads asymmetric v1 only from its own files
                info["scheme"] = ModuleScheme(p.bits if p.bits in SUPPORTED_PACK_BITS else 4,
                                              p.group_size if p.n_groups > 1 else -1, self.convention == "v1", False)
            return TensorPlan(rec.name, rec.shape, src, target, v.verdict, v.reason, out_name=rec.name, info=info)
        if explicit and len(rec.shape) == 2 and _DENSE_LINEAR.match(rec.name):
            want = parse_gptq_type(explicit)
            if not want.sym and self.convention == "v1":
                return self._asym_v1_refusal(rec, rec.dtype, explicit)
            return TensorPlan(rec.name, rec.shape, rec.dtype, explicit, REQUANTIZE,
                              "dense weights quantized with round-to-nearest (no calibration)",
                              out_name=rec.name, info={"scheme": want})
        return TensorPlan(rec.name, rec.shape, rec.dtype, rec.dtype, EXACT, "copied", out_name=rec.name)

    def _plan_rotated(self, rec: TensorRecord, options: Options, source) -> TensorPlan:
        """A rotated down_proj: GPTQ carries the rotation itself, so the stored (rotated) grid is planned as
        any grid and the `rotation` key goes into the output config; gptqmodel re-applies the transform."""
        rot = rec.rotated
        grid_rec = TensorRecord(rec.name, rec.shape, "grid", rot.load, params=rot.params)
        plan = self.plan_tensor(grid_rec, options, source)
        plan.source = f"{plan.source} rotated ({rot.rotation})"
        plan.target = f"{plan.target} + online Hadamard (rotation kept)"
        plan.info.update(keeps_source_form=True, rotated_grid=rot.load, rotation=rot.rotation)
        return plan

    def _asym_v1_refusal(self, rec: TensorRecord, src: str, explicit: str) -> TensorPlan:
        return TensorPlan(rec.name, rec.shape, src, explicit, REFUSED,
                          "asymmetric GPTQ is written as v2: gptqmodel loads asymmetric v1 only from its own files",
                          alternative=f"gptq-v2 output: qconvert 'SRC->gptq-v2' --type {explicit}", out_name=rec.name)

    def _aligned_type(self, p: GridParams, shape: tuple[int, ...]) -> str:
        """The advice when `--type` asks for another grid than the source's: without `--type` every tensor
        keeps its own grid, which is exact when GPTQ holds it (one `--type` may not fit every tensor: a
        g128 checkpoint's 128-wide rows are single groups); "" when it does not hold it."""
        return "no --type (every tensor keeps its own grid: exact)" if self._check_grid(p, shape).verdict == EXACT else ""

    def _check_grid(self, p: GridParams, shape: tuple[int, ...]) -> Decision:
        return check(p, shape, GPTQ_SCHEMES[self.convention])

    def check_model(self, source, plans, options) -> None:
        return None

    def open(self, path: Path, source, plans: list[TensorPlan], options: Options) -> "GptqSession":
        return GptqSession(self, Path(path), source, plans)


class GptqSession:
    """Streams GPTQ tensors into safetensors shards; writes config and side files at the end."""

    def __init__(self, writer: GptqWriter, path: Path, source, plans: list[TensorPlan]):
        self.writer, self.path, self.source = writer, path, source
        self.shards = ShardWriter(path)
        self.schemes: dict[str, ModuleScheme] = {}
        self.dense_linears: list[str] = []
        self.rotation: str | None = None

    def add(self, plan: TensorPlan, item: Dense | Grid) -> torch.Tensor:
        rotated = plan.info.get("rotated_grid")
        if rotated is not None:
            # `item` is the folded stand-in; store the rotated grid and keep the rotation in the config.
            # What gptqmodel computes from it is the grid with the transform folded: return that to measure.
            item, self.rotation = rotated(), plan.info["rotation"]
        if "dense" in plan.info:
            item = Dense(item.dequantize(plan.info["dense"]))
        elif "grid_view" in plan.info:
            item = plan.info["grid_view"]()
        elif plan.verdict == REQUANTIZE:
            scheme = plan.info["scheme"]
            w = item.dequantize(torch.float32)
            item = Grid.rtn(w, scheme.bits, scheme.group_size, scheme.sym)
        if isinstance(item, Grid):
            prefix = plan.name[: -len(".weight")] if plan.name.endswith(".weight") else plan.name
            self._add_grid(prefix, item)
            decoded = item.dequantize(torch.float32)
            return fold_online_hadamard(decoded) if rotated is not None else decoded
        if len(plan.shape) == 2 and _DENSE_LINEAR.match(plan.name):
            self.dense_linears.append(plan.name[: -len(".weight")])
        self.shards.put(plan.name, item.tensor)
        return item.tensor.to(torch.float32)

    def _add_grid(self, prefix: str, grid: Grid) -> None:
        p = grid.params
        out_features, in_features = grid.shape
        put = self.shards.put
        packed = grid.packed
        if packed is not None and packed.layout == "gptq-rows" and packed.bits == p.bits:
            put(f"{prefix}.qweight", packed.words)  # same packing: the source words as they are
        else:
            put(f"{prefix}.qweight", pack_rows(grid.codes.T.contiguous(), p.bits))
        put(f"{prefix}.qzeros", encode_zeros(p.zeros.T.contiguous(), p.bits, self.writer.convention))
        put(f"{prefix}.scales", p.scales.T.contiguous().to(torch.float16))
        put(f"{prefix}.g_idx", p.group_of_column(in_features).to(torch.int32))
        group = p.group_size if p.n_groups > 1 else -1
        self.schemes[prefix] = ModuleScheme(p.bits, group, p.symmetric, not p.contiguous_groups(in_features))

    def close(self) -> None:
        self.shards.close()
        qc = self._quant_config()
        write_json(self.path / "config.json", {**self.source.config, "quantization_config": qc})
        write_json(self.path / "quantize_config.json", qc)
        copy_side_files(self.source, self.path)

    def _quant_config(self) -> dict:
        if not self.schemes:
            raise QConvertError("nothing to write as GPTQ: the source has no quantized tensors (pass --type, e.g. 4g128)")
        counts: dict[ModuleScheme, int] = {}
        for s in self.schemes.values():
            counts[s] = counts.get(s, 0) + 1
        base = max(counts, key=counts.get)
        fmt = "gptq_v2" if self.writer.convention == "v2" else "gptq"
        dynamic = {}
        for prefix, s in self.schemes.items():
            if s != base:
                dynamic[f"+:^{re.escape(prefix)}$"] = {"bits": s.bits, "group_size": s.group_size, "sym": s.sym,
                                                      "desc_act": s.desc_act}
        for prefix in self.dense_linears:
            dynamic[f"-:^{re.escape(prefix)}$"] = {}
        qc = {"bits": base.bits, "group_size": base.group_size, "desc_act": base.desc_act, "sym": base.sym,
              "lm_head": False, "method": "gptq", "quant_method": "gptq",
              "format": fmt, "checkpoint_format": fmt, "pack_dtype": "int32"}
        if fmt == "gptq_v2":
            # gptqmodel's `meta` marks its own files; auto-round's loader in transformers refuses files that
            # carry it (they may be v2), and v1 files load the same in gptqmodel without it
            qc["meta"] = {"quantizer": [f"qconvert:{__version__}"]}
        if dynamic:
            qc["dynamic"] = dynamic
        if self.rotation:
            qc["rotation"] = self.rotation
        return qc


def _sniff(convention: str):
    def sniff(path: Path) -> bool:
        qc = quantization_config_of(path)
        if not isinstance(qc, dict) or not qc or str(qc.get("quant_method", qc.get("method", ""))).lower() != "gptq":
            return False
        try:
            return _zero_convention(qc) == convention
        except BadInput:  # an unreadable format label: the v1 reader opens it and names the key
            return convention == "v1"
    return sniff


# the --type vocabulary as parse_gptq_type reads it; v1 output refuses asymmetric grids (see _asym_v1_refusal)
_GPTQ_TYPE_HELP = (f"BITSgGROUP, bits {', '.join(map(str, SUPPORTED_PACK_BITS))}, group -1 for per-channel: "
                   "4g128, 4g32, 8g-1; {asym}; without --type each grid keeps its own")

register_format(FormatEntry("gptq", aliases=("gptq-v1", "autogptq"),
                            description="GPTQ checkpoint, v1 zero-point convention (stored zero = z - 1)",
                            open_reader=open_gptq, writer=GptqWriter("v1"), sniff=_sniff("v1"),
                            type_help=_GPTQ_TYPE_HELP.format(asym="symmetric only (asymmetric output is gptq-v2)"),
                            examples=("qconvert 'gguf->gptq' model-q4_0.gguf model-gptq/",
                                      "qconvert 'hf->gptq' model/ model-gptq/ --type 4g128 --allow-requant")))
register_format(FormatEntry("gptq-v2", aliases=("gptqv2",),
                            description="GPTQ checkpoint, v2 convention (true zero points)",
                            open_reader=open_gptq, writer=GptqWriter("v2"), sniff=_sniff("v2"),
                            type_help=_GPTQ_TYPE_HELP.format(asym="a trailing a is asymmetric: 4g32a"),
                            examples=("qconvert 'gptq->gptq-v2' model-gptq/ model-gptq-v2/",
                                      "qconvert 'hf->gptq-v2' model/ model-gptq-v2/ --type 4g32a --allow-requant")))

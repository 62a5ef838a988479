"""compressed-tensors' quantization config, its module matching, its int32 packing and its target scheme.

Learned from compressed-tensors 0.19 (what llm-compressor 0.14 writes and transformers loads with):

- quantization/quant_args.py: QuantizationArgs (num_bits, type int/float, symmetric, strategy
  tensor/channel/group/block/token/tensor_group/attn_head, group_size, actorder). A missing strategy is
  inferred: group_size None -> tensor, > 0 -> group, -1 -> channel. actorder "group"/"dynamic"/true is
  refused since 0.19 ("removed"); older files carry `weight_g_idx` for it (vLLM still reads them).
- lifecycle/apply.py + utils/match.py: every config group's targets map to its scheme (a later group's
  identical target replaces an earlier one); a module's scheme is that of its first matching target
  after sorting them as match_targets does: exact names, then `re:` regexes (re.match from the start,
  both sorted alphabetically), then class names ("Linear"). `ignore` entries match the same way.
- compressors/pack_quantized/helpers.py pack_to_int32: codes are signed (int4: -8..7) and stored with
  2**(b-1) added, densely packed LSB-first (element i of a row at bit i*b, crossing word boundaries, rows
  padded to 32 elements, ceil(cols*b/32) words). weight_packed packs along the input dimension
  ([out, ceil(in*b/32)]); an asymmetric group/channel weight_zero_point packs along the output
  dimension (packed_dim=0: [ceil(out*b/32), G]). So a stored field is the unsigned code 0..2**b-1 and an
  unpacked zero field the unsigned zero point; symmetric grids store no zero point (zero 0 = mid code).
- lifecycle/forward.py _dequantize: x_q.to(scale.dtype) - zero_point.to(scale.dtype), times scale, in
  the scale's dtype. (q - z) is an integer of at most 9 bits and exact in fp16/bf16, and the product of
  it with an fp16/bf16 scale is exact in float32 (at most 20 significant bits), so compressed-tensors'
  value is our float32 value rounded once to the scale dtype: the grid's float32 dequantization is the
  exact one, as for gptqmodel, which computes in fp16 the same way (tests compare both ways).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ...converters.checker import EXACT, REFUSED, REQUANTIZE, Decision, TargetScheme, register_family
from ...converters.errors import BadInput
from ...converters.records import GridParams
from ...converters.validate import ConfigView
from ...kernels.triton import route as triton_route
from ..common import block_schemes  # noqa: F401  (registers the float-block family its float targets follow)

__all__ = ["QuantArgs", "ModuleRules", "parse_rules", "pack_dense", "unpack_dense", "CT_PACK", "READ_FORMATS",
           "STRATEGIES", "INT_FORMATS", "FLOAT_FORMATS", "FP4_FORMATS", "E4M3_FORMATS", "MX_GROUP", "CT_FLOAT"]

# formats this reader reads (config `format`, global or per group)
INT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
# float element formats, read as float grids (converters/records.py): float-quantized (fp8 e4m3 `weight`),
# nvfp4-pack-quantized and mxfp4-pack-quantized (two e2m1 codes a byte in `weight_packed`), mxfp8-quantized
# (compressors/mxfp8: float-quantized's F8_E4M3 `weight` with a uint8 E8M0 `weight_scale` per 32)
FLOAT_FORMATS = ("float-quantized", "nvfp4-pack-quantized", "mxfp4-pack-quantized", "mxfp8-quantized")
E4M3_FORMATS = ("float-quantized", "mxfp8-quantized")  # an unpacked F8_E4M3 `weight`
MX_GROUP = 32  # OCP MX: one E8M0 exponent per 32 elements of a row
FP4_FORMATS = ("nvfp4-pack-quantized", "mxfp4-pack-quantized")
READ_FORMATS = INT_FORMATS + FLOAT_FORMATS + ("dense",)
STRATEGIES = ("tensor", "channel", "group")  # what a weight's scales may be laid out as here
_ALL_STRATEGIES = ("tensor", "channel", "group", "block", "token", "tensor_group", "attn_head")


@dataclass(frozen=True)
class QuantArgs:
    """A config group's `weights` arguments, typed and checked."""

    num_bits: int
    type: str  # "int" | "float"
    symmetric: bool
    strategy: str
    group_size: int | None
    actorder: str | None
    fmt: str  # the layout the module's tensors are in: the group's format (or the global one), see label
    group: str  # the config group's name, for messages
    activations: bool  # input or output activations are quantized as well (a runtime choice, not kept)
    block_structure: tuple[int, int] | None = None  # strategy "block": (rows, columns) sharing one scale
    label: str = ""  # the format as config.json names it, when the layout differs ("naive-quantized" fp8)

    @property
    def format_label(self) -> str:
        return self.label or self.fmt

    @property
    def offset(self) -> int:
        return 1 << (self.num_bits - 1)


def _weights_args(view: ConfigView, fmt: str, group: str) -> QuantArgs:
    w = view.view("weights", default=None)
    if w is None:
        raise BadInput(f"{view.prefix}weights is missing: a config group without weight quantization is not read",
                       path=view.path)
    bits = w.int("num_bits", default=8, lo=1, hi=64)
    qtype = w.str("type", default="int").lower()
    if qtype not in ("int", "float"):
        raise BadInput(f"{w.prefix}type is {qtype!r}: expected 'int' or 'float'", path=view.path)
    if qtype == "int" and fmt in INT_FORMATS and not 1 <= bits <= 8:
        raise BadInput(f"{w.prefix}num_bits is {bits}: compressed-tensors packs int weights of 1..8 bits",
                       path=view.path)
    if qtype == "float" and bits not in (4, 8):
        raise BadInput(f"{w.prefix}num_bits is {bits}: float weights are fp8 (8) or fp4 (4)", path=view.path)
    label = ""
    if fmt == "naive-quantized" and qtype == "float":
        # compressed-tensors 0.19 registers float-quantized as NaiveQuantizationCompressor under another name
        # (compressors/naive_quantized: same compress, same decompress); naive writes `weights.pytorch_dtype()`,
        # fp8 e4m3 for 8-bit floats (4-bit floats raise NotImplementedError there). llm-compressor 0.14 labels
        # weight-only fp8 naive-quantized: the tensors are float-quantized's, never int8 codes.
        if bits != 8:
            raise BadInput(f"{w.prefix}num_bits is {bits}: naive-quantized float weights are fp8 (compressed-tensors "
                           "stores no other float width unpacked)", path=view.path)
        fmt, label = "float-quantized", "naive-quantized"
    group_size = w.int("group_size", default=None, lo=-1)
    strategy = w.str("strategy", default=None)
    if strategy is None:  # QuantizationArgs.validate_model_after
        strategy = "tensor" if group_size is None else ("group" if group_size > 0 else "channel")
    strategy = strategy.lower()
    if fmt == "mxfp8-quantized" and (qtype, bits, strategy, group_size) != ("float", 8, "group", MX_GROUP):
        # MXFP8QuantizationCompressor.can_compress: 8-bit float weights in groups of 32 (E8M0 exponents)
        raise BadInput(f"{w.prefix} is {qtype} {bits}-bit, strategy {strategy!r}, group_size {group_size}: "
                       f"mxfp8-quantized is 8-bit float weights in groups of {MX_GROUP}", path=view.path)
    if strategy not in _ALL_STRATEGIES:
        raise BadInput(f"{w.prefix}strategy is {strategy!r}: compressed-tensors defines "
                       f"{', '.join(_ALL_STRATEGIES)}", path=view.path)
    if strategy not in STRATEGIES and not (strategy == "tensor_group" and fmt == "nvfp4-pack-quantized") \
            and not (strategy == "block" and fmt == "float-quantized"):
        raise BadInput(f"{w.prefix}strategy {strategy!r} is not read (weights in {', '.join(STRATEGIES)} "
                       "strategies are, fp8 in blocks too)", path=view.path)
    block = None
    if strategy == "block":  # forward_helpers._process_block: [rows, columns] per scale, edge blocks padded
        block = w.get("block_structure")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and 0 < b <= 1 << 16
                                                                    for b in block)):
            raise BadInput(f"{w.prefix}block_structure is {block!r}: expected [rows, columns] of a block",
                           path=view.path)
        block = tuple(block)
    if strategy in ("group", "tensor_group") and (group_size is None or group_size <= 0):
        raise BadInput(f"{w.prefix}strategy {strategy!r} needs a positive group_size, not {group_size}",
                       path=view.path)
    actorder = w.get("actorder")
    if actorder is True:
        actorder = "group"
    if actorder not in (None, False, "group", "dynamic", "weight", "static"):
        raise BadInput(f"{w.prefix}actorder is {actorder!r}: expected null, 'weight', 'static' or 'group'",
                       path=view.path)
    acts = any(view.get(k) is not None for k in ("input_activations", "output_activations"))
    return QuantArgs(bits, qtype, w.bool("symmetric", default=True), strategy, group_size,
                     actorder or None, fmt, group, acts, block, label)


def match_name(name: str, target: str) -> bool:
    """compressed-tensors utils/match.py match_name: `re:` is re.match from the start, else equality."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


# the class names a quantized safetensors module can be: its weight is 2-D [out, in] (nn.Linear); CT
# matches class names along the MRO, and every Linear subclass is also a Linear
_CLASS_OF_LINEAR = ("Linear", "Module")


def match_class(target: str) -> bool:
    return target in _CLASS_OF_LINEAR


@dataclass
class ModuleRules:
    target_to_scheme: dict[str, QuantArgs]
    ignore: list[str]

    def scheme_of(self, module: str) -> QuantArgs | None:
        """apply.py: the scheme of the module's first matching target (exact, regex, class order); None
        when no target matches or an ignore entry does."""
        if any(match_name(module, i) or match_class(i) for i in self.ignore):
            return None
        ordered = sorted(self.target_to_scheme, key=lambda t: ("re:" in t, t))
        for t in ordered:
            if match_name(module, t):
                return self.target_to_scheme[t]
        for t in ordered:
            if match_class(t):
                return self.target_to_scheme[t]
        return None

    def ignored(self, module: str) -> bool:
        return any(match_name(module, i) or match_class(i) for i in self.ignore)


def parse_rules(qc: dict, where: Path) -> tuple[ModuleRules, str]:
    """The config groups and ignore list of a compressed-tensors quantization_config; (rules, global format)."""
    view = ConfigView(qc, where, "quantization_config.")
    fmt = view.str("format", default="dense")
    groups = view.view("config_groups", default=None)
    if groups is None or not groups.data:
        raise BadInput("quantization_config.config_groups is missing or empty: nothing says how weights are "
                       "quantized", path=where)
    target_to_scheme: dict[str, QuantArgs] = {}
    for name in groups.data:
        g = groups.view(name)
        gfmt = g.str("format", default=None) or fmt
        if gfmt not in READ_FORMATS:
            raise BadInput(f"{g.prefix}format is {gfmt!r}: qconvert reads {', '.join(READ_FORMATS)}", path=where)
        args = _weights_args(g, gfmt, name)
        targets = g.list("targets")
        for t in targets:
            if not isinstance(t, str):
                raise BadInput(f"{g.prefix}targets holds {t!r}: expected strings (names, re: regexes, classes)",
                               path=where)
            if t.startswith("re:"):
                try:
                    re.compile(t[3:])
                except re.error as e:
                    raise BadInput(f"{g.prefix}targets entry {t[:80]!r} is not a valid regular expression "
                                   f"({e})", path=where) from None
            target_to_scheme[t] = args
    ignore = view.list("ignore", default=[])
    if not all(isinstance(i, str) for i in ignore):
        raise BadInput("quantization_config.ignore holds a non-string entry", path=where)
    return ModuleRules(target_to_scheme, list(ignore)), fmt


# ---------------------------------------------------------------------------------------------------
# dense int32 packing (pack_to_int32 / unpack_from_int32 of compressed-tensors 0.19)


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_dense(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, cols] unsigned codes -> [rows, ceil(cols*bits/32)] int32, element i at bit i*bits, LSB first."""
    rows, cols = codes.shape
    padded = -(-cols // 32) * 32
    c = torch.zeros((rows, padded), dtype=torch.int64)
    c[:, :cols] = codes.to(torch.int64)
    c = c.view(rows, padded // 32, 32)
    words = torch.zeros((rows, padded // 32, bits), dtype=torch.int64)
    for j in range(32):
        start = j * bits
        w, off = divmod(start, 32)
        words[:, :, w] |= (c[:, :, j] << off) & 0xFFFFFFFF
        if off + bits > 32:
            words[:, :, w + 1] |= c[:, :, j] >> (32 - off)
    n_words = -(-cols * bits // 32)
    return _as_int32(words.view(rows, -1)[:, :n_words]).contiguous()


def unpack_dense(words: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """The inverse of pack_dense: [rows, n_words] int32 -> [rows, cols] uint8 codes (Triton where chosen)."""
    routed = triton_route.bitstream(words, bits, cols)
    if routed is not None:
        return routed
    rows, n_words = words.shape
    groups = -(-n_words // bits)
    w = torch.zeros((rows, groups * bits), dtype=torch.int64)
    w[:, :n_words] = words.to(torch.int64) & 0xFFFFFFFF
    w = w.view(rows, groups, bits)
    mask = (1 << bits) - 1
    out = torch.empty((rows, groups, 32), dtype=torch.int64)
    for j in range(32):
        start = j * bits
        i, off = divmod(start, 32)
        v = w[:, :, i] >> off
        if off + bits > 32:
            v = v | (w[:, :, i + 1] << (32 - off))
        out[:, :, j] = v & mask
    return out.view(rows, groups * 32)[:, :cols].to(torch.uint8).contiguous()


# ---------------------------------------------------------------------------------------------------
# the writer's target: pack-quantized int weights


def _ct_pack(src, shape, s: TargetScheme, native, prefer_groups=()) -> Decision:
    """compressed-tensors pack-quantized: 1..8-bit integer codes along the input features in contiguous
    groups (or one per row), integer zero points (packed int8 fields) or none (symmetric), scales in any
    float dtype (kept as the source stores them). No act-order: compressed-tensors 0.19 refuses actorder
    "group" (quant_args.py validate_actorder), so a scattered g_idx cannot be stored."""
    if not isinstance(src, GridParams):
        return Decision(REQUANTIZE, "dense weights quantized with compressed-tensors' min-max round-to-nearest")
    p = src
    in_features = shape[-1]
    if p.axis != 1:
        return Decision(REQUANTIZE, "axis-0 groups run down output rows; compressed-tensors groups run along inputs")
    if p.mins is not None and not _min_form_has_integer_zero(p):
        return Decision(REQUANTIZE, "a float block min is not an integer zero point (pack-quantized stores int8 "
                                    "zero points)")
    if p.mins is None and not p.integer_zeros:
        return Decision(REQUANTIZE, "float zero points: pack-quantized stores integer zero points")
    if not 1 <= p.bits <= 8:
        return Decision(REQUANTIZE, f"{p.bits}-bit codes: pack-quantized holds 1..8 bits")
    if not p.contiguous_groups(in_features):
        return Decision(REQUANTIZE, "act-order g_idx: compressed-tensors 0.19 removed actorder 'group' (no "
                                    "weight_g_idx), so scattered groups cannot be stored")
    if in_features % p.group_size:
        return Decision(REFUSED, f"rows of {in_features} are not whole groups of {p.group_size}")
    if p.compute_dtype != torch.float32 and p.compute_dtype != p.scales.dtype:
        return Decision(REQUANTIZE, f"the source dequantizes in {str(p.compute_dtype)[6:]}, compressed-tensors in "
                                    f"its scale dtype {str(p.scales.dtype)[6:]}")
    how = "symmetric" if p.symmetric else "integer zero points"
    return Decision(EXACT, f"codes, {how} and {str(p.scales.dtype)[6:]} scales kept", keeps_codes=True)


def _min_form_has_integer_zero(p: GridParams) -> bool:
    """A min-form grid d*q + m is d*(q - z) when every z = -m/d is an integer code."""
    d, m = p.scales.to(torch.float32), p.mins.to(torch.float32)
    z = torch.where(d != 0, -m / torch.where(d != 0, d, 1), 0)
    zi = z.round()
    return bool(((z == zi) & (zi >= 0) & (zi < (1 << p.bits))).all()) and bool(torch.equal(-(d * zi), m))


register_family("ct-pack", _ct_pack)

CT_PACK = TargetScheme("pack-quantized", "ct-pack", zero="int", scale="source", act_order=False,
                       code_bits=tuple(range(1, 9)))


# -- the float formats a float grid is written in --------------------------------------------------------
def _ct_fp8(src, shape, s: TargetScheme, native, prefer_groups=()) -> Decision:
    """float-quantized: e4m3 codes (`weight`) with `weight_scale` in fp16/bf16/fp32 per tensor, channel, group or
    [rows, columns] block, as the source lays them out (forward_helpers._dequantize multiplies in the scale's
    dtype: the float32 value rounded once, as for the int formats)."""
    if not isinstance(src, GridParams):
        return Decision(REQUANTIZE, "dense weights: qconvert writes fp8 only from an fp8 grid's own codes")
    p = src
    if p.element != "e4m3":
        return Decision(REQUANTIZE, f"{p.element or 'integer'} codes are not e4m3 values")
    e8m0 = p.scales.dtype == torch.float8_e8m0fnu
    if p.scales.dtype not in (torch.float16, torch.bfloat16, torch.float32) and not e8m0:
        return Decision(REQUANTIZE, f"{str(p.scales.dtype)[6:]} scales: float-quantized stores fp16/bf16/fp32 ones")
    if p.global_scale is not None or p.axis != 1 or not p.contiguous_groups(shape[-1]):
        return Decision(REQUANTIZE, "a global scale or scattered groups: float-quantized has neither")
    if e8m0:
        # OCP MXFP8 (mlx's mxfp8): every E8M0 exponent, 2**-127 .. 2**127, is a float32 value, and code times
        # power of two is exact in float32 too, so stored as float32 the scales decode to the source's values
        return Decision(EXACT, "e4m3 codes kept, E8M0 exponents stored as float32 scales (exact)", keeps_codes=True)
    return Decision(EXACT, f"e4m3 codes and {str(p.scales.dtype)[6:]} scales kept", keeps_codes=True)


register_family("ct-fp8", _ct_fp8, takes_codebooks=True)

# the float formats, tried in this order for a float grid (the float-block family, formats/common/block_schemes.py,
# decides the MX and fp4 ones from the scale values): mxfp8 (e4m3 under E8M0 exponents per 32: what llm-compressor's
# MXFP8 schemes write), float-quantized (any other e4m3 grid), mxfp4 (E8M0 exponents per 32), nvfp4 (E4M3 per 16
# over a global divisor)
CT_FLOAT = {
    "mxfp8-quantized": TargetScheme("mxfp8-quantized", "float-block", bits=8, group=MX_GROUP, block=MX_GROUP,
                                    scale="e8m0", element="e4m3"),
    "float-quantized": TargetScheme("float-quantized", "ct-fp8", bits=8, scale="source", element="e4m3"),
    "mxfp4-pack-quantized": TargetScheme("mxfp4-pack-quantized", "float-block", bits=4, group=32, block=32,
                                         scale="e8m0", element="e2m1"),
    "nvfp4-pack-quantized": TargetScheme("nvfp4-pack-quantized", "float-block", bits=4, group=16, block=16,
                                         scale="ue4m3", element="e2m1", tensor_scale="div"),
}

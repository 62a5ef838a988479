"""auto-round's native checkpoints (`quant_method` "auto-round" / "intel/auto-round"), read into integer grids.

What auto-round 0.16 writes (export/export_to_autoround/export.py save_quantized_as_autoround,
export/formats/backends/autoround.py) and what its loader reads (inference/convert_model.py, backend.py,
auto_round_extension/torch/qlinear_torch*.py, gptqmodel's AwqTorchLinear for AWQ on CPU):

- `packing_format` names the layout. Format "auto_round" picks it per scheme: symmetric int ->
  "auto_round:auto_gptq"; asymmetric 4-bit (every layer 4-bit or 16-bit) -> "auto_round:auto_awq"; other
  asymmetric int -> "auto_round". "auto_round:gptqmodel" is asked for by name. The loader normalises
  "auto" and "auto_round:gptq" to "auto_round:auto_gptq", "auto_round:awq" to "auto_round:auto_awq", and a
  config without the key is "auto_round:gptq" (transformers' AutoRoundConfig default).
- GPTQ layouts ("auto_round:auto_gptq", "auto_round", "auto_round:gptqmodel"): per linear `qweight` int32
  [in*b/32, out] (codes along the inputs, one little-endian bit stream per 32 codes: 2/3/4/8 bits as
  GPTQ, 5/6/7 bits the same stream, auto_round/utils/bit_packing.py), `qzeros` int32 [G, out*b/32] (the same
  stream along the outputs), `scales` fp16 [G, out]; "auto_round:gptqmodel" adds `g_idx` int32 [in], always
  k // group_size (its CPU loader does not even read it).
  W = scales[g] * (q - z).
- Zero points: "auto_round:auto_gptq" stores z - 1 field by field (qlinear_torch_zp.pack_248_bits: `(zeros -
  1).clamp_(0, maxq)`, so a zero point 0 is written as 1 -- the file's meaning is what the loader decodes) and
  its loader adds 1 to every field (forward: `zeros += 1`, no carry between fields: a field of maxq reads
  2**b, which no packer writes and no GPTQ-style target holds, so it is refused). "auto_round" and
  "auto_round:gptqmodel" store z itself (qlinear_torch). Measured on the stored fixtures: symmetric 4-bit
  auto_gptq fields read 7, the loader's zero 8.
- AWQ layout ("auto_round:auto_awq", 4 bits; export_to_awq/utils.py WQLinear_GEMM): `qweight` int32
  [in, out*b/32] packed along the outputs, 8 codes a word with output j of each 8 at nibble
  [0, 4, 1, 5, 2, 6, 3, 7][j]; `qzeros` int32 [G, out*b/32] the same; `scales` fp16 [G, out]; raw zero
  points. gptqmodel's dequantize_gemm: (q - z) * s.
- `extra_config` {layer name or regex: {bits, group_size, sym, data_type, ...}}: an exact layer name first,
  else the first regex (re.search, in the config's order) that matches (inference/utils.py
  _expand_regex_config); fields it leaves out keep the defaults. bits >= 16 keeps a layer in float: it is
  stored as `<layer>.weight` and read as it is.

The loader dequantizes in the scales' dtype (fp16): scale * (q - z) with |q - z| <= 2**b, one rounding of the
exact product, which is what our float32 dequantization rounded to fp16 gives. So the grid keeps float32
arithmetic and fp16 scales, as GPTQ's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from ...converters.errors import BadInput
from ...converters.records import Grid, GridParams, PackedCodes, TensorRecord
from ...converters.validate import ConfigView
from ...kernels.triton import route as triton_route
from ...kernels.bitpack import SUPPORTED_PACK_BITS, unpack_rows
from ..common.quant_config import config_bits, read_config
from ...converters.model_shapes import ModelShapes
from ..common.checkpoint import CheckpointDir, CheckpointSource, quantization_config_of, read_json

__all__ = ["AutoRoundSource", "open_auto_round", "sniff_auto_round", "QUANT_METHODS", "PACKINGS",
           "unpack_stream", "AWQ_REVERSE_ORDER"]

QUANT_METHODS = ("auto-round", "intel/auto-round")
# packing_format -> (layout, zero convention); "zp-1": stored fields hold z - 1
PACKINGS = {
    "auto_round:auto_gptq": ("gptq", "zp-1"),
    "auto_round": ("gptq", "raw"),
    "auto_round:gptqmodel": ("gptq", "raw"),
    "auto_round:auto_awq": ("awq", "raw"),
}
_ALIASES = {"auto": "auto_round:auto_gptq", "auto_round:gptq": "auto_round:auto_gptq",
            "auto_round:awq": "auto_round:auto_awq"}
DEFAULT_PACKING = "auto_round:gptq"  # transformers 5 AutoRoundConfig.__init__
STREAM_BITS = (2, 3, 4, 5, 6, 7, 8)  # auto_round_extension/torch/qlinear_torch.py SUPPORTED_BITS
AWQ_BITS = (4,)  # 5-7-bit AWQ loads only into humming's CUDA kernels, 2/8-bit AWQ is not packed by auto-round
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # logical output j of 8 is stored at slot AWQ_REVERSE_ORDER[j]
FLOAT_BITS = 16  # bits >= 16: the layer stays in float
_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_PART_DTYPES = {"qweight": {"I32": "int32"}, "qzeros": {"I32": "int32"},
                "scales": {"F16": "float16", "BF16": "bfloat16", "F32": "float32"},
                "g_idx": {"I32": "int32", "I64": "int64"}}


def unpack_stream(words: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] int32 words -> [R*32/bits, C] uint8 codes along dim 0: the little-endian bit stream of 32
    codes per `bits` words that auto-round uses at every width (bit_packing.py); 2/3/4/8 bits are GPTQ's."""
    if bits in SUPPORTED_PACK_BITS:
        return unpack_rows(words, bits)
    rows, cols = words.shape
    if rows % bits:
        raise ValueError(f"{rows} packed rows is not a multiple of {bits} for {bits}-bit codes")
    routed = triton_route.bitstream(words.T, bits, rows * 32 // bits)  # each column's stream, in Triton where chosen
    if routed is not None:
        return routed.T.contiguous()
    w = (words.to(torch.int64) & 0xFFFFFFFF).view(rows // bits, bits, cols)
    out = torch.empty((rows // bits, 32, cols), dtype=torch.uint8)
    mask = (1 << bits) - 1
    for j in range(32):
        word, shift = divmod(j * bits, 32)
        val = w[:, word] >> shift
        if shift + bits > 32:
            val = val | (w[:, word + 1] << (32 - shift))
        out[:, j] = (val & mask).to(torch.uint8)
    return out.view(rows // bits * 32, cols)


def _awq_logical(stored: torch.Tensor) -> torch.Tensor:
    """Rows in AWQ's stored order (groups of 8 interleaved) -> logical order, along dim 0."""
    n = stored.shape[0]
    return stored.view(n // 8, 8, *stored.shape[1:])[:, list(AWQ_REVERSE_ORDER)].reshape(stored.shape)


@dataclass(frozen=True)
class LayerScheme:
    bits: int
    group_size: int  # -1: one group per row
    sym: bool
    data_type: str


def _normalize_method(value) -> str:
    return str(value).strip().lower().replace("_", "-") if isinstance(value, str) else ""


def _quant_config(path: Path, config: dict) -> tuple[dict, Path]:
    """config.json's quantization_config (auto-round also writes it as quantization_config.json)."""
    where = path / "config.json"
    qc = config.get("quantization_config")
    if qc is None and (path / "quantization_config.json").is_file():
        where = path / "quantization_config.json"
        qc = read_json(where)
    if not isinstance(qc, dict) or not qc:
        raise BadInput("no quantization_config object in config.json", path=path / "config.json")
    method = _normalize_method(qc.get("quant_method"))
    if method not in QUANT_METHODS:
        raise BadInput(f"quant_method is {qc.get('quant_method')!r}, not auto-round", path=where)
    return qc, where


def _packing(qc: dict, where: Path) -> tuple[str, str, str]:
    """(packing_format as the loader normalises it, layout, zero convention)."""
    raw = qc.get("packing_format", DEFAULT_PACKING)
    if not isinstance(raw, str):
        raise BadInput(f"quantization_config.packing_format is {raw!r}: expected a string such as "
                       "\"auto_round:auto_gptq\"", path=where)
    name = _ALIASES.get(raw.strip().lower(), raw.strip().lower())
    if name not in PACKINGS:
        raise BadInput(f"unknown packing_format {raw!r}: qconvert reads auto-round's integer packings "
                       f"{', '.join(PACKINGS)} (fp8, mx/nv fp4, llm_compressor and mlx packings are not integer "
                       "GPTQ/AWQ grids)", path=where)
    return (name, *PACKINGS[name])


def _scheme(view: ConfigView, base: LayerScheme | None) -> LayerScheme:
    """bits/group_size/sym/data_type of the config (base None) or of one extra_config entry over `base`
    (auto-round's defaults: bits 4, group_size 128, sym true, data_type int)."""
    bits = config_bits(view, default=4 if base is None else base.bits) if view.get("bits") is not None else (
        4 if base is None else base.bits)
    group = view.get("group_size")
    if group is None:
        group = 128 if base is None else base.group_size
    elif isinstance(group, bool) or not isinstance(group, int):
        raise BadInput(f"{view.prefix}group_size is {group!r}: expected an integer (-1 for one group per row)",
                       path=view.path)
    if group == 0 or group < -1:
        raise BadInput(f"{view.prefix}group_size is {group}: expected -1 or a positive group size", path=view.path)
    sym = view.get("sym")
    sym = (True if base is None else base.sym) if sym is None else view.bool("sym")
    data_type = view.get("data_type")
    data_type = ("int" if base is None else base.data_type) if data_type is None else view.str("data_type")
    return LayerScheme(bits, group, bool(sym), data_type)


@dataclass(frozen=True)
class _Override:
    key: str
    regex: "re.Pattern | None"  # None: an exact layer name
    scheme: LayerScheme


class AutoRoundSource(CheckpointSource):
    """An auto-round native checkpoint folder, read lazily tensor by tensor."""

    format_name = "auto-round"

    def __init__(self, path: Path):
        self.path = Path(path)
        self.ckpt = CheckpointDir(self.path)
        conf = read_config(self.path)
        self.quant_config, self.qc_file = _quant_config(self.path, conf.raw)
        self.config = conf.model
        self.shapes = ModelShapes(self.config, self.path / "config.json")
        self.packing_format, self.layout, self.zero_convention = _packing(self.quant_config, self.qc_file)
        view = ConfigView(self.quant_config, self.qc_file, "quantization_config.")
        act_bits = view.get("act_bits")
        if isinstance(act_bits, (int, float)) and not isinstance(act_bits, bool) and act_bits < FLOAT_BITS:
            raise BadInput(f"quantization_config.act_bits is {act_bits}: activation quantization (W{view.get('bits')}"
                           f"A{act_bits}) has no integer-grid equivalent here", path=self.qc_file)
        self.scheme = _scheme(view, None)
        self.modules = self.ckpt.group_modules(_PARTS, primary="qweight")
        self.unmatched_regex: list[str] = []
        self.overrides = self._overrides(view)

    # -- configuration ----------------------------------------------------------------------------
    def _overrides(self, view: ConfigView) -> list[_Override]:
        extra = view.view("extra_config", default=None)
        if extra is None:
            return []
        layers = set(self.modules) | {n[: -len(".weight")] for n in self.ckpt.location if n.endswith(".weight")}
        layers |= {self.model_module(n) for n in layers}  # a renamed checkpoint's config may use either name
        out = []
        for key, entry in extra.data.items():
            if not isinstance(entry, dict):
                raise BadInput(f"{extra.prefix}{key} is not a JSON object of overrides (bits, group_size, sym)",
                               path=self.qc_file)
            scheme = _scheme(ConfigView(entry, self.qc_file, f"{extra.prefix}{key}."), self.scheme)
            if key in layers:
                out.append(_Override(key, None, scheme))
                continue
            try:
                regex = re.compile(key)
            except (re.error, RecursionError, OverflowError):
                self.unmatched_regex.append(key)  # the loader skips an invalid pattern silently
                continue
            if entry:  # an empty override is skipped by the loader
                out.append(_Override(key, regex, scheme))
        return out

    def layer_scheme(self, prefix: str) -> LayerScheme:
        """The loader's scheme of one layer: its exact extra_config entry, else the first matching regex."""
        names = self.module_names(prefix)  # the stored name, and the class's where the checkpoint is renamed
        for o in self.overrides:
            if o.regex is None and (o.key in names or self.model_module(o.key) in names):
                return o.scheme
        for o in self.overrides:
            if o.regex is not None and any(o.regex.search(n) for n in names):
                return o.scheme
        return self.scheme

    # -- one quantized module -------------------------------------------------------------------------
    def _bad(self, msg: str, name: str) -> BadInput:
        return BadInput(msg, path=self.ckpt.file_of(name) if name in self.ckpt else self.path, tensor=name)

    def _params(self, prefix: str) -> tuple[GridParams, tuple[int, int]]:
        parts = self.modules[prefix]
        qname = parts["qweight"]
        self.ckpt.require_parts(prefix, parts, "qweight", ("qzeros", "scales"))
        scheme = self.layer_scheme(prefix)
        if scheme.bits >= FLOAT_BITS:
            raise self._bad(f"the module is packed in the file, but its config says {scheme.bits}-bit (kept in "
                            "float, read from <layer>.weight by auto-round)", qname)
        if scheme.data_type.lower() not in ("int", "int_sym", "int_asym"):
            raise self._bad(f"data_type {scheme.data_type!r}: only auto-round's integer grids are read", qname)
        allowed = AWQ_BITS if self.layout == "awq" else STREAM_BITS
        if scheme.bits not in allowed:
            raise self._bad(f"unsupported bits {scheme.bits} for packing_format {self.packing_format}: auto-round "
                            f"packs {', '.join(map(str, allowed))} there", qname)
        for part, dtypes in _PART_DTYPES.items():
            if part in parts and self.ckpt.dtype(parts[part]) not in dtypes:
                raise self._bad(f"{part} dtype {self.ckpt.dtype(parts[part])} is not {' or '.join(dtypes.values())}",
                                parts[part])
        shapes = {part: self.ckpt.shape(name) for part, name in parts.items()}
        for part in ("qweight", "qzeros", "scales"):
            if len(shapes[part]) != 2:
                raise self._bad(f"{part} shape {shapes[part]} is not 2-D", parts[part])
        bits = scheme.bits
        out_features, in_features = self._features(shapes["qweight"], bits, qname)
        self.shapes.check_linear(self.model_module(prefix), out_features, in_features, self.ckpt.file_of(qname), qname,
                                 f"qweight shape {shapes['qweight']} at {bits} bits ({self.layout} layout)")
        group = in_features if scheme.group_size == -1 else scheme.group_size
        if in_features % group:
            raise self._bad(f"group_size {scheme.group_size} does not divide in_features {in_features}", qname)
        n_groups = in_features // group
        packed_out = out_features * bits // 32
        if shapes["scales"] != (n_groups, out_features):
            raise self._bad(f"scales shape {shapes['scales']} does not match qweight {shapes['qweight']}: expected "
                            f"({n_groups}, {out_features}) for {in_features} inputs in groups of {group}",
                            parts["scales"])
        if shapes["qzeros"] != (n_groups, packed_out):
            raise self._bad(f"qzeros shape {shapes['qzeros']} does not match {n_groups} groups x {out_features} "
                            f"outputs at {bits} bits: expected ({n_groups}, {packed_out})", parts["qzeros"])
        zeros = self._zeros(self.ckpt.get(parts["qzeros"]), bits, parts["qzeros"])
        g_idx = self._g_idx(parts, in_features, group) if "g_idx" in parts else None
        scales = self.ckpt.get(parts["scales"]).T.contiguous()
        params = GridParams(bits=bits, group_size=group, scales=scales, zeros=zeros.T.contiguous(), g_idx=g_idx)
        return params, (out_features, in_features)

    def _features(self, qshape: tuple[int, int], bits: int, qname: str) -> tuple[int, int]:
        """(out, in) from qweight's shape: GPTQ layouts pack the inputs (rows), AWQ the outputs (columns). 32 codes
        fill `bits` words, and auto-round packs whole runs of 32 (export/formats/base.py _check_divisible_by_32);
        its loaders need the outputs in 32s too (backend.py exllamav2_feature_checker)."""
        rows, cols = qshape
        packed, plain = (rows, cols) if self.layout == "gptq" else (cols, rows)
        if not packed or not plain:
            raise self._bad(f"qweight shape {qshape} is empty", qname)
        if packed % bits:
            raise self._bad(f"qweight shape {qshape}: {packed} packed {'rows' if self.layout == 'gptq' else 'columns'}"
                            f" do not hold whole runs of 32 {bits}-bit codes (a multiple of {bits} words)", qname)
        out_features, in_features = (plain, packed * 32 // bits) if self.layout == "gptq" else (packed * 32 // bits, plain)
        if out_features % 32:
            raise self._bad(f"qweight shape {qshape}: {out_features} outputs, which {bits}-bit qzeros cannot pack "
                            "(a multiple of 32 is needed)", qname)
        return out_features, in_features

    def _zeros(self, qzeros: torch.Tensor, bits: int, name: str) -> torch.Tensor:
        """[G, out*b/32] words -> [G, out] zero points (int16) as auto-round's loader reads them."""
        fields = unpack_stream(qzeros.T.contiguous(), bits).T.to(torch.int16)
        if self.layout == "awq":
            fields = _awq_logical(fields.T.contiguous()).T
        if self.zero_convention == "zp-1":
            top = (1 << bits) - 1
            if bool((fields == top).any()):
                raise self._bad(f"a stored zero field reads {top}, i.e. zero point {top + 1} under auto_gptq's z - 1 "
                                f"convention: outside the {bits}-bit code range (auto-round's packer clamps z - 1 to "
                                f"0..{top - 1})", name)
            fields = fields + 1
        return fields.contiguous()

    def _g_idx(self, parts: dict, in_features: int, group: int) -> None:
        """auto_round:gptqmodel stores g_idx = k // group_size (qlinear_torch's g_idx=True buffer, never changed by
        its pack()). auto-round's CPU loader builds its QuantLinear without that buffer and so never reads it:
        groups are k // group_size whatever the file says. Any other index is refused rather than read two ways."""
        name = parts["g_idx"]
        if self.ckpt.shape(name) != (in_features,):
            raise self._bad(f"g_idx shape {self.ckpt.shape(name)} does not match qweight's {in_features} inputs", name)
        natural = torch.arange(in_features, dtype=torch.int64) // group
        if not torch.equal(self.ckpt.get(name).to(torch.int64), natural):
            raise self._bad("g_idx is not k // group_size: auto-round writes no act-order index and its loader "
                            "ignores g_idx, so the file's groups are ambiguous", name)
        return None

    def _load_grid(self, prefix: str) -> Grid:
        params, (out_features, in_features) = self._params(prefix)
        qweight = self.ckpt.get(self.modules[prefix]["qweight"])
        if self.layout == "gptq" and params.bits in SUPPORTED_PACK_BITS:
            # GPTQ's own words: a GPTQ writer copies them, the Q4_0 path moves nibbles
            return Grid(params, packed=PackedCodes(qweight, params.bits, "gptq-rows"))
        if self.layout == "gptq":
            return Grid(params, codes=unpack_stream(qweight, params.bits).T.contiguous())
        stored = unpack_stream(qweight.T.contiguous(), params.bits)  # [out (stored order), in]
        return Grid(params, codes=_awq_logical(stored).contiguous())

    # -- the ModelSource interface --------------------------------------------------------------------
    def records(self) -> Iterator[TensorRecord]:
        return self.module_records(self.modules, "qweight", self._module_record)

    def _module_record(self, prefix: str, shard: str) -> TensorRecord:
        params, shape = self._params(prefix)
        # held until planned, then read again where used (`params_loader`), as the AWQ and GPTQ readers' records
        rec = TensorRecord(f"{prefix}.weight", shape, "grid", lambda p=prefix: self._load_grid(p), source_file=shard,
                           params_loader=lambda p=prefix: self._params(p)[0])
        rec.params = params  # already parsed for the shape: the first use takes them
        return rec

    def describe(self) -> dict:
        qc = self.quant_config
        layouts = {"gptq": "qweight int32 [in*b/32, out] packed along inputs; qzeros [G, out*b/32]; scales fp16 [G, out]",
                   "awq": "qweight int32 [in, out*b/32] packed along outputs (AWQ order); qzeros [G, out*b/32]; "
                          "scales fp16 [G, out]"}
        desc = {"format": self.format_name, "quant_method": qc.get("quant_method"),
                "packing_format": self.packing_format,
                "zero_convention": "stored z - 1" if self.zero_convention == "zp-1" else "stored z",
                "bits": self.scheme.bits, "group_size": self.scheme.group_size, "sym": self.scheme.sym,
                "data_type": self.scheme.data_type, "extra_config": qc.get("extra_config") or {},
                "block_name_to_quantize": qc.get("block_name_to_quantize", qc.get("to_quant_block_names")),
                "autoround_version": qc.get("autoround_version"),
                "shards": len(self.ckpt.shards), "quantized_modules": len(self.modules),
                "layout": layouts[self.layout], "ignored_files": self.ignored_files}
        if self.unmatched_regex:
            desc["skipped_extra_config_keys"] = self.unmatched_regex
        return desc


def open_auto_round(path: Path, **_: object) -> AutoRoundSource:
    return AutoRoundSource(path)


def sniff_auto_round(path: Path) -> bool:
    """A checkpoint folder whose quantization config says quant_method auto-round (the data's own label)."""
    qc = quantization_config_of(path)
    if isinstance(qc, dict) and not qc and (Path(path) / "quantization_config.json").is_file():
        try:
            qc = read_json(Path(path) / "quantization_config.json")
        except BadInput:
            return False
    return isinstance(qc, dict) and _normalize_method(qc.get("quant_method")) in QUANT_METHODS

"""AWQ checkpoints (AutoAWQ, transformers' AwqConfig, gptqmodel's AWQ export): GEMM, gptqmodel's 2-8-bit stream, GEMV.

Per quantized linear `<prefix>`: `qweight`, `qzeros` (int32) and `scales` (fp16/bf16), optional `bias`; layout.py
has the three packings: 4-bit GEMM ([in, out/8], interleaved nibbles), gptqmodel's 2/3/5-8-bit GEMM (a bit stream
along the outputs, [in, ceil(out*b/32)]), and AutoAWQ's GEMV ([out, in/8], zeros and scales per output row,
padded). Every record is a grid in [out, in] orientation with integer zero points and the stored scales; codes
are unpacked when the record is loaded.

The dequantization is gptqmodel 7.6's (quantization/awq/utils/packing_utils.py dequantize_gemm, which
AwqTorchLinear.forward multiplies by): `(iweight - izeros) * scales`, int32 codes minus int32 zeros times the fp16
scales, i.e. one fp16 rounding of the exact product. The grid carries compute_dtype float16 so that ours is that
fp16 matrix bit for bit (a float32 product would keep the unrounded value).

quantization_config keys, as the producers write them: quant_method "awq"; bits (AutoAWQ: w_bit); group_size
(AutoAWQ: q_group_size; -1 = one group per row); version and/or format (gptqmodel writes both, AutoAWQ
"GEMM" in capitals); zero_point; modules_to_not_convert (modules transformers leaves as plain linears: they are stored as plain
weights, and a quantized module it names is refused).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import torch

from ...converters.errors import BadInput
from ...converters.records import Grid, GridParams, TensorRecord
from ...converters.validate import ConfigView
from ...converters.model_shapes import ModelShapes
from ..common.checkpoint import CheckpointDir, CheckpointSource, quantization_config_of
from .layout import PACK_FACTOR, gemv_zeros_width, unpack_codes, unpack_stream, words_per_row
from ..common.quant_config import CheckpointConfig, read_config

__all__ = ["AwqSource", "open_awq", "is_awq", "READ_VERSIONS", "KNOWN_VERSIONS"]

_PARTS = ("qweight", "qzeros", "scales")
# the layouts gptqmodel 7.6 exports for AWQ (quantization/config.py AWQ_EXPORT_FORMATS) and AutoAWQ's others;
# GEMM and GEMV are read; the others pack in kernel tiles (gemv_fast, marlin, ...)
READ_VERSIONS = ("gemm", "gemv")
KNOWN_VERSIONS = ("gemm", "gemv", "gemv_fast", "marlin", "bitblas", "llm-awq", "exllama", "ipex")
_SCALE_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16}
_KEY_ALIASES = {"bits": ("bits", "w_bit"), "group_size": ("group_size", "q_group_size"),
                "version": ("version", "format", "checkpoint_format")}


def is_awq(qc: object) -> bool:
    return isinstance(qc, dict) and str(qc.get("quant_method", qc.get("method", ""))).lower() == "awq"


def _quant_config(conf: CheckpointConfig) -> ConfigView:
    """config.json's quantization_config, else quantize_config.json (as gptqmodel reads it)."""
    qc = conf.quantization(fallback="quantize_config.json")
    if qc is None or not qc.data:
        raise BadInput("no quantization_config in config.json and no quantize_config.json", path=conf.path)
    method = qc.get("quant_method", qc.get("method"))
    if not isinstance(method, str) or method.lower() != "awq":
        raise BadInput(f"{qc.prefix}quant_method is {method!r}, not awq", path=qc.path)
    return qc


def _one_of(qc: ConfigView, what: str):
    """The value of a key that producers spell several ways (bits / w_bit); spellings that disagree are refused."""
    found = {k: qc.get(k) for k in _KEY_ALIASES[what] if qc.get(k) is not None}
    values = {str(v).lower() for v in found.values()}
    if len(values) > 1:
        listed = ", ".join(f"{qc.prefix}{k} {v!r}" for k, v in found.items())
        raise BadInput(f"{listed} disagree", path=qc.path)
    return next(iter(found.items()), (_KEY_ALIASES[what][0], None))


class AwqSource(CheckpointSource):
    """An AWQ (GEMM or GEMV) checkpoint directory, read lazily tensor by tensor."""

    format_name = "awq"

    def __init__(self, path: Path):
        self.path = Path(path)
        conf = read_config(self.path)
        qc = _quant_config(conf)
        self.quant_config = qc.data
        self.config = conf.model
        self.bits = self._bits(qc)
        self.group_size = self._group_size(qc)
        self.version = self._version(qc)
        self.zero_point = qc.bool("zero_point", default=True)
        self.not_converted = self._modules_to_not_convert(qc)
        self.shapes = ModelShapes(self.config, self.path / "config.json")
        self.ckpt = CheckpointDir(self.path)
        self.modules = self.ckpt.group_modules(_PARTS, primary="qweight")

    # -- the config ---------------------------------------------------------------------------------
    def _bits(self, qc: ConfigView) -> int:
        key, bits = _one_of(qc, "bits")
        if bits is None:
            return 4  # AutoAWQ's and transformers' AwqConfig default
        if isinstance(bits, bool) or not isinstance(bits, int):
            raise BadInput(f"{qc.prefix}{key} is {bits!r}: expected an integer", path=qc.path)
        if not 2 <= bits <= 8:
            # gptqmodel 7.6 packing_utils._pack_contiguous: "AWQ packing requires 2 through 8 bits"
            raise BadInput(f"{qc.prefix}{key} is {bits}: AWQ packs 2 through 8 bits (4: AutoAWQ's interleaved "
                           "GEMM words; 2, 3, 5-8: gptqmodel's bit stream)", path=qc.path)
        return bits

    def _group_size(self, qc: ConfigView) -> int:
        key, group = _one_of(qc, "group_size")
        if group is None:
            return 128  # AutoAWQ's and transformers' AwqConfig default
        if isinstance(group, bool) or not isinstance(group, int) or group == 0 or group < -1:
            raise BadInput(f"{qc.prefix}{key} is {group!r}: expected -1 (one group per row) or a positive integer",
                           path=qc.path)
        return group

    def _version(self, qc: ConfigView) -> str:
        key, version = _one_of(qc, "version")
        if version is None:
            return "gemm"  # transformers' AwqConfig default (AWQLinearVersion.GEMM)
        if not isinstance(version, str):
            raise BadInput(f"{qc.prefix}{key} is {version!r}: expected a string such as \"gemm\"", path=qc.path)
        v = version.strip().lower().replace("-", "_").replace("llm_awq", "llm-awq")
        if v not in KNOWN_VERSIONS:
            raise BadInput(f"{qc.prefix}{key} {version!r} is not an AWQ layout (known: {', '.join(KNOWN_VERSIONS)})",
                           path=qc.path)
        if v not in READ_VERSIONS:
            raise BadInput(f"{qc.prefix}{key} {version!r}: only the GEMM (qweight [in, out/8]) and GEMV (qweight "
                           f"[out, in/8]) layouts are read; {v} packs the codes differently", path=qc.path)
        if v == "gemv" and self.bits != 4:
            # AutoAWQ 0.2.9 WQLinear_GEMV: "Only 4-bit are supported for now."
            raise BadInput(f"{qc.prefix}{key} {version!r} with {self.bits} bits: the GEMV layout is 4-bit only",
                           path=qc.path)
        return v

    def _modules_to_not_convert(self, qc: ConfigView) -> tuple[str, ...]:
        names = qc.list("modules_to_not_convert", default=None) or []
        if not all(isinstance(n, str) for n in names):
            raise BadInput(f"{qc.prefix}modules_to_not_convert is {names!r:.80}: expected a list of module names",
                           path=qc.path)
        for name in names:
            try:
                re.compile(name)
            except (re.error, RecursionError, OverflowError):
                raise BadInput(f"{qc.prefix}modules_to_not_convert entry {name[:80]!r} is not a valid regular "
                               "expression (transformers matches the entries as regexes)", path=qc.path) from None
        return tuple(names)

    # -- reading one module -------------------------------------------------------------------------
    def _params(self, prefix: str) -> tuple[GridParams, tuple[int, int], str]:
        """The module's grid parameters (scales and zeros read, codes not), after every check the headers allow."""
        parts = self.modules[prefix]
        qweight_name = parts["qweight"]
        where = self.ckpt.file_of(qweight_name)
        self.ckpt.require_parts(prefix, parts, "qweight", ("qzeros", "scales"))
        skipped = next((m for m in self.not_converted if _skips(m, prefix)), None)
        if skipped is not None:
            raise BadInput(f"module is quantized in the file, but modules_to_not_convert lists {skipped!r} "
                           "(transformers would load it as a plain linear and leave it random)", path=where,
                           tensor=qweight_name)
        for part in ("qweight", "qzeros"):
            if self.ckpt.dtype(parts[part]) != "I32":
                raise BadInput(f"{part} dtype {self.ckpt.dtype(parts[part])} is not int32",
                               path=self.ckpt.file_of(parts[part]), tensor=parts[part])
        if self.ckpt.dtype(parts["scales"]) not in _SCALE_DTYPES:
            raise BadInput(f"scales dtype {self.ckpt.dtype(parts['scales'])} is not float16 or bfloat16",
                           path=self.ckpt.file_of(parts["scales"]), tensor=parts["scales"])
        shapes = {part: self.ckpt.shape(name) for part, name in parts.items()}
        for part, name in parts.items():
            if len(shapes[part]) != 2:
                raise BadInput(f"{part} shape {shapes[part]} is not 2-D", path=self.ckpt.file_of(name), tensor=name)
        if self.version == "gemv":
            return self._gemv_params(prefix, parts, shapes)
        return self._gemm_params(prefix, parts, shapes)

    def _group_of(self, in_features: int, where: Path, qweight_name: str) -> int:
        group = self.group_size if 0 < self.group_size < in_features else in_features
        if in_features % group:
            raise BadInput(f"in_features {in_features} is not a multiple of group_size {self.group_size}",
                           path=where, tensor=qweight_name)
        return group

    def _gemm_params(self, prefix: str, parts: dict, shapes: dict) -> tuple[GridParams, tuple[int, int], str]:
        """GEMM and gptqmodel's bit stream: qweight [in, words(out)], qzeros [G, words(out)], scales [G, out]."""
        qweight_name = parts["qweight"]
        where = self.ckpt.file_of(qweight_name)
        qshape = shapes["qweight"]
        in_features, out_features = qshape[0], self._out_features(qshape, shapes["scales"])
        if not in_features or not out_features:
            raise BadInput(f"qweight shape {qshape} is empty", path=where, tensor=qweight_name)
        self.shapes.check_linear(prefix, out_features, in_features, where, qweight_name,
                                 f"qweight shape {qshape} ({self._layout_words})")
        n_words = words_per_row(out_features, self.bits)
        if qshape[1] != n_words:
            raise BadInput(f"qweight shape {qshape} does not hold {out_features} outputs of {self.bits} bits "
                           f"(scales {shapes['scales']}): expected ({in_features}, {n_words})",
                           path=where, tensor=qweight_name)
        group = self._group_of(in_features, where, qweight_name)
        n_groups = in_features // group
        sname, zname = parts["scales"], parts["qzeros"]
        if shapes["scales"] != (n_groups, out_features):
            raise BadInput(f"scales shape {shapes['scales']} does not match qweight {qshape}: expected ({n_groups}, "
                           f"{out_features}) for {in_features} inputs in groups of {group} and {out_features} outputs",
                           path=self.ckpt.file_of(sname), tensor=sname)
        if shapes["qzeros"] != (n_groups, n_words):
            raise BadInput(f"qzeros shape {shapes['qzeros']} does not match qweight {qshape}: expected ({n_groups}, "
                           f"{n_words})", path=self.ckpt.file_of(zname), tensor=zname)
        scales = self.ckpt.get(sname)
        zeros = unpack_codes(self.ckpt.get(zname), self.bits, out_features).to(torch.int16)  # [G, out]
        params = GridParams(bits=self.bits, group_size=group, scales=scales.T.contiguous(), zeros=zeros.T.contiguous(),
                            compute_dtype=scales.dtype)
        return params, (out_features, in_features), qweight_name

    def _gemv_params(self, prefix: str, parts: dict, shapes: dict) -> tuple[GridParams, tuple[int, int], str]:
        """AutoAWQ GEMV (layout.py): qweight [out, in/8], qzeros [out, W], scales [out, 8W], W padded."""
        qweight_name = parts["qweight"]
        where = self.ckpt.file_of(qweight_name)
        qshape = shapes["qweight"]
        out_features, in_features = qshape[0], qshape[1] * PACK_FACTOR
        if not in_features or not out_features:
            raise BadInput(f"qweight shape {qshape} is empty", path=where, tensor=qweight_name)
        self.shapes.check_linear(prefix, out_features, in_features, where, qweight_name,
                                 f"qweight shape {qshape} (GEMV: [out, in/8])")
        group = self._group_of(in_features, where, qweight_name)
        n_groups = in_features // group
        width = gemv_zeros_width(in_features, group)
        if width is None:
            raise BadInput(f"group_size {group}: AutoAWQ's GEMV packs groups of 32, 64 or >= 128 only "
                           "(calculate_zeros_width)", path=where, tensor=qweight_name)
        sname, zname = parts["scales"], parts["qzeros"]
        if shapes["qzeros"] != (out_features, width):
            raise BadInput(f"qzeros shape {shapes['qzeros']} does not match qweight {qshape}: expected "
                           f"({out_features}, {width}) (GEMV: {n_groups} groups, padded)",
                           path=self.ckpt.file_of(zname), tensor=zname)
        if shapes["scales"] != (out_features, width * PACK_FACTOR):
            raise BadInput(f"scales shape {shapes['scales']} does not match qweight {qshape}: expected "
                           f"({out_features}, {width * PACK_FACTOR}) (GEMV: {n_groups} groups, padded)",
                           path=self.ckpt.file_of(sname), tensor=sname)
        scales = self.ckpt.get(sname)[:, :n_groups].contiguous()  # [out, G]
        zeros = unpack_stream(self.ckpt.get(zname), 4, n_groups).to(torch.int16)  # [out, G]
        params = GridParams(bits=4, group_size=group, scales=scales, zeros=zeros, compute_dtype=scales.dtype)
        return params, (out_features, in_features), qweight_name

    def _layout_description(self) -> str:
        if self.version == "gemv":
            return ("GEMV (AutoAWQ): qweight int32 [out, in/8] packed along inputs, nibbles in natural order; "
                    "qzeros int32 [out, W] and scales fp16 [out, 8W], W padded (calculate_zeros_width)")
        if self.bits == 4:
            return ("GEMM: qweight int32 [in, out/8] packed along outputs, nibble order 0 2 4 6 1 3 5 7; "
                    "qzeros int32 [G, out/8]; scales fp16 [G, out]")
        return (f"gptqmodel {self.bits}-bit stream: qweight int32 [in, ceil(out*{self.bits}/32)], codes LSB-first "
                f"along outputs across word boundaries; qzeros int32 [G, ceil(out*{self.bits}/32)]; scales [G, out]")

    @property
    def _layout_words(self) -> str:
        return "GEMM: [in, out/8]" if self.bits == 4 else f"{self.bits}-bit stream: [in, ceil(out*{self.bits}/32)]"

    def _out_features(self, qshape: tuple[int, ...], scales_shape: tuple[int, ...]) -> int:
        """4-bit GEMM words hold exactly 8 outputs; a bit stream's last word may be part padding, so its
        outputs are scales' columns (gptqmodel's dequantize_gemm passes scales.shape[-1] as the count)."""
        return qshape[1] * PACK_FACTOR if self.bits == 4 else scales_shape[1]

    def _load_grid(self, prefix: str) -> Grid:
        params, (out_features, in_features), qweight_name = self._params(prefix)
        if self.version == "gemv":
            return Grid(params, codes=unpack_stream(self.ckpt.get(qweight_name), 4, in_features))  # [out, in]
        codes = unpack_codes(self.ckpt.get(qweight_name), self.bits, out_features)  # [in, out]
        return Grid(params, codes=codes.T.contiguous())

    # -- the ModelSource interface ------------------------------------------------------------------
    def records(self) -> Iterator[TensorRecord]:
        return self.module_records(self.modules, "qweight", self._module_record)

    def _module_record(self, prefix: str, shard: str) -> TensorRecord:
        params, shape, _ = self._params(prefix)
        # held until planned, then read again where used (`params_loader`): a giant model's scales and zero points
        # (1/16-1/64 of its code bytes) are not all held from planning to writing
        rec = TensorRecord(f"{prefix}.weight", shape, "grid", lambda p=prefix: self._load_grid(p), source_file=shard,
                           params_loader=lambda p=prefix: self._params(p)[0])
        rec.params = params  # already parsed for the shape: the first use takes them
        return rec

    def describe(self) -> dict:
        return {"format": "awq", "version": self.version, "bits": self.bits, "group_size": self.group_size,
                "zero_point": self.zero_point, "modules_to_not_convert": list(self.not_converted),
                "shards": len(self.ckpt.shards), "quantized_modules": len(self.modules),
                "dequantization": "(q - z) * s in the scales' dtype (gptqmodel's / AutoAWQ's dequantize_gemm)",
                "layout": self._layout_description(),
                "ignored_files": self.ignored_files}


_BOUNDARY = r"(?:(?<=\.)|(?=\.|$))"


def _skips(pattern: str, module: str) -> bool:
    """Whether transformers leaves `module` unquantized for a modules_to_not_convert entry (transformers 5.24
    quantizers/quantizers_utils.py should_convert_module: a regex matched from the start up to a module
    boundary, or a suffix of the module's name)."""
    return bool(re.match(rf"(?:{pattern}){_BOUNDARY}", module)) or module.endswith(pattern)


def open_awq(path: Path, **_: object) -> AwqSource:
    return AwqSource(path)


def sniff_awq(path: Path) -> bool:
    """A checkpoint folder whose quantization config (config.json, else quantize_config.json) says awq."""
    return is_awq(quantization_config_of(path))

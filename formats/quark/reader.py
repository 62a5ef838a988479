"""AMD Quark checkpoints in OCP MXFP4 and MXFP8 (config.json quantization_config.quant_method "quark"): what
amd-quark 0.13's `export_safetensors` writes (custom_mode "quark", real_quantized), the form AMD ships DeepSeek-R1,
Kimi-K2.5, GLM-5 and Qwen3.5-397B MXFP4 in.

Config: `global_quant_config.weight` {dtype "fp4", qscheme "per_group", group_size 32, scale_format "e8m0",
ch_axis -1}, overridden per module by `layer_quant_config` (name patterns, fnmatch as Quark matches them) and
`layer_type_quant_config` (by class: a linear here), `exclude` (name patterns left dense). Per quantized linear
`<prefix>`: `weight` U8 [out, in/2], two E2M1 codes a byte, the even element in the low nibble, and
`weight_scale` U8 [out, in/32], E8M0 exponents (2**(e - 127)). Quark's dequantization (its real quantizer's
forward on import, and its fake quantization before export, which the fixture's oracle shows agree) is the
table value times the exponent, exact in float32; code 8 is -0.0 as OCP's E2M1 says.

MXFP8 (`weight` dtype "fp8_e4m3", the rest as above): `weight` U8 [out, in], one E4M3 code a byte, `weight_scale` U8
[out, in/32]; Quark's dequantization (fake_quantize_mx: the E4M3 value times the power of two) is exact in float32.
amd-quark 0.13 cannot export it real-quantized (real_quantize_fp8_e4m3 raises for per_group), so the fixture is
built from this layout with Quark's own scale rule and checked against Quark's fake-quantized weights
(scripts/producers/quark.py).

Read as float grids (kernels/floatq.py's E2M1 / E4M3 tables, E8M0 scales per 32). MXFP4 keeps its codes in GGUF
MXFP4, UQFF mxfp4, mlx mxfp4 and compressed-tensors mxfp4-pack-quantized and casts exactly into FP8 128x128 tiles
(formats/common/fp8_tiles.py); MXFP8 keeps its codes in compressed-tensors mxfp8-quantized and mlx mxfp8.
Activation and KV-cache scales (`input_scale`, `output_scale`, `k_scale`, `v_scale`) are a
runtime's choice: listed, not carried. Any other Quark weight scheme (FP8 per tensor or channel, int4/int8, OCP
MXFP6 / MXINT8) is refused in one line naming the config key and the first module it quantizes.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
import torch

from ...converters.errors import BadInput
from ...converters.model_shapes import ModelShapes
from ...converters.records import Grid
from ...kernels.floatq import unpack_fp4
from ..common.checkpoint import CheckpointDir, quantization_config_of
from ..common.float_grids import FloatModuleSource, float_grid
from ..common.quant_config import read_config

__all__ = ["QuarkSource", "open_quark", "sniff_quark"]

RUNTIME_PARTS = ("input_scale", "output_scale", "k_scale", "v_scale")
_MX_GROUP = 32


def sniff_quark(path: Path) -> bool:
    qc = quantization_config_of(path)
    return isinstance(qc, dict) and str(qc.get("quant_method", "")).lower() == "quark"


def _weight_scheme(layer: object) -> dict | None:
    """A Quark layer config's `weight` spec (the first, when a list), or None for a layer left dense."""
    if not isinstance(layer, dict):
        return None
    w = layer.get("weight")
    if isinstance(w, list):
        w = w[0] if w else None
    return w if isinstance(w, dict) else None


# Quark's element dtype -> (the float grid's element format, codes a byte)
_MX_ELEMENTS = {"fp4": ("e2m1", 2), "fp8_e4m3": ("e4m3", 1)}


def _mx_element(w: dict) -> str | None:
    """The OCP MX element format ("fp4" / "fp8_e4m3") of a weight spec in groups of 32 under E8M0 scales along
    the inputs, else None."""
    if (w.get("qscheme") == "per_group" and w.get("group_size") == _MX_GROUP and w.get("scale_format") == "e8m0"
            and w.get("ch_axis", -1) in (-1, 1) and w.get("dtype") in _MX_ELEMENTS):
        return w["dtype"]
    return None


class QuarkSource(FloatModuleSource):
    """A Quark OCP MXFP4 checkpoint folder, read tensor by tensor."""

    format_name = "quark"

    def __init__(self, path: Path):
        self.path = Path(path)
        conf = read_config(self.path)
        where = conf.path
        qc = conf.quantization()
        if qc is None or str(qc.get("quant_method", "")).lower() != "quark":
            raise BadInput("quantization_config.quant_method is not 'quark'", path=where)
        self.quant_config = qc.data
        self.config = conf.model
        self.where = where
        exclude = qc.get("exclude")
        if exclude is None:
            exclude = []
        if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
            # Quark's exclude is a list of module-name patterns; anything else is not a list it could have written
            # (scripts/fuzz found -1e300 here raising a TypeError)
            raise BadInput("quantization_config.exclude is not a list of module-name patterns", path=where)
        self.exclude = exclude
        self.layer_configs = qc.get("layer_quant_config") or {}
        if not isinstance(self.layer_configs, dict):
            raise BadInput("quantization_config.layer_quant_config is not an object", path=where)
        self.global_weight = _weight_scheme(qc.get("global_quant_config"))
        self.shapes = ModelShapes(self.config, where)
        self.ckpt = CheckpointDir(self.path)
        self.modules = {}
        for name in self.ckpt.location:
            prefix, _, part = name.rpartition(".")
            if part == "weight_scale":
                if f"{prefix}.weight" not in self.ckpt.location:
                    raise BadInput("weight_scale without weight", path=self.ckpt.file_of(name),
                                   tensor=f"{prefix}.weight")
                self.modules[prefix] = {"weight": f"{prefix}.weight", "weight_scale": name}
        for name in self.ckpt.location:  # packed codes that lost their scale would pass for a dense U8 tensor
            prefix = name[: -len(".weight")]
            if name.endswith(".weight") and self.ckpt.dtype(name) in ("U8", "F8_E4M3") and prefix not in self.modules:
                raise BadInput(f"{self.ckpt.dtype(name)} weight without its weight_scale (MX codes are values only "
                               "times their E8M0 exponents)", path=self.ckpt.file_of(name),
                               tensor=f"{prefix}.weight_scale")
        for prefix in self.modules:
            self._scheme_of(prefix)
            self._params(prefix)  # every module checked before a record is made
        self.runtime_params = sorted(n for n in self.ckpt.location if n.rpartition(".")[2] in RUNTIME_PARTS)

    def _scheme_of(self, prefix: str) -> dict:
        """The weight spec Quark applies to module `prefix` (layer_quant_config by name pattern first, then the
        global one); a scheme other than OCP MXFP4 is a BadInput naming the key and the module."""
        key, w = "global_quant_config.weight", self.global_weight
        for pattern, layer in self.layer_configs.items():
            if isinstance(pattern, str) and fnmatch.fnmatch(prefix, pattern):
                key, w = f"layer_quant_config[{pattern!r}].weight", _weight_scheme(layer)
                break
        wname = f"{prefix}.weight"
        if w is None:
            raise BadInput(f"quantization_config.{key} says this module is not quantized, but it has a weight_scale",
                           path=self.ckpt.file_of(wname), tensor=wname)
        if _mx_element(w) is None:
            what = {k: w.get(k) for k in ("dtype", "qscheme", "group_size", "scale_format")}
            raise BadInput(f"quantization_config.{key} is {what}: qconvert reads Quark's OCP MXFP4 and MXFP8 (dtype "
                           "fp4 or fp8_e4m3, per_group 32, scale_format e8m0)", path=self.ckpt.file_of(wname),
                           tensor=wname)
        return w

    # -- one module --------------------------------------------------------------------------------
    def _bad(self, msg: str, tensor: str) -> BadInput:
        return BadInput(msg, path=self.ckpt.file_of(tensor), tensor=tensor)

    def _params(self, prefix: str):
        wname, sname = self.modules[prefix]["weight"], self.modules[prefix]["weight_scale"]
        dtype = _mx_element(self._scheme_of(prefix))
        element, per_byte = _MX_ELEMENTS[dtype]
        what = "MXFP4 nibbles" if per_byte == 2 else "MXFP8 E4M3 codes"
        # MXFP8 codes are one byte each: U8 as vLLM's quark OCP_MX scheme loads them, or the same bytes tagged
        # F8_E4M3
        allowed = {wname: ("U8",) if per_byte == 2 else ("U8", "F8_E4M3"), sname: ("U8",)}
        for n in (wname, sname):
            if self.ckpt.dtype(n) not in allowed[n]:
                raise self._bad(f"dtype {self.ckpt.dtype(n)} is not {' or '.join(allowed[n])} ({what} and E8M0 "
                                "exponents)", n)
        wshape, sshape = tuple(self.ckpt.shape(wname)), tuple(self.ckpt.shape(sname))
        if len(wshape) != 2 or min(wshape) < 1 or (wshape[1] * per_byte) % _MX_GROUP:
            form = "[out, in/2]" if per_byte == 2 else "[out, in]"
            raise self._bad(f"{'packed ' if per_byte == 2 else ''}weight of shape {list(wshape)}: expected {form} "
                            "with in a multiple of 32", wname)
        out_f, in_f = wshape[0], wshape[1] * per_byte
        if sshape != (out_f, in_f // _MX_GROUP):
            raise self._bad(f"scale shape {list(sshape)} does not match a [{out_f}, {in_f}] weight in groups of 32: "
                            f"expected {[out_f, in_f // _MX_GROUP]}", sname)
        self.shapes.check_linear(prefix, out_f, in_f, self.ckpt.file_of(wname), wname, "packed weight shape")
        scales = self.ckpt.get(sname)
        if bool((scales == 0xFF).any()):
            raise self._bad("an E8M0 scale is 0xFF (NaN)", sname)
        return float_grid(element, scales.view(torch.float8_e8m0fnu), _MX_GROUP), (out_f, in_f)

    def _load(self, prefix: str) -> Grid:
        params, _ = self._params(prefix)
        stored = self.ckpt.get(self.modules[prefix]["weight"])
        codes = unpack_fp4(stored) if params.element == "e2m1" else stored.view(torch.uint8)
        return Grid(params, codes=codes)

    # -- the ModelSource interface (records: FloatModuleSource) -----------------------------------
    def describe(self) -> dict:
        desc = {"format": self.format_name, "quant_method": "quark", "version": self.quant_config.get("version"),
                "quantized_modules": len(self.modules), "exclude": self.exclude, "shards": len(self.ckpt.shards),
                "ignored_files": self.ignored_files,
                "layout": "OCP MXFP4: weight two E2M1 codes a byte (even element low), weight_scale E8M0 per 32; "
                          "OCP MXFP8: weight one E4M3 code a byte, weight_scale E8M0 per 32"}
        return self.describe_runtime(desc)


def open_quark(path: Path, **_: object) -> QuarkSource:
    return QuarkSource(path)

"""NVIDIA ModelOpt checkpoints (`modelopt.torch.export.export_hf_checkpoint`): FP8, NVFP4 and MXFP4 weights.

The config is hf_quant_config.json {"producer": {"name": "modelopt"}, "quantization": {"quant_algo", "group_size",
"exclude_modules", "kv_cache_quant_algo", "quantized_layers" (MIXED_PRECISION)}}, repeated in config.json's
quantization_config with quant_method "modelopt". Per quantized linear `<prefix>` (as ModelOpt 0.47 exports them):

- FP8: `weight` F8_E4M3 [out, in], `weight_scale` float32, one value ([] / [1]) or one per output row ([out] /
  [out, 1]); W = fp8 * weight_scale (qtensor/fp8_tensor.py FP8QTensor.dequantize).
- NVFP4: `weight` uint8 [out, in/2] (two e2m1 codes a byte, the even element in the low nibble), `weight_scale`
  F8_E4M3 [out, in/16], `weight_scale_2` float32 [] (the per-tensor scale); W = e2m1 * (weight_scale *
  weight_scale_2), the product of the two scales rounded to float32 first (NVFP4QTensor.dequantize:
  per_block_scale = scale.float() * double_scale). Its global scale is a multiplier, where compressed-tensors'
  `weight_global_scale` is a divisor (the reader says which in describe()).
- MXFP4 (quant_algo "mxfp4"): `weight` uint8 as NVFP4's, `weight_scale` uint8 E8M0 exponents [out, in/32];
  W = e2m1 * 2**(e - 127) (MXFP4QTensor.dequantize).

Each becomes a float grid (converters/records.py) whose float32 dequantization equals ModelOpt's own
dequantization in float32 bit for bit (tests/formats/common/test_float_grids.py, on ModelOpt's output made on CPU). Activation
scales (`input_scale`) and KV-cache scales (`k_scale`, `v_scale`) are a runtime's choice: counted in describe(),
not carried.
"""

from __future__ import annotations

from pathlib import Path
import torch

from ...converters.errors import BadInput
from ...converters.records import Grid
from ...converters.validate import ConfigView
from ...kernels.floatq import unpack_fp4
from ..common.float_grids import FloatModuleSource, float_grid, fp8_element, refuse_unscaled_fp8
from ...converters.model_shapes import ModelShapes
from ..common.checkpoint import CheckpointDir, quantization_config_of, read_json
from ..common.quant_config import read_config

__all__ = ["ModelOptSource", "open_modelopt", "sniff_modelopt", "ALGOS"]

# quant_algo values whose weights are read (MIXED_PRECISION: per module, in quantized_layers)
ALGOS = ("FP8", "NVFP4", "MXFP4", "MIXED_PRECISION")
_PARTS = ("weight_scale", "weight_scale_2")
RUNTIME_PARTS = ("input_scale", "k_scale", "v_scale", "output_scale")


def _producer_config(path: Path) -> tuple[dict, Path] | None:
    """hf_quant_config.json's "quantization" object, else config.json's quantization_config when its
    quant_method is modelopt; None when neither is ModelOpt's."""
    hf = path / "hf_quant_config.json"
    if hf.is_file():
        data = read_json(hf)
        producer = (data.get("producer") or {}).get("name", "") if isinstance(data.get("producer"), dict) else ""
        if str(producer).lower() == "modelopt" and isinstance(data.get("quantization"), dict):
            return data["quantization"], hf
    qc = quantization_config_of(path)
    if isinstance(qc, dict) and str(qc.get("quant_method", "")).lower() == "modelopt":
        return qc, path / "config.json"
    return None


def sniff_modelopt(path: Path) -> bool:
    try:
        return Path(path).is_dir() and _producer_config(Path(path)) is not None
    except BadInput:
        return False


class ModelOptSource(FloatModuleSource):
    """A ModelOpt checkpoint folder, read tensor by tensor."""

    format_name = "modelopt"

    def __init__(self, path: Path):
        self.path = Path(path)
        conf = read_config(self.path)
        found = _producer_config(self.path)
        if found is None:
            raise BadInput("no ModelOpt quantization config (hf_quant_config.json with producer modelopt, or "
                           "quantization_config.quant_method modelopt)", path=self.path / "config.json")
        data, where = found
        qv = ConfigView(data, where)
        self.algo = str(qv.get("quant_algo", "")).upper()
        if self.algo not in ALGOS:
            raise BadInput(f"quant_algo {qv.get('quant_algo')!r} is not read (qconvert reads ModelOpt's "
                           f"{', '.join(ALGOS)} weights)", path=where)
        self.quant_config = data
        self.config = conf.model
        self.shapes = ModelShapes(self.config, self.path / "config.json")
        self.ckpt = CheckpointDir(self.path)
        self.modules = {}
        for name in self.ckpt.location:
            prefix, _, part = name.rpartition(".")
            if part in _PARTS:
                self.modules.setdefault(prefix, {})[part] = name
        for prefix, parts in self.modules.items():
            if "weight_scale" not in parts:
                raise BadInput("weight_scale_2 without weight_scale", path=self.ckpt.file_of(parts["weight_scale_2"]),
                               tensor=f"{prefix}.weight_scale")
            if f"{prefix}.weight" not in self.ckpt.location:
                raise BadInput("weight_scale without weight", path=self.ckpt.file_of(parts["weight_scale"]),
                               tensor=f"{prefix}.weight")
            parts["weight"] = f"{prefix}.weight"
        refuse_unscaled_fp8(self.ckpt, {n for parts in self.modules.values() for n in parts.values()}, "weight_scale")
        self.runtime_params = sorted(n for n in self.ckpt.location if n.rpartition(".")[2] in RUNTIME_PARTS)

    # -- one module --------------------------------------------------------------------------------
    def _bad(self, msg: str, tensor: str) -> BadInput:
        return BadInput(msg, path=self.ckpt.file_of(tensor), tensor=tensor)

    def _kind(self, prefix: str) -> str:
        """"fp8" / "nvfp4" / "mxfp4", decided from the stored dtypes (a MIXED_PRECISION file mixes them)."""
        parts = self.modules[prefix]
        wd, sd = self.ckpt.dtype(parts["weight"]), self.ckpt.dtype(parts["weight_scale"])
        if wd in ("F8_E4M3", "F8_E5M2"):
            kind = "fp8"
        elif wd == "U8" and sd == "F8_E4M3":
            kind = "nvfp4"
        elif wd == "U8" and sd == "U8":
            kind = "mxfp4"
        else:
            raise self._bad(f"weight {wd} with weight_scale {sd} is none of ModelOpt's FP8 (F8_E4M3 weight), "
                            "NVFP4 (U8 weight, F8_E4M3 scales) or MXFP4 (U8 weight, U8 E8M0 scales)", parts["weight"])
        if self.algo != "MIXED_PRECISION" and kind.upper() != self.algo:
            raise self._bad(f"the weights are {kind.upper()} but quant_algo is {self.algo}", parts["weight"])
        if kind == "nvfp4" and "weight_scale_2" not in parts:
            raise BadInput("NVFP4 weight without weight_scale_2 (the per-tensor scale)",
                           path=self.ckpt.file_of(parts["weight"]), tensor=f"{prefix}.weight_scale_2")
        return kind

    def _params(self, prefix: str):
        parts = self.modules[prefix]
        kind = self._kind(prefix)
        wname, sname = parts["weight"], parts["weight_scale"]
        wshape, sshape = self.ckpt.shape(wname), self.ckpt.shape(sname)
        if len(wshape) != 2 or min(wshape) < 1:
            raise self._bad(f"weight of shape {list(wshape)}: expected a 2-D linear weight", wname)
        out_f, in_f = wshape[0], wshape[1] * (1 if kind == "fp8" else 2)
        self.shapes.check_linear(prefix, out_f, in_f, self.ckpt.file_of(wname), wname, "weight shape")
        if kind == "fp8":
            element = fp8_element(self.ckpt.dtype(wname), self.ckpt.file_of(wname), wname)
            if self.ckpt.dtype(sname) != "F32":
                raise self._bad(f"FP8 weight_scale dtype {self.ckpt.dtype(sname)} is not F32", sname)
            if sshape in ((), (1,)):
                scales = self.ckpt.get(sname).reshape(1, 1).expand(out_f, 1).contiguous()
                return float_grid(element, scales, in_f), (out_f, in_f)  # one value, every row
            if sshape in ((out_f,), (out_f, 1)):
                return float_grid(element, self.ckpt.get(sname).reshape(out_f, 1), in_f), (out_f, in_f)
            raise self._bad(f"FP8 weight_scale shape {list(sshape)}: expected one value or one per output row "
                            f"({out_f})", sname)
        group = 16 if kind == "nvfp4" else 32
        if in_f % group or sshape != (out_f, in_f // group):
            raise self._bad(f"{kind.upper()} weight_scale shape {list(sshape)} does not match a {out_f}x{in_f} weight "
                            f"in groups of {group}: expected {[out_f, in_f // group]}", sname)
        scales = self.ckpt.get(sname)
        if kind == "mxfp4":
            return float_grid("e2m1", scales.view(torch.float8_e8m0fnu), group), (out_f, in_f)
        gname = parts["weight_scale_2"]
        if self.ckpt.dtype(gname) != "F32" or self.ckpt.shape(gname) not in ((), (1,)):
            raise self._bad(f"weight_scale_2 is {self.ckpt.dtype(gname)} {list(self.ckpt.shape(gname))}: expected "
                            "one float32 value", gname)
        # NVFP4QTensor's e2m1 table decodes code 8 as +0.0 (qtensor/nvfp4_tensor.py e2m1_values)
        return float_grid("e2m1", scales, group, global_scale=self.ckpt.get(gname), global_scale_op="mul",
                          negative_zero=False), (out_f, in_f)

    def _load(self, prefix: str) -> Grid:
        params, _ = self._params(prefix)
        w = self.ckpt.get(self.modules[prefix]["weight"])
        codes = w.view(torch.uint8) if params.bits == 8 else unpack_fp4(w)
        return Grid(params, codes=codes)

    # -- the ModelSource interface (records: FloatModuleSource) -----------------------------------
    def describe(self) -> dict:
        kinds: dict[str, int] = {}
        for prefix in self.modules:
            kinds[self._kind(prefix)] = kinds.get(self._kind(prefix), 0) + 1
        desc = {"format": self.format_name, "quant_algo": self.algo, "schemes": kinds,
                "quantized_modules": len(self.modules), "shards": len(self.ckpt.shards),
                "exclude_modules": self.quant_config.get("exclude_modules", []), "ignored_files": self.ignored_files,
                "layout": "FP8: e4m3 weights times a float32 weight_scale (per tensor or per row); NVFP4: e2m1 codes "
                          "times e4m3 weight_scale per 16 times the float32 weight_scale_2 (a multiplier); MXFP4: "
                          "e2m1 codes times E8M0 exponents per 32"}
        return self.describe_runtime(desc)


def open_modelopt(path: Path, **_: object) -> ModelOptSource:
    return ModelOptSource(path)

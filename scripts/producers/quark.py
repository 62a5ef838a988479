"""Remake tests/producer_fixtures/quark/: AMD Quark OCP MX checkpoints made by the real producer, offline on CPU.

    /work/venvs/<yours>/bin/python scripts/producers/quark.py      # a python with amd-quark 0.13 importable

amd-quark 0.13 (PyPI) runs on the CPU: `ModelQuantizer(QConfig(global_quant_config=QLayerConfig(weight=
OCP_MXFP4Spec(ch_axis=-1, is_dynamic=False).to_quantization_spec()), exclude=["lm_head"])).quantize_model(model)`
(weight-only MX needs no calibration data), then `export_safetensors(model, out)` (custom_mode "quark",
real_quantized, pack_method "reorder"), which writes config.json quantization_config {quant_method "quark",
global_quant_config.weight {dtype "fp4", qscheme "per_group", group_size 32, scale_format "e8m0", ...}, exclude,
layer_quant_config, layer_type_quant_config, version "0.13"} and per linear `weight` U8 [out, in/2] and
`weight_scale` U8 [out, in/32]. It needs scipy, onnx and onnxslim importable beside it (quark.torch imports them);
the tests only read the committed files.

OCP MXFP8 (OCP_MXFP8E4M3Spec) is not made: amd-quark 0.13's real_quantized export raises "Unsupported QuantSchema:
per_group for quant_dtype: fp8_e4m3" (hw_emulation real_quantize_fp8_e4m3), on CPU as anywhere, so Quark
publishes MXFP8 only as fake-quantized (dense) weights, which are read as a dense checkpoint.

Per case <name>/: the checkpoint as Quark exported it, and oracle.json: Quark's own dequantization of every quantized
linear, twice: `QuantLinear.get_quant_weight` of the quantized model before export (its fake-quantized weight) and
the real quantizer of each QParamsLinear that Quark's `import_model_from_safetensors` rebuilds from the
exported files (its dequantization of the stored codes), in float32, as dtype,
shape and sha256. versions.json records the packages.

The base model is tests/support/fixtures.py's tiny Llama (seed 1234, hidden 128, ffn 256, untied lm_head) cut to one
decoder layer, in bfloat16.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

_common.leave_import_path()
OUT = _common.PRODUCER_FIXTURES / "quark"
PACKAGES = ("amd-quark", "transformers", "torch")
CASES = ("mxfp4",)


def build_base(out: Path) -> Path:
    return _common.tiny_llama_first_layer(out, seed=1234, tie=False)


def _quant_weights(model) -> dict:
    import torch

    found = {}
    for name, module in model.named_modules():
        with torch.no_grad():
            if type(module).__name__ == "QuantLinear":  # quantized in memory: its fake-quantized weight
                found[f"{name}.weight"] = module.get_quant_weight(module.weight).to(torch.float32)
            elif type(module).__name__ == "QParamsLinear":  # imported: its real quantizer dequantizes the codes
                found[f"{name}.weight"] = module.weight_quantizer(module.weight).to(torch.float32)
    return found


_BEFORE_EXPORT: dict = {}


def produce(name: str, base: Path, out: Path) -> None:
    import torch
    from quark.torch import ModelQuantizer, export_safetensors
    from quark.torch.quantization.config.config import OCP_MXFP4Spec, QConfig, QLayerConfig
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    spec = OCP_MXFP4Spec(ch_axis=-1, is_dynamic=False).to_quantization_spec()
    config = QConfig(global_quant_config=QLayerConfig(weight=spec), exclude=["lm_head"])
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.bfloat16)
    model = ModelQuantizer(config).quantize_model(model, None)
    _BEFORE_EXPORT[name] = {n: _common.tensor_digest(w) for n, w in _quant_weights(model).items()}
    if out.exists():
        shutil.rmtree(out)
    with torch.no_grad():
        export_safetensors(model, out)
    _common.copy_side_files(base, out)


def oracle(ckpt: Path) -> dict:
    """Quark's own dequantization, before export and of the model its importer rebuilds from the files."""
    from quark.torch.export.api import import_model_from_safetensors

    model = import_model_from_safetensors(None, str(ckpt), device="cpu")
    return {"weights": {n: _common.tensor_digest(w) for n, w in _quant_weights(model).items()},
            "weights_before_export": _BEFORE_EXPORT[ckpt.name]}


def main(argv: list[str]) -> int:
    _common.offline_defaults()
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", choices=list(CASES))
    names = ap.parse_args(argv).only or list(CASES)
    _common.make_cases(OUT, names, "quark_producer_", build_base, produce, oracle, PACKAGES)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

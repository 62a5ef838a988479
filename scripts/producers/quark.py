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

OCP MXFP8 (OCP_MXFP8E4M3Spec, case "mxfp8") cannot be exported by amd-quark 0.13: its real_quantized export raises
"Unsupported QuantSchema: per_group for quant_dtype: fp8_e4m3" (hw_emulation real_quantize_fp8_e4m3; checked again
2026-12-04, on CPU; the same function serves every device). So that case is Quark's quantization and Quark's config
with the files built from the format's documented layout (what vLLM's quark OCP_MX scheme loads and AMD's MXFP8
exports carry): per linear `weight` U8 [out, in], one E4M3 code a byte, and `weight_scale` U8 [out, in/32], E8M0
exponents; config.json's quantization_config is Quark's own QConfig.to_dict() plus the exporter's "export" block,
as export_safetensors writes it for MXFP4. The codes and exponents are computed with Quark's own pieces
(quantization/utils.even_round of each 32-block's amax, the scale its fake_quantize_mx uses; the E4M3 cast of the
clamped quotient), and the script asserts that code value times 2**(e - 127) equals Quark's fake-quantized weight
(QuantLinear.get_quant_weight) bit for bit before writing: that weight is the oracle ("weights_before_export"); there
is no importer oracle, since Quark's importer reads only what its exporter writes.

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
CASES = ("mxfp4", "mxfp8")


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
    from quark.torch.quantization.config.config import OCP_MXFP4Spec, OCP_MXFP8E4M3Spec, QConfig, QLayerConfig
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    spec_cls = OCP_MXFP4Spec if name == "mxfp4" else OCP_MXFP8E4M3Spec
    spec = spec_cls(ch_axis=-1, is_dynamic=False).to_quantization_spec()
    config = QConfig(global_quant_config=QLayerConfig(weight=spec), exclude=["lm_head"])
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.bfloat16)
    model = ModelQuantizer(config).quantize_model(model, None)
    weights = _quant_weights(model)
    _BEFORE_EXPORT[name] = {n: _common.tensor_digest(w) for n, w in weights.items()}
    if out.exists():
        shutil.rmtree(out)
    if name == "mxfp8":
        _write_mxfp8(model, config, weights, base, out)
        return
    with torch.no_grad():
        export_safetensors(model, out)
    _common.copy_side_files(base, out)


def _mxfp8_module(w, want):
    """One linear's E4M3 codes (uint8 [out, in]) and E8M0 exponents (uint8 [out, in/32]) from Quark's own scale
    rule (fake_quantize_mx: even_round of each block's amax in the weight's dtype, a zero scale made float32 eps),
    checked against Quark's fake-quantized weight `want` (float32) bit for bit."""
    import torch
    from quark.torch.quantization.utils import even_round

    out_f, in_f = w.shape
    blocks = w.detach().reshape(out_f, in_f // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = even_round(amax, "fp8_e4m3")
    scale = scale.masked_fill(scale == 0.0, torch.finfo(torch.float32).eps)
    codes = (blocks.to(torch.float32) / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    m, e = torch.frexp(scale.squeeze(-1))
    assert bool((m == 0.5).all()), "a Quark MX scale that is not a power of two"
    e8m0 = (e.to(torch.int32) - 1 + 127).to(torch.uint8)
    values = (codes.to(torch.float32) * scale).reshape(out_f, in_f)
    assert torch.equal(values.view(torch.int32), want.view(torch.int32)), "the built file is not Quark's weight"
    return codes.reshape(out_f, in_f).view(torch.uint8), e8m0


def _write_mxfp8(model, config, weights: dict, base: Path, out: Path) -> None:
    """The MXFP8 checkpoint in the documented layout (module docstring): every non-linear tensor as the model
    holds it (bfloat16), each quantized linear as `weight` (E4M3 codes) and `weight_scale` (E8M0 exponents)."""
    import dataclasses

    import torch
    from quark.torch.export.config.config import JsonExporterConfig
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    tensors = {}
    for name, tensor in model.state_dict().items():
        prefix = name[: -len(".weight")]
        if name in weights:
            tensors[name], tensors[f"{prefix}.weight_scale"] = _mxfp8_module(tensor, weights[name])
        elif "_quantizer." not in name:  # the quantizers' own buffers are not part of an exported checkpoint
            tensors[name] = tensor.detach().contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    qc = config.to_dict()
    qc["export"] = dataclasses.asdict(JsonExporterConfig())
    cfg["quantization_config"] = qc
    _common.write_json(out / "config.json", cfg)
    _common.copy_side_files(base, out)


def oracle(ckpt: Path) -> dict:
    """Quark's own dequantization, before export and of the model its importer rebuilds from the files (MXFP8:
    before export only, see the module docstring)."""
    from quark.torch.export.api import import_model_from_safetensors

    if ckpt.name == "mxfp8":
        return {"weights_before_export": _BEFORE_EXPORT[ckpt.name],
                "built": "amd-quark 0.13 cannot export MXFP8 (real_quantize_fp8_e4m3: per_group unsupported); files "
                         "built from the documented layout, equal to Quark's fake-quantized weights bit for bit"}

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

"""Remake tests/producer_fixtures/torchao/: torchao safetensors checkpoints made by the real producer, offline on CPU.

    python scripts/producers/torchao.py [--only intx4_g32_sym ...]     # runs in the shared .venv

torchao 0.18 through transformers 5.24: `AutoModelForCausalLM.from_pretrained(base, quantization_config=
TorchAoConfig(<torchao config>))`, then `save_pretrained` (safetensors), which flattens every quantized weight
with torchao.prototype.safetensors (`<module>._weight_qdata`, `_weight_scale`, `_weight_zero_point`, with a JSON
`_type` / `_data` entry per weight in the safetensors header metadata and `tensor_names`), as pytorch's own Qwen3
INT4 / FP8 releases are published.

Cases (each runs on the CPU):
- intx4_g32_sym: IntxWeightOnlyConfig(int4, PerGroup(32), symmetric) -> IntxUnpackedToInt8Tensor;
- intx4_g32_asym: the same, asymmetric (integer zero points);
- int8_weight_only: Int8WeightOnlyConfig() -> Int8Tensor (one float32 scale per row);
- float8_weight_only: Float8WeightOnlyConfig() -> Float8Tensor (E4M3, one float32 scale per row).
Int4WeightOnlyConfig cannot be made here: its "plain" packing (Int4Tensor) needs mslk's quantizer and its
"tile_packed_to_4d" one (pytorch's Qwen3-8B-INT4) needs CUDA (tinygemm's packing op); torchao has no CPU
dequantization for either.

Per case <name>/: the checkpoint as transformers saved it, and oracle.json: torchao's own dequantization of every
quantized linear (the loaded tensor subclass's `dequantize()`, in the model dtype, and torchao's
dequantize_affine / _dequantize_affine_float8 with output_dtype float32), as dtype, shape and sha256.

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
OUT = _common.PRODUCER_FIXTURES / "torchao"
PACKAGES = ("torchao", "transformers", "torch", "safetensors")
CASES = ("intx4_g32_sym", "intx4_g32_asym", "int8_weight_only", "float8_weight_only")


def build_base(out: Path) -> Path:
    return _common.tiny_llama_first_layer(out, seed=1234, tie=False)


def _config(name: str):
    import torch
    from torchao.quantization import (Float8WeightOnlyConfig, Int8WeightOnlyConfig, IntxWeightOnlyConfig,
                                      MappingType)
    from torchao.quantization.granularity import PerGroup

    if name.startswith("intx4_g32"):
        mapping = MappingType.SYMMETRIC if name.endswith("_sym") else MappingType.ASYMMETRIC
        return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32), mapping_type=mapping)
    if name == "int8_weight_only":
        return Int8WeightOnlyConfig()
    return Float8WeightOnlyConfig()


def produce(name: str, base: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, TorchAoConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.bfloat16,
                                                 quantization_config=TorchAoConfig(_config(name)))
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(str(out), safe_serialization=True)
    _common.copy_side_files(base, out)


def oracle(ckpt: Path) -> dict:
    """torchao's own dequantization of every quantized weight, loaded back through transformers."""
    import torch
    from transformers import AutoModelForCausalLM
    from torchao.quantization.quant_primitives import _dequantize_affine_float8, dequantize_affine

    model = AutoModelForCausalLM.from_pretrained(str(ckpt))
    found, found32 = {}, {}
    for name, p in model.named_parameters():
        if type(p).__name__ == "Parameter" and type(p.data).__name__ == "Tensor":
            continue
        w = p.data if type(p).__name__ == "Parameter" else p
        found[name] = _common.tensor_digest(w.dequantize())
        if type(w).__name__ == "Float8Tensor":
            w32 = _dequantize_affine_float8(w.qdata, w.scale, torch.float32)
        else:
            w32 = dequantize_affine(w.qdata, w.block_size, w.scale, w.zero_point, torch.int8,
                                    output_dtype=torch.float32)
        found32[name] = _common.tensor_digest(w32)
    return {"weights": found, "weights_float32": found32}


def main(argv: list[str]) -> int:
    _common.offline_defaults()
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", choices=list(CASES))
    names = ap.parse_args(argv).only or list(CASES)
    _common.make_cases(OUT, names, "torchao_producer_", build_base, produce, oracle, PACKAGES)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

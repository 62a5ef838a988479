"""Remake tests/producer_fixtures/modelopt/: NVIDIA ModelOpt checkpoints made by the real producer, offline on CPU.

    python scripts/producers/modelopt.py [--only nvfp4 ...]      # creates .venvs/modelopt if needed

nvidia-modelopt 0.47 pins its own transformers (5.14), so it runs in its own venv (.venvs/modelopt, gitignored);
this script re-executes itself there. ModelOpt quantizes with `mtq.quantize(model, CFG, forward_loop)` (fake
quantization in torch, which runs on the CPU) and writes the Hugging Face checkpoint with
`modelopt.torch.export.export_hf_checkpoint` (hf_quant_config.json, quantization_config quant_method "modelopt").

Per case <name>/: the checkpoint as ModelOpt exported it, and oracle.json: ModelOpt's own dequantization of every
quantized linear, computed from the saved tensors with its qtensor classes (NVFP4QTensor.dequantize: the fp8
block scale times weight_scale_2 in float32, times the e2m1 value; FP8QTensor.dequantize: the fp8 value times
weight_scale), in float32, as dtype, shape and sha256 of the bytes. versions.json records the packages.

The base model is tests/support/fixtures.py's tiny Llama (seed 1234, hidden 128, ffn 256, untied lm_head) cut to one
decoder layer; calibration is 4 seeded random prompts of 32 tokens.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

# _common.py, beside this file, holds the scaffolding the producers share: this folder is on sys.path for that
# one import only, since this file is named like the package it drives
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

_common.leave_import_path()
VENV = _common.REPO / ".venvs" / "modelopt"
OUT = _common.PRODUCER_FIXTURES / "modelopt"
PINS = ("torch==2.13.0", "nvidia-modelopt[hf]==0.47.0")
PACKAGES = ("nvidia-modelopt", "transformers", "torch")  # their versions go into versions.json
# case -> ModelOpt's preset config name
CASES = {"nvfp4": "NVFP4_DEFAULT_CFG", "fp8": "FP8_DEFAULT_CFG", "mxfp4": "MXFP4_DEFAULT_CFG"}


def ensure_venv() -> Path:
    return _common.ensure_venv(VENV, PINS[0], list(PINS[1:]), constrain_torch=True)


def build_base(out: Path) -> Path:
    """tests/support/fixtures.py's tiny Llama (untied lm_head), decoder layer 1 removed, in bfloat16."""
    return _common.tiny_llama_first_layer(out, seed=1234, tie=False)


def produce(name: str, base: Path, out: Path) -> None:
    import torch
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(2024)
    calib = [torch.randint(2, 512, (1, 32), generator=gen) for _ in range(4)]

    def forward_loop(m):
        for ids in calib:
            m(ids)

    mtq.quantize(model, getattr(mtq, CASES[name]), forward_loop=forward_loop)
    if out.exists():
        shutil.rmtree(out)
    export_hf_checkpoint(model, export_dir=str(out))
    _common.copy_side_files(base, out)


def oracle(ckpt: Path) -> dict:
    """ModelOpt's own dequantization (its qtensor classes) of every quantized linear, from the saved tensors."""
    import torch
    from safetensors.torch import load_file
    from modelopt.torch.quantization.qtensor import FP8QTensor, MXFP4QTensor, NVFP4QTensor

    t = load_file(str(ckpt / "model.safetensors"))
    found = {}
    for key in sorted(t):
        if not key.endswith(".weight") or f"{key}_scale" not in t:
            continue
        w, scale = t[key], t[f"{key}_scale"]
        if w.dtype == torch.uint8 and scale.dtype == torch.float8_e4m3fn:  # NVFP4
            shape = torch.Size((w.shape[0], w.shape[1] * 2))
            deq = NVFP4QTensor(shape, torch.float32, w).dequantize(
                torch.float32, scale=scale, double_scale=t[f"{key}_scale_2"], block_sizes={-1: 16})
        elif w.dtype == torch.uint8:  # MXFP4: E8M0 exponents per 32
            shape = torch.Size((w.shape[0], w.shape[1] * 2))
            deq = MXFP4QTensor(shape, torch.float32, w).dequantize(torch.float32, scale=scale,
                                                                  block_sizes={-1: 32})
        else:  # FP8
            deq = FP8QTensor(w.shape, torch.float32, w).dequantize(torch.float32, scale=scale)
        found[key] = _common.tensor_digest(deq)
    return {"weights": found}


def main(argv: list[str]) -> int:
    if not _common.in_venv(VENV):
        return _common.rerun(ensure_venv(), __file__, argv)
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", choices=list(CASES))
    names = ap.parse_args(argv).only or list(CASES)
    _common.make_cases(OUT, names, "modelopt_producer_", build_base, produce, oracle, PACKAGES)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

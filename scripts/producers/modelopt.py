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

The base model is tests/fixtures.py's tiny Llama (seed 1234, hidden 128, ffn 256, untied lm_head) cut to one
decoder layer; calibration is 4 seeded random prompts of 32 tokens.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# this file is named like the package it drives: its folder leaves the import path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venvs" / "modelopt"
OUT = REPO / "tests" / "producer_fixtures" / "modelopt"
PINS = ("torch==2.13.0", "nvidia-modelopt[hf]==0.47.0")
# case -> ModelOpt's preset config name
CASES = {"nvfp4": "NVFP4_DEFAULT_CFG", "fp8": "FP8_DEFAULT_CFG", "mxfp4": "MXFP4_DEFAULT_CFG"}


def _in_venv() -> bool:
    return Path(sys.prefix).resolve() == VENV.resolve()


def ensure_venv() -> Path:
    py = VENV / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", PINS[0]], check=True)  # the CPU build first
        pin = VENV / "torch-pin.txt"
        pin.write_text(PINS[0] + "\n")
        subprocess.run([str(py), "-m", "pip", "install", "-q", "-c", str(pin), *PINS[1:]], check=True)
    return py


def build_base(out: Path) -> Path:
    """tests/fixtures.py's tiny Llama (untied lm_head), decoder layer 1 removed, in bfloat16."""
    from safetensors.torch import load_file, save_file

    spec = importlib.util.spec_from_file_location("qconvert_test_fixtures", REPO / "tests" / "support" / "fixtures.py")
    fx = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fx)
    fx.build_tiny_llama(out, seed=1234, tie=False)
    tensors = {k: v for k, v in load_file(str(out / "model.safetensors")).items() if ".layers.1." not in k}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


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
    for side in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (base / side).exists():
            shutil.copy2(base / side, out / side)


def _sha(w) -> dict:
    w = w.detach().contiguous().cpu()
    raw = w.view(__import__("torch").uint8) if w.element_size() > 1 else w
    return {"dtype": str(w.dtype)[6:], "shape": list(w.shape), "sha256": hashlib.sha256(raw.numpy().tobytes()).hexdigest()}


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
        found[key] = _sha(deq)
    return {"weights": found}


def versions() -> dict:
    import importlib.metadata as md

    return {p: md.version(p) for p in ("nvidia-modelopt", "transformers", "torch")}


def main(argv: list[str]) -> int:
    if not _in_venv():
        py = ensure_venv()
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        return subprocess.run([str(py), __file__, *argv], env=env).returncode
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", choices=list(CASES))
    names = ap.parse_args(argv).only or list(CASES)
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="modelopt_producer_") as tmp:
        base = build_base(Path(tmp) / "base")
        for name in names:
            case = OUT / name
            produce(name, base, case)
            (case / "oracle.json").write_text(json.dumps(oracle(case), indent=1, sort_keys=True) + "\n")
            print(f"{name}: {sum(p.stat().st_size for p in case.iterdir())} bytes", flush=True)
    (OUT / "versions.json").write_text(json.dumps(versions(), indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

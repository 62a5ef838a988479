"""Remake tests/producer_fixtures/bitsandbytes/ with the real producer: transformers' BitsAndBytesConfig and
bitsandbytes 0.50 on CPU, offline.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/producers/bitsandbytes.py [--only nf4_dq]

bitsandbytes 0.50.2 installs into the main .venv without changing a pin (`pip install --dry-run` showed only
bitsandbytes itself), so this script runs there and the tests also recompute the oracle live.

Per variant (tests/producer_fixtures/bitsandbytes/<variant>/):
- the checkpoint transformers' save_pretrained wrote (config.json with quantization_config, model.safetensors,
  tokenizer files);
- reference.safetensors: bitsandbytes' OWN dequantization of every quantized linear, computed from the
  checkpoint re-loaded from disk by transformers (so from exactly the saved bytes):
  4-bit: bitsandbytes.functional.dequantize_4bit(weight.data, weight.quant_state) (in the quant_state dtype,
  fp16 here); int8: bitsandbytes.functional.int8_vectorwise_dequant(weight.data, weight.SCB) (float32) --
  the function transformers' integrations/bitsandbytes.py dequantize_bnb_weight calls; and `__logits__`
  (float32 [1, T, vocab]) of tests/fixtures.py prompt_ids() through that re-loaded bnb model;
- versions.json: the package versions that made it.

The model is tests/fixtures.py's tiny llama (hidden 128, ffn 256, vocab 512) cut to one decoder layer, with
tied embeddings (no separate lm_head tensor), so that the three variants stay under 2 MB together.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# this file is named like the package it drives: run as a script, its folder is sys.path[0] and
# `import bitsandbytes` would import this file itself
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
OUT_ROOT = REPO / "tests" / "producer_fixtures" / "bitsandbytes"
N_LAYERS = 1
VARIANTS = {
    "nf4_dq": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=False),
    "int8": dict(load_in_8bit=True),
}

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _fixtures():
    spec = importlib.util.spec_from_file_location("qconvert_test_fixtures", REPO / "tests" / "support" / "fixtures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build_base(fx, out: Path) -> Path:
    """tests/fixtures.py build_tiny_llama, tied, with N_LAYERS decoder layers (its config builder, one field
    changed)."""
    original = fx._model_config

    def fewer_layers(arch, tie):
        config, cls = original(arch, tie)
        config.num_hidden_layers = N_LAYERS
        return config, cls

    fx._model_config = fewer_layers
    try:
        return fx.build_tiny_llama(out, seed=1234, tie=True)
    finally:
        fx._model_config = original


def _quiet() -> None:
    """No progress bars on stderr (the format contract test quantizes a sample in-process and reads stderr)."""
    from transformers.utils import logging

    logging.disable_progress_bar()


def quantize(base: Path, out: Path, spec: dict) -> Path:
    """save_pretrained of `base` quantized by transformers + bitsandbytes with BitsAndBytesConfig(**spec):
    also what a test needs to make a bitsandbytes sample of any dense folder."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    _quiet()

    if out.exists():
        shutil.rmtree(out)
    cfg = BitsAndBytesConfig(**spec, bnb_4bit_compute_dtype=torch.float16) if spec.get("load_in_4bit") \
        else BitsAndBytesConfig(**spec)
    model = AutoModelForCausalLM.from_pretrained(str(base), quantization_config=cfg, device_map="cpu",
                                                 dtype=torch.float16)
    model.save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (base / name).exists():
            shutil.copy(base / name, out / name)
    return out


def bnb_reference(ckpt: Path, ref_path: Path, prompt: list[int]) -> Path:
    """bitsandbytes' own dequantized weights and logits of a saved bnb checkpoint, re-loaded by transformers."""
    import bitsandbytes as bnb
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    _quiet()
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), device_map="cpu", dtype=torch.float16)
    model.eval()
    tensors = {}
    with torch.inference_mode():
        for name, mod in model.named_modules():
            if isinstance(mod, bnb.nn.Linear4bit):
                w = bnb.functional.dequantize_4bit(mod.weight.data, mod.weight.quant_state)
            elif isinstance(mod, bnb.nn.Linear8bitLt):
                w = bnb.functional.int8_vectorwise_dequant(mod.weight.data, mod.weight.SCB)
            else:
                continue
            if tuple(w.shape) != (mod.out_features, mod.in_features):
                raise RuntimeError(f"{name}: dequantized {tuple(w.shape)}")
            tensors[f"{name}.weight"] = w.contiguous()
        if not tensors:
            raise RuntimeError(f"no bitsandbytes linears found in {ckpt}")
        ids = torch.tensor([list(prompt)], dtype=torch.long)
        tensors["__logits__"] = model(input_ids=ids).logits.float().contiguous()
    ref_path = Path(ref_path)
    ref_path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(ref_path), metadata={"source": f"bitsandbytes {bnb.__version__}"})
    return ref_path


def versions() -> dict:
    from importlib.metadata import version

    return {p: version(p) for p in ("bitsandbytes", "torch", "transformers", "safetensors")}


def make_variant(fx, base: Path, name: str) -> Path:
    spec = VARIANTS[name]
    out = OUT_ROOT / name
    quantize(base, out, spec)
    bnb_reference(out, out / "reference.safetensors", fx.prompt_ids())
    with open(out / "versions.json", "w") as f:
        json.dump({"producer": "transformers BitsAndBytesConfig + bitsandbytes (CPU)", **versions(),
                   "variant": spec, "prompt_ids": fx.prompt_ids()}, f, indent=1, sort_keys=True)
        f.write("\n")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", choices=sorted(VARIANTS))
    ap.add_argument("--reference", nargs=2, metavar=("CKPT", "OUT"),
                    help="only re-load CKPT with transformers + bitsandbytes and write its oracle to OUT")
    ap.add_argument("--sample", nargs=2, metavar=("DENSE", "OUT"),
                    help="quantize any dense llama DENSE into OUT as nf4 with double quant (the format contract's sample)")
    args = ap.parse_args(argv)
    if args.sample:
        quantize(Path(args.sample[0]), Path(args.sample[1]), VARIANTS["nf4_dq"])
        return 0
    fx = _fixtures()
    if args.reference:
        bnb_reference(Path(args.reference[0]), Path(args.reference[1]), fx.prompt_ids())
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        base = build_base(fx, Path(tmp) / "base")
        for name in args.only or sorted(VARIANTS):
            print("made", make_variant(fx, base, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())

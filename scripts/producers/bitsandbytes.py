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
  (float32 [1, T, vocab]) of tests/support/fixtures.py prompt_ids() through that re-loaded bnb model;
- versions.json: the package versions that made it.

The model is tests/support/fixtures.py's tiny llama (hidden 128, ffn 256, vocab 512) cut to one decoder layer, with
tied embeddings (no separate lm_head tensor), so that the three variants stay under 2 MB together.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

# _common.py, beside this file, holds the scaffolding the producers share: this folder is on sys.path for that
# one import only, since this file is named like the package it drives (see _common.leave_import_path)
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

_common.leave_import_path()
OUT_ROOT = _common.PRODUCER_FIXTURES / "bitsandbytes"
N_LAYERS = 1
VARIANTS = {
    "nf4_dq": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=False),
    "int8": dict(load_in_8bit=True),
    # saved after one forward pass on a CPU with AVX-512 BF16: bitsandbytes 0.50 Linear4bit.forward repacks the
    # weight into its CPU layout (functional._convert_weight_packed_for_cpu: absmax un-nested, transposed to
    # [in/blocksize, out] and rounded to bfloat16), and save_pretrained's state_dict undoes it
    # (_convert_weight_packed_for_cpu_inverse). With double quant the absmax is quantized again in the model
    # dtype: `nested_dtype` float16 / bfloat16 (read as bitsandbytes reads it). Without it the absmax is left
    # bfloat16 [in/blocksize, out], in the wrong block order: the defect the reader refuses (see its docstring).
    "nf4_dq_f16_cpu_forward": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   model_dtype="float16", cpu_forward=True),
    "nf4_dq_bf16_cpu_forward": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                    model_dtype="bfloat16", cpu_forward=True),
    "fp4_dq_bf16_cpu_forward": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=True,
                                    model_dtype="bfloat16", cpu_forward=True),
    "nf4_cpu_forward_transposed_absmax": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                              bnb_4bit_use_double_quant=False, model_dtype="float16",
                                              cpu_forward=True),
}
# the keys of a variant that are this script's, not BitsAndBytesConfig's
_SCRIPT_KEYS = ("model_dtype", "cpu_forward")
PACKAGES = ("bitsandbytes", "torch", "transformers", "safetensors")  # their versions go into versions.json

_common.offline_defaults()


def build_base(fx, out: Path) -> Path:
    """tests/support/fixtures.py build_tiny_llama, tied, with N_LAYERS decoder layers (its config builder, one field
    changed)."""
    return _common.tiny_llama_with_layers(fx, out, N_LAYERS, seed=1234, tie=True)


def _quiet() -> None:
    """No progress bars on stderr (the format contract test quantizes a sample in-process and reads stderr)."""
    from transformers.utils import logging

    logging.disable_progress_bar()


def quantize(base: Path, out: Path, spec: dict, prompt: list[int] | None = None) -> Path:
    """save_pretrained of `base` quantized by transformers + bitsandbytes with BitsAndBytesConfig(**spec) (less
    the script's own keys: model_dtype, default float16, and cpu_forward: run `prompt` through the model first):
    also what a test needs to make a bitsandbytes sample of any dense folder."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    _quiet()

    if out.exists():
        shutil.rmtree(out)
    dtype = getattr(torch, spec.get("model_dtype", "float16"))
    bnb_spec = {k: v for k, v in spec.items() if k not in _SCRIPT_KEYS}
    cfg = BitsAndBytesConfig(**bnb_spec, bnb_4bit_compute_dtype=dtype) if spec.get("load_in_4bit") \
        else BitsAndBytesConfig(**bnb_spec)
    model = AutoModelForCausalLM.from_pretrained(str(base), quantization_config=cfg, device_map="cpu", dtype=dtype)
    if spec.get("cpu_forward"):
        model.eval()
        with torch.inference_mode():
            model(input_ids=torch.tensor([list(prompt)], dtype=torch.long))
        linear = model.model.layers[0].mlp.down_proj
        if not getattr(linear.weight.quant_state, "packing_format_for_cpu", False):
            raise RuntimeError("bitsandbytes did not repack for the CPU (no AVX-512 BF16 here?): this variant "
                               "needs a CPU whose Linear4bit.forward repacks")
    model.save_pretrained(str(out))
    # the tokenizer files only: generation_config.json stays as save_pretrained wrote it
    _common.copy_side_files(base, out, ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"))
    return out


def bnb_reference(ckpt: Path, ref_path: Path, prompt: list[int], dtype: str = "float16") -> Path:
    """bitsandbytes' own dequantized weights and logits of a saved bnb checkpoint, re-loaded by transformers."""
    import bitsandbytes as bnb
    import torch
    from transformers import AutoModelForCausalLM

    _quiet()
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), device_map="cpu", dtype=getattr(torch, dtype))
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
    return _common.save_reference(tensors, model, prompt, ref_path, f"bitsandbytes {bnb.__version__}")


def make_variant(fx, base: Path, name: str) -> Path:
    spec = VARIANTS[name]
    out = OUT_ROOT / name
    quantize(base, out, spec, fx.prompt_ids())
    bnb_reference(out, out / "reference.safetensors", fx.prompt_ids(), spec.get("model_dtype", "float16"))
    _common.write_versions(out, "transformers BitsAndBytesConfig + bitsandbytes (CPU)", PACKAGES, variant=spec,
                           prompt_ids=fx.prompt_ids())
    return out


def main(argv=None) -> int:
    ap = _common.variant_parser(__doc__, VARIANTS,
                                "only re-load CKPT with transformers + bitsandbytes and write its oracle to OUT")
    ap.add_argument("--sample", nargs=2, metavar=("DENSE", "OUT"),
                    help="quantize any dense llama DENSE into OUT as nf4 with double quant (the format contract's sample)")
    args = ap.parse_args(argv)
    if args.sample:
        quantize(Path(args.sample[0]), Path(args.sample[1]), VARIANTS["nf4_dq"])
        return 0
    fx = _common.fixtures()
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

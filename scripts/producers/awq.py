"""Remake tests/producer_fixtures/awq/ with the real producer: gptqmodel's AWQ on CPU, offline.

    GPTQMODEL_CPU_WORKERS=2 HF_HUB_OFFLINE=1 .venv/bin/python scripts/producers/awq.py [--only gemm_g32]

Per variant (tests/producer_fixtures/awq/<variant>/):
- the checkpoint gptqmodel saved (config.json with quantization_config, model.safetensors, tokenizer files);
- reference.safetensors: gptqmodel's OWN dequantized weight of every AWQ linear (fp16 [out, in], from the
  loader's torch kernel: gptqmodel 7.6 quantization/awq/utils/packing_utils.py dequantize_gemm, the function
  AwqTorchLinear.forward multiplies by; checked here against forward(I)) and `__logits__` (float32
  [1, T, vocab]) of tests/support/fixtures.py prompt_ids() through gptqmodel's AWQ model;
- versions.json: the package versions that made it.

The model is tests/support/fixtures.py's tiny llama cut to one decoder layer (hidden 128, ffn 256, vocab 512), so
that the committed variants (4-bit group 32 and 128, 3-bit group 128; zero_point true, GEMM) stay small.

`--make NAME OUT` makes one variant into OUT (the tests make TEST_VARIANTS so, into a temporary folder).
`--quantize BASE OUT [--group-size G] [--bits B]` quantizes another fp16 checkpoint the same way (a sample for the format
contract test). `--reference CKPT OUT` only loads CKPT with gptqmodel and writes OUT as above: the tests run it in a child
process to recompute the oracle live (gptqmodel patches transformers in the process that loads it).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

# _common.py, beside this file, holds the scaffolding the producers share: this folder is on sys.path for that
# one import only, since the sibling scripts are named after packages (see _common.leave_import_path)
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

_common.leave_import_path()
OUT_ROOT = _common.PRODUCER_FIXTURES / "awq"
N_LAYERS = 1
# gptqmodel 7.6 AWQ_EXPORT_FORMATS: gemm, gemv, gemv_fast, marlin, bitblas, llm-awq. Only GEMM packs on a CPU
# machine: its GEMV/GEMV_FAST QuantLinears list CUDA/ROCm devices only (nn_modules/qlinear/gemv_awq.py).
VARIANTS = {
    "gemm_g32": dict(group_size=32, fmt="gemm"),
    "gemm_g128": dict(group_size=128, fmt="gemm"),
    # gptqmodel 7.6 packs widths other than 4 as a plain LSB-first bit stream along the outputs
    # (packing_utils.pack_awq -> _pack_contiguous; 3 bits: codes cross word boundaries)
    "gemm_3bit_g128": dict(group_size=128, fmt="gemm", bits=3),
}
# made by the tests into a temporary folder (`--make NAME OUT`, ~35 s here), not committed: 8-bit symmetric
# groups of 32 (zero points all 128, AWQProcessor.pseudo_quantize_tensor), what GGUF Q8_0 holds
TEST_VARIANTS = {
    "gemm_8bit_g32_sym": dict(group_size=32, fmt="gemm", bits=8, sym=True),
}

PACKAGES = ("gptqmodel", "torch", "transformers", "safetensors")  # their versions go into versions.json

_common.offline_defaults(GPTQMODEL_CPU_WORKERS="2")


def build_base(fx, out: Path) -> Path:
    """tests/support/fixtures.py build_tiny_llama with N_LAYERS decoder layers (its config builder, one field changed)."""
    return _common.tiny_llama_with_layers(fx, out, N_LAYERS, seed=1234)


def quantize_awq(fx, base: Path, out: Path, group_size: int, fmt: str, bits: int = 4, sym: bool = False) -> Path:
    import torch
    from gptqmodel import BACKEND, GPTQModel
    from gptqmodel.quantization import AWQConfig

    if out.exists():
        shutil.rmtree(out)
    # sym=False is AWQ's zero_point true (AWQConfig._update_output_payload: zero_point = not sym);
    # sym=True stores zero points 2**(bits-1) (looper/awq_processor.py pseudo_quantize_tensor);
    # offload_to_disk=False keeps a random temp path out of config.json (see tests/support/fixtures.py)
    qcfg = AWQConfig(bits=bits, group_size=group_size, sym=sym, format=fmt, offload_to_disk=False)
    fx._seed_all()
    model = GPTQModel.load(str(base), qcfg, device="cpu", dtype=torch.float16)
    # gptqmodel 7.6 models/base.py quantize(): with BACKEND.AUTO a GEMM export packs with AWQ_GEMM, which
    # wants CUDA; AwqTorchLinear (nn_modules/qlinear/torch_awq.py) packs the same GEMM layout (pack_awq) on CPU
    model.quantize(fx.calibration_data(), batch_size=1, backend=BACKEND.AWQ_TORCH)
    model.save(str(out))
    del model
    fx._clean_checkpoint(out)
    return out


def gptqmodel_reference(ckpt: Path, ref_path: Path, prompt: list[int]) -> Path:
    """gptqmodel's own dequantized weights and logits of an AWQ checkpoint (CPU torch kernel, fp16)."""
    import torch
    from gptqmodel import BACKEND, GPTQModel
    from gptqmodel.nn_modules.qlinear import AWQuantLinear
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm
    from gptqmodel.version import __version__ as gptqmodel_version

    m = GPTQModel.load(str(ckpt), backend=BACKEND.AWQ_TORCH, device="cpu", dtype=torch.float16)
    hf = m.model
    hf.eval()
    tensors = {}
    with torch.inference_mode():
        for name, mod in hf.named_modules():
            if not isinstance(mod, AWQuantLinear):
                continue
            w = dequantize_gemm(mod.qweight, mod.qzeros, mod.scales, mod.bits, mod.group_size)  # [in, out]
            if w.dtype != torch.float16 or tuple(w.shape) != (mod.in_features, mod.out_features):
                raise RuntimeError(f"{name}: dequantized {w.dtype} {tuple(w.shape)}")
            # the forward path multiplies by exactly this matrix: x = I gives it back (one term per sum)
            eye = torch.eye(mod.in_features, dtype=torch.float16)
            bias = mod.bias if mod.bias is not None else 0
            if not torch.equal(mod(eye) - bias, w):
                raise RuntimeError(f"{name}: forward(I) differs from dequantize_gemm")
            tensors[f"{name}.weight"] = w.t().contiguous()
    if not tensors:
        raise RuntimeError(f"no AWQ linears found in {ckpt}")
    return _common.save_reference(tensors, hf, prompt, ref_path, f"gptqmodel {gptqmodel_version}")


def make_variant(fx, base: Path, name: str, out: Path | None = None) -> Path:
    spec = {**VARIANTS, **TEST_VARIANTS}[name]
    out = out or OUT_ROOT / name
    quantize_awq(fx, base, out, spec["group_size"], spec["fmt"], spec.get("bits", 4), spec.get("sym", False))
    gptqmodel_reference(out, out / "reference.safetensors", fx.prompt_ids())
    _common.write_versions(out, "gptqmodel AWQ (CPU)", PACKAGES, variant=spec, prompt_ids=fx.prompt_ids())
    return out


def main(argv=None) -> int:
    ap = _common.variant_parser(__doc__, VARIANTS)
    ap.add_argument("--make", nargs=2, metavar=("NAME", "OUT"), help="make one variant (of VARIANTS or "
                    f"TEST_VARIANTS: {', '.join(TEST_VARIANTS)}) into OUT, with its reference and versions.json")
    ap.add_argument("--quantize", nargs=2, metavar=("BASE", "OUT"),
                    help="quantize any fp16 checkpoint BASE into OUT (GEMM, zero_point, --group-size, --bits)")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--bits", type=int, default=4, choices=range(2, 9), help="with --quantize: 2..8")
    args = ap.parse_args(argv)
    fx = _common.fixtures()
    if args.quantize:
        quantize_awq(fx, Path(args.quantize[0]), Path(args.quantize[1]), args.group_size, "gemm", args.bits)
        return 0
    if args.reference:
        gptqmodel_reference(Path(args.reference[0]), Path(args.reference[1]), fx.prompt_ids())
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        base = build_base(fx, Path(tmp) / "base")
        if args.make:
            print("made", make_variant(fx, base, args.make[0], Path(args.make[1])))
            return 0
        for name in args.only or sorted(VARIANTS):
            print("made", make_variant(fx, base, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())

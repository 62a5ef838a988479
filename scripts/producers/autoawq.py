"""Remake tests/producer_fixtures/awq/autoawq_gemv and autoawq_gemm with the real producer: AutoAWQ, on CPU, offline.

    .venv/bin/python scripts/producers/autoawq.py        # creates .venvs/autoawq if needed

AutoAWQ 0.2.9 (the last release; archived) imports transformers' pre-5 model classes, so it runs in its own venv
(.venvs/autoawq, gitignored): torch 2.13 CPU, autoawq with --no-deps (its triton / autoawq-kernels are CUDA-only
and optional: without awq_ext it packs in pure torch), transformers 4.51.3, accelerate, and datasets < 4 /
huggingface-hub < 1 only because awq/utils/calib_data.py imports datasets at module level.

One AWQ search, two packings: quantize(..., export_compatible=True) runs AutoAWQ's scale search and clipping
and leaves the scaled fp16 weights unpacked; the model is then deep-copied and each copy packed by
AutoAWQ's own quantizer (AwqQuantizer.pack -> pseudo_quantize_tensor -> WQLinear_GEMV / WQLinear_GEMM
.from_linear) and saved by save_quantized. Both checkpoints therefore hold the same codes, zeros and scales.

Oracle (reference.safetensors in autoawq_gemv/, which the GEMM twin shares): AutoAWQ's own dequantized fp16
weight [out, in] of every linear, from awq/utils/packing_utils.py dequantize_gemm on the GEMM twin (the torch
path WQLinear_GEMM.forward takes without awq_ext). WQLinear_GEMV has no torch path (its forward needs the CUDA
awq_ext), so its layout's dequantization is the same (q - z) * s of the same codes; the script checks
that AutoAWQ's pseudo-quantized weights (pseudo_quantize_tensor's fp16 w, what from_linear packs) equal the
oracle too, and records in versions.json how many of them do. No logits: AutoAWQ's from_quantized wants CUDA.

The base model is the one scripts/producers/awq.py quantizes (tests/support/fixtures.py tiny llama, one decoder layer,
seed 1234), built in the main venv; calibration is tests/support/fixtures.py calibration_data()'s token ids (a list of
token lists: AutoAWQ's get_calib_dataset takes them as they are, nothing downloads); the base's tokenizer files
are copied into autoawq_gemv (the GEMM twin keeps config.json and the weights only).
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# _common.py, beside this file, holds the scaffolding the producers share: this folder is on sys.path for that
# one import only, since the sibling scripts are named after packages (awq.py would shadow AutoAWQ's `awq`)
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

_common.leave_import_path()
VENV = _common.REPO / ".venvs" / "autoawq"
OUT_ROOT = _common.PRODUCER_FIXTURES / "awq"
PINS = ("torch==2.13.0", "autoawq==0.2.9")
DEPS = ("transformers==4.51.3", "accelerate", "safetensors", "tokenizers", "numpy", "datasets<4", "huggingface-hub<1.0",
        "zstandard")
# group 32: GEMV pads its zeros to a multiple of 4 words and its scales to 8 columns a word (calculate_zeros_width)
GROUP = 32
PACKAGES = ("autoawq", "torch", "transformers", "accelerate", "safetensors")  # their versions go into versions.json
_common.offline_defaults()


def ensure_venv() -> Path:
    return _common.ensure_venv(VENV, PINS[0], ["--no-deps", PINS[1]], list(DEPS))


# -- in the autoawq venv ----------------------------------------------------------------------------------

def _layer_prefixes(model) -> dict[int, str]:
    return {id(m): name for name, m in model.named_modules()}


def quantize_both(base: Path, calib: list[list[int]], gemv_dir: Path, gemm_dir: Path) -> dict:
    import torch
    from awq import AutoAWQForCausalLM
    from awq.quantize.quantizer import AwqQuantizer
    from awq.utils.packing_utils import dequantize_gemm
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = AutoAWQForCausalLM.from_pretrained(str(base), torch_dtype=torch.float16, device_map="cpu")
    quant_config = {"zero_point": True, "q_group_size": GROUP, "w_bit": 4, "version": "GEMM"}
    model.quantize(None, quant_config=quant_config, calib_data=calib, export_compatible=True,
                   max_calib_samples=len(calib), max_calib_seq_len=len(calib[0]), n_parallel_calib_samples=None)

    # the pseudo-quantized fp16 weights AwqQuantizer._apply_quant hands to from_linear, by full module name
    pseudo: dict[str, torch.Tensor] = {}
    original_apply = AwqQuantizer._apply_quant

    def recording_apply(self, module, named_linears):
        prefix = _layer_prefixes(self.model)[id(module)]
        original_pq = self.pseudo_quantize_tensor

        def pq(w, _names=iter(named_linears)):
            out = original_pq(w)
            pseudo[f"{prefix}.{next(_names)}.weight"] = out[0].detach().clone()
            return out
        self.pseudo_quantize_tensor = pq
        try:
            return original_apply(self, module, named_linears)
        finally:
            del self.pseudo_quantize_tensor

    AwqQuantizer._apply_quant = recording_apply
    packed = {}
    try:
        for version, out in (("gemv", gemv_dir), ("gemm", gemm_dir)):
            twin = copy.deepcopy(model)
            twin.quant_config.version = version.upper()
            twin.quantizer.version = version
            pseudo.clear()
            twin.pack()
            if out.exists():
                shutil.rmtree(out)
            twin.save_quantized(str(out))
            packed[version] = (twin, dict(pseudo))
    finally:
        AwqQuantizer._apply_quant = original_apply

    from awq.modules.linear.gemm import WQLinear_GEMM
    gemm_model, gemm_pseudo = packed["gemm"]
    reference = {}
    for name, mod in gemm_model.model.named_modules():
        if isinstance(mod, WQLinear_GEMM):
            w = dequantize_gemm(mod.qweight, mod.qzeros, mod.scales, mod.w_bit, mod.group_size)  # [in, out]
            if w.dtype != torch.float16 or tuple(w.shape) != (mod.in_features, mod.out_features):
                raise RuntimeError(f"{name}: dequantized {w.dtype} {tuple(w.shape)}")
            reference[f"{name}.weight"] = w.t().contiguous()
    gemv_pseudo = packed["gemv"][1]
    if set(reference) != set(gemv_pseudo) or set(reference) != set(gemm_pseudo) or not reference:
        raise RuntimeError(f"modules differ: {sorted(reference)} / {sorted(gemv_pseudo)}")
    for name in reference:  # one search, two packings: the same fp16 weights went into both
        if not torch.equal(gemv_pseudo[name], gemm_pseudo[name]):
            raise RuntimeError(f"{name}: the GEMV and GEMM packings started from different weights")
    pseudo_equal = {name: int((gemv_pseudo[name].half() == reference[name]).sum()) for name in reference}
    save_file(reference, str(gemv_dir / "reference.safetensors"), metadata={"source": "autoawq dequantize_gemm"})
    return {"pseudo_quantized_equal_to_reference": pseudo_equal,
            "weights": {name: reference[name].numel() for name in reference}}


def child_main(base: Path, calib_path: Path, gemv_dir: Path, gemm_dir: Path) -> None:
    calib = json.loads(Path(calib_path).read_text())
    info = quantize_both(base, calib, gemv_dir, gemm_dir)
    for out, role in ((gemv_dir, "GEMV (reference.safetensors: AutoAWQ's dequantize_gemm of the GEMM twin)"),
                      (gemm_dir, "GEMM twin of ../autoawq_gemv (same codes; oracle there)")):
        for junk in _common.SIDE_FILES:
            if out is gemm_dir and (out / junk).exists():
                (out / junk).unlink()  # the twin stays small: the reader needs config.json and the weights
        _common.write_versions(out, "AutoAWQ (CPU, pure-torch packing)", PACKAGES, role=role,
                               quant_config={"zero_point": True, "q_group_size": GROUP, "w_bit": 4},
                               calibration="tests/support/fixtures.py calibration_data() token ids", **info)


# -- in the main venv -------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = _common.parser(__doc__)
    ap.add_argument("--child", nargs=4, metavar=("BASE", "CALIB", "GEMV", "GEMM"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child_main(*map(Path, args.child))
        return 0
    py = ensure_venv()
    fx = _common.fixtures()
    awq_producer = _common.load_by_path("qconvert_awq_producer", _common.HERE / "awq.py")
    with tempfile.TemporaryDirectory() as tmp:
        base = awq_producer.build_base(fx, Path(tmp) / "base")
        calib = Path(tmp) / "calib.json"
        calib.write_text(json.dumps([row["input_ids"] for row in fx.calibration_data()]))
        gemv, gemm = OUT_ROOT / "autoawq_gemv", OUT_ROOT / "autoawq_gemm"
        subprocess.run([str(py), str(Path(__file__).resolve()), "--child", str(base), str(calib), str(gemv),
                        str(gemm)], check=True)
        # quantize() got no tokenizer (token-id calibration), so save_quantized wrote none: the base's files,
        # which llama.cpp's GGUF needs when the tests convert the GEMV checkpoint
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy2(base / name, gemv / name)
        print("made", gemv, gemm)
    return 0


if __name__ == "__main__":
    sys.exit(main())

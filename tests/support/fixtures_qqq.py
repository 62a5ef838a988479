"""Offline fixtures for QQQ and rotated GPTQ: checkpoints made by gptqmodel 7.6.0 on CPU, and references
taken from gptqmodel's own runtime.

Layout under ``root`` (default ``tests/_fixtures/qqq``)::

    root/
      base/                       the tiny fp16 Llama of tests/support/fixtures.py (same seed, built here again so
                                  that this builder never waits on the GPTQ fixtures' lock)
      <variant>/
        ckpt/                     the gptqmodel checkpoint
        reference.safetensors     QQQ: "<module>.w8" = gptqmodel's runtime int8 weights (int8 [out, in]) and
                                  "<module>.s_channel" = the per-channel scale gptqmodel multiplies with
                                  (float32 [out], unpermuted, as held by the loaded module);
                                  GPTQ: "<module>.weight" fp16 [out, in] (the stored, still rotated grid);
                                  "__logits__" float32 [1, T, vocab] from gptqmodel's CPU kernels, fp16 model.
        .done                     marker

Variants: ``qqq_g128`` (QQQ 4-bit group 128), ``qqq_gm1`` (QQQ 4-bit per-channel), ``rot_b4_g128``
(GPTQ v1 4-bit g128 sym with ``rotation: "hadamard"``).

gptqmodel 7.6.0 on a CPU needs two monkeypatches (its QQQ packing and its rotation assume CUDA), both
confined here:
* QQQ packing: ``QQQProcessor._quant_linear_kernel`` picks the CUDA ``QQQLinear``; it is made to return
  ``(QQQTorchLinear, BACKEND.QQQ_TORCH)`` (same ``pack()``), and ``backend="qqq_torch"`` is passed.
* rotation: ``apply_exact_had_to_linear`` calls ``.cuda()``; ``torch.Tensor.cuda`` is an identity while
  quantize() runs and is restored afterwards.

Usage: ``python tests/support/fixtures_qqq.py [--only NAME ...]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, Iterable, Optional

sys.path.insert(0, str(Path(__file__).parent))
import fixtures  # noqa: E402  (sets the gptqmodel environment variables)

DEFAULT_ROOT = fixtures.DEFAULT_ROOT / "qqq"

VARIANTS: Dict[str, dict] = {
    "qqq_g128": dict(kind="qqq", group_size=128),
    "qqq_gm1": dict(kind="qqq", group_size=-1),
    "rot_b4_g128": dict(kind="gptq", fmt="gptq", bits=4, group_size=128, rotation="hadamard"),
}


@contextlib.contextmanager
def qqq_on_cpu():
    """QQQ packing on CPU: the processor's kernel choice -> QQQTorchLinear (the only CPU packer)."""
    from gptqmodel.looper.qqq_processor import QQQProcessor
    from gptqmodel.nn_modules.qlinear.qqq import QQQTorchLinear
    from gptqmodel.utils.backend import BACKEND

    original = QQQProcessor._quant_linear_kernel
    QQQProcessor._quant_linear_kernel = lambda self: (QQQTorchLinear, BACKEND.QQQ_TORCH)
    try:
        yield
    finally:
        QQQProcessor._quant_linear_kernel = original


@contextlib.contextmanager
def cuda_is_identity():
    """Rotation on CPU: `Tensor.cuda()` returns the tensor itself while the block runs."""
    import torch

    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def quantize_qqq(base_dir, out_dir, group_size: int) -> Path:
    import torch
    from gptqmodel import GPTQModel, QuantizeConfig

    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    kw = dict(bits=4, group_size=group_size, sym=True, desc_act=False, method="qqq", format="qqq",
              offload_to_disk=False)
    if group_size == -1:
        kw["act_group_aware"] = False
    qcfg = QuantizeConfig(**kw)
    fixtures._seed_all()
    with qqq_on_cpu():
        model = GPTQModel.load(str(base_dir), qcfg, device="cpu", dtype=torch.float16, backend="qqq_torch")
        model.quantize(fixtures.calibration_data(), batch_size=1, backend="qqq_torch")
        model.save(str(out))
    del model
    fixtures._clean_checkpoint(out)
    return out


def quantize_rotated(base_dir, out_dir, bits: int, group_size: int, rotation: str, fmt: str = "gptq") -> Path:
    import torch
    from gptqmodel import GPTQModel, QuantizeConfig

    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    qcfg = QuantizeConfig(bits=bits, group_size=group_size, sym=True, desc_act=False, format=fmt,
                          rotation=rotation, offload_to_disk=False)
    fixtures._seed_all()
    model = GPTQModel.load(str(base_dir), qcfg, device="cpu", dtype=torch.float16)
    with cuda_is_identity():
        model.quantize(fixtures.calibration_data(), batch_size=1)
    model.save(str(out))
    del model
    fixtures._clean_checkpoint(out)
    return out


def qqq_reference(ckpt_dir, ref_path, prompt_ids: Iterable[int]) -> Path:
    """gptqmodel's QQQ runtime (QQQTorchLinear, fp16 model): per linear the int8 weights and the
    per-channel scale its forward multiplies with, and the logits."""
    import torch
    from gptqmodel import GPTQModel
    from gptqmodel.nn_modules.qlinear.qqq import QQQTorchLinear
    from safetensors.torch import save_file

    m = GPTQModel.load(str(ckpt_dir), backend="qqq_torch", device="cpu", dtype=torch.float16)
    tensors = {}
    with torch.inference_mode():
        for name, mod in m.model.named_modules():
            if isinstance(mod, QQQTorchLinear):
                w8, s_channel = mod._dequantize_weight_for_torch()  # [in, out] float, [1, out] float32
                if not bool((w8 == w8.round()).all()) or float(w8.abs().max()) > 128:
                    raise RuntimeError(f"{name}: runtime weights are not int8")
                tensors[f"{name}.w8"] = w8.t().contiguous().to(torch.int8)
                tensors[f"{name}.s_channel"] = s_channel.reshape(-1).to(torch.float32).contiguous()
        if not tensors:
            raise RuntimeError(f"no QQQ linears in {ckpt_dir}")
        logits = m.model(input_ids=torch.tensor([list(prompt_ids)], dtype=torch.long)).logits
        tensors["__logits__"] = logits.float().contiguous()
    save_file(tensors, str(ref_path), metadata={"source": "gptqmodel qqq_torch"})
    del m
    return Path(ref_path)


def qqq_logits(ckpt_dir, prompt_ids: Iterable[int]):
    """Logits of any QQQ checkpoint under gptqmodel's CPU QQQ kernel (fp16 model), numpy [T, vocab]."""
    import torch
    from gptqmodel import GPTQModel

    m = GPTQModel.load(str(ckpt_dir), backend="qqq_torch", device="cpu", dtype=torch.float16)
    with torch.inference_mode():
        out = m.model(input_ids=torch.tensor([list(prompt_ids)], dtype=torch.long)).logits
    return out[0].float().numpy()


def gptq_logits(ckpt_dir, prompt_ids: Iterable[int]):
    """Logits of a GPTQ checkpoint (rotation honoured) under gptqmodel's torch kernel, numpy [T, vocab]."""
    import torch

    m = fixtures._load_quantized(ckpt_dir)
    with torch.inference_mode():
        out = m.model(input_ids=torch.tensor([list(prompt_ids)], dtype=torch.long)).logits
    return out[0].float().numpy()


def load_qqq_reference(ref_path):
    """-> ({module: (w8 int8 [out, in], s_channel float32 [out])}, logits float32 [1, T, vocab]) as torch."""
    from safetensors.torch import load_file

    t = load_file(str(ref_path))
    logits = t.pop("__logits__")
    mods = {}
    for k in t:
        if k.endswith(".w8"):
            prefix = k[: -len(".w8")]
            mods[prefix] = (t[k], t[f"{prefix}.s_channel"])
    return mods, logits


def ensure_qqq_fixtures(root=DEFAULT_ROOT, names: Optional[Iterable[str]] = None, verbose: bool = False) -> dict:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    names = list(VARIANTS) if names is None else list(names)
    with fixtures._RootLock(root):
        pids = fixtures.prompt_ids()
        base = root / "base"
        if not fixtures._done(base):
            if base.exists():
                shutil.rmtree(base)
            fixtures.build_tiny_llama(base, **fixtures.BASES["base"])
            fixtures._mark_done(base, {"kind": "base", **fixtures.BASES["base"]})
        result = {"root": root, "prompt_ids": pids, "base": base, "variants": {}}
        for name in names:
            spec = dict(VARIANTS[name])
            vdir = root / name
            ckpt, ref = vdir / "ckpt", vdir / "reference.safetensors"
            if not fixtures._done(vdir):
                t0 = time.perf_counter()
                if vdir.exists():
                    shutil.rmtree(vdir)
                vdir.mkdir(parents=True)
                if spec["kind"] == "qqq":
                    quantize_qqq(base, ckpt, spec["group_size"])
                    qqq_reference(ckpt, ref, pids)
                else:
                    quantize_rotated(base, ckpt, spec["bits"], spec["group_size"], spec["rotation"], spec["fmt"])
                    fixtures.gptq_reference(ckpt, ref, pids)
                fixtures._mark_done(vdir, spec)
                if verbose:
                    print(f"built {name} in {time.perf_counter() - t0:.1f}s", flush=True)
            result["variants"][name] = {"dir": vdir, "ckpt": ckpt, "reference": ref, **spec}
        return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Build the QQQ / rotated GPTQ fixtures with gptqmodel")
    ap.add_argument("--root", default=str(DEFAULT_ROOT))
    ap.add_argument("--only", nargs="+")
    args = ap.parse_args(argv)
    res = ensure_qqq_fixtures(args.root, args.only, verbose=True)
    print(json.dumps({k: str(v["ckpt"]) for k, v in res["variants"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

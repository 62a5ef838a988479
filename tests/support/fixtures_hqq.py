"""HQQ test fixtures made by the real producer: hqq 0.2.8.post1 with transformers 4.57.6, on CPU.

This script runs in the separate environment `<repo>/.venvs/hqq` (scripts/test_env.d/20-hqq.sh), never in
the main venv: hqq's transformers path needs transformers 4.57.x. Tests call it through a subprocess.

    python tests/support/fixtures_hqq.py build [--root DIR]             every variant below (cached, .done markers)
    python tests/support/fixtures_hqq.py verify DIR OUT.safetensors [--loader transformers|hqq] [--compute-dtype D]

Layout under ``root`` (default tests/_fixtures/hqq)::

    base_llama/, base_qwen2/         fp16 tiny models (tests/support/fixtures.py build_tiny_llama) + tokenizer
    <variant>/tf/                    transformers save_pretrained: model.safetensors (19-20 keys per layer),
                                     config.json with quantization_config (quant_method "hqq")
    <variant>/lib/                   hqq library save_quantized: qmodel.pt + config.json (no quantization_config)
    <variant>/reference.safetensors  hqq's own HQQLinear.dequantize() per quantized linear ("<module>.weight",
                                     in hqq's compute dtype) and "__logits__" (float32 [T, vocab]) of the
                                     quantized model on the prompt of tests/support/fixtures.py
    legacy_b4_g64_ax0/lib/           the b4_g64_ax0 qmodel.pt rewritten in the hqq <= 0.1.8 layout
                                     {"W_q", "meta": {...}, "bias"}; its reference is what hqq 0.2.8 loads from it

`verify` loads a checkpoint with the real consumer (transformers 4.57.6 `from_pretrained`, which must give
HQQLinear modules, hqq's `AutoHQQHFModel.from_quantized` for qmodel.pt, or hqq's `HQQLinear.load_state_dict`
per layer of a safetensors checkpoint, which keeps an fp16/bf16 compute dtype) and writes the same kind of reference file.

Pitfalls of hqq 0.2.8 and transformers 4.57.6 on a CPU handled here: device "cpu" everywhere; transformers
computes HQQ in float32 whatever dtype is asked, so the transformers variants are float32 and the float16
variant is made by the hqq library; dynamic_config lists every linear tag; save_pretrained before
save_quantized (the latter turns the state dict encoding off, so encoded_state_dict is set back afterwards);
one thread (reproducible).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = Path(__file__).resolve().parent
DEFAULT_ROOT = HERE.parent / "_fixtures" / "hqq"
LINEAR_TAGS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _wq(nbits, group_size, axis, view_as_float=False):
    return dict(nbits=nbits, group_size=group_size, axis=axis, view_as_float=view_as_float)


# name -> how to make it. "producer": transformers (HqqConfig, compute float32) or hqq (quantize_model).
VARIANTS = {
    "b4_g64_ax1": dict(base="base_llama", producer="transformers", quant=_wq(4, 64, 1)),
    "b4_g64_ax0": dict(base="base_llama", producer="transformers", quant=_wq(4, 64, 0)),
    "b3_g64_ax1": dict(base="base_llama", producer="transformers", quant=_wq(3, 64, 1)),
    "b3_g64_ax0": dict(base="base_llama", producer="transformers", quant=_wq(3, 64, 0)),
    "b2_g64_ax1": dict(base="base_llama", producer="transformers", quant=_wq(2, 64, 1)),
    "b1_g64_ax1": dict(base="base_llama", producer="transformers", quant=_wq(1, 64, 1)),
    "b8_g128_ax1_bias": dict(base="base_qwen2", producer="transformers", quant=_wq(8, 128, 1)),
    "b4_g64_ax1_vaf": dict(base="base_llama", producer="transformers", quant=_wq(4, 64, 1, view_as_float=True)),
    "mixed": dict(base="base_llama", producer="transformers", dynamic={
        "self_attn.q_proj": _wq(4, 64, 1), "self_attn.k_proj": _wq(4, 64, 1),
        "self_attn.v_proj": _wq(4, 64, 0), "self_attn.o_proj": _wq(3, 64, 1),
        "mlp.gate_proj": _wq(2, 32, 1), "mlp.up_proj": _wq(3, 64, 0), "mlp.down_proj": _wq(8, 128, 0)}),
    "b4_g64_ax1_fp16": dict(base="base_llama", producer="hqq", compute_dtype="float16", quant=_wq(4, 64, 1)),
    "b4_g64_ax0_bf16": dict(base="base_llama", producer="hqq", compute_dtype="bfloat16", quant=_wq(4, 64, 0)),
}
BASES = {"base_llama": dict(seed=1234, arch="llama"), "base_qwen2": dict(seed=99, arch="qwen2")}


def _main_fixtures():
    spec = importlib.util.spec_from_file_location("qconvert_test_fixtures", HERE / "fixtures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _quant_config(torch, quant: dict):
    from hqq.core.quantize import BaseQuantizeConfig

    return BaseQuantizeConfig(**quant)


def _hqq_linears(model):
    from hqq.core.quantize import HQQLinear

    return {name: m for name, m in model.named_modules() if isinstance(m, HQQLinear)}


def write_reference(model, path: Path, prompt: list[int]) -> None:
    """hqq's own dequantized weights of every HQQLinear and the model's logits on the prompt."""
    import torch
    from safetensors.torch import save_file

    tensors = {}
    with torch.no_grad():
        linears = _hqq_linears(model)
        if not linears:
            raise RuntimeError("no HQQLinear modules in the model: the checkpoint was not loaded as HQQ")
        for name, m in linears.items():
            tensors[f"{name}.weight"] = m.dequantize().contiguous().clone()
        logits = model(torch.tensor([prompt])).logits[0]
        tensors["__logits__"] = logits.float().contiguous()
    save_file(tensors, str(path), metadata={"source": "hqq 0.2.8.post1"})


def _save_both(model, out: Path, torch) -> None:
    from hqq.models.hf.base import AutoHQQHFModel

    model.save_pretrained(str(out / "tf"), safe_serialization=True)
    AutoHQQHFModel.setup_model(model)
    AutoHQQHFModel.save_quantized(model, str(out / "lib"))
    for m in _hqq_linears(model).values():
        m.encoded_state_dict = True  # save_quantized turned the safetensors encoding off (a lasting side effect)
    # the hqq library writes config.json without quantization_config (its model never had one); ours came
    # from transformers, so it is removed to match what the library writes for its own models
    cfg_path = out / "lib" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def build_variant(root: Path, name: str, prompt: list[int]) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, HqqConfig

    spec = VARIANTS[name]
    base = root / spec["base"]
    out = root / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    torch.manual_seed(0)
    if spec["producer"] == "transformers":
        if "dynamic" in spec:
            qc = HqqConfig(dynamic_config=spec["dynamic"])
        else:
            qc = HqqConfig(**spec["quant"])
        model = AutoModelForCausalLM.from_pretrained(str(base), quantization_config=qc, dtype=torch.float32)
    else:
        from hqq.models.hf.base import AutoHQQHFModel

        compute = getattr(torch, spec["compute_dtype"])
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=compute)
        AutoHQQHFModel.quantize_model(model, quant_config=_quant_config(torch, spec["quant"]),
                                      compute_dtype=compute, device="cpu")
        # transformers needs the quantization_config to save and reload an HQQ model (set by hand, as the
        # hqq library does not write one)
        model.config.quantization_config = HqqConfig(**spec["quant"])
        model.is_quantized = True
        model.hf_quantizer = None
    model.eval()
    _save_both(model, out, torch)
    for sub in ("tf", "lib"):
        AutoTokenizer.from_pretrained(str(base)).save_pretrained(str(out / sub))
    write_reference(model, out / "reference.safetensors", prompt)
    (out / ".done").write_text(json.dumps(spec, sort_keys=True) + "\n")
    return out


def build_legacy(root: Path, prompt: list[int]) -> Path:
    """The b4_g64_ax0 qmodel.pt in the pre-0.2 layout {"W_q", "meta": {...}, "bias"}, then loaded by hqq 0.2.8
    (which still reads "meta") for its reference."""
    import torch

    src = root / "b4_g64_ax0" / "lib"
    out = root / "legacy_b4_g64_ax0"
    if out.exists():
        shutil.rmtree(out)
    (out / "lib").mkdir(parents=True)
    weights = torch.load(src / "qmodel.pt", weights_only=True)
    meta_keys = ("nbits", "group_size", "shape", "scale", "zero", "axis", "packing", "compute_dtype",
                 "quant_zero", "quant_scale", "unpack_view_dtype", "view_as_float")
    legacy = {}
    for module, state in weights.items():
        if "W_q" in state:
            entry = {"W_q": state["W_q"], "meta": {k: state[k] for k in meta_keys}}
            if state.get("bias") is not None:
                entry["bias"] = state["bias"]
            legacy[module] = entry
        else:
            legacy[module] = state
    torch.save(legacy, out / "lib" / "qmodel.pt")
    for f in src.iterdir():
        if f.name != "qmodel.pt":
            shutil.copy(f, out / "lib" / f.name)
    model = load_hqq_lib(out / "lib", torch.float32)
    write_reference(model, out / "reference.safetensors", prompt)
    (out / ".done").write_text("{}\n")
    return out


def load_hqq_lib(path: Path, compute_dtype):
    from hqq.models.hf.base import AutoHQQHFModel

    model = AutoHQQHFModel.from_quantized(str(path), compute_dtype=compute_dtype, device="cpu")
    model.eval()
    return model


def load_hqq_safetensors(path: Path, compute_dtype):
    """hqq's own HQQLinear.load_state_dict on each layer of a safetensors checkpoint (a loader by hand, since
    transformers 4.57.6 always computes HQQ in float32): this keeps the checkpoint's fp16/bf16 compute dtype."""
    import torch
    from hqq.core.quantize import HQQLinear
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    config.quantization_config = None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, torch_dtype=compute_dtype)
    tensors = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    prefixes = [k[: -len(".W_q")] for k in tensors if k.endswith(".W_q")]
    for prefix in prefixes:
        state = {k[len(prefix) + 1:]: tensors.pop(k) for k in list(tensors) if k.startswith(prefix + ".")}
        layer = HQQLinear(None, None, compute_dtype=compute_dtype, device="cpu")
        layer.load_state_dict(state)
        parent_name, _, child = prefix.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected:
        raise RuntimeError(f"unexpected tensors {unexpected[:5]}")
    model.eval()
    return model


def load_transformers(path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    return model


def build(root: Path, names=None) -> None:
    import torch

    torch.set_num_threads(1)
    fx = _main_fixtures()
    prompt = fx.prompt_ids()
    root.mkdir(parents=True, exist_ok=True)
    (root / "prompt.json").write_text(json.dumps({"prompt_ids": prompt}) + "\n")
    for bname, kw in BASES.items():
        d = root / bname
        if not (d / ".done").exists():
            if d.exists():
                shutil.rmtree(d)
            fx.build_tiny_llama(d, **kw)
            (d / ".done").write_text(json.dumps(kw) + "\n")
    for name in names or list(VARIANTS) + ["legacy_b4_g64_ax0"]:
        if (root / name / ".done").exists():
            continue
        print(f"building {name}", flush=True)
        if name == "legacy_b4_g64_ax0":
            if not (root / "b4_g64_ax0" / ".done").exists():
                build_variant(root, "b4_g64_ax0", prompt)
            build_legacy(root, prompt)
        else:
            build_variant(root, name, prompt)


def verify(path: Path, out: Path, loader: str, compute_dtype: str, prompt: list[int]) -> None:
    import torch

    torch.set_num_threads(1)
    if loader == "transformers":
        model = load_transformers(path)
    elif loader == "hqq-safetensors":
        model = load_hqq_safetensors(path, getattr(torch, compute_dtype))
    else:
        model = load_hqq_lib(path, getattr(torch, compute_dtype))
    write_reference(model, out, prompt)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    b.add_argument("--only", nargs="*")
    v = sub.add_parser("verify")
    v.add_argument("path", type=Path)
    v.add_argument("out", type=Path)
    v.add_argument("--loader", choices=("transformers", "hqq", "hqq-safetensors"), default="transformers")
    v.add_argument("--compute-dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    args = ap.parse_args(argv)
    if args.cmd == "build":
        build(args.root, args.only)
    else:
        verify(args.path, args.out, args.loader, args.compute_dtype, _main_fixtures().prompt_ids())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Remake tests/producer_fixtures/auto_round/: auto-round's NATIVE format, made by auto-round itself.

Runs auto-round (installed in the main .venv, CPU, offline) on a tiny llama from tests/support/fixtures.py, trimmed
to one decoder layer with tied embeddings so that all variants stay under 2 MB together:

- sym4_g32:   W4 sym g32, format "auto_round" -> packing_format auto_round:auto_gptq (stores zero - 1)
- asym4_g128: W4 asym g128, format "auto_round" -> packing_format auto_round:auto_awq (AWQ layout)
- mixed_asym: W3 asym g32 base, format "auto_round" -> packing_format "auto_round" (raw zero points), with
              layer_config overrides (-> extra_config): down_proj 8-bit g128, q_proj 2-bit g64, k_proj 4-bit sym,
              o_proj kept in 16 bit

Beside each variant: reference.safetensors (auto-round's own loader's dequantized weight of every quantized
linear, [out, in] fp16, as its QuantLinear computes it in forward()) and logits.safetensors (the loaded
model's logits for a fixed prompt). versions.json records the package versions.

Not committed (tests make them in a temporary folder, `OUT make sym_wide,asym_wide`): sym_wide (auto_gptq
packing at 2/3/5/6/7/8 bits), asym_wide (raw packing at 5/6/7 bits) and gptqmodel_asym (format
"auto_round:gptqmodel": raw zeros plus g_idx).

Run: .venv/bin/python scripts/producers/auto_round.py [OUT_DIR]

DeepSeek-V4 (`auto_round.py deepseek_v4` -> tests/producer_fixtures/autoround_deepseek_v4/), from the float form of
the architecture tests' 3-layer model (fixtures_archs.build_deepseek_v4 layers 3, deepseek_v4_dequantized: sliding,
CSA and HCA layers, the FP4 experts decoded; the base gptqmodel_archs.py quantizes for gptq_deepseek_v4), in the
release's names: auto-round 0.16's model-free mode, AutoRound(model=DIR, scheme="W4A16", model_free=True,
group_size=32), which quantizes the safetensors files without building the model. It writes auto_round:auto_gptq
packing (4 bits, sym, groups of 32) under the release's names (`head.weight`, `layers.N.attn.wq_a.qweight`, its
extra_config keeps `head` and the routers `layers.N.ffn.gate` float), which qconvert's readers rename to
transformers' (formats/common/checkpoint.py, formats/common/release_names.py quantized_release_names). It quantizes every
linear of the layers (68: the attention's wq_a / wq_b / wkv / wo_a / wo_b, the compressors' and the indexer's, every
routed and shared expert). Its oracle, reference.safetensors, is auto-round's own dequantization: each module's
packed tensors loaded into the QuantLinear its loader builds for auto_round:auto_gptq (auto_round_extension.torch
.qlinear_torch_zp, as loader.json of the variants above records), the weight its forward() multiplies by captured
(dequantized_weight), float16 [out, in] (the first 256 rows of the indexer's 4096-row wq_b only: DSV4_REFERENCE_ROWS),
keyed by the stored module name. There are no logits: auto-round's
runtime (transformers 5.24 with auto-round 0.16) does not run the checkpoint. It builds its QuantLinears under
transformers' module names and the file's are the release's, so every quantized weight is reported MISSING (each
`.qweight` UNEXPECTED), left at its initial values, and the logits are NaN (measured in float32 and bfloat16).
The calibrated flow (iters=0, bfloat16) fails in auto-round's block replay, "TypeError:
DeepseekV4Attention.forward() missing 1 required positional argument: 'position_embeddings'".
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

# _common.py, beside this file, holds the scaffolding the producers share: this folder is on sys.path for that
# one import only, since this file is named auto_round.py and `import auto_round` must find the package
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

_common.leave_import_path()
DEFAULT_OUT = _common.PRODUCER_FIXTURES / "auto_round"
CALIBRATION_TEXT = ("The quick brown fox jumps over the lazy dog while the small cat sleeps in the warm sun; "
                    "numbers like 12, 345 and 6789 appear between words, and punctuation: commas, dots!")
PROMPT_IDS = [1, 17, 42, 99, 7, 300, 256, 5, 64, 128, 33, 411]

VARIANTS = {
    "sym4_g32": dict(bits=4, group_size=32, sym=True, layer_config=None),
    "asym4_g128": dict(bits=4, group_size=128, sym=False, layer_config=None, iters=4),
    "mixed_asym": dict(bits=3, group_size=32, sym=False, layer_config={
        "model.layers.0.mlp.down_proj": {"bits": 8, "group_size": 128},
        "model.layers.0.self_attn.q_proj": {"bits": 2, "group_size": 64},
        "model.layers.0.self_attn.o_proj": {"bits": 16},
        "model.layers.0.self_attn.k_proj": {"bits": 4, "sym": True},
    }),
    # made by the tests (not committed: 2 MB budget): auto-round's other widths, both zero conventions
    "sym_wide": dict(bits=4, group_size=32, sym=True, layer_config={
        "model.layers.0.self_attn.q_proj": {"bits": 5},
        "model.layers.0.self_attn.k_proj": {"bits": 6},
        "model.layers.0.self_attn.v_proj": {"bits": 7},
        "model.layers.0.mlp.gate_proj": {"bits": 2},
        "model.layers.0.mlp.up_proj": {"bits": 3},
        "model.layers.0.mlp.down_proj": {"bits": 8, "group_size": 64},
    }),
    "asym_wide": dict(bits=5, group_size=32, sym=False, layer_config={
        "model.layers.0.self_attn.k_proj": {"bits": 6},
        "model.layers.0.self_attn.v_proj": {"bits": 7},
    }),
    "gptqmodel_asym": dict(bits=4, group_size=64, sym=False, layer_config=None, format="auto_round:gptqmodel"),
}
COMMITTED = ("sym4_g32", "asym4_g128", "mixed_asym")
PACKAGES = ("auto-round", "torch", "transformers", "gptqmodel", "safetensors")  # their versions go into versions.json


def build_base(out: Path) -> Path:
    """The tiny llama (tests/support/fixtures.py), one decoder layer, tied embeddings (lm_head = embed_tokens)."""
    return _common.tiny_llama_first_layer(out / "_base", per_layer_keys=("layer_types",), seed=2024, tie=True)


def quantize(base: Path, dest: Path, spec: dict) -> None:
    """auto-round 0.16 RTN (iters=0: its own quantizer, no calibration data needed) saved as format auto_round."""
    import torch
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float16)
    tok = AutoTokenizer.from_pretrained(str(base))
    # a few fixed sentences as the calibration set: offline, no Hub dataset
    texts = [CALIBRATION_TEXT[i:] + CALIBRATION_TEXT[:i] for i in range(0, 160, 20)]
    ar = AutoRound(model, tok, bits=spec["bits"], group_size=spec["group_size"], sym=spec["sym"],
                   iters=spec.get("iters", 0), dataset=texts, nsamples=len(texts), seqlen=32, batch_size=4,
                   device_map="cpu", layer_config=spec["layer_config"])
    ar.quantize_and_save(str(dest), format=spec.get("format", "auto_round"))
    # auto-round 0.16 saves into a subfolder named after the model and scheme (<dest>/_base-w4g32): lift it
    inner = [p for p in dest.iterdir() if p.is_dir()]
    if len(inner) == 1 and (inner[0] / "config.json").exists():
        for f in inner[0].iterdir():
            f.rename(dest / f.name)
        inner[0].rmdir()


def load_and_dump(dest: Path) -> None:
    """auto-round's own loader (transformers + its AutoRoundConfig, CPU): dequantized weights and logits."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(dest), dtype=torch.float16, device_map="cpu")
    model.eval()
    ref = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "qweight") and hasattr(mod, "scales"):
            ref[f"{name}.weight"] = dequantized_weight(mod).contiguous()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT_IDS])).logits[0].contiguous()  # fp16, as the loader computes them
    save_file(ref, str(dest / "reference.safetensors"))
    save_file({"logits": logits, "ids": torch.tensor(PROMPT_IDS)}, str(dest / "logits.safetensors"))
    kinds = sorted({f"{type(m).__module__}.{type(m).__name__}" for _, m in model.named_modules()
                    if hasattr(m, "qweight")})
    _common.write_json(dest / "loader.json", {"quant_linear": kinds}, indent=2, sort_keys=False)


def dequantized_weight(mod):
    """The [out, in] weight the loaded QuantLinear multiplies by: its forward() dequantizes the packed tensors and
    calls torch.matmul(x, W^T) (auto_round_extension torch QuantLinear, gptqmodel AwqTorchLinear); the second
    operand is captured as it is, so nothing is recomputed here (a product with an identity would turn -0.0
    into +0.0)."""
    import torch

    in_features = getattr(mod, "infeatures", None) or getattr(mod, "in_features")
    captured = []
    matmul = torch.matmul

    def spy(a, b, *args, **kwargs):
        captured.append(b.detach().clone())
        return matmul(a, b, *args, **kwargs)

    torch.matmul = spy
    try:
        with torch.no_grad():
            mod(torch.zeros((1, in_features), dtype=mod.scales.dtype))
    finally:
        torch.matmul = matmul
    if len(captured) != 1 or captured[0].shape[0] != in_features:
        raise RuntimeError(f"{type(mod).__name__}.forward did not multiply by one [in, out] weight")
    return captured[0].T.contiguous()


def make(out: Path, names) -> None:
    """Quantize and dump the named variants into `out`, each step in its own process."""
    out.mkdir(parents=True, exist_ok=True)
    build_base(out)
    for name in names:
        dest = out / name
        if dest.exists():
            shutil.rmtree(dest)
        for step in ("quantize", "dump"):
            subprocess.run([sys.executable, __file__, str(out), step, name], check=True,
                           env=_common.offline_env(CUDA_VISIBLE_DEVICES=""), cwd=_common.REPO)
        for junk in dest.glob("*.py"):
            junk.unlink()
    shutil.rmtree(out / "_base")


DSV4_OUT = _common.PRODUCER_FIXTURES / "autoround_deepseek_v4"
DSV4_LAYERS = 3  # sliding, CSA and HCA, as gptq_deepseek_v4 (gptqmodel_archs.py LAYERS)
DSV4_SCHEME = dict(scheme="W4A16", group_size=32)
# the reference keeps a module's first 256 rows (each with all its groups): only the indexer's wq_b has more (4096,
# half of the file alone), and the fixture stays within gptq_deepseek_v4's size
DSV4_REFERENCE_ROWS = 256


def make_deepseek_v4(out: Path = DSV4_OUT) -> Path:
    """auto-round's model-free W4A16 g32 of the float release-named DeepSeek-V4 (see the docstring), its
    dequantization beside it. Model-free quantizes in worker processes: run only under `if __name__ == "__main__"`."""
    import tempfile

    import torch
    from auto_round import AutoRound
    from safetensors.torch import save_file

    sys.path.insert(0, str(_common.REPO / "tests" / "support"))
    import fixtures_archs  # noqa: E402

    with tempfile.TemporaryDirectory(prefix="qconvert-ar-dsv4-") as tmp:
        release = fixtures_archs.build_deepseek_v4(Path(tmp) / "release", layers=DSV4_LAYERS)
        base = fixtures_archs.deepseek_v4_dequantized(release, Path(tmp) / "base")
        ckpt = Path(tmp) / "ckpt"
        AutoRound(model=str(base), model_free=True, **DSV4_SCHEME).quantize_and_save(output_dir=str(ckpt),
                                                                                     format="auto_round")
        shutil.rmtree(ckpt / ".cache", ignore_errors=True)  # the model-free run's scratch folder
        reference = {f"{name}.weight": dequantized_weight(layer)[:DSV4_REFERENCE_ROWS].to(torch.float16).contiguous()
                     for name, layer in _auto_gptq_layers(ckpt)}
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        shutil.copytree(ckpt, out / "model")
        save_file(reference, str(out / "reference.safetensors"))
    _common.write_versions(out, "auto-round model-free", ["auto-round", "torch", "transformers", "safetensors"],
                           base=f"tests/support/fixtures_archs.py deepseek_v4 (seed 0, layers {DSV4_LAYERS}, "
                                "deepseek_v4_dequantized: the release's names)", **DSV4_SCHEME,
                           logits="none: auto-round's runtime leaves every quantized weight MISSING (release names)")
    return out


def _auto_gptq_layers(ckpt: Path):
    """(module name, auto-round's QuantLinear for auto_round:auto_gptq holding the module's packed tensors) for every
    quantized module of the checkpoint (4-bit, groups of 32, as quantization_config.json says)."""
    import json

    import torch
    from auto_round_extension.torch.qlinear_torch_zp import QuantLinear
    from safetensors.torch import load_file

    qc = json.loads((ckpt / "quantization_config.json").read_text())
    tensors = load_file(str(ckpt / "model.safetensors"))
    for name in sorted(n[: -len(".qweight")] for n in tensors if n.endswith(".qweight")):
        qweight = tensors[f"{name}.qweight"]
        layer = QuantLinear(qc["bits"], qc["group_size"], qweight.shape[0] * 32 // qc["bits"], qweight.shape[1],
                            bias=False)
        for part in ("qweight", "qzeros", "scales"):
            getattr(layer, part).copy_(tensors[f"{name}.{part}"])
        layer.post_init()
        yield name, layer.to(torch.float16).eval()


def main(argv: list[str]) -> None:
    """auto_round.py [OUT]: the committed variants; OUT make NAME,NAME: those variants (the wide-bit ones are
    made by the tests, too big to commit); OUT quantize|dump NAME: one step (a child process); OUT sample DENSE: the
sym4_g32 scheme applied to the dense checkpoint DENSE (the format contract's read-only sample)."""
    if argv[1:] == ["deepseek_v4"]:  # auto_round.py deepseek_v4: tests/producer_fixtures/autoround_deepseek_v4/
        _common.offline_defaults(CUDA_VISIBLE_DEVICES="")
        print(make_deepseek_v4())
        return
    out = Path(argv[1]) if len(argv) > 1 else DEFAULT_OUT
    if len(argv) > 3 and argv[2] in ("quantize", "dump"):
        if argv[2] == "quantize":
            quantize(out / "_base", out / argv[3], VARIANTS[argv[3]])
        else:
            load_and_dump(out / argv[3])
        return
    if len(argv) > 3 and argv[2] == "sample":  # OUT sample DENSE_DIR: a 4-bit sym g32 checkpoint of any dense llama
        quantize(Path(argv[3]), out, VARIANTS["sym4_g32"])
        return
    if len(argv) > 3 and argv[2] == "make":
        make(out, argv[3].split(","))
        return
    make(out, COMMITTED)
    _common.write_json(out / "versions.json", _common.package_versions(*PACKAGES), indent=2, sort_keys=False)


if __name__ == "__main__":
    main(sys.argv)

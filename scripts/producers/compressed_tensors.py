"""Remake tests/producer_fixtures/compressed_tensors/: compressed-tensors checkpoints made by the real producer,
llm-compressor 0.14 (compressed-tensors 0.19), offline on CPU, from a tiny random Llama.

    python scripts/producers/compressed_tensors.py            # creates .venvs/llmcompressor if needed

llm-compressor pins transformers <= 5.17 and auto-round <= 0.15.1, which the main .venv (transformers 5.24,
auto-round 0.16) cannot take, so it runs in its own venv (.venvs/llmcompressor, gitignored); this script
re-executes itself there.

Per case <name>/: the checkpoint as llm-compressor saved it (config.json with quantization_config,
model.safetensors, tokenizer files) and oracle.json: the producer's own dequantization of every quantized
linear -- transformers 5.17 + compressed-tensors 0.19 loading the checkpoint decompressed
(CompressedTensorsConfig(run_compressed=False)), the weights the runtime computes with -- as dtype, shape and
sha256 of the raw bytes (a bit-for-bit oracle that keeps the folder small; the tests also recompute the
dequantization live with compressed-tensors 0.19 in the main venv). versions.json records the packages.

The base model is tests/fixtures.py's tiny Llama (seed 1234, hidden 128, ffn 256, tied embeddings) cut to one
decoder layer, so that the seven cases stay under 2 MB together.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# this file's own name would shadow the compressed_tensors package: its folder leaves the import path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venvs" / "llmcompressor"
OUT = REPO / "tests" / "producer_fixtures" / "compressed_tensors"
PINS = ("torch==2.13.0", "llmcompressor==0.14.0.1", "compressed-tensors==0.19.0")


def _int_group(bits: int, group: int | None, sym: bool, strategy: str, actorder=None) -> dict:
    w = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": strategy}
    if group:
        w["group_size"] = group
    if actorder:
        w["actorder"] = actorder
    return w


# name -> (modifier, recipe kwargs). RTN = QuantizationModifier (compressed-tensors' min-max observer), GPTQ =
# GPTQModifier on seeded random calibration ids.
CASES = {
    # W4A16 symmetric, groups of 32 (what GGUF Q4_0 holds)
    "w4a16_g32_sym": ("rtn", dict(config_groups={"group_0": {"targets": ["Linear"],
                                                             "weights": _int_group(4, 32, True, "group")}})),
    # the W4A16_ASYM preset (groups of 128, integer zero points) through GPTQ, activation order "weight"
    # (compressed-tensors 0.19 removed actorder "group": no weight_g_idx is written any more)
    "w4a16_g128_asym_gptq": ("gptq", dict(config_groups={"group_0": {
        "targets": ["Linear"], "weights": _int_group(4, 128, False, "group", actorder="weight")}})),
    # the W8A16 preset: int8 per channel, symmetric (pack-quantized at 8 bits)
    "w8a16_channel": ("rtn", dict(scheme="W8A16")),
    # two config groups: down_proj by regex at 8 bits per channel, every other Linear 4-bit g64 asym
    "mixed_groups": ("rtn", dict(config_groups={
        "group_0": {"targets": ["re:.*mlp\\.down_proj$"], "weights": _int_group(8, None, True, "channel")},
        "group_1": {"targets": ["Linear"], "weights": _int_group(4, 64, False, "group")}})),
    # the W8A8 preset: int8 weights per channel + dynamic int8 activations (int-quantized: an int8 `weight`)
    "w8a8_int": ("rtn", dict(scheme="W8A8")),
    # FP8 weights per channel + dynamic fp8 activations (float-quantized)
    "fp8_dynamic": ("rtn", dict(scheme="FP8_DYNAMIC")),
    # NVFP4 weights (e2m1, fp8 group scales of 16, a global scale) (nvfp4-pack-quantized)
    "nvfp4a16": ("rtn", dict(scheme="NVFP4A16")),
    # FP8 weights in 128x128 blocks, one float scale per block (DeepSeek-V3's layout; float-quantized, strategy block)
    "fp8_block": ("rtn", dict(scheme="FP8_BLOCK")),
    # MXFP4 weights (e2m1, an e8m0 exponent per 32) (mxfp4-pack-quantized)
    "mxfp4a16": ("rtn", dict(scheme="MXFP4A16")),
}


def _in_venv() -> bool:
    return Path(sys.prefix).resolve() == VENV.resolve()


def ensure_venv() -> Path:
    py = VENV / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", PINS[0]], check=True)  # the CPU build first
        subprocess.run([str(py), "-m", "pip", "install", "-q", *PINS[1:]], check=True)
    return py


def _fixtures_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("qconvert_test_fixtures", REPO / "tests" / "support" / "fixtures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build_base(out: Path) -> Path:
    """tests/fixtures.py's tiny Llama (tied embeddings), decoder layer 1 removed."""
    from safetensors.torch import load_file, save_file

    fx = _fixtures_module()
    fx.build_tiny_llama(out, seed=1234, tie=True)
    tensors = {k: v for k, v in load_file(str(out / "model.safetensors")).items() if ".layers.1." not in k}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def calibration(n: int = 16, length: int = 64, seed: int = 2024):
    import torch
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 512, (n, length), generator=g)
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * length] * n})


def produce(name: str, base: Path, out: Path) -> None:
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kind, kwargs = CASES[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float16)
    tok = AutoTokenizer.from_pretrained(str(base))
    if kind == "gptq":
        recipe = GPTQModifier(ignore=["lm_head"], **kwargs)
        oneshot(model=model, dataset=calibration(), recipe=recipe, num_calibration_samples=16, max_seq_length=64,
                pipeline="basic")
    else:
        oneshot(model=model, recipe=QuantizationModifier(ignore=["lm_head"], **kwargs))
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(str(out), save_compressed=True)
    tok.save_pretrained(str(out))
    for side in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (base / side).exists():  # the original tokenizer files, not the re-saved ones (machine-local keys)
            shutil.copy2(base / side, out / side)
    for junk in ("recipe.yaml",):
        if (out / junk).exists():
            (out / junk).unlink()


def oracle(ckpt: Path) -> dict:
    """The producer runtime's dequantized linear weights: transformers + compressed-tensors, decompressed."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), quantization_config=CompressedTensorsConfig(
        run_compressed=False))
    qc = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    found = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and ".layers." in name:
            w = mod.weight.detach().contiguous().cpu()
            raw = w.view(torch.uint8) if w.element_size() > 1 else w
            found[f"{name}.weight"] = {"dtype": str(w.dtype)[6:], "shape": list(w.shape),
                                       "sha256": hashlib.sha256(raw.numpy().tobytes()).hexdigest()}
    return {"format": qc.get("format"), "weights": found}


def versions() -> dict:
    import importlib.metadata as md

    return {p: md.version(p) for p in ("llmcompressor", "compressed-tensors", "transformers", "torch")}


def main(argv: list[str]) -> int:
    if not _in_venv():
        py = ensure_venv()
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false")
        return subprocess.run([str(py), __file__, *argv], env=env).returncode
    names = argv or list(CASES)
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ct_producer_") as tmp:
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

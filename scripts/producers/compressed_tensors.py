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

The base model is tests/support/fixtures.py's tiny Llama (seed 1234, hidden 128, ffn 256, tied embeddings) cut to one
decoder layer, so that the seven cases stay under 2 MB together.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

# _common.py, beside this file, holds the scaffolding the producers share: this folder is on sys.path for that
# one import only, since this file's own name would shadow the compressed_tensors package
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

_common.leave_import_path()
# QCONVERT_LLMCOMPRESSOR_VENV: another place for that venv (a worktree whose .venvs/ is shared read-only)
VENV = Path(os.environ.get("QCONVERT_LLMCOMPRESSOR_VENV") or _common.REPO / ".venvs" / "llmcompressor")
OUT = _common.PRODUCER_FIXTURES / "compressed_tensors"
PINS = ("torch==2.13.0", "llmcompressor==0.14.0.1", "compressed-tensors==0.19.0")
PACKAGES = ("llmcompressor", "compressed-tensors", "transformers", "torch")  # their versions go into versions.json


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
    # MXFP8 weights (e4m3, an e8m0 exponent per 32; mxfp8-quantized: F8_E4M3 `weight`, uint8 `weight_scale`)
    "mxfp8a16": ("rtn", dict(scheme="MXFP8A16")),
    # weight-only FP8 (no input activations): compressed-tensors' infer_module_format gives these
    # naive-quantized, not float-quantized (FloatQuantizationCompressor.can_compress needs input activations),
    # and stores the same F8_E4M3 `weight` + `weight_scale`: blocks of 64 rows x 32 columns, per channel, per tensor
    "fp8_block_64x32_naive": ("rtn", dict(config_groups={"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "symmetric": True, "strategy": "block", "block_structure": [64, 32]}}})),
    "fp8_channel_naive": ("rtn", dict(config_groups={"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}}})),
    "fp8_tensor_naive": ("rtn", dict(config_groups={"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"}}})),
}


def ensure_venv() -> Path:
    return _common.ensure_venv(VENV, PINS[0], list(PINS[1:]))


def build_base(out: Path) -> Path:
    """tests/support/fixtures.py's tiny Llama (tied embeddings), decoder layer 1 removed."""
    return _common.tiny_llama_first_layer(out, seed=1234, tie=True)


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
    _common.copy_side_files(base, out)  # the original tokenizer files, not the re-saved ones (machine-local keys)
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
    found = {f"{name}.weight": _common.tensor_digest(mod.weight) for name, mod in model.named_modules()
             if isinstance(mod, torch.nn.Linear) and ".layers." in name}
    return {"format": qc.get("format"), "weights": found}


def main(argv: list[str]) -> int:
    if not _common.in_venv(VENV):
        return _common.rerun(ensure_venv(), __file__, argv, HF_DATASETS_OFFLINE="1")
    _common.make_cases(OUT, argv or list(CASES), "ct_producer_", build_base, produce, oracle, PACKAGES)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

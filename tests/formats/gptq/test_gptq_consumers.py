"""GPTQ written from GGUF files that llama.cpp quantized loads in every GPTQ consumer: gptqmodel,
transformers' own GPTQ loader (optimum over gptqmodel's kernels) and transformers with auto-round's loader
(`quantization_config=AutoRoundConfig(...)`), with the same logits as our dequantization of the output.

Two traps this guards against: asymmetric v1 output (gptqmodel refuses it unless gptqmodel wrote it), and a
quantized head declared only by gptqmodel's `lm_head: true` (transformers' loaders then leave it random)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import fixtures
from helpers import run_cli, transformers_logits
from gguf_reader_files import _ensure

PROMPT = fixtures.prompt_ids()


def _logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].float().numpy()


def _loaders(path):
    from gptqmodel import BACKEND, GPTQModel
    from transformers import AutoModelForCausalLM, AutoRoundConfig

    yield "gptqmodel", GPTQModel.load(str(path), backend=BACKEND.TORCH, device="cpu", dtype=torch.float16).model
    yield "transformers", AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float16, device_map="cpu")
    yield "transformers+auto-round", AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float16, device_map="cpu", quantization_config=AutoRoundConfig(backend="torch"))


def _gguf_to_gptq(tmp_path, qtype: str, target: str, *args) -> tuple:
    src = _ensure("llama")[qtype]
    out = tmp_path / target
    run_cli(f"gguf->{target}", src, out, "--report", tmp_path / "r.json", *args)
    report = json.loads((tmp_path / "r.json").read_text())
    dense = tmp_path / f"{target}.hf"
    run_cli(f"{target}->hf", out, dense, "--type", "f32")
    return out, report, transformers_logits(dense, PROMPT)


def test_q8_0_head_is_stored_so_every_loader_reads_it(tmp_path):
    out, report, want = _gguf_to_gptq(tmp_path, "q8_0", "gptq")
    head = next(t for t in report["tensors"] if t["name"] == "lm_head.weight")
    assert head["source"].startswith("8-bit") and head["target"] == "float16"  # the Q8_0 head, dequantized once
    assert head["verdict"] in ("exact", "near-exact") and head["max_abs_err"] < 1e-3
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["lm_head"] is False and qc["format"] == "gptq" and "meta" not in qc
    span = float(want.max() - want.min())
    seen = []
    for name, model in _loaders(out):
        got = _logits(model)
        assert float(np.abs(got - want).max()) < 0.01 * span, name  # fp16 kernels vs our float32 dequant
        seen.append(name)
    assert seen == ["gptqmodel", "transformers", "transformers+auto-round"]


@pytest.mark.parametrize("target", ["gptq", "gptq-v2"])
def test_k_quant_gguf_requantized_to_gptq_loads(tmp_path, target):
    """Q4_K_M's grids (min form, 6-bit sub-scales) requantize: v1 output is written symmetric (gptqmodel
    loads asymmetric v1 only from its own files), v2 output keeps asymmetric zero points."""
    out, report, want = _gguf_to_gptq(tmp_path, "q4_k_m", target, "--allow-requant")
    assert any(t["verdict"] == "requantize" for t in report["tensors"])
    qc = json.loads((out / "quantize_config.json").read_text())
    assert qc["sym"] is (target == "gptq") and qc["checkpoint_format"] == ("gptq" if target == "gptq" else "gptq_v2")
    ref = fixtures.gptq_reference(out, tmp_path / "ref.safetensors", PROMPT)
    weights, logits = fixtures.load_reference(ref)
    assert len(weights) == 14
    span = float(want.max() - want.min())
    assert float(np.abs(logits[0] - want).max()) < 0.01 * span


def test_asymmetric_type_into_v1_is_refused_naming_v2(tmp_path):
    src = _ensure("llama")["q4_k_m"]
    proc = run_cli("gguf->gptq", src, tmp_path / "o", "--type", "4g32a", "--allow-requant", check_rc=2)
    assert "asymmetric GPTQ is written as v2" in proc.stderr and "qconvert 'SRC->gptq-v2' --type 4g32a" in proc.stderr
    run_cli("gguf->gptq-v2", src, tmp_path / "o2", "--type", "4g32a", "--allow-requant")


def test_k_quant_refusal_proposes_no_type_gptq_lacks(tmp_path):
    """Q5_K/Q6_K tensors have no GPTQ twin: the refusal must not propose `--type 5g32` or `6g16` (which
    GPTQ cannot write), only choices that work."""
    src = _ensure("llama")["q4_k_m"]
    proc = run_cli("gguf->gptq", src, tmp_path / "o", "--type", "4g32", check_rc=2)
    line = proc.stderr.strip()
    assert len(line.splitlines()) == 1 and "--allow-requant" in line
    assert "5g" not in line and "6g" not in line
    run_cli("gguf->gptq", src, tmp_path / "o", "--type", "4g32", "--allow-requant")

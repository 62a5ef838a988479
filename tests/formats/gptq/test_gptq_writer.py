"""GPTQ written by qconvert loads in gptqmodel 7.6.0 with the source's weights and logits."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.torch import load_file

import fixtures
from helpers import run_cli

CASES = [
    ("v1_b4_g32_sym_act", "gptq-v2"),     # act-order index carried through
    ("v2_b4_g32_asym_zp0", "gptq-v2"),    # asymmetric, zero point 0
    ("v1_b3_g32_sym", "gptq-v2"),         # 3-bit packing
    ("v2_b4_g32_sym", "gptq"),            # v2 -> v1 (symmetric, whole-word offset)
    ("v1_b8_g128_sym", "gptq"),
]


@pytest.mark.parametrize("variant,target", CASES)
def test_gptqmodel_loads_our_output_with_equal_logits(fx, prompt, variant, target, tmp_path):
    v = fx["variants"][variant]
    out = tmp_path / "out"
    proc = run_cli(f"gptq->{target}", v["ckpt"], out, "--report", tmp_path / "r.json")
    report = json.loads((tmp_path / "r.json").read_text())
    assert all(t["verdict"] == "exact" and t["max_abs_err"] == 0.0 for t in report["tensors"]), proc.stdout
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["checkpoint_format"] == ("gptq_v2" if target == "gptq-v2" else "gptq")
    assert qc["bits"] == v["bits"] and qc["desc_act"] == v["desc_act"]

    ref_path = fixtures.gptq_reference(out, tmp_path / "ours.safetensors", prompt)
    ours_w, ours_logits = fixtures.load_reference(ref_path)
    src_w, src_logits = fixtures.load_reference(v["reference"])
    assert ours_w.keys() == src_w.keys()
    for name in src_w:
        assert np.array_equal(ours_w[name], src_w[name]), name
    assert np.array_equal(ours_logits, src_logits)


def test_round_trip_v1_v2_v1_is_tensor_identical(fx, tmp_path):
    src = fx["variants"]["v1_b4_g128_sym_act"]["ckpt"]
    run_cli("gptq->gptq-v2", src, tmp_path / "v2")
    run_cli("gptq-v2->gptq", tmp_path / "v2", tmp_path / "v1")
    a = load_file(str(src / "model.safetensors"))
    b = load_file(str(tmp_path / "v1" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and bool((a[k] == b[k]).all()), k
    v2 = load_file(str(tmp_path / "v2" / "model.safetensors"))
    assert any(not bool((v2[k] == a[k]).all()) for k in a if k.endswith("qzeros"))  # only zeros differ


def test_asymmetric_into_v1_is_refused_naming_v2(fx, tmp_path):
    src = fx["variants"]["v2_b4_g32_asym_zp0"]["ckpt"]
    proc = run_cli("gptq-v2->gptq", src, tmp_path / "out", check_rc=2)
    assert "gptq-v2 output (exact)" in proc.stderr and not (tmp_path / "out").exists()


def test_dense_to_gptq_requantizes_and_gptqmodel_runs_it(fx, prompt, tmp_path):
    """hf -> gptq: round-to-nearest onto GPTQ's grid, refused without --allow-requant, and what gptqmodel
    computes from our file equals our own dequantization of it."""
    base = fx["bases"]["base"]
    proc = run_cli("hf->gptq", base, tmp_path / "x", "--type", "4g32", check_rc=2)
    assert "--allow-requant" in proc.stderr and not (tmp_path / "x").exists()
    out = tmp_path / "out"
    run_cli("hf->gptq", base, out, "--type", "4g32", "--allow-requant", "--report", tmp_path / "r.json")
    report = json.loads((tmp_path / "r.json").read_text())
    requant = [t for t in report["tensors"] if t["verdict"] == "requantize"]
    assert len(requant) == 14 and all(0 < t["max_abs_err"] < 0.1 for t in requant)

    from qconvert.formats.gptq.reader import GptqSource
    import torch

    weights, _ = fixtures.load_reference(fixtures.gptq_reference(out, tmp_path / "ref.safetensors", prompt))
    for rec in GptqSource(out).records():
        if rec.is_grid:
            ours = rec.load().dequantize(torch.float32).to(torch.float16).numpy()
            assert np.array_equal(ours, weights[rec.name[: -len(".weight")]]), rec.name

"""The command line as a user meets it: pair names, formats, inspect, dry runs and the JSON report."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import run_cli, transformers_logits

from qconvert.converters.registry import all_formats

EXAMPLE_FORMAT_LINES = ("gptq", "gptq-v2", "hf", "gguf")


def test_formats_lists_every_registered_format():
    out = run_cli("formats").stdout
    for entry in all_formats():
        line = next(line for line in out.splitlines() if line.split()[0] == entry.name)
        assert ("read" in line) == entry.can_read and ("write" in line) == entry.can_write
    assert {e.name for e in all_formats()} >= set(EXAMPLE_FORMAT_LINES)


def test_inspect_names_format_bits_group_and_layout(fx):
    proc = run_cli("inspect", fx["variants"]["v2_b4_g128_sym_act"]["ckpt"], "--json")
    info = json.loads(proc.stdout)
    assert info["format"] == "gptq-v2" and info["bits"] == 4 and info["group_size"] == 128
    assert "packed along inputs" in info["layout"]
    assert info["tensors_by_scheme"]["4-bit g128 sym act-order"] == 2  # the two down_proj (256 inputs)


def test_dry_run_prints_the_plan_and_writes_nothing(fx, tmp_path):
    out = tmp_path / "x.gguf"
    proc = run_cli("gptq->gguf", fx["variants"]["v1_b3_g32_sym"]["ckpt"], out, "--dry-run",
                   "--report", tmp_path / "plan.json")
    assert not out.exists()
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:4] == ["tensor", "source", "target", "verdict"]
    assert any("Q3_K" in line and "requantize" in line for line in lines)
    assert "dry run: nothing written" in lines[-1]
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["summary"]["dry_run"] and all(t["max_abs_err"] is None for t in plan["tensors"])


def test_report_schema(fx, tmp_path):
    run_cli("gptq:gguf", fx["variants"]["v1_b4_g32_sym"]["ckpt"], tmp_path / "x.gguf", "--report", tmp_path / "r.json")
    report = json.loads((tmp_path / "r.json").read_text())
    assert set(report) == {"source", "target", "tensors", "summary"}
    for t in report["tensors"]:
        assert {"name", "target", "verdict", "max_abs_err", "rmse"} <= set(t)
    assert report["summary"]["tensors"] == 21 and report["summary"]["verdicts"]["exact"] == 21


def test_unquoted_pair_gets_a_hint(tmp_path):
    proc = run_cli("gptq-", "a", "b", check_rc=2)  # what bash passes for an unquoted gptq->gguf
    assert "quote the pair" in proc.stderr


def test_tensor_type_override(fx, tmp_path):
    r = tmp_path / "r.json"
    run_cli("gptq->gguf", fx["variants"]["v1_b4_g32_sym"]["ckpt"], tmp_path / "x.gguf", "--report", r,
            "--tensor-type", r"mlp\.down_proj=q8_0", "--tensor-type", "embed_tokens=f32")
    tensors = {t["name"]: t for t in json.loads(r.read_text())["tensors"]}
    assert tensors["model.layers.0.mlp.down_proj.weight"]["target"] == "Q8_0"
    assert tensors["model.layers.0.mlp.down_proj.weight"]["verdict"] == "exact"  # 4-bit codes fit Q8_0
    assert tensors["model.embed_tokens.weight"]["target"] == "F32"
    assert tensors["model.layers.0.mlp.up_proj.weight"]["target"] == "Q4_0"


def test_gptq_to_hf_loads_in_transformers_like_the_source(fx, prompt, tmp_path):
    """The dequantized bf16 checkpoint: transformers loads it; logits close to gptqmodel's run."""
    import fixtures

    run_cli("gptq->hf", fx["variants"]["v1_b4_g128_sym"]["ckpt"], tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["torch_dtype"] == "bfloat16"
    _, ref_logits = fixtures.load_reference(fx["variants"]["v1_b4_g128_sym"]["reference"])
    got = transformers_logits(tmp_path / "hf", prompt)
    # bf16 weights against gptqmodel's fp16 kernel: bounded by bf16 rounding of the weights
    assert abs(got - ref_logits[0]).max() < 0.05 * (ref_logits.max() - ref_logits.min())


def test_verify_rereads_output_and_measures_every_tensor(fx, tmp_path):
    src = fx["variants"]["v1_b4_g32_sym"]["ckpt"]
    run_cli("gptq->gptq-v2", src, tmp_path / "same")
    run_cli("verify", src, tmp_path / "same", "--strict", "--report", tmp_path / "r.json")
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["summary"]["verdicts"]["exact"] == 21
    # a different model: verify sees it, and --strict turns that into exit 3
    other = fx["variants"]["v1_b4_g32_sym_act"]["ckpt"]
    proc = run_cli("verify", other, tmp_path / "same", "--strict", check_rc=3)
    assert "differs" in proc.stdout


PRODUCED = Path(__file__).parents[1] / "producer_fixtures"  # checkpoints the formats' own producers made


@pytest.mark.parametrize("folder, fmt", [
    ("awq/gemm_g32", "awq"), ("auto_round/asym4_g128", "auto-round"), ("bitsandbytes/nf4_dq", "bitsandbytes"),
    ("bitsandbytes/int8", "bitsandbytes"), ("compressed_tensors/w4a16_g32_sym", "compressed-tensors"),
    ("compressed_tensors/fp8_dynamic", "compressed-tensors"), ("mlx/model", "mlx"),
    ("torchao/intx4_g32_sym", "torchao"), ("quark/mxfp4", "quark"),
])
def test_inspect_names_each_producers_format_from_its_data(tmp_path, folder, fmt):
    """The format comes from the files (config, tensors), not from the folder's name: each producer's own
    checkpoint is copied to a folder called `model` first."""
    copy = tmp_path / "model"
    shutil.copytree(PRODUCED / folder, copy)
    info = json.loads(run_cli("inspect", copy, "--json").stdout)
    assert info["format"] == fmt

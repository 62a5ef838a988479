"""mlx's float quantize modes (mlx-lm 0.32 `q_mode="mxfp8"` / `"mxfp4"`): read as float grids equal to
mx.dequantize bit for bit, and moved with their codes kept into the formats that hold them, each output
judged by its runtime.

The producer fixtures (tests/producer_fixtures/mlx/mxfp8, mxfp4; scripts/producers/mlx.py) are
mlx_lm.convert's own output for the tiny llama, with mlx's dequantization of every module (float32, the
products themselves) and mlx-lm's logits of the fixtures' prompt stored beside them when they were made.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import fixtures
from helpers import llama_logits, run_cli

from qconvert.converters.checker import EXACT
from qconvert.formats.compressed_tensors.reader import CtSource
from qconvert.formats.mlx.reader import MlxSource, looks_like_mlx

PRODUCED = Path(__file__).resolve().parents[2] / "producer_fixtures" / "mlx"
PROMPT = fixtures.prompt_ids()
MODULES = 16  # 14 decoder linears, the embedding and the untied head: mlx_lm.convert quantizes all


def _grids(src) -> dict:
    return {r.name: r for r in src.records() if r.is_grid}


def _bits(w: torch.Tensor) -> torch.Tensor:
    return w.contiguous().view(torch.int32)  # bit patterns: -0.0 and NaN compared as mlx wrote them


@pytest.mark.parametrize("mode, element", [("mxfp8", "e4m3"), ("mxfp4", "e2m1")])
def test_reader_equals_mx_dequantize(mode, element):
    folder = PRODUCED / mode / "model"
    assert looks_like_mlx(folder)
    want = load_file(str(PRODUCED / mode / "reference.safetensors"))
    grids = _grids(MlxSource(folder))
    assert sorted(grids) == sorted(k for k in want if not k.startswith("__")) and len(grids) == MODULES
    for name, rec in grids.items():
        assert rec.params.element == element and rec.params.group_size == 32, name
        assert rec.params.scales.dtype == torch.float8_e8m0fnu, name
        assert torch.equal(_bits(rec.load().dequantize(torch.float32)), _bits(want[name])), name


def _exact_rows(report: Path, target: str, at_least: int = 14) -> list[dict]:
    rows = [r for r in json.loads(report.read_text())["tensors"] if r["target"] == target]
    assert len(rows) >= at_least and all(r["verdict"] == EXACT and r["max_abs_err"] == 0.0 for r in rows), rows
    return rows


def _ct_runtime_holds_our_values(out: Path, source: dict, element: str) -> None:
    """transformers + compressed-tensors decompress our output to the mlx values (fp4 through bf16, as it
    decompresses, tests/support/ct_runtime.py), and our ct reader finds mlx's codes."""
    from ct_runtime import _as_runtime, _ct_model

    params = {n: t.detach() for n, t in _ct_model(out, dtype=torch.float32).named_parameters()}
    written = _grids(CtSource(out))
    assert len(written) == 14  # the decoder linears; the embedding and head are written dense
    for name, rec in written.items():
        assert rec.params.element == element, name
        assert torch.equal(rec.load().codes.to(torch.int64), source[name].load().codes.to(torch.int64)), name
        assert torch.equal(rec.load().dequantize(torch.float32), source[name].load().dequantize(torch.float32)), name
        assert torch.equal(_as_runtime(rec, params[name].dtype), params[name]), name


def test_mxfp4_moves_keep_the_codes(tmp_path):
    folder = PRODUCED / "mxfp4" / "model"
    source = _grids(MlxSource(folder))
    mlx_logits = load_file(str(PRODUCED / "mxfp4" / "reference.safetensors"))["__logits__"].numpy()

    gguf, report = tmp_path / "m.gguf", tmp_path / "gguf.json"
    run_cli("mlx->gguf", folder, gguf, "--type", "mxfp4", "--report", report)
    assert len(_exact_rows(report, "MXFP4")) == MODULES
    # llama.cpp runs the MXFP4 blocks (f32 activations) near mlx-lm's fp16 run of the same weights
    ours = llama_logits(gguf, PROMPT)
    gap = float(np.abs(ours - mlx_logits).max())
    assert np.isfinite(ours).all() and gap < 0.05 * float(mlx_logits.max() - mlx_logits.min()), gap

    ct, report = tmp_path / "ct", tmp_path / "ct.json"
    run_cli("mlx->compressed-tensors", folder, ct, "--report", report)
    _exact_rows(report, "mxfp4-pack-quantized")
    _ct_runtime_holds_our_values(ct, source, "e2m1")

    fp8, report = tmp_path / "fp8", tmp_path / "fp8.json"
    run_cli("mlx->fp8", folder, fp8, "--report", report)
    _exact_rows(report, "fp8-128x128-e8m0")  # loaded by transformers in tests/formats/fp8/test_fp8_tiles.py


def test_mxfp8_to_compressed_tensors_mxfp8(tmp_path):
    """mlx's mxfp8 into compressed-tensors' own MXFP8 format (mxfp8-quantized, what llm-compressor's MXFP8A16
    writes: tests/formats/compressed_tensors reads its fixture), codes and exponents kept."""
    folder = PRODUCED / "mxfp8" / "model"
    out, report = tmp_path / "ct", tmp_path / "ct.json"
    run_cli("mlx->compressed-tensors", folder, out, "--report", report)
    _exact_rows(report, "mxfp8-quantized")
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    assert [(g["format"], g["weights"]["type"], g["weights"]["strategy"], g["weights"]["group_size"],
             g["weights"]["scale_dtype"]) for g in groups.values()] \
        == [("mxfp8-quantized", "float", "group", 32, "torch.uint8")]
    _ct_runtime_holds_our_values(out, _grids(MlxSource(folder)), "e4m3")
    # and back: compressed-tensors' MXFP8 into mlx's mxfp8 mode gives mlx's own words and exponents byte for byte
    # (mlx-lm loading an mxfp8 folder we write: test_mx_sources_write_mlx_float_modes)
    back, report = tmp_path / "back", tmp_path / "back.json"
    run_cli("compressed-tensors->mlx", out, back, "--report", report)
    _exact_rows(report, "mlx mxfp8 g32")
    want, mine = load_file(str(folder / "model.safetensors")), load_file(str(back / "model.safetensors"))
    kept = [k for k in want if k.rsplit(".", 1)[0] + ".scales" in want and not k.startswith(("model.embed", "lm_head"))]
    assert len(kept) == 28 and all(torch.equal(want[k], mine[k]) for k in kept), kept


@pytest.mark.parametrize("case", ["biases", "scale_dtype", "bits"])
def test_bad_float_mode_input_is_one_line(tmp_path, case):
    import shutil

    from helpers import edit_safetensors, expect_user_error

    src = tmp_path / "src"
    shutil.copytree(PRODUCED / "mxfp8" / "model", src)
    st, target = src / "model.safetensors", "model.layers.0.mlp.down_proj"
    if case == "biases":  # an affine part in a float-mode module
        edit_safetensors(st, lambda t: t.__setitem__(f"{target}.biases", t[f"{target}.scales"].to(torch.float16)))
        needles = ("has biases", f"{target}.biases")
    elif case == "scale_dtype":
        edit_safetensors(st, lambda t: t.__setitem__(f"{target}.scales", t[f"{target}.scales"].to(torch.float16)))
        needles = ("uint8 E8M0", f"{target}.scales")
    else:  # the packed-shape check is the affine one (test_mlx.py)
        cfg = json.loads((src / "config.json").read_text())
        cfg["quantization"]["group_size"] = 64
        (src / "config.json").write_text(json.dumps(cfg))
        needles = ("mxfp8 takes only bits 8, group_size 32", "config.json")
    expect_user_error("mlx->compressed-tensors", src, tmp_path, *needles)


def _quark(case: str):
    from qconvert.formats.quark.reader import QuarkSource

    return PRODUCED.parent / "quark" / case, QuarkSource


@pytest.mark.parametrize("pair, source, mode", [
    ("quark->mlx", lambda: _quark("mxfp4"), "mxfp4"),  # AMD Quark's export (amd-quark 0.13)
    ("quark->mlx", lambda: _quark("mxfp8"), "mxfp8"),  # Quark's MXFP8, built from its layout (no export on CPU)
])
def test_mx_sources_write_mlx_float_modes(pair, source, mode, tmp_path):
    """Any MXFP4 / MXFP8 grid is written in mlx's mxfp4 / mxfp8 mode with its codes and exponents, mlx-lm loads
    it and mx.dequantize gives the source's values bit for bit; mlx's own folder of that mode round-trips byte
    for byte."""
    import subprocess

    folder, reader = source()
    out, report = tmp_path / "mlx", tmp_path / "r.json"
    run_cli(pair, folder, out, "--report", report)
    assert len(_exact_rows(report, f"mlx {mode} g32", 7)) == 7
    assert json.loads((out / "config.json").read_text())["quantization"]["mode"] == mode
    mlx_py = PRODUCED.parents[1].parent / ".venvs" / "mlx" / "bin" / "python"
    driver = PRODUCED.parents[1] / "support" / "mlx_driver.py"
    proc = subprocess.run([str(mlx_py), str(driver), "load", str(out), str(tmp_path / "mx.st"), json.dumps(PROMPT)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    modules = json.loads(proc.stdout)["quantized"]
    assert len(modules) == 7 and {m["mode"] for m in modules.values()} == {mode}
    got = load_file(str(tmp_path / "mx.st"))
    assert np.isfinite(got["__logits__"].numpy()).all()
    for name, rec in _grids(reader(folder)).items():
        assert torch.equal(_bits(got[name]), _bits(rec.load().dequantize(torch.float32))), name
    back = tmp_path / "back"
    run_cli("mlx->mlx", PRODUCED / mode / "model", back)
    want, mine = load_file(str(PRODUCED / mode / "model" / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert sorted(want) == sorted(mine) and all(torch.equal(want[k], mine[k]) for k in want)

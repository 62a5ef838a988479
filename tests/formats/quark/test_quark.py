"""AMD Quark OCP MXFP4 checkpoints (quant_method "quark"), made by amd-quark 0.13 on the CPU
(tests/producer_fixtures/quark, scripts/producers/quark.py): read equal to Quark's own dequantization bit for bit,
their codes kept in GGUF MXFP4 (llama.cpp runs it), UQFF mxfp4, compressed-tensors mxfp4-pack-quantized
(transformers loads it) and cast exactly into FP8 128x128 tiles; bad input refused in one line."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import fixtures
from helpers import expect_user_error, llama_logits, run_cli, transformers_logits

from qconvert.converters.checker import EXACT, check
from qconvert.converters.errors import BadInput
from qconvert.formats.compressed_tensors.reader import CtSource
from qconvert.formats.quark.reader import QuarkSource

TESTS = Path(__file__).resolve().parents[2]
QUARK = TESTS / "producer_fixtures" / "quark" / "mxfp4"
PROMPT = fixtures.prompt_ids()


def _sha(w: torch.Tensor) -> str:
    return hashlib.sha256(w.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _grids(src) -> dict:
    return {r.name: r for r in src.records() if r.is_grid}


def test_reads_equal_quarks_own_dequantization():
    oracle = json.loads((QUARK / "oracle.json").read_text())
    grids = _grids(QuarkSource(QUARK))
    assert sorted(grids) == sorted(oracle["weights"]) and len(grids) == 7
    for name, rec in grids.items():
        w = rec.load().dequantize(torch.float32)
        assert _sha(w) == oracle["weights"][name]["sha256"] == oracle["weights_before_export"][name]["sha256"], name


def test_every_mxfp4_target_keeps_the_codes():
    """The checker's verdicts for every module (the writers plan from these; GGUF and compressed-tensors are
    written and run below, FP8 tiles in tests/formats/fp8/test_fp8_tiles.py)."""
    from qconvert.formats.common.fp8_tiles import FP8_TILE
    from qconvert.formats.compressed_tensors.schemes import CT_FLOAT
    from qconvert.formats.gguf.schemes import GGUF_SCHEMES
    from qconvert.formats.uqff.schemes import UQFF_SCHEMES

    grids = _grids(QuarkSource(QUARK))
    for scheme in (GGUF_SCHEMES["MXFP4"], UQFF_SCHEMES["mxfp4"], CT_FLOAT["mxfp4-pack-quantized"], FP8_TILE):
        for name, rec in grids.items():
            d = check(rec.params, rec.shape, scheme)
            assert d.verdict == EXACT and d.keeps_codes, (scheme.name, name, d.reason)


@pytest.mark.parametrize("target, type_name", [("gguf", "MXFP4"), ("compressed-tensors", "mxfp4-pack-quantized")])
def test_mxfp4_codes_move_exactly(target, type_name, tmp_path):
    out, report = tmp_path / ("m.gguf" if target == "gguf" else "m"), tmp_path / "r.json"
    run_cli(f"quark->{target}", QUARK, out, "--report", report)
    rows = [r for r in json.loads(report.read_text())["tensors"] if r["target"] == type_name]
    assert len(rows) == 7 and all(r["verdict"] == EXACT and r["max_abs_err"] == 0.0 for r in rows), rows
    if target == "gguf":  # llama.cpp runs our MXFP4 blocks within 0.05 of the logit range of transformers
        dense = tmp_path / "dense"
        run_cli("quark->hf", QUARK, dense, "--type", "f32")
        ours, ref = llama_logits(out, PROMPT), transformers_logits(dense, PROMPT)
        assert np.isfinite(ours).all() and float(np.abs(ours - ref).max()) < 0.05 * float(ref.max() - ref.min())
    if target == "compressed-tensors":  # its runtime holds Quark's values (rounded to bf16, as it decompresses)
        from ct_runtime import _as_runtime, _ct_model

        params = {n: t.detach() for n, t in _ct_model(out, dtype=torch.float32).named_parameters()}
        written = _grids(CtSource(out))
        source = _grids(QuarkSource(QUARK))
        for name, rec in written.items():
            assert torch.equal(rec.load().codes, source[name].load().codes), name
            assert torch.equal(_as_runtime(rec, params[name].dtype), params[name]), name


def _rewrite_config(src: Path, fn) -> None:
    cfg = json.loads((src / "config.json").read_text())
    fn(cfg["quantization_config"])
    (src / "config.json").write_text(json.dumps(cfg))


def _rewrite_tensors(src: Path, fn) -> None:
    tensors = load_file(str(src / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})


Q = "model.layers.0.mlp.down_proj"  # the first quantized module of the file
BAD = {
    "mxfp6-scheme": (lambda src: _rewrite_config(src, lambda qc: qc["global_quant_config"]["weight"].update(
        dtype="fp6_e2m3")), ("global_quant_config.weight", "fp6_e2m3", "model.safetensors", f"{Q}.weight")),
    # MXFP4's packed nibbles under an MXFP8 config: one code a byte would make half the inputs the scales describe
    "mxfp8-label-on-mxfp4-codes": (lambda src: _rewrite_config(src, lambda qc: qc["global_quant_config"]["weight"]
                                                               .update(dtype="fp8_e4m3")),
                                   ("scale shape", f"{Q}.weight_scale")),
    # scripts/fuzz (seed 2028, case 6554): a number for the exclude list raised a TypeError
    "exclude-not-a-list": (lambda src: _rewrite_config(src, lambda qc: qc.update(exclude=-1e300)),
                           ("quantization_config.exclude", "config.json")),
    "excluded-but-quantized": (lambda src: _rewrite_config(src, lambda qc: qc["layer_quant_config"].update(
        {f"{Q}": {"weight": None}})), ("not quantized", f"{Q}.weight", "model.safetensors")),
    "scale-shape": (lambda src: _rewrite_tensors(src, lambda t: t.update(
        {f"{Q}.weight_scale": t[f"{Q}.weight_scale"][:, :2].contiguous()})), ("scale shape", f"{Q}.weight_scale")),
    "weight-without-scale": (lambda src: _rewrite_tensors(src, lambda t: t.pop(f"{Q}.weight_scale")),
                             ("without its weight_scale", f"{Q}.weight_scale")),
    "nan-scale": (lambda src: _rewrite_tensors(src, lambda t: t[f"{Q}.weight_scale"].__setitem__((0, 0), 255)),
                  ("0xFF", f"{Q}.weight_scale")),
}


def test_bad_quark_input_is_refused_naming_the_file_and_tensor(tmp_path):
    """Each case refused by the reader (in this process); the first through the CLI as well (one line, exit 2,
    nothing written)."""
    for i, case in enumerate(sorted(BAD)):
        src = tmp_path / case
        shutil.copytree(QUARK, src)
        edit, needles = BAD[case]
        edit(src)
        with pytest.raises(BadInput) as err:
            QuarkSource(src)
        for needle in needles:
            assert needle in str(err.value), (case, needle, str(err.value))
        if i == 0:
            expect_user_error("quark->gguf", src, tmp_path, *needles)


# -- OCP MXFP8 ---------------------------------------------------------------------------------------------
# amd-quark 0.13 quantizes MXFP8 on the CPU but cannot export it real-quantized (real_quantize_fp8_e4m3 raises for
# per_group): the fixture is Quark's quantization and config with the files built from the documented layout, its
# oracle Quark's fake-quantized weights (scripts/producers/quark.py asserts the built codes decode to them)
QUARK8 = TESTS / "producer_fixtures" / "quark" / "mxfp8"


def test_mxfp8_reads_equal_quarks_own_dequantization():
    oracle = json.loads((QUARK8 / "oracle.json").read_text())["weights_before_export"]
    grids = _grids(QuarkSource(QUARK8))
    assert sorted(grids) == sorted(oracle) and len(grids) == 7
    for name, rec in grids.items():
        assert rec.params.element == "e4m3" and rec.params.scales.dtype == torch.float8_e8m0fnu, name
        assert _sha(rec.load().dequantize(torch.float32)) == oracle[name]["sha256"], name


def test_mxfp8_to_compressed_tensors_loads_in_transformers_with_quarks_weights(tmp_path):
    """Codes and exponents kept in compressed-tensors' mxfp8-quantized, transformers + compressed-tensors
    decompress them to Quark's values (in bf16, as compressors/mxfp8 decodes)."""
    from ct_runtime import _as_runtime, _ct_model

    out, report = tmp_path / "ct", tmp_path / "r.json"
    run_cli("quark->compressed-tensors", QUARK8, out, "--report", report)
    rows = [r for r in json.loads(report.read_text())["tensors"] if r["target"] == "mxfp8-quantized"]
    assert len(rows) == 7 and all(r["verdict"] == EXACT and r["max_abs_err"] == 0.0 for r in rows), rows
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "mxfp8-quantized"
    params = {n: t.detach() for n, t in _ct_model(out, dtype=torch.float32).named_parameters()}
    source = _grids(QuarkSource(QUARK8))
    written = _grids(CtSource(out))
    assert sorted(written) == sorted(source)
    for name, rec in written.items():
        assert torch.equal(rec.load().codes, source[name].load().codes), name
        assert torch.equal(rec.load().dequantize(torch.float32), source[name].load().dequantize(torch.float32)), name
        assert torch.equal(_as_runtime(rec, params[name].dtype), params[name]), name


def test_mxfp8_to_gguf_verdicts(tmp_path):
    """GGUF has no MXFP8 type: Q8_0 (int8 codes under an fp16 scale per 32) does not hold E4M3 values times a
    power of two, so the default type is refused with the aligned choice; F32 holds every value and BF16 every one
    above 2**-133, written exact (the checker decides from the values) and read back equal."""
    proc = run_cli("quark->gguf", QUARK8, tmp_path / "refused.gguf", check_rc=2)
    err = proc.stderr.strip()
    assert "lossy requantization to Q8_0" in err and "e4m3 float codes are not a uniform grid" in err, err
    assert "aligned choice: --type f32 (exact)" in err and not (tmp_path / "refused.gguf").exists(), err
    from qconvert.formats.gguf.reader import GgufSource

    out, report = tmp_path / "m.gguf", tmp_path / "r.json"
    run_cli("quark->gguf", QUARK8, out, "--type", "bf16", "--report", report)
    rows = [r for r in json.loads(report.read_text())["tensors"] if r["source"] == "mxfp8 g32"]
    assert len(rows) == 7 and all(r["target"] == "BF16" and r["verdict"] == EXACT and r["max_abs_err"] == 0.0
                                  for r in rows), rows
    back = {r.name: r for r in GgufSource(out).records()}  # q/k rows un-permuted to Hugging Face's order
    for name, rec in _grids(QuarkSource(QUARK8)).items():
        got = back[name].load().dequantize(torch.float32)
        assert torch.equal(got, rec.load().dequantize(torch.float32)), name

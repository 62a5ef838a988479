"""HQQ: reader, writer, hqq->gguf, checked against hqq 0.2.8.post1 itself (and transformers 4.57.6).

hqq runs in its own environment (<repo>/.venvs/hqq, made by scripts/test_env.d/20-hqq.sh); tests reach it
through tests/support/fixtures_hqq.py in a subprocess (tests/support/hqq_env.py): `build` makes the fixtures
with hqq (cached under tests/_fixtures/hqq), `verify` loads a checkpoint with hqq's or transformers' own loader
and dumps what that loader dequantizes, plus the logits.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import fixtures
from helpers import edit_safetensors, expect_user_error, llama_logits, run_cli, transformers_logits
from hqq_env import _verify, hqqfx  # noqa: F401  (hqqfx: the hqq fixtures, built by hqq's own environment)

VARIANTS = ("b4_g64_ax1", "b4_g64_ax0", "b3_g64_ax1", "b3_g64_ax0", "b2_g64_ax1", "b1_g64_ax1",
            "b8_g128_ax1_bias", "b4_g64_ax1_vaf", "mixed", "b4_g64_ax1_fp16", "b4_g64_ax0_bf16")


def _our_dequant(path: Path, fmt: str = "hqq") -> dict:
    from qconvert.converters.run import open_source

    src = open_source(fmt, path)
    return {r.name: r.load().dequantize(r.params.compute_dtype) for r in src.records() if r.is_grid}


def _sources():
    out = [(v, s) for v in VARIANTS for s in ("tf", "lib")]
    return out + [("legacy_b4_g64_ax0", "lib")]


# ---------------------------------------------------------------------------------------------------
# reading: our dequantization is hqq's, bit for bit


@pytest.mark.parametrize("variant,style", _sources(), ids=[f"{v}-{s}" for v, s in _sources()])
def test_dequant_equals_hqq(hqqfx, variant, style):
    ref = load_file(str(hqqfx["root"] / variant / "reference.safetensors"))
    ours = _our_dequant(hqqfx["root"] / variant / style)
    assert sorted(ours) == sorted(k for k in ref if k != "__logits__")
    for name, w in ours.items():
        assert w.dtype == ref[name].dtype, name
        assert torch.equal(w, ref[name]), (name, float((w.float() - ref[name].float()).abs().max()))


def test_reader_facts(hqqfx):
    """Per-layer settings come from each layer's own tensors (the mixed variant), and the sniffers agree."""
    from qconvert.converters.registry import detect_format
    from qconvert.formats.hqq.reader import open_hqq

    root = hqqfx["root"]
    src = open_hqq(root / "mixed" / "tf")
    got = {r.name.split(".", 3)[3]: (r.params.bits, r.params.group_size, r.params.axis)
           for r in src.records() if r.is_grid and ".layers.0." in r.name}
    assert got == {"self_attn.q_proj.weight": (4, 64, 1), "self_attn.k_proj.weight": (4, 64, 1),
                   "self_attn.v_proj.weight": (4, 64, 0), "self_attn.o_proj.weight": (3, 64, 1),
                   "mlp.gate_proj.weight": (2, 32, 1), "mlp.up_proj.weight": (3, 64, 0),
                   "mlp.down_proj.weight": (8, 128, 0)}
    fp16 = next(r for r in open_hqq(root / "b4_g64_ax1_fp16" / "lib").records() if r.is_grid)
    assert fp16.params.compute_dtype == torch.float16
    biases = [r.name for r in open_hqq(root / "b8_g128_ax1_bias" / "lib").records() if r.name.endswith(".bias")]
    assert len(biases) == 6  # q/k/v of 2 layers
    for d in (root / "mixed" / "tf", root / "mixed" / "lib", root / "legacy_b4_g64_ax0" / "lib"):
        assert detect_format(d) == "hqq"
    proc = run_cli("inspect", root / "legacy_b4_g64_ax0" / "lib")
    assert "legacy meta" in proc.stdout


def test_axis0_row_ops_match_dequant(hqqfx):
    """Axis-0 grids keep their strided-row groups through row slices and permutations (the GGUF writer
    permutes Q/K rows; the runner measures row bands)."""
    from qconvert.formats.hqq.reader import open_hqq

    rec = next(r for r in open_hqq(hqqfx["root"] / "b4_g64_ax0" / "tf").records() if r.is_grid)
    grid = rec.load()
    full = grid.dequantize()
    perm = torch.randperm(full.shape[0], generator=torch.Generator().manual_seed(0))
    assert torch.equal(grid.permute_rows(perm).dequantize(), full[perm])
    assert torch.equal(grid.row_slice(5, 77).dequantize(), full[5:77])
    assert torch.equal(grid.permute_rows(perm).row_slice(3, 9).dequantize(), full[perm][3:9])


# ---------------------------------------------------------------------------------------------------
# writing: hqq (and transformers) load what we write, with hqq's dequantization unchanged

ROUND_TRIPS = [  # (variant, source container, --type, loader, compute dtype for the hqq loader)
    ("mixed", "tf", "qmodel", "hqq", "float32"),
    ("mixed", "lib", "safetensors", "transformers", "float32"),
    ("b4_g64_ax1_vaf", "lib", "safetensors", "transformers", "float32"),
    ("b8_g128_ax1_bias", "tf", "qmodel", "hqq", "float32"),
    ("b3_g64_ax0", "lib", "safetensors", "transformers", "float32"),
    ("b4_g64_ax1_fp16", "tf", "qmodel", "hqq", "float16"),
    ("b4_g64_ax0_bf16", "lib", "safetensors", "hqq-safetensors", "bfloat16"),
    ("b4_g64_ax1_fp16", "lib", "safetensors", "hqq-safetensors", "float16"),
    ("legacy_b4_g64_ax0", "lib", "safetensors", "transformers", "float32"),
]


@pytest.mark.parametrize("variant,style,out_type,loader,compute", ROUND_TRIPS,
                         ids=[f"{v}-{s}-to-{t}" for v, s, t, _, _ in ROUND_TRIPS])
def test_written_hqq_loads_in_hqq(hqqfx, tmp_path, variant, style, out_type, loader, compute):
    out = tmp_path / "out"
    report = tmp_path / "report.json"
    run_cli("hqq->hqq", hqqfx["root"] / variant / style, out, "--type", out_type, "--report", report)
    summary = json.loads(report.read_text())["summary"]
    assert summary["verdicts"]["exact"] == summary["tensors"] and summary["max_abs_err"] == 0.0
    assert (out / ("qmodel.pt" if out_type == "qmodel" else "model.safetensors")).exists()
    if out_type == "safetensors":
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        assert qc["quant_method"] == "hqq" and "skip_modules" in qc and "quant_config" in qc
    loaded = _verify(out, tmp_path / "loaded.safetensors", loader, compute)
    ref = load_file(str(hqqfx["root"] / variant / "reference.safetensors"))
    if loader == "hqq-safetensors":
        # the per-layer loader builds the rest of the model itself (rotary tables in the compute dtype), so
        # its logits are compared with the same loader on hqq's own save_pretrained of this model
        ref["__logits__"] = _verify(hqqfx["root"] / variant / "tf", tmp_path / "theirs.safetensors", loader,
                                    compute)["__logits__"]
    assert sorted(loaded) == sorted(ref)
    for name in ref:
        assert loaded[name].dtype == ref[name].dtype and torch.equal(loaded[name], ref[name]), name
    # and our own reader reads our output back to the same values
    ours = _our_dequant(out)
    for name, w in ours.items():
        assert torch.equal(w, ref[name]), name


def _same_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Bitwise equality (view_as_float codes are float32 bit patterns, some of them NaN)."""
    return torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("variant", ["b4_g64_ax1", "b3_g64_ax0", "b1_g64_ax1", "b4_g64_ax1_vaf", "mixed",
                                     "b8_g128_ax1_bias", "b4_g64_ax1_fp16"])
def test_same_container_is_byte_identical(hqqfx, tmp_path, variant):
    """Reading and writing the transformers container reproduces hqq's tensors exactly, all 19-20 keys."""
    out = tmp_path / "out"
    run_cli("hqq->hqq", hqqfx["root"] / variant / "tf", out)
    a = safe_open(str(out / "model.safetensors"), "pt")
    b = safe_open(str(hqqfx["root"] / variant / "tf" / "model.safetensors"), "pt")
    assert set(a.keys()) == set(b.keys())
    for k in b.keys():
        x, y = a.get_tensor(k), b.get_tensor(k)
        assert x.dtype == y.dtype and x.shape == y.shape and _same_bytes(x, y), k


@pytest.mark.parametrize("variant", ["mixed", "b4_g64_ax1_fp16", "b8_g128_ax1_bias"])
def test_same_qmodel_container_is_identical(hqqfx, tmp_path, variant):
    """qmodel.pt -> qmodel.pt: every module entry as hqq's save_quantized wrote it (values and types)."""
    out = tmp_path / "out"
    run_cli("hqq->hqq", hqqfx["root"] / variant / "lib", out)
    ours = torch.load(out / "qmodel.pt", weights_only=True)
    theirs = torch.load(hqqfx["root"] / variant / "lib" / "qmodel.pt", weights_only=True)
    assert list(ours) == list(theirs)
    for module, state in theirs.items():
        assert set(ours[module]) == set(state), module
        for key, value in state.items():
            got = ours[module][key]
            if isinstance(value, torch.Tensor):
                assert got.dtype == value.dtype and torch.equal(got, value), (module, key)
            else:
                assert type(got) is type(value) and got == value, (module, key, got, value)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


@pytest.mark.parametrize("scheme,variant", [("4g64a1", "b4_g64_ax1"), ("4g64a0", "b4_g64_ax0"),
                                            ("3g64a0", "b3_g64_ax0"), ("2g64", "b2_g64_ax1")])
def test_requant_is_hqqs_own_quantizer(hqqfx, tmp_path, scheme, variant):
    """Dense -> HQQ with our quantizer gives the codes, scales and zeros hqq 0.2.8 itself produced from the
    same base weights; refused without --allow-requant."""
    base = hqqfx["root"] / "base_llama"
    out = tmp_path / "out"
    proc = run_cli("hf->hqq", base, out, "--type", scheme, check_rc=2)
    assert "--allow-requant" in proc.stderr and not out.exists()
    run_cli("hf->hqq", base, out, "--type", scheme, "--allow-requant")
    a = safe_open(str(out / "model.safetensors"), "pt")
    b = safe_open(str(hqqfx["root"] / variant / "tf" / "model.safetensors"), "pt")
    assert set(a.keys()) == set(b.keys())
    hqq_keys = [k for k in b.keys() if ".layers." in k and not k.endswith("norm.weight")]
    assert len(hqq_keys) == 14 * 19
    for k in hqq_keys:
        assert torch.equal(a.get_tensor(k), b.get_tensor(k)), k


def test_gptq_to_hqq_exact_and_loads(fx, hqqfx, tmp_path):
    """Integer zero points move into hqq's float zero exactly; transformers+hqq dequantize to gptqmodel's
    weights (gptqmodel's reference is those exact values rounded once to fp16)."""
    variant = fx["variants"]["v1_b4_g32_sym"]
    out = tmp_path / "out"
    report = tmp_path / "report.json"
    run_cli("gptq->hqq", variant["ckpt"], out, "--report", report)
    assert json.loads(report.read_text())["summary"]["max_abs_err"] == 0.0
    loaded = _verify(out, tmp_path / "loaded.safetensors", "transformers")
    ours = _our_dequant(variant["ckpt"], "gptq")
    gptq_weights, _ = fixtures.load_reference(variant["reference"])
    assert len(ours) == len(gptq_weights) == 14
    for name, w in ours.items():
        assert torch.equal(loaded[name], w), name
        gptqmodel_w = torch.from_numpy(gptq_weights[name[: -len(".weight")]])
        assert torch.equal(loaded[name].to(torch.float16), gptqmodel_w), name
    proc = run_cli("gptq->hqq", fx["variants"]["v1_b4_g128_sym_act"]["ckpt"], tmp_path / "act", check_rc=2)
    assert "act-order" in proc.stderr and "--allow-requant" in proc.stderr


# ---------------------------------------------------------------------------------------------------
# hqq -> gguf


def _logit_gap(gguf_path: Path, hf_dir: Path, ids) -> float:
    ours = llama_logits(gguf_path, ids)
    theirs = transformers_logits(hf_dir, ids)
    return float(np.abs(ours - theirs).max() / (theirs.max() - theirs.min()))


def test_hqq_axis1_to_q4_1_runs_in_llama_cpp(hqqfx, tmp_path):
    src = hqqfx["root"] / "b4_g64_ax1" / "tf"
    gguf_path, hf_dir, report = tmp_path / "m.gguf", tmp_path / "hf", tmp_path / "report.json"
    run_cli("hqq->gguf", src, gguf_path, "--report", report)
    rep = json.loads(report.read_text())
    grids = [t for t in rep["tensors"] if t["source"].startswith("4-bit")]
    assert len(grids) == 14 and all(t["target"] == "Q4_1" and t["verdict"] == "near-exact" for t in grids)
    # codes kept: the only error is fp16 rounding of d and m, far below one quantization step
    assert max(t["max_abs_err"] for t in grids) < 1e-3
    run_cli("hqq->hf", src, hf_dir, "--type", "f32")
    ids = hqqfx["prompt"]
    # the dense dequantization is hqq's: transformers on it gives hqq's own logits
    ref_logits = load_file(str(hqqfx["root"] / "b4_g64_ax1" / "reference.safetensors"))["__logits__"].numpy()
    theirs = transformers_logits(hf_dir, ids)
    assert np.abs(theirs - ref_logits).max() <= 1e-4 * (ref_logits.max() - ref_logits.min())
    assert _logit_gap(gguf_path, hf_dir, ids) < 0.05


def test_hqq_axis0_to_gguf_needs_requant(hqqfx, tmp_path):
    src = hqqfx["root"] / "b4_g64_ax0" / "lib"
    gguf_path = tmp_path / "m.gguf"
    proc = run_cli("hqq->gguf", src, gguf_path, check_rc=2)
    err = proc.stderr
    assert "axis-0" in err and "--allow-requant" in err and "aligned choice: --type f32" in err
    assert not gguf_path.exists()
    # requantizing 4-bit codes onto another 4-bit grid adds a second full rounding (about 7% of the logit
    # range on this tiny model); Q8_0 keeps the requantization noise small
    run_cli("hqq->gguf", src, gguf_path, "--type", "q8_0", "--allow-requant")
    run_cli("hqq->hf", src, tmp_path / "hf", "--type", "f32")
    assert _logit_gap(gguf_path, tmp_path / "hf", hqqfx["prompt"]) < 0.05


def test_fp16_compute_to_q4_1_is_near_exact(hqqfx, tmp_path):
    report = tmp_path / "report.json"
    run_cli("hqq->gguf", hqqfx["root"] / "b4_g64_ax1_fp16" / "lib", tmp_path / "m.gguf", "--report", report)
    grids = [t for t in json.loads(report.read_text())["tensors"] if t["source"].startswith("4-bit")]
    assert grids and all(t["verdict"] == "near-exact" for t in grids)


# ---------------------------------------------------------------------------------------------------
# bad input: one line, exit 2, nothing written


def _expect_error(src, tmp_path, *needles, pair="hqq->gguf"):
    return expect_user_error(pair, src, tmp_path, *needles, out_name="out.gguf")


class _Payload:
    """Unpickling this would create a marker file: a weights-only loader must refuse it instead."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_qmodel_with_object_is_refused_not_unpickled(hqqfx, tmp_path):
    src = tmp_path / "ckpt"
    shutil.copytree(hqqfx["root"] / "b4_g64_ax1" / "lib", src)
    weights = torch.load(src / "qmodel.pt", weights_only=True)
    marker = tmp_path / "unpickled"
    weights["model.norm"]["evil"] = _Payload(marker)
    torch.save(weights, src / "qmodel.pt")
    _expect_error(src, tmp_path, "qmodel.pt", "refused")
    assert not marker.exists()


@pytest.fixture
def tf_copy(hqqfx, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(hqqfx["root"] / "b4_g64_ax1" / "tf", dst)
    return dst


def test_truncated_safetensors(tf_copy, tmp_path):
    path = tf_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    _expect_error(tf_copy, tmp_path, "model.safetensors", "cannot read")


@pytest.mark.parametrize("key", ["scale", "zero"])
def test_missing_scale_or_zero(tf_copy, tmp_path, key):
    name = f"model.layers.1.mlp.up_proj.{key}"
    edit_safetensors(tf_copy / "model.safetensors", lambda t: t.pop(name))
    _expect_error(tf_copy, tmp_path, "model.safetensors", name, f"no {key}")


def test_missing_zero_in_qmodel(hqqfx, tmp_path):
    src = tmp_path / "ckpt"
    shutil.copytree(hqqfx["root"] / "b3_g64_ax0" / "lib", src)
    weights = torch.load(src / "qmodel.pt", weights_only=True)
    del weights["model.layers.0.self_attn.k_proj"]["zero"]
    torch.save(weights, src / "qmodel.pt")
    _expect_error(src, tmp_path, "qmodel.pt", "model.layers.0.self_attn.k_proj.zero")


@pytest.mark.parametrize("nbits", [7, 9, 0])
def test_unknown_nbits(tf_copy, tmp_path, nbits):
    name = "model.layers.0.self_attn.q_proj.nbits"
    edit_safetensors(tf_copy / "model.safetensors", lambda t: t.__setitem__(name, torch.tensor(nbits, dtype=torch.int32)))
    _expect_error(tf_copy, tmp_path, name, f"unsupported nbits {nbits}")


def test_dtype_string_is_whitelisted(tf_copy, tmp_path):
    """hqq evals this string; we only look it up."""
    name = "model.layers.0.self_attn.q_proj.compute_dtype"
    code = "__import__('os').system('true')"
    edit_safetensors(tf_copy / "model.safetensors",
                      lambda t: t.__setitem__(name, torch.tensor(list(code.encode()), dtype=torch.uint8)))
    _expect_error(tf_copy, tmp_path, name, "unknown dtype")


def test_wrong_packed_shape(tf_copy, tmp_path):
    name = "model.layers.0.mlp.down_proj.W_q"
    edit_safetensors(tf_copy / "model.safetensors", lambda t: t.__setitem__(name, t[name][:-2].clone()))
    _expect_error(tf_copy, tmp_path, name, "W_q holds")

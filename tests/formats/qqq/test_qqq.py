"""QQQ: reader bit-exact against gptqmodel's runtime, writer loadable by gptqmodel, QQQ into GGUF / GPTQ /
hf checked by their consumers (llama.cpp, gptqmodel, transformers), and bad inputs.

References come from gptqmodel 7.6.0 itself (tests/support/fixtures_qqq.py): the int8 weights and the channel
scale its CPU kernel QQQTorchLinear multiplies with, and its logits.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import fixtures
import fixtures_qqq
import helpers
from qconvert.formats.qqq.reader import QqqSource
from qconvert.kernels.qqq_perm import (CHANNEL_SCALE_PERM, GROUP_SCALE_PERM, code_permutation, pack_qqq_codes,
                                       unpack_qqq_codes)

QQQ_VARIANTS = ("qqq_g128", "qqq_gm1")
LOGIT_TOLERANCE = 0.05  # of the reference's logit range (llama.cpp / a different kernel)
# QQQ's runtime quantizes activations to int8 per token; a GPTQ model and its exact QQQ copy differ by that
ACTIVATION_TOLERANCE = 0.02


@pytest.fixture(scope="module")
def qfx():
    return fixtures_qqq.ensure_qqq_fixtures()


def _ref(qfx, variant):
    return fixtures_qqq.load_qqq_reference(qfx["variants"][variant]["reference"])


def _report(path):
    return json.loads(path.read_text())


# -- kernels ------------------------------------------------------------------------------------------

def test_permutations_match_gptqmodel():
    from gptqmodel.nn_modules.qlinear.qqq import QQQLinear

    for group_size, mode in ((128, "grouped"), (-1, "channel")):
        layer = QQQLinear(bits=4, group_size=group_size, desc_act=False, sym=True, in_features=256,
                          out_features=128, register_buffers=False)
        perm, _, scale_perm, _, scale_perm_single, _ = layer._get_perms()
        assert torch.equal(code_permutation(mode), torch.as_tensor(perm, dtype=torch.int64)), mode
        assert GROUP_SCALE_PERM.tolist() == list(scale_perm)
        assert CHANNEL_SCALE_PERM.tolist() == list(scale_perm_single)


@pytest.mark.parametrize("mode", ["grouped", "channel"])
def test_pack_unpack_round_trip(mode):
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (192, 128), generator=g, dtype=torch.int64).to(torch.uint8)
    B = pack_qqq_codes(codes, mode)
    assert B.dtype == torch.int32 and tuple(B.shape) == (128 // 16, 192 * 2)
    assert torch.equal(unpack_qqq_codes(B, mode), codes)


# -- reader -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", QQQ_VARIANTS)
def test_dequantization_is_gptqmodels_runtime_bit_for_bit(qfx, variant):
    mods, _ = _ref(qfx, variant)
    src = QqqSource(qfx["variants"][variant]["ckpt"])
    seen = 0
    for rec in src.records():
        if not rec.is_grid:
            continue
        prefix = rec.name[: -len(".weight")]
        w8, s_channel = mods[prefix]
        grid = rec.load()
        p = grid.params
        if p.bits == 8:  # grouped: the int8 runtime grid itself
            assert torch.equal(grid.codes.to(torch.int16) - 128, w8.to(torch.int16)), prefix
            assert torch.equal(p.scales[:, 0].to(torch.float32), s_channel), prefix
        else:  # per-channel: a 4-bit grid with scale 16 * s_channel
            assert torch.equal((grid.codes.to(torch.int16) - 8) * 16, w8.to(torch.int16)), prefix
            assert torch.equal(p.scales[:, 0].to(torch.float32) / 16, s_channel), prefix
        expected = w8.to(torch.float32) * s_channel[:, None]
        assert torch.equal(grid.dequantize(torch.float32), expected), prefix
        seen += 1
    assert seen == len(mods) == 14
    if variant == "qqq_g128":  # in=128 layers are per-channel style, down_proj (in=256) is grouped
        kinds = {r.name: r.params.bits for r in src.records() if r.is_grid}
        assert kinds["model.layers.0.mlp.down_proj.weight"] == 8 and kinds["model.layers.0.self_attn.q_proj.weight"] == 4


def test_sniff_and_inspect(qfx):
    from qconvert.converters.registry import detect_format

    assert detect_format(qfx["variants"]["qqq_g128"]["ckpt"]) == "qqq"
    out = helpers.run_cli("inspect", qfx["variants"]["qqq_g128"]["ckpt"]).stdout
    assert "qqq" in out


# -- writer: QQQ that gptqmodel loads -----------------------------------------------------------------

@pytest.mark.parametrize("variant", QQQ_VARIANTS)
def test_qqq_to_qqq_is_a_copy_gptqmodel_loads(qfx, variant, tmp_path, prompt):
    ckpt = qfx["variants"][variant]["ckpt"]
    out = tmp_path / "out"
    helpers.run_cli("qqq->qqq", ckpt, out, "--report", tmp_path / "r.json")
    rep = _report(tmp_path / "r.json")
    assert rep["summary"]["verdicts"]["exact"] == rep["summary"]["tensors"] and rep["summary"]["max_abs_err"] == 0
    a, b = load_file(str(ckpt / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    _, ref_logits = _ref(qfx, variant)
    got = fixtures_qqq.qqq_logits(out, prompt)
    assert np.array_equal(got, ref_logits[0].numpy())


def _runtime_weights(ckpt):
    """gptqmodel's QQQ runtime weights of a checkpoint: {module: float32 [out, in]} (s_channel * w8)."""
    from gptqmodel import GPTQModel
    from gptqmodel.nn_modules.qlinear.qqq import QQQTorchLinear

    m = GPTQModel.load(str(ckpt), backend="qqq_torch", device="cpu", dtype=torch.float16)
    weights = {}
    with torch.inference_mode():
        for name, mod in m.model.named_modules():
            if isinstance(mod, QQQTorchLinear):
                w8, s_channel = mod._dequantize_weight_for_torch()
                weights[name] = w8.t().to(torch.float32) * s_channel.reshape(-1, 1).to(torch.float32)
    return weights


def test_gptq_per_channel_to_qqq_exact_and_loads(fx, qfx, tmp_path, prompt):
    variant = fx["variants"]["v1_b4_gm1_sym"]
    out = tmp_path / "q"
    helpers.run_cli("gptq->qqq", variant["ckpt"], out, "--report", tmp_path / "r.json")
    rep = _report(tmp_path / "r.json")
    assert rep["summary"]["verdicts"]["exact"] == rep["summary"]["tensors"] and rep["summary"]["max_abs_err"] == 0
    ref_weights, ref_logits = fixtures.load_reference(variant["reference"])
    runtime = _runtime_weights(out)
    assert len(runtime) == len(ref_weights) == 14
    for name, w in runtime.items():  # gptqmodel's QQQ runtime weights == its GPTQ runtime weights
        assert torch.equal(w.to(torch.float16), torch.from_numpy(ref_weights[name])), name
    got = fixtures_qqq.qqq_logits(out, prompt)
    spread = float(np.ptp(ref_logits))
    assert np.abs(got - ref_logits[0]).max() <= ACTIVATION_TOLERANCE * spread


def test_gptq_g128_to_qqq_requantizes_down_proj_only(fx, tmp_path):
    variant = fx["variants"]["v1_b4_g128_sym"]
    out = tmp_path / "q"
    proc = helpers.run_cli("gptq->qqq", variant["ckpt"], out, check_rc=2)
    assert "down_proj" in proc.stderr and "--allow-requant" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists()
    helpers.run_cli("gptq->qqq", variant["ckpt"], out, "--allow-requant", "--report", tmp_path / "r.json")
    tensors = _report(tmp_path / "r.json")["tensors"]
    for t in tensors:
        if ".down_proj." in t["name"]:
            assert t["verdict"] == "requantize" and 0 < t["max_abs_err"] < 0.01, t
        else:
            assert t["verdict"] == "exact" and t["max_abs_err"] == 0, t
    # what we measured is what gptqmodel runs: our decode of the written file == its runtime weights
    src = QqqSource(out)
    runtime = _runtime_weights(out)
    for rec in src.records():
        if rec.is_grid:
            assert torch.equal(rec.load().dequantize(torch.float32), runtime[rec.name[: -len(".weight")]]), rec.name


# -- QQQ into other formats ---------------------------------------------------------------------------

@pytest.mark.parametrize("variant", QQQ_VARIANTS)
def test_qqq_to_gguf_exact_and_runs_in_llama_cpp(qfx, variant, tmp_path, prompt):
    out = tmp_path / "m.gguf"
    helpers.run_cli("qqq->gguf", qfx["variants"][variant]["ckpt"], out, "--report", tmp_path / "r.json")
    rep = _report(tmp_path / "r.json")
    assert rep["summary"]["verdicts"]["exact"] == rep["summary"]["tensors"] and rep["summary"]["max_abs_err"] == 0
    types = {t["target"] for t in rep["tensors"] if ".mlp.down_proj." in t["name"]}
    assert types == ({"Q8_0"} if variant == "qqq_g128" else {"Q4_0"})
    # the GGUF blocks decode to gptqmodel's runtime weights (rows of q/k are rope-permuted: use mlp/o_proj)
    mods, ref_logits = _ref(qfx, variant)
    tensors = helpers.gguf_tensors(out)
    w8, s_channel = mods["model.layers.1.mlp.down_proj"]
    decoded = helpers.gguf_dequant(tensors["blk.1.ffn_down.weight"])
    assert np.array_equal(decoded, (w8.to(torch.float32) * s_channel[:, None]).numpy())
    got = helpers.llama_logits(out, prompt)
    spread = float(np.ptp(ref_logits.numpy()))
    assert np.abs(got - ref_logits[0].numpy()).max() <= LOGIT_TOLERANCE * spread


@pytest.mark.parametrize("variant", QQQ_VARIANTS)
def test_qqq_to_gptq_exact_and_loads(qfx, variant, tmp_path, prompt):
    out = tmp_path / "g"
    helpers.run_cli("qqq->gptq", qfx["variants"][variant]["ckpt"], out, "--report", tmp_path / "r.json")
    rep = _report(tmp_path / "r.json")
    assert rep["summary"]["verdicts"]["exact"] == rep["summary"]["tensors"] and rep["summary"]["max_abs_err"] == 0
    mods, ref_logits = _ref(qfx, variant)
    ref_path = tmp_path / "gptq_ref.safetensors"
    fixtures.gptq_reference(out, ref_path, prompt)
    weights, logits = fixtures.load_reference(ref_path)
    for name, (w8, s_channel) in mods.items():  # gptqmodel's GPTQ kernel runs the QQQ runtime weights
        expected = (w8.to(torch.float32) * s_channel[:, None]).to(torch.float16)
        assert torch.equal(torch.from_numpy(weights[name]), expected), name
    spread = float(np.ptp(ref_logits.numpy()))
    assert np.abs(logits[0] - ref_logits[0].numpy()).max() <= ACTIVATION_TOLERANCE * spread


def test_qqq_to_hf_runs_in_transformers(qfx, tmp_path, prompt):
    out = tmp_path / "hf"
    helpers.run_cli("qqq->hf", qfx["variants"]["qqq_g128"]["ckpt"], out, "--type", "f32", "--report", tmp_path / "r.json")
    rep = _report(tmp_path / "r.json")
    assert rep["summary"]["max_abs_err"] == 0
    _, ref_logits = _ref(qfx, "qqq_g128")
    got = helpers.transformers_logits(out, prompt)
    spread = float(np.ptp(ref_logits.numpy()))
    assert np.abs(got - ref_logits[0].numpy()).max() <= ACTIVATION_TOLERANCE * spread


def test_four_bit_view_is_the_ideal_grid(qfx):
    """The 4-bit view of a grouped layer keeps the codes; its weights differ from the runtime's int8
    rounding by at most half a channel step (plus the clamp, absent in this checkpoint's codes)."""
    src = QqqSource(qfx["variants"]["qqq_g128"]["ckpt"])
    prefix = "model.layers.0.mlp.down_proj"
    view = src.four_bit_grid(prefix)
    assert view.params.bits == 4 and view.params.group_size == 128
    runtime = src._load_grid(prefix)
    s = runtime.params.scales.to(torch.float32)
    diff = (view.dequantize() - runtime.dequantize()).abs() / s
    assert float(diff.max()) > 0  # the two semantics really differ
    assert float(torch.quantile(diff.flatten(), 0.99)) <= 0.51


# -- bad inputs ---------------------------------------------------------------------------------------

def _broken_copy(qfx, tmp_path, edit):
    src = qfx["variants"]["qqq_g128"]["ckpt"]
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    t = load_file(str(bad / "model.safetensors"))
    edit(t)
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    return bad


@pytest.mark.parametrize("case", ["wrong_shape", "missing_s_channel", "missing_s_group", "s_channel_shape"])
def test_bad_qqq_tensors(qfx, tmp_path, case):
    name = "model.layers.0.mlp.down_proj"

    def edit(t):
        if case == "wrong_shape":
            t[f"{name}.B"] = t[f"{name}.B"][:8].contiguous()
        elif case == "missing_s_channel":
            del t[f"{name}.s_channel"]
        elif case == "missing_s_group":
            del t[f"{name}.s_group"]
        else:
            t[f"{name}.s_channel"] = t[f"{name}.s_channel"][:, :64].contiguous()

    bad = _broken_copy(qfx, tmp_path, edit)
    out = tmp_path / "out.gguf"
    proc = helpers.run_cli("qqq->gguf", bad, out, check_rc=2)
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "model.safetensors" in err and name in err, err
    expected = {"wrong_shape": "in_features 128", "missing_s_channel": "s_channel",
                "missing_s_group": "s_group", "s_channel_shape": "s_channel"}[case]
    assert expected in err
    assert not out.exists()


def test_bad_qqq_config(qfx, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(qfx["variants"]["qqq_g128"]["ckpt"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["group_size"] = 64
    (bad / "config.json").write_text(json.dumps(cfg))
    proc = helpers.run_cli("qqq->gguf", bad, tmp_path / "o.gguf", check_rc=2)
    assert "group_size 64" in proc.stderr and "config.json" in proc.stderr


# -- QQQ -> HQQ, loaded by the hqq library (its own environment, see tests/formats/hqq/test_hqq.py) ------------------

HQQ_PY = fixtures.REPO_ROOT / ".venvs" / "hqq" / "bin" / "python"


@pytest.mark.parametrize("variant", QQQ_VARIANTS)
def test_qqq_to_hqq_loads_in_hqq_with_the_runtime_weights(qfx, variant, tmp_path):
    import os
    import subprocess

    out = tmp_path / "hqq"
    helpers.run_cli("qqq->hqq", qfx["variants"][variant]["ckpt"], out, "--report", tmp_path / "r.json")
    rep = _report(tmp_path / "r.json")
    assert rep["summary"]["verdicts"]["exact"] == rep["summary"]["tensors"] and rep["summary"]["max_abs_err"] == 0
    if not HQQ_PY.exists():
        raise RuntimeError(f"{HQQ_PY} is missing: run `bash scripts/test_env.d/20-hqq.sh` to create the hqq environment")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore",
           "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    loaded_path = tmp_path / "loaded.safetensors"
    proc = subprocess.run([str(HQQ_PY), str(fixtures.REPO_ROOT / "tests" / "support" / "fixtures_hqq.py"), "verify",
                           str(out), str(loaded_path), "--loader", "transformers", "--compute-dtype", "float32"],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = load_file(str(loaded_path))
    mods, ref_logits = _ref(qfx, variant)
    for name, (w8, s_channel) in mods.items():  # hqq's dequantized weights == gptqmodel's QQQ runtime weights
        assert torch.equal(loaded[f"{name}.weight"].to(torch.float32), w8.to(torch.float32) * s_channel[:, None]), name
    spread = float(ref_logits.max() - ref_logits.min())
    assert float((loaded["__logits__"] - ref_logits[0]).abs().max()) <= ACTIVATION_TOLERANCE * spread


def test_grouped_qqq_to_gptq_4bit_keeps_qqq_codes(qfx, tmp_path, prompt):
    """Asked for GPTQ 4-bit g128, a grouped QQQ layer is written from its own 4-bit view (codes kept,
    scale s_channel * s_group): lossy against the int8 runtime weights, so `requantize`, but not RTN."""
    from qconvert.formats.gptq.reader import GptqSource

    ckpt = qfx["variants"]["qqq_g128"]["ckpt"]
    out = tmp_path / "g"
    helpers.run_cli("qqq->gptq", ckpt, out, "--type", "4g128", "--allow-requant", "--report", tmp_path / "r.json")
    for t in _report(tmp_path / "r.json")["tensors"]:
        if ".down_proj." in t["name"]:
            assert t["verdict"] == "requantize" and "own 4-bit codes" in t["reason"], t
        elif t["source"] != t["target"]:
            assert t["verdict"] == "exact" and t["max_abs_err"] == 0, t
    src, written = QqqSource(ckpt), GptqSource(out)
    for rec in written.records():
        if rec.name.endswith("down_proj.weight"):
            view = src.four_bit_grid(rec.name[: -len(".weight")])
            got = rec.load()
            assert torch.equal(got.codes, view.codes) and torch.equal(got.params.scales, view.params.scales)
    _, ref_logits = _ref(qfx, "qqq_g128")
    spread = float(ref_logits.max() - ref_logits.min())
    assert np.abs(fixtures_qqq.gptq_logits(out, prompt) - ref_logits[0].numpy()).max() <= ACTIVATION_TOLERANCE * spread


def test_qqq_gguf_qqq_round_trip_is_exact(qfx, tmp_path, prompt):
    """Per-channel QQQ -> GGUF Q4_0 -> QQQ: the Q4_0 blocks of a row share one scale, which the alignment
    check proves equal to a per-channel grid, so the way back is exact too and gptqmodel runs the same
    model (bit-equal logits)."""
    gguf_path = tmp_path / "m.gguf"
    helpers.run_cli("qqq->gguf", qfx["variants"]["qqq_gm1"]["ckpt"], gguf_path)
    out = tmp_path / "back"
    helpers.run_cli("gguf->qqq", gguf_path, out, "--type", "g-1", "--report", tmp_path / "r.json")
    rep = _report(tmp_path / "r.json")
    assert rep["summary"]["verdicts"]["exact"] == rep["summary"]["tensors"] and rep["summary"]["max_abs_err"] == 0
    _, ref_logits = _ref(qfx, "qqq_gm1")
    assert np.array_equal(fixtures_qqq.qqq_logits(out, prompt), ref_logits[0].numpy())

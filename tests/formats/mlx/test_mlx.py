"""MLX (mlx-lm folders): qconvert's writer and reader judged by mlx and mlx-lm themselves.

mlx runs in its own environment (.venvs/mlx, scripts/test_env.d/40-mlx.sh); tests/support/mlx_driver.py does the mlx
side: mlx_lm.load of our output, mx.dequantize of every quantized module, the logits of the fixtures' prompt
and a few greedy tokens; mx.quantize for the quantizer rule; mlx_lm.convert as the producer.

Tolerances, from the arithmetic: mlx decodes s*q + b in the model dtype (fp16 here) with two roundings, and
the gptqmodel reference is s*(q - z) rounded once to fp16, so a kept grid differs from either by at most a
few fp16 half-ulps of values below 2**bits * s: |diff| <= 4 * 2**(bits - 11) * s per group, far below the
quantization step s (the codes are the same). Logits: mlx-lm (fp16 activations) against gptqmodel's fp16
torch run or llama.cpp, both on the same weights up to that rounding: measured below 0.02 on this model
(logits of order 1); the tests allow 0.05 of the logit range, as tests/formats/gguf/test_gguf_reader.py does.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import fixtures
from helpers import llama_logits, run_cli, transformers_logits

REPO = Path(__file__).resolve().parents[3]
MLX_PY = REPO / ".venvs" / "mlx" / "bin" / "python"
DRIVER = Path(__file__).parents[2] / "support" / "mlx_driver.py"
PRODUCED = Path(__file__).parents[2] / "producer_fixtures" / "mlx"
LOGIT_TOLERANCE = 0.05  # fraction of the reference's logit range
# llama.cpp's CPU matmul quantizes the activations to Q8 for Q4_0/Q4_1 weights: on the asym zp0 model its
# logits are 0.52 off gptqmodel's on the same weights (range 7.1) and 0.61 off mlx-lm's, which is 0.09 off
# gptqmodel's (measured); against llama.cpp the tests allow 0.12 of the range
LLAMA_CPP_TOLERANCE = 0.12


def _mlx_ready() -> bool:
    if not MLX_PY.exists():
        return False
    proc = subprocess.run([str(MLX_PY), "-c", "import mlx.core, mlx_lm, safetensors"], capture_output=True)
    return proc.returncode == 0


pytestmark = pytest.mark.skipif(not _mlx_ready(), reason="mlx environment missing: bash scripts/test_env.d/40-mlx.sh")


def _driver(*args, timeout: int = 600) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([str(MLX_PY), str(DRIVER), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, f"mlx driver {args[0]} failed:\n{proc.stderr[-4000:]}"
    return proc.stdout


def mlx_load(model_dir: Path, tmp_path: Path, ids: list[int], n_new: int = 4) -> tuple[dict, dict]:
    """mlx-lm's view of a folder: ({module.weight: mx.dequantize float32, __logits__, __generated__}, summary)."""
    from safetensors.numpy import load_file

    out = tmp_path / f"mlx-{model_dir.name}.safetensors"
    summary = json.loads(_driver("load", model_dir, out, json.dumps(ids), n_new).strip().splitlines()[-1])
    return load_file(str(out)), summary


def _report(path: Path) -> dict:
    return {t["name"]: t for t in json.loads(path.read_text())["tensors"]}


def _convert(pair: str, src: Path, out: Path, *extra) -> dict:
    report = out.parent / f"{out.name}.report.json"
    run_cli(pair, src, out, "--report", report, "--quiet", *extra)
    return _report(report)


def _qconvert_dequant(folder: Path) -> dict[str, torch.Tensor]:
    """Our reader's float32 dequantization of an mlx folder's quantized modules."""
    from qconvert.formats.mlx.reader import MlxSource

    src = MlxSource(folder)
    return {r.name: r.load().dequantize(torch.float32) for r in src.records() if r.is_grid}


def _grid_scales(folder: Path) -> dict[str, tuple[torch.Tensor, int, int]]:
    from qconvert.formats.mlx.reader import MlxSource

    return {r.name: (r.params.scales.to(torch.float32), r.params.group_size, r.params.bits)
            for r in MlxSource(folder).records() if r.is_grid}


def _assert_kept_grid(got: np.ndarray, ref: np.ndarray, scales: torch.Tensor, group: int, bits: int, name: str):
    s = scales.abs().repeat_interleave(group, dim=1).numpy()
    diff = np.abs(got.astype(np.float32) - ref.astype(np.float32))
    bound = 4 * 2.0 ** (bits - 11) * s
    assert (diff <= bound).all(), f"{name}: {float((diff - bound).max())} over the fp16 rounding bound"


def _assert_logits_close(got: np.ndarray, ref: np.ndarray, what: str, tolerance: float = LOGIT_TOLERANCE) -> float:
    ref = ref.reshape(got.shape)
    span = float(ref.max() - ref.min())
    err = float(np.abs(got - ref).max())
    assert err <= tolerance * span, f"{what}: logits differ by {err:.4f} (range {span:.2f})"
    return err


# ---------------------------------------------------------------------------------------------------------
# mlx's own rules, reimplemented in torch (formats/mlx/packing.py), against mlx


def test_affine_quantizer_and_packing_are_mlx_bit_for_bit(tmp_path):
    from safetensors.numpy import load_file, save_file

    from qconvert.formats.mlx.packing import MLX_BITS, MLX_GROUPS, mlx_affine_quantize, pack_mlx, unpack_mlx

    gen = torch.Generator().manual_seed(5)
    inputs = {}
    for dtype in ("float16", "bfloat16", "float32"):
        for bits in MLX_BITS:
            for group in MLX_GROUPS:
                w = torch.randn(16, 256, generator=gen) * 0.05
                w[0, :group] = w[0, :group].abs()  # a group with min >= 0 (q0 = 0: bias 0)
                inputs[f"w@{bits}@{group}@{dtype}"] = w.to(getattr(torch, dtype)).to(torch.float32).numpy()
    save_file(inputs, str(tmp_path / "in.safetensors"))
    _driver("quantize", tmp_path / "in.safetensors", tmp_path / "out.safetensors")
    want = load_file(str(tmp_path / "out.safetensors"))
    for key, w in inputs.items():
        _, bits, group, dtype = key.split("@")
        bits, group, store = int(bits), int(group), getattr(torch, dtype)
        codes, scales, biases = mlx_affine_quantize(torch.from_numpy(w).to(store), bits, group, store)
        words = pack_mlx(codes, bits).view(torch.int32).numpy().view(np.uint32)
        assert np.array_equal(words, want[f"{key}.q"]), key
        assert np.array_equal(scales.float().numpy(), want[f"{key}.scales"]), key
        assert np.array_equal(biases.float().numpy(), want[f"{key}.biases"]), key
        assert torch.equal(unpack_mlx(torch.from_numpy(want[f"{key}.q"].view(np.int32)), bits, 256), codes), key


# ---------------------------------------------------------------------------------------------------------
# gptq -> mlx: codes kept, loaded and run by mlx-lm

KEPT = ["v2_b4_g32_sym", "v2_b4_g32_asym_zp0", "v1_b4_g128_sym", "v1_b8_g128_sym", "v1_b3_g32_sym",
        "v2_b2_g32_asym", "v1_b4_gm1_sym"]


@pytest.mark.parametrize("variant", KEPT)
def test_gptq_to_mlx_keeps_the_grid_and_runs_in_mlx_lm(fx, prompt, tmp_path, variant):
    v = fx["variants"][variant]
    out = tmp_path / "mlx"
    plans = _convert("gptq->mlx", v["ckpt"], out)
    ref_weights, ref_logits = fixtures.load_reference(v["reference"])
    grids = {n: p for n, p in plans.items() if p["source"] != p["target"]}
    assert grids and all(p["verdict"] in ("exact", "near-exact") for p in grids.values()), grids
    assert all(p["max_abs_err"] < 2.0 ** -9 for p in grids.values())
    got, summary = mlx_load(out, tmp_path, prompt, n_new=4)
    ours = _qconvert_dequant(out)
    scales = _grid_scales(out)
    assert set(summary["quantized"]) == set(ref_weights)  # load_reference names modules
    for module, ref in ref_weights.items():
        name = f"{module}.weight"
        info = summary["quantized"][module]
        assert info["bits"] == v["bits"] and info["mode"] == "affine"
        # our reader decodes what mlx decodes, bit for bit; both are gptqmodel's weight up to fp16 rounding
        assert np.array_equal(ours[name].numpy(), got[name]), name
        s, group, bits = scales[name]
        assert group == info["group_size"]
        _assert_kept_grid(got[name], ref, s, group, bits, name)
    _assert_logits_close(got["__logits__"], ref_logits[0], f"{variant} mlx-lm vs gptqmodel")
    assert len(got["__generated__"]) == 4


def test_act_order_is_refused_then_requantized_with_mlx_rule(fx, prompt, tmp_path):
    v = fx["variants"]["v1_b4_g32_sym_act"]
    proc = run_cli("gptq->mlx", v["ckpt"], tmp_path / "refused", check_rc=2)
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "act-order" in err and "--allow-requant" in err, err
    assert not (tmp_path / "refused").exists()
    out = tmp_path / "mlx"
    plans = _convert("gptq->mlx", v["ckpt"], out, "--allow-requant")
    assert {p["verdict"] for n, p in plans.items() if "_proj" in n} == {"requantize"}
    got, _ = mlx_load(out, tmp_path, prompt, n_new=0)
    # the requantized codes are mlx's own quantizer applied to the source's dequantization (fp16)
    from qconvert.formats.mlx.packing import mlx_affine_quantize
    from qconvert.formats.gptq.reader import GptqSource

    src = {r.name: r for r in GptqSource(v["ckpt"]).records() if r.is_grid}
    for name, rec in src.items():
        codes, s, b = mlx_affine_quantize(rec.load().dequantize(torch.float32), 4, 64, torch.float16)
        want = ((s.float().repeat_interleave(64, 1) * codes.float()).half().float()
                + b.float().repeat_interleave(64, 1)).half().float()
        assert np.array_equal(got[name], want.numpy()), name
    ref_weights, ref_logits = fixtures.load_reference(v["reference"])
    err = float(np.abs(got["__logits__"] - ref_logits[0]).max())
    assert err < 0.5 * float(np.ptp(ref_logits)), err  # requantized: same model, coarser


# ---------------------------------------------------------------------------------------------------------
# gguf Q4_0 / Q4_1 -> mlx (group 32)


@pytest.mark.parametrize("gguf_type,variant", [("q4_0", "v1_b4_g32_sym"), ("q4_1", "v2_b4_g32_asym_zp0")])
def test_gguf_q4_to_mlx(fx, prompt, tmp_path, gguf_type, variant):
    gguf_path = tmp_path / f"{gguf_type}.gguf"
    gplans = _convert("gptq->gguf", fx["variants"][variant]["ckpt"], gguf_path, "--type", gguf_type)
    assert {p["target"] for n, p in gplans.items() if "_proj" in n} == {gguf_type.upper()}
    out = tmp_path / "mlx"
    plans = _convert("gguf->mlx", gguf_path, out)
    kept = {n: p for n, p in plans.items() if p["target"].startswith("mlx")}
    assert kept and {p["target"] for p in kept.values()} == {"mlx 4-bit g32"}
    assert all(p["verdict"] in ("exact", "near-exact") for p in kept.values()), kept
    got, summary = mlx_load(out, tmp_path, prompt, n_new=4)
    ours = _qconvert_dequant(out)
    scales = _grid_scales(out)
    from qconvert.formats.gguf.reader import GgufSource

    source = {r.name: r for r in GgufSource(gguf_path).records()}
    for name in kept:
        assert np.array_equal(ours[name].numpy(), got[name]), name
        # the GGUF grid as qconvert's reader decodes it (gguf-py's values, llama.cpp's q/k row order undone)
        want = source[name].load().dequantize(torch.float32).numpy()
        s, group, bits = scales[name]
        _assert_kept_grid(got[name], want, s, group, bits, name)
    assert all(info["group_size"] == 32 for info in summary["quantized"].values())
    _assert_logits_close(got["__logits__"], llama_logits(gguf_path, prompt), f"{gguf_type} mlx-lm vs llama.cpp",
                         LLAMA_CPP_TOLERANCE)
    # and against gptqmodel on the GPTQ checkpoint the GGUF was made from (the same grid)
    _, ref_logits = fixtures.load_reference(fx["variants"][variant]["reference"])
    _assert_logits_close(got["__logits__"], ref_logits[0], f"{gguf_type} mlx-lm vs gptqmodel")


# ---------------------------------------------------------------------------------------------------------
# the reader: mlx_lm.convert's output (committed producer fixture, and made live), -> gguf


def _produced() -> Path:
    folder = PRODUCED / "model"
    assert folder.is_dir(), "tests/producer_fixtures/mlx missing: run scripts/producers/mlx.py"
    return folder


def test_reader_matches_mlx_on_mlx_lm_convert_output(tmp_path, prompt):
    from safetensors.numpy import load_file

    folder = _produced()
    stored = load_file(str(PRODUCED / "reference.safetensors"))  # mx.dequantize by mlx when it was made
    ours = _qconvert_dequant(folder)
    live, summary = mlx_load(folder, tmp_path, prompt, n_new=0)
    assert set(ours) == {f"{m}.weight" for m in summary["quantized"]}
    for name, w in ours.items():
        assert np.array_equal(w.numpy(), stored[name]), name
        assert np.array_equal(w.numpy(), live[name]), name
    assert np.array_equal(live["__logits__"], stored["__logits__"])
    proc = run_cli("inspect", folder)
    assert "mlx" in proc.stdout


def test_mlx_lm_convert_live_reads_the_same(tmp_path, fx, prompt):
    out = tmp_path / "produced"
    _driver("convert", fx["bases"]["base"], out, 4, 64)
    got, _ = mlx_load(out, tmp_path, prompt, n_new=0)
    ours = _qconvert_dequant(out)
    assert ours and all(np.array_equal(w.numpy(), got[n]) for n, w in ours.items())


def test_mlx_lm_convert_moe_switch_layers_read_per_expert(tmp_path, prompt):
    """mlx_lm.convert's own MoE folder (producer_fixtures/mlx/moe: a tiny Qwen3-MoE, each layer's experts stacked in
    switch layers [experts, out, in] and quantized after stacking, the router at 8 bits as Qwen3-MoE's
    quant_predicate asks): our reader gives every expert as Hugging Face's per-expert tensor, equal to mx.dequantize
    of its slice bit for bit, and its `mlx->hf` / `mlx->gguf` run in transformers / llama.cpp with mlx-lm's logits
    (float32 on every side: both measured 1.9e-6 off mlx-lm's, logit range 7.3)."""
    from safetensors.numpy import load_file

    from qconvert.formats.mlx.reader import MlxSource

    folder = PRODUCED / "moe" / "model"
    assert folder.is_dir(), "tests/producer_fixtures/mlx/moe missing: run scripts/producers/mlx.py moe"
    stored = load_file(str(PRODUCED / "moe" / "reference.safetensors"))  # mx.dequantize by mlx when it was made
    source = MlxSource(folder)
    ours = {r.name: r for r in source.records() if r.is_grid}
    expected = set()
    for name, want in stored.items():
        if name.startswith("__"):
            continue
        stack = want if want.ndim == 3 else None
        for e, w in enumerate(stack if stack is not None else [want]):
            ours_name = source.layout.expert_name(name, e) if stack is not None else name
            assert np.array_equal(ours[ours_name].load().dequantize(torch.float32).numpy(), w), ours_name
            expected.add(ours_name)
    assert expected == set(ours) and sum(".experts." in n for n in ours) == 2 * 3 * 4  # 2 layers, 3 projections
    from qconvert.converters.plan import Options
    from qconvert.converters.run import convert

    hf, gguf_path = tmp_path / "hf", tmp_path / "moe.gguf"  # in process: two CLI starts cost more than the rest
    convert("mlx", folder, "hf", hf, Options(type="f32"), progress=False)
    convert("mlx", folder, "gguf", gguf_path, Options(type="f32"), progress=False)
    _assert_logits_close(transformers_logits(hf, prompt), stored["__logits__"], "mlx->hf transformers vs mlx-lm")
    _assert_logits_close(llama_logits(gguf_path, prompt), stored["__logits__"], "mlx->gguf llama.cpp vs mlx-lm")


def test_switch_layer_of_other_expert_count_is_refused(tmp_path):
    """A switch layer whose first axis is not config.json's expert count: a BadInput naming the file and the
    tensor, before any record is read (the CLI's one line, exit 2)."""
    from qconvert.converters.errors import BadInput
    from qconvert.formats.mlx.reader import MlxSource

    src = _copy(PRODUCED / "moe" / "model", tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(num_experts=3, num_local_experts=3)
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BadInput) as e:
        list(MlxSource(src).records())
    assert "num_experts = 3 experts along its first axis, got [4, " in str(e.value)
    assert e.value.path.endswith("model.safetensors") and ".switch_mlp." in e.value.tensor


def test_mlx_to_gguf_q4_1(tmp_path, prompt):
    from safetensors.numpy import load_file

    folder = _produced()
    stored = load_file(str(PRODUCED / "reference.safetensors"))
    gguf_path = tmp_path / "q4_1.gguf"
    plans = _convert("mlx->gguf", folder, gguf_path, "--type", "q4_1")
    quant = {n: p for n, p in plans.items() if p["target"] == "Q4_1"}
    assert quant and all(p["verdict"] in ("exact", "near-exact") for p in quant.values()), plans
    from qconvert.formats.gguf.reader import GgufSource

    back = {r.name: r.load().dequantize(torch.float32) for r in GgufSource(gguf_path).records()}
    scales = _grid_scales(folder)
    for name in quant:
        # Q4_1 holds mlx's fp16 scale and bias as d and m: the codes are the same, and the values differ
        # only by mlx's fp16 rounding of s*q + b (llama.cpp decodes d*q + m in float32)
        s, group, bits = scales[name]
        _assert_kept_grid(stored[name], back[name].numpy(), s, group, bits, name)
    _assert_logits_close(llama_logits(gguf_path, prompt), stored["__logits__"], "Q4_1 llama.cpp vs mlx-lm",
                         LLAMA_CPP_TOLERANCE)


# ---------------------------------------------------------------------------------------------------------
# bad input: one line, exit 2


def _copy(folder: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(folder, dst)
    return dst


@pytest.mark.parametrize("case", ["no_biases", "no_scales", "packed_shape", "bits"])
def test_bad_mlx_input_is_one_line(tmp_path, case):
    from helpers import edit_safetensors, expect_user_error

    src = _copy(_produced(), tmp_path / "src")
    st = src / "model.safetensors"
    target = "model.layers.0.mlp.down_proj"
    if case == "no_biases":
        edit_safetensors(st, lambda t: t.pop(f"{target}.biases"))
        needles = ("scales without biases", f"{target}.biases")
    elif case == "no_scales":
        edit_safetensors(st, lambda t: t.pop(f"{target}.scales"))
        needles = ("biases without scales", f"{target}.scales")
    elif case == "packed_shape":
        edit_safetensors(st, lambda t: t.__setitem__(f"{target}.weight", t[f"{target}.weight"][:, :-1].contiguous()))
        needles = ("scales", f"{target}.weight")
    else:
        cfg = json.loads((src / "config.json").read_text())
        cfg["quantization"]["bits"] = 7
        (src / "config.json").write_text(json.dumps(cfg))
        needles = ("bits is 7", "config.json")
    expect_user_error("mlx->gguf", src, tmp_path, *needles)


# ---------------------------------------------------------------------------------------------------------
# sharded output: mlx_lm.load globs model*.safetensors; the index names every tensor's shard


def test_sharded_output_loads_in_mlx_lm(fx, prompt, tmp_path, monkeypatch):
    from qconvert.converters.plan import Options
    from qconvert.converters.run import convert
    from qconvert.formats.mlx.writer import MlxSession

    monkeypatch.setattr(MlxSession, "max_shard_bytes", 100_000)
    v = fx["variants"]["v2_b4_g32_sym"]
    out = tmp_path / "mlx"
    convert("gptq-v2", v["ckpt"], "mlx", out, Options(), progress=False)
    shards = sorted(p.name for p in out.glob("model*.safetensors"))
    assert len(shards) > 2 and (out / "model.safetensors.index.json").exists(), shards
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index.values()) == set(shards)
    got, summary = mlx_load(out, tmp_path, prompt, n_new=2)
    ours = _qconvert_dequant(out)
    assert len(summary["quantized"]) == 14 and all(np.array_equal(w.numpy(), got[n]) for n, w in ours.items())
    single = tmp_path / "single"
    convert("gptq-v2", v["ckpt"], "mlx", single, Options(), progress=False)
    want, _ = mlx_load(single, tmp_path, prompt, n_new=0)
    assert np.array_equal(got["__logits__"], want["__logits__"])


def test_mlx_round_trip_is_exact(tmp_path):
    out = tmp_path / "again"
    plans = _convert("mlx->mlx", _produced(), out)
    assert {p["verdict"] for p in plans.values()} == {"exact"}
    from safetensors.numpy import load_file

    a, b = load_file(str(_produced() / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)


def test_per_module_types_load_with_their_own_bits(fx, prompt, tmp_path):
    v = fx["variants"]["v1_b4_g128_sym"]
    out = tmp_path / "mlx"
    plans = _convert("gptq->mlx", v["ckpt"], out, "--tensor-type", "down_proj=mlx8g64")
    assert plans["model.layers.0.mlp.down_proj.weight"]["target"] == "mlx 8-bit g64"
    q = json.loads((out / "config.json").read_text())["quantization"]
    assert q["model.layers.1.mlp.down_proj"] == {"group_size": 64, "bits": 8, "mode": "affine"}
    got, summary = mlx_load(out, tmp_path, prompt, n_new=0)
    assert summary["quantized"]["model.layers.1.mlp.down_proj"]["bits"] == 8
    assert summary["quantized"]["model.layers.1.mlp.up_proj"]["group_size"] == 128
    ref_weights, ref_logits = fixtures.load_reference(v["reference"])
    scales = _grid_scales(out)
    for module, ref in ref_weights.items():
        s, group, bits = scales[f"{module}.weight"]
        # 4-bit codes in an 8-bit grid: the same values, bounded by the 4-bit rounding
        _assert_kept_grid(got[f"{module}.weight"], ref, s, group, 4, module)
    _assert_logits_close(got["__logits__"], ref_logits[0], "mixed types mlx-lm vs gptqmodel")


def test_dense_quantize_is_mlx_lm_convert_byte_for_byte(fx, tmp_path):
    """hf -> mlx --type mlx4g64 applies mlx's own rule: the same bytes mlx_lm.convert writes (committed fixture,
    made from the same tiny llama), embeddings and output head included."""
    from safetensors.numpy import load_file

    out = tmp_path / "mlx"
    plans = _convert("hf->mlx", fx["bases"]["base"], out, "--type", "mlx4g64", "--allow-requant")
    assert {p["verdict"] for n, p in plans.items() if n.endswith("_proj.weight")} == {"requantize"}
    ours, theirs = load_file(str(out / "model.safetensors")), load_file(str(_produced() / "model.safetensors"))
    assert set(ours) == set(theirs)
    for k in theirs:
        assert ours[k].dtype == theirs[k].dtype and np.array_equal(ours[k], theirs[k]), k


# ---------------------------------------------------------------------------------------------------------
# the family handler's decisions, from the data


def _grid(bits=4, group=128, in_features=256, out=64, g_idx=None, mins=False, seed=3):
    from qconvert.converters.records import Grid, GridParams

    gen = torch.Generator().manual_seed(seed)
    n = in_features // group
    scales = (torch.rand(out, n, generator=gen) * 0.02 + 0.001).half()
    codes = torch.randint(0, 2 ** bits, (out, in_features), generator=gen, dtype=torch.uint8)
    if mins:
        m = (-torch.rand(out, n, generator=gen) * 0.1).half().float()
        p = GridParams(bits=bits, group_size=group, scales=scales, zeros=torch.zeros_like(scales), mins=m)
    else:
        zeros = torch.randint(0, 2 ** bits, (out, n), generator=gen, dtype=torch.int16)
        p = GridParams(bits=bits, group_size=group, scales=scales, zeros=zeros, g_idx=g_idx)
    return Grid(p, codes)


def test_handler_decides_from_the_data():
    from qconvert.converters.checker import check
    from qconvert.formats.mlx.schemes import mlx_scheme

    fp16, fp32 = mlx_scheme(4, 0, torch.float16), mlx_scheme(4, 0, torch.float32)
    g = _grid()
    d = check(g.params, g.shape, fp16)
    assert d.verdict == "near-exact" and d.keeps_codes and d.group_size == 128
    # float32 storage of an integer-zero grid with fp16 scales: s*q + (-s*z) is s*(q - z) in float32 exactly
    d = check(g.params, g.shape, fp32)
    assert d.verdict == "exact"
    from qconvert.kernels.dequant import dequantize_grid_torch

    p = g.params
    s = p.scales.float()
    mlx_value = dequantize_grid_torch(g.codes, s, torch.zeros_like(s), 128, None, mins=-(s * p.zeros.float()),
                                      compute_dtype=torch.float32)
    assert torch.equal(mlx_value, g.dequantize(torch.float32))
    # a min-form grid decoded in float32 (GGUF Q4_1) stored in float32: mlx's own arithmetic, exact
    q41 = _grid(group=32, mins=True)
    assert check(q41.params, q41.shape, fp32).verdict == "exact"
    assert check(q41.params, q41.shape, fp16).verdict == "near-exact"
    # act-order: scattered across groups -> requantize; permuted whole 32-blocks stay inside mlx groups of 32
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(1))
    scattered = _grid(g_idx=(perm // 128).to(torch.int64))
    assert check(scattered.params, scattered.shape, fp16).verdict == "requantize"
    blocks = torch.tensor([1, 0, 1, 0, 0, 1, 1, 0]).repeat_interleave(32)
    by_block = _grid(g_idx=blocks.to(torch.int64))
    d = check(by_block.params, by_block.shape, fp16)
    assert d.keeps_codes and d.group_size == 32
    assert check(g.params, g.shape, mlx_scheme(2, 0, torch.float16)).verdict == "requantize"  # 4-bit codes > 2 bits
    assert check("float16", (64, 100), fp16).verdict == "refused"  # 100 is no whole group of 32


def test_act_order_blocks_keep_their_codes(tmp_path):
    """The writer's scale gather for an act-order index whose scatter stays inside mlx groups: what mlx
    will decode (the session's return, fp16 arithmetic) against the source grid's own dequantization."""
    from qconvert.converters.records import TensorRecord
    from qconvert.converters.plan import Options
    from qconvert.formats.mlx.writer import MlxWriter

    blocks = torch.tensor([1, 0, 1, 0, 0, 1, 1, 0]).repeat_interleave(32).to(torch.int64)
    g = _grid(g_idx=blocks, out=256, in_features=256)
    rec = TensorRecord("model.layers.0.mlp.down_proj.weight", (256, 256), "grid", lambda: g, params=g.params)

    class Src:
        config = {"dtype": "float16"}

        @staticmethod
        def side_files():
            return {}

    writer = MlxWriter().for_conversion(Src, Options())
    plan = writer.plan_tensor(rec, Options(), Src)
    assert plan.verdict == "near-exact" and plan.target == "mlx 4-bit g32"
    session = writer.open(tmp_path, Src, [plan], Options())
    decoded = session.add(plan, g)
    s = g.params.scales.float()[:, blocks[::32]].repeat_interleave(32, dim=1)
    assert bool(((decoded - g.dequantize(torch.float32)).abs() <= 4 * 2.0 ** (4 - 11) * s).all())
    session.close()
    from safetensors.torch import load_file

    stored = load_file(str(tmp_path / "model.safetensors"))
    assert stored["model.layers.0.mlp.down_proj.scales"].shape == (256, 8)


# ---------------------------------------------------------------------------------------------------------
# awq -> mlx: gptqmodel's AWQ checkpoints (tests/producer_fixtures/awq), codes kept, judged by mlx-lm

AWQ_FIXTURES = Path(__file__).parents[2] / "producer_fixtures" / "awq"


def _producer_oracle(src: Path) -> tuple[dict, np.ndarray, list[int]]:
    """The producer's own fp16 weights, logits and prompt ids stored beside its checkpoint: gptqmodel's AWQ
    (reference.safetensors with __logits__, versions.json) or auto-round's loader (logits.safetensors)."""
    from safetensors.torch import load_file

    reference = load_file(str(src / "reference.safetensors"))
    if "__logits__" in reference:
        ids = json.loads((src / "versions.json").read_text())["prompt_ids"]
        return reference, reference.pop("__logits__")[0].float().numpy(), ids
    logits = load_file(str(src / "logits.safetensors"))
    return reference, logits["logits"].float().numpy(), logits["ids"].tolist()


@pytest.mark.parametrize("fmt, variant", [("awq", "gemm_g32"), ("awq", "gemm_g128"), ("auto-round", "sym4_g32"),
                                          ("auto-round", "asym4_g128")])
def test_awq_and_auto_round_to_mlx_keep_the_grid_and_run_in_mlx_lm(tmp_path, fmt, variant):
    src = (AWQ_FIXTURES if fmt == "awq" else AWQ_FIXTURES.parent / "auto_round") / variant
    reference, ref_logits, ids = _producer_oracle(src)
    out = tmp_path / "mlx"
    plans = _convert(f"{fmt}->mlx", src, out)
    grids = {n: p for n, p in plans.items() if p["source"].startswith("4-bit")}
    assert len(grids) == 7 and {p["verdict"] for p in grids.values()} == {"near-exact"}, grids
    got, summary = mlx_load(out, tmp_path, ids, n_new=4)
    ours = _qconvert_dequant(out)
    scales = _grid_scales(out)
    for name in grids:
        assert summary["quantized"][name[: -len(".weight")]]["bits"] == 4
        assert np.array_equal(ours[name].numpy(), got[name]), name  # our reader decodes what mlx decodes
        s, group, bits = scales[name]
        _assert_kept_grid(got[name], reference[name].float().numpy(), s, group, bits, name)
    _assert_logits_close(got["__logits__"], ref_logits, f"{fmt} {variant} mlx-lm vs its producer's runtime")
    assert len(got["__generated__"]) == 4

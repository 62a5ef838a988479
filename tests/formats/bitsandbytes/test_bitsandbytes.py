"""bitsandbytes checkpoints (formats/bitsandbytes): the reader against bitsandbytes 0.50 itself, the codebook
grid in the alignment checker, bnb -> gguf judged by llama.cpp, bnb -> hf judged by transformers, bad input.

The checkpoints are the real producer's (transformers BitsAndBytesConfig + bitsandbytes on CPU), committed
under tests/producer_fixtures/bitsandbytes/ with bitsandbytes' own dequantization beside them
(reference.safetensors); scripts/producers/bitsandbytes.py remakes them. bitsandbytes is in the main venv,
so every oracle is also recomputed live here (its functional API, and transformers' loaded model).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from helpers import (edit_safetensors, expect_user_error, gguf_dequant, gguf_tensors, llama_logits, run_cli,
                     transformers_logits)
from qconvert.converters.checker import EXACT, NEAR_EXACT, REFUSED, REQUANTIZE, check
from qconvert.converters.records import describe_grid
from qconvert.formats.bitsandbytes.reader import INT8_RECIPROCAL, BnbSource
from qconvert.formats.gguf.schemes import GGUF_SCHEMES
from qconvert.formats.gptq import GPTQ_SCHEMES
from qconvert.formats.hqq import HQQ_KEEP
from qconvert.formats.qqq import qqq_scheme
from qconvert.formats.uqff.schemes import UQFF_SCHEMES

REPO = Path(__file__).resolve().parents[3]
ROOT = REPO / "tests" / "producer_fixtures" / "bitsandbytes"
VARIANTS = ("nf4_dq", "fp4", "int8")
# saved after a forward pass on the CPU (bitsandbytes' CPU repack undone by its save path): double quant in the
# model dtype, `nested_dtype` float16 / bfloat16 (read as bitsandbytes reads it)
CPU_FORWARD = ("nf4_dq_f16_cpu_forward", "nf4_dq_bf16_cpu_forward", "fp4_dq_bf16_cpu_forward")
# ... and without double quant: the absmax left transposed in bfloat16 (refused, see the reader)
TRANSPOSED_ABSMAX = "nf4_cpu_forward_transposed_absmax"
LINEARS = 7  # one llama decoder layer: q, k, v, o, gate, up, down
# llama.cpp's converter permutes q_proj / k_proj rows (rope); these keep the source's row order in GGUF
UNPERMUTED = ("self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
GGUF_NAME = {"self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def fixture(variant: str) -> Path:
    path = ROOT / variant
    if not (path / "reference.safetensors").exists():
        pytest.skip(f"{path} is missing: run scripts/producers/bitsandbytes.py")
    return path


def reference(variant: str) -> dict[str, torch.Tensor]:
    return load_file(str(fixture(variant) / "reference.safetensors"))


def prompt(variant: str) -> list[int]:
    return json.loads((fixture(variant) / "versions.json").read_text())["prompt_ids"]


def ours(variant: str) -> dict[str, torch.Tensor]:
    """Our dequantization of every quantized linear, in the dtype bitsandbytes dequantizes it to."""
    src = BnbSource(fixture(variant))
    out = {}
    for rec in src.records():
        if rec.is_grid:
            out[rec.name] = rec.load().dequantize(src.dequant_dtype(rec.name))
    return out


def bnb():
    return pytest.importorskip("bitsandbytes")


def producer():
    spec = importlib.util.spec_from_file_location("qconvert_bnb_producer", REPO / "scripts" / "producers" / "bitsandbytes.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------------------------------------------------
# the reader: bit for bit against bitsandbytes


@pytest.mark.parametrize("variant", VARIANTS + CPU_FORWARD)
def test_dequantization_equals_stored_bitsandbytes_oracle(variant):
    ref, got = reference(variant), ours(variant)
    assert len(got) == LINEARS and set(got) == set(ref) - {"__logits__"}
    for name, w in got.items():
        assert w.dtype == ref[name].dtype and torch.equal(w, ref[name]), name


@pytest.mark.parametrize("variant", VARIANTS + CPU_FORWARD)
def test_dequantization_equals_live_bitsandbytes_functional(variant):
    """bitsandbytes' own functions on the stored tensors (QuantState.from_dict as Params4bit.from_prequantized
    builds it; int8_vectorwise_dequant as transformers' dequantize_bnb_weight calls it)."""
    F = bnb().functional
    path = fixture(variant) / "model.safetensors"
    got = ours(variant)
    with safe_open(str(path), "pt") as f:
        keys = list(f.keys())
        for name, w in got.items():
            prefix = name[: -len(".weight")]
            if variant == "int8":
                live = F.int8_vectorwise_dequant(f.get_tensor(name), f.get_tensor(f"{prefix}.SCB"))
            else:
                parts = {k[len(name) + 1:]: f.get_tensor(k) for k in keys if k.startswith(name + ".")}
                qs = F.QuantState.from_dict(parts, device=torch.device("cpu"))
                live = F.dequantize_4bit(f.get_tensor(name), qs)
            assert live.dtype == w.dtype and torch.equal(live, w), name


def test_nested_dtype_is_read_in_its_own_dtype():
    """The float16 / bfloat16 nested state is undone in that dtype (two roundings): read in float32, as before,
    the absmax would differ, so the bit-for-bit match above is the nested dtype's doing."""
    from qconvert.formats.bitsandbytes.reader import nested_absmax

    for variant, dtype in (("nf4_dq_f16_cpu_forward", torch.float16), ("nf4_dq_bf16_cpu_forward", torch.bfloat16)):
        with safe_open(str(fixture(variant) / "model.safetensors"), "pt") as f:
            state = json.loads(bytes(f.get_tensor(f"{Q}.quant_state.bitsandbytes__nf4").tolist()).decode())
            assert state["nested_dtype"] == str(dtype)[6:], state
            args = (f.get_tensor(f"{Q}.absmax"), f.get_tensor(f"{Q}.nested_quant_map"),
                    f.get_tensor(f"{Q}.nested_absmax"), state["nested_blocksize"], state["nested_offset"])
        own, as_f32 = nested_absmax(*args, dtype), nested_absmax(*args)
        assert own.dtype == torch.float32 and not torch.equal(own, as_f32), variant


def test_transposed_absmax_is_refused_naming_defect_and_remedy(tmp_path):
    """transformers 5.24 + bitsandbytes 0.50, NF4 without double quant, saved after a CPU forward: absmax BF16
    [in/64, out]. bitsandbytes' own loader (the stored reference) reads it in flat order; read transposed it gives
    other weights, up to 0.18 away: the file holds no single right reading, so it is refused in one line."""
    F = bnb().functional
    src = fixture(TRANSPOSED_ABSMAX)
    ref = reference(TRANSPOSED_ABSMAX)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        parts = {k[len(Q) + 1:]: f.get_tensor(k) for k in keys if k.startswith(Q + ".")}
        assert parts["absmax"].dtype == torch.bfloat16 and tuple(parts["absmax"].shape) == (256 // 64, 128)
        loader = F.dequantize_4bit(f.get_tensor(Q), F.QuantState.from_dict(dict(parts), device=torch.device("cpu")))
        assert torch.equal(loader, ref[Q])  # the stored oracle is the loader's reading
        parts["absmax"] = parts["absmax"].T.reshape(-1).float().contiguous()
        transposed = F.dequantize_4bit(f.get_tensor(Q), F.QuantState.from_dict(parts, device=torch.device("cpu")))
    assert (transposed.float() - loader.float()).abs().max() > 0.1  # measured 0.1499 (0.18 over the 7 linears)
    for pair in ("bnb->gguf", "bnb->hf"):
        expect_user_error(pair, src, tmp_path, "model.safetensors", f"{Q}.absmax", "absmax is BF16 (4, 128)",
                          "misread by bitsandbytes' own loader", "bnb_4bit_use_double_quant=True")
    proc = run_cli("inspect", src, check_rc=2)
    assert "absmax is BF16" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("variant", CPU_FORWARD)
def test_cpu_forward_variant_to_hf_runs_in_transformers(tmp_path, variant):
    """nested_dtype float16 / bfloat16, into a dense checkpoint of the model dtype: bitsandbytes' dequantization
    bit for bit, and transformers runs it (logits against the bnb model's, which computes in its CPU kernels)."""
    ref = reference(variant)
    dtype = json.loads((fixture(variant) / "versions.json").read_text())["variant"]["model_dtype"]
    out, rep = tmp_path / "hf", tmp_path / "report.json"
    run_cli("bnb->hf", fixture(variant), out, "--type", {"float16": "f16", "bfloat16": "bf16"}[dtype], "--report", rep)
    weights = load_file(str(out / "model.safetensors"))
    report = _report(rep)
    for name, r in ref.items():
        if name != "__logits__":
            assert weights[name].dtype == r.dtype and torch.equal(weights[name], r), name
            assert report[name]["verdict"] == NEAR_EXACT, report[name]
    diff = np.abs(transformers_logits(out, prompt(variant)) - ref["__logits__"][0].numpy()).max()
    # measured 0.035 (nf4, fp16), 0.052 (nf4, bf16), 0.037 (fp4, bf16): bitsandbytes' CPU 4-bit kernel
    # against torch's matmuls
    assert diff < 0.1, diff


def test_dequantization_equals_the_transformers_loaded_model(tmp_path):
    """The checkpoint loaded by transformers (its bnb integration) and dequantized by bitsandbytes, live: the
    same weights as ours, and the logits as stored (within what the CPU's own kernels change)."""
    bnb()
    for variant in ("nf4_dq", "int8"):
        live = load_file(str(producer().bnb_reference(fixture(variant), tmp_path / f"{variant}.safetensors",
                                                      prompt(variant))))
        got = ours(variant)
        for name, w in got.items():
            assert torch.equal(live[name], w), (variant, name)
        # the logits of bitsandbytes' fp16 4-bit CPU matmul depend on the CPU's kernels: equal on the machine that
        # made the fixture, 0.037 apart on an AMD EPYC with AVX-512 BF16 (int8: 0.0 on both)
        np.testing.assert_allclose(live["__logits__"].numpy(), reference(variant)["__logits__"].numpy(), atol=0.05)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16, torch.float32))
def test_kernels_equal_bitsandbytes_for_every_blocksize_type_and_dtype(dtype):
    """Beyond the fixtures: bitsandbytes quantizes random weights at every blocksize it accepts, NF4 and FP4,
    with and without double quant, dequantizing to fp16 / bf16 / fp32; our unpacking, nested absmax and
    codebook kernel give its bits."""
    F = bnb().functional
    from qconvert.formats.bitsandbytes.reader import BNB_BLOCKSIZES, nested_absmax, unpack_4bit
    from qconvert.kernels.dequant import dequantize_codebook_torch

    gen = torch.Generator().manual_seed(0)
    for bs in BNB_BLOCKSIZES:
        for qtype in ("nf4", "fp4"):
            for double in (False, True):
                out_f, in_f = 24, max(bs, 256) * 2
                w = (torch.randn(out_f, in_f, generator=gen) * 0.05).to(dtype)
                q, qs = F.quantize_4bit(w, blocksize=bs, quant_type=qtype, compress_statistics=double)
                want = F.dequantize_4bit(q, qs)
                absmax = (nested_absmax(qs.absmax, qs.state2.code, qs.state2.absmax, qs.state2.blocksize,
                                        float(qs.offset)) if double else qs.absmax.float())
                got = dequantize_codebook_torch(unpack_4bit(q, out_f, in_f), absmax.view(out_f, in_f // bs), qs.code,
                                                bs, dtype)
                assert got.dtype == want.dtype and torch.equal(got, want), (bs, qtype, double)


def test_nibble_order_is_high_first():
    """The first element of a row is the high nibble of its first byte (bitsandbytes' _dequantize_4bit_compute)."""
    src = BnbSource(fixture("fp4"))
    name = "model.layers.0.mlp.down_proj.weight"
    grid = next(r for r in src.records() if r.name == name).load()
    with safe_open(str(fixture("fp4") / "model.safetensors"), "pt") as f:
        packed = f.get_tensor(name).reshape(-1)
    assert torch.equal(grid.codes[0, 0::2], packed[:128] >> 4) and torch.equal(grid.codes[0, 1::2], packed[:128] & 15)


def test_int8_two_step_scale_is_why_scale_steps_exist():
    """bitsandbytes rounds twice ((q * SCB) * 1/127); one scale fl(SCB/127) times q differs in some elements,
    so the int8 grid carries both (GridParams.scale_steps) and dequantizes as bnb does."""
    src = BnbSource(fixture("int8"))
    ref = reference("int8")
    differs = 0
    for rec in src.records():
        if not rec.is_grid:
            continue
        grid = rec.load()
        one_step = (grid.codes.to(torch.float32) - 128) * grid.params.scales
        differs += int((one_step != ref[rec.name]).sum())
        assert torch.equal(grid.params.scales, grid.params.scale_steps[0] * INT8_RECIPROCAL)
    # measured: 34392 of the 147456 fixture elements (23%) differ, by up to 3e-8 (an ulp)
    assert differs > 0


# ---------------------------------------------------------------------------------------------------------
# the checker: a codebook is not a uniform grid


def _params(variant: str, name: str = "model.layers.0.mlp.down_proj.weight"):
    rec = next(r for r in BnbSource(fixture(variant)).records() if r.name == name)
    return rec.params, rec.shape


def test_codebook_grid_is_described_and_requantized_by_every_integer_target():
    p, shape = _params("nf4_dq")
    assert describe_grid(p, shape[1]) == "4-bit nf4 codebook blocksize 64"
    assert describe_grid(_params("fp4")[0], shape[1]) == "4-bit fp4 codebook blocksize 64"
    assert not p.integer_zeros and not p.symmetric
    schemes = [*GGUF_SCHEMES.values(), *UQFF_SCHEMES.values(), *GPTQ_SCHEMES.values(), HQQ_KEEP,
               qqq_scheme(128, shape[1]), qqq_scheme(-1, shape[1])]
    for s in schemes:
        d = check(p, shape, s)
        if s.family == "float":
            assert d.verdict == (EXACT if s.dtype == torch.float32 else NEAR_EXACT), (s.name, d)
            continue
        if s.family == "float-block":  # MXFP4 / NVFP4 / FP8: another (float) codebook, which says so
            assert d.verdict == REQUANTIZE and f"nf4 codebook codes are not {s.element} values" in d.reason, d
            continue
        assert d.verdict in (REQUANTIZE, REFUSED) and not d.keeps_codes, (s.name, d)
        if d.verdict == REQUANTIZE:
            assert "a 16-value codebook is not a uniform grid" in d.reason, (s.name, d.reason)


def test_int8_grid_keeps_its_codes_in_q8_0_near_exactly():
    p, shape = _params("int8")
    assert p.symmetric and describe_grid(p, shape[1]) == "8-bit per-channel sym"
    d = check(p, shape, GGUF_SCHEMES["Q8_0"])
    assert d.verdict == NEAR_EXACT and d.keeps_codes, d
    assert check(p, shape, GGUF_SCHEMES["F32"]).verdict == EXACT
    assert check(p, shape, GGUF_SCHEMES["Q4_0"]).verdict == REQUANTIZE


# ---------------------------------------------------------------------------------------------------------
# conversions, judged by their consumers


def _report(path: Path) -> dict[str, dict]:
    return {t["name"]: t for t in json.loads(path.read_text())["tensors"]}


def test_int8_to_q8_0_keeps_codes_and_llama_cpp_runs_it(tmp_path):
    src = fixture("int8")
    out, rep = tmp_path / "int8.gguf", tmp_path / "report.json"
    run_cli("bnb->gguf", src, out, "--type", "Q8_0", "--report", rep)
    report, ref = _report(rep), reference("int8")
    tensors = gguf_tensors(out)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        for module in UNPERMUTED:
            name = f"model.layers.0.{module}.weight"
            entry = report[name]
            assert entry["target"] == "Q8_0" and entry["verdict"] == NEAR_EXACT, entry
            t = tensors[f"blk.0.{GGUF_NAME[module]}.weight"]
            blocks = np.asarray(t.data).reshape(-1, 34)
            q = torch.from_numpy(blocks[:, 2:].copy().view(np.int8).reshape(-1))
            d = torch.from_numpy(blocks[:, :2].copy().view(np.float16).reshape(-1))
            w8, scb = f.get_tensor(name), f.get_tensor(f"model.layers.0.{module}.SCB")
            assert torch.equal(q, w8.reshape(-1)), name  # the int8 codes, unchanged
            want_d = (scb * INT8_RECIPROCAL).to(torch.float16).repeat_interleave(w8.shape[1] // 32)
            assert torch.equal(d, want_d), name  # the row scale, rounded once to fp16
            err = float((torch.from_numpy(gguf_dequant(t)).reshape(ref[name].shape) - ref[name]).abs().max())
            assert err == pytest.approx(entry["max_abs_err"], rel=1e-6, abs=1e-12) and 0 < err < 2e-4, (name, err)
    # bnb's own model runs LLM.int8 (activations quantized to int8 too, outliers above 6.0 in fp16): the
    # logits differ by that; measured 0.096 max over 16 positions x 512 logits of magnitude <= 3.8
    logits = llama_logits(out, prompt("int8"))
    assert np.abs(logits - ref["__logits__"][0].numpy()).max() < 0.15


@pytest.mark.parametrize("variant", ("nf4_dq", "fp4"))
def test_4bit_to_q4_k_needs_allow_requant_and_reports_the_codebook(tmp_path, variant):
    src = fixture(variant)
    proc = run_cli("bnb->gguf", src, tmp_path / "refused.gguf", "--type", "Q4_K", check_rc=2)
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "--allow-requant" in err and "codebook is not a uniform grid" in err, err
    out, rep = tmp_path / "q4k.gguf", tmp_path / "report.json"
    run_cli("bnb->gguf", src, out, "--type", "Q4_K", "--allow-requant", "--report", rep)
    report, ref = _report(rep), reference(variant)
    tensors = gguf_tensors(out)
    quantized = [e for e in report.values() if e["source"].endswith("codebook blocksize 64")]
    assert len(quantized) == LINEARS
    for e in quantized:
        assert e["verdict"] == REQUANTIZE and "a 16-value codebook is not a uniform grid" in e["reason"], e
    # the report's error is the real one: our float32 dequantization (bnb's before its fp16 cast) vs the file
    exact = {r.name: r.load().dequantize(torch.float32) for r in BnbSource(src).records() if r.is_grid}
    for module in UNPERMUTED:
        name = f"model.layers.0.{module}.weight"
        t = tensors[f"blk.0.{GGUF_NAME[module]}.weight"]
        err = float((torch.from_numpy(gguf_dequant(t)).reshape(exact[name].shape) - exact[name]).abs().max())
        assert err == pytest.approx(report[name]["max_abs_err"], rel=1e-5), (name, err, report[name])
        assert 0 < err < 0.03, (name, err)  # measured 0.009-0.016 (weights ~ N(0, 1/128))
    # llama.cpp runs it; requantizing a random tiny model's NF4/FP4 weights moves its logits by up to
    # 0.5 (measured 0.495 nf4, 0.467 fp4; logits of magnitude <= 3.7), so this is a smoke bound
    logits = llama_logits(out, prompt(variant))
    assert np.abs(logits - ref["__logits__"][0].numpy()).max() < 1.0


@pytest.mark.parametrize("variant", VARIANTS)
def test_f32_gguf_is_exact_and_llama_cpp_matches_bnb_logits(tmp_path, variant):
    out, rep = tmp_path / "f32.gguf", tmp_path / "report.json"
    run_cli("bnb->gguf", fixture(variant), out, "--type", "F32", "--report", rep)
    assert {e["verdict"] for e in _report(rep).values()} == {EXACT}
    ref = reference(variant)
    tensors = gguf_tensors(out)
    exact = {r.name: r.load().dequantize(torch.float32) for r in BnbSource(fixture(variant)).records() if r.is_grid}
    for module in UNPERMUTED:
        name = f"model.layers.0.{module}.weight"
        got = torch.from_numpy(np.asarray(tensors[f"blk.0.{GGUF_NAME[module]}.weight"].data).copy())
        assert torch.equal(got.reshape(exact[name].shape), exact[name]), name
        assert torch.equal(exact[name].to(ref[name].dtype), ref[name]), name
    # q_proj / k_proj: llama.cpp's rope row order, applied to the grid's rows (codes and their block scales)
    from qconvert.formats.gguf.names import qk_row_permutation

    config = json.loads((fixture(variant) / "config.json").read_text())
    for module, gname in (("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k")):
        name = f"model.layers.0.{module}.weight"
        perm = qk_row_permutation(name, config, "llama")
        got = torch.from_numpy(np.asarray(tensors[f"blk.0.{gname}.weight"].data).copy()).reshape(exact[name].shape)
        assert perm is not None and torch.equal(got, exact[name][perm]), name
    logits = llama_logits(out, prompt(variant))
    diff = np.abs(logits - ref["__logits__"][0].numpy()).max()
    # measured: nf4 0.0053, fp4 0.0059 (bnb's fp16 model vs llama.cpp's f32); int8 0.094 (LLM.int8 matmul)
    assert diff < (0.15 if variant == "int8" else 0.02), diff


@pytest.mark.parametrize("variant", VARIANTS)
def test_to_hf_dense_is_bnb_dequantization_and_transformers_runs_it(tmp_path, variant):
    ref = reference(variant)
    want = "f32" if variant == "int8" else "f16"  # the dtype bitsandbytes dequantizes to
    out, rep = tmp_path / "hf", tmp_path / "report.json"
    run_cli("bnb->hf", fixture(variant), out, "--type", want, "--report", rep)
    report = _report(rep)
    weights = load_file(str(out / "model.safetensors"))
    for name, r in ref.items():
        if name == "__logits__":
            continue
        assert weights[name].dtype == r.dtype and torch.equal(weights[name], r), name
        assert report[name]["verdict"] == (EXACT if want == "f32" else NEAR_EXACT), report[name]
    logits = transformers_logits(out, prompt(variant))
    diff = np.abs(logits - ref["__logits__"][0].numpy()).max()
    assert diff < (0.15 if variant == "int8" else 0.01), diff  # measured 0.0046 / 0.0055 / 0.095


def test_inspect_names_the_scheme():
    for variant, kind, double in (("nf4_dq", "nf4", "True"), ("fp4", "fp4", "False"), ("int8", "int8", None)):
        text = run_cli("inspect", fixture(variant)).stdout
        assert "format: bitsandbytes" in text and f'"{kind}"' in text, text
        if double is not None:
            assert f"double_quant: {double}" in text, text


# ---------------------------------------------------------------------------------------------------------
# bad input: one line, exit 2, naming the file and the tensor


def _copy(variant: str, tmp_path: Path) -> Path:
    dst = tmp_path / f"src-{variant}"
    shutil.copytree(fixture(variant), dst, ignore=shutil.ignore_patterns("reference.safetensors"))
    return dst


Q = "model.layers.0.mlp.down_proj.weight"
QS = f"{Q}.quant_state.bitsandbytes__nf4"


def _set_state(tensors: dict, **changes) -> None:
    state = json.loads(bytes(tensors[QS].tolist()).decode())
    state.update(changes)
    tensors[QS] = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)


@pytest.mark.parametrize("edit, needles", [
    (lambda t: t.pop(f"{Q}.absmax"), ("without absmax", f"{Q}.absmax")),
    (lambda t: t.pop(QS), ("without its quant_state", Q)),
    (lambda t: t.__setitem__(QS, torch.tensor(list(b'{"quant_type": "nf4", "blocksize'), dtype=torch.uint8)),
     ("quant_state JSON is corrupt", QS)),
    (lambda t: _set_state(t, shape=[128, 128]), ("needs 8192 packed bytes", "holds 16384", QS)),
    (lambda t: _set_state(t, quant_type="int4"), ("unknown quant_type 'int4'", QS)),
    (lambda t: _set_state(t, blocksize=48), ("blocksize 48 is not supported", QS)),
    (lambda t: _set_state(t, blocksize=128), ("absmax shape (512,) does not match 256 blocks", f"{Q}.absmax")),
    (lambda t: _set_state(t, blocksize=512), ("not a multiple of blocksize 512", QS)),
    (lambda t: t.pop(f"{Q}.nested_quant_map"), ("nested_absmax without nested_quant_map",)),
], ids=["no-absmax", "no-quant-state", "corrupt-json", "shape-mismatch", "unknown-quant-type", "bad-blocksize",
        "absmax-count", "straddling-blocks", "no-nested-map"])
def test_bad_4bit_input_is_one_line(tmp_path, edit, needles):
    src = _copy("nf4_dq", tmp_path)
    edit_safetensors(src / "model.safetensors", edit)
    expect_user_error("bnb->gguf", src, tmp_path, "model.safetensors", *needles)


def test_bad_int8_input_is_one_line(tmp_path):
    src = _copy("int8", tmp_path)
    edit_safetensors(src / "model.safetensors", lambda t: t.pop("model.layers.0.mlp.up_proj.SCB"))
    expect_user_error("bnb->hf", src, tmp_path, "model.safetensors", "int8 weight without SCB",
                      "model.layers.0.mlp.up_proj.SCB")

"""IQ4_NL as a GGUF target, what is its own: the kernel's (kernels/ggml/iq4_nl.py) nearest table entry against
ggml-quants.c's best_index_int8, its zero blocks and row length, the checker's verdicts (formats/gguf/schemes.py),
and bitsandbytes' NF4 / FP4 and auto-round's uniform grid converted to it, judged by llama.cpp. The kernel's bytes
against ggml's own quantize_iq4_nl, and hf -> gguf against llama-quantize, with every other IQ type:
tests/kernels/test_iq_vs_ggml.py.

Oracles, all run here (none stored): ggml_quantize_chunk(GGML_TYPE_IQ4_NL) from llama-cpp-python's
libggml-base.so (kernels/ggml/libggml.py); gguf-py's IQ4_NL decoder; llama.cpp running the files; the producers'
own logits. The bitsandbytes sources are the real producer's checkpoints in tests/producer_fixtures/bitsandbytes
(scripts/producers/bitsandbytes.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from helpers import gguf_dequant, gguf_tensors, llama_logits, run_cli
from iq_cases import _report, _uniform_grid
from qconvert.converters.checker import EXACT, REFUSED, REQUANTIZE, check, decide
from qconvert.converters.records import GridParams
from qconvert.formats.bitsandbytes.reader import BnbSource
from qconvert.formats.gguf.names import qk_row_permutation
from qconvert.formats.gguf.schemes import ALIGNED_CANDIDATES, GGUF_SCHEMES, k_fallback
from qconvert.kernels.ggml.libggml import ggml_quantize
from qconvert.kernels.ggml.iq4_nl import KVALUES, best_index, dequantize_iq4_nl, quantize_iq4_nl

llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

REPO = Path(__file__).resolve().parents[2]
BNB = REPO / "tests" / "producer_fixtures" / "bitsandbytes"
CODEBOOK_REASON = "a 16-value codebook is not a uniform grid (IQ4_NL's 16 values are a different codebook)"


# ---------------------------------------------------------------------------------------------------------
# the kernel's nearest entry and edge cases (its bytes against ggml's: tests/kernels/test_iq_vs_ggml.py)


def _best_index_as_c(x: np.ndarray) -> np.ndarray:
    """ggml-quants.c best_index_int8 transcribed literally, one float32 at a time."""
    val = KVALUES.astype(np.float32)
    out = np.empty(x.size, np.uint8)
    for i, v in enumerate(x.astype(np.float32)):
        if v <= val[0]:
            out[i] = 0
            continue
        if v >= val[15]:
            out[i] = 15
            continue
        ml, mu = 0, 15
        while mu - ml > 1:
            mav = (ml + mu) // 2
            if v < val[mav]:
                mu = mav
            else:
                ml = mav
        out[i] = mu - 1 if np.float32(v - val[mu - 1]) < np.float32(val[mu] - v) else mu
    return out


def test_nearest_entry_by_midpoints_is_c_best_index():
    """The kernel counts midpoints; C compares two float32 differences: the same near every midpoint."""
    rng = np.random.default_rng(1)
    val = KVALUES.astype(np.float32)
    mids = (val[1:] + val[:-1]) / np.float32(2)
    steps = rng.integers(-40, 41, (200, 15)) * np.spacing(mids)[None, :]
    x = np.concatenate([(mids[None, :] + steps).astype(np.float32).ravel(), mids, val,
                        np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45, 1e30, -1e30], np.float32),
                        (rng.standard_normal(4000) * 60).astype(np.float32)])
    assert np.array_equal(best_index(x), _best_index_as_c(x))


def test_kernel_zero_blocks_and_row_length():
    data = quantize_iq4_nl(np.zeros((1, 32), np.float32))
    assert data.tobytes() == bytes(2) + bytes([0x88]) * 16  # d = 0, every code 8 (the entry nearest 0)
    with pytest.raises(ValueError, match="multiple of IQ4_NL's block of 32"):
        quantize_iq4_nl(np.zeros((1, 48), np.float32))


# ---------------------------------------------------------------------------------------------------------
# the checker


def test_every_source_requantizes_into_iq4_nl():
    s = GGUF_SCHEMES["IQ4_NL"]
    assert (s.ggml_type, s.block, s.block_bytes) == (20, 32, 18)
    dense = check("float16", (8, 128), s)
    assert dense.verdict == REQUANTIZE and "IQ4_NL quantizer" in dense.reason, dense
    # a Q4_0-like grid: Q4_0 keeps its codes exactly, IQ4_NL cannot (its steps are not uniform)
    g = _uniform_grid()
    assert check(g, (8, 128), GGUF_SCHEMES["Q4_0"]).verdict == EXACT
    d = decide(g, (8, 128), s, ALIGNED_CANDIDATES)
    assert d.verdict == REQUANTIZE and not d.keeps_codes and "non-linear 16-value table" in d.reason, d
    assert d.alternative == ("Q4_0", EXACT)
    # rows of no whole 32-blocks: the checker refuses, the writer stores F16 as for the legacy types
    assert check("float16", (8, 48), s).verdict == REFUSED
    assert check(_uniform_grid(cols=96), (8, 48), s).verdict == REFUSED
    assert k_fallback("IQ4_NL", (8, 48), None)[0] == "F16"
    assert k_fallback("IQ4_NL", (8, 64), None) == ("IQ4_NL", "")
    # bitsandbytes' NF4 / FP4 codebooks: requantized, the reason naming IQ4_NL's own codebook
    for variant in ("nf4_dq", "fp4"):
        rec = next(r for r in BnbSource(BNB / variant).records() if r.is_grid)
        d = check(rec.params, rec.shape, s)
        assert d.verdict == REQUANTIZE and not d.keeps_codes and CODEBOOK_REASON in d.reason, d


# ---------------------------------------------------------------------------------------------------------
# bitsandbytes NF4 / FP4 -> IQ4_NL


GGUF_NAME = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}


def _errors_against_source(out: Path, variant: str) -> dict[str, tuple[float, float]]:
    """(max abs, rmse) of gguf-py's decode of each linear against our float32 dequantization of the
    bitsandbytes grid, in GGUF row order (q/k rows permuted as llama.cpp's converter permutes them)."""
    src = BNB / variant
    config = json.loads((src / "config.json").read_text())
    tensors = gguf_tensors(out)
    errs = {}
    for rec in BnbSource(src).records():
        if not rec.is_grid:
            continue
        exact = rec.load().dequantize(torch.float32)
        perm = qk_row_permutation(rec.name, config, "llama")
        if perm is not None:
            exact = exact[perm]
        module = rec.name.split("layers.0.")[1].rsplit(".weight", 1)[0]
        got = torch.from_numpy(gguf_dequant(tensors[f"blk.0.{GGUF_NAME[module]}.weight"])).reshape(exact.shape)
        diff = (got - exact).double()
        errs[rec.name] = (float(diff.abs().max()), float(diff.pow(2).mean().sqrt()))
    return errs


@pytest.mark.parametrize("variant", ("nf4_dq", "fp4"))
def test_bnb_4bit_to_iq4_nl_reports_the_measured_error_and_llama_cpp_runs_it(tmp_path, variant):
    src = BNB / variant
    proc = run_cli("bnb->gguf", src, tmp_path / "refused.gguf", "--type", "iq4_nl", check_rc=2)
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "--allow-requant" in err and CODEBOOK_REASON in err, err
    out, rep = tmp_path / "iq4_nl.gguf", tmp_path / "report.json"
    run_cli("bnb->gguf", src, out, "--type", "iq4_nl", "--allow-requant", "--report", rep, "--quiet")
    report = _report(rep)
    quantized = [e for e in report.values() if e["source"].endswith("codebook blocksize 64")]
    assert len(quantized) == 7
    for e in quantized:
        assert e["target"] == "IQ4_NL" and e["verdict"] == REQUANTIZE and CODEBOOK_REASON in e["reason"], e
    errs = _errors_against_source(out, variant)
    for name, (max_abs, _) in errs.items():
        assert max_abs == report[name]["max_abs_err"], (name, max_abs, report[name])
    # the bytes are ggml's quantize_iq4_nl of our float32 dequantization
    tensors = gguf_tensors(out)
    down = next(r for r in BnbSource(src).records() if r.name.endswith("mlp.down_proj.weight"))
    x = down.load().dequantize(torch.float32).numpy()
    assert bytes(tensors["blk.0.ffn_down.weight"].data) == ggml_quantize(x, "IQ4_NL").tobytes()
    # against `--type Q4_K` from the same source, rmse over the 7 linears. These linears' rows are 128 wide, so
    # Q4_K falls back as llama-quantize's does: Q5_0 (the fallback for a grid requantized from its values; it was
    # Q5_1, with a min, before float and codebook grids took llama-quantize's choice), measured:
    # nf4_dq IQ4_NL 0.00522 vs Q5_0 0.00406: ratio 1.29 (1.57 against Q5_1's 0.00332).
    # (On dense N(0, 1) weights IQ4_NL and Q4_K are within 7%; these sources hold only 16 levels per 64-block,
    # which a 5-bit grid fits better than IQ4_NL's one scale and fixed table.)
    q4k = tmp_path / "q4_k.gguf"
    run_cli("bnb->gguf", src, q4k, "--type", "Q4_K", "--allow-requant", "--quiet")
    k_errs = _errors_against_source(q4k, variant)
    rmse_iq = float(np.sqrt(np.mean([e[1] ** 2 for e in errs.values()])))
    rmse_k = float(np.sqrt(np.mean([e[1] ** 2 for e in k_errs.values()])))
    assert 0 < rmse_iq < 0.008 and 0 < rmse_k < 0.005, (rmse_iq, rmse_k)
    assert 1.15 < rmse_iq / rmse_k < 2.0, (rmse_iq, rmse_k)
    # llama.cpp runs it: a smoke bound against bitsandbytes' own logits (requantizing moves them, as Q4_K does);
    # measured max 0.777 / rms 0.163 (nf4_dq), 0.784 / 0.186 (fp4); Q4_K: 0.495 / 0.104, 0.467 / 0.112
    logits = llama_logits(out, json.loads((src / "versions.json").read_text())["prompt_ids"])
    want = load_file(str(src / "reference.safetensors"))["__logits__"][0].numpy()
    assert np.abs(logits - want).max() < 1.0


# ---------------------------------------------------------------------------------------------------------
# a uniform grid that Q4_0 would keep exactly (auto-round 4-bit symmetric, group 32): requantized all the same

AUTO_ROUND = REPO / "tests" / "producer_fixtures" / "auto_round" / "sym4_g32"


def test_q4_0_like_grid_requantizes_and_names_the_exact_choice(tmp_path):
    from qconvert.formats.gguf.names import gguf_arch
    from qconvert.converters.registry import get_format

    proc = run_cli("auto-round->gguf", AUTO_ROUND, tmp_path / "refused.gguf", "--type", "iq4_nl", check_rc=2)
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "--type q4_0 (exact)" in err and "non-linear 16-value table" in err, err
    out, rep = tmp_path / "iq4_nl.gguf", tmp_path / "report.json"
    run_cli("auto-round->gguf", AUTO_ROUND, out, "--type", "iq4_nl", "--allow-requant", "--report", rep, "--quiet")
    report = _report(rep)
    source = get_format("auto-round").open_reader(AUTO_ROUND)
    arch = gguf_arch(source.config)
    tensors = gguf_tensors(out)
    grids = [r for r in source.records() if r.is_grid]
    assert len(grids) == 7
    for rec in grids:
        e = report[rec.name]
        assert e["target"] == "IQ4_NL" and e["verdict"] == REQUANTIZE, e
        x = rec.load().dequantize(torch.float32)
        perm = qk_row_permutation(rec.name, source.config, arch)
        if perm is not None:
            x = x[perm]
        t = tensors[e["out_name"]]
        assert bytes(t.data) == ggml_quantize(x.numpy(), "IQ4_NL").tobytes(), rec.name
        got = torch.from_numpy(gguf_dequant(t)).reshape(x.shape)
        assert float((got - x).abs().max()) == e["max_abs_err"], e
    # llama.cpp runs it, near auto-round's own model (its stored logits); requantizing moves them:
    # measured max 0.69 over a logit range of 8.64 (8%)
    stored = load_file(str(AUTO_ROUND / "logits.safetensors"))
    want = stored["logits"].float().numpy().reshape(-1, stored["logits"].shape[-1])
    got = llama_logits(out, stored["ids"].reshape(-1).tolist())
    diff = float(np.abs(got - want).max())
    assert diff < 0.15 * float(want.max() - want.min()), diff

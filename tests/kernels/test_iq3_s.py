"""IQ3_S as a GGUF target, what is its own: the kernel's lattice (kernels/ggml/iq3_s.py, kernels/ggml/iq_lattice.py)
against gguf-py's grid and C's neighbour order, the dead-block quirk, scale range and overflow as ggml's bytes and
aborts show them, the checker's verdicts and llama-quantize's 256 -> IQ4_NL fallback (formats/gguf/schemes.py), and
llama-quantize's IQ3_S file as a source, copied. The kernel's bytes against ggml's own quantize_iq3_s, its decoder
against gguf-py's, and hf -> gguf against llama-quantize, with every other IQ type: tests/kernels/test_iq_vs_ggml.py.

Oracles, all run here (none stored): ggml_quantize_chunk(GGML_TYPE_IQ3_S) from llama-cpp-python's
libggml-base.so (kernels/ggml/libggml.py), and in a child process where ggml aborts; llama-quantize
(llama_cpp.llama_model_quantize, LLAMA_FTYPE_MOSTLY_IQ3_S = 26) of our F32 GGUF (tests/kernels/conftest.py);
gguf-py's IQ3_S grid; llama.cpp running the file. The grid for the checker is tests/support/iq_cases.py's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import fixtures
from helpers import gguf_tensors, llama_logits, run_cli
from iq_cases import _report, _uniform_grid
from qconvert.converters.checker import EXACT, REFUSED, REQUANTIZE, check, decide
from qconvert.formats.gguf.schemes import ALIGNED_CANDIDATES, GGUF_SCHEMES, k_fallback
from qconvert.kernels.ggml.libggml import ggml_quantize
from qconvert.kernels.ggml.iq3_s import dequantize_iq3_s, quantize_iq3_s
from qconvert.kernels.ggml.iq_lattice import codes_of, lattice

llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

SB = 110  # bytes per 256-element super-block (gguf-py GGML_QUANT_SIZES)
PROMPT = fixtures.prompt_ids()


# ---------------------------------------------------------------------------------------------------------
# the kernel's lattice and the cases ggml's bytes show (its bytes against ggml's: tests/kernels/test_iq_vs_ggml.py)


def test_lattice_is_gguf_py_grid_and_neighbours_are_the_nearest_points():
    """The transcribed grid is the one the decoders use (gguf-py's IQ3_S grid, point for point), and each code
    off the grid lists the points at its 3 smallest distinct distances, by (distance, index): C's qsort order
    in iq3xs_init_impl, written here literally one code at a time."""
    lat = lattice("IQ3_S")
    gguf.quants.IQ3_S.init_grid()
    assert np.array_equal(lat.values, gguf.quants.IQ3_S.grid.reshape(512, 4))
    grid = lat.values.astype(np.int64)
    on = lat.kmap >= 0
    assert on.sum() == 512
    for u in np.flatnonzero(~on):
        pos = 2 * codes_of(np.array([u]), 3, 4)[0] + 1
        d2 = ((grid - pos) ** 2).sum(axis=1)
        order = sorted(range(512), key=lambda j: (d2[j], j))
        want, distinct = [], []
        for j in order:
            if d2[j] not in distinct:
                if len(distinct) == 3:
                    break
                distinct.append(d2[j])
            want.append(j)
        got = lat.nb_flat[lat.nb_start[u]:lat.nb_start[u] + lat.nb_count[u]]
        assert got.tolist() == want, u
    # and the map: every grid point's code maps to its index
    codes = (((grid - 1) // 2) << np.array([0, 3, 6, 9])).sum(axis=1)
    assert np.array_equal(lat.kmap[codes], np.arange(512))


def test_dead_block_quirk_and_scale_range_come_from_ggml():
    """ggml's own bytes show what the kernel reproduces: after a dead 32-block (all zeros) the next blocks'
    grid bytes and signs sit one slot early and the last slot stays 0 (C's `continue` skips the pointer
    increments), while qh keeps each block's place; the largest block scale is always 15; an all-zero
    super-block is 110 zero bytes."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    x[0, :32] = 0  # block 0 dead
    data = ggml_quantize(x, "IQ3_S").reshape(-1, SB)
    assert data.tobytes() == quantize_iq3_s(x).tobytes()
    qs, qh, signs = data[0, 2:66], data[0, 66:74], data[0, 74:106]
    assert (qs[56:] == 0).all() and (signs[28:] == 0).all() and qh[0] == 0
    # the shifted signs are block 1's: bit i of byte k is the sign of its value 8k + i
    want = np.packbits(x[0, 32:64] < 0, bitorder="little")
    assert np.array_equal(signs[:4], want)
    s = np.stack([data[:, 106:110] & 0xF, data[:, 106:110] >> 4], axis=2).reshape(2, 8)
    assert (s.max(axis=1) == 15).all()
    zeros = np.zeros((1, 256), np.float32)
    assert ggml_quantize(zeros, "IQ3_S").tobytes() == quantize_iq3_s(zeros).tobytes() == bytes(SB)
    with pytest.raises(ValueError, match="multiple of IQ3_S's block of 256"):
        quantize_iq3_s(np.zeros((1, 128), np.float32))


_ABORT_CHILD = """
import sys, numpy as np
from qconvert.kernels.ggml.libggml import ggml_quantize
x = (np.random.default_rng(1).standard_normal((2, 256)) * 1e37).astype(np.float32)
ggml_quantize(x, "IQ3_S")
print("returned")
"""


def test_overflowing_input_aborts_ggml_and_raises_here():
    """Values whose squares overflow float32 (x ~ 1e37) leave no neighbour of finite error: ggml's
    GGML_ASSERT(grid_index >= 0) aborts the process (run in a child), the kernel raises ValueError."""
    x = (np.random.default_rng(1).standard_normal((2, 256)) * 1e37).astype(np.float32)
    with pytest.raises(ValueError, match="aborts on this input"):
        quantize_iq3_s(x)
    env = {**os.environ, "GGML_NO_BACKTRACE": "1"}
    child = subprocess.run([sys.executable, "-c", _ABORT_CHILD], capture_output=True, text=True, env=env,
                           timeout=120)
    assert child.returncode == -6 and "returned" not in child.stdout, (child.returncode, child.stderr[-500:])
    assert "GGML_ASSERT(grid_index >= 0)" in child.stderr, child.stderr[-500:]


# ---------------------------------------------------------------------------------------------------------
# the checker and the 256 fallback


def test_every_source_requantizes_into_iq3_s_and_short_rows_fall_back_to_iq4_nl():
    s = GGUF_SCHEMES["IQ3_S"]
    assert (s.ggml_type, s.block, s.group, s.block_bytes, s.scale) == (21, 256, 32, SB, "k4")
    dense = check("float16", (8, 256), s)
    assert dense.verdict == REQUANTIZE and "IQ3_S quantizer" in dense.reason, dense
    g = _uniform_grid(cols=256)
    d = decide(g, (8, 256), s, ALIGNED_CANDIDATES)
    assert d.verdict == REQUANTIZE and not d.keeps_codes and "512-point lattice" in d.reason, d
    assert "IQ3_S quantizer" in d.reason and d.alternative == ("Q4_0", EXACT), d
    refused = check("float16", (8, 128), s)
    assert refused.verdict == REFUSED and "falls back to IQ4_NL" in refused.reason, refused
    # llama-quant.cpp tensor_type_fallback: IQ3_S -> IQ4_NL, and F16 where 32 does not divide the row either
    assert k_fallback("IQ3_S", (8, 128), None) == ("IQ4_NL", "IQ3_S needs rows of 256 (these have 128), "
                                                             "fallback IQ4_NL: ")
    assert k_fallback("IQ3_S", (4, 8, 128), _uniform_grid(cols=128))[0] == "IQ4_NL"
    assert k_fallback("IQ3_S", (8, 48), None)[0] == "F16"
    assert k_fallback("IQ3_S", (8, 512), None) == ("IQ3_S", "")


# ---------------------------------------------------------------------------------------------------------
# llama-quantize's IQ3_S file as the source (the conversion itself: tests/kernels/test_iq_vs_ggml.py)


@pytest.fixture(scope="module")
def llama_iq3(iq_llama) -> Path:
    """llama-quantize's IQ3_S of the tiny llama's F32 GGUF (tests/kernels/conftest.py)."""
    return iq_llama("IQ3_S")


def test_gguf_to_gguf_copies_iq3_s_blocks(llama_iq3, tmp_path):
    """llama-quantize's IQ3_S file as the source: its IQ3_S tensors are read with their blocks (gguf-py's decode
    for the values) and copied byte for byte into IQ3_S, the file running as before."""
    out, rep = tmp_path / "same.gguf", tmp_path / "same.json"
    run_cli("gguf->gguf", llama_iq3, out, "--report", rep, "--quiet")
    report = _report(rep)
    copied = [e for e in report.values() if e["target"] == "IQ3_S"]
    assert len(copied) == 2 and all(e["verdict"] == EXACT and e["reason"] == "IQ3_S blocks copied byte for byte"
                                    for e in copied), copied
    a, b = gguf_tensors(llama_iq3), gguf_tensors(out)
    for name in a:
        assert a[name].tensor_type == b[name].tensor_type and bytes(a[name].data) == bytes(b[name].data), name
    assert np.array_equal(llama_logits(llama_iq3, PROMPT), llama_logits(out, PROMPT))

"""The IQ1 writers (kernels/ggml/iq1.py over kernels/ggml/iq_c.c): IQ1_S and IQ1_M bytes equal to
ggml_quantize_chunk's on weight-shaped rows (1 and 2 threads), the shared IQ data kinds (tests/support/iq_cases.py:
zeros, tiny, subnormal, huge, ties, mixed...), edge rows (a single value, rows of one value, dead blocks in live
super-blocks, zero importance), NaN; IQ1_S refused without an importance matrix as ggml asserts one, IQ1_M without
one equal to ggml's x*x weighting.

Oracle, run here: ggml_quantize_chunk from llama-cpp-python's libggml-base.so (kernels/ggml/libggml.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from iq_cases import KINDS, _imatrix, _xs_data
from qconvert.kernels import dispatch
from qconvert.kernels.ggml import iq_c
from qconvert.kernels.ggml.iq1 import quantize_iq1_m, quantize_iq1_s
from qconvert.kernels.ggml.libggml import ggml_quantize

QUANTIZE = {"IQ1_S": quantize_iq1_s, "IQ1_M": quantize_iq1_m}


def _weights(rows: int, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """bf16-rounded weight-like rows (heavy-tailed, per-row scale, a few outlier columns) and an imatrix."""
    rng = np.random.default_rng(seed)
    x = rng.standard_t(5, (rows, n)) * (0.01 + 0.04 * rng.random((rows, 1)))
    x[:, rng.choice(n, 4, replace=False)] *= 20
    x = (x.astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)
    return x, (rng.gamma(0.5, 2.0, n) + 1e-3).astype(np.float32)


def _edges(n: int = 512) -> np.ndarray:
    """Zeros; tiny (1e-28 x, below both dead thresholds); subnormals; a dead 16-block and 32-block in live
    super-blocks; large values (x 1e4); a single nonzero value; a row of one value; alternating signs; a row of
    equal |x| with random signs (every sort ties); NaN in one block."""
    rng = np.random.default_rng(77)
    x = (rng.standard_normal((10, n)) * 0.03).astype(np.float32)
    x[0] = 0
    x[1] *= np.float32(1e-28)
    x[2] = rng.standard_normal(n).astype(np.float32) * np.float32(1e-40)
    x[3, 32:64] = 0
    x[3, 256 + 16:256 + 32] = 0
    x[4] *= np.float32(1e4)
    x[5] = 0
    x[5, 300] = 1.5
    x[6] = 0.25
    x[7] = np.where(np.arange(n) % 2, 0.1, -0.1)
    x[8] = np.where(rng.random(n) < 0.5, 0.5, -0.5)
    x[9, 40] = np.nan
    return x


@pytest.fixture(scope="module")
def c_path():
    assert iq_c.available(), "the C quantizers did not build (a C compiler is required in CI)"


@pytest.mark.parametrize("t", QUANTIZE)
def test_iq1_bytes_equal_ggml_on_weight_rows_one_and_two_threads(t, c_path):
    x, imatrix = _weights(16, 2048, 3)
    for weights in (imatrix, None):
        if weights is None and t == "IQ1_S":
            with pytest.raises(ValueError, match="needs an importance matrix"):
                quantize_iq1_s(x, None)
            continue
        theirs = ggml_quantize(x, t, weights)
        with dispatch.kernel_trace() as trace:
            one = QUANTIZE[t](x, weights, threads=1)
        assert trace["quantize"] == ["c"], trace
        assert one.shape == theirs.shape == (16, 2048 // 256 * iq_c.BLOCK_BYTES[t])
        assert one.tobytes() == theirs.tobytes(), f"{t} imatrix={weights is not None}: bytes differ from ggml"
        assert QUANTIZE[t](x, weights, threads=2).tobytes() == theirs.tobytes(), f"{t}: 2 threads changed the bytes"


@pytest.mark.parametrize("t", QUANTIZE)
def test_iq1_bytes_equal_ggml_on_data_kinds_and_edges(t, c_path):
    """Every data kind of the IQ comparisons with each importance vector (none: IQ1_M only), and the edge rows
    with zero importance on the first blocks."""
    rng = np.random.default_rng(11)
    for kind in (*KINDS, "subscales", "mirror", "odd"):
        x = _xs_data(kind, rng)
        for weighting in ("random", "sparse", "ones") + (("none",) if t == "IQ1_M" else ()):
            w = _imatrix(weighting, rng, x.shape[1])
            ours, theirs = QUANTIZE[t](x, w, threads=2), ggml_quantize(x, t, w)
            bad = np.flatnonzero((ours != theirs).any(axis=1))
            assert bad.size == 0, f"{t} {kind} {weighting}: rows {bad.tolist()} differ from ggml"
    x = _edges()
    w = np.random.default_rng(5).random(x.shape[1]).astype(np.float32)
    w[:64] = 0
    for weights in (w, None) if t == "IQ1_M" else (w,):
        ours, theirs = QUANTIZE[t](x, weights, threads=2), ggml_quantize(x, t, weights)
        bad = np.flatnonzero((ours != theirs).any(axis=1))
        assert bad.size == 0, f"{t} edges imatrix={weights is not None}: rows {bad.tolist()} differ from ggml"
    one = x[3:4, :256]  # one row of one super-block
    assert QUANTIZE[t](one, w[:256]).tobytes() == ggml_quantize(one, t, w[:256]).tobytes()


@pytest.mark.parametrize("t", QUANTIZE)
def test_iq1_decoders_equal_ggml_bit_for_bit(t, c_path, monkeypatch):
    """dequantize_iq1_s / _iq1_m (the C decoder the writer measures with and the GGUF reader reads with, and
    gguf-py's numpy decoder where C is not built) equal ggml's own dequantize_row_iq1_*: on the written bytes of
    weight rows and edge rows, and on random bytes (every index, scale, sign and fp16 d, subnormal, inf and NaN
    included), compared as bits (NaN too)."""
    from qconvert.kernels.ggml.iq1 import dequantize_iq1_m, dequantize_iq1_s
    from qconvert.kernels.ggml.libggml import ggml_dequantize

    decode = {"IQ1_S": dequantize_iq1_s, "IQ1_M": dequantize_iq1_m}[t]
    x, w = _weights(8, 1024, 9)
    written = QUANTIZE[t](x, w, threads=1)
    edges = QUANTIZE[t](_edges(), np.ones(512, np.float32), threads=1)
    noise = np.random.default_rng(21).integers(0, 256, (64, 4 * iq_c.BLOCK_BYTES[t]), dtype=np.uint8)
    for data, n in ((written, 1024), (edges, 512), (noise, 1024)):
        theirs = ggml_dequantize(data, t, n).view(np.uint32)
        ours = decode(data, n, threads=2)
        assert ours.shape == (data.shape[0], n)
        np.testing.assert_array_equal(ours.view(np.uint32), theirs, err_msg=f"{t}: C decoder != ggml")
        monkeypatch.setattr(iq_c, "available", lambda: False)
        with np.errstate(all="ignore"):  # gguf-py multiplies the NaN / inf d of the random bytes
            fallback = decode(data, n)
        np.testing.assert_array_equal(fallback.view(np.uint32), theirs, err_msg=f"{t}: gguf-py != ggml")
        monkeypatch.undo()


@pytest.mark.parametrize("t", QUANTIZE)
def test_iq1_ties_give_ggml_bytes_with_and_without_qsort(t, c_path):
    """Rows of a 4-bit GPTQ checkpoint's dequantized weights (16 levels per group of 128: ties in nearly every
    block) and of bf16 weights: ggml's bytes where tied blocks skip qsort (this machine's qsort is glibc's, stable,
    as the probe must find it) and where every tied block goes through qsort (portable_only, as with a C library
    whose qsort is not stable)."""
    x, w = _weights(16, 2048, 31)
    g = x.reshape(16, -1, 128)
    step = np.abs(g).max(-1, keepdims=True) / 7.5
    gridded = ((np.clip(np.round(g / step), -8, 7)) * step).reshape(16, 2048).astype(np.float32)
    import platform

    glibc = platform.libc_ver()[0] == "glibc"
    if glibc:
        assert iq_c.iq1_ties_skip_qsort(), "glibc's qsort is a stable merge sort: the probe should find it so"
    for portable in (False, True):
        iq_c.portable_only(portable)
        try:
            for rows in (gridded, x):
                ours, theirs = QUANTIZE[t](rows, w, threads=2), ggml_quantize(rows, t, w)
                bad = np.flatnonzero((ours != theirs).any(axis=1))
                assert bad.size == 0, f"{t} portable={portable}: rows {bad.tolist()} differ from ggml"
        finally:
            iq_c.portable_only(False)
    assert iq_c.iq1_ties_skip_qsort() or not glibc  # portable_only(False) took the shortcut back

"""The C twin of the lattice quantizers (kernels/ggml/iq_c.c, iq_c.py): IQ3_S, IQ3_XXS, IQ2_S, IQ2_XS, IQ2_XXS, the
default CPU path of kernels/ggml/iq3_s.py and iq2.py's quantize_* (tests/kernels/test_iq_vs_ggml.py's parametrized
comparison runs it over every data kind and importance vector). Here: weight-shaped rows with and without an
importance matrix on 1 and 2 threads, dead, tiny and huge blocks inside live super-blocks, each against
ggml_quantize_chunk; and the numpy codecs, kept as the readable reference and the fallback (QCONVERT_COMPILE=0),
still giving ggml's bytes.

Oracle, run here: ggml_quantize_chunk from llama-cpp-python's libggml-base.so (kernels/ggml/libggml.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from qconvert.kernels import dispatch
from qconvert.kernels.ggml import iq2, iq3_s, iq_c
from qconvert.kernels.ggml.libggml import ggml_quantize

TYPES = ("IQ2_XXS", "IQ3_XXS", "IQ3_S", "IQ2_XS", "IQ2_S")
NEEDS_WEIGHTS = ("IQ2_XS", "IQ2_XXS")  # ggml asserts an importance matrix


def _quantize(t: str):
    return getattr(iq3_s if t.startswith("IQ3") else iq2, f"quantize_{t.lower()}")


def _weights(rows: int, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """bf16-rounded weight-like rows (heavy-tailed, per-row scale, a few outlier columns) and an imatrix."""
    rng = np.random.default_rng(seed)
    x = rng.standard_t(5, (rows, n)) * (0.01 + 0.04 * rng.random((rows, 1)))
    x[:, rng.choice(n, 4, replace=False)] *= 20
    x = (x.astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)  # bf16 values
    imatrix = (rng.gamma(0.5, 2.0, n) + 1e-3).astype(np.float32)
    return x, imatrix


def _edges(n: int = 1024) -> np.ndarray:
    """Rows of edge cases: all zero; tiny (1e-30, below every dead threshold); a dead 32-block and a dead 16-block
    inside live super-blocks (IQ3_S's pointer quirk); subnormals; large values (x 1e4);
    a single nonzero value; all equal values; alternating signs."""
    rng = np.random.default_rng(77)
    x = (rng.standard_normal((9, n)) * 0.03).astype(np.float32)
    x[0] = 0
    x[1] *= np.float32(1e-28)
    x[2, 32:64] = 0
    x[2, 256 + 16:256 + 32] = 0
    x[3] = rng.standard_normal(n).astype(np.float32) * np.float32(1e-40)
    x[4] *= np.float32(1e4)
    x[5] = 0
    x[5, 300] = 1.5
    x[6] = 0.25
    x[7] = np.where(np.arange(n) % 2, 0.1, -0.1)
    x[8, :256] = 0
    return x


@pytest.fixture(scope="module")
def c_path():
    assert iq_c.available(), "the C lattice quantizers did not build (a C compiler is required in CI)"


@pytest.mark.parametrize("t", TYPES)
def test_c_bytes_equal_ggml_on_weight_rows_one_and_two_threads(t, c_path):
    x, imatrix = _weights(16, 2048, TYPES.index(t))
    quantize = _quantize(t)
    for weights in (imatrix, None):
        if weights is None and t in NEEDS_WEIGHTS:
            with pytest.raises(ValueError, match="needs an importance matrix"):
                quantize(x, None)
            continue
        theirs = ggml_quantize(x, t, weights)
        with dispatch.kernel_trace() as trace:
            one = quantize(x, weights, threads=1)
        assert trace["quantize"] == ["c"], trace
        two = quantize(x, weights, threads=2)
        assert one.shape == theirs.shape == (16, 2048 // 256 * iq_c.BLOCK_BYTES[t])
        assert one.tobytes() == theirs.tobytes(), f"{t} imatrix={weights is not None}: bytes differ from ggml"
        assert two.tobytes() == theirs.tobytes(), f"{t}: 2 threads changed the bytes"


@pytest.mark.parametrize("t", TYPES)
def test_c_bytes_equal_ggml_on_edge_rows(t, c_path):
    x = _edges()
    imatrix = np.random.default_rng(5).random(x.shape[1]).astype(np.float32)
    imatrix[:64] = 0  # zero importance: every weight of those blocks 0
    quantize = _quantize(t)
    for weights in (imatrix, None):
        if weights is None and t in NEEDS_WEIGHTS:
            continue
        theirs = ggml_quantize(x, t, weights)
        ours = quantize(x, weights, threads=2)
        bad = np.flatnonzero((ours != theirs).any(axis=1))
        assert bad.size == 0, f"{t} imatrix={weights is not None}: rows {bad.tolist()} differ from ggml"
    # a row of one super-block, and one row only
    one = x[2:3, :256]
    w = imatrix[:256]
    assert quantize(one, w, threads=2).tobytes() == ggml_quantize(one, t, w).tobytes()


@pytest.mark.parametrize("t", (*TYPES, "IQ1_S", "IQ1_M"))
def test_portable_searches_equal_ggml(t, c_path):
    """The neighbour searches' portable C (a CPU without AVX2: ARM, old x86), forced here where the AVX2 versions
    would run, gives ggml's bytes too: weight rows and edge rows, with an importance matrix and (where ggml allows)
    without."""
    from qconvert.kernels.ggml import iq1

    quantize = getattr(iq1, f"quantize_{t.lower()}") if t.startswith("IQ1") else _quantize(t)
    x, imatrix = _weights(8, 2048, 90 + len(t))
    rows = np.concatenate([x, _edges(2048)])
    iq_c.portable_only(True)
    try:
        for weights in (imatrix, None) if t in ("IQ3_S", "IQ3_XXS", "IQ2_S", "IQ1_M") else (imatrix,):
            ours, theirs = quantize(rows, weights, threads=2), ggml_quantize(rows, t, weights)
            bad = np.flatnonzero((ours != theirs).any(axis=1))
            assert bad.size == 0, f"{t} imatrix={weights is not None}: rows {bad.tolist()} differ from ggml"
    finally:
        iq_c.portable_only(False)


def test_huge_values_raise_where_ggml_aborts(c_path):
    """Values whose squares overflow float32 leave no neighbour of finite error: ggml aborts (shown in
    test_iq3_s.py / test_iq_low_bit.py), the C path raises ValueError as the numpy one does. IQ2_XXS does not get
    there (make_qp_quants' scale is not finite, eff_max <= 0 is false, every trial fails): ggml returns, with
    these bytes."""
    x = (np.random.default_rng(1).standard_normal((2, 256)) * 1e37).astype(np.float32)
    ones = np.ones(256, np.float32)
    for t in TYPES:
        if t == "IQ2_XXS":
            assert _quantize(t)(x, ones).tobytes() == ggml_quantize(x, t, ones).tobytes()
            continue
        with pytest.raises(ValueError, match="aborts on this input"):
            _quantize(t)(x, ones)


@pytest.mark.parametrize("t", TYPES)
def test_numpy_fallback_still_equals_ggml(t, monkeypatch):
    """QCONVERT_COMPILE=0 (or no compiler): the numpy codec runs, with ggml's bytes."""
    monkeypatch.setenv("QCONVERT_COMPILE", "0")
    assert not iq_c.available()
    x, imatrix = _weights(4, 512, 40 + TYPES.index(t))
    x = np.concatenate([x, _edges(512)[[0, 2, 5]]])
    ours = _quantize(t)(x, imatrix, threads=1)
    assert ours.tobytes() == ggml_quantize(x, t, imatrix).tobytes()


@pytest.mark.parametrize("t", ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"))
def test_k_types_with_imatrix_take_the_c_path_with_ggml_bytes(t, c_path):
    """quantize_k with an importance matrix: kernels/ggml/kquant_imatrix_c.c (no torch.compile), ggml's bytes on
    weight rows and edge rows, 1 and 2 threads, noted as kernel "c"."""
    from qconvert.kernels.ggml.kquants import quantize_k

    x, imatrix = _weights(32, 2048, 60)
    edges = _edges(2048)
    imatrix[:40] = 0
    for rows in (x, edges):
        theirs = ggml_quantize(rows, t, imatrix)
        with dispatch.kernel_trace() as trace:
            one = quantize_k(rows, t, imatrix=imatrix, threads=1)
        assert trace["quantize"] == ["c"], trace
        assert one.tobytes() == theirs.tobytes(), f"{t}: bytes differ from ggml"
        assert quantize_k(rows, t, imatrix=imatrix, threads=2).tobytes() == theirs.tobytes()

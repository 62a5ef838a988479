"""K-quant codecs (kernels/kquants.py) against gguf-py's dequantizers and llama.cpp's C reference.

The C oracle is the reference quantizer compiled into llama-cpp-python's `libggml-base.so`
(`ggml_quantize_chunk` with no importance matrix, i.e. `quantize_row_q*_K_ref`, what llama-quantize
does without --imatrix), called through ctypes. Those tests skip only when llama_cpp is not
importable. Identical-block percentages are printed (run with -s) and recorded as properties.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import gguf
import numpy as np
import pytest

from kquant_data import DATA, MAX_RMSE_RATIO, MIN_IDENTICAL
from qconvert.kernels.ggml import kquants as kq

TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# byte offsets of the fp16 super-block scales (d, dmin) inside each block
FP16_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _gguf_dequant(q: np.ndarray, t: str) -> np.ndarray:
    return gguf.quants.dequantize(q, gguf.GGMLQuantizationType[t])


def _rmse(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a.astype(np.float64) - b) ** 2)))


# ------------------------------------------------------------------------------------------------
# C oracle


class _Oracle:
    def __init__(self, lib_path: Path):
        self.lib = ctypes.CDLL(str(lib_path))
        f = self.lib.ggml_quantize_chunk
        f.restype = ctypes.c_size_t
        f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                      ctypes.c_int64, ctypes.c_void_p]
        for name in ("quantize_row_q8_K_ref",
                     *(f"quantize_row_{t[:2].lower()}_K_ref" for t in TYPES),
                     *(f"dequantize_row_{t[:2].lower()}_K" for t in (*TYPES, "Q8_K"))):
            g = getattr(self.lib, name)
            g.restype = None
            g.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]

    def quantize(self, x: np.ndarray, t: str) -> np.ndarray:
        x = np.ascontiguousarray(x, np.float32)
        rows, n = x.shape
        out = np.zeros((rows, n // 256 * kq.BLOCK_BYTES[t]), np.uint8)
        if t == "Q8_K":  # not a storage type: ggml_quantize_chunk does not take it
            self.lib.quantize_row_q8_K_ref(x.ctypes.data, out.ctypes.data, x.size)
            return out
        size = self.lib.ggml_quantize_chunk(int(gguf.GGMLQuantizationType[t]), x.ctypes.data,
                                            out.ctypes.data, 0, rows, n, None)
        assert size == out.nbytes
        return out

    def quantize_row_ref(self, x: np.ndarray, t: str) -> np.ndarray:
        x = np.ascontiguousarray(x, np.float32)
        out = np.zeros((x.shape[0], x.shape[1] // 256 * kq.BLOCK_BYTES[t]), np.uint8)
        getattr(self.lib, f"quantize_row_{t[:2].lower()}_K_ref")(x.ctypes.data, out.ctypes.data, x.size)
        return out

    def dequantize(self, q: np.ndarray, t: str) -> np.ndarray:
        q = np.ascontiguousarray(q)
        y = np.empty((q.shape[0], q.shape[1] // kq.BLOCK_BYTES[t] * 256), np.float32)
        getattr(self.lib, f"dequantize_row_{t[:2].lower()}_K")(q.ctypes.data, y.ctypes.data, y.size)
        return y


@pytest.fixture(scope="module")
def oracle() -> _Oracle:
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed: no C reference quantizer to compare with")
    lib = Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"
    assert lib.exists(), f"llama_cpp is importable but {lib} is missing"
    return _Oracle(lib)


# ------------------------------------------------------------------------------------------------
# dequantization == gguf-py


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("name", list(DATA))
def test_dequantize_matches_gguf_py_on_our_bytes(t, name):
    x = DATA[name]
    q = kq.quantize_k(x, t)
    assert q.dtype == np.uint8 and q.shape == (x.shape[0], x.shape[1] // 256 * kq.BLOCK_BYTES[t])
    ours = kq.dequantize_k(q, t)
    ref = _gguf_dequant(q, t)
    assert ours.dtype == np.float32 and ours.shape == x.shape
    np.testing.assert_array_equal(ours, ref)
    assert np.isfinite(ours).all()
    # what a zero input row quantizes to must decode to exact zeros
    zero_rows = ~x.any(axis=1)
    assert (ours[zero_rows] == 0).all()


@pytest.mark.parametrize("t", TYPES)
def test_dequantize_matches_gguf_py_on_random_blocks(t):
    rng = np.random.default_rng(7)
    nblocks = 4096
    q = rng.integers(0, 256, (nblocks, kq.BLOCK_BYTES[t]), dtype=np.uint8)
    for off in FP16_FIELDS[t]:  # sane finite fp16 scales, including some zeros and subnormals
        v = (rng.standard_normal(nblocks) * 10.0 ** rng.integers(-7, 2, nblocks)).astype(np.float16)
        v[::97] = 0
        q[:, off:off + 2] = v.view(np.uint8).reshape(nblocks, 2)
    q = q.reshape(64, -1)
    ours = kq.dequantize_k(q, t)
    np.testing.assert_array_equal(ours, _gguf_dequant(q, t))
    assert ours.shape == (64, nblocks // 64 * 256)


@pytest.mark.parametrize("t", TYPES)
def test_dequantize_matches_c_on_random_blocks(t, oracle):
    rng = np.random.default_rng(8)
    q = rng.integers(0, 256, (1024, kq.BLOCK_BYTES[t]), dtype=np.uint8)
    for off in FP16_FIELDS[t]:
        v = (rng.standard_normal(1024) * 0.01).astype(np.float16)
        q[:, off:off + 2] = v.view(np.uint8).reshape(-1, 2)
    q = q.reshape(16, -1)
    np.testing.assert_array_equal(kq.dequantize_k(q, t), oracle.dequantize(q, t))


# ------------------------------------------------------------------------------------------------
# quantization == llama.cpp reference


@pytest.mark.parametrize("path", ["numpy", "c"])
@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("name", list(DATA))
def test_quantize_matches_c_reference(t, name, path, oracle, record_property, monkeypatch):
    """Both of our reference quantizers: the numpy codecs and their C twin (kernels/kquant_c.c)."""
    from qconvert.kernels.ggml import kquant_c

    x = DATA[name]
    if path == "numpy":
        _no_c(monkeypatch)
    elif not kquant_c.available():
        pytest.skip("no C compiler (or QCONVERT_COMPILE=0): the C quantizers are not built")
    with np.errstate(all="ignore"):  # the denormal row makes C and us divide by ~0 alike
        ours = kq.quantize_k(x, t)
    ref = oracle.quantize(x, t)
    bb = kq.BLOCK_BYTES[t]
    same = (ours.reshape(-1, bb) == ref.reshape(-1, bb)).all(axis=1)
    pct = 100.0 * same.mean()
    r_ours = _rmse(kq.dequantize_k(ours, t), x)
    r_ref = _rmse(kq.dequantize_k(ref, t), x)
    ratio = r_ours / r_ref if r_ref else (1.0 if r_ours == 0 else float("inf"))
    record_property("identical_blocks_pct", pct)
    record_property("rmse_ratio", ratio)
    print(f"\n{t} {name}: {same.size} blocks, {pct:.4f}% byte-identical to C, "
          f"RMSE ours {r_ours:.4g} / C {r_ref:.4g} = {ratio:.6f}")
    assert same.mean() >= MIN_IDENTICAL, f"{t} {name}: only {pct:.4f}% of blocks identical to C"
    assert r_ours <= r_ref * MAX_RMSE_RATIO + 1e-30, f"{t} {name}: RMSE {r_ours} vs C {r_ref}"


def test_c_oracle_entry_points_agree(oracle):
    """ggml_quantize_chunk (imatrix NULL) is the same algorithm as quantize_row_*_ref, so the oracle
    used above is the reference quantizer and not a weighted variant."""
    x = DATA["normal"][:8]
    for t in TYPES:
        np.testing.assert_array_equal(oracle.quantize(x, t), oracle.quantize_row_ref(x, t))


def test_q8_k_matches_c_reference(oracle):
    x = np.concatenate([DATA["normal"][:16, :2048], DATA["mixed"][:, :2048]], axis=0)
    with np.errstate(all="ignore"):
        ours = kq.quantize_k(x, "Q8_K").reshape(-1, 292)
    ref = oracle.quantize(x, "Q8_K").reshape(-1, 292)
    np.testing.assert_array_equal(ours[:, :260], ref[:, :260])  # d and qs
    nonzero = ours[:, :4].view(np.float32)[:, 0] != 0  # C leaves bsums of all-zero blocks unset
    np.testing.assert_array_equal(ours[nonzero, 260:], ref[nonzero, 260:])
    q = ours.reshape(x.shape[0], -1)
    np.testing.assert_array_equal(kq.dequantize_k(q, "Q8_K"), oracle.dequantize(q, "Q8_K"))


# ------------------------------------------------------------------------------------------------
# properties that hold without the oracle


@pytest.mark.parametrize("t", TYPES)
def test_error_within_type_bound(t):
    """Every element decodes within one code step of its input: |x - y| <= d_eff (the sub-block's
    d*sc, plus the min's fp16/6-bit rounding for the affine types)."""
    x = DATA["normal"]
    y = kq.dequantize_k(kq.quantize_k(x, t), t)
    err = np.abs(y - x).reshape(-1, 16)
    span = np.ptp(x.reshape(-1, 16), axis=1, keepdims=True)
    # loose, type-specific: steps per sub-block span, with room for the 2nd-stage scale rounding
    steps = {"Q2_K": 3, "Q3_K": 7, "Q4_K": 15, "Q5_K": 31, "Q6_K": 63}[t]
    assert (err <= span / steps * 2.0 + 1e-7).all()
    rel = _rmse(y, x) / x.std()
    assert rel < {"Q2_K": 0.4, "Q3_K": 0.2, "Q4_K": 0.1, "Q5_K": 0.05, "Q6_K": 0.025}[t]


def test_shapes_and_dispatch():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 512)).astype(np.float32)
    for t in TYPES:
        q = kq.quantize_k(x, t)
        assert q.shape == (2, 3, 2 * kq.BLOCK_BYTES[t])
        np.testing.assert_array_equal(q.reshape(6, -1), kq.quantize_k(x.reshape(6, 512), t))
        np.testing.assert_array_equal(kq.quantize_k(x[0, 0], t), q[0, 0])  # 1-D row
        assert kq.dequantize_k(q, t).shape == x.shape
    # enum and lower-case names, float64 input
    np.testing.assert_array_equal(kq.quantize_k(x.astype(np.float64), gguf.GGMLQuantizationType.Q4_K),
                                  kq.quantize_k(x, "q4_k"))
    np.testing.assert_array_equal(kq.quantize_q6_K(x), kq.quantize_k(x, "Q6_K"))
    with pytest.raises(ValueError):
        kq.quantize_k(x[..., :300], "Q4_K")
    with pytest.raises(ValueError):
        kq.quantize_k(x, "Q4_0")
    with pytest.raises(ValueError):
        kq.dequantize_k(np.zeros((2, 100), np.uint8), "Q4_K")
    with pytest.raises(ValueError):  # an importance matrix must have one value per column
        kq.quantize_k(x, "Q4_K", imatrix=np.ones(x.shape[-1] + 256, np.float32))


def test_chunking_does_not_change_bytes(monkeypatch):
    """Blocks are independent: a different chunk size must give the same bytes (numpy chunks, and the C
    quantizers' chunks handed to threads, including a last partial tile)."""
    from qconvert.kernels.ggml import kquant_c

    x = DATA["real_shaped"][:6]
    with monkeypatch.context() as m:
        _no_c(m)
        ref = {t: kq.quantize_k(x, t) for t in TYPES}
        m.setattr(kq, "_CHUNK", 7)
        for t in TYPES:
            np.testing.assert_array_equal(kq.quantize_k(x, t), ref[t])
    if kquant_c.available():
        monkeypatch.setattr(kquant_c, "CHUNK_BLOCKS", 5)
        for t in TYPES:
            for threads in (1, 2, 3):
                np.testing.assert_array_equal(kq.quantize_k(x, t, threads=threads), ref[t])


def test_c_quantizers_equal_ggml_on_non_finite_input(oracle):
    """NaN, inf, float32 extremes and denormals: the C twin follows C's nearest_int and comparisons,
    so its bytes are ggml's even where the numpy codecs' are not."""
    from qconvert.kernels.ggml import kquant_c

    if not kquant_c.available():
        pytest.skip("no C compiler (or QCONVERT_COMPILE=0): the C quantizers are not built")
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((64, 1024)) * 0.02).astype(np.float32)
    x[1, 5] = np.nan
    x[2, 300] = np.inf
    x[3, 7] = -np.inf
    x[4, :256] = np.nan
    x[5, 600] = 3e38
    x[6, 10] = 1e-42
    for t in TYPES:
        with np.errstate(all="ignore"):
            np.testing.assert_array_equal(kq.quantize_k(x, t, threads=2), oracle.quantize(x, t), err_msg=t)


# ------------------------------------------------------------------------------------------------
# the compiled searches (kernels/kquant_fused.py): the same bytes as the numpy searches and as C


@pytest.fixture
def compiled_searches(monkeypatch):
    """Send every tensor through the compiled searches (not only those >= MIN_VALUES) and count the
    searches they actually ran, so that a silent fallback to numpy cannot pass for them."""
    from qconvert.kernels.ggml import kquant_fused as kf

    assert kf.available(), "QCONVERT_COMPILE=0, or a compiled search already failed in this process"
    monkeypatch.setattr(kf, "MIN_VALUES", 0)
    _no_c(monkeypatch)
    used = {"searches": 0}
    for name in ("qx_search", "qkx2_search"):
        real = getattr(kf, name)

        def spy(*args, _real=real, **kwargs):
            found = _real(*args, **kwargs)
            used["searches"] += found is not None
            return found

        monkeypatch.setattr(kf, name, spy)
    yield used
    assert kf.available(), "a compiled search failed (see kquant_fused._run) and fell back to numpy"


def _no_c(monkeypatch) -> None:
    """Keep quantize_k off the C quantizers (kernels/kquant_c.c) for this test."""
    from qconvert.kernels.ggml import kquant_c

    monkeypatch.setattr(kquant_c, "available", lambda: False)


def _numpy_bytes(x, t, imatrix=None):
    from qconvert.kernels.ggml import iq_c, kquant_c
    from qconvert.kernels.ggml import kquant_fused as kf

    saved, saved_c, saved_iq = kf.MIN_VALUES, kquant_c.available, iq_c.available
    kf.MIN_VALUES = 1 << 62
    kquant_c.available = iq_c.available = lambda: False  # the C twins too (iq_c: the imatrix K types)
    try:
        return kq.quantize_k(x, t, imatrix=imatrix, threads=1)
    finally:
        kf.MIN_VALUES, kquant_c.available, iq_c.available = saved, saved_c, saved_iq


# The compiled searches are the fallback where no C compiler is found (every other test runs the C twins): they are
# compared on the first 8 rows of each dataset (every edge row of them), whose numpy reference takes seconds
# rather than the minute the full sets took in a cold CI run; the compile itself is most of what is left.
COMPILED_DATA = {name: x[:8] for name, x in DATA.items()}


# Q3_K without an importance matrix has no compiled part (its coordinate descent stays in numpy)
@pytest.mark.parametrize("t", ["Q2_K", "Q4_K", "Q5_K", "Q6_K"])
def test_compiled_searches_give_the_numpy_and_c_bytes(t, compiled_searches, oracle):
    for name, x in COMPILED_DATA.items():
        with np.errstate(all="ignore"):
            ours = kq.quantize_k(x, t, threads=1)
            ref = _numpy_bytes(x, t)
        np.testing.assert_array_equal(ours, ref, err_msg=f"{t} {name}: compiled != numpy")
        bb = kq.BLOCK_BYTES[t]
        same = (ours.reshape(-1, bb) == oracle.quantize(x, t).reshape(-1, bb)).all(axis=1)
        print(f"\n{t} {name} compiled: {100 * same.mean():.4f}% of {same.size} blocks identical to C")
        assert same.mean() >= MIN_IDENTICAL
    assert compiled_searches["searches"] >= len(COMPILED_DATA)


@pytest.mark.parametrize("t", TYPES)
def test_compiled_weighted_searches_equal_ggml(t, compiled_searches, monkeypatch):
    """With an importance matrix every K type has a compiled search (Q3_K: make_qx_quants), the fallback where
    the C twin (kernels/ggml/kquant_imatrix_c.c: Q4_K, Q5_K, Q6_K; tests/kernels/test_iq_c.py) is not built."""
    from qconvert.kernels.ggml import iq_c
    from qconvert.kernels.ggml.libggml import available, ggml_quantize

    monkeypatch.setattr(iq_c, "available", lambda: False)

    if not available():
        pytest.skip("llama-cpp-python is not installed: no ggml_quantize_chunk to compare with")
    rng = np.random.default_rng(5)
    for x in (COMPILED_DATA["normal"], COMPILED_DATA["real_shaped"], DATA["mixed"]):
        imat = rng.gamma(0.7, 1.0, x.shape[1]).astype(np.float32)
        imat[rng.random(x.shape[1]) < 0.05] = 0.0
        with np.errstate(all="ignore"):
            ours = kq.quantize_k(x, t, imatrix=imat, threads=1)
            np.testing.assert_array_equal(ours, _numpy_bytes(x, t, imat))
            np.testing.assert_array_equal(ours, ggml_quantize(x, t, imatrix=imat))
    assert compiled_searches["searches"] >= 3


def test_compiled_searches_on_torch_threads(compiled_searches, monkeypatch):
    """threads=2 on the compiled path runs the loops on torch's intra-op threads: same bytes, and the
    caller's torch thread count is restored. One type (each thread count is its own compile: the two types this
    took were 97 s of a cold CI run; test_compiled_searches_give_the_numpy_and_c_bytes covers the others)."""
    import torch

    monkeypatch.setattr(kq, "_CHUNK", 8)  # small enough for the threaded branch
    x = COMPILED_DATA["real_shaped"]
    before = torch.get_num_threads()
    np.testing.assert_array_equal(kq.quantize_k(x, "Q4_K", threads=2), kq.quantize_k(x, "Q4_K", threads=1))
    assert torch.get_num_threads() == before
    assert compiled_searches["searches"] >= 2

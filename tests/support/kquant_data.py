"""The datasets the quantizers are compared with llama.cpp's C reference on (tests/kernels/test_kquants.py,
tests/kernels/test_legacy_vs_ggml.py): LLM-shaped bf16 weights, all-zero rows and blocks, tiny and huge magnitudes,
denormals, exact ties; and the bounds those comparisons hold them to."""

from __future__ import annotations

import numpy as np

MIN_IDENTICAL = 0.999
MAX_RMSE_RATIO = 1.001


def _bf16(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even to bfloat16 and back, like a checkpoint stored in bf16."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def _datasets() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(20240611)
    d = {}
    d["normal"] = (rng.standard_normal((64, 4096)) * 0.05).astype(np.float32)
    # LLM-weight-like: heavy tails, per-row and per-column scales, a few outlier input channels,
    # bf16 storage, a row length that is not a power of two (11008 = 43 * 256)
    rows, cols = 48, 11008
    col_scale = np.exp(rng.normal(0, 0.3, cols))
    col_scale[rng.choice(cols, 12, replace=False)] *= 25
    w = rng.standard_t(4, (rows, cols)) * np.exp(rng.normal(-4, 0.5, (rows, 1))) * col_scale
    d["real_shaped"] = _bf16(w.astype(np.float32))
    z = (rng.standard_normal((8, 1024)) * 0.02).astype(np.float32)
    z[0] = 0  # all-zero row
    z[3, :384] = 0  # zero super-block and half of the next
    z[5, ::2] = 0
    d["zero_rows"] = z
    d["tiny"] = (rng.standard_normal((16, 1024)) * 1e-8).astype(np.float32)
    d["huge"] = (rng.standard_normal((16, 1024)) * 1e4).astype(np.float32)
    m = (rng.standard_normal((12, 2048)) * 10.0 ** rng.integers(-6, 4, (12, 1))).astype(np.float32)
    m[1] = 0
    m[2] = 0.37  # constant positive
    m[3] = -np.abs(m[3])  # all negative
    m[4, rng.random(2048) < 0.9] = 0  # sparse
    m[5] = np.round(m[5] / m[5].std() * 2) / 4  # coarse grid: many exact ties, +-a pairs
    m[6] = rng.standard_normal(2048).astype(np.float32) * 1e-39  # denormals
    m[7, :256] = np.sign(rng.standard_normal(256))  # +-1 only
    d["mixed"] = m
    return d


DATA = _datasets()

"""The legacy quantizers (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) against llama.cpp's own C reference
(`ggml_quantize_chunk` from the llama-cpp-python wheel), on the same datasets as the K-quant tests:
LLM-shaped bf16 weights, all-zero rows and blocks, tiny and huge magnitudes, denormals, exact ties.
Every path of ours is checked: the C twin that conversions take where a C compiler built it
(kernels/kquant_c.c), the eager torch codec and the fused torch.compile kernel that large tensors take without
it (tests/e2e/test_bench_quantize.py covers the fused one on 4M-value tensors as well). The C twin also gives
ggml's bytes on NaN, infinities, denormals and values that overflow fp16."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qconvert.kernels.ggml.layouts import LAYOUTS, LEGACY_TYPES
from qconvert.kernels.ggml import kquant_c
from qconvert.kernels.ggml.legacy import decode_blocks, quantize_pack
from kquant_data import DATA, MAX_RMSE_RATIO, MIN_IDENTICAL

ggml_ctypes = pytest.importorskip("qconvert.kernels.ggml.libggml")
if not ggml_ctypes.available():
    pytest.skip("llama-cpp-python's libggml-base.so is not installed: no C reference", allow_module_level=True)


def _rmse(q: np.ndarray, t: str, x: np.ndarray) -> float:
    y = decode_blocks(LAYOUTS[t], torch.from_numpy(q)).numpy().reshape(x.shape)
    return float(np.sqrt(np.mean((y.astype(np.float64) - x) ** 2)))


# every legacy type through the C twin and the eager codec; Q4_0 and Q8_0 (the types with a fused kernel) also
# through that
PATHS = ([(t, "c") for t in LEGACY_TYPES] + [(t, "eager") for t in LEGACY_TYPES]
         + [("Q4_0", "fused"), ("Q8_0", "fused")])


def _ours(lay, x: np.ndarray, path: str) -> np.ndarray:
    if path == "c":
        assert kquant_c.available(), "the C quantizers did not build (a C compiler is part of the test machine)"
        return quantize_pack(lay, torch.from_numpy(x), c=True).numpy()
    return quantize_pack(lay, torch.from_numpy(x), fused=path == "fused", c=False).numpy()


@pytest.mark.parametrize("t,path", PATHS, ids=[f"{t}-{p}" for t, p in PATHS])
def test_legacy_quantizer_matches_c_reference(t, path):
    lay = LAYOUTS[t]
    for name, x in DATA.items():
        with np.errstate(all="ignore"):
            ours = _ours(lay, x, path)
            ref = ggml_ctypes.ggml_quantize(x, t)
        same = (ours.reshape(-1, lay.nbytes) == ref.reshape(-1, lay.nbytes)).all(axis=1)
        pct = 100.0 * same.mean()
        r_ours, r_ref = _rmse(ours, t, x), _rmse(ref, t, x)
        print(f"\n{t} {path} {name}: {same.size} blocks, {pct:.4f}% identical to C, "
              f"RMSE {r_ours:.4g} / {r_ref:.4g}")
        assert same.mean() >= MIN_IDENTICAL, f"{t} {name}: only {pct:.4f}% of blocks identical to C"
        assert r_ours <= r_ref * MAX_RMSE_RATIO + 1e-30 or np.isnan(r_ref), f"{t} {name}: RMSE {r_ours} vs {r_ref}"


@pytest.mark.parametrize("t", LEGACY_TYPES)
def test_c_legacy_quantizers_give_ggmls_bytes_on_non_finite_input(t):
    # C's casts of NaN and out-of-range floats to int8/uint8 are undefined; ggml's files hold what x86-64 gcc
    # computes, which kernels/kquant_c.c writes out. Blocks of NaN, +-inf, denormals, +-0, fp16 overflow, 3e38
    rng = np.random.default_rng(11)
    ladder = np.array([np.nan, np.inf, -np.inf, 1e-45, -1e-45, 6e-8, 65504, 70000, 1e38, -1e38, 0.0, -0.0, 1.0, -1.0,
                       0.5, 3e-39, 1e-30], np.float32)
    x = ladder[rng.integers(0, len(ladder), (16, 1024))]
    x[0] = np.nan
    x[1] = -0.0
    x[2] = rng.normal(size=1024) * 1e-40
    x[3] = rng.normal(size=1024) * 3e38
    x = x.astype(np.float32)
    with np.errstate(all="ignore"):
        ours = _ours(LAYOUTS[t], x, "c")
        ref = ggml_ctypes.ggml_quantize(x, t)
    np.testing.assert_array_equal(ours, ref)

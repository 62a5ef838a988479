"""The legacy quantizers (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) against llama.cpp's own C reference
(`ggml_quantize_chunk` from the llama-cpp-python wheel), on the same datasets as the K-quant tests:
LLM-shaped bf16 weights, all-zero rows and blocks, tiny and huge magnitudes, denormals, exact ties.
Both of our paths are checked: the eager torch codec and the fused torch.compile kernel that large
tensors take (tests/test_bench_quantize.py covers the fused one on 4M-value tensors as well)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qconvert.kernels.ggml_layouts import LAYOUTS, LEGACY_TYPES
from qconvert.kernels.ggml_legacy import decode_blocks, quantize_pack
from test_kquants import DATA, MAX_RMSE_RATIO, MIN_IDENTICAL

ggml_ctypes = pytest.importorskip("qconvert.kernels.ggml_ctypes")
if not ggml_ctypes.available():
    pytest.skip("llama-cpp-python's libggml-base.so is not installed: no C reference", allow_module_level=True)


def _rmse(q: np.ndarray, t: str, x: np.ndarray) -> float:
    y = decode_blocks(LAYOUTS[t], torch.from_numpy(q)).numpy().reshape(x.shape)
    return float(np.sqrt(np.mean((y.astype(np.float64) - x) ** 2)))


# every legacy type through the eager codec; Q4_0 and Q8_0 (the types with a fused kernel) through both
PATHS = [(t, False) for t in LEGACY_TYPES] + [("Q4_0", True), ("Q8_0", True)]


@pytest.mark.parametrize("t,fused", PATHS, ids=[f"{t}-{'fused' if f else 'eager'}" for t, f in PATHS])
def test_legacy_quantizer_matches_c_reference(t, fused):
    lay = LAYOUTS[t]
    for name, x in DATA.items():
        with np.errstate(all="ignore"):
            ours = quantize_pack(lay, torch.from_numpy(x), fused=fused).numpy()
            ref = ggml_ctypes.ggml_quantize(x, t)
        same = (ours.reshape(-1, lay.nbytes) == ref.reshape(-1, lay.nbytes)).all(axis=1)
        pct = 100.0 * same.mean()
        r_ours, r_ref = _rmse(ours, t, x), _rmse(ref, t, x)
        print(f"\n{t} {'fused' if fused else 'eager'} {name}: {same.size} blocks, {pct:.4f}% identical to C, "
              f"RMSE {r_ours:.4g} / {r_ref:.4g}")
        assert same.mean() >= MIN_IDENTICAL, f"{t} {name}: only {pct:.4f}% of blocks identical to C"
        assert r_ours <= r_ref * MAX_RMSE_RATIO + 1e-30 or np.isnan(r_ref), f"{t} {name}: RMSE {r_ours} vs {r_ref}"

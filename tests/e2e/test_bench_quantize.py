"""The quantizer benchmark runs and compares like with like; the fused Q4_0/Q8_0 kernels it measures
(torch.compile) give llama.cpp's bytes, also on the blocks where rounding details matter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import bench_quantize
from qconvert.kernels.ggml.layouts import LAYOUTS
from qconvert.kernels.ggml.legacy import quantize_pack

ggml_ctypes = pytest.importorskip("qconvert.kernels.ggml.libggml")
if not ggml_ctypes.available():
    pytest.skip("llama-cpp-python's libggml-base.so is not installed", allow_module_level=True)


def _awkward(rows: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(rows, n, generator=g) * 0.02
    x[0, :32] = 0.0  # all-zero block: +0 max, d = -0 for Q4_0
    x[1, :32] = -0.0  # negative zeros
    x[2, :32] = 1.0
    x[2, 5] = -1.0  # +a / -a tie: the first wins
    x[3, :32] = torch.arange(32) / 2.0 - 8  # exact halves after scaling
    x[4, :32] = torch.tensor([0.5 / 127 * k for k in range(32)])  # Q8_0 halves
    x[5, :64] = -x[5, :64].abs()
    x[6] *= 1e-30  # tiny scales
    return x.to(torch.bfloat16).to(torch.float32)


@pytest.mark.parametrize("t", ["Q4_0", "Q8_0"])
def test_fused_legacy_quantizer_equals_ggml(t):
    x = _awkward(1024, 4096)  # 4M values: the size where quantize_pack switches to the fused kernel
    fused = quantize_pack(LAYOUTS[t], x, fused=True).numpy()
    eager = quantize_pack(LAYOUTS[t], x, fused=False).numpy()
    want = ggml_ctypes.ggml_quantize(x.numpy(), t)
    np.testing.assert_array_equal(eager, want)
    np.testing.assert_array_equal(fused, want)


def test_benchmark_runs_and_matches_llama_cpp(capsys):
    assert bench_quantize.main(["--mb", "1", "--shapes", "256x1024", "--types", "Q4_0,Q8_0,Q4_K,Q6_K",
                                "--threads", "1,2"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line[:2] in ("Q4", "Q8", "Q6")]
    assert len(rows) == 8
    assert all(r[-1] == "True" for r in rows), out  # our bytes are llama.cpp's bytes
    for r in rows:  # identical bytes decode to identical RMSE
        assert r[-3] == r[-2], r

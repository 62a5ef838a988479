"""The 1- and 2-bit ggml types Q1_0, Q2_0, TQ1_0 and TQ2_0 (kernels/ggml/lowbit.py, the C quantizers of
kernels/ggml/kquant_c.c) against llama.cpp's own library: every block's bytes equal to ggml_quantize_chunk's on the
datasets the other quantizers are held to (LLM-shaped bf16 weights with a row of 11008, zero rows and blocks,
tiny, huge, denormal and tie-laden values) and on blocks of NaN, infinities, fp16 overflow and denormals, where
ggml's bytes are whatever its C computes on x86-64; every decode bit for bit equal to ggml's dequantize_row_* on
ggml's bytes and on arbitrary bytes (NaN and infinite scales too). PrismML's 128-value Q2_0 blocks decode as two of
upstream's 64-value blocks under one scale.

Oracle (run here, none stored): libggml-base.so of llama-cpp-python (kernels/ggml/libggml.py: ggml_quantize_chunk,
dequantize_row_q1_0 / _q2_0 / _tq1_0 / _tq2_0)."""

from __future__ import annotations

import numpy as np
import pytest

from kquant_data import DATA
from qconvert.kernels.ggml import kquant_c
from qconvert.kernels.ggml.layouts import LOWBIT_LAYOUTS, LOWBIT_TYPES, Q2_0_PRISM
from qconvert.kernels.ggml.lowbit import dequantize_lowbit, q2_0_layout_for_size, quantize_lowbit, unpack_lowbit

libggml = pytest.importorskip("qconvert.kernels.ggml.libggml")
if not libggml.available():
    pytest.skip("llama-cpp-python's libggml-base.so is not installed: no C reference", allow_module_level=True)


def _non_finite(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ladder = np.array([np.nan, np.inf, -np.inf, 1e-45, -1e-45, 6e-8, 65504, 70000, 1e38, -1e38, 0.0, -0.0, 1.0, -1.0,
                       0.5, 3e-39, 1e-30], np.float32)
    x = ladder[rng.integers(0, len(ladder), (16, 1024))]
    x[0] = np.nan
    x[1] = -0.0
    x[2] = rng.normal(size=1024) * 1e-40  # denormals only
    with np.errstate(over="ignore"):
        x[3] = rng.normal(size=1024) * 3e38  # sums and products that overflow (some to inf already)
    x[4, ::7] = np.nan  # a NaN here and there among normal values
    x[5] = rng.normal(size=1024)
    x[5, 100] = np.inf
    return x.astype(np.float32)


CASES = {**DATA, "non_finite": _non_finite(3)}


@pytest.mark.parametrize("t", LOWBIT_TYPES)
def test_quantizer_bytes_equal_ggml_quantize_chunk(t):
    assert kquant_c.available(), "the C quantizers did not build (a C compiler is part of the test machine)"
    for name, x in CASES.items():
        with np.errstate(all="ignore"):
            ours = quantize_lowbit(x, t)
            threaded = quantize_lowbit(x, t, threads=3)
            ref = libggml.ggml_quantize(x, t)
        assert ours.shape == ref.shape == (x.shape[0], LOWBIT_LAYOUTS[t].row_bytes(x.shape[1]))
        np.testing.assert_array_equal(ours, ref, err_msg=f"{t} {name}")
        np.testing.assert_array_equal(threaded, ref, err_msg=f"{t} {name} (threads)")


@pytest.mark.parametrize("t", LOWBIT_TYPES)
def test_decode_equals_ggml_dequantize_row_bit_for_bit(t):
    lay = LOWBIT_LAYOUTS[t]
    rng = np.random.default_rng(17)
    n = 1024
    blocks = [libggml.ggml_quantize(DATA["real_shaped"][:8, :n], t),
              rng.integers(0, 256, (16, lay.row_bytes(n)), dtype=np.uint8)]  # any byte: codes 3, NaN / inf scales
    with np.errstate(all="ignore"):
        blocks.append(libggml.ggml_quantize(_non_finite(5), t))
    for data in blocks:
        with np.errstate(all="ignore"):
            ours = dequantize_lowbit(lay, data)
        ref = libggml.ggml_dequantize(data, t, n)
        np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))


def test_ternary_quantizers_write_codes_0_to_2_and_q2_0_never_3():
    """ggml's quantizers round w / amax into {-1, 0, 1}: code 3 (+2d) is a decoder-only value for Q2_0 and TQ2_0 (and
    a TQ1_0 byte cannot hold it); Q1_0's codes are the signs 1 / 3 around 2."""
    x = DATA["real_shaped"][:, :4096]
    for t in LOWBIT_TYPES:
        codes, scales = unpack_lowbit(LOWBIT_LAYOUTS[t], quantize_lowbit(x, t))
        assert set(np.unique(codes)) == ({1, 3} if t == "Q1_0" else {0, 1, 2}), t
        assert scales.dtype == np.float16 and scales.shape == (x.shape[0], 4096 // LOWBIT_LAYOUTS[t].block)


def test_prismml_q2_0_blocks_decode_as_two_upstream_blocks_and_are_told_by_size():
    up = LOWBIT_LAYOUTS["Q2_0"]
    data = libggml.ggml_quantize(DATA["normal"][:4, :1024], "Q2_0").reshape(4, -1, 2, up.nbytes)
    # a 128-value block: the first 64-block's fp16 d, then both blocks' 16 code bytes
    prism = np.concatenate([data[:, :, 0, :2], data[:, :, 0, 2:], data[:, :, 1, 2:]], axis=-1).reshape(4, -1)
    assert prism.shape[1] == Q2_0_PRISM.row_bytes(1024)
    codes, scales = unpack_lowbit(up, data.reshape(4, -1))
    want = (codes.astype(np.float32) - 1).reshape(4, -1, 128) * scales[:, ::2].astype(np.float32)[..., None]
    np.testing.assert_array_equal(dequantize_lowbit(Q2_0_PRISM, prism), want.reshape(4, 1024))
    assert q2_0_layout_for_size(4 * 1024, up.row_bytes(1024) * 4) is up
    assert q2_0_layout_for_size(4 * 1024, Q2_0_PRISM.row_bytes(1024) * 4) is Q2_0_PRISM
    assert q2_0_layout_for_size(4 * 1024, 1000) is None

"""Kernels: bit packing, legacy ggml codecs and the word-level Q4_0 repack, against the formats'
own definitions (gguf-py's numpy codecs, which are byte-identical to ggml's C reference)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from qconvert.converters.records import Grid, GridParams, PackedCodes
from qconvert.kernels import dequantize_grid
from qconvert.kernels.bitpack import pack_rows, unpack_rows
from qconvert.kernels.ggml.layouts import LEGACY_TYPES, layout
from qconvert.kernels.ggml.legacy import decode_blocks, pack_blocks, quantize_blocks, repack_grid
from qconvert.kernels.ggml.gptq_q4_0 import gptq4_to_q4_0, q4_0_to_gptq4


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_unpack_round_trip(bits):
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (256, 96), generator=gen, dtype=torch.uint8)
    words = pack_rows(codes, bits)
    assert words.dtype == torch.int32 and words.shape == (256 * bits // 32, 96)
    assert torch.equal(unpack_rows(words, bits), codes)


def test_three_bit_layout_matches_gptq_words():
    """3-bit symmetric v1 zeros store 3 in every field: the words 0xdb6db6db, 0xb6db6db6, 0x6db6db6d."""
    words = pack_rows(torch.full((32, 1), 3, dtype=torch.uint8), 3).view(-1).tolist()
    assert [w & 0xFFFFFFFF for w in words] == [0xDB6DB6DB, 0xB6DB6DB6, 0x6DB6DB6D]


def test_four_bit_word_is_lsb_first():
    codes = torch.arange(8, dtype=torch.uint8).view(8, 1)
    assert pack_rows(codes, 4).item() & 0xFFFFFFFF == 0x76543210


def _data():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((32, 512), generator=gen) * 0.05
    x[1] = 0.0  # an all-zero row
    x[2] *= 1e-6  # tiny magnitudes
    x[3] *= 1e4  # huge magnitudes
    x[4, :32] = torch.tensor([0.5, -0.5] * 16)  # ties between +max and -max
    return x


@pytest.mark.parametrize("name", LEGACY_TYPES)
def test_legacy_quantizer_is_byte_identical_to_gguf_py(name):
    x = _data()
    lay = layout(name)
    ours = pack_blocks(lay, *quantize_blocks(lay, x)).numpy()
    ref = gguf.quants.quantize(x.numpy(), getattr(gguf.GGMLQuantizationType, name))
    assert np.array_equal(ours, ref)


@pytest.mark.parametrize("name", LEGACY_TYPES)
def test_legacy_decoder_equals_gguf_py(name):
    lay = layout(name)
    ref_bytes = gguf.quants.quantize(_data().numpy(), getattr(gguf.GGMLQuantizationType, name))
    ours = decode_blocks(lay, torch.from_numpy(ref_bytes)).numpy()
    assert np.array_equal(ours, gguf.quants.dequantize(ref_bytes, getattr(gguf.GGMLQuantizationType, name)))


def _grid(bits, group, sym, rows=64, cols=256, seed=1):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn((rows, cols), generator=gen) * 0.02
    return Grid.rtn(w, bits, group, sym)


@pytest.mark.parametrize("name,bits,sym", [("Q4_0", 4, True), ("Q8_0", 8, True), ("Q5_0", 4, True),
                                           ("Q4_0", 3, True), ("Q4_1", 4, False), ("Q5_1", 4, False)])
def test_repack_grid_decodes_to_the_grid(name, bits, sym):
    grid = _grid(bits, 64, sym)
    lay = layout(name)
    p = grid.params
    data = repack_grid(lay, grid.codes, p.scales, p.zeros, p.group_of_column(grid.shape[1])[::32])
    decoded = decode_blocks(lay, data)
    expected = grid.dequantize(torch.float32)
    if lay.has_min:  # only m = -s*z rounds to fp16
        assert float((decoded - expected).abs().max()) <= float((p.scales.float() * p.zeros.float()).abs().max()) * 2**-11
    else:
        assert torch.equal(decoded, expected)


def test_word_level_q4_0_repack_equals_code_level_and_inverts():
    grid = _grid(4, 128, True, rows=96, cols=512)
    p = grid.params
    words = pack_rows(grid.codes.T.contiguous(), 4)
    block_scales = p.scales[:, p.group_of_column(512)[::32]]
    fast = gptq4_to_q4_0(words, block_scales)
    slow = repack_grid(layout("Q4_0"), grid.codes, p.scales, p.zeros, p.group_of_column(512)[::32])
    assert torch.equal(fast, slow)
    back_words, back_scales = q4_0_to_gptq4(fast)
    assert torch.equal(back_words, words) and torch.equal(back_scales, block_scales)


def test_packed_grid_slices_and_permutes_like_unpacked():
    grid = _grid(4, 32, True, rows=16, cols=64)
    packed = Grid(grid.params, packed=PackedCodes(pack_rows(grid.codes.T.contiguous(), 4), 4, "gptq-rows"))
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(3))
    assert torch.equal(packed.permute_rows(perm).codes, grid.codes[perm])
    assert torch.equal(packed.row_slice(3, 9).dequantize(), grid.row_slice(3, 9).dequantize())
    assert packed.shape == grid.shape


def test_dequantize_with_act_order_index_gathers_groups():
    codes = torch.tensor([[0, 15, 8, 8]], dtype=torch.uint8)
    params = GridParams(bits=4, group_size=2, scales=torch.tensor([[1.0, 0.5]], dtype=torch.float16),
                        zeros=torch.tensor([[8, 8]], dtype=torch.int16), g_idx=torch.tensor([1, 0, 0, 1]))
    w = dequantize_grid(Grid(params, codes))
    assert w.tolist() == [[-4.0, 7.0, 0.0, 0.0]]

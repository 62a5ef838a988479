"""AWQ's packed layouts, as pure functions over tensors.

GEMM (AutoAWQ WQLinear_GEMM; gptqmodel 7.6 AwqGEMMLinear / AwqTorchLinear, which share its packing,
quantization/awq/utils/packing_utils.py pack_awq):

    qweight int32 [in, out/8]   eight 4-bit codes of one input row, packed along the OUTPUT columns
    qzeros  int32 [G,  out/8]   the zero points, packed the same way
    scales  fp16  [G,  out]
    W[k, n] = (q[k, n] - z[k // group, n]) * s[k // group, n]     ([in, out], forward does x @ W)

Within a word the nibbles are interleaved: nibble i (bits 4i..4i+3) holds column 8j + AWQ_ORDER[i] of word j
(pack_awq indexes the natural codes with AWQ_ORDER before packing LSB-first). gptqmodel unpacks with
`>> [0, 4, ..., 28] & 15` and then takes nibble AWQ_REVERSE_ORDER[c] for column c (reverse_awq_order):
the inverse permutation, which is what `unpack_gemm` does.

Other widths (gptqmodel 7.6 only: AwqTorchLinear SUPPORTS_BITS 2..8; packing_utils.pack_awq ->
_pack_contiguous, unpacked by _unpack_columnwise): no interleave; each row's codes in natural column order form
one little-endian bit stream, code c in bits c*b .. c*b+b-1 of the row (bit i of word j is stream bit 32j + i),
so a 3-bit code may straddle two words. A row of n codes takes ceil(n*b/32) words (qweight [in, ceil(out*b/32)],
qzeros [G, ceil(out*b/32)]); the loader takes n from scales' last dimension. `unpack_stream` / `pack_stream`.

GEMV (AutoAWQ 0.2.9 awq/modules/linear/gemv.py WQLinear_GEMV.from_linear; 4-bit only):

    qweight int32 [out, in/8]   eight codes of one OUTPUT row, packed along the inputs, nibble i = input 8j + i
    qzeros  int32 [out, W]      zero of group g in word g // 8, nibble g % 8 (order_map is the identity)
    scales  fp16  [out, 8W]     scale of group g in column g; columns G.. are zero padding
    W = calculate_zeros_width(in, group): ceil(G / 8) words, rounded up to a multiple of 4 (group 32) or
    2 (group 64); groups other than 32, 64 and >= 128 raise NotImplementedError there.

i.e. the 4-bit bit stream along the other axis: unpack_stream(words, 4, n). Its forward exists only as the CUDA
awq_ext kernel; the values are (q - z) * s of these codes, which AutoAWQ's quantizer computed in fp16 as the
pseudo-quantized weight it packed (scripts/producers/autoawq.py checks that equality).
"""

from __future__ import annotations

import torch

from ...kernels.triton import route as triton_route

__all__ = ["AWQ_ORDER", "AWQ_REVERSE_ORDER", "PACK_FACTOR", "unpack_gemm", "pack_gemm", "stream_words",
           "unpack_stream", "pack_stream", "unpack_codes", "words_per_row", "gemv_zeros_width"]

# gptqmodel 7.6 quantization/awq/utils/packing_utils.py: AWQ_ORDER / AWQ_REVERSE_ORDER (4-bit only)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
PACK_FACTOR = 8  # 4-bit codes per int32 word
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_gemm(words: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols/8] GEMM words -> uint8 [rows, cols] codes 0..15 in natural column order (Triton where
    chosen: natural code j of a word is its nibble AWQ_REVERSE_ORDER[j])."""
    rows, n_words = words.shape
    routed = triton_route.bitstream(words, 4, n_words * PACK_FACTOR, order=AWQ_REVERSE_ORDER)
    if routed is not None:
        return routed
    nibbles = (words.to(torch.int32)[:, :, None] >> _SHIFTS) & 15  # [rows, n_words, 8] in shift order
    natural = nibbles[:, :, list(AWQ_REVERSE_ORDER)]
    return natural.reshape(rows, n_words * PACK_FACTOR).to(torch.uint8)


def pack_gemm(codes: torch.Tensor) -> torch.Tensor:
    """uint8/int [rows, cols] codes -> int32 [rows, cols/8] GEMM words (the inverse of unpack_gemm; used by
    the tests to build bad inputs and to check the order both ways)."""
    rows, cols = codes.shape
    grouped = codes.to(torch.int64).reshape(rows, cols // PACK_FACTOR, PACK_FACTOR)[:, :, list(AWQ_ORDER)]
    words = (grouped << _SHIFTS.to(torch.int64)).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def stream_words(count: int, bits: int) -> int:
    """Words a row of `count` codes of `bits` bits takes in the bit stream (packing_utils._pack_contiguous)."""
    return -(-count * bits // 32)


def unpack_stream(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 [rows, ceil(count*bits/32)] bit-stream words -> uint8 [rows, count] codes (natural order; Triton
    where chosen)."""
    routed = triton_route.bitstream(words, bits, count)
    if routed is not None:
        return routed
    rows = words.shape[0]
    unsigned = words.to(torch.int64) & 0xFFFFFFFF
    unsigned = torch.cat([unsigned, torch.zeros(rows, 1, dtype=torch.int64)], dim=1)  # the last code's next word
    start = torch.arange(count, dtype=torch.int64) * bits
    word, shift = start // 32, start % 32
    # low part from the code's first word, high part from the next (shifted out entirely when it fits in one)
    value = (unsigned[:, word] >> shift) | (unsigned[:, word + 1] << (32 - shift))
    return (value & ((1 << bits) - 1)).to(torch.uint8)


def pack_stream(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8/int [rows, count] codes -> int32 bit-stream words (the inverse of unpack_stream; for the tests)."""
    rows, count = codes.shape
    bit_of = torch.arange(bits, dtype=torch.int64)
    stream = ((codes.to(torch.int64)[:, :, None] >> bit_of) & 1).reshape(rows, count * bits)
    n_words = stream_words(count, bits)
    stream = torch.cat([stream, torch.zeros(rows, n_words * 32 - count * bits, dtype=torch.int64)], dim=1)
    words = (stream.reshape(rows, n_words, 32) << torch.arange(32, dtype=torch.int64)).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def words_per_row(count: int, bits: int) -> int:
    """Words of one packed row: GEMM's eight interleaved nibbles at 4 bits, the bit stream otherwise."""
    return count // PACK_FACTOR if bits == 4 else stream_words(count, bits)


def unpack_codes(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Either packing -> uint8 [rows, count] codes in natural column order."""
    if bits == 4:
        return unpack_gemm(words)[:, :count]
    return unpack_stream(words, bits, count)


def gemv_zeros_width(in_features: int, group: int) -> int | None:
    """AutoAWQ 0.2.9 gemv.py calculate_zeros_width: qzeros words a GEMV row takes (None: a group it refuses)."""
    multiple = 1 if group >= 128 else {64: 2, 32: 4}.get(group)
    if multiple is None:
        return None
    words = -(-(in_features // group) // PACK_FACTOR)
    return -(-words // multiple) * multiple

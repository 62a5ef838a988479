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
"""

from __future__ import annotations

import torch

__all__ = ["AWQ_ORDER", "AWQ_REVERSE_ORDER", "PACK_FACTOR", "unpack_gemm", "pack_gemm"]

# gptqmodel 7.6 quantization/awq/utils/packing_utils.py: AWQ_ORDER / AWQ_REVERSE_ORDER (4-bit only)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
PACK_FACTOR = 8  # 4-bit codes per int32 word
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_gemm(words: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols/8] GEMM words -> uint8 [rows, cols] codes 0..15 in natural column order."""
    rows, n_words = words.shape
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

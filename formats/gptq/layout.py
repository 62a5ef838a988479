"""GPTQ's zero points as stored: `qzeros` int32 [G, out*b/32], packed along the outputs, in the v1 or v2 convention.

v1 decode: 2/4/8-bit words get the constant 0x55555555 / 0x11111111 / 0x01010101 added as whole
int32 words (wrapping), because gptqmodel's writer subtracted it as whole words and a zero point of 0
borrowed from its neighbour field; adding per field would decode the neighbour one too low. 3-bit zeros
are converted field by field (gptqmodel 7.6 does the same: utils/model.py, convert_gptq_v1_to_v2_format_module).
"""

from __future__ import annotations


import torch

from ...kernels.bitpack import pack_rows, unpack_rows


# whole-word constant that turns v2 zero fields into v1 fields (one per field, 2/4/8-bit packing)
V1_WORD_OFFSET = {2: 0x55555555, 4: 0x11111111, 8: 0x01010101}

def decode_zeros(qzeros: torch.Tensor, bits: int, convention: str) -> torch.Tensor:
    """[G, out*b/32] int32 -> [G, out] true zero points (int16)."""
    words = qzeros
    if convention == "v1" and bits in V1_WORD_OFFSET:
        w = (qzeros.to(torch.int64) & 0xFFFFFFFF) + V1_WORD_OFFSET[bits]
        words = (w & 0xFFFFFFFF).to(torch.int64)
        words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    z = unpack_rows(words.T.contiguous(), bits).T.to(torch.int16)
    if convention == "v1" and bits not in V1_WORD_OFFSET:  # 3-bit: field by field
        z = (z + 1) % (1 << bits)
    return z.contiguous()


def encode_zeros(zeros: torch.Tensor, bits: int, convention: str) -> torch.Tensor:
    """[G, out] true zero points -> [G, out*b/32] int32 in the given convention."""
    z = zeros.to(torch.int64)
    if convention == "v1" and bits not in V1_WORD_OFFSET:
        z = (z - 1) % (1 << bits)
    words = pack_rows(z.T.contiguous(), bits).T.contiguous()
    if convention == "v1" and bits in V1_WORD_OFFSET:
        w = ((words.to(torch.int64) & 0xFFFFFFFF) - V1_WORD_OFFSET[bits]) & 0xFFFFFFFF
        words = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)
    return words

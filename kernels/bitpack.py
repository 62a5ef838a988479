"""GPTQ-style bit packing: integer codes <-> int32 words, vectorized torch on any device.

Every GPTQ bit width (2, 3, 4, 8) uses the same rule: consecutive codes form one little-endian bit
stream, code i at bits [b*i, b*i + b), cut into 32-bit words. For 2/4/8 bits a code never straddles
two words; for 3 bits every 32 codes fill exactly 3 words and codes 10 and 21 straddle (the
"10-1-10-1-10" layout gptqmodel describes is this same stream). One loop over the codes of a chunk therefore
serves all widths, with the straddling part handled where it occurs.

`qweight` packs along rows (input features), `qzeros` along columns (output features):
`unpack_rows` / `pack_rows` work on dim 0; use `.T` views for the other.
"""

from __future__ import annotations

from math import gcd

import torch

__all__ = ["unpack_rows", "pack_rows", "chunk_geometry", "SUPPORTED_PACK_BITS"]

SUPPORTED_PACK_BITS = (2, 3, 4, 8)
_WORD = 32


def chunk_geometry(bits: int) -> tuple[int, int]:
    """(codes, words) of the smallest run of codes that fills whole words: (8, 1) for 4 bits, (32, 3) for 3."""
    if bits not in SUPPORTED_PACK_BITS:
        raise ValueError(f"unsupported bit width {bits}; GPTQ packs {SUPPORTED_PACK_BITS}")
    lcm = bits * _WORD // gcd(bits, _WORD)
    return lcm // bits, lcm // _WORD


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] int32 words -> [R * 32 / bits, C] uint8 codes (codes run along dim 0)."""
    n_codes, n_words = chunk_geometry(bits)
    rows, cols = packed.shape
    if rows % n_words:
        raise ValueError(f"{rows} packed rows is not a multiple of {n_words} for {bits}-bit codes")
    # int64 so that shifts of the sign bit stay logical
    words = (packed.to(torch.int64) & 0xFFFFFFFF).view(rows // n_words, n_words, cols)
    mask = (1 << bits) - 1
    out = torch.empty((rows // n_words, n_codes, cols), dtype=torch.uint8, device=packed.device)
    for j in range(n_codes):
        pos = j * bits
        w, s = divmod(pos, _WORD)
        val = words[:, w] >> s
        if s + bits > _WORD:  # straddles into the next word (3-bit codes 10 and 21)
            val = val | (words[:, w + 1] << (_WORD - s))
        out[:, j] = (val & mask).to(torch.uint8)
    return out.view(rows // n_words * n_codes, cols)


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] integer codes (0 .. 2**bits-1) -> [R * bits / 32, C] int32 words. Inverse of unpack_rows."""
    n_codes, n_words = chunk_geometry(bits)
    rows, cols = codes.shape
    if rows % n_codes:
        raise ValueError(f"{rows} rows of {bits}-bit codes do not fill whole 32-bit words")
    c = codes.to(torch.int64).view(rows // n_codes, n_codes, cols)
    words = torch.zeros((rows // n_codes, n_words, cols), dtype=torch.int64, device=codes.device)
    for j in range(n_codes):
        pos = j * bits
        w, s = divmod(pos, _WORD)
        words[:, w] |= (c[:, j] << s) & 0xFFFFFFFF
        if s + bits > _WORD:
            words[:, w + 1] |= c[:, j] >> (_WORD - s)
    # reinterpret the low 32 bits as signed int32, as checkpoints store them
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32).view(rows // n_codes * n_words, cols)

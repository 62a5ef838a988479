"""HQQ (half-quadratic quantization) as pure tensor functions: bit packing, grid views and the quantizer.

HQQ views a weight W[out, in] in row-major order as a group matrix:
  axis 1: W.reshape(-1, gs)  -> [numel/gs, gs], one group per row (runs of `gs` input features)
  axis 0: W.reshape(gs, -1)  -> [gs, numel/gs], one group per column (every (out/gs)-th output row of one
          input column)
and stores codes packed along dim 0 of that matrix in slabs: with k codes per storage word, slab j (rows
j*P/k .. (j+1)*P/k) goes to bit field j counted from the most significant side. 3-bit packs ten codes into
bits 29..0 of an int32 after zero-padding the rows to a multiple of ten. Dequantization is
(q - zero) * scale, with the scale stored already inverted; see shared spec hqq.md sections 1-2.

`quantize_hqq` is HQQ's own rule (min/max grid, optional rounded zero, then the proximal solver that moves
the zero only), run in float32 as hqq runs it on a CPU, so that requantizing into HQQ gives what hqq gives.
"""

from __future__ import annotations

import torch

__all__ = ["PACKINGS", "Packing", "packing_for_bits", "pack_hqq", "unpack_hqq", "grouped_shape",
           "codes_to_grouped", "grouped_to_codes", "quantize_hqq"]


class Packing:
    """One HQQ packing: name, storage dtype, codes per word, bits per code."""

    def __init__(self, name: str, storage: torch.dtype, per_word: int, field_bits: int):
        self.name, self.storage, self.per_word, self.field_bits = name, storage, per_word, field_bits

    def packed_rows(self, rows: int) -> int:
        if self.name == "3bit_32":
            return -(-rows // 10)
        return rows // self.per_word

    def fits(self, rows: int) -> bool:
        """u8 packings need the row count to divide evenly (hqq fails otherwise); 3-bit pads."""
        return self.name == "3bit_32" or rows % self.per_word == 0


# THE table of HQQ packings (hqq/core/bitpack.py); nbits 5 and 6 are stored unpacked as 8bit_u8
PACKINGS = {
    "8bit_u8": Packing("8bit_u8", torch.uint8, 1, 8),
    "4bit_u8": Packing("4bit_u8", torch.uint8, 2, 4),
    "3bit_32": Packing("3bit_32", torch.int32, 10, 3),
    "2bit_u8": Packing("2bit_u8", torch.uint8, 4, 2),
    "1bit_u8": Packing("1bit_u8", torch.uint8, 8, 1),
}
_BITS_TO_PACKING = {8: "8bit_u8", 6: "8bit_u8", 5: "8bit_u8", 4: "4bit_u8", 3: "3bit_32", 2: "2bit_u8", 1: "1bit_u8"}


def packing_for_bits(bits: int) -> Packing:
    return PACKINGS[_BITS_TO_PACKING[bits]]


def grouped_shape(shape: tuple[int, int], group_size: int, axis: int) -> tuple[int, int]:
    numel = shape[0] * shape[1]
    return (numel // group_size, group_size) if axis == 1 else (group_size, numel // group_size)


def codes_to_grouped(codes: torch.Tensor, group_size: int, axis: int) -> torch.Tensor:
    """[out, in] codes -> HQQ's group matrix (a view of the same row-major data)."""
    return codes.reshape(grouped_shape(tuple(codes.shape), group_size, axis))


def grouped_to_codes(grouped: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    return grouped.reshape(shape)


def pack_hqq(grouped: torch.Tensor, packing: Packing) -> torch.Tensor:
    """Unpacked codes [P, C] (any integer dtype) -> packed words [P/k, C] in the packing's storage dtype."""
    rows = grouped.shape[0]
    if not packing.fits(rows):
        raise ValueError(f"{packing.name} needs a multiple of {packing.per_word} rows, got {rows}")
    if packing.name == "3bit_32":
        padded = torch.zeros((packing.packed_rows(rows) * 10, grouped.shape[1]), dtype=torch.int32)
        padded[:rows] = grouped.to(torch.int32)
        q, dtype = padded, torch.int32
    else:
        q, dtype = grouped.to(torch.uint8), torch.uint8
    step = q.shape[0] // packing.per_word
    words = torch.zeros((step, q.shape[1]), dtype=dtype)
    for j in range(packing.per_word):
        shift = packing.field_bits * (packing.per_word - 1 - j)
        words |= q[j * step:(j + 1) * step] << shift
    return words


def unpack_hqq(words: torch.Tensor, packing: Packing, rows: int) -> torch.Tensor:
    """Packed words [P/k, C] -> uint8 codes [rows, C] (3-bit: the padding rows are cut off)."""
    step = words.shape[0]
    mask = (1 << packing.field_bits) - 1
    w = words.to(torch.int32 if packing.name == "3bit_32" else torch.uint8)
    slabs = [(w >> (packing.field_bits * (packing.per_word - 1 - j))) & mask for j in range(packing.per_word)]
    out = torch.cat(slabs, dim=0).to(torch.uint8)
    if out.shape[0] < rows or (packing.name != "3bit_32" and out.shape[0] != rows) or step != packing.packed_rows(rows):
        raise ValueError(f"{tuple(words.shape)} {packing.name} words do not hold {rows} rows")
    return out[:rows]


def _shrink_lp(x: torch.Tensor, beta: float, lp_norm: float) -> torch.Tensor:
    out = torch.abs(x)
    out.sub_((1.0 / beta) * out.pow(lp_norm - 1)).clamp_min_(0.0)
    out.mul_(torch.sign(x))
    return out


@torch.inference_mode()
def quantize_hqq(w: torch.Tensor, bits: int, group_size: int, axis: int = 1, optimize: bool = True,
                 round_zero: bool | None = None, iters: int = 20, lp_norm: float = 0.7,
                 beta: float = 10.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [out, in] -> (codes [out, in] uint8, scale, zero) in HQQ's keepdim shapes ([numel/gs, 1] on axis 1,
    [1, numel/gs] on axis 0), float32, scale already inverted: W ~ (q - zero) * scale.

    The rule of hqq 0.2.8 `Quantizer.quantize` with its default proximal solver on a CPU (float32):
    s_inv = (2^b - 1) / (max - min) (1 where the range is below 1e-4, at most 2e4), z = -min * s_inv
    (rounded when round_zero, hqq's default for 4-bit), then up to `iters` steps that move z only and stop
    when the mean error no longer falls.
    """
    if round_zero is None:
        round_zero = bits == 4
    shape = tuple(w.shape)
    wf = w.to(torch.float32).reshape(grouped_shape(shape, group_size, axis))
    wmin = wf.min(dim=axis, keepdim=True)[0]
    wmax = wf.max(dim=axis, keepdim=True)[0]
    max_code = float(round(2 ** bits - 1))
    denom = wmax - wmin
    s_inv = max_code / denom
    s_inv = torch.where(denom.abs() <= 1e-4, torch.full_like(s_inv, 1.0), s_inv).clamp(max=2e4)
    zero = -wmin * s_inv
    if round_zero:
        zero = torch.round(zero)
    if optimize:
        best = torch.tensor(float("inf"))
        for _ in range(iters):
            q = torch.round(wf * s_inv + zero).clamp_(0, max_code)
            wr = (q - zero) / s_inv
            we = _shrink_lp(wf - wr, beta, lp_norm)
            zero = torch.mean(q - (wf - we) * s_inv, dim=axis, keepdim=True)
            err = torch.abs(wf - wr).mean().float()
            if err < best:
                best = err
            else:
                break
    q = torch.round(wf * s_inv + zero).clamp_(0, max_code)
    return q.to(torch.uint8).reshape(shape), 1.0 / s_inv, zero

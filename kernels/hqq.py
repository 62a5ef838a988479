"""HQQ (half-quadratic quantization) as pure tensor functions: bit packing, grid views and the quantizer.

HQQ views a weight W[out, in] in row-major order as a group matrix:
  axis 1: W.reshape(-1, gs)  -> [numel/gs, gs], one group per row (runs of `gs` input features)
  axis 0: W.reshape(gs, -1)  -> [gs, numel/gs], one group per column (every (out/gs)-th output row of one
          input column)
and stores codes packed along dim 0 of that matrix in slabs: with k codes per storage word, slab j (rows
j*P/k .. (j+1)*P/k) goes to bit field j counted from the most significant side. 3-bit packs ten codes into
bits 29..0 of an int32 after zero-padding the rows to a multiple of ten. Dequantization is
(q - zero) * scale, with the scale stored already inverted (hqq 0.2.8's hqq/core/quantize.py: `quantize`
stores 1 / scale, `dequantize` computes `(W_q - zero) * scale`; the packing is hqq/core/bitpack.py's).

`quantize_hqq` is HQQ's own rule (min/max grid, optional rounded zero, then the proximal solver that moves
the zero only), run in float32 as hqq runs it on a CPU, so that requantizing into HQQ gives what hqq gives.
"""

from __future__ import annotations

import math

import torch

from .triton import route as triton_route

__all__ = ["PACKINGS", "Packing", "packing_for_bits", "pack_hqq", "unpack_hqq", "grouped_shape",
           "codes_to_grouped", "grouped_to_codes", "quantize_hqq", "axis0_period", "axis0_expand",
           "axis0_compact"]


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
    step = words.shape[0] if words.dim() == 2 else -1
    unpacked = step * packing.per_word
    if (step < 0 or unpacked < rows or (packing.name != "3bit_32" and unpacked != rows)
            or step != packing.packed_rows(rows)):
        raise ValueError(f"{tuple(words.shape)} {packing.name} words do not hold {rows} rows")
    w = words.to(torch.int32 if packing.name == "3bit_32" else torch.uint8)
    routed = triton_route.hqq_unpack(w, packing.field_bits, packing.per_word, rows)  # Triton where chosen
    if routed is not None:
        return routed
    mask = (1 << packing.field_bits) - 1
    slabs = [(w >> (packing.field_bits * (packing.per_word - 1 - j))) & mask for j in range(packing.per_word)]
    return torch.cat(slabs, dim=0).to(torch.uint8)[:rows]


# -- axis 0: hqq's [1, M] meta as the [p, in] matrix of converters/records.py ---------------------------
# Flat element f = n*in + k of W[out, in] sits in column f % M of W.reshape(gs, M), M = numel / gs: that
# column is its group. hqq (and mistral.rs, which copies its reshape) only need gs to divide numel, so gs
# need not divide `out`: mistral.rs 0.9.5 writes k/v projections of 32 rows with gs 64 (M = in / 2).
# Rows n and n + p fall in the same groups when p*in is a multiple of M, first for p = M / gcd(in, M);
# so the group of (n, k) is column ((n % p)*in + k) % M, and the meta expanded to
# E[h, k] = meta[(h*in + k) % M], h < p, is records.py's axis-0 form with R = p rows and
# group_size = out / p. When gs divides out this is the plain reshape (p = out / gs, E = meta.reshape(p, in)).
# E holds lcm(M, in) <= numel values: never more than the weight itself.


def axis0_period(shape: tuple[int, int], group_size: int) -> int:
    """p: the number of distinct group rows of an axis-0 grid (numel % group_size must be 0)."""
    out_features, in_features = shape
    m = out_features * in_features // group_size
    return m // math.gcd(in_features, m)


def axis0_expand(meta: torch.Tensor, shape: tuple[int, int], group_size: int) -> torch.Tensor:
    """hqq's axis-0 scale or zero ([1, M] or [M]) -> the [p, in] matrix E[h, k] = meta[(h*in + k) % M]."""
    out_features, in_features = shape
    flat = meta.reshape(-1)
    m = flat.numel()
    p = axis0_period(shape, group_size)
    if p * in_features == m:
        return flat.reshape(p, in_features)
    index = torch.arange(p * in_features, dtype=torch.int64) % m
    return flat[index].reshape(p, in_features)


def _bits_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (so that equality is exact, NaN and -0.0 included)."""
    if t.is_floating_point():
        return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def _divisors(n: int) -> list[int]:
    small, large, d = [], [], 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def axis0_compact(scales: torch.Tensor, zeros: torch.Tensor, shape: tuple[int, int], bits: int,
                  prefer: tuple[int, ...] = ()) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """The inverse of axis0_expand: (group_size, scale [1, M], zero [1, M]) of an hqq axis-0 layout that
    gives these [p, in] scales and zeros exactly and whose group rows `bits`' packing holds; None when
    none does. The group sizes in `prefer` (the source's own) are tried first, then the smallest
    period M of the flattened meta (the largest group), up to M = p*in (group_size = out / p, always
    a layout of this grid)."""
    out_features, in_features = shape
    numel = out_features * in_features
    p = scales.shape[0]
    if tuple(scales.shape) != (p, in_features) or tuple(zeros.shape) != (p, in_features) or out_features % p:
        return None
    s_bits, z_bits = _bits_of(scales).reshape(-1), _bits_of(zeros).reshape(-1)
    total = p * in_features
    packing = packing_for_bits(bits)

    def fits(m: int) -> bool:
        if m <= 0 or total % m or numel % m or m // math.gcd(in_features, m) != p:
            return False
        if not packing.fits(numel // m):
            return False
        head_s, head_z = s_bits[:m], z_bits[:m]
        return bool(torch.equal(s_bits.view(-1, m), head_s.expand(total // m, m))
                    and torch.equal(z_bits.view(-1, m), head_z.expand(total // m, m)))

    candidates = [numel // g for g in prefer if g and g > 0 and numel % g == 0] + _divisors(total)
    for m in dict.fromkeys(candidates):
        if fits(m):
            gs = numel // m
            return gs, scales.reshape(-1)[:m].reshape(1, m).contiguous(), zeros.reshape(-1)[:m].reshape(1, m).contiguous()
    return None


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

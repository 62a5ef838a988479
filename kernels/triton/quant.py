"""Triton twins of ggml's legacy block quantizers (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and of the lossless repacks
into those blocks, byte for byte with the CPU path (kernels/ggml/legacy.py, which is ggml's
quantize_row_q*_ref).

Every float32 operation of the C reference is one Triton operation here, in the same order: divisions are
`tl.div_rn` (Triton's plain `/` is an approximate division on NVIDIA GPUs), launches pass
enable_fp_fusion=False (no x*id + 8.5 contracted into an FMA), fp16 conversions round to nearest even (a
float32 -> fp16 cast does on the GPU and under the interpreter). The C conversions from float to a small
integer are written out as x86 computes them (`c_int`: truncation, and INT_MIN for NaN or anything out of
the int32 range, whose low byte is then taken), so a denormal block whose 1/d overflows gives C's bytes too.

- `quantize_legacy_triton(name, x)`: float32 [rows, n] -> block bytes [rows, n/32*nbytes]
  (ggml quantize_row_q4_0_ref .. quantize_row_q8_0_ref; ggml_legacy.quantize_pack).
- `pack_legacy_triton(name, codes, shift, d, m)`: codes already on the type's grid plus fp16 block params ->
  bytes (ggml_legacy.pack_blocks after repack_grid's q - z + offset).
- `gptq4_to_q4_0_triton(qweight, block_scales)`: GPTQ 4-bit words straight into Q4_0 blocks
  (kernels/gptq_q4_0.gptq4_to_q4_0: each byte is two nibbles of two words).
Without a GPU they run under TRITON_INTERPRET=1, which is how tests/kernels/test_triton_kernels.py compares them (through tests/support/triton_probes.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dequant import interpreting, launch

__all__ = ["quantize_legacy_triton", "pack_legacy_triton", "gptq4_to_q4_0_triton", "LEGACY_KINDS"]

# name -> (kernel kind, bytes per block)
LEGACY_KINDS = {"Q4_0": (0, 18), "Q4_1": (1, 20), "Q5_0": (2, 22), "Q5_1": (3, 24), "Q8_0": (4, 34)}


@triton.jit
def c_int(v):
    """C's (int)v on x86 (cvttss2si): truncation toward zero; NaN and values outside the int32 range give
    INT_MIN ("integer indefinite")."""
    ok = (v >= -2147483648.0) & (v < 2147483648.0)
    return tl.where(ok, tl.where(ok, v, 0.0).to(tl.int32), -2147483647 - 1)


@triton.jit
def c_int8(i):
    """(int8_t) of an int: its low byte, sign-extended."""
    return ((i & 0xFF) ^ 0x80) - 0x80


@triton.jit
def fp16_bits(v):
    """GGML_FP32_TO_FP16 (round to nearest even) as the 16 bits in an int32."""
    return v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def c_roundf(v):
    """C's roundf: half away from zero (exact: the fraction v - trunc(v) is exact below 2**23, and from 2**23
    on every float32 is an integer)."""
    small = tl.abs(v) < 8388608.0
    t = tl.where(small, tl.where(small, v, 0.0).to(tl.int32).to(tl.float32), v)
    f = v - t
    return t + tl.where(f >= 0.5, 1.0, tl.where(f <= -0.5, -1.0, 0.0))


@triton.jit
def _store_u8(ptr, v, mask):
    tl.store(ptr, (v & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def _store_f16(ptr, bits, mask):
    _store_u8(ptr, bits, mask)
    _store_u8(ptr + 1, bits >> 8, mask)


@triton.jit
def _first_absmax(xl, xh, j):
    """C's `if (amax < fabsf(v)) { amax = fabsf(v); max = v; }` from amax = max = 0 over the 32 values of a
    block held as two halves [B, 16]: the signed value of the first largest |x| (NaN never wins), +0 for a
    block of zeros."""
    al = tl.abs(xl)
    ah = tl.abs(xh)
    al = tl.where(al == al, al, 0.0)
    ah = tl.where(ah == ah, ah, 0.0)
    amax = tl.maximum(tl.max(al, axis=1), tl.max(ah, axis=1))
    il = tl.min(tl.where(al == amax[:, None], j[None, :], 99), axis=1)
    ih = tl.min(tl.where(ah == amax[:, None], j[None, :], 99), axis=1)
    vl = tl.max(tl.where(j[None, :] == il[:, None], xl, float("-inf")), axis=1)
    vh = tl.max(tl.where(j[None, :] == ih[:, None], xh, float("-inf")), axis=1)
    return tl.where(amax > 0, tl.where(il < 99, vl, vh), 0.0)


@triton.jit
def _first_equal(xl, xh, v, j):
    """The first of the 32 values (two halves [B, 16]) that compares equal to v: C's strict running min / max
    keeps the first of equal values, which decides the sign of a zero extreme (-0.0 == +0.0)."""
    il = tl.min(tl.where(xl == v[:, None], j[None, :], 99), axis=1)
    ih = tl.min(tl.where(xh == v[:, None], j[None, :], 99), axis=1)
    vl = tl.max(tl.where(j[None, :] == il[:, None], xl, float("-inf")), axis=1)
    vh = tl.max(tl.where(j[None, :] == ih[:, None], xh, float("-inf")), axis=1)
    return tl.where(il < 99, vl, vh)


@triton.jit
def _minmax(xl, xh, j):
    """C's `if (v < min) min = v; if (v > max) max = v;` from +-FLT_MAX (finite inputs)."""
    lo = tl.minimum(tl.min(xl, axis=1), tl.min(xh, axis=1))
    hi = tl.maximum(tl.max(xl, axis=1), tl.max(xh, axis=1))
    return _first_equal(xl, xh, lo, j), _first_equal(xl, xh, hi, j)


@triton.jit
def _store_nibbles_and_high(base, ql, qh_, j, live, m2, QS: tl.constexpr, QH: tl.constexpr, FIVE: tl.constexpr):
    """qs[j] = (ql & 0xF) | (qh & 0xF) << 4; for 5-bit types also the u32 of bit 4 of every code (element j:
    bit j, element 16 + j: bit 16 + j), little-endian at QH."""
    _store_u8(base[:, None] + QS + j[None, :], (ql & 0xF) | ((qh_ & 0xF) << 4), m2)
    if FIVE:
        lo_bits = tl.sum(((ql & 0x10) >> 4) << j[None, :], axis=1)  # distinct bits: the sum is the OR
        hi_bits = tl.sum(((qh_ & 0x10) >> 4) << j[None, :], axis=1)
        _store_u8(base + QH, lo_bits, live)
        _store_u8(base + QH + 1, lo_bits >> 8, live)
        _store_u8(base + QH + 2, hi_bits, live)
        _store_u8(base + QH + 3, hi_bits >> 8, live)


@triton.jit
def _quant_legacy_kernel(x_ptr, out_ptr, n_blocks, KIND: tl.constexpr, NBYTES: tl.constexpr, BB: tl.constexpr):
    # KIND: 0 Q4_0, 1 Q4_1, 2 Q5_0, 3 Q5_1, 4 Q8_0; one block of 32 values per lane row, as two halves of 16
    blk = tl.program_id(0) * BB + tl.arange(0, BB)
    live = blk < n_blocks
    j = tl.arange(0, 16)
    m2 = live[:, None] & (j[None, :] < 16)
    src = x_ptr + blk.to(tl.int64)[:, None] * 32 + j[None, :]
    xl = tl.load(src, mask=m2, other=0.0)
    xh = tl.load(src + 16, mask=m2, other=0.0)
    base = out_ptr + blk.to(tl.int64) * NBYTES
    if KIND == 4:
        # quantize_row_q8_0_ref: amax = MAX(amax, |x|); d = amax/127; qs = roundf(x*id)
        al = tl.abs(xl)
        ah = tl.abs(xh)
        amax = tl.maximum(tl.max(tl.where(al == al, al, 0.0), axis=1), tl.max(tl.where(ah == ah, ah, 0.0), axis=1))
        d = tl.div_rn(amax, 127.0)
        inv = tl.where(d != 0, tl.div_rn(1.0, tl.where(d != 0, d, 1.0)), 0.0)
        _store_f16(base, fp16_bits(d), live)
        _store_u8(base[:, None] + 2 + j[None, :], c_int(c_roundf(xl * inv[:, None])), m2)
        _store_u8(base[:, None] + 18 + j[None, :], c_int(c_roundf(xh * inv[:, None])), m2)
    elif KIND == 0 or KIND == 2:
        # quantize_row_q4_0_ref / q5_0_ref: d = max / -8 (-16), id = d ? 1/d : 0,
        # MIN(15 (31), (int8_t)(x*id + 8.5 (16.5)))
        FIVE: tl.constexpr = KIND == 2
        mx = _first_absmax(xl, xh, j)
        d = tl.div_rn(mx, -16.0 if FIVE else -8.0)
        inv = tl.where(d != 0, tl.div_rn(1.0, tl.where(d != 0, d, 1.0)), 0.0)
        bias: tl.constexpr = 16.5 if FIVE else 8.5
        top: tl.constexpr = 31 if FIVE else 15
        ql = tl.minimum(c_int8(c_int(xl * inv[:, None] + bias)), top) & 0xFF  # stored into a uint8
        qh_ = tl.minimum(c_int8(c_int(xh * inv[:, None] + bias)), top) & 0xFF
        _store_f16(base, fp16_bits(d), live)
        if FIVE:
            _store_nibbles_and_high(base, ql, qh_, j, live, m2, 6, 2, True)
        else:
            _store_u8(base[:, None] + 2 + j[None, :], ql | (qh_ << 4), m2)  # C: qs = xi0; qs |= xi1 << 4
    else:
        # quantize_row_q4_1_ref / q5_1_ref: d = (max - min)/15 (31); (x - min)*id + 0.5, truncated
        FIVE: tl.constexpr = KIND == 3
        lo, hi = _minmax(xl, xh, j)
        d = tl.div_rn(hi - lo, 31.0 if FIVE else 15.0)
        inv = tl.where(d != 0, tl.div_rn(1.0, tl.where(d != 0, d, 1.0)), 0.0)
        tl_ = (xl - lo[:, None]) * inv[:, None] + 0.5
        th_ = (xh - lo[:, None]) * inv[:, None] + 0.5
        _store_f16(base, fp16_bits(d), live)
        _store_f16(base + 2, fp16_bits(lo), live)
        if FIVE:  # (uint8_t)(x0 + 0.5f): no clamp
            _store_nibbles_and_high(base, c_int(tl_) & 0xFF, c_int(th_) & 0xFF, j, live, m2, 8, 4, True)
        else:
            ql = tl.minimum(c_int8(c_int(tl_)), 15) & 0xFF
            qh_ = tl.minimum(c_int8(c_int(th_)), 15) & 0xFF
            _store_u8(base[:, None] + 4 + j[None, :], ql | (qh_ << 4), m2)


@triton.jit
def _pack_legacy_kernel(codes_ptr, shift_ptr, d_ptr, m_ptr, out_ptr, n_blocks, KIND: tl.constexpr,
                        NBYTES: tl.constexpr, BB: tl.constexpr):
    # codes uint8 [n_blocks*32] + an int32 shift per block (q' = q + shift: repack_grid's -z + offset) and the
    # fp16 bits of d (and m) per block -> the block bytes, pack_blocks' layout
    blk = tl.program_id(0) * BB + tl.arange(0, BB)
    live = blk < n_blocks
    j = tl.arange(0, 16)
    m2 = live[:, None] & (j[None, :] < 16)
    src = codes_ptr + blk.to(tl.int64)[:, None] * 32 + j[None, :]
    sh = tl.load(shift_ptr + blk, mask=live, other=0)
    ql = tl.load(src, mask=m2, other=0).to(tl.int32) + sh[:, None]
    qh_ = tl.load(src + 16, mask=m2, other=0).to(tl.int32) + sh[:, None]
    base = out_ptr + blk.to(tl.int64) * NBYTES
    _store_f16(base, tl.load(d_ptr + blk, mask=live, other=0), live)
    if KIND == 4:
        _store_u8(base[:, None] + 2 + j[None, :], ql, m2)
        _store_u8(base[:, None] + 18 + j[None, :], qh_, m2)
    else:
        HAS_MIN: tl.constexpr = KIND == 1 or KIND == 3
        FIVE: tl.constexpr = KIND == 2 or KIND == 3
        if HAS_MIN:
            _store_f16(base + 2, tl.load(m_ptr + blk, mask=live, other=0), live)
        if FIVE:
            _store_nibbles_and_high(base, ql, qh_, j, live, m2, 6 + 2 * HAS_MIN, 2 + 2 * HAS_MIN, True)
        else:
            _store_u8(base[:, None] + 2 + 2 * HAS_MIN + j[None, :], (ql & 0xF) | ((qh_ & 0xF) << 4), m2)


@triton.jit
def _gptq_q4_0_kernel(words_ptr, d_ptr, out_ptr, n_out, nb, BB: tl.constexpr):
    # words int32 [nb*4, n_out]: block b of output n is words 4b..4b+3 of column n, nibble k = channel 8w + k.
    # Q4_0 byte i (i < 16) = e_i | e_(i+16) << 4 with e_c nibble c % 8 of word 4b + c // 8.
    t = tl.program_id(0) * BB + tl.arange(0, BB)  # (output, block) pairs, output-major as the bytes lie
    live = t < n_out * nb
    n = t // nb
    b = t % nb
    i = tl.arange(0, 16)
    m2 = live[:, None] & (i[None, :] < 16)
    w_lo = tl.load(words_ptr + (4 * b[:, None] + i[None, :] // 8) * n_out + n[:, None], mask=m2, other=0)
    w_hi = tl.load(words_ptr + (4 * b[:, None] + 2 + i[None, :] // 8) * n_out + n[:, None], mask=m2, other=0)
    sh = 4 * (i[None, :] % 8)
    e0 = (w_lo >> sh) & 0xF
    e1 = (w_hi >> sh) & 0xF
    base = out_ptr + t.to(tl.int64) * 18
    _store_f16(base, tl.load(d_ptr + t, mask=live, other=0), live)
    _store_u8(base[:, None] + 2 + i[None, :], e0 | (e1 << 4), m2)


def _blocks_per_program(n_blocks: int) -> int:
    return min(8192, triton.next_power_of_2(max(1, n_blocks))) if interpreting() else 64


def quantize_legacy_triton(type_name: str, x: torch.Tensor) -> torch.Tensor:
    """float32 [rows, n] (n % 32 == 0) -> uint8 [rows, n/32*nbytes], ggml's quantize_row_*_ref byte for byte."""
    kind, nbytes = LEGACY_KINDS[type_name]
    rows, n = x.shape
    nb = rows * n // 32
    out = torch.empty((rows, n // 32 * nbytes), dtype=torch.uint8, device=x.device)
    bb = _blocks_per_program(nb)
    launch(_quant_legacy_kernel, (triton.cdiv(nb, bb),), x.to(torch.float32).contiguous(), out, nb,
           KIND=kind, NBYTES=nbytes, BB=bb)
    return out


def _f16_bits(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float16).contiguous().view(torch.int16).to(torch.int32) & 0xFFFF


def pack_legacy_triton(type_name: str, codes: torch.Tensor, shift: torch.Tensor | None, d: torch.Tensor,
                       m: torch.Tensor | None = None) -> torch.Tensor:
    """codes [rows, n] (uint8, or int8 for Q8_0) + shift int [rows, n/32] (added to every code of its block, None
    = 0) + block d (and m) [rows, n/32] (rounded to fp16 here, as pack_blocks does) -> uint8 block bytes."""
    kind, nbytes = LEGACY_KINDS[type_name]
    rows, n = codes.shape
    nb = rows * n // 32
    dev = codes.device
    out = torch.empty((rows, n // 32 * nbytes), dtype=torch.uint8, device=dev)
    c = codes.contiguous().view(torch.uint8) if codes.dtype == torch.int8 else codes.to(torch.uint8).contiguous()
    sh = (torch.zeros((rows, n // 32), dtype=torch.int32, device=dev) if shift is None
          else shift.to(dev, torch.int32)).contiguous()
    mb = _f16_bits(m.to(dev)) if m is not None else torch.zeros(1, dtype=torch.int32, device=dev)
    bb = _blocks_per_program(nb)
    launch(_pack_legacy_kernel, (triton.cdiv(nb, bb),), c, sh, _f16_bits(d.to(dev)), mb, out, nb,
           KIND=kind, NBYTES=nbytes, BB=bb)
    return out


def gptq4_to_q4_0_triton(qweight: torch.Tensor, block_scales: torch.Tensor) -> torch.Tensor:
    """qweight int32 [in/8, out], block_scales fp16 [out, in/32] -> Q4_0 bytes uint8 [out, in/32*18]."""
    in8, n_out = qweight.shape
    nb = in8 // 4
    out = torch.empty((n_out, nb * 18), dtype=torch.uint8, device=qweight.device)
    bb = _blocks_per_program(n_out * nb)
    launch(_gptq_q4_0_kernel, (triton.cdiv(n_out * nb, bb),), qweight.contiguous(),
           _f16_bits(block_scales.to(qweight.device)).contiguous(), out, n_out, nb, BB=bb)
    return out

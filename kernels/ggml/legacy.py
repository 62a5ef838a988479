"""ggml legacy block codecs (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), vectorized torch over all blocks at once.

Three operations per type, all on [rows, n] tensors with n a multiple of 32:
- `pack_blocks(layout, codes, d, m)`: codes already on the type's grid + fp16 block params -> bytes.
  This is the lossless repack path: a GPTQ grid becomes blocks without touching a float.
- `quantize_blocks(layout, x)`: llama.cpp's reference quantizer (`quantize_row_*_ref`), byte for byte:
  the same signed-max choice, the same truncation after `+ 8.5` and the same fp32 inverse scale.
- `decode_blocks(layout, data)`: bytes -> float32, the same arithmetic as gguf-py's dequantize.
- `quantize_pack(layout, x)`: quantize_blocks + pack_blocks in one: ggml's reference quantizers in C
  (kernels/ggml/kquant_c.c) where a C compiler built them; otherwise, for Q4_0 and Q8_0 on large tensors, the
  element-wise passes run as one fused torch.compile kernel (see _fused below), else the eager codec.
"""

from __future__ import annotations

import math
import mmap

import torch

from .layouts import BlockLayout

__all__ = ["pack_blocks", "quantize_blocks", "quantize_pack", "decode_blocks", "unpack_blocks"]

_HALF = 16  # elements j and j + 16 share a byte in the 4-bit nibble arrays


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """[..., ] fp16 -> [..., 2] little-endian bytes."""
    return x.to(torch.float16).contiguous().view(torch.uint8).view(*x.shape, 2)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """[rows, nb, 32] codes -> [rows, nb, 16] bytes: element j low nibble, element j + 16 high nibble."""
    return (q[..., :_HALF] & 0x0F) | ((q[..., _HALF:] & 0x0F) << 4)


def _high_bits(q: torch.Tensor) -> torch.Tensor:
    """[rows, nb, 32] 5-bit codes -> [rows, nb, 4] bytes of the little-endian u32 whose bit j is bit 4 of q[j]."""
    bits = ((q >> 4) & 1).view(*q.shape[:-1], 4, 8)
    weights = 1 << torch.arange(8, dtype=torch.int32, device=q.device)
    return (bits.to(torch.int32) * weights).sum(-1).to(torch.uint8)


def pack_blocks(lay: BlockLayout, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None) -> torch.Tensor:
    """codes [rows, n] (uint8 on 0..2**bits-1, or int8 for Q8_0), d/m [rows, n/32] -> uint8 [rows, n/32*nbytes]."""
    rows, n = codes.shape
    nb = n // lay.block
    q = codes.view(rows, nb, lay.block)
    parts = [_fp16_bytes(d)]
    if lay.has_min:
        if m is None:
            raise ValueError(f"{lay.name} needs a block min")
        parts.append(_fp16_bytes(m))
    if lay.name == "Q8_0":
        parts.append(q.to(torch.int8).view(torch.uint8))
    else:
        qu = q.to(torch.uint8)
        if lay.bits == 5:
            parts.append(_high_bits(qu))
        parts.append(_nibbles(qu))
    return torch.cat(parts, dim=-1).view(rows, nb * lay.nbytes)


def unpack_blocks(lay: BlockLayout, data: torch.Tensor):
    """uint8 [rows, nb*nbytes] -> (codes [rows, n] int16, d [rows, nb] f32, m [rows, nb] f32 | None)."""
    rows = data.shape[0]
    nb = data.shape[1] // lay.nbytes
    b = data.view(rows, nb, lay.nbytes)
    d = b[..., 0:2].contiguous().view(torch.float16).view(rows, nb).to(torch.float32)
    pos = 2
    m = None
    if lay.has_min:
        m = b[..., 2:4].contiguous().view(torch.float16).view(rows, nb).to(torch.float32)
        pos = 4
    if lay.name == "Q8_0":
        q = b[..., pos:].contiguous().view(torch.int8).to(torch.int16)
    else:
        qh = None
        if lay.bits == 5:
            qh = b[..., pos:pos + 4].to(torch.int32)
            pos += 4
        qs = b[..., pos:].to(torch.int16)
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1)
        if qh is not None:
            word = qh[..., 0] | (qh[..., 1] << 8) | (qh[..., 2] << 16) | (qh[..., 3] << 24)
            hi = (word[..., None] >> torch.arange(32, device=data.device)) & 1
            q = q | (hi.to(torch.int16) << 4)
    return q.reshape(rows, nb * lay.block), d, m


def decode_blocks(lay: BlockLayout, data: torch.Tensor) -> torch.Tensor:
    from ..triton.route import legacy_decode

    routed = legacy_decode(lay, data)  # the Triton twin, when chosen
    if routed is not None:
        return routed
    q, d, m = unpack_blocks(lay, data)
    rows, n = q.shape
    nb = n // lay.block
    qf = q.view(rows, nb, lay.block).to(torch.float32)
    if lay.has_min:
        w = d[..., None] * qf + m[..., None]
    else:
        w = d[..., None] * (qf - lay.offset)
    return w.view(rows, n)


def quantize_blocks(lay: BlockLayout, x: torch.Tensor):
    """float32 [rows, n] -> (codes, d fp16, m fp16 | None), exactly as ggml's quantize_row_*_ref."""
    rows, n = x.shape
    nb = n // lay.block
    xb = x.to(torch.float32).reshape(rows, nb, lay.block)
    if lay.has_min:
        lo = xb.min(-1).values
        hi = xb.max(-1).values
        d = (hi - lo) / float(lay.code_max)
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        t = (xb - lo[..., None]) * inv[..., None] + 0.5
        q = torch.trunc(t).to(torch.int32)
        if lay.bits == 4:
            q = q.clamp(max=15)  # Q5_1's reference has no clamp; its values never exceed 31
        return q.to(torch.uint8).view(rows, n), d.to(torch.float16), lo.to(torch.float16)
    amax_idx = xb.abs().argmax(-1, keepdim=True)  # first index of the largest |x|, as C's strict '<'
    signed_max = torch.gather(xb, -1, amax_idx).squeeze(-1)
    if lay.name == "Q8_0":
        amax = signed_max.abs()
        d = amax / 127.0
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        v = xb * inv[..., None]
        # roundf: half away from zero. Not floor(|v| + 0.5): that sum rounds up to 1 at |v| = 0.5 - 2**-25
        t = torch.trunc(v)
        q = torch.where((v - t).abs() == 0.5, t + torch.sign(v), torch.round(v))
        return q.to(torch.int8).view(rows, n), d.to(torch.float16), None
    # C starts from max = +0.0 and only replaces it for |x| > 0: a block of (negative) zeros keeps +0,
    # so d = +0/-8 = -0.0 (fp16 0x8000)
    signed_max = torch.where(signed_max == 0, torch.zeros_like(signed_max), signed_max)
    d = signed_max / float(-lay.offset)
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    t = xb * inv[..., None] + (lay.offset + 0.5)
    q = torch.trunc(t).to(torch.int32).clamp(max=lay.code_max)
    return q.to(torch.uint8).view(rows, n), d.to(torch.float16), None


def repack_grid(lay: BlockLayout, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                block_group: torch.Tensor, mins: torch.Tensor | None = None) -> torch.Tensor:
    """A grid whose every block lies in one group -> legacy blocks, moving codes, not floats.

    codes [out, in] uint8, scales/zeros [out, G], block_group [in/32]: the group of each block.
    Symmetric types take q' = q - z + offset (the caller checked the range); types with a min take
    q' = q, d = s, m = -s*z, or the grid's own min in the min form (m rounds to fp16: the only
    rounding on this path).
    """
    from ..triton.route import legacy_repack

    routed = legacy_repack(lay, codes, scales, zeros, block_group, mins)  # the Triton twin, when chosen
    if routed is not None:
        return routed
    rows, n = codes.shape
    nb = n // lay.block
    s = scales[:, block_group].to(torch.float32)
    z = zeros[:, block_group]
    if lay.has_min:
        m = mins[:, block_group].to(torch.float32) if mins is not None else -(s * z.to(torch.float32))
        return pack_blocks(lay, codes, s.to(torch.float16), m.to(torch.float16))
    q = codes.view(rows, nb, lay.block).to(torch.int16) - z.to(torch.int16)[..., None] + lay.offset
    return pack_blocks(lay, q.view(rows, n), s.to(torch.float16))


# ---------------------------------------------------------------------------------------------------
# Fused Q4_0 / Q8_0 quantization
#
# The eager path above makes ~8 passes over the data (abs, argmax, gather, multiply, add, trunc,
# clamp, cast, pack). For large tensors the whole per-block computation is compiled by torch.compile
# (inductor's C++ backend) into one loop over the blocks: each block's 32 values are read once. The
# result stays byte-identical to C because every compiled operation is an exactly defined IEEE
# float32 operation (max/min, x*inv + c, 1/d, trunc, clamp, casts; inductor compiles without
# unsafe-math and without FMA contraction), the only constant divisor (Q8_0's 127) comes in as a
# runtime tensor so that it cannot be turned into a multiplication by its rounded reciprocal. The
# kernel also returns the fp16 bits of the scale and a flag per block. The sign of a zero scale (C
# stores -0.0 for a Q4_0 block of zeros) is set in integers, and the flagged blocks, which the float
# code does not reproduce, are requantized eagerly: which of +a / -a is "the" maximum of a
# block holding both (C keeps the first), non-finite values, and a scale whose inverse overflows
# (C's float->int8 cast of +-inf/NaN).
# Without a working compiler (or with QCONVERT_COMPILE=0) the eager path runs; both give the same bytes.

_FUSED_MIN_ELEMENTS = 1 << 22  # below this the one-time compilation costs more than it saves
_FUSED_BAND_VALUES = 1 << 22  # values per kernel call
_fused_cache: dict = {}


def _fused_enabled() -> bool:
    import os

    return os.environ.get("QCONVERT_COMPILE", "1") != "0"




def _redo_mask(hi, lo, inv):
    """Blocks whose float codes the kernel does not reproduce: non-finite inputs, and a scale whose
    inverse overflows (denormal blocks: x*inf is +-inf or NaN, which C's (int8_t) cast turns into the
    low byte of INT_MIN, 0, while the kernel's float clamp would give 15 / a saturated int8)."""
    return ~(torch.isfinite(inv) & torch.isfinite(hi) & torch.isfinite(lo))


def _q4_0_kernel(xb, offset):
    hi, lo = xb.amax(-1), xb.amin(-1)
    smax = torch.where(hi >= -lo, hi, lo)
    d = smax / -offset
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    t = xb * inv[..., None] + (offset + 0.5)  # C: x*id + 8.5, truncated by the (int8_t) cast
    q = torch.trunc(t).clamp(max=15).to(torch.uint8)
    # C's d = max/-8 with max starting at +0: a zero d is -0.0 unless max was a negative number
    # too small for max/-8 to be nonzero
    # C's d = max/-8 with max starting at +0: a zero d is -0.0 unless max was a negative number too
    # small for max/-8 to be nonzero. The caller sets that sign in integers: inductor compiles with
    # -fno-signed-zeros, so the sign of a float zero is not something the kernel may rely on.
    zero_kind = torch.where(d == 0, torch.where(smax >= 0, 2, 1), 0).to(torch.int8)  # 2: -0.0, 1: +0.0
    redo = _redo_mask(hi, lo, inv) | ((hi == -lo) & (hi > 0))  # +a and -a: C keeps the first
    return d.to(torch.float16), q[..., :_HALF] | (q[..., _HALF:] << 4), zero_kind, redo


def _q8_0_kernel(xb, divisor):
    hi, lo = xb.amax(-1), xb.amin(-1)
    d = torch.maximum(hi.abs(), lo.abs()) / divisor
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    v = xb * inv[..., None]
    t = torch.trunc(v)  # C's roundf: half away from zero (rint, except exact halves)
    r = torch.where((v - t).abs() == 0.5, t + torch.sign(v), torch.round(v))
    zero_kind = (d == 0).to(torch.int8)  # a zero d is C's 0/127 = +0.0
    return d.to(torch.float16), r.to(torch.int8), zero_kind, _redo_mask(hi, lo, inv)


_KERNELS = {"Q4_0": _q4_0_kernel, "Q8_0": _q8_0_kernel}


def _call_fused(name: str, *args):
    fn = _fused_cache.get(name)
    if fn is None:
        try:
            fn = torch.compile(_KERNELS[name], dynamic=True)
        except Exception:  # noqa: BLE001 - no compiler / unsupported platform
            fn = _KERNELS[name]
        _fused_cache[name] = fn
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - a compile failure surfaces on the first call: eager for good
        _fused_cache[name] = _KERNELS[name]
        return _KERNELS[name](*args)


def _empty_bytes(shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised uint8 tensor; a large one on transparent huge pages where Linux offers them
    (THP in madvise mode): the first write of a fresh 48 MB buffer costs ~17 ms in 4 KB page faults
    and ~3 ms in 2 MB pages, a third of what the Q8_0 kernel itself takes. The tensor keeps the
    mapping alive and unmaps it when freed."""
    n = math.prod(shape)
    if n >= 1 << 23 and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            m.madvise(mmap.MADV_HUGEPAGE)
            return torch.frombuffer(m, dtype=torch.uint8).view(shape)
        except (OSError, ValueError, AttributeError):  # no THP, or no anonymous mmap here
            pass
    return torch.empty(shape, dtype=torch.uint8)


def quantize_pack(lay: BlockLayout, x: torch.Tensor, fused: bool | None = None, c: bool | None = None
                  ) -> torch.Tensor:
    """float32 [rows, n] -> uint8 [rows, n/32*nbytes]: pack_blocks(quantize_blocks(x)), byte for byte.

    Which path: the Triton twin (kernels/triton/quant.py) when Triton is chosen (kernels/triton/route.py); else,
    by default, the fused torch.compile kernel for Q8_0 on large tensors (QCONVERT_COMPILE != 0: its 2 threads
    measured 2.5 GB/s, the C twin 1.0-1.5), ggml's reference quantizers in C (kernels/ggml/kquant_c.c) for the rest where
    they are built (Q4_0 1.5-1.9 GB/s, at or above the fused kernel, without its compilation; Q4_1 / Q5_0 / Q5_1
    about 10x the eager codec), else the fused kernel for large Q4_0, else the eager torch codec. `fused` or `c`
    given: that path. All give the same bytes."""
    from . import kquant_c
    from .kquants import default_threads
    from ..triton.route import legacy_quantize

    large = lay.name in _KERNELS and x.numel() >= _FUSED_MIN_ELEMENTS and _fused_enabled()
    if c is None:
        c = fused is None and not (lay.name == "Q8_0" and large)
    use_c = c and not x.is_cuda and kquant_c.available()
    routed = legacy_quantize(lay, x, use_c)
    if routed is not None:
        return routed
    if use_c:
        return torch.from_numpy(kquant_c.quantize_legacy(x.to(torch.float32).numpy(), lay.name, default_threads()))
    if fused is None:
        fused = large
    if not fused or lay.name not in _KERNELS:
        return pack_blocks(lay, *quantize_blocks(lay, x))
    rows, n = x.shape
    nb = n // lay.block
    xb = x.to(torch.float32).contiguous().view(rows, nb, lay.block)
    const = torch.tensor(8.0 if lay.name == "Q4_0" else 127.0, dtype=torch.float32)
    out = _empty_bytes((rows, nb, lay.nbytes))
    # Bands of rows: the kernel's outputs of one band (<= 4 MB of codes) come from memory the allocator
    # reuses, instead of fresh pages the kernel would fault in for the whole tensor's codes.
    step = max(1, _FUSED_BAND_VALUES // n)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        d16, q, zero_kind, redo = _call_fused(lay.name, xb[r0:r1], const)  # fp16 scale, codes, zero kind, redo
        bits = d16.view(torch.int16)
        if bool(zero_kind.any()):  # blocks of zeros: the sign C gives their scale
            bits.masked_fill_(zero_kind == 1, 0)
            bits.masked_fill_(zero_kind == 2, -0x8000)  # fp16 -0.0
        band = out[r0:r1]
        band[..., 0:2] = bits.view(torch.uint8).view(r1 - r0, nb, 2)
        band[..., 2:] = q.view(torch.uint8)
        if bool(redo.any()):
            r, b = redo.nonzero(as_tuple=True)
            sub = xb[r0:r1][r, b].reshape(-1, lay.block)
            band[r, b] = pack_blocks(lay, *quantize_blocks(lay, sub)).view(-1, lay.nbytes)
    return out.view(rows, nb * lay.nbytes)

"""Float element formats (FP8 E4M3/E5M2, FP4 E2M1) and their block scales (E8M0, E4M3), as pure functions.

The float-quantized checkpoints (DeepSeek/Qwen3 FP8, compressed-tensors float-quantized / mxfp4 / nvfp4,
NVIDIA ModelOpt FP8 / NVFP4, gpt-oss MXFP4) all store a code per element that indexes a small table of
float values, times a scale per block of elements (and for NVFP4 a per-tensor scale as well). A code is
the element's own bit pattern, so the tables here are the formats' value sets in code order:

- E2M1 (OCP MX spec; FP4): sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6. Code 8 is -0.0.
- E4M3 ("fn": no infinities, 0x7F / 0xFF are NaN, max 448) and E5M2 (IEEE-like, max 57344): torch's
  float8_e4m3fn / float8_e5m2 decode every byte, so their tables are those decodings.
- E8M0 (MX block scale): byte e is 2**(e - 127); 0xFF is NaN.

Packing: two E2M1 codes a byte, the even element in the low nibble (compressed-tensors pack_fp4_to_uint8,
ModelOpt, gpt-oss `*_blocks`, mistral.rs UQFF MXFP4 all agree). ggml's blocks order nibbles differently
(block_mxfp4: byte j holds elements j and j + 16 of a 32-block; block_nvfp4: byte 8s + j holds elements
16s + j and 16s + j + 8 of its 16-element sub-block s), which `pack_ggml_*` / `unpack_ggml_*` convert.

`quantize_ggml_mxfp4` / `quantize_ggml_nvfp4` reproduce ggml's quantize_row_mxfp4_ref and
quantize_row_nvfp4_ref (ggml-quants.c of the llama.cpp that llama-cpp-python 0.3.36 vendors; what
ggml_quantize_chunk, llama-quantize and convert_hf_to_gguf's MXFP4 path run) byte for byte:

- MXFP4, per 32-block: amax = max |x| (NaN never wins `amax < |v|`); e = (uint8)(floor(log2f(amax)) - 2 + 127)
  when amax > 0, else 0; d = 2**(e - 128) (ggml_e8m0_to_fp32_half: ggml's table holds the E2M1 values
  doubled, kvalues_mxfp4 = 0, 1, 2, 3, 4, 6, 8, 12 and negatives); each element takes the first index i of
  the smallest |kvalues[i] * d - x| (best_index_mxfp4, strict <), in float32.
- NVFP4, per 16-element sub-block of a 64-block: ue = ggml_fp32_to_ue4m3(amax / 6), d = ggml_ue4m3_to_fp32(ue)
  (the E4M3 value halved, again for the doubled table), codes as above.

Exactness notes: the products kvalues[i] * d are exact in float32 (at most 6 significant bits); the
subtraction and fabsf round as numpy's float32 does. log2f is taken as the float32 rounding of a double
log2 (glibc's log2f is correctly rounded to within 0.502 ulp; the floor only changes when the rounding
crosses an integer, which the double-then-float32 rounding reproduces); tests/formats/common/test_float_grids.py
compares every block with ggml_quantize_chunk. The float -> uint8 conversion of the exponent is C's
truncation through a 32-bit int (gcc's cvttss2si), so an out-of-range value wraps as it does in C.
"""

from __future__ import annotations

import numpy as np
import torch

from .triton import route as triton_route

__all__ = ["E2M1_VALUES", "element_table", "ELEMENT_BITS", "unpack_fp4", "pack_fp4", "e8m0_to_float",
           "float_to_e8m0", "is_e8m0_exact", "e4m3_exact", "MXFP4_BLOCK", "MXFP4_BYTES", "NVFP4_BLOCK",
           "NVFP4_SUB", "NVFP4_BYTES", "pack_ggml_mxfp4", "unpack_ggml_mxfp4", "pack_ggml_nvfp4",
           "unpack_ggml_nvfp4", "decode_ggml_mxfp4", "decode_ggml_nvfp4", "quantize_ggml_mxfp4",
           "quantize_ggml_nvfp4", "ue4m3_to_float"]

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
ELEMENT_BITS = {"e2m1": 4, "e4m3": 8, "e5m2": 8}

MXFP4_BLOCK, MXFP4_BYTES = 32, 17  # ggml-common.h block_mxfp4: uint8 e, uint8 qs[16]
NVFP4_BLOCK, NVFP4_SUB, NVFP4_BYTES = 64, 16, 36  # block_nvfp4: uint8 d[4] (UE4M3), uint8 qs[32]

# ggml-common.h kvalues_mxfp4: the E2M1 values doubled (so that they are integers)
_KVALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)
F32 = np.float32


def element_table(name: str, negative_zero: bool = True) -> torch.Tensor:
    """The float32 value of every code of an element format, in code order (NaN where the format has one).
    `negative_zero=False`: E2M1's code 8 as +0.0, as ModelOpt's NVFP4 table and ggml's kvalues_mxfp4 decode it
    (the spec's -0.0 otherwise: compressed-tensors, transformers' gpt-oss table, ModelOpt's MXFP4)."""
    if name == "e2m1":
        table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        return table if negative_zero else table + 0.0  # x + 0.0 turns -0.0 into +0.0
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[name]
    return torch.arange(256, dtype=torch.uint8).view(dtype).to(torch.float32)


# -- FP4 codes two to a byte, even element in the low nibble ----------------------------------------------
def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] -> uint8 codes [..., n] (low nibble first): Triton where chosen (kernels/triton/route.py)."""
    p = packed.to(torch.uint8)
    if p.dim() >= 1 and p.numel():
        routed = triton_route.bitstream(p.reshape(-1, p.shape[-1]), 4, p.shape[-1] * 2, word_bits=8)
        if routed is not None:
            return routed.reshape(*p.shape[:-1], p.shape[-1] * 2)
    return torch.stack((p & 0x0F, p >> 4), dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., n] (n even) -> uint8 [..., n/2], the even element in the low nibble."""
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).contiguous()


# -- block scales ----------------------------------------------------------------------------------------
def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 bytes -> float32 2**(e - 127) (byte 0 is the subnormal 2**-127; 0xFF is NaN)."""
    return e.to(torch.uint8).view(torch.float8_e8m0fnu).to(torch.float32)


def float_to_e8m0(x: torch.Tensor) -> torch.Tensor:
    """float32 powers of two in [2**-127, 2**127] -> their E8M0 bytes (callers check `is_e8m0_exact` first)."""
    m, e = torch.frexp(x.to(torch.float32))  # x = m * 2**e, m = 0.5 for a power of two
    return (e.to(torch.int32) - 1 + 127).clamp(0, 254).to(torch.uint8)


def is_e8m0_exact(x: torch.Tensor) -> torch.Tensor:
    """Elementwise: is x a power of two that an E8M0 byte holds (2**-127 .. 2**127)?"""
    x = x.to(torch.float32)
    m, e = torch.frexp(x)
    return (m == 0.5) & (e >= -126) & (e <= 128)


def e4m3_exact(x: torch.Tensor) -> torch.Tensor:
    """Elementwise: does x survive a round trip through float8_e4m3fn unchanged (NaN never does)?"""
    x = x.to(torch.float32)
    return x.to(torch.float8_e4m3fn).to(torch.float32) == x


def ue4m3_to_float(d: np.ndarray) -> np.ndarray:
    """ggml_ue4m3_to_fp32: an unsigned E4M3 byte (bias 7) -> float32 value * 0.5 (bytes 0 and 0x7F -> 0)."""
    d = np.asarray(d, dtype=np.uint8)
    exp = (d >> 3).astype(np.int32) & 0xF
    man = (d & 7).astype(np.float32)
    raw = np.where(exp == 0, np.ldexp(man, -9), np.ldexp(F32(1) + man / F32(8), exp - 7)).astype(F32)
    out = raw * F32(0.5)
    out[(d == 0) | (d == 0x7F)] = 0
    return out.astype(F32)


def _fp32_to_ue4m3(x: np.ndarray) -> np.ndarray:
    """ggml_fp32_to_ue4m3, elementwise on float32: the exponent and top three mantissa bits of x, rounded
    by the next bit (a carry into the exponent included), saturating at 0x7E (448); subnormals as
    (int)(x * 512 + 0.5) clamped to 1..7; non-positive or NaN -> 0."""
    x = np.asarray(x, dtype=F32)
    out = np.zeros(x.shape, dtype=np.uint8)
    pos = x > 0  # NaN and <= 0 stay 0
    xc = np.minimum(x, F32(448.0))
    bits = xc.view(np.uint32)
    fexp = ((bits >> 23) & 0xFF).astype(np.int32) - 127
    fman = ((bits >> 20) & 7).astype(np.int32)
    uexp = fexp + 7
    sub = pos & (uexp <= 0)
    man = np.trunc(xc * F32(512.0) + F32(0.5)).astype(np.int64)
    man = np.minimum(man, 7)
    out = np.where(sub & (man >= 1), man, out).astype(np.uint8)
    norm = pos & (uexp > 0)
    rnd = ((bits >> 19) & 1).astype(np.int32)
    m = fman + rnd
    e = np.where(m > 7, uexp + 1, uexp)
    m = np.where(m > 7, 0, m)
    val = np.where(e >= 15, 0x7E, (e << 3) | m)
    val = np.where(uexp >= 15, 0x7E, val)
    return np.where(norm, val, out).astype(np.uint8)


# -- ggml MXFP4 / NVFP4 blocks ---------------------------------------------------------------------------
def pack_ggml_mxfp4(codes: np.ndarray, e: np.ndarray) -> np.ndarray:
    """E2M1 codes uint8 [rows, n] and E8M0 bytes uint8 [rows, n/32] -> block_mxfp4 bytes [rows, n/32*17]."""
    rows, n = codes.shape
    nb = n // MXFP4_BLOCK
    c = codes.reshape(rows, nb, MXFP4_BLOCK).astype(np.uint8)
    qs = c[..., :16] | (c[..., 16:] << 4)
    return np.concatenate([e.reshape(rows, nb, 1).astype(np.uint8), qs], axis=-1).reshape(rows, nb * MXFP4_BYTES)


def unpack_ggml_mxfp4(data: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """block_mxfp4 bytes [rows, n/32*17] -> (E2M1 codes uint8 [rows, n], E8M0 bytes uint8 [rows, n/32])."""
    b = np.asarray(data, dtype=np.uint8).reshape(-1, n // MXFP4_BLOCK, MXFP4_BYTES)
    qs = b[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(b.shape[0], n)
    return codes, b[..., 0].copy()


def pack_ggml_nvfp4(codes: np.ndarray, d: np.ndarray) -> np.ndarray:
    """E2M1 codes uint8 [rows, n] and UE4M3 bytes uint8 [rows, n/16] -> block_nvfp4 bytes [rows, n/64*36]."""
    rows, n = codes.shape
    nb = n // NVFP4_BLOCK
    c = codes.reshape(rows, nb, 4, NVFP4_SUB).astype(np.uint8)
    qs = (c[..., :8] | (c[..., 8:] << 4)).reshape(rows, nb, 32)
    return np.concatenate([d.reshape(rows, nb, 4).astype(np.uint8), qs], axis=-1).reshape(rows, nb * NVFP4_BYTES)


def unpack_ggml_nvfp4(data: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """block_nvfp4 bytes -> (E2M1 codes uint8 [rows, n], UE4M3 bytes uint8 [rows, n/16])."""
    b = np.asarray(data, dtype=np.uint8).reshape(-1, n // NVFP4_BLOCK, NVFP4_BYTES)
    rows = b.shape[0]
    qs = b[..., 4:].reshape(rows, -1, 4, 8)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, n)
    return codes, b[..., :4].reshape(rows, -1).copy()


def decode_ggml_mxfp4(data: np.ndarray, n: int) -> np.ndarray:
    """dequantize_row_mxfp4: kvalues_mxfp4[q] * 2**(e - 128), float32 [rows, n]."""
    codes, e = unpack_ggml_mxfp4(data, n)
    d = e8m0_to_float(torch.from_numpy(e)).numpy() * F32(0.5)  # ggml_e8m0_to_fp32_half, exact (e=0: 2**-128)
    return (_KVALUES[codes].reshape(codes.shape[0], -1, MXFP4_BLOCK) * d[..., None]).reshape(codes.shape)


def decode_ggml_nvfp4(data: np.ndarray, n: int) -> np.ndarray:
    """dequantize_row_nvfp4: kvalues_mxfp4[q] * ue4m3_to_fp32(d), float32 [rows, n] (without the tensor's
    `.scale`, which llama.cpp multiplies into the matmul's result)."""
    codes, d = unpack_ggml_nvfp4(data, n)
    s = ue4m3_to_float(d)
    return (_KVALUES[codes].reshape(codes.shape[0], -1, NVFP4_SUB) * s[..., None]).reshape(codes.shape)


def _best_index(x: np.ndarray, d: np.ndarray) -> np.ndarray:
    """best_index_mxfp4 for every element: x float32 [..., k], d float32 [..., 1] -> uint8 [..., k]: the first
    i with the smallest |kvalues[i] * d - x| (np.argmin keeps the first of equal minima, as C's strict <;
    a NaN x makes every error NaN and C keeps index 0, as argmin does)."""
    best = np.zeros(x.shape, dtype=np.uint8)
    best_err = np.abs(_KVALUES[0] * d - x)
    for i in range(1, 16):
        err = np.abs((_KVALUES[i] * d).astype(F32) - x)
        better = err < best_err
        best[better] = i
        best_err = np.where(better, err, best_err)
    return best


def _amax(xb: np.ndarray) -> np.ndarray:
    """max |x| over the last axis, a NaN never taking the place of a number (C's `amax < fabsf(v)`)."""
    a = np.abs(xb)
    return np.where(np.isnan(a), F32(0), a).max(axis=-1).astype(F32)


def _c_uint8_of_float(v: np.ndarray) -> np.ndarray:
    """C's (uint8_t) of a float on x86-64 gcc: truncation to a 32-bit int (cvttss2si; NaN and values out of
    range give INT_MIN), then its low byte."""
    v = np.asarray(v, dtype=np.float64)
    ok = np.isfinite(v) & (v > -2.0 ** 31) & (v < 2.0 ** 31)
    i = np.where(ok, np.trunc(np.where(ok, v, 0)), -(2 ** 31)).astype(np.int64)
    return (i & 0xFF).astype(np.uint8)


def quantize_ggml_mxfp4(x: np.ndarray) -> np.ndarray:
    """float32 [rows, n] (n a multiple of 32) -> block_mxfp4 bytes, as ggml's quantize_row_mxfp4_ref."""
    from .dispatch import note_kernel  # the report's "kernel": no Triton twin of this quantizer

    note_kernel("quantize", "numpy")
    x = np.ascontiguousarray(x, dtype=F32)
    rows, n = x.shape
    xb = x.reshape(rows, n // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = _amax(xb)
    with np.errstate(divide="ignore", invalid="ignore"):
        lg = np.log2(amax.astype(np.float64)).astype(F32)  # log2f: the float32 rounding of the exact value
        ev = np.floor(lg).astype(F32) - F32(2) + F32(127)
    e = np.where(amax > 0, _c_uint8_of_float(ev), 0).astype(np.uint8)
    d = e8m0_to_float(torch.from_numpy(e)).numpy() * F32(0.5)
    codes = _best_index(xb, d[..., None]).reshape(rows, n)
    return pack_ggml_mxfp4(codes, e)


def quantize_ggml_nvfp4(x: np.ndarray) -> np.ndarray:
    """float32 [rows, n] (n a multiple of 64) -> block_nvfp4 bytes, as ggml's quantize_row_nvfp4_ref."""
    from .dispatch import note_kernel  # the report's "kernel": no Triton twin of this quantizer

    note_kernel("quantize", "numpy")
    x = np.ascontiguousarray(x, dtype=F32)
    rows, n = x.shape
    xb = x.reshape(rows, n // NVFP4_SUB, NVFP4_SUB)
    amax = _amax(xb)
    ue = _fp32_to_ue4m3((amax / F32(6.0)).astype(F32))
    d = ue4m3_to_float(ue)
    codes = _best_index(xb, d[..., None]).reshape(rows, n)
    return pack_ggml_nvfp4(codes, ue)

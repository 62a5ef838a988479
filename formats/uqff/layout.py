"""UQFF 1.x facts in one place, and the pure per-family codecs (tensors in, tensors out).

A UQFF layer `<key>` is a group of safetensors tensors `<key>.weight`, `<key>.weight.format` (U8 scalar:
the family tag) and family-specific `<key>.weight.<field>` metadata (mistralrs-quant/src/uqff/ in mistral.rs).
Each family decodes here exactly as mistral.rs 0.9.5 computes it on a CPU:

  tag 0 GGUF blocks   ggml block bytes [rows * row_bytes] + ggml type id + torch-order shape
  tag 1 Unquant       a plain float tensor
  tag 2 HQQ           HQQ axis-0 groups, 4-bit "two halves" / 8-bit packing, (q - zero) * scale
  tag 3 FP8           per-tensor scaled F8E4M3: w = fp8 * dequant_w_scale
  tag 4 AFQ           MLX affine: LSB-first u32 bit stream per row, w = scale * q + bias
  tag 5 F8Q8          33-byte blocks of 32 flattened elements: fp8 d, int8 qs, w = qs * (d / 416)
  tag 6 MXFP4         FP4 E2M1 nibbles (low nibble first) * 2^(e8m0 - 127), blocks of 32 along a row
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType

from ...kernels.triton import route as triton_route
from ...kernels.bitpack import pack_rows, unpack_rows

__all__ = ["TAG", "FAMILY_OF_TAG", "SUFFIXES", "GGML_TYPE_IDS", "GGML_NAME_OF_ID", "UqffType", "UQFF_TYPES",
           "READER_MINOR", "MAJOR", "unpack_afq", "pack_afq", "decode_f8q8", "encode_f8q8", "decode_mxfp4",
           "encode_mxfp4", "encode_fp8", "F8Q8_DIVISOR", "hqq_halves_unpack", "hqq_halves_pack",
           "decode_q8_1", "decode_q8_k"]

MAJOR = 1
READER_MINOR = 2  # the newest minor this reader knows (mistral.rs 0.9.5 writes 1.2.0)

# weight.format tags (mistral.rs QuantizedSerdeType)
TAG = {"gguf": 0, "unquant": 1, "hqq": 2, "fp8": 3, "afq": 4, "f8q8": 5, "mxfp4": 6}
FAMILY_OF_TAG = {v: k for k, v in TAG.items()}
# the exact `weight*` suffix set of each family (mistral.rs' inspector recognises a layer by it)
SUFFIXES = {
    "gguf": ("weight", "weight.format", "weight.dtype", "weight.shape"),
    "unquant": ("weight", "weight.format"),
    "hqq": ("weight", "weight.format", "weight.scales", "weight.zeros", "weight.shape", "weight.bits",
            "weight.group_size", "weight.axis", "weight.optimization_steps", "weight.round_zeros",
            "weight.channel_wise"),
    "fp8": ("weight", "weight.format", "weight.dequant_w_scale", "weight.dequant_x_scale", "weight.quant_scale",
            "weight.dtype"),
    "afq": ("weight", "weight.format", "weight.bits", "weight.group_size", "weight.scales", "weight.biases"),
    "f8q8": ("weight", "weight.format", "weight.num_blocks", "weight.shape"),
    "mxfp4": ("weight", "weight.format", "weight.scales"),
}
FP8_DTYPE_CODE = 9  # F8E4M3 in UQFF's dtype code table
# ggml type ids used in `weight.dtype` of tag 0 (names as kernels.ggml.layouts spells them)
# the ggml types a UQFF GGUF-block layer may hold, with gguf-py's type ids
GGML_TYPE_IDS = {name: int(GGMLQuantizationType[name]) for name in (
    "F32", "F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K",
    "BF16")}
GGML_NAME_OF_ID = {v: k for k, v in GGML_TYPE_IDS.items()}
# the two ggml types kernels.ggml.layouts does not hold (no GGUF writer target); decoded here by hand
EXTRA_BLOCKS = {"Q8_1": (32, 36), "Q8_K": (256, 292)}  # (elements, bytes); Q8_1 is 36 bytes in candle
# F8Q8 divides by F8E4M3::MAX, which the float8 0.7 crate linked into mistral.rs 0.9.5 evaluates to 416, not 448:
# with 416 the decoding of mistral.rs' own F8Q8 layers matches its runtime exactly, with 448 it does not
F8Q8_DIVISOR = 416.0
MXFP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass(frozen=True)
class UqffType:
    """One `--type` as mistral.rs names it (its ISQ names): family, bits, and the ggml type for tag 0."""

    name: str
    family: str
    bits: int = 0
    ggml: str = ""  # tag 0: kernels.ggml.layouts name
    group_size: int = 0  # HQQ / AFQ default group
    unquant_dtype: torch.dtype | None = None


def _t(name, family, bits=0, ggml="", group_size=0, dtype=None):
    return UqffType(name, family, bits, ggml, group_size, dtype)


# THE table of writable UQFF types (mistral.rs ISQ names; f32/f16/bf16 = inline Unquant layers, UQFF 1.1)
UQFF_TYPES = {t.name: t for t in (
    _t("q4_0", "gguf", 4, "Q4_0"), _t("q4_1", "gguf", 4, "Q4_1"), _t("q5_0", "gguf", 5, "Q5_0"),
    _t("q5_1", "gguf", 5, "Q5_1"), _t("q8_0", "gguf", 8, "Q8_0"), _t("q2k", "gguf", 2, "Q2_K"),
    _t("q3k", "gguf", 3, "Q3_K"), _t("q4k", "gguf", 4, "Q4_K"), _t("q5k", "gguf", 5, "Q5_K"),
    _t("q6k", "gguf", 6, "Q6_K"),
    _t("hqq4", "hqq", 4, group_size=64), _t("hqq8", "hqq", 8, group_size=64),
    _t("afq2", "afq", 2, group_size=64), _t("afq3", "afq", 3, group_size=64), _t("afq4", "afq", 4, group_size=64),
    _t("afq6", "afq", 6, group_size=64), _t("afq8", "afq", 8, group_size=64),
    _t("fp8", "fp8", 8), _t("f8q8", "f8q8", 8), _t("mxfp4", "mxfp4", 4),
    _t("f32", "unquant", 32, dtype=torch.float32), _t("f16", "unquant", 16, dtype=torch.float16),
    _t("bf16", "unquant", 16, dtype=torch.bfloat16),
)}
# mistral.rs' ISQ fallback for K types when a row is not a whole number of 256-blocks (as its own output shows:
# q4k on 64-wide rows is stored as Q4_1)
K_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q4_1", "Q5_K": "Q5_0", "Q6_K": "Q5_1"}
AFQ_GROUPS = (128, 64, 32)
AFQ_BITS = (2, 3, 4, 6, 8)


# -- AFQ: a little-endian bit stream per row, cut into u32 words ---------------------------------------
def unpack_afq(words: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """u32 (or int32) [out, in*bits/32] -> uint8 codes [out, in]. For 2/3/4/8 bits this is GPTQ's stream
    (kernels.bitpack) transposed; 6 bits goes through numpy's bit unpacking."""
    w = words.contiguous().view(torch.int32)
    routed = triton_route.bitstream(w, bits, in_features)  # Triton where chosen
    if routed is not None:
        return routed
    if bits in (2, 3, 4, 8):
        return unpack_rows(w.T.contiguous(), bits).T.contiguous()
    out = w.shape[0]
    raw = np.unpackbits(w.numpy().view(np.uint8).reshape(out, -1), axis=1, bitorder="little")
    fields = raw.reshape(out, -1, bits)[:, :in_features].astype(np.uint16)
    codes = (fields << np.arange(bits, dtype=np.uint16)).sum(-1)
    return torch.from_numpy(codes.astype(np.uint8))


def pack_afq(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [out, in] -> torch.uint32 words [out, in*bits/32] (the inverse of unpack_afq)."""
    out, n = codes.shape
    if n * bits % 32:
        raise ValueError(f"rows of {n} {bits}-bit codes do not fill whole u32 words")
    if bits in (2, 3, 4, 8):
        return pack_rows(codes.T.contiguous(), bits).T.contiguous().view(torch.uint32)
    c = codes.numpy().astype(np.uint16)
    raw = ((c[..., None] >> np.arange(bits, dtype=np.uint16)) & 1).astype(np.uint8).reshape(out, -1)
    packed = np.packbits(raw, axis=1, bitorder="little")
    return torch.from_numpy(np.ascontiguousarray(packed).view(np.uint32).copy()).view(out, -1)


# -- HQQ 4-bit "two halves" / 8-bit packing along dim 0 of the [gs, numel/gs] group matrix --------------
def hqq_halves_unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    from ...kernels.hqq import packing_for_bits, unpack_hqq

    packing = packing_for_bits(bits)
    return unpack_hqq(words, packing, words.shape[0] * packing.per_word)


def hqq_halves_pack(grouped: torch.Tensor, bits: int) -> torch.Tensor:
    from ...kernels.hqq import pack_hqq, packing_for_bits

    return pack_hqq(grouped, packing_for_bits(bits))


# -- FP8 (per tensor) -------------------------------------------------------------------------------------
def encode_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (F8E4M3 weight, float32 scalar dequant scale), mistral.rs' rule: the tensor's
    absmax maps to 448."""
    x = w.to(torch.float32)
    amax = float(x.abs().max())
    scale = torch.tensor(amax / 448.0 if amax > 0 else 1.0, dtype=torch.float32)
    q = (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, scale


# -- F8Q8: 33-byte blocks (fp8 d, int8 qs[32]) over the flattened weight ---------------------------------
def decode_f8q8(data: torch.Tensor, numel: int) -> torch.Tensor:
    b = data.view(-1, 33)
    d = b[:, :1].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    scale = d / F8Q8_DIVISOR  # mistral.rs: d.to_f32() / F8E4M3::MAX, then qs * scale
    q = b[:, 1:].contiguous().view(torch.int8).to(torch.float32)
    return (q * scale).reshape(-1)[:numel]


def encode_f8q8(w: torch.Tensor) -> torch.Tensor:
    """float -> uint8 [num_blocks*33], mistral.rs' quantizer: d = fp8(amax/127*416), qs = round(x*127/amax)."""
    x = w.to(torch.float32).reshape(-1)
    pad = (-x.numel()) % 32
    x = torch.cat([x, x.new_zeros(pad)]).view(-1, 32)
    amax = x.abs().max(-1, keepdim=True).values
    d = (amax / 127.0 * F8Q8_DIVISOR).to(torch.float8_e4m3fn)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(x * inv).clamp(-127, 127).to(torch.int8)
    return torch.cat([d.view(torch.uint8), q.view(torch.uint8)], dim=1).reshape(-1)


# -- MXFP4 -------------------------------------------------------------------------------------------------
def decode_mxfp4(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in/2] nibbles (low nibble = even element), uint8 [out, in/32] E8M0 -> float32 [out, in]."""
    out = weight.shape[0]
    table = torch.tensor(MXFP4_VALUES + tuple(-v for v in MXFP4_VALUES), dtype=torch.float32)
    nib = torch.stack([weight & 0x0F, weight >> 4], dim=-1).reshape(out, -1).to(torch.int64)
    vals = table[nib]
    scale = torch.ldexp(torch.ones_like(scales, dtype=torch.float32), scales.to(torch.int32) - 127)
    return (vals.view(out, -1, 32) * scale[..., None]).view(out, -1)


def encode_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (uint8 nibbles [out, in/2], uint8 E8M0 [out, in/32]); mistral.rs' scale rule
    s = floor(log2(amax/6)) + 127, then each element to the nearest E2M1 value."""
    x = w.to(torch.float32)
    out, n = x.shape
    xb = x.view(out, n // 32, 32)
    amax = xb.abs().max(-1).values
    e = torch.where(amax > 0, torch.floor(torch.log2(amax / 6.0)), torch.zeros_like(amax)) + 127
    e = e.clamp(0, 254)
    scaled = xb / torch.ldexp(torch.ones_like(e), (e - 127).to(torch.int32))[..., None]
    grid = torch.tensor(MXFP4_VALUES, dtype=torch.float32)
    idx = (scaled.abs()[..., None] - grid).abs().argmin(-1)
    code = (idx | torch.where(scaled < 0, 8, 0)).to(torch.uint8).view(out, n)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.contiguous(), e.to(torch.uint8)


# -- the two block types without a grid writer: decoded by hand -----------------------------------------
def decode_q8_1(data: torch.Tensor, rows: int) -> torch.Tensor:
    b = data.view(rows, -1, 36)
    d = b[..., 0:2].contiguous().view(torch.float16).to(torch.float32)
    q = b[..., 4:36].contiguous().view(torch.int8).to(torch.float32)
    return (d * q).view(rows, -1)


def decode_q8_k(data: torch.Tensor, rows: int) -> torch.Tensor:
    b = data.view(rows, -1, 292)
    d = b[..., 0:4].contiguous().view(torch.float32)
    q = b[..., 4:260].contiguous().view(torch.int8).to(torch.float32)
    return (d * q).view(rows, -1)

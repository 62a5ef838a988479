"""Tag 4, AFQ (MLX's affine scheme): each row a little-endian bit stream of `bits`-bit codes cut into u32
words (`weight` U32 [out, in * bits / 32]), w = scale * q + bias per group of 32 / 64 / 128 along a row
(`weight.scales`, `weight.biases` [out, in / group], float; mistral.rs dequantizes in their dtype), and
U8 `weight.bits` / `weight.group_size`.

It loads as a min-form grid, or with integer zero points when the biases provably sit on the integer grid
(`_integer_zeros`), and carries GPTQ's packed stream where the bits allow (AFQ's stream is GPTQ's,
transposed), so that a GPTQ writer moves words. Written from a grid whose codes align (codes kept, float32
scales and biases), else with MLX's affine min/max rule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ....converters.plan import TensorPlan
from ....converters.records import Dense, Grid, GridParams, PackedCodes
from ....kernels.bitpack import pack_rows, unpack_rows
from ....kernels.triton import route as triton_route
from ..layout import AFQ_BITS, AFQ_GROUPS, UqffType
from .base import EncodedLayer, LayerCodec, LayerDescription, u8_tensor

if TYPE_CHECKING:
    from ..layer_view import LayerView

__all__ = ["AfqCodec", "unpack_afq", "pack_afq"]


class AfqCodec(LayerCodec, family="afq"):
    @classmethod
    def describe(cls, layer: LayerView) -> LayerDescription:
        params, shape = _grid_params(layer)
        return LayerDescription(shape, "grid", params)

    @classmethod
    def load(cls, layer: LayerView) -> Grid:
        params, (_, n) = _grid_params(layer)
        bits = params.bits
        w = layer.part("weight")
        codes = unpack_afq(w, bits, n)
        packed = PackedCodes(w.view(torch.int32).T.contiguous(), bits, "gptq-rows") if bits in (2, 3, 4, 8) else None
        return Grid(params, codes, packed)

    @classmethod
    def encode(cls, t: UqffType, plan: TensorPlan, item: Dense | Grid) -> EncodedLayer:
        out, n = plan.shape
        g = plan.action.group_size
        if plan.action.aligned:
            p = item.params
            rep = p.group_size // g  # a source group of 128 is two AFQ groups of 64 with the same scale
            s = p.scales.to(torch.float32)
            bias = p.mins.to(torch.float32) if p.mins is not None else -(s * p.zeros.to(torch.float32))
            scales, biases = s.repeat_interleave(rep, dim=1), bias.repeat_interleave(rep, dim=1)
            packed = item.packed
            if packed is not None and packed.layout == "gptq-rows" and packed.bits == t.bits:
                weight = packed.words.T.contiguous().view(torch.uint32)  # GPTQ's stream is AFQ's, transposed
            else:
                weight = pack_afq(item.codes, t.bits)
            codes = item.codes
        else:
            codes, scales, biases = _quantize_affine(item.dequantize(torch.float32), t.bits, g)
            weight = pack_afq(codes, t.bits)
        params = GridParams(bits=t.bits, group_size=g, scales=scales, zeros=torch.zeros_like(scales), mins=biases)
        tensors = {"": weight, "weight.format": cls.format_tensor(), "weight.bits": u8_tensor(t.bits),
                   "weight.group_size": u8_tensor(g), "weight.scales": scales.contiguous(),
                   "weight.biases": biases.contiguous()}
        return EncodedLayer(tensors, Grid(params, codes).dequantize(torch.float32))


def _grid_params(layer: LayerView) -> tuple[GridParams, tuple[int, int]]:
    """The layer's GridParams and [out, in], every header checked before the codes are read."""
    bits = layer.meta_int("weight.bits", AFQ_BITS, "AFQ bits")
    gs = layer.meta_int("weight.group_size", AFQ_GROUPS, "AFQ group size")
    wdtype, wshape = layer.header("weight")
    if len(wshape) != 2 or wdtype not in ("U32", "I32") or min(wshape) < 1:
        raise layer.bad(f"AFQ weight must be a 2-D U32 tensor, got {wshape[:4]} {wdtype}")
    out, words = wshape
    n, rest = divmod(words * 32, bits)
    dtypes = {layer.header(s)[0] for s in ("weight.scales", "weight.biases")}
    sshape, bshape = layer.header("weight.scales")[1], layer.header("weight.biases")[1]
    if len(dtypes) != 1 or not dtypes <= {"F32", "F16", "BF16"} or list(sshape) != list(bshape) \
            or len(sshape) != 2 or sshape[0] != out:
        raise layer.bad(f"AFQ scales {sshape[:4]} / biases {bshape[:4]} ({', '.join(sorted(dtypes))}) "
                        f"are not one float [{out}, groups] pair", "weight.scales")
    if rest or n != sshape[1] * gs:
        raise layer.bad(f"AFQ weight rows of {words} u32 words hold {words * 32 / bits:g} {bits}-bit codes, "
                        f"but the scales describe {sshape[1]} groups of {gs} = {sshape[1] * gs} inputs", "weight.bits")
    scales, biases = layer.part("weight.scales"), layer.part("weight.biases")
    compute = scales.dtype
    zeros = _integer_zeros(scales, biases, bits)
    if zeros is not None:
        params = GridParams(bits=bits, group_size=gs, scales=scales, zeros=zeros, compute_dtype=compute)
    else:
        params = GridParams(bits=bits, group_size=gs, scales=scales, zeros=torch.zeros_like(scales), mins=biases,
                            compute_dtype=compute)
    return params, (out, n)


def _integer_zeros(scales: torch.Tensor, biases: torch.Tensor, bits: int) -> torch.Tensor | None:
    """Integer zero points z with bias = -scale*z, when the zero-point form (q - z) * s gives mistral.rs'
    s*q + b bit for bit: float32 arithmetic, fp16-representable scales (so every s*q and s*z is exact)
    and z an integer code. None otherwise: the grid then stays in the min form."""
    if scales.dtype != torch.float32:
        return None
    s = scales
    if not torch.equal(s.to(torch.float16).to(torch.float32), s) or bool((s == 0).any()):
        return None
    z = torch.round(-biases / s)
    if bool(((z < 0) | (z > (1 << bits) - 1)).any()):
        return None
    if not torch.equal(-(s * z), biases) and not torch.equal((-s) * z, biases):
        return None
    return z.to(torch.int16)


def _quantize_affine(w: torch.Tensor, bits: int, group: int):
    """MLX-style affine round-to-nearest: per group scale = (max - min) / (2^b - 1), bias = min."""
    out, n = w.shape
    x = w.to(torch.float32).view(out, n // group, group)
    lo, hi = x.min(-1).values, x.max(-1).values
    maxq = (1 << bits) - 1
    scale = (hi - lo) / maxq
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((x - lo[..., None]) / scale[..., None]).clamp(0, maxq).to(torch.uint8).view(out, n)
    return q, scale, lo


# -- a little-endian bit stream per row, cut into u32 words ---------------------------------------------
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

"""Tag 0, GGUF blocks: the ggml block bytes of a [rows, in] matrix (`weight`, U8 [rows * row_bytes]), the ggml
type id (`weight.dtype`, gguf-py's ids: layout.GGML_TYPE_IDS) and the torch-order shape (`weight.shape`).

Quantized block types load as `Grid`s that carry their bytes (`PackedCodes(layout="ggml:<TYPE>")`), so that a
GGUF or UQFF writer of the same type copies the blocks; F32 / F16 / BF16 and the two block types no GGUF
writer targets (Q8_1, Q8_K, decoded here by hand) load as dense floats. Encoding is the shared ggml codec
(formats/common/ggml_codec.py: blocks copied, codes kept, or ggml's reference quantizers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ....converters.plan import BitIdentical, TensorPlan
from ....converters.records import Dense, Grid, GridParams, PackedCodes
from ....kernels.ggml.kblocks import K_ZERO_POINT, unpack_k_blocks
from ....kernels.ggml.layouts import LAYOUTS
from ....kernels.ggml.legacy import unpack_blocks
from ...common.ggml_codec import encode_tensor
from ..layout import GGML_NAME_OF_ID, GGML_TYPE_IDS, UqffType
from .base import EncodedLayer, LayerCodec, LayerDescription, u32_tensor

if TYPE_CHECKING:
    from ..layer_view import LayerView

__all__ = ["GgufCodec", "EXTRA_BLOCKS", "decode_q8_1", "decode_q8_k"]

# the two ggml types kernels.ggml.layouts does not hold (no GGUF writer target); decoded here by hand
EXTRA_BLOCKS = {"Q8_1": (32, 36), "Q8_K": (256, 292)}  # (elements, bytes); Q8_1 is 36 bytes in candle
_FLOAT_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


class GgufCodec(LayerCodec, family="gguf"):
    @classmethod
    def describe(cls, layer: LayerView) -> LayerDescription:
        shape = layer.shape()
        name = _ggml_type(layer)
        fields = {"native_type": name}
        if _is_grid(name):  # the block scales live in the blocks: planning reads them
            return LayerDescription(shape, "grid", _load_blocks(layer, shape, name).params, fields)
        return LayerDescription(shape, "float32" if name not in LAYOUTS else _FLOAT_NAMES[name], None, fields)

    @classmethod
    def load(cls, layer: LayerView) -> Dense | Grid:
        shape = layer.shape()
        name = _ggml_type(layer)
        if _is_grid(name):
            return _load_blocks(layer, shape, name)
        return Dense(_load_plain(layer, shape, name))

    @classmethod
    def label(cls, layer: LayerView) -> str:
        return "gguf:" + _ggml_type(layer)

    @classmethod
    def encode(cls, t: UqffType, plan: TensorPlan, item: Dense | Grid) -> EncodedLayer:
        name = plan.action.ggml
        data, decoded = encode_tensor(LAYOUTS[name], plan.verdict, item, plan.action.quant)
        tensors = {"": torch.from_numpy(np.ascontiguousarray(data).reshape(-1)).to(torch.uint8),
                   "weight.format": cls.format_tensor(), "weight.dtype": u32_tensor(GGML_TYPE_IDS[name]),
                   "weight.shape": u32_tensor(list(plan.shape))}
        if not isinstance(decoded, BitIdentical):
            decoded = decoded.reshape(plan.shape)
        return EncodedLayer(tensors, decoded)


def _ggml_type(layer: LayerView) -> str:
    return GGML_NAME_OF_ID[layer.meta_int("weight.dtype", GGML_NAME_OF_ID, "ggml type id")]


def _is_grid(name: str) -> bool:
    """A block type kernels.ggml.layouts decodes to a grid (not a float type, not Q8_1 / Q8_K)."""
    return name in LAYOUTS and LAYOUTS[name].kind != "float"


def _block_bytes(layer: LayerView, shape, block: int, nbytes: int) -> torch.Tensor:
    """The weight's bytes as [rows, row_bytes], checked against the shape and the block size."""
    rows, n = shape
    if n % block:
        raise layer.bad(f"rows of {n} are not whole blocks of {block}")
    w = layer.part("weight")
    want = rows * (n // block) * nbytes
    if w.dtype != torch.uint8 or w.numel() != want:
        raise layer.bad(f"{w.numel()} bytes of {w.dtype}, expected {want} uint8 for shape {list(shape)}")
    return w.reshape(rows, -1).contiguous()


def _load_plain(layer: LayerView, shape, name: str) -> torch.Tensor:
    if name in EXTRA_BLOCKS:
        block, nbytes = EXTRA_BLOCKS[name]
        data = _block_bytes(layer, shape, block, nbytes)
        return decode_q8_1(data, shape[0]) if name == "Q8_1" else decode_q8_k(data, shape[0])
    dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[name]
    data = _block_bytes(layer, shape, 1, torch.tensor([], dtype=dtype).element_size())
    return data.view(dtype).view(shape)


def _load_blocks(layer: LayerView, shape, name: str) -> Grid:
    lay = LAYOUTS[name]
    words = _block_bytes(layer, shape, lay.block, lay.nbytes)
    if lay.kind == "k":
        codes, scales, mins = unpack_k_blocks(name, words.numpy())
        codes, scales = torch.from_numpy(codes), torch.from_numpy(scales)
        if mins is None:
            zeros = torch.full_like(scales, K_ZERO_POINT[name], dtype=torch.int16)
        else:
            mins, zeros = torch.from_numpy(mins), torch.zeros_like(scales)
        group = lay.sub_block
    else:
        q, d, m = unpack_blocks(lay, words)
        scales, mins = d.to(torch.float16), None  # the stored fp16 block scale, exactly
        if lay.name == "Q8_0":
            codes, zeros = (q + 128).to(torch.uint8), torch.full_like(scales, 128, dtype=torch.int16)
        elif lay.has_min:
            codes, mins, zeros = q.to(torch.uint8), m, torch.zeros_like(m)
        else:
            codes, zeros = q.to(torch.uint8), torch.full_like(scales, lay.offset, dtype=torch.int16)
        group = lay.block
    params = GridParams(bits=lay.bits, group_size=group, scales=scales, zeros=zeros, mins=mins)
    return Grid(params, codes, PackedCodes(words, lay.bits, f"ggml:{name}"))


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

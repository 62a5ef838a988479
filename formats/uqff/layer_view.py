"""One UQFF layer `<key>` of a shard set as its codec (codecs/) reads it: the container (reader.py) hands
a codec a `LayerView`, never the shard set, so that a codec reads only its layer's tensors and every refusal
names the file and tensor concerned."""

from __future__ import annotations

from typing import Protocol

import torch

from ...converters.errors import BadInput
from .layout import FAMILY_OF_TAG

__all__ = ["LayerView", "ShardTensors"]


class ShardTensors(Protocol):
    """What a LayerView needs of the container's merged shard namespace (reader._Shards)."""

    location: dict  # tensor name -> the shard file that holds it

    def meta(self, name: str) -> tuple[str, list[int]]: ...

    def get(self, name: str) -> torch.Tensor: ...


_INT_TAGS = ("U8", "U16", "U32", "I8", "I16", "I32", "I64")
_FLOAT_TAGS = ("F32", "F16", "BF16", "F64")
_MAX_DIM = 1 << 24


class LayerView:
    """One UQFF layer `<key>` of a shard set, what a codec (codecs/) reads it through: its tensors by suffix
    (`parts`: "weight", "weight.format", ... -> the tensor's name in the set, or an expert's view of a stacked
    one), their headers and values, the shared metadata scalars checked before any use, and `bad(...)`. Every
    refusal names a file of the set and the tensor concerned, so a codec never needs the whole source."""

    def __init__(self, shards: ShardTensors, key: str, parts: dict[str, str]):
        self.shards, self.key, self.parts = shards, key, parts

    def __contains__(self, suffix: str) -> bool:
        return suffix in self.parts

    def bad(self, msg: str, suffix: str = "weight") -> BadInput:
        """A refusal of the layer's tensor `<key>.<suffix>`, naming the shard that holds its weight."""
        return BadInput(msg, path=self.shards.location[self.parts["weight"]], tensor=f"{self.key}.{suffix}")

    def _name(self, suffix: str) -> str:
        if suffix not in self.parts:
            raise BadInput(f"missing {suffix} for this layer", path=self.shards.location[self.parts["weight"]],
                           tensor=f"{self.key}.{suffix}")
        return self.parts[suffix]

    def header(self, suffix: str) -> tuple[str, list[int]]:
        """(dtype tag, shape) of a layer's tensor from the safetensors header, without reading it."""
        return self.shards.meta(self._name(suffix))

    def part(self, suffix: str) -> torch.Tensor:
        return self.shards.get(self._name(suffix))

    def _meta_scalar(self, suffix: str, tags, kind: str, what: str) -> tuple[str, torch.Tensor]:
        """A layer's scalar (`[]` or `[1]`) metadata tensor of one of `tags`, checked from the header before
        it is read: (its name, its value as a 0-d tensor)."""
        name = self._name(suffix)
        dtype, shape = self.shards.meta(name)
        if dtype not in tags or len(shape) > 1 or (shape and shape[0] != 1):
            raise BadInput(f"{what}: expected {kind} scalar, found {dtype} {shape[:4]}",
                           path=self.shards.location[name], tensor=name)
        return name, self.shards.get(name).reshape(())

    def meta_int(self, suffix: str, allowed, what: str) -> int:
        """An integer scalar metadata tensor, checked against `allowed` before any use."""
        name, value = self._meta_scalar(suffix, _INT_TAGS, "an integer", what)
        v = int(value.to(torch.int64))
        if v not in allowed:
            raise BadInput(f"{what} is {v}; expected {_show_allowed(allowed)}", path=self.shards.location[name],
                           tensor=name)
        return v

    def meta_float(self, suffix: str, what: str) -> torch.Tensor:
        name, v = self._meta_scalar(suffix, _FLOAT_TAGS, "a float", what)
        if not bool(torch.isfinite(v)):
            raise BadInput(f"{what} is not a finite number", path=self.shards.location[name], tensor=name)
        return v

    def family(self) -> str:
        """The layer's family from its `weight.format` tag (layout.TAG), the name its codec registered."""
        return FAMILY_OF_TAG[self.meta_int("weight.format", FAMILY_OF_TAG, "UQFF format tag")]

    def shape(self) -> tuple[int, ...]:
        """The 2-D shape a `weight.shape` tensor gives (GGUF blocks, HQQ, F8Q8)."""
        dtype, dims = self.header("weight.shape")
        if dtype not in _INT_TAGS or len(dims) != 1 or not 1 <= dims[0] <= 8:
            raise self.bad(f"weight.shape must be a short integer vector, found {dtype} {dims[:4]}", "weight.shape")
        shape = tuple(int(x) for x in self.part("weight.shape").to(torch.int64).tolist())
        if any(not 1 <= x <= _MAX_DIM for x in shape):
            raise self.bad(f"weight shape {list(shape)}: every size must be 1..{_MAX_DIM}", "weight.shape")
        if len(shape) != 2:
            raise self.bad(f"weight shape {list(shape)}: only 2-D layers and [E, out, in] stacked experts "
                           "are supported", "weight.shape")
        return shape


def _show_allowed(allowed) -> str:
    if isinstance(allowed, range):
        return f"{allowed.start}..{allowed.stop - 1}"
    values = sorted(allowed)
    return "one of " + ", ".join(map(str, values[:16])) + (" ..." if len(values) > 16 else "")

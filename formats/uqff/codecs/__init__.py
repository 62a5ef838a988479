"""One codec per UQFF layer tag, registered by its family, so that the container knows no tag's layout.

A UQFF layer `<key>` is a `weight` tensor plus small `weight.*` tensors, and its `weight.format` tag
(layout.TAG) names the codec that reads and writes it, as gguf-py's quants.py keys its block codecs by GGML
type: a codec is a subclass of `LayerCodec` declared with `family=` (`class AfqCodec(LayerCodec,
family="afq")`), which registers it; `codec(family)` finds it. Each module of this package holds one tag:

    describe(layer) -> LayerDescription    shape, grid parameters and record fields from the small tensors,
                                           for planning (codes are unpacked only where the scales live in
                                           them: GGUF blocks)
    load(layer) -> Dense | Grid            the layer's values, as mistral.rs 0.9.5 decodes them on a CPU
    encode(t, plan, item) -> EncodedLayer  the tensors of one 2-D layer of UQFF type `t` (suffix "" for the
                                           weight, in the order they are written) and the float32 values
                                           they decode to (or `BitIdentical`)
    label(layer) -> str                    the layer's kind as `qconvert inspect` counts it (default: family)

and that tag's own packing helpers. Codecs hold no state: every hook is a classmethod. `layer` is the
container's view of one layer (reader.LayerView): its tensors' headers and values, its checked metadata
scalars, and `bad(...)`, the BadInput that names the layer's file and tensor. `describe` checks every header
and small tensor a layer has before planning goes on; the order of a codec's checks is part of its behaviour
(the first refusal is the one reported, naming its tensor), so it stays as it is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, NamedTuple

import torch

from ....converters.checker import EXACT, NEAR_EXACT
from ....converters.plan import BitIdentical, TensorPlan
from ....converters.records import Dense, Grid, GridParams
from ..layout import TAG, UqffType

if TYPE_CHECKING:
    from ..reader import LayerView

__all__ = ["LayerCodec", "LayerDescription", "EncodedLayer", "codec", "keeps_float_codes", "u8_tensor", "u32_tensor"]


@dataclass(frozen=True)
class LayerDescription:
    """What planning knows of a layer before its values are loaded."""

    shape: tuple[int, ...]  # the 2-D [out, in] the layer decodes to
    dtype: str  # "grid" for a quantized layer, else the float dtype name its values load as
    params: GridParams | None = None  # a grid's small parameters, for the checker
    record_fields: dict = field(default_factory=dict)  # TensorRecord fields beyond the values (native_type...)


class EncodedLayer(NamedTuple):
    """One 2-D layer as a codec encoded it: its tensors by suffix ("" is the weight itself, the rest
    `weight.<field>`), in the order they are written, and the float32 values they decode to."""

    tensors: dict[str, torch.Tensor]
    decoded: torch.Tensor | BitIdentical


_CODECS: dict[str, type["LayerCodec"]] = {}


class LayerCodec(ABC):
    """The codec of one UQFF layer tag; see the module docstring for each hook."""

    family: ClassVar[str]  # layout.TAG's name of the tag
    tag: ClassVar[int]  # the `weight.format` value

    def __init_subclass__(cls, family: str, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if family not in TAG:
            raise ValueError(f"{family!r} is not a UQFF layer family (layout.TAG: {', '.join(TAG)})")
        if family in _CODECS:
            raise ValueError(f"UQFF family {family!r} already has a codec ({_CODECS[family].__name__})")
        cls.family, cls.tag = family, TAG[family]
        _CODECS[family] = cls

    @classmethod
    @abstractmethod
    def describe(cls, layer: LayerView) -> LayerDescription:
        """The layer's shape, grid parameters and record fields, from its small tensors."""

    @classmethod
    @abstractmethod
    def load(cls, layer: LayerView) -> Dense | Grid:
        """The layer's values: a Grid where the tag is a grid a writer can keep, else Dense float32."""

    @classmethod
    @abstractmethod
    def encode(cls, t: UqffType, plan: TensorPlan, item: Dense | Grid) -> EncodedLayer:
        """`item` as one 2-D layer of type `t`, as `plan.action` (writer.UqffAction) decided."""

    @classmethod
    def label(cls, layer: LayerView) -> str:
        """The layer's kind in `qconvert inspect`'s count of layers."""
        return cls.family

    @classmethod
    def format_tensor(cls) -> torch.Tensor:
        """The `weight.format` tensor of a layer of this tag."""
        return u8_tensor(cls.tag)

    @classmethod
    def plain_weight_header(cls, layer: LayerView) -> tuple[str, list[int]]:
        """(dtype, shape) of a weight stored as the 2-D matrix itself (Unquant, FP8, MXFP4's nibbles),
        refused when it is not one."""
        dtype, shape = layer.header("weight")
        if len(shape) != 2 or min(shape) < 1:
            raise layer.bad(f"{cls.family} weight of shape {shape[:4]}: only 2-D layers are supported")
        return dtype, shape


def codec(family: str) -> type[LayerCodec]:
    """The registered codec of a UQFF layer family ("gguf", "afq"...)."""
    try:
        return _CODECS[family]
    except KeyError:
        raise LookupError(f"no UQFF layer codec for family {family!r} (registered: {', '.join(sorted(_CODECS))})") \
            from None


def keeps_float_codes(plan: TensorPlan, item: Dense | Grid, element: str) -> bool:
    """A float grid of the target's element format ("e4m3", "e2m1") whose codes the checker let the layer
    keep (the float-block family): FP8 and MXFP4 then store the source's codes as they are."""
    return isinstance(item, Grid) and plan.verdict in (EXACT, NEAR_EXACT) and \
        getattr(item.params, "element", None) == element


def u8_tensor(value: int) -> torch.Tensor:
    """A U8 scalar, as UQFF stores tags, bit widths and flags."""
    return torch.tensor(value, dtype=torch.uint8)


def u32_tensor(value: int | list[int]) -> torch.Tensor:
    """A U32 scalar or vector, as UQFF stores sizes, shapes and type ids."""
    return torch.tensor(value, dtype=torch.uint32)


# every tag's codec registers itself on import; the modules import the base above, hence at the end
from . import afq, f8q8, fp8, gguf, hqq, mxfp4, unquant  # noqa: E402,F401  (registration)

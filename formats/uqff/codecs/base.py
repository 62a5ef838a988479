"""The base of every UQFF layer codec (see the package docstring): `LayerCodec` and its registry, what a codec
returns (`LayerDescription`, `EncodedLayer`), the writer's decision it encodes by (`UqffAction`), the shared
float-grid codec (`FloatGridCodec`, FP8 and MXFP4) and the small tensors every tag stores."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, NamedTuple

import torch

from ....converters.checker import EXACT, NEAR_EXACT
from ....converters.plan import BitIdentical, TensorPlan
from ....converters.records import Dense, Grid, GridParams
from ...common.ggml_codec import QuantHow
from ..layout import TAG, UqffType

if TYPE_CHECKING:
    from ..layer_view import LayerView

__all__ = ["LayerCodec", "FloatGridCodec", "LayerDescription", "EncodedLayer", "UqffAction", "codec",
           "keeps_float_codes", "u8_tensor", "u32_tensor"]


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


@dataclass
class UqffAction:
    """Where and how the session stores one tensor. `where`: "residual" (residual.safetensors, as it is), "uqff"
    (a layer of UQFF type `type`), "uqff-expert" (one expert of the stacked layer `stack`) or "uqff-bias" (a
    layer's bias, beside it in the .uqff: check_model moves a residual bias there when its layer is stored).
    The rest is what the checker decided for a layer: the ggml type a GGUF-block layer stores (`ggml`, and
    `quant` when K blocks keep codes), the group of an AFQ / HQQ layer and whether its codes are kept
    (`aligned`, with HQQ's `meta_dtype` and the source layer's own `hqq_flags`)."""

    where: str
    type: str = ""
    bias_of: str | None = None  # a residual bias: the layer prefix it belongs to
    stack: str = ""  # an expert: its stacked layer, index and part ("weight" | "bias")
    expert: int | None = None
    expert_part: str = "weight"
    ggml: str = ""
    quant: QuantHow | None = None
    group_size: int | None = None
    aligned: bool = False
    meta_dtype: torch.dtype | None = None
    hqq_flags: dict = field(default_factory=dict)


_CODECS: dict[str, type["LayerCodec"]] = {}


class LayerCodec(ABC):
    """The codec of one UQFF layer tag; see the module docstring for each hook."""

    family: ClassVar[str]  # layout.TAG's name of the tag
    tag: ClassVar[int]  # the `weight.format` value

    def __init_subclass__(cls, family: str | None = None, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if family is None:  # a shared base of several tags (FloatGridCodec): registers nothing
            return
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


class FloatGridCodec(LayerCodec):
    """A tag whose weight is the 2-D matrix of float codes itself (FP8's E4M3 bytes, MXFP4's E2M1 nibbles)
    under small scale tensors: planning reads the weight's header and the scales (`grid_params`), loading
    adds the codes (`codes_of` the weight)."""

    @classmethod
    @abstractmethod
    def grid_params(cls, layer: LayerView) -> tuple[tuple[int, ...], GridParams]:
        """(shape, GridParams) from the weight's header and the scale tensors, without reading the codes."""

    @classmethod
    @abstractmethod
    def codes_of(cls, weight: torch.Tensor) -> torch.Tensor:
        """The stored weight tensor as one uint8 code per element."""

    @classmethod
    def describe(cls, layer: LayerView) -> LayerDescription:
        cls.plain_weight_header(layer)
        shape, params = cls.grid_params(layer)
        return LayerDescription(shape, "grid", params)

    @classmethod
    def load(cls, layer: LayerView) -> Grid:
        weight = layer.part("weight")  # first, as always: a file cut since planning is refused at the weight
        _, params = cls.grid_params(layer)
        return Grid(params, codes=cls.codes_of(weight))


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

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
container's view of one layer (layer_view.LayerView): its tensors' headers and values, its checked metadata
scalars, and `bad(...)`, the BadInput that names the layer's file and tensor. `describe` checks every header
and small tensor a layer has before planning goes on; the order of a codec's checks is part of its behaviour
(the first refusal is the one reported, naming its tensor), so it stays as it is.

The base classes live in base.py (FP8 and MXFP4 share `FloatGridCodec`); the writer's decision a codec encodes
by is `UqffAction`.
"""

from .base import (EncodedLayer, FloatGridCodec, LayerCodec, LayerDescription, UqffAction, codec, keeps_float_codes,
                   u8_tensor, u32_tensor)

__all__ = ["LayerCodec", "FloatGridCodec", "LayerDescription", "EncodedLayer", "UqffAction", "codec",
           "keeps_float_codes", "u8_tensor", "u32_tensor"]

# every tag's codec registers itself on import; each module imports base.py
from . import afq, f8q8, fp8, gguf, hqq, mxfp4, unquant  # noqa: E402,F401  (registration)

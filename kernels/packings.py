"""The registry of packed-code layouts: how a source's stored words become codes, by layout name.

A `PackedCodes` record (converters/records.py) names its layout; the operations on it (unpack, select output
rows, count the input features) are looked up here, so a new packing (AWQ's nibble order, HQQ's, Marlin
tiles) is one new entry, as gguf-py's codec classes register themselves per quantization type.
A layout is matched by its exact name, else by the prefix before a ':' ("ggml:Q4_K" -> "ggml").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .bitpack import unpack_rows

__all__ = ["Packing", "register_packing", "packing", "PACKINGS"]


@dataclass(frozen=True)
class Packing:
    name: str
    # words, bits -> uint8 codes [out, in]; None when the reader gives the codes unpacked alongside
    unpack: Callable[[torch.Tensor, int], torch.Tensor] | None
    take_rows: Callable[[torch.Tensor, object], torch.Tensor]  # words, index -> the words of those output rows
    in_features: Callable[[torch.Tensor, int], int]  # words, bits -> input features
    description: str = ""


PACKINGS: dict[str, Packing] = {}


def register_packing(p: Packing) -> Packing:
    if PACKINGS.get(p.name, p) is not p:
        raise ValueError(f"packing {p.name!r} is already registered")
    PACKINGS[p.name] = p
    return p


def packing(layout: str) -> Packing:
    found = PACKINGS.get(layout) or PACKINGS.get(layout.split(":", 1)[0])
    if found is None:
        raise ValueError(f"unknown packing {layout!r}; known: {', '.join(sorted(PACKINGS))}")
    return found


register_packing(Packing(
    "gptq-rows", unpack=lambda w, bits: unpack_rows(w, bits).T.contiguous(),
    take_rows=lambda w, index: w[:, index], in_features=lambda w, bits: w.shape[0] * 32 // bits,
    description="int32 [in*bits/32, out]: codes LSB-first along the input features (GPTQ qweight)"))
def _ggml_in_features(words: torch.Tensor, bits: int) -> int:
    raise ValueError("ggml blocks do not say their row length without their type; the grid's codes do")


register_packing(Packing(
    "ggml", unpack=None, take_rows=lambda w, index: w[index], in_features=_ggml_in_features,
    description="uint8 [out, row_bytes]: a row's ggml blocks as stored (ggml:<TYPE>); the codes come unpacked "
                "alongside, and a writer of the same type copies the bytes"))

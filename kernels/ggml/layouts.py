"""The one table of per-type layout facts for ggml (GGUF) tensor types.

Everything that asks "what does a Q4_1 block hold?" reads it from here: the GGUF writer and reader,
the alignment checker and the codecs. Block sizes, bytes per block and type ids come from gguf-py
(`GGML_QUANT_SIZES`, `GGMLQuantizationType`: llama.cpp's own Python package); the code layout (bits,
offset, min) follows the block structs of ggml-common.h.

A block of `block` consecutive elements along a row (ggml ne0 = HF in_features) takes `nbytes` bytes.
Legacy types decode as `d * (q - offset)` (symmetric) or `d * q + m` (`has_min`), with one fp16 `d`
(and `m`) per block, codes `0 .. 2**bits - 1` (Q8_0: signed int8, offset 0).
K types hold 256-element super-blocks with 6- or 8-bit sub-block scales.
Codebook types hold 4-bit codes indexing a fixed table of values, no uniform grid: IQ4_NL 32-blocks of
fp16 `d`, `d * table[q]` (kernels/ggml/iq4_nl.py); IQ4_XS 256-element super-blocks whose 32-element sub-blocks
(`sub_block`) scale by `d * (ls - 32)`, ls a 6-bit code (kernels/ggml/iq4_xs.py); IQ3_S the same super-blocks whose
groups of 4 values index a 512-point lattice, signs apart, under `d * (1 + 2*s)` (kernels/ggml/iq3_s.py; `bits` 3
is the lattice's per coordinate, the type takes 3.44 bits per weight); IQ2_S groups of 8 on a 1024-point lattice
of 2-bit coordinates under 16-block scales, IQ2_XS on a 512-point one, IQ2_XXS on a 256-point one under 32-block
scales (kernels/ggml/iq2.py), IQ3_XXS groups of 4 on a 256-point lattice (kernels/ggml/iq3_s.py). They are writable targets
(TARGET_LAYOUTS) but not in LAYOUTS, the table of grid types that readers decode into GridParams (a codebook
block is not `d * (q - offset)`; the GGUF reader reads such tensors as dense float32 through gguf-py).
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = ["BlockLayout", "LAYOUTS", "layout", "FLOAT_TYPES", "LEGACY_TYPES", "K_TYPES", "CODEBOOK_LAYOUTS",
           "CODEBOOK_TYPES", "FP4_LAYOUTS", "FP4_TYPES", "LOWBIT_LAYOUTS", "LOWBIT_TYPES", "Q2_0_PRISM",
           "IQ1_LAYOUTS", "TARGET_LAYOUTS", "GGUF_PY_UNKNOWN"]


@dataclass(frozen=True)
class BlockLayout:
    name: str  # llama.cpp's spelling: "Q4_0", "F16"
    ggml_type: int  # gguf.GGMLQuantizationType value
    block: int  # elements per block (1 for float types)
    nbytes: int  # bytes per block
    bits: int  # bits per code (float types: bits per element)
    offset: int = 0  # legacy symmetric types: value = d * (q - offset)
    has_min: bool = False  # legacy asymmetric types: value = d * q + m
    kind: str = "legacy"  # "float" | "legacy" | "k" | "codebook" | "fp4" | "lowbit"
    sub_block: int = 0  # K types, IQ4_XS, the IQ2/IQ3 types: elements sharing one sub-block scale
    signed_codes: bool = False  # Q8_0 stores int8 codes

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes / self.block

    @property
    def code_max(self) -> int:
        return (1 << self.bits) - 1

    def row_bytes(self, n: int) -> int:
        if n % self.block:
            raise ValueError(f"row of {n} elements is not a multiple of {self.name}'s block of {self.block}")
        return n // self.block * self.nbytes


def _ggml(name: str, bits: int, **kw) -> BlockLayout:
    """A layout whose type id, block size and block bytes are gguf-py's."""
    qtype = GGMLQuantizationType[name]
    block, nbytes = GGML_QUANT_SIZES[qtype]
    return BlockLayout(name, int(qtype), block, nbytes, bits, **kw)


_TABLE = (
    _ggml("F32", 32, kind="float"),
    _ggml("F16", 16, kind="float"),
    _ggml("BF16", 16, kind="float"),
    _ggml("Q4_0", 4, offset=8),
    _ggml("Q4_1", 4, has_min=True),
    _ggml("Q5_0", 5, offset=16),
    _ggml("Q5_1", 5, has_min=True),
    _ggml("Q8_0", 8, signed_codes=True),
    _ggml("Q2_K", 2, has_min=True, kind="k", sub_block=16),
    _ggml("Q3_K", 3, offset=4, kind="k", sub_block=16),
    _ggml("Q4_K", 4, has_min=True, kind="k", sub_block=32),
    _ggml("Q5_K", 5, has_min=True, kind="k", sub_block=32),
    _ggml("Q6_K", 6, offset=32, kind="k", sub_block=16),
)

LAYOUTS: dict[str, BlockLayout] = {t.name: t for t in _TABLE}
FLOAT_TYPES = tuple(t.name for t in _TABLE if t.kind == "float")
LEGACY_TYPES = tuple(t.name for t in _TABLE if t.kind == "legacy")
K_TYPES = tuple(t.name for t in _TABLE if t.kind == "k")

# nibbles indexing kvalues_iq4nl (ggml-common.h): IQ4_NL 32-blocks of fp16 d + 16 bytes of codes; IQ4_XS
# 256-element super-blocks of fp16 d, eight 6-bit sub-block scales (scales_h, scales_l) and 128 bytes of codes.
# Lattice codebooks (kernels/ggml/iq_lattice.py): IQ3_S 256-element super-blocks of fp16 d, a 9-bit grid index per
# group of 4 (qs, qh), a sign bit per value and a 4-bit scale per 32-block (block_iq3_s, kernels/ggml/iq3_s.py); IQ2_S
# the same with a 10-bit index per group of 8 and a 4-bit scale per 16-block (block_iq2_s, kernels/ggml/iq2.py); IQ2_XS
# a uint16 per group of 8 (9-bit index, 7 sign bits: even parity) and 4-bit scales of 16-blocks (block_iq2_xs);
# IQ3_XXS an 8-bit index per group of 4 and a uint32 of signs and 4-bit scale per 32-block (block_iq3_xxs); IQ2_XXS
# per 32-block a uint32 of four 8-bit indices (groups of 8) and one of four 7-bit signs and the scale (block_iq2_xxs)
_CODEBOOK_TABLE = (_ggml("IQ4_NL", 4, kind="codebook"), _ggml("IQ4_XS", 4, kind="codebook", sub_block=32),
                   _ggml("IQ3_S", 3, kind="codebook", sub_block=32), _ggml("IQ2_S", 2, kind="codebook", sub_block=16),
                   _ggml("IQ2_XS", 2, kind="codebook", sub_block=16),
                   _ggml("IQ3_XXS", 3, kind="codebook", sub_block=32),
                   _ggml("IQ2_XXS", 2, kind="codebook", sub_block=32),
                   # IQ1_S / IQ1_M (IQ1_LAYOUTS below): 3-level values on the 2048-point grid (kernels/ggml/iq1.py)
                   _ggml("IQ1_S", 1, kind="codebook", sub_block=32), _ggml("IQ1_M", 1, kind="codebook", sub_block=16))
CODEBOOK_LAYOUTS: dict[str, BlockLayout] = {t.name: t for t in _CODEBOOK_TABLE}
CODEBOOK_TYPES = tuple(CODEBOOK_LAYOUTS)
# FP4 float blocks: E2M1 codes times a block scale (kernels/floatq.py). MXFP4 32-blocks of an E8M0 exponent and
# 16 bytes of nibbles (block_mxfp4); NVFP4 64-blocks of four UE4M3 sub-block scales (`sub_block` 16) and 32 bytes
# (block_nvfp4), with a per-tensor float32 `.scale` tensor beside the weight when the source has a global scale
FP4_LAYOUTS: dict[str, BlockLayout] = {t.name: t for t in (_ggml("MXFP4", 4, kind="fp4"),
                                                           _ggml("NVFP4", 4, kind="fp4", sub_block=16))}
FP4_TYPES = tuple(FP4_LAYOUTS)
# The 1- and 2-bit types (kernels/ggml/lowbit.py): one fp16 `d` per block and 2-bit grid codes, w = d * (q - z).
# Q1_0 128-blocks of signs (ggml 41), Q2_0 64-blocks of 2-bit codes (ggml 42, which gguf 0.19 does not know: its
# facts are ggml-common.h's, QK2_0 64, 2 + 16 bytes), TQ1_0 / TQ2_0 the ternary 256-blocks (ggml 34, 35).
# `bits` is the grid's code width (2 for all: Q1_0's signs are the codes 1 and 3 around the zero point 2).
LOWBIT_LAYOUTS: dict[str, BlockLayout] = {t.name: t for t in (
    _ggml("Q1_0", 2, kind="lowbit"), BlockLayout("Q2_0", 42, 64, 18, 2, kind="lowbit"),
    _ggml("TQ1_0", 2, kind="lowbit"), _ggml("TQ2_0", 2, kind="lowbit"))}
LOWBIT_TYPES = tuple(LOWBIT_LAYOUTS)
# PrismML's llama.cpp fork writes 128-value Q2_0 blocks (fp16 d + 32 bytes) under the same type id 42: read only,
# told apart by the tensor's byte size (kernels/ggml/lowbit.py q2_0_layout_for_size)
Q2_0_PRISM = BlockLayout("Q2_0", 42, 128, 34, 2, kind="lowbit")
# IQ1_S (ggml 19: fp16 d, 32 bytes of grid index lows, 8 uint16 of index highs, 3-bit scale and delta sign per
# 32-block) and IQ1_M (ggml 29: no d field, the fp16 scale spread over the top nibbles of its four uint16 scales),
# 256-blocks on ggml's 2048-point iq1s grid plus a +-0.125 delta: codebook types, read as gguf-py decodes them and
# written by kernels/ggml/iq1.py (ggml's quantize_iq1_s / _iq1_m bytes)
IQ1_LAYOUTS: dict[str, BlockLayout] = {t: CODEBOOK_LAYOUTS[t] for t in ("IQ1_S", "IQ1_M")}
# ggml types this llama.cpp has that gguf 0.19's GGMLQuantizationType lacks: type id -> layout
GGUF_PY_UNKNOWN: dict[int, BlockLayout] = {42: LOWBIT_LAYOUTS["Q2_0"]}
# every type a writer can store: the grid types, the codebook types, the FP4 float-block types and the 1-2-bit types
TARGET_LAYOUTS: dict[str, BlockLayout] = {**LAYOUTS, **CODEBOOK_LAYOUTS, **FP4_LAYOUTS, **LOWBIT_LAYOUTS}


def layout(name: str) -> BlockLayout:
    key = name.upper()
    if key not in TARGET_LAYOUTS:
        raise KeyError(f"unknown ggml type {name!r}; known: {', '.join(TARGET_LAYOUTS)}")
    return TARGET_LAYOUTS[key]

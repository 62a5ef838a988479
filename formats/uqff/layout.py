"""UQFF 1.x facts in one place: the versions, the layer tags and their suffix sets, the ggml type ids of
GGUF-block layers, and THE table of the types a layer can be written as (mistral.rs' ISQ names).

A UQFF layer `<key>` is a group of safetensors tensors `<key>.weight`, `<key>.weight.format` (U8 scalar:
the family tag) and family-specific `<key>.weight.<field>` metadata (mistralrs-quant/src/uqff/ in mistral.rs):

  tag 0 GGUF blocks   ggml block bytes [rows * row_bytes] + ggml type id + torch-order shape
  tag 1 Unquant       a plain float tensor
  tag 2 HQQ           HQQ axis-0 groups, 4-bit "two halves" / 8-bit packing, (q - zero) * scale
  tag 3 FP8           per-tensor scaled F8E4M3: w = fp8 * dequant_w_scale
  tag 4 AFQ           MLX affine: LSB-first u32 bit stream per row, w = scale * q + bias
  tag 5 F8Q8          33-byte blocks of 32 flattened elements: fp8 d, int8 qs, w = qs * (d / 416)
  tag 6 MXFP4         FP4 E2M1 nibbles (low nibble first) * 2^(e8m0 - 127), blocks of 32 along a row

How each tag is read, written and packed, as mistral.rs 0.9.5 computes it on a CPU, is its codec's
(codecs/<family>.py); what more than one module needs is here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

__all__ = ["TAG", "FAMILY_OF_TAG", "SUFFIXES", "GGML_TYPE_IDS", "GGML_NAME_OF_ID", "UqffType", "UQFF_TYPES",
           "READER_MINOR", "MAJOR", "K_FALLBACK", "AFQ_GROUPS", "AFQ_BITS"]

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
# ggml type ids used in `weight.dtype` of tag 0 (names as kernels.ggml.layouts spells them)
# the ggml types a UQFF GGUF-block layer may hold, with gguf-py's type ids
GGML_TYPE_IDS = {name: int(GGMLQuantizationType[name]) for name in (
    "F32", "F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K",
    "BF16")}
GGML_NAME_OF_ID = {v: k for k, v in GGML_TYPE_IDS.items()}


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

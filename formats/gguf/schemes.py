"""The GGUF target types: one table of schemes, and llama-quantize's rules as small hooks beside it.

Every writable ggml type is a `TargetScheme` built from kernels.ggml_layouts (whose sizes are gguf-py's);
the alignment checker (converters/align.py) decides every verdict from these. The codebook types (IQ4_NL:
codes index a fixed non-linear table) are a family of their own, "ggml-codebook", registered here: no
grid keeps its codes in them, so every source is requantized (kernels/iq4_nl.py, ggml's quantize_iq4_nl).
"""

from __future__ import annotations

from ...converters.align import REFUSED, REQUANTIZE, Decision, TargetScheme, ggml_scheme, register_family
from ...converters.records import GridParams
from ...kernels.ggml_layouts import CODEBOOK_LAYOUTS, LAYOUTS, TARGET_LAYOUTS

__all__ = ["GGUF_SCHEMES", "ALIGNED_CANDIDATES", "default_grid_type", "k_fallback"]

CODEBOOK_FAMILY = "ggml-codebook"


def check_ggml_codebook(src, shape, s: TargetScheme, native, prefer_groups=()) -> Decision:
    """A ggml codebook type (IQ4_NL: fp16 d per 32-block times one of 16 fixed int8 values): every source
    is dequantized and quantized with ggml's IQ4_NL quantizer. A grid's codes never stay: s * (q - z) steps
    are uniform, the table's are not (a Q4_0-like grid included). An IQ4_NL GGUF source is read as dense
    float32 (the GGUF reader's grids are LAYOUTS only), so there is no byte copy either.
    (A bitsandbytes codebook grid never gets here: align.check decides it, naming IQ4_NL's codebook.)"""
    if shape[-1] % s.block:
        return Decision(REFUSED, f"rows of {shape[-1]} are not a whole number of {s.name} blocks of {s.block}")
    if isinstance(src, GridParams):
        return Decision(REQUANTIZE, f"{s.name} codes index a non-linear 16-value table; the grid's uniform "
                                    f"codes s*(q - z) are not its values, so the dequantized weights are "
                                    f"quantized again with ggml's {s.name} quantizer")
    return Decision(REQUANTIZE, f"dense {src} weights quantized with ggml's {s.name} quantizer")


register_family(CODEBOOK_FAMILY, check_ggml_codebook)


def codebook_scheme(name: str) -> TargetScheme:
    """A ggml codebook type as a target: one fp16 scale per block, 4-bit codes into a fixed table."""
    lay = CODEBOOK_LAYOUTS[name]
    return TargetScheme(name, CODEBOOK_FAMILY, bits=lay.bits, group=lay.block, block=lay.block, zero="none",
                        scale="fp16", ggml_type=lay.ggml_type, block_bytes=lay.nbytes)


GGUF_SCHEMES: dict[str, TargetScheme] = {**{name: ggml_scheme(name) for name in LAYOUTS},
                                         **{name: codebook_scheme(name) for name in CODEBOOK_LAYOUTS}}
# aligned candidates, cheapest first: the checker's first exact (else near-exact) one is the suggestion
ALIGNED_CANDIDATES = tuple(GGUF_SCHEMES[t] for t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "F32"))
# llama-quantize's fallback when a row is not a whole number of 256-element K blocks (llama-quant.cpp:414-418); for
# a grid the variant with a block min is taken when the grid's zero points are not the symmetric mid code
_K_FALLBACK = {"Q2_K": ("Q4_0", "Q4_1"), "Q3_K": ("Q4_0", "Q4_1"), "Q4_K": ("Q5_0", "Q5_1"),
               "Q5_K": ("Q5_1", "Q5_1"), "Q6_K": ("Q8_0", "Q8_0")}


def default_grid_type(p) -> str:
    """The type whose bit width matches the source grid; whether it aligns is the checker's job."""
    if p.bits == 4:
        return "Q4_0" if p.symmetric else "Q4_1"
    if p.bits == 8:
        return "Q8_0"
    if p.bits == 3:
        return "Q3_K"
    if p.bits <= 2:
        return "Q2_K"
    return "Q5_K" if p.bits == 5 else "Q6_K"


def k_fallback(target: str, shape, params) -> tuple[str, str]:
    """llama-quantize's tensor_type_fallback (llama-quant.cpp:390) for a row (HF shape[-1] = ggml ne[0], for
    2-D and 3-D expert tensors alike) that is not a whole number of the target's blocks: a K type takes its
    legacy 32-block type, and where that (or a legacy target itself) does not fit either, F16.
    -> (the type used, a note for the reason)."""
    lay = TARGET_LAYOUTS[target]
    n = int(shape[-1])
    if lay.kind == "float" or n % lay.block == 0:
        return target, ""
    chosen = target  # a 32-block type (legacy or IQ4_NL) has no smaller block to demote to
    if lay.kind == "k":
        symmetric_choice, with_min = _K_FALLBACK[target]
        chosen = symmetric_choice if params is None or params.symmetric else with_min
    if n % TARGET_LAYOUTS[chosen].block:
        chosen = "F16"  # "must use F16 due to unusual shape"
    return chosen, f"{target} needs rows of {lay.block} (these have {n}), fallback {chosen}: "

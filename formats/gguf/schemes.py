"""The GGUF target types: one table of schemes, and llama-quantize's rules as small hooks beside it.

Every writable ggml type is a `TargetScheme` built from kernels.ggml_layouts (whose sizes are gguf-py's);
the alignment checker (converters/align.py) decides every verdict from these.
"""

from __future__ import annotations

from ...converters.align import TargetScheme, ggml_scheme
from ...kernels.ggml_layouts import LAYOUTS

__all__ = ["GGUF_SCHEMES", "ALIGNED_CANDIDATES", "default_grid_type", "k_fallback"]

GGUF_SCHEMES: dict[str, TargetScheme] = {name: ggml_scheme(name) for name in LAYOUTS}
# aligned candidates, cheapest first: the checker's first exact (else near-exact) one is the suggestion
ALIGNED_CANDIDATES = tuple(GGUF_SCHEMES[t] for t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "F32"))
# llama-quantize's fallback when a row is not a whole number of 256-element K blocks (llama-quant.cpp); for
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
    """Swap a K type for llama-quantize's legacy fallback when the rows do not fill 256-blocks:
    (the type used, a note for the reason)."""
    lay = LAYOUTS[target]
    if lay.kind != "k" or shape[-1] % lay.block == 0:
        return target, ""
    symmetric_choice, with_min = _K_FALLBACK[target]
    chosen = symmetric_choice if params is None or params.symmetric else with_min
    return chosen, f"{target} needs rows of {lay.block} (these have {shape[-1]}), fallback {chosen}: "

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
    lay = LAYOUTS[target]
    n = int(shape[-1])
    if lay.kind == "float" or n % lay.block == 0:
        return target, ""
    chosen = target  # a 32-block type has no smaller block to demote to
    if lay.kind == "k":
        symmetric_choice, with_min = _K_FALLBACK[target]
        chosen = symmetric_choice if params is None or params.symmetric else with_min
    if n % LAYOUTS[chosen].block:
        chosen = "F16"  # "must use F16 due to unusual shape"
    return chosen, f"{target} needs rows of {lay.block} (these have {n}), fallback {chosen}: "

"""The GGUF target types: one table of schemes, and llama-quantize's rules as small hooks beside it.

Every writable ggml type is a `TargetScheme` built from kernels.ggml.layouts (whose sizes are gguf-py's);
the alignment checker (converters/checker.py) decides every verdict from these. The codebook types (IQ4_NL,
IQ4_XS: codes index a fixed non-linear table; IQ3_S, IQ3_XXS, IQ2_S, IQ2_XS, IQ2_XXS: groups of 4 / 8 index a
lattice codebook) are a family of their own, "ggml-codebook", registered here: no grid keeps its codes in them, so
every source is requantized (kernels/ggml/iq4_nl.py, iq4_xs.py, iq3_s.py, iq2.py: ggml's quantize_iq4_nl / _iq4_xs /
_iq3_s / _iq3_xxs / _iq2_s / _iq2_xs / _iq2_xxs). The IQ2 types and IQ3_XXS need an importance matrix
(imatrix_refusal). The 1- and 2-bit types Q1_0, Q2_0, TQ1_0 and TQ2_0 are the "ggml-lowbit" family, also registered
here: a source of the very type copies its blocks, every other is quantized with ggml's reference quantizer
(kernels/ggml/lowbit.py, kquant_c.c).
"""

from __future__ import annotations

from ...converters.checker import EXACT, NEAR_EXACT, REFUSED, REQUANTIZE, Decision, TargetScheme, check, register_family
from ...converters.records import GridParams
from ...kernels.ggml.layouts import CODEBOOK_LAYOUTS, FP4_LAYOUTS, LAYOUTS, LOWBIT_LAYOUTS, TARGET_LAYOUTS
from ..common.block_schemes import ggml_scheme

__all__ = ["GGUF_SCHEMES", "ALIGNED_CANDIDATES", "default_grid_type", "k_fallback", "imatrix_refusal"]

CODEBOOK_FAMILY = "ggml-codebook"


def check_ggml_codebook(src, shape, s: TargetScheme, native, prefer_groups=()) -> Decision:
    """A ggml codebook type (IQ4_NL: fp16 d per 32-block times one of 16 fixed int8 values; IQ4_XS: the
    same table under 6-bit scales of 32-element sub-blocks in 256-element super-blocks; IQ3_S, IQ3_XXS, IQ2_S,
    IQ2_XS, IQ2_XXS: groups of 4 or 8 values on a lattice of 256 to 1024 points, signs apart, under 4-bit
    block scales): every source is dequantized and quantized with ggml's quantizer for the type. A grid's
    codes never stay: s * (q - z) steps are uniform, the table's (and the lattice's) are not (a Q4_0-like grid
    included). The one exception is a GGUF source of this very type (native: the GGUF reader reads it as dense
    float32 and carries its block bytes), whose blocks are copied. (A bitsandbytes codebook grid never gets
    here: align.check decides it, naming IQ4_NL's codebook.)"""
    if native == s.name:
        return Decision(EXACT, f"{s.name} blocks copied byte for byte", copied=True, keeps_codes=True)
    if shape[-1] % s.block:
        if s.block != s.group:  # IQ4_XS: the GGUF writer never asks this, k_fallback demotes such rows first
            return Decision(REFUSED, f"rows of {shape[-1]} are not a whole number of {s.name} super-blocks of "
                                     f"{s.block} (llama-quantize falls back to {_CODEBOOK_FALLBACK[s.name]})")
        return Decision(REFUSED, f"rows of {shape[-1]} are not a whole number of {s.name} blocks of {s.block}")
    if isinstance(src, GridParams):
        return Decision(REQUANTIZE, f"{s.name} codes index {_CODEBOOK_VALUES[s.name]}; the grid's uniform "
                                    f"codes s*(q - z) are not its values, so the dequantized weights are "
                                    f"quantized again with ggml's {s.name} quantizer")
    return Decision(REQUANTIZE, f"dense {src} weights quantized with ggml's {s.name} quantizer")


register_family(CODEBOOK_FAMILY, check_ggml_codebook)


def codebook_scheme(name: str) -> TargetScheme:
    """A ggml codebook type as a target, codes into a fixed table: IQ4_NL one fp16 scale per 32-block, IQ4_XS
    6-bit sub-block scales under an fp16 super-block scale (as the K types: group 32, block 256), IQ3_S 4-bit
    ones (group 32, IQ3_XXS and IQ2_XXS too), IQ2_S and IQ2_XS 4-bit ones of 16-blocks."""
    lay = CODEBOOK_LAYOUTS[name]
    # the IQ2/IQ3 types: 4-bit, the IQ1 types 3-bit
    scale = "fp16" if not lay.sub_block else "k6" if name == "IQ4_XS" else "k3" if name.startswith("IQ1") else "k4"
    return TargetScheme(name, CODEBOOK_FAMILY, bits=lay.bits, group=lay.sub_block or lay.block, block=lay.block,
                        zero="none", scale=scale, ggml_type=lay.ggml_type, block_bytes=lay.nbytes)


LOWBIT_FAMILY = "ggml-lowbit"
# what each 1-2-bit type stores, for the checker's reasons (ggml-quants.c quantize_row_*_ref)
_LOWBIT_VALUES = {"Q1_0": "the sign of each weight times the block's mean |w| (fp16)",
                  "Q2_0": "round(w / amax) in {-1, 0, 1} times the block's amax (fp16)",
                  "TQ1_0": "round(w / amax) in {-1, 0, 1} times the block's amax (fp16), five trits a byte",
                  "TQ2_0": "round(w / amax) in {-1, 0, 1} times the block's amax (fp16), 2-bit codes"}


def check_ggml_lowbit(src, shape, s: TargetScheme, native, prefer_groups=()) -> Decision:
    """A ggml 1-2-bit type (Q1_0, Q2_0, TQ1_0, TQ2_0): a GGUF source of this very type copies its blocks; every other
    source is dequantized and quantized with ggml's reference quantizer, whose scale is a statistic of the block
    (mean |w| or amax), not a free one: a grid's codes stay only when its scale is that statistic, which no other
    format's producer guarantees."""
    if native == s.name:
        return Decision(EXACT, f"{s.name} blocks copied byte for byte", copied=True, keeps_codes=True)
    if shape[-1] % s.block:
        return Decision(REFUSED, f"rows of {shape[-1]} are not a whole number of {s.name} blocks of {s.block}")
    what = "grid" if isinstance(src, GridParams) else f"dense {src}"
    return Decision(REQUANTIZE, f"{what} weights quantized with ggml's {s.name} quantizer: {_LOWBIT_VALUES[s.name]}")


register_family(LOWBIT_FAMILY, check_ggml_lowbit)


def lowbit_scheme(name: str) -> TargetScheme:
    """A ggml 1-2-bit type as a target: one fp16 scale per block, 2-bit grid codes (kernels/ggml/lowbit.py)."""
    lay = LOWBIT_LAYOUTS[name]
    return TargetScheme(name, LOWBIT_FAMILY, bits=lay.bits, group=lay.block, block=lay.block, zero="none",
                        scale="fp16", ggml_type=lay.ggml_type, block_bytes=lay.nbytes)


def fp4_scheme(name: str) -> TargetScheme:
    """A ggml FP4 float-block type (the "float-block" family, formats/common/block_schemes.py): E2M1 codes times a block scale.
    MXFP4: an E8M0 exponent per 32 elements. NVFP4: a UE4M3 scale per 16 (in 64-element blocks), and llama.cpp
    multiplies a matmul's result by the weight's `<name>.scale` tensor when the file has one (llama-model.cpp's
    generic pass loads every `.scale`; llama-graph.cpp build_lora_mm), which is where a global scale goes."""
    lay = FP4_LAYOUTS[name]
    nvfp4 = name == "NVFP4"
    return TargetScheme(name, "float-block", bits=4, group=lay.sub_block or lay.block, block=lay.block,
                        scale="ue4m3" if nvfp4 else "e8m0", ggml_type=lay.ggml_type, block_bytes=lay.nbytes,
                        element="e2m1", tensor_scale="post" if nvfp4 else "")


GGUF_SCHEMES: dict[str, TargetScheme] = {**{name: ggml_scheme(name) for name in LAYOUTS},
                                         **{name: codebook_scheme(name) for name in CODEBOOK_LAYOUTS},
                                         **{name: fp4_scheme(name) for name in FP4_LAYOUTS},
                                         **{name: lowbit_scheme(name) for name in LOWBIT_LAYOUTS}}
# aligned candidates, cheapest first: the checker's first exact (else near-exact) one is the suggestion
ALIGNED_CANDIDATES = tuple(GGUF_SCHEMES[t] for t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4", "NVFP4",
                                                     "F16", "F32"))
# llama-quantize's fallback when a row is not a whole number of 256-element K blocks (llama-quant.cpp:414-418); for
# a grid the variant with a block min is taken when the grid's zero points are not the symmetric mid code
_K_FALLBACK = {"Q2_K": ("Q4_0", "Q4_1"), "Q3_K": ("Q4_0", "Q4_1"), "Q4_K": ("Q5_0", "Q5_1"),
               "Q5_K": ("Q5_1", "Q5_1"), "Q6_K": ("Q8_0", "Q8_0")}
# the same for the 256-element codebook types (llama-quant.cpp:402-410: the IQ1/IQ2/IQ3 types and IQ4_XS ->
# IQ4_NL, whatever the source)
_CODEBOOK_FALLBACK = {t: "IQ4_NL" for t in ("IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_S",
                                              "IQ1_M")}
# the 1-2-bit types' (llama-quant.cpp:411-415): Q2_0, TQ1_0, TQ2_0 -> Q4_0; Q1_0 has none (llama-quantize stops:
# "no tensor type fallback is defined for type q1_0"), so its plan is refused
_LOWBIT_FALLBACK = {"Q2_0": "Q4_0", "TQ1_0": "Q4_0", "TQ2_0": "Q4_0"}
# what a codebook type's codes index, for the checker's reasons
_CODEBOOK_VALUES = {"IQ4_NL": "a non-linear 16-value table", "IQ4_XS": "a non-linear 16-value table",
                    "IQ3_S": "a 512-point lattice of 4-value groups with signs apart",
                    "IQ2_S": "a 1024-point lattice of 8-value groups with signs apart",
                    "IQ2_XS": "a 512-point lattice of 8-value groups with even-parity signs",
                    "IQ3_XXS": "a 256-point lattice of 4-value groups with even-parity signs",
                    "IQ2_XXS": "a 256-point lattice of 8-value groups with even-parity signs",
                    "IQ1_S": "a 2048-point grid of 8-value groups of -1, 0, +1 shifted by +-0.125 per block",
                    "IQ1_M": "a 2048-point grid of 8-value groups of -1, 0, +1 shifted by +-0.125 per group"}
# llama-quant.cpp tensor_requires_imatrix: the types llama-quantize refuses to make without an importance matrix
# (but for token_embd / per_layer_token_embd / output), "this quantization requires an imatrix!"
_IMATRIX_REQUIRED = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ1_S", "IQ1_M")
# the types whose ggml quantizer asserts the weights (GGML_ASSERT(quant_weights)): no tensor is exempt
_WEIGHTS_ASSERTED = ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ1_M")


def imatrix_refusal(target: str, out_name: str, has_imatrix: bool) -> str | None:
    """llama-quantize's rule for the very low-bit types: a tensor planned for one of them, other than the
    embeddings and the output, needs its importance vector (--imatrix); those two too where ggml's quantizer
    itself asserts one (IQ2_XS, IQ2_XXS). -> the refusal's reason, or None."""
    if has_imatrix or target not in _IMATRIX_REQUIRED:
        return None
    if out_name in ("token_embd.weight", "per_layer_token_embd.weight", "output.weight"):
        if target not in _WEIGHTS_ASSERTED:
            return None
        return f"{target} needs an importance matrix (--imatrix with an entry for this tensor): ggml's quantizer " \
               f"asserts one"
    return f"{target} needs an importance matrix (--imatrix with an entry for this tensor), as llama-quantize does"


def default_grid_type(p) -> str:
    """The type whose bit width matches the source grid; whether it aligns is the checker's job. A float grid
    of E2M1 codes goes to the FP4 type its scales fit (MXFP4's exponents, else NVFP4); FP8 has no ggml type
    and goes to Q8_0 (requantized; the refusal proposes F16, which holds the values near-exactly)."""
    if getattr(p, "element", None) == "e2m1":
        shape = (p.scales.shape[0], p.group_size * p.n_groups)
        fits_mxfp4 = check(p, shape, GGUF_SCHEMES["MXFP4"]).verdict in (EXACT, NEAR_EXACT)
        return "MXFP4" if fits_mxfp4 else "NVFP4"
    if getattr(p, "element", None) in ("e4m3", "e5m2"):
        return "Q8_0"
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
    legacy 32-block type, IQ4_XS and the IQ2/IQ3 types take IQ4_NL, and where that (or a 32-block target) does not fit
    either, F16. -> (the type used, a note for the reason)."""
    lay = TARGET_LAYOUTS[target]
    n = int(shape[-1])
    if lay.kind == "float" or n % lay.block == 0:
        return target, ""
    if lay.kind == "lowbit" and target not in _LOWBIT_FALLBACK:
        return target, ""  # Q1_0: no fallback in llama-quantize; the checker refuses the rows
    chosen = _CODEBOOK_FALLBACK.get(target, _LOWBIT_FALLBACK.get(target, target))  # a 32-block type has none smaller
    if lay.kind == "k":
        symmetric_choice, with_min = _K_FALLBACK[target]
        # a float grid (MXFP4, NVFP4, FP8: codes index a table, no zero point) is requantized from its values,
        # as llama-quantize's fallback does (Q5_0 for Q4_K); an asymmetric integer grid keeps its codes with a min
        chosen = symmetric_choice if params is None or params.symmetric or params.codebook is not None else with_min
    if n % TARGET_LAYOUTS[chosen].block:
        chosen = "F16"  # "must use F16 due to unusual shape"
    return chosen, f"{target} needs rows of {lay.block} (these have {n}), fallback {chosen}: "

"""The alignment contract: can a target type hold a source tensor, and at what cost? Decided here only.

Verdicts, per tensor:
- `exact`: the target decodes to the source dequantization bit for bit (float32).
- `near-exact`: the codes are kept; only stored float values round once to the target's float format
  (Q4_1's fp16 min, an fp16 copy of float weights). The report gives the measured error.
- `requantize`: the target grid cannot hold the source grid (bit width, group size, act-order scatter,
  zero points); the tensor is dequantized and quantized again with the target format's own quantizer.
  Lossy, allowed only with --allow-requant; the report gives the measured error.
- `refused`: the target cannot hold the tensor at all (a row that is not a whole number of blocks).

Every writable type of every format is a `TargetScheme` (data, declared once in its format's table:
formats/gguf/schemes.py, formats/uqff/schemes.py, formats/gptq/schemes.py...). `check(source, shape, scheme)` returns
a `Decision` (verdict, reason, how many blocks keep their codes, the facts a writer needs to keep them);
`best_aligned(source, shape, schemes)` is the one search for the cheapest scheme that holds a grid.
Writers read Decisions, never reason text; their quirks (llama-quantize's K fallback, mistral.rs'
dtype rule) are small hooks beside their tables.

How a scheme is read is its family's handler. The core knows one family, `float` (F32 / F16 / BF16 targets);
every other family is registered by the format that owns it with `register_family` (formats/common/
block_schemes.py: `ggml` and `float-block`, which GGUF and UQFF share; gptq, qqq, hqq, mlx, compressed-tensors
and UQFF's own), so this module knows no format.

Decisions come from the data that the source carries (zero points, act-order index, scales), not only
from its config: an act-order index whose 32-blocks each fall inside one group still aligns.

Two source kinds are decided once in check(), before or after the family handler: a codebook grid
(bitsandbytes NF4/FP4: table values, not s * (q - z)) is requantized by every target that stores integer
codes, with the reason saying so; a grid with two-step scales (bitsandbytes LLM.int8) is never `exact` in a
target that stores one scale (at best `near-exact`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Union

import torch

from .records import GridParams, describe_grid

__all__ = ["EXACT", "NEAR_EXACT", "REQUANTIZE", "REFUSED", "VERDICTS", "Verdict", "Decision", "TargetScheme",
           "families", "check", "decide", "best_aligned", "register_family", "float_scheme", "check_dense_to_float",
           "check_grid_to_float", "fp16_exact", "describe_grid", "Source"]


class Verdict:
    """The four verdicts, as plans, reports and their JSON carry them (plain strings, best first)."""

    EXACT = "exact"
    NEAR_EXACT = "near-exact"
    REQUANTIZE = "requantize"
    REFUSED = "refused"
    ALL = (EXACT, NEAR_EXACT, REQUANTIZE, REFUSED)


EXACT, NEAR_EXACT, REQUANTIZE, REFUSED = Verdict.ALL
VERDICTS = Verdict.ALL

_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(frozen=True)
class TargetScheme:
    """One writable target type, as data. `name` is the type as its format spells it ("Q4_0", "afq4").

    zero: "none" (symmetric: codes decode as d * (q - offset)), "int" (an integer zero point per group),
          "min" (a float block min: d * q + m), "float" (HQQ's float zero point).
    scale: how scales are stored: "fp16", "bf16", "fp32", "k6" (6-bit sub-block scales under an fp16
           super-scale), "k8" (8-bit, Q6_K), "source" (in the source's own dtype), "e8m0", "e4m3"...
    group: elements sharing one scale along a row (0: the target keeps the source's group size;
           for K types the sub-block); block: elements per stored block (ggml: 32 or 256).
    """

    name: str
    family: str
    bits: int = 0  # bits per code (0: the source's); float targets: bits per element
    group: int = 0
    block: int = 0
    zero: str = "none"
    scale: str = "fp16"
    offset: int = 0  # symmetric codes decode as d * (q - offset)
    signed: bool = False  # codes stored as signed integers (Q8_0's int8)
    axis: int = 1  # 1: groups along the input features; 0: HQQ's strided output rows
    act_order: bool = False  # an act-order index (g_idx) can be stored
    code_bits: tuple[int, ...] = ()  # bit widths the target stores (empty: only `bits`)
    groups: tuple[int, ...] = ()  # group sizes the target may choose from, largest first (AFQ)
    dtype: torch.dtype | None = None  # float targets
    ggml_type: int | None = None  # gguf.GGMLQuantizationType value
    block_bytes: int = 0  # bytes per block (ggml: gguf-py's GGML_QUANT_SIZES)
    note: str = ""  # what the runtime needs to know, appended to every reason (mistral.rs' run dtype)
    element: str = ""  # float-block targets: the element format of the codes ("e2m1", "e4m3")
    # float-block targets: a float32 scale per tensor beside the block scales (NVFP4), and how it applies, as
    # GridParams.global_scale_op: "post" (llama.cpp's `.scale`, after the block product), "div" (compressed-
    # tensors' weight_global_scale divides the block scale), "mul"; "" for none
    tensor_scale: str = ""

    def __post_init__(self):
        if self.family not in _HANDLERS:
            raise ValueError(f"unknown scheme family {self.family!r} (register_family first)")


@dataclass(frozen=True)
class Decision:
    """What the checker decided for one tensor and one target scheme."""

    verdict: str
    reason: str
    scheme: str = ""  # the scheme's name
    kept_blocks: int | None = None  # K types: super-blocks that keep the grid's codes
    total_blocks: int | None = None
    copied: bool = False  # the source's own packed bytes are the target's (same ggml type)
    group_size: int | None = None  # the group the target stores (AFQ, HQQ axis 0), when it chose one
    meta_dtype: torch.dtype | None = None  # HQQ axis 0: the dtype scales and zeros are stored in
    keeps_codes: bool = False  # the target is written from the source's codes (not requantized)
    facts: dict = field(default_factory=dict)  # anything else a handler measured (read-only by convention)
    fallback: str = ""  # the type stored instead of the one asked for (a K type on rows of no whole 256-blocks)
    alternative: tuple[str, str] | None = None  # (scheme, verdict) that would hold the grid, when this does not

    @property
    def lossless(self) -> bool:
        return self.verdict == EXACT

    def with_reason(self, prefix: str = "", suffix: str = "") -> "Decision":
        return replace(self, reason=prefix + self.reason + suffix)


Source = Union[GridParams, str]  # a grid's parameters, or a dense tensor's torch dtype name ("float16")


def fp16_exact(x: torch.Tensor) -> bool:
    """True when every value survives a round trip through fp16 unchanged."""
    xf = x.to(torch.float32)
    return bool(torch.equal(xf.to(torch.float16).to(torch.float32), xf))


def float_scheme(name: str, note: str = "", scheme_name: str | None = None) -> TargetScheme:
    """F32 / F16 / BF16 as a target."""
    return TargetScheme(scheme_name or name, "float", bits=torch.finfo(_FLOAT_DTYPES[name]).bits,
                        dtype=_FLOAT_DTYPES[name], note=note)


# --------------------------------------------------------------------------------------------------------
# the family handlers: (source, shape, scheme, native) -> Decision


def check_grid_to_float(p: GridParams, target: str) -> Decision:
    if target == "F32" and p.integer_zeros:
        return Decision(EXACT, "dequantized in float32, which holds every grid value exactly")
    if target == "F32":
        return Decision(EXACT, "dequantized in float32")
    return Decision(NEAR_EXACT, f"dequantized weights round once to {target.lower()}")


def check_dense_to_float(src_dtype: str, target: str) -> Decision:
    src = getattr(torch, src_dtype, None)
    dst = _FLOAT_DTYPES[target]
    if src == dst:
        return Decision(EXACT, "copied")
    widening = {(torch.float16, torch.float32), (torch.bfloat16, torch.float32)}
    if (src, dst) in widening:
        return Decision(EXACT, f"{src_dtype} widens to {target.lower()} exactly")
    return Decision(NEAR_EXACT, f"{src_dtype} rounds to {target.lower()}")


def _float(src: Source, shape, s: TargetScheme, native, prefer_groups=()) -> Decision:
    target = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}[s.dtype]
    if isinstance(src, GridParams):
        return check_grid_to_float(src, target)
    return check_dense_to_float(src, target)


# family -> handler(source, shape, scheme, native, prefer_groups) -> Decision. Formats register the families
# their targets follow with register_family: check() stays the one entry point and a Decision the one answer.
_HANDLERS: dict[str, Callable[..., Decision]] = {"float": _float}
# families whose handlers decide codebook sources themselves (float targets; a format's own registered with
# register_family(..., takes_codebooks=True), such as float-block)
_TAKES_CODEBOOKS = {"float"}


def _codebook_source(p: GridParams, shape: tuple[int, ...], s: TargetScheme, prefer_groups) -> Decision:
    """A codebook grid (bitsandbytes NF4/FP4) into any target that stores integer-grid codes: its values are
    table entries, not s * (q - z), so no target keeps the codes. The target decides as for dense float32
    weights (a row that is not whole blocks is still refused; AFQ / HQQ still choose their group), and the
    reason says why the codes could not stay."""
    dense = _HANDLERS[s.family]("float32", shape, s, None, prefer_groups)
    if dense.verdict == REFUSED:
        return dense
    if p.element is not None:
        why = f"{p.element} float codes are not a uniform grid"
    else:
        why = f"a {2 ** p.bits}-value codebook is not a uniform grid"
    if s.name.upper().startswith("IQ4") and p.element is None:
        why += f" ({s.name.upper()}'s 16 values are a different codebook)"
    return replace(dense, verdict=REQUANTIZE, reason=f"{why}; weights are dequantized and quantized again "
                                                      f"with {s.name}'s quantizer", keeps_codes=False,
                   kept_blocks=None, copied=False)


def families() -> tuple[str, ...]:
    """The registered scheme families, in registration order."""
    return tuple(_HANDLERS)


def register_family(name: str, handler: Callable[..., Decision], takes_codebooks: bool = False) -> None:
    """Add a scheme family. `takes_codebooks`: its handler decides codebook (and float) grids itself; otherwise
    check() decides them as codebooks no integer target holds."""
    if _HANDLERS.get(name, handler) is not handler:
        raise ValueError(f"scheme family {name!r} is already registered")
    _HANDLERS[name] = handler
    if takes_codebooks:
        _TAKES_CODEBOOKS.add(name)


def check(source: Source, shape: tuple[int, ...], scheme: TargetScheme, *, native: str | None = None,
          prefer_groups: tuple[int, ...] = ()) -> Decision:
    """The verdict for storing a tensor (a grid's parameters, or a dense dtype name) as `scheme`.

    native: the name of the source's own packed type when it has one the target may copy (a GGUF grid's
    ggml type); prefer_groups: the source's own group sizes, tried first where the target chooses one."""
    shape = tuple(shape)
    if isinstance(source, GridParams) and source.codebook is not None and scheme.family not in _TAKES_CODEBOOKS:
        d = _codebook_source(source, shape, scheme, tuple(prefer_groups))
    else:
        d = _HANDLERS[scheme.family](source, shape, scheme, native, tuple(prefer_groups))
    if isinstance(source, GridParams) and source.scale_steps is not None and d.verdict == EXACT \
            and scheme.family != "float":
        # the source rounds twice ((q * a) * c); any target stores one scale fl(a * c): within an ulp, not exact
        d = replace(d, verdict=NEAR_EXACT, reason=d.reason + " (the source's two-step scale becomes one)")
    d = replace(d, scheme=scheme.name)
    return d.with_reason(suffix=scheme.note) if scheme.note else d


def decide(source: Source, shape: tuple[int, ...], scheme: TargetScheme, candidates: Iterable[TargetScheme] = (),
           *, native: str | None = None, prefer_groups: tuple[int, ...] = (), fallback: str = "") -> Decision:
    """check(), and for a grid the target cannot hold as it is (requantize, refused) the cheapest of
    `candidates` that can: the aligned alternative a refusal proposes."""
    d = check(source, shape, scheme, native=native, prefer_groups=prefer_groups)
    if fallback:
        d = replace(d, fallback=fallback)
    if d.verdict in (REQUANTIZE, REFUSED) and isinstance(source, GridParams) and candidates:
        best = best_aligned(source, shape, candidates, native=native, prefer_groups=prefer_groups)
        if best is not None:
            d = replace(d, alternative=(best[0].name, best[1].verdict))
    return d


def best_aligned(source: GridParams, shape: tuple[int, ...], schemes: Iterable[TargetScheme], *,
                 native: str | None = None, prefer_groups: tuple[int, ...] = ()
                 ) -> tuple[TargetScheme, Decision] | None:
    """The first scheme (cheapest first, as the table orders them) that holds the grid exactly, else the
    first that holds it near-exactly; None when none does."""
    decided = [(s, check(source, shape, s, native=native, prefer_groups=prefer_groups)) for s in schemes]
    for wanted in (EXACT, NEAR_EXACT):
        for s, d in decided:
            if d.verdict == wanted:
                return s, d
    return None

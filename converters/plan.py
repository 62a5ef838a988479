"""The plan: one `TensorPlan` per source tensor, decided before a byte is written.

Writers implement `Writer` (plan one tensor, open a session) and `WriterSession` (add one tensor,
returning what the target will decode to, so that the runner can measure the error against the
source dequantization). Planning reads every record's small parameters, which also validates every
shard before the output is touched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Protocol

import torch

from .checker import NEAR_EXACT, REFUSED, REQUANTIZE, EXACT
from .errors import QConvertError, RefusedPlan
from .records import Dense, Grid, ModelSource, TensorRecord

__all__ = ["Options", "TensorPlan", "Writer", "WriterSession", "BitIdentical", "refusal_message", "check_plan"]


@dataclass
class Options:
    type: str | None = None  # target type for quantized tensors (for dense sources: 2-D weights)
    tensor_types: list[tuple[str, str]] = field(default_factory=list)  # (regex, type), first match wins
    allow_requant: bool = False
    extra: dict = field(default_factory=dict)  # writer-specific options
    device: str = "cpu"  # where kernels run: "cpu", "cuda", "cuda:N" or "auto" (kernels.resolve_device)

    def explicit_type(self, name: str) -> str | None:
        for pattern, type_name in self.tensor_types:
            if re.search(pattern, name):
                return type_name
        return None


@dataclass
class TensorPlan:
    name: str  # source (Hugging Face) name
    shape: tuple[int, ...]
    source: str  # what the source holds: "4-bit g128 sym", "float16"
    target: str  # target type: "Q4_0", "F32", "gptq 4-bit g128"
    verdict: str
    reason: str = ""
    alternative: str = ""  # an aligned choice that would avoid requantization, e.g. "--type q4_0 (exact)"
    out_name: str = ""  # the tensor's name in the target
    info: dict = field(default_factory=dict)  # writer-private facts decided at plan time


@dataclass(frozen=True)
class BitIdentical:
    """A writer's proof of an exact repack: it decoded the bytes it wrote back into the source's own
    packed form and found them identical to the source, words and scales, so every decoded value
    equals the source's and the error is measured as 0 without a float pass."""

    how: str


class WriterSession(Protocol):
    def add(self, plan: TensorPlan, item: Dense | Grid) -> torch.Tensor | BitIdentical:
        """Store one tensor; return the float32 values the target decodes to, in the source's layout
        (or `BitIdentical` when the written bytes were shown identical to the source's packed codes)."""
        ...

    def close(self) -> None:
        ...


class Writer(Protocol):
    name: str
    output_is_file: bool

    def plan_tensor(self, rec: TensorRecord, options: Options, source: ModelSource) -> TensorPlan:
        ...

    def check_model(self, source: ModelSource, plans: list[TensorPlan], options: Options) -> None:
        """Refuse, before writing, what the target cannot hold as a whole (tokenizer, architecture)."""
        ...

    def open(self, path: Path, source: ModelSource, plans: list[TensorPlan], options: Options) -> WriterSession:
        ...


def refusal_message(plans: Iterable[TensorPlan], allow_requant: bool) -> str | None:
    """One line naming the tensors that block the plan and what would work instead, or None."""
    blocked = [p for p in plans if p.verdict == REFUSED or (p.verdict == REQUANTIZE and not allow_requant)]
    if not blocked:
        return None
    first = blocked[0]
    names = ", ".join(p.name for p in blocked[:3]) + (f" and {len(blocked) - 3} more" if len(blocked) > 3 else "")
    alternatives = sorted({p.alternative for p in blocked if p.alternative})
    hint = f"; aligned choice: {' / '.join(alternatives)}" if alternatives else ""
    if any(p.verdict == REFUSED for p in blocked):
        bad = next(p for p in blocked if p.verdict == REFUSED)
        return f"refused: {bad.name} cannot be stored as {bad.target}: {bad.reason}{hint}"
    return (f"refused: {len(blocked)} tensor(s) would need lossy requantization to {first.target} "
            f"({names}: {first.reason}){hint}; pass --allow-requant to accept the loss")


def check_plan(plans: list[TensorPlan], allow_requant: bool) -> None:
    msg = refusal_message(plans, allow_requant)
    if msg:
        raise RefusedPlan(msg)


def verdict_counts(plans: Iterable[TensorPlan]) -> dict[str, int]:
    counts = {EXACT: 0, NEAR_EXACT: 0, REQUANTIZE: 0, REFUSED: 0}
    for p in plans:
        counts[p.verdict] = counts.get(p.verdict, 0) + 1
    return counts


def unknown_type(type_name: str, known: Iterable[str], fmt: str) -> QConvertError:
    return QConvertError(f"unknown {fmt} type {type_name!r}; choose one of: {', '.join(known)}")

"""The plan and the writer contract: one `TensorPlan` per source tensor, decided before a byte is written.

A writer is a subclass of `Writer`, which declares every hook the runner calls, each with its default, so
that a writer overrides what it needs and nothing is probed by name (as transformers' `HfQuantizer` does):

    for_conversion(source, options) -> Writer      the writer for one conversion (default: itself), holding
                                                   what it decides once per model (GGUF's architecture)
    adapt_records(records, source) -> records      the records it takes (default: the source's); GGUF splits
                                                   some tensors into several of its own
    plan_records(records, options, source)         (record, plan) pairs (default: plan_tensor per record, in
                                                   stream order); GGUF looks at every name first for a mix
    plan_tensor(rec, options, source) -> plan      required: the verdict for one tensor, from the checker
    check_model(source, plans, options)            refuse what the target cannot hold as a whole (default: none)
    writes_several_files(options) -> bool          the output is several files named after OUT (default False)
    open(path, source, plans, options) -> session  required: start writing
    open_split(folder, name, source, plans, options)   one conversion split into parts (default None: cannot
    open_part(folder, source, plans, options, layout)  be); the part sessions write where the driver placed
    alternative_hint(scheme, verdict) -> str       how the aligned alternative a refusal proposes is written

and a `WriterSession` stores one tensor at a time (`add`, required), may hand back the float32 source values
it dequantized to encode it (`take_reference`, default None) and finishes the output (`close`, required).

A writer whose output does not carry the source's side files sets `copies_side_files = False` (GGUF); for
the others the runner checks them (tokenizer.json, tokenizer_config.json...) before the output is created.

`Writer.plan(rec, decision, ...)` formats a plan from the checker's `Decision` in one place: verdict, reason,
and the aligned alternative as the writer writes it. What a writer decided for a tensor beyond that travels
as its own typed `action` (a small dataclass of the writer's, read back by its session), never as text.
Planning reads every record's small parameters, which also validates every shard before the output is touched.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from .checker import EXACT, NEAR_EXACT, REFUSED, REQUANTIZE, Decision
from .errors import QConvertError, RefusedPlan
from .records import Dense, Grid, ModelSource, TensorRecord, describe_record

__all__ = ["Options", "TensorPlan", "Writer", "WriterSession", "BitIdentical", "refusal_message", "check_plan",
           "verdict_counts", "unknown_type", "SplitOutput", "PartSession", "WrittenRange"]


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
    action: Any = None  # what the writer decided for this tensor: its own dataclass, read back by its session
    # the writer stores the source's own form behind a lossy stand-in (a rotated GPTQ grid), so the stand-in's
    # loss does not apply (run.mark_standin)
    keeps_source_form: bool = False
    source_file: str = ""  # the input file the tensor was read from (set by the runner), named in a refusal


@dataclass(frozen=True)
class BitIdentical:
    """A writer's proof of an exact repack: it decoded the bytes it wrote back into the source's own
    packed form and found them identical to the source, words and scales, so every decoded value
    equals the source's and the error is measured as 0 without a float pass."""

    how: str


class WriterSession(ABC):
    """One conversion's output being written, a tensor at a time."""

    @abstractmethod
    def add(self, plan: TensorPlan, item: Dense | Grid) -> torch.Tensor | BitIdentical:
        """Store one tensor; return the float32 values the target decodes to, in the source's layout
        (or `BitIdentical` when the written bytes were shown identical to the source's packed codes)."""

    def take_reference(self) -> torch.Tensor | None:
        """The float32 source values the last `add` dequantized to encode its tensor, once, or None: the runner
        then measures against them instead of dequantizing the source a second time."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Finish the output (configs, side files, headers written last)."""


@dataclass(frozen=True)
class WrittenRange:
    """Bytes a part wrote: `nbytes` at `offset` of the output file `file` (a name in the split's folder), with
    their sha256, so that a re-run can verify the part instead of redoing it (converters/split.py)."""

    file: str
    offset: int
    nbytes: int
    sha256: str


class PartSession(WriterSession):
    """One part of a split conversion being written (converters/split.py): `add` stores its tensor where the
    driver's `SplitOutput` placed it, and `written` lists every byte range it wrote."""

    written: list[WrittenRange]

    def part_record(self) -> dict:
        """What the driver's `SplitOutput.finish` needs of this part beyond its bytes (JSON), kept in the
        part's manifest. Default: nothing."""
        return {}


class SplitOutput(ABC):
    """The driver's side of a conversion split into parts: made by `Writer.open_split`, it has written what
    only the driver writes first (a header that fixes where every tensor's bytes go) and holds `layout`, the
    small picklable facts a part session needs to place its bytes; `files` are the output files it makes in
    its folder (renamed next to OUT when every part is done), `finish` writes what comes after the parts."""

    files: list[str]
    layout: Any

    def finish(self, records: list[dict]) -> None:
        """Write what only the driver can, after every part is written; `records` are the parts'
        `part_record()`s in part order. Default: nothing."""
        return None


class Writer(ABC):
    """A format's writer: see the module docstring for every hook and its default."""

    name: str
    output_is_file: bool = False  # the output is one file (GGUF), else a folder
    # the output carries the source's side files (tokenizer, generation config): the runner checks them before
    # writing (validate.check_side_files). GGUF, which reads the tokenizer into its own keys, does not.
    copies_side_files: bool = True

    def for_conversion(self, source: ModelSource, options: Options) -> "Writer":
        """The writer for one conversion: a fresh object holding what is decided once per model (nothing is
        stored on the source or on the registered writer). Default: this writer, which holds nothing."""
        return self

    def adapt_records(self, records: Iterable[TensorRecord], source: ModelSource) -> Iterator[TensorRecord]:
        """The records this writer takes, in order. Default: the source's as they are."""
        return iter(records)

    def plan_records(self, records: Iterable[TensorRecord], options: Options,
                     source: ModelSource) -> Iterator[tuple[TensorRecord, TensorPlan]]:
        """Every record with its plan, in stream order. Default: `plan_tensor` of each as it arrives (a bad
        record is refused when it is reached)."""
        for rec in records:
            yield rec, self.plan_tensor(rec, options, source)

    @abstractmethod
    def plan_tensor(self, rec: TensorRecord, options: Options, source: ModelSource) -> TensorPlan:
        """The plan of one tensor: its target type and the checker's verdict (formatted by `plan`)."""

    def check_model(self, source: ModelSource, plans: list[TensorPlan], options: Options) -> None:
        """Refuse, before writing, what the target cannot hold as a whole (tokenizer, architecture). Default:
        nothing to refuse."""
        return None

    def writes_several_files(self, options: Options) -> bool:
        """True when the output is several files named after OUT (split GGUF parts: output.atomic_output)."""
        return False

    @abstractmethod
    def open(self, path: Path, source: ModelSource, plans: list[TensorPlan], options: Options) -> WriterSession:
        """Start writing to `path` (a temporary name the runner renames on success)."""

    def open_split(self, folder: Path, name: str, source: ModelSource, plans: list[TensorPlan],
                   options: Options) -> SplitOutput | None:
        """Start a conversion split into parts (`--workers`, `--ray`: converters/split.py) in `folder`, the
        output named `name`: write what fixes where every tensor goes. Default None: this writer writes one
        stream whose placement depends on the tensors before it, and cannot be split."""
        return None

    def part_group(self, plan: TensorPlan) -> Any:
        """Tensors with the same non-None group are converted in one part of a split conversion (UQFF: the
        experts of one stacked layer, held until the last arrives). Default None: any cut."""
        return None

    def open_part(self, folder: Path, source: ModelSource, plans: list[TensorPlan], options: Options,
                  layout: Any) -> PartSession:
        """A session writing some of the tensors of a split conversion into the files in `folder`, where
        `layout` (the SplitOutput's) places them. Required with `open_split`."""
        raise NotImplementedError(f"{self.name} writer has open_split but no open_part")

    def alternative_hint(self, scheme: str, verdict: str) -> str:
        """The aligned alternative a Decision names, as a user of this writer asks for it."""
        return f"--type {scheme} ({verdict})"

    def plan(self, rec: TensorRecord, decision: Decision, target: str, *, out_name: str | None = None,
             action: Any = None, source: str | None = None, reason_prefix: str = "") -> TensorPlan:
        """The plan of `rec` from the checker's decision: verdict, reason (after `reason_prefix`) and the aligned
        alternative (`alternative_hint`), formatted here once for every writer."""
        alternative = self.alternative_hint(*decision.alternative) if decision.alternative else ""
        return TensorPlan(rec.name, rec.shape, describe_record(rec) if source is None else source, target,
                          decision.verdict, reason_prefix + decision.reason, alternative=alternative,
                          out_name=rec.name if out_name is None else out_name, action=action)


def refusal_message(plans: Iterable[TensorPlan], allow_requant: bool) -> str | None:
    """One line naming the tensors that block the plan, the input file they come from (when the runner set
    it) and what would work instead, or None."""
    blocked = [p for p in plans if p.verdict == REFUSED or (p.verdict == REQUANTIZE and not allow_requant)]
    if not blocked:
        return None
    first = blocked[0]
    names = ", ".join(p.name for p in blocked[:3]) + (f" and {len(blocked) - 3} more" if len(blocked) > 3 else "")
    alternatives = sorted({p.alternative for p in blocked if p.alternative})
    hint = f"; aligned choice: {' / '.join(alternatives)}" if alternatives else ""
    if any(p.verdict == REFUSED for p in blocked):
        bad = next(p for p in blocked if p.verdict == REFUSED)
        return f"refused: {bad.name}{_in_files([bad])} cannot be stored as {bad.target}: {bad.reason}{hint}"
    return (f"refused: {len(blocked)} tensor(s){_in_files(blocked)} would need lossy requantization to "
            f"{first.target} ({names}: {first.reason}){hint}; pass --allow-requant to accept the loss")


def _in_files(plans: list[TensorPlan]) -> str:
    """" in model-00001-of-00002.safetensors (and 1 more file)": the input files of `plans`, first first."""
    files = list(dict.fromkeys(p.source_file for p in plans if p.source_file))
    if not files:
        return ""
    more = len(files) - 1
    return f" in {files[0]}" + (f" (and {more} more file{'s' if more > 1 else ''})" if more else "")


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

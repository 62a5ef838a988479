"""The records of a batch conversion: a job as the manifest gives it (`BatchJob`) and what became of it
(`JobResult`), shared by the batch runner (batch.py) and the per-layer plot of its report (batch_plot.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["BatchJob", "JobResult"]


PAIR = re.compile(r"^(?P<src>[A-Za-z0-9_.\-]+?)(?:->|:|=>)(?P<dst>[A-Za-z0-9_.\-]+)$")


@dataclass(frozen=True)
class BatchJob:
    src: Path
    pair: str  # "gptq->gguf", or "auto->gguf" for a matrix job (the source format detected)
    out: Path
    options: tuple[str, ...] = ()

    @property
    def target(self) -> str:
        return PAIR.match(self.pair)["dst"]

    def argv(self, report: Path) -> list[str]:
        src_fmt = PAIR.match(self.pair)["src"]
        head = ["convert", str(self.src), str(self.out), "--to", self.target] if src_fmt == "auto" else \
            [self.pair, str(self.src), str(self.out)]
        return head + list(self.options) + ["--quiet", "--report", str(report)]


@dataclass
class JobResult:
    src: str
    pair: str
    out: str
    status: str  # "done" | "skipped" | "failed" | "planned"
    error: str = ""
    seconds: float = 0.0
    bytes: int = 0
    verdicts: dict = field(default_factory=dict)
    max_abs_err: float | None = None
    rms_err: float | None = None
    options: list[str] = field(default_factory=list)
    # `--verify`: `qconvert verify SRC OUT --logits` of the job's output (quality.LogitReport's figures)
    verify: str = ""  # "" not asked | "measured" | the one-line error that stopped it | "above --max-kl ..."
    kl_mean: float | None = None
    kl_max: float | None = None
    top1_agreement: float | None = None
    ppl_source: float | None = None
    ppl_output: float | None = None
    gate: str = ""  # `--max-kl X`: "passed", or why not ("KL mean 0.16 above --max-kl 0.05"); set per run

    @property
    def verify_failed(self) -> bool:
        return bool(self.verify) and self.verify != "measured" or self.gate.startswith("failed")

"""What a conversion reports: per tensor its plan (verdict, reason, target) and the error measured against the
source's float32 dequantization, with the path each kernel stage took; a summary; report.json."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .plan import TensorPlan, verdict_counts

__all__ = ["TensorResult", "Report", "measure", "kernel_summary", "NotFinite", "check_finite_copy"]


@dataclass
class TensorResult:
    plan: TensorPlan
    max_abs_err: float | None = None
    rmse: float | None = None
    kernel: dict | None = None  # stage -> the path that ran it: {"dequantize": "triton", "quantize": "c"}

    def as_dict(self) -> dict:
        p = self.plan
        return {"name": p.name, "out_name": p.out_name, "shape": list(p.shape), "source": p.source,
                "target": p.target, "verdict": p.verdict, "reason": p.reason,
                "max_abs_err": self.max_abs_err, "rmse": self.rmse,
                **({"kernel": self.kernel} if self.kernel is not None else {})}


@dataclass
class Report:
    source_format: str
    target_format: str
    source_path: str
    output_path: str | None
    results: list[TensorResult] = field(default_factory=list)
    seconds: float = 0.0
    dry_run: bool = False
    ignored_files: dict = field(default_factory=dict)  # files beside the source that are not part of the model
    not_carried: dict = field(default_factory=dict)  # tensors of the source no record carries, with why
    logits: dict | None = None  # `verify --logits`: quality.LogitReport.as_dict()

    def summary(self) -> dict:
        plans = [r.plan for r in self.results]
        errs = [r.max_abs_err for r in self.results if r.max_abs_err is not None]
        return {"tensors": len(plans), "verdicts": verdict_counts(plans),
                "max_abs_err": max(errs) if errs else None, "seconds": round(self.seconds, 3),
                "dry_run": self.dry_run}

    def as_dict(self) -> dict:
        return {"source": {"format": self.source_format, "path": self.source_path, "ignored_files": self.ignored_files,
                           "not_carried": self.not_carried},
                "target": {"format": self.target_format, "path": self.output_path},
                "tensors": [r.as_dict() for r in self.results], "summary": self.summary(),
                **({"logits": self.logits} if self.logits is not None else {})}

    def write_json(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.as_dict(), indent=2) + "\n")


_MEASURE_CHUNK = 1 << 18  # elements of source dequantization alive at once while measuring (about 40 B each)


def measure(item, decoded: torch.Tensor, reference: torch.Tensor | None = None) -> tuple[float, float]:
    """Max abs error and RMSE of `decoded` against the source's float32 dequantization, computed a
    band of rows at a time so that measuring never holds a second full-size float copy. `reference`:
    that dequantization when the writer already made it to encode the tensor (the same values, so the
    same numbers), else each band of the source is dequantized here."""
    if decoded.numel() == 0:
        return 0.0, 0.0
    if reference is not None and tuple(reference.shape) != tuple(decoded.shape):
        reference = None
    rows = decoded.shape[0] if decoded.dim() > 1 else 1
    step = max(1, _MEASURE_CHUNK // max(1, decoded.numel() // rows))
    max_err, sum_sq = 0.0, 0.0
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        if reference is not None:
            ref = reference[start:stop] if decoded.dim() > 1 else reference
        else:
            part = item.row_slice(start, stop) if decoded.dim() > 1 else item
            ref = part.dequantize(torch.float32)
        got = decoded[start:stop] if decoded.dim() > 1 else decoded
        band_max, band_sq = _band_error(got, ref)  # band_max is NaN when any difference is NaN
        if not math.isfinite(band_max):
            raise NotFinite.find(ref, got, start)
        max_err = max(max_err, band_max)
        sum_sq += band_sq
    return max_err, (sum_sq / decoded.numel()) ** 0.5


def _band_error(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |got - ref|, sum of squares in double) of one band. The C kernel (kernels/ggml/kquant_c.c
    qc_error_stats) takes one pass where torch takes six (most of a requantizing conversion's measuring time); its
    double sum runs in a fixed order of its own, so an RMSE can differ from torch's in its last digits, never
    between two runs here. Bands on a GPU are measured on the CPU, so `--device cuda` reports the CPU's numbers."""
    from ..kernels.ggml import kquant_c

    got, ref = got.to("cpu", torch.float32), ref.to("cpu", torch.float32)
    if kquant_c.available():
        return kquant_c.error_stats(got.contiguous().numpy(), ref.contiguous().numpy())
    diff = (got - ref).abs()
    return float(diff.max()), float(diff.double().pow(2).sum())


def check_finite_copy(item) -> None:
    """A writer's BitIdentical proof makes the error 0 without a float pass, which would also skip the NaN / inf
    check `measure` makes: a dense source's values are checked here (a grid's scales, zeros and mins already were,
    as the records streamed: run.finite_params; its integer codes cannot be NaN). Raises NotFinite(in_source)."""
    t = getattr(item, "tensor", None)
    if t is None or not torch.is_floating_point(t) or bool(torch.isfinite(t).all()):
        return
    bad = ~torch.isfinite(t)
    what = "NaN" if bool(torch.isnan(t).any()) else "inf"
    row = None if t.dim() < 2 else int(bad.reshape(bad.shape[0], -1).any(dim=1).nonzero()[0, 0])
    raise NotFinite(True, what, row)


class NotFinite(ValueError):
    """`measure` met a value that is not finite, so no error can be reported for the tensor: in the source's
    own dequantization (`in_source`: the source is broken) or in what the target decodes to. `what` is "NaN"
    or "inf", `row` the first output row holding it (None for a 1-D tensor)."""

    def __init__(self, in_source: bool, what: str, row: int | None):
        self.in_source, self.what, self.row = in_source, what, row
        self.where = "" if row is None else f" (output row {row})"
        super().__init__(f"{'source' if in_source else 'converted'} values hold {what}{self.where}")

    @classmethod
    def find(cls, ref: torch.Tensor, got: torch.Tensor, first_row: int) -> "NotFinite":
        """Which side of a band holds the value, looked for only once the band's error is not finite."""
        in_source = not bool(torch.isfinite(ref).all())
        values = ref if in_source else got.to(torch.float32)
        bad = ~torch.isfinite(values)
        what = "NaN" if bool(torch.isnan(values).any()) else "inf"
        if values.dim() < 2:
            return cls(in_source, what, None)
        return cls(in_source, what, first_row + int(bad.reshape(bad.shape[0], -1).any(dim=1).nonzero()[0, 0]))


def kernel_summary(trace: dict) -> dict:
    """kernels.kernel_trace's {stage: [paths]} -> {stage: "triton"} ("triton+c" where parts took each)."""
    return {stage: "+".join(paths) for stage, paths in trace.items()}

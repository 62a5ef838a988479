"""`qconvert verify`: re-read a converted model with qconvert's readers and measure every tensor against its
source, independently of the conversion's own report (`--logits` runs both models too: logits.py)."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import QConvertError
from ..model_shapes import canonical_name
from ..plan import TensorPlan
from ..records import describe_record
from ..registry import detect_format
from ..report import Report, TensorResult, kernel_summary, measure
from ..run import device_scope, open_source
from ...kernels import kernel_trace

__all__ = ["verify"]


def verify(src_path: Path, out_path: Path, src_format: str | None = None, out_format: str | None = None,
           progress: bool = True, device: str | None = None) -> Report:
    """_verify with the dequantizations on `device` (kernels.use_device)."""
    with device_scope(device):
        return _verify(src_path, out_path, src_format, out_format, progress)


def _verify(src_path: Path, out_path: Path, src_format: str | None = None, out_format: str | None = None,
            progress: bool = True) -> Report:
    """Re-read a converted model with qconvert's readers and measure every tensor against the source.

    Independent of the conversion's own report: both sides are opened from disk by format, matched by
    their Hugging Face names, dequantized to float32 and compared. Verdicts here are what the numbers
    say: `exact` (max error 0), `differs` (with the error), `missing` (not in the output).
    """
    start = time.perf_counter()
    source = open_source(src_format or detect_format(src_path), src_path)
    output = open_source(out_format or detect_format(out_path), out_path)
    # matched by the names transformers loads them by (a writer may rename what a producer renamed)
    out_records = {canonical_name(r.name, output.config): r for r in output.records()}
    report = Report(source.format_name, output.format_name, str(src_path), str(out_path))
    for rec in tqdm(list(source.records()), desc="Verifying", unit="tensor", disable=not progress, leave=False):
        target = out_records.get(canonical_name(rec.name, source.config))
        if target is None:
            plan = TensorPlan(rec.name, rec.shape, describe_record(rec), "-", "missing", "not in the output")
            report.results.append(TensorResult(plan))
            continue
        if tuple(target.shape) != tuple(rec.shape):
            raise QConvertError(f"shape {tuple(target.shape)} in the output, {tuple(rec.shape)} in the source",
                                path=out_path, tensor=rec.name)
        with kernel_trace() as used:
            max_err, rmse = measure(rec.load(), target.load().dequantize(torch.float32))
        plan = TensorPlan(rec.name, rec.shape, describe_record(rec), describe_record(target),
                          "exact" if max_err == 0.0 else "differs")
        report.results.append(TensorResult(plan, max_err, rmse, kernel_summary(used)))
    report.seconds = time.perf_counter() - start
    return report

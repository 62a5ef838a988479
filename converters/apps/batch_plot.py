"""The PNG beside REPORT/batch.md: per-layer error of every job (and its KL divergence where measured).

Functions over data: the batch's JobResult records and each job's `--report` JSON (converters/run.py
`Report.as_dict`), keyed by the job's output path (`JobResult.out`, the same string the report holds as
`target.path`). matplotlib is an optional dependency (`pip install "qconvert[batch]"`): without it
`plot_layer_errors` returns None and writes nothing.

The figure is built on a bare `matplotlib.figure.Figure` with the Agg canvas, never through pyplot, so
no display is needed and no global figure state is touched (a batch may draw from any thread).
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from .batch_jobs import JobResult

__all__ = ["layer_errors", "layer_error_figure", "plot_layer_errors", "matplotlib_available",
           "load_job_reports", "INSTALL_HINT"]

INSTALL_HINT = 'the per-layer error plot needs matplotlib: pip install "qconvert[batch]"'

# Hugging Face `model.layers.N.` (also nested, e.g. `model.language_model.layers.N.`) and GGUF `blk.N.`
_LAYER = re.compile(r"(?:^|\.)(?:layers|blk)\.(\d+)\.")
# a span of positive errors wider than this reads better on a log axis
_LOG_SPAN = 10.0


def layer_index(name: str) -> int | None:
    """The decoder layer a tensor name belongs to; None for the embedding, head and final norm."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


def layer_errors(report: dict) -> dict[int, float]:
    """Layer index -> the layer's RMS error: the root of the size-weighted mean of its tensors' rmse^2
    (so the layer's RMS over all of its weights, as if they were one tensor). Tensors without a measured
    rmse (a dry run) or outside any layer are left out; a layer of only exact tensors is 0.0."""
    sq_sum: dict[int, float] = {}
    count: dict[int, int] = {}
    for t in report.get("tensors", []):
        if t.get("rmse") is None:
            continue
        idx = layer_index(t.get("name", ""))
        if idx is None and t.get("out_name"):
            idx = layer_index(t["out_name"])
        if idx is None:
            continue
        n = _numel(t["shape"])
        sq_sum[idx] = sq_sum.get(idx, 0.0) + float(t["rmse"]) ** 2 * n
        count[idx] = count.get(idx, 0) + n
    # a layer whose tensors are all empty has no error to speak of
    return {i: (sq_sum[i] / count[i]) ** 0.5 if count[i] else 0.0 for i in sorted(sq_sum)}


def matplotlib_available() -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    del matplotlib  # imported only to learn that it can be (find_spec would miss a broken install)
    return True


def _job_label(result) -> str:
    return f"{Path(result.out).name} ({result.pair})"


def _measured_kl(results) -> list:
    return [r for r in results if r.status != "failed" and getattr(r, "kl_mean", None) is not None]


def layer_error_figure(results: Sequence[JobResult], job_reports: dict[str, dict]) -> Figure:
    """The figure: panel 1 the per-layer RMS error of every job with a report (one line each), panel 2,
    only when some job measured it, a bar per job of its mean KL divergence. Needs matplotlib."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    series = []
    for r in results:
        if r.status == "failed":  # a report under its output is an earlier run's, not this one's
            continue
        report = job_reports.get(r.out)
        errs = layer_errors(report) if report is not None else {}
        if errs:
            series.append((r, errs))
    kl_jobs = _measured_kl(results)

    panels = 2 if kl_jobs else 1
    fig = Figure(figsize=(10, 4.5 * panels), layout="constrained")
    ax = fig.add_subplot(panels, 1, 1)
    ax.set_title("per-layer RMS error (size-weighted over the layer's tensors)")
    ax.set_xlabel("layer")
    ax.set_ylabel("RMS error")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    if not series:
        ax.text(0.5, 0.5, "no per-layer errors measured", ha="center", va="center", transform=ax.transAxes)
    styles = ("-", "--", ":", "-.")  # the colour cycle repeats after 10 jobs; the line style tells them apart
    exact_shown = False
    for k, (r, errs) in enumerate(series):
        xs, ys = list(errs), list(errs.values())
        (line,) = ax.plot(xs, ys, styles[(k // 10) % len(styles)], marker=".", label=_job_label(r))
        exact = [x for x, y in errs.items() if y == 0.0]
        if exact:
            # hollow markers on the zero line: an exact layer must not read as "missing" or "tiny"
            ax.plot(exact, [0.0] * len(exact), "o", color=line.get_color(), mfc="white", ms=7, clip_on=False,
                    zorder=3)
            exact_shown = True
    if exact_shown:  # one legend entry for every job's exact layers, last, in no job's colour
        ax.plot([], [], "o", color="0.3", mfc="white", ms=7, label="exact layer (error 0)")
    positive = [y for _, errs in series for y in errs.values() if y > 0]
    if positive and max(positive) > _LOG_SPAN * min(positive):
        if exact_shown:  # log cannot show 0: symlog is linear below the smallest error, so 0 stays on the axis
            ax.set_yscale("symlog", linthresh=min(positive))
        else:
            ax.set_yscale("log")
    if series:
        layers = [i for _, errs in series for i in errs]
        # half a layer of margin: a one-layer model would otherwise get a +-0.05 axis of fractional ticks
        ax.set_xlim(min(layers) - 0.5, max(layers) + 0.5)
        ax.axhline(0.0, color="0.6", lw=0.8, zorder=0)
        ax.legend(fontsize="small", loc="best")

    if kl_jobs:
        kx = fig.add_subplot(panels, 1, 2)
        kx.set_title("KL divergence of the output's logits against the source's (mean over tokens)")
        names = [_job_label(r) for r in kl_jobs]
        means = [float(r.kl_mean) for r in kl_jobs]
        bars = kx.bar(range(len(kl_jobs)), means, color="C0", label="mean KL")
        maxes = [(i, float(r.kl_max)) for i, r in enumerate(kl_jobs) if getattr(r, "kl_max", None) is not None]
        if maxes:
            kx.plot([i for i, _ in maxes], [m for _, m in maxes], "_", color="black", ms=18, mew=2, label="max KL")
        for bar, r in zip(bars, kl_jobs):
            top1 = getattr(r, "top1_agreement", None)
            if top1 is not None:
                kx.annotate(f"top-1 {100 * float(top1):.1f}%", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize="small")
        kx.set_xticks(range(len(kl_jobs)), names, rotation=20, ha="right", fontsize="small")
        kx.set_ylabel("KL divergence")
        kx.legend(fontsize="small")
    return fig


def plot_layer_errors(results: Sequence[JobResult], job_reports: dict[str, dict], png_path: Path, *,
                      strict: bool = False) -> Path | None:
    """Write the figure to png_path and return it; None when matplotlib is not installed (write
    INSTALL_HINT instead). A batch's outputs matter more than its picture: unless `strict` (the tests),
    a failure while drawing is one warning line on stderr and None, never an exception."""
    if not matplotlib_available():
        return None
    png_path = Path(png_path)
    try:
        fig = layer_error_figure(results, job_reports)
        fig.savefig(png_path, dpi=100)
    except Exception as e:
        if strict:
            raise
        print(f"qconvert: warning: {png_path}: per-layer error plot not written ({type(e).__name__}: {e})",
              file=sys.stderr)
        return None
    return png_path


def load_job_reports(report_dir: Path) -> dict[str, dict]:
    """REPORT/jobs/*.json keyed by their output path (`target.path`, which is `JobResult.out`). Where
    several runs wrote the same output (other options, an older qconvert) the newest report wins; a report
    that cannot be read (its job killed while writing it) is left out: the plot draws what was measured."""
    found: dict[str, tuple[int, dict]] = {}
    for p in sorted(Path(report_dir, "jobs").glob("*.json")):
        try:
            rep = json.loads(p.read_text())
            out, mtime = rep["target"]["path"], p.stat().st_mtime_ns
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if out is not None and (out not in found or mtime > found[out][0]):
            found[out] = (mtime, rep)
    return {out: rep for out, (_, rep) in found.items()}

"""Benchmark: `qconvert batch --workers 2` against a sequential loop of the same single commands.

Builds once (cached under --work) a synthetic GPTQ 4-bit g128 llama of about --size-mb MB
(scripts/synthetic_gptq.py), then runs the first --jobs of ten conversions of it

  1. sequentially, one `python -m qconvert PAIR SRC OUT ... --quiet --report R` after another, each
     timed and its peak RSS taken from os.wait4 (the kernel's high-water mark, exact);
  2. as one `qconvert batch MANIFEST --workers W` into fresh outputs and a fresh report folder, timed,
     its job processes (one per job, each run by one of the W workers) sampled every 0.2 s for their
     peak RSS (VmHWM, the high-water mark so far, from /proc), with os.wait4 on the batch process as the
     exact bound over it and every job process it reaped;

checks that both runs wrote the same bytes (SHA-256 over each output's files), and prints per job the
seconds and peak MB of both, the totals, the ratio sequential / batch wall time and the peak RSS per
worker. --json PATH writes the same numbers. Nothing is asserted on the timings.

    python scripts/bench_batch.py [--work DIR] [--size-mb 500] [--jobs 10] [--workers 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic_gptq import make_synthetic_gptq  # noqa: E402

MB = 1_000_000
SAMPLE_SECONDS = 0.2
GROUP = 128  # QQQ takes only g128 (or per-channel) GPTQ without requantizing
VOCAB = 512  # the bundled tiny example's tokenizer, which synthetic_gptq copies

# (output name, pair, options): the first --jobs of these run. The first ones are the cheap exact
# repacks, so a quick check still covers several writers; the K quants requantize (hence --allow-requant).
JOBS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("model.gguf", "gptq->gguf", ()),
    ("model-hf-f16", "gptq->hf", ("--type", "f16")),
    ("model-gptq-v2", "gptq->gptq-v2", ()),
    ("model-uqff", "gptq->uqff", ()),
    ("model-q8_0.gguf", "gptq->gguf", ("--type", "q8_0")),
    ("model-hqq", "gptq->hqq", ()),
    ("model-qqq", "gptq->qqq", ("--allow-requant",)),  # QQQ's int8 steps of a per-channel scale round
    ("model-q4_0.gguf", "gptq->gguf", ("--type", "q4_0")),
    ("model-q4_k_m.gguf", "gptq->gguf", ("--type", "q4_k_m", "--allow-requant")),
    ("model-q2_k.gguf", "gptq->gguf", ("--type", "q2_k", "--allow-requant")),
)

# llama-like shapes, smallest first: the model takes the largest that still has at least MIN_LAYERS
# layers at the asked size, so a 500 MB model is 2048-wide with ~19 layers, a 40 MB one 1024-wide.
SHAPES = ((1024, 2816), (2048, 5632), (4096, 11008))
MIN_LAYERS = 8


# -- the model ------------------------------------------------------------------------------------------------
def _layer_bytes(hidden: int, intermediate: int) -> int:
    weights = 4 * hidden * hidden + 3 * hidden * intermediate
    # 4-bit qweight, fp16 scales and 4-bit qzeros per group of 128, int32 g_idx per input column, two norms
    g_idx = (4 * hidden + 2 * intermediate + hidden) * 4
    return weights // 2 + weights // GROUP * 2 + weights // GROUP // 2 + g_idx + 2 * hidden * 2


def model_shape(size_mb: float) -> tuple[int, int, int]:
    """(hidden, intermediate, layers) of a model of about size_mb MB."""
    target = size_mb * MB
    for hidden, intermediate in reversed(SHAPES):
        rest = target - 2 * VOCAB * hidden * 2  # embedding and head in fp16
        layers = round(rest / _layer_bytes(hidden, intermediate))
        if layers >= MIN_LAYERS or (hidden, intermediate) == SHAPES[0]:
            return hidden, intermediate, max(1, layers)
    raise AssertionError("unreachable: the smallest shape always returns")


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in _files(path))


def build_model(work: Path, size_mb: float) -> tuple[Path, dict]:
    """The cached synthetic checkpoint for this size, built into a temporary folder and renamed, so an
    interrupted build is never taken for a finished one."""
    hidden, intermediate, layers = model_shape(size_mb)
    info = {"format": f"gptq 4-bit g{GROUP} sym", "hidden": hidden, "intermediate": intermediate,
            "layers": layers, "vocab": VOCAB}
    model = work / f"model-{hidden}x{intermediate}x{layers}"
    if not (model / "config.json").is_file():
        work.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=work))
        print(f"building the synthetic model ({hidden} wide, {layers} layers) in {model} ...", flush=True)
        make_synthetic_gptq(tmp, hidden=hidden, intermediate=intermediate, layers=layers,
                            heads=hidden // 128, kv_heads=hidden // 128, bits=4, group=GROUP, shard_mb=128)
        if model.exists():  # a half-built folder of an older run of this script
            shutil.rmtree(model)
        tmp.rename(model)
    info["mb"] = round(tree_bytes(model) / MB, 1)
    return model, info


# -- measuring ------------------------------------------------------------------------------------------------
def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else []


def tree_digest(path: Path) -> str:
    """SHA-256 over the output's files: their paths inside it and their bytes."""
    h = hashlib.sha256()
    for p in _files(path):
        h.update((p.relative_to(path).as_posix() if p != path else "").encode() + b"\0")
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def run_waited(argv: list[str], stderr_path: Path) -> tuple[float, int, int]:
    """Run argv to its end: (seconds, exit status, peak RSS in bytes). The peak is the kernel's ru_maxrss
    from wait4 (KiB on Linux), of the process and any children it reaped."""
    t0 = time.monotonic()
    with open(stderr_path, "wb") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.monotonic() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    return seconds, proc.returncode, usage.ru_maxrss * 1024


def _proc_status_kib(pid: int, field_name: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass  # the process ended between listing and reading it
    return None


def _children(pid: int) -> list[tuple[int, list[str]]]:
    """The direct children of pid with their command lines (psutil when installed, else /proc)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    found = []
    if psutil is not None:
        try:
            kids = psutil.Process(pid).children(recursive=False)
        except psutil.Error:
            return []
        for k in kids:
            try:
                found.append((k.pid, k.cmdline()))
            except psutil.Error:
                continue
        return found
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # the command name (field 2) may hold spaces and parentheses: the fields after its last ")"
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    found.append((int(entry), [a.decode(errors="replace") for a in f.read().split(b"\0") if a]))
        except (OSError, ValueError, IndexError):
            continue
    return found


@dataclass
class BatchRun:
    seconds: float
    returncode: int
    rusage_peak: int  # bytes: wait4's high-water mark over the batch process and every job process it reaped
    job_peaks: dict[str, int] = field(default_factory=dict)  # output path -> sampled VmHWM of its process
    parent_peak: int = 0
    concurrent_peak: int = 0  # the largest sum of the job processes' RSS at one sample
    sampler: str = ""


def run_batch_sampled(argv: list[str], outs: list[str], stderr_path: Path) -> BatchRun:
    sampler = ("psutil children" if importlib.util.find_spec("psutil") else "/proc scan") + " + /proc VmHWM"
    job_peaks: dict[str, int] = {}
    parent_peak = concurrent_peak = 0
    t0 = time.monotonic()
    with open(stderr_path, "wb") as err:
        proc = subprocess.Popen(argv, stdout=err, stderr=subprocess.STDOUT)
        while True:
            # WNOHANG keeps the batch a zombie-free child we reap ourselves, so its rusage is ours to read
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            parent_peak = max(parent_peak, (_proc_status_kib(proc.pid, "VmHWM") or 0) * 1024)
            rss_now = 0
            for child, cmdline in _children(proc.pid):
                out = next((o for o in outs if o in cmdline), None)
                hwm, rss = _proc_status_kib(child, "VmHWM"), _proc_status_kib(child, "VmRSS")
                if out is None or hwm is None:
                    continue
                job_peaks[out] = max(job_peaks.get(out, 0), hwm * 1024)
                rss_now += (rss or 0) * 1024
            concurrent_peak = max(concurrent_peak, rss_now)
            time.sleep(SAMPLE_SECONDS)
    seconds = time.monotonic() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    return BatchRun(seconds, proc.returncode, usage.ru_maxrss * 1024, job_peaks, parent_peak, concurrent_peak,
                    sampler)


# -- the benchmark --------------------------------------------------------------------------------------------
def single_argv(pair: str, src: Path, out: Path, options: tuple[str, ...], report: Path) -> list[str]:
    # what the batch runs for each job (converters/apps/batch.py BatchJob.argv), written as a user would
    return [sys.executable, "-m", "qconvert", pair, str(src), str(out), *options, "--quiet", "--report", str(report)]


def _first_error(stderr_path: Path) -> str:
    lines = stderr_path.read_text(errors="replace").splitlines()
    return next((ln for ln in lines if ln.startswith("qconvert: error:")), lines[-1] if lines else "no output")


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def bench(work: Path, size_mb: float, n_jobs: int, workers: int, keep: bool) -> dict:
    model, model_info = build_model(work, size_mb)
    jobs = JOBS[:n_jobs]
    run = work / "run"
    failures: list[str] = []

    # 1. the sequential loop; each output hashed, then deleted, so the disk holds one run's outputs at a time
    seq_dir = _fresh(run / "sequential")
    rows = []
    for name, pair, options in jobs:
        out = seq_dir / name
        secs, rc, peak = run_waited(single_argv(pair, model, out, options, seq_dir / f"{name}.report.json"),
                                    seq_dir / f"{name}.stderr")
        row = {"out": name, "pair": pair, "options": list(options), "seq_seconds": round(secs, 2),
               "seq_peak_mb": round(peak / MB, 1), "out_mb": round(tree_bytes(out) / MB, 1),
               "seq_sha256": tree_digest(out) if rc == 0 else None}
        if rc != 0:
            failures.append(f"sequential {name}: {_first_error(seq_dir / f'{name}.stderr')}")
        print(f"  sequential {name:<20} {secs:7.2f} s  {peak / MB:8.1f} MB" + ("" if rc == 0 else "  FAILED"),
              flush=True)
        rows.append(row)
        if not keep:
            _remove(out)

    # 2. the batch, into fresh outputs and a fresh report folder (nothing to skip)
    batch_dir = _fresh(run / "batch")
    manifest = batch_dir / "manifest.json"
    outs = [str(batch_dir / "out" / name) for name, _, _ in jobs]
    manifest.write_text(json.dumps({"jobs": [{"src": str(model), "pair": pair, "out": o, "options": list(options)}
                                             for (_, pair, options), o in zip(jobs, outs)]}, indent=2))
    print(f"  batch --workers {workers} ...", flush=True)
    br = run_batch_sampled([sys.executable, "-m", "qconvert", "batch", str(manifest), "--workers", str(workers),
                            "--report", str(batch_dir / "report")], outs, batch_dir / "batch.log")
    if br.returncode != 0:
        failures.append(f"batch exit {br.returncode}: {_first_error(batch_dir / 'batch.log')}")
    batch_jobs = {}
    report_json = batch_dir / "report" / "batch.json"
    if report_json.is_file():
        batch_jobs = {j["out"]: j for j in json.loads(report_json.read_text())["jobs"]}
    for row, o in zip(rows, outs):
        j = batch_jobs.get(o, {})
        row["batch_status"] = j.get("status", "missing")
        row["batch_seconds"] = j.get("seconds")
        row["batch_peak_mb"] = round(br.job_peaks[o] / MB, 1) if o in br.job_peaks else None
        row["batch_sha256"] = tree_digest(Path(o)) if Path(o).exists() else None
        row["identical"] = row["seq_sha256"] is not None and row["seq_sha256"] == row["batch_sha256"]
        if row["batch_status"] != "done":
            failures.append(f"batch {row['out']}: {row['batch_status']} {j.get('error', '')}".rstrip())
        elif row["seq_sha256"] is not None and not row["identical"]:
            failures.append(f"{row['out']}: the batch's output differs from the single command's")
    if not keep:
        _remove(batch_dir / "out")

    seq_total = sum(r["seq_seconds"] for r in rows)
    sampled = list(br.job_peaks.values())
    return {"model": {"path": str(model), **model_info}, "workers": workers, "cpus": os.cpu_count(),
            "jobs": rows, "sequential_seconds": round(seq_total, 2), "batch_seconds": round(br.seconds, 2),
            "ratio_sequential_over_batch": round(seq_total / br.seconds, 3) if br.seconds else None,
            "batch_worker_peak_mb_max": round(max(sampled) / MB, 1) if sampled else None,
            "batch_rusage_maxrss_mb": round(br.rusage_peak / MB, 1),
            "batch_parent_peak_mb": round(br.parent_peak / MB, 1),
            "batch_concurrent_workers_rss_peak_mb": round(br.concurrent_peak / MB, 1),
            "sequential_peak_mb_max": max(r["seq_peak_mb"] for r in rows),
            "sampler": br.sampler, "sample_seconds": SAMPLE_SECONDS,
            "all_identical": all(r["identical"] for r in rows), "failures": failures}


def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def format_table(res: dict) -> str:
    m = res["model"]
    lines = [f"model: {m['path']} ({m['format']}, hidden {m['hidden']}, {m['layers']} layers, {m['mb']} MB)",
             f"{res['cpus']} CPUs, batch --workers {res['workers']}", "",
             f"{'output':<20} {'pair':<14} {'options':<30} {'out MB':>8} {'seq s':>8} {'seq peak MB':>12} "
             f"{'batch s':>8} {'batch peak MB':>14} {'same bytes':>10}"]
    for r in res["jobs"]:
        lines.append(f"{r['out']:<20} {r['pair']:<14} {' '.join(r['options']) or '-':<30} {r['out_mb']:>8.1f} "
                     f"{r['seq_seconds']:>8.2f} {r['seq_peak_mb']:>12.1f} {_num(r['batch_seconds'], '.2f'):>8} "
                     f"{_num(r['batch_peak_mb'], '.1f'):>14} {'yes' if r['identical'] else 'NO':>10}")
    lines += ["",
              f"sequential loop wall time      {res['sequential_seconds']:.2f} s",
              f"batch --workers {res['workers']} wall time     {res['batch_seconds']:.2f} s",
              f"ratio sequential / batch       {_num(res['ratio_sequential_over_batch'], '.2f')}",
              f"peak RSS per worker (batch)    {_num(res['batch_worker_peak_mb_max'], '.1f')} MB (largest job process, "
              f"sampled every {res['sample_seconds']} s)",
              f"  wait4 bound, batch + workers {res['batch_rusage_maxrss_mb']:.1f} MB (exact high-water mark of any one "
              "process of the batch)",
              f"  workers' RSS at once, peak   {res['batch_concurrent_workers_rss_peak_mb']:.1f} MB; "
              f"batch process itself {res['batch_parent_peak_mb']:.1f} MB",
              f"peak RSS, sequential (max)     {res['sequential_peak_mb_max']:.1f} MB",
              f"outputs byte-identical         {sum(r['identical'] for r in res['jobs'])}/{len(res['jobs'])}"]
    lines += [f"FAILED: {f}" for f in res["failures"]]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/qconvert-bench-batch"),
                    help="the cached model and the runs' outputs")
    ap.add_argument("--size-mb", type=float, default=500, help="size of the synthetic GPTQ model (MB)")
    ap.add_argument("--jobs", type=int, default=len(JOBS), choices=range(1, len(JOBS) + 1), metavar=f"1..{len(JOBS)}",
                    help="run the first N of the ten conversions")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", type=Path, help="write the results as JSON")
    ap.add_argument("--keep", action="store_true", help="keep both runs' outputs (by default each is deleted "
                                                        "once hashed)")
    args = ap.parse_args()
    res = bench(args.work, args.size_mb, args.jobs, args.workers, args.keep)
    print(format_table(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())

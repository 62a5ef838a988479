"""Batch conversion: a manifest of jobs run by worker processes, resumable, each job isolated.

    qconvert batch MANIFEST [--workers N] [--report DIR] [--dry-run]

The manifest (YAML or JSON) holds `jobs` (each `src`, `pair` such as "gptq->gguf", `out`, `options`: a list of
CLI arguments) and/or a `matrix` (`sources`: folders or files; `targets`: entries with `to`, `options` and an
`out` pattern with `{name}`, the source's folder name or file stem, and `{to}`). The source format of a matrix
job is detected from its data, as `qconvert convert --to` does. Relative paths are relative to the manifest.

Every job is one `qconvert` process (`python -m qconvert PAIR SRC OUT ... --report`), so its output is the
single command's, byte for byte, and a job that fails or crashes is reported with its one-line error while
the others go on. A job is skipped when its output exists and the marker beside the report
(`REPORT/done/<job key>.json`) says that a run with the same source contents (SHA-256 of every file), pair,
options and qconvert version completed it; outputs are written atomically by each command, so a batch
killed midway (kill -9 included) resumes by running exactly the jobs without a marker.

Exit status: 0 when every job is done or skipped, 1 when any failed, 2 for a bad manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import __version__
from .errors import QConvertError

__all__ = ["BatchJob", "JobResult", "load_manifest", "run_batch", "default_workers"]

_PAIR = re.compile(r"^(?P<src>[A-Za-z0-9_.\-]+?)(?:->|:|=>)(?P<dst>[A-Za-z0-9_.\-]+)$")


@dataclass(frozen=True)
class BatchJob:
    src: Path
    pair: str  # "gptq->gguf", or "auto->gguf" for a matrix job (the source format detected)
    out: Path
    options: tuple[str, ...] = ()

    @property
    def target(self) -> str:
        return _PAIR.match(self.pair)["dst"]

    def argv(self, report: Path) -> list[str]:
        src_fmt = _PAIR.match(self.pair)["src"]
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


# -- the manifest ---------------------------------------------------------------------------------------------
def _bad(manifest: Path, what: str) -> QConvertError:
    return QConvertError(f"bad batch manifest: {what}", path=manifest)


def _strings(value, manifest: Path, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        import shlex

        return tuple(shlex.split(value))
    if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
        raise _bad(manifest, f"{where} must be a list of command-line arguments")
    return tuple(str(v) for v in value)


def load_manifest(manifest: Path) -> list[BatchJob]:
    """The jobs of a manifest file, paths resolved against its folder; QConvertError naming what is wrong."""
    manifest = Path(manifest)
    try:
        text = manifest.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise QConvertError(f"cannot read batch manifest ({getattr(e, 'strerror', None) or type(e).__name__})",
                            path=manifest) from None
    try:
        if manifest.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as e:  # json / yaml parse errors: their position is the useful part
        raise _bad(manifest, f"not valid {'JSON' if manifest.suffix.lower() == '.json' else 'YAML'} "
                             f"({str(e).splitlines()[0][:120]})") from None
    if not isinstance(data, dict) or not ({"jobs", "matrix"} & set(data)):
        raise _bad(manifest, "expected a mapping with `jobs` and/or `matrix`")
    base = manifest.resolve().parent
    jobs: list[BatchJob] = []
    for i, j in enumerate(data.get("jobs") or []):
        where = f"jobs[{i}]"
        if not isinstance(j, dict) or not all(isinstance(j.get(k), str) for k in ("src", "pair", "out")):
            raise _bad(manifest, f"{where} needs src, pair and out (strings)")
        if not _PAIR.match(j["pair"]):
            raise _bad(manifest, f"{where}.pair {j['pair']!r} is not SRC->DST")
        jobs.append(BatchJob(base / j["src"], j["pair"], base / j["out"], _strings(j.get("options"), manifest,
                                                                                    f"{where}.options")))
    matrix = data.get("matrix")
    if matrix is not None:
        if not isinstance(matrix, dict) or not isinstance(matrix.get("sources"), list) \
                or not isinstance(matrix.get("targets"), list):
            raise _bad(manifest, "matrix needs `sources` and `targets` lists")
        for k, t in enumerate(matrix["targets"]):
            if not isinstance(t, dict) or not isinstance(t.get("to"), str) or not isinstance(t.get("out"), str):
                raise _bad(manifest, f"matrix.targets[{k}] needs `to` and `out` (a pattern with {{name}})")
            if "{name}" not in t["out"]:
                raise _bad(manifest, f"matrix.targets[{k}].out {t['out']!r} has no {{name}}: every source would "
                                     "write the same output")
        for s in matrix["sources"]:
            if not isinstance(s, str):
                raise _bad(manifest, "matrix.sources must be paths (strings)")
            src = base / s
            name = src.stem if src.suffix else src.name
            for k, t in enumerate(matrix["targets"]):
                out = base / t["out"].format(name=name, to=t["to"])
                jobs.append(BatchJob(src, f"auto->{t['to']}", out,
                                     _strings(t.get("options"), manifest, f"matrix.targets[{k}].options")))
    outs = [j.out.resolve() for j in jobs]
    dup = next((o for o in outs if outs.count(o) > 1), None)
    if dup is not None:
        raise _bad(manifest, f"two jobs write {dup}")
    if not jobs:
        raise _bad(manifest, "no jobs")
    return jobs


# -- resuming -------------------------------------------------------------------------------------------------
def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and ".qconvert-tmp-" not in p.name)
    return []


def source_digest(path: Path, cache: dict) -> str:
    """SHA-256 over every file of the source (names and bytes); cached by (path, size, mtime) for the run."""
    h = hashlib.sha256()
    for p in _files(path):
        st = p.stat()
        key = (str(p), st.st_size, st.st_mtime_ns)
        if key not in cache:
            fh = hashlib.sha256()
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    fh.update(chunk)
            cache[key] = fh.hexdigest()
        h.update(p.relative_to(path).as_posix().encode() if p != path else p.name.encode())
        h.update(cache[key].encode())
    return h.hexdigest()


def job_key(job: BatchJob, digest: str) -> str:
    ident = json.dumps({"src": digest, "pair": job.pair, "options": list(job.options), "out": str(job.out.resolve()),
                        "version": __version__}, sort_keys=True)
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


def _out_bytes(out: Path) -> int:
    return sum(p.stat().st_size for p in _files(out))


# -- running --------------------------------------------------------------------------------------------------
def default_workers() -> int:
    """What the machine allows: one worker per core, at most one per 4 GB of memory (a conversion streams,
    but its largest tensors and the writer's buffers are held)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        mem = 8 << 30
    return max(1, min(cores, mem // (4 << 30)))


def _summarize(report_path: Path) -> tuple[dict, float | None, float | None]:
    rep = json.loads(report_path.read_text())
    errs = [t for t in rep["tensors"] if t.get("rmse") is not None]
    rms = None
    if errs:
        total = sum(t["shape"][0] * (t["shape"][1] if len(t["shape"]) > 1 else 1) for t in errs) or 1
        rms = (sum(t["rmse"] ** 2 * t["shape"][0] * (t["shape"][1] if len(t["shape"]) > 1 else 1)
                   for t in errs) / total) ** 0.5
    return rep["summary"]["verdicts"], rep["summary"]["max_abs_err"], rms


def _run_job(job: BatchJob, report_dir: Path, key: str, force: bool, dry_run: bool = False) -> JobResult:
    res = JobResult(str(job.src), job.pair, str(job.out), "failed", options=list(job.options))
    (report_dir / "jobs").mkdir(parents=True, exist_ok=True)
    report = report_dir / "jobs" / f"{key}.json"
    t0 = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "qconvert", *job.argv(report)] + (["--force"] if force else []) + \
        (["--dry-run"] if dry_run else [])
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    res.seconds = round(time.monotonic() - t0, 3)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("qconvert: error:")]
        res.error = lines[0] if lines else (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return res
    res.status = "planned" if dry_run else "done"
    res.bytes = 0 if dry_run else _out_bytes(job.out)
    res.verdicts, res.max_abs_err, res.rms_err = _summarize(report)
    return res


def run_batch(jobs: list[BatchJob], report_dir: Path, workers: int, dry_run: bool = False, force: bool = False,
              progress: bool = True) -> list[JobResult]:
    """Run (or with dry_run, plan: each command with --dry-run) every job not already done; `force` replaces outputs a job finds in its
    way (without it such a job fails as the single command would: "output exists")."""
    from tqdm import tqdm

    report_dir = Path(report_dir)
    (report_dir / "done").mkdir(parents=True, exist_ok=True)
    cache: dict = {}
    results: list[JobResult | None] = [None] * len(jobs)
    todo = []
    for i, job in enumerate(jobs):
        if not job.src.exists():
            results[i] = JobResult(str(job.src), job.pair, str(job.out), "failed",
                                   error=f"qconvert: error: {job.src}: no such file or directory",
                                   options=list(job.options))
            continue
        key = job_key(job, source_digest(job.src, cache))
        marker = report_dir / "done" / f"{key}.json"
        if marker.is_file() and job.out.exists():
            done = JobResult(**json.loads(marker.read_text()))
            done.status, done.seconds = "skipped", 0.0
            results[i] = done
        else:
            todo.append((i, job, key, marker))

    def work(item):
        i, job, key, marker = item
        res = _run_job(job, report_dir, key, force, dry_run)
        if res.status == "done":  # the marker last: a job killed before it runs again
            tmp = marker.with_suffix(".tmp")
            tmp.write_text(json.dumps(asdict(res)))
            tmp.replace(marker)
        return i, res

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool, \
            tqdm(total=len(todo), desc="Jobs", unit="job", disable=not progress or not todo) as bar:
        for i, res in pool.map(work, todo):
            results[i] = res
            bar.update(1)
    final = [r for r in results if r is not None]
    write_reports(report_dir, final)
    return final


def write_reports(report_dir: Path, results: list[JobResult]) -> None:
    counts = {s: sum(r.status == s for r in results) for s in ("done", "skipped", "failed", "planned")}
    (report_dir / "batch.json").write_text(json.dumps({"qconvert": __version__, "counts": counts,
                                                       "jobs": [asdict(r) for r in results]}, indent=2) + "\n")
    rows = ["| src | pair | out | status | seconds | bytes | verdicts | max abs err | rms err | error |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        verdicts = ", ".join(f"{v} {k}" for k, v in r.verdicts.items() if v)
        err = "-" if r.max_abs_err is None else f"{r.max_abs_err:.3g}"
        rms = "-" if r.rms_err is None else f"{r.rms_err:.3g}"
        rows.append(f"| {r.src} | {r.pair} | {r.out} | {r.status} | {r.seconds} | {r.bytes} | {verdicts} | {err} | "
                    f"{rms} | {r.error.replace('|', '/')} |")
    summary = ", ".join(f"{v} {k}" for k, v in counts.items() if v)
    (report_dir / "batch.md").write_text(f"# qconvert batch ({summary})\n\n" + "\n".join(rows) + "\n")

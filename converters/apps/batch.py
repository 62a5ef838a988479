"""Batch conversion: a manifest of jobs run by worker processes, resumable, each job isolated.

    qconvert batch MANIFEST [--workers N] [--report DIR] [--dry-run] [--force] [--ray [ADDRESS]]
                            [--verify [--max-kl X]]

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

With `--ray`, each job is one Ray task (a local Ray started for the batch, or a cluster joined at ADDRESS) that
runs the same `qconvert` process on whichever node Ray picks, so the bytes are the local workers'. The nodes
read sources and write outputs and per-job reports at the paths the driver gives, hence a filesystem shared
at the same path on every node; the driver alone writes the markers and the batch reports.

With `--verify`, each converted job is measured by a second process, `qconvert verify SRC OUT --logits`
(its report in REPORT/verify/<job key>.json); the figures go into the job's result and marker.

Exit status: 0 when every job is done or skipped, 1 when any failed (or failed its quality gate), 2 for a bad
manifest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from ... import __version__
from ...kernels import usable_cpus
from ..errors import QConvertError
from .batch_jobs import PAIR, BatchJob, JobResult

__all__ = ["BatchJob", "JobResult", "load_manifest", "run_batch", "default_workers", "job_memory_bytes"]


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
        if not PAIR.match(j["pair"]):
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
    cores = usable_cpus()
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


def _error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("qconvert: error:")]
    return lines[0] if lines else (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]


def _run_job(job: BatchJob, report_dir: Path, key: str, force: bool, dry_run: bool = False,
             env_overrides: dict[str, str] | None = None, verify: bool = False,
             converted: JobResult | None = None) -> JobResult:
    """One job's `qconvert` process, on this machine or (as a Ray task) on a node; `env_overrides` carries the
    driver's QCONVERT_* settings to a node whose environment is not the driver's. With `verify`, a second
    process, `qconvert verify SRC OUT --logits`, measures the output in its runtime; given `converted` (a job done
    by an earlier run without --verify), only that runs."""
    (report_dir / "jobs").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **(env_overrides or {}), "PYTHONUNBUFFERED": "1"}
    if converted is None:
        res = JobResult(str(job.src), job.pair, str(job.out), "failed", options=list(job.options))
        report = report_dir / "jobs" / f"{key}.json"
        t0 = time.monotonic()
        argv = [sys.executable, "-m", "qconvert", *job.argv(report)] + (["--force"] if force else []) + \
            (["--dry-run"] if dry_run else [])
        proc = subprocess.run(argv, capture_output=True, text=True, env=env)
        res.seconds = round(time.monotonic() - t0, 3)
        if proc.returncode != 0:
            res.error = _error_line(proc)
            return res
        res.status = "planned" if dry_run else "done"
        res.bytes = 0 if dry_run else _out_bytes(job.out)
        res.verdicts, res.max_abs_err, res.rms_err = _summarize(report)
    else:
        res = converted
    if verify and not dry_run:
        (report_dir / "verify").mkdir(exist_ok=True)
        _verify_job(job, report_dir / "verify" / f"{key}.json", env, res)
    return res


def _verify_job(job: BatchJob, report: Path, env: dict, res: JobResult) -> None:
    """The quality gate of one converted job, in its own process (two models, one after the other, in the
    runtimes that own their formats); its figures, or the one-line error that stopped it, go into `res`."""
    t0 = time.monotonic()
    argv = [sys.executable, "-m", "qconvert", "verify", str(job.src), str(job.out), "--logits", "--quiet",
            "--report", str(report)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    res.seconds = round(res.seconds + time.monotonic() - t0, 3)
    if proc.returncode != 0:
        res.verify = _error_line(proc)
        return
    logits = json.loads(report.read_text())["logits"]
    res.verify = "measured"
    for k in ("kl_mean", "kl_max", "top1_agreement", "ppl_source", "ppl_output"):
        setattr(res, k, logits[k])


# The thread pools of a job's process: torch's intra-op (OpenMP) threads and the K-quantizer's (QCONVERT_THREADS).
_THREAD_VARIABLES = ("OMP_NUM_THREADS", "QCONVERT_THREADS")


def job_threads(cores: int, in_flight: int) -> dict[str, str]:
    """Each of `in_flight` jobs gets its share of the cores, unless the user set the variables. Every job
    sized to the whole machine would put two spinning OpenMP pools on each core: on 2 cores a batch of two
    such workers ran 0.90x a sequential loop. The bytes do not depend on the thread count."""
    share = str(max(1, cores // max(1, in_flight)))
    return {v: share for v in _THREAD_VARIABLES if v not in os.environ}


class _LocalJobs:
    """Jobs run by threads of this process, each waiting on its job's `qconvert` process."""

    def __init__(self, workers: int | None):
        self.in_flight = max(1, workers or default_workers())
        self._env = job_threads(usable_cpus(), self.in_flight)

    def run(self, job: BatchJob, report_dir: Path, key: str, force: bool, dry_run: bool, verify: bool = False,
            converted: JobResult | None = None) -> JobResult:
        return _run_job(job, report_dir, key, force, dry_run, self._env, verify=verify, converted=converted)

    def close(self) -> None:
        pass


def _ray_module():
    try:
        import ray
    except ImportError:
        raise QConvertError('--ray needs ray (pip install "qconvert[batch]")') from None
    return ray


class _RayJobs:
    """Jobs run as Ray tasks: the same `_run_job` on a node, one task per job declaring one CPU and the memory
    its conversion needs; at most `workers` (default: the cluster's CPUs) in flight."""

    def __init__(self, address: str | None, workers: int | None):
        ray = self._ray = _ray_module()
        quiet = dict(include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
        try:
            with _stderr_held() as held:
                if address:
                    _check_reachable(address)
                    ray.init(address=address, **quiet)
                else:
                    # "local", not None: ray.init(None) would join a cluster it finds through RAY_ADDRESS or the
                    # last `ray start` on this machine; without an address the user asked for a Ray of the batch's
                    # own. Only job results (a few KB each) travel through its object store.
                    ray.init(address="local", object_store_memory=_LOCAL_OBJECT_STORE_BYTES, **quiet)
        except Exception as e:  # ConnectionError, a timeout, a version mismatch: Ray's first line says which
            where = f"cannot join the Ray cluster at {address}" if address else "cannot start a local Ray"
            hint = "; the cluster wants its token: set RAY_AUTH_MODE=token and put the head's ~/.ray/auth_token " \
                   "here (or set RAY_AUTH_TOKEN)" if "InvalidAuthToken" in held.text else ""
            raise QConvertError(f"--ray: {where} ({_first_line(e)}){hint}") from None
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        self.largest_node_memory = max((int(n["Resources"].get("memory", 0)) for n in nodes), default=0)
        self.in_flight = max(1, workers or int(ray.cluster_resources().get("CPU", 1)))
        # max_retries=0: a job whose node died is reported failed, as a crashed local job is, and the next run
        # of the batch resumes it; a retry could find the output its first attempt had already renamed in place
        self._task = ray.remote(num_cpus=1, max_retries=0)(_run_job)
        # a task declares one CPU (Ray sets its OMP_NUM_THREADS=1); its K-quantizer takes one thread too
        self._env = {"QCONVERT_THREADS": "1", **{k: v for k, v in os.environ.items() if k.startswith("QCONVERT_")}}
        _format_name("gguf")  # loads the format registry now: the job threads would race to load it

    def run(self, job: BatchJob, report_dir: Path, key: str, force: bool, dry_run: bool, verify: bool = False,
            converted: JobResult | None = None) -> JobResult:
        need = job_memory_bytes(job.src, job.target)
        if need > self.largest_node_memory:  # Ray would wait forever for a node that can take it
            return _failed(job, f"qconvert: error: {job.src}: needs about {need / (1 << 30):.1f} GiB of memory "
                                f"(estimated from its largest tensor), more than any Ray node has "
                                f"({self.largest_node_memory / (1 << 30):.1f} GiB)")
        ref = self._task.options(memory=need).remote(job, report_dir, key, force, dry_run, self._env, verify,
                                                     converted)
        try:
            return self._ray.get(ref)
        except self._ray.exceptions.RayError as e:  # the task, its worker or its node died (OOM kill included)
            return _failed(job, f"qconvert: error: {job.src}: the Ray task failed ({_first_line(e)})")

    def close(self) -> None:
        self._ray.shutdown()  # stops the local Ray this batch started; from a cluster, only disconnects


_LOCAL_OBJECT_STORE_BYTES = 256 << 20


class _HeldStderr:
    text = ""


@contextmanager
def _stderr_held():
    """File descriptor 2 sent to a temporary file while Ray connects: its C++ client writes a line a second
    there while it retries (a wrong token, a head still starting); what it wrote is kept as `.text`."""
    held = _HeldStderr()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield held
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            held.text = sink.read().decode(errors="replace")


def _check_reachable(address: str) -> None:
    """Fail in seconds on a HOST:PORT nothing listens at: ray.init retries such an address for many minutes."""
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():  # "auto", or a form Ray resolves itself
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
    except OSError as e:
        raise ConnectionError(f"nothing answers at {host}:{port}: {e.strerror or type(e).__name__}") from None


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__


def _failed(job: BatchJob, error: str) -> JobResult:
    return JobResult(str(job.src), job.pair, str(job.out), "failed", error=error, options=list(job.options))


# Ray's `memory=` for a job: what its `qconvert` process holds at its peak, from peaks measured (getrusage) on
# synthetic GPTQ models whose largest tensor held 11M, 45M and 90M values: the interpreter, torch and the formats'
# code (about 250 MB), plus per value of the largest tensor (it is converted at once) about 29 bytes when
# requantizing (Q8_0, Q4_K_M), 11-13 when dequantizing to hf, 4.4 for an exact GGUF repack; the writers that
# write safetensors folders also hold one output shard (ShardWriter: up to 2 GiB; the output is float32 at most),
# the GGUF and UQFF writers stream.
_JOB_BASE_MEMORY = 512 << 20
_PEAK_BYTES_PER_VALUE = 32
_SHARD_BUFFER_BYTES = 2 << 30
_STREAMING_TARGETS = frozenset({"gguf", "uqff"})


def job_memory_bytes(src: Path, target: str) -> int:
    """About what one job converting `src` to the format `target` holds at its peak (see above)."""
    values = [v for p in _files(src) for v in _tensor_values(p)]
    need = _JOB_BASE_MEMORY + _PEAK_BYTES_PER_VALUE * max(values, default=0)
    if _format_name(target) not in _STREAMING_TARGETS:
        need += min(_SHARD_BUFFER_BYTES, 4 * sum(values))
    return need


def _format_name(name: str) -> str:
    """The canonical name of a format or alias ("llama.cpp" -> "gguf"); an unknown one is returned as given."""
    from ..registry import get_format  # imports torch and the formats: paid once, by a Ray batch's driver

    try:
        return get_format(name).name
    except QConvertError:
        return name


def _tensor_values(path: Path) -> list[int]:
    """The number of values of each tensor of a file, from its header where one is read cheaply (safetensors,
    GGUF). Integer tensors are taken as packed 4-bit codes, 2 values a byte (GPTQ, HQQ, QQQ pack 32-bit words;
    4 bits is the densest packing in common use). Any other file, or one whose header does not read (the job
    will say why), counts as one tensor of 16-bit values: its largest tensor is no bigger."""
    from ...formats.common.safetensors_header import DTYPE_BITS, read_header

    try:
        if path.suffix == ".safetensors":
            return [(t.end - t.begin) * 8 // (4 if t.dtype[0] in "IU" else DTYPE_BITS[t.dtype])
                    for t in read_header(path).tensors.values()]
        if path.suffix == ".gguf":
            from ...formats.gguf.reader import scan_header

            return [math.prod(t.dims) for t in scan_header(path).tensors]
    except QConvertError:
        pass
    return [path.stat().st_size // 2]


def run_batch(jobs: list[BatchJob], report_dir: Path, workers: int | None, dry_run: bool = False, force: bool = False,
              progress: bool = True, use_ray: bool = False, ray_address: str | None = None, verify: bool = False,
              max_kl: float | None = None) -> list[JobResult]:
    """Run (or with dry_run, plan: each command with --dry-run) every job not already done; `force` replaces outputs a job finds in its
    way (without it such a job fails as the single command would: "output exists"). `workers` caps the jobs in
    flight (None: what the machine, or with `use_ray` the Ray cluster at `ray_address` or a local one, allows).

    `verify` adds the quality gate to every job: `qconvert verify SRC OUT --logits` after the conversion, and for a
    job an earlier run completed without a measurement, the measurement alone (the output is not converted
    again). `max_kl` judges each measured job by its mean KL; it is applied to every run's results afresh."""
    from tqdm import tqdm

    # absolute: a Ray task runs in a working directory of its own, on a node that sees the paths the driver does
    report_dir = Path(report_dir).resolve()
    if use_ray:
        _ray_module()  # refused before anything is hashed or written
    (report_dir / "done").mkdir(parents=True, exist_ok=True)
    cache: dict = {}
    results: list[JobResult | None] = [None] * len(jobs)
    todo = []
    for i, job in enumerate(jobs):
        if not job.src.exists():
            results[i] = _failed(job, f"qconvert: error: {job.src}: no such file or directory")
            continue
        key = job_key(job, source_digest(job.src, cache))
        marker = report_dir / "done" / f"{key}.json"
        if marker.is_file() and job.out.exists():
            done = JobResult(**json.loads(marker.read_text()))
            done.status, done.seconds = "skipped", 0.0
            if verify and not dry_run and done.verify != "measured":  # measure it; the conversion stays
                todo.append((i, job, key, marker, done))
            else:
                results[i] = done
        else:
            todo.append((i, job, key, marker, None))

    def work(item):
        i, job, key, marker, converted = item
        res = runner.run(job, report_dir, key, force, dry_run, verify, converted)
        if res.status in ("done", "skipped"):  # the marker last: a job killed before it runs again
            tmp = marker.with_suffix(".tmp")
            tmp.write_text(json.dumps(asdict(res)))
            tmp.replace(marker)
        return i, res

    if todo:  # a batch with every job done starts no Ray
        runner = _RayJobs(ray_address, workers) if use_ray else _LocalJobs(workers)
        try:
            with ThreadPoolExecutor(max_workers=runner.in_flight) as pool, \
                    tqdm(total=len(todo), desc="Jobs", unit="job", disable=not progress) as bar:
                for i, res in pool.map(work, todo):
                    results[i] = res
                    bar.update(1)
        finally:
            runner.close()
    final = [r for r in results if r is not None]
    for r in final:
        r.gate = "" if max_kl is None or r.verify != "measured" else \
            "passed" if r.kl_mean <= max_kl else f"failed: KL mean {r.kl_mean:.4g} above --max-kl {max_kl:g}"
    write_reports(report_dir, final)
    return final


def job_counts(results: list[JobResult]) -> dict[str, int]:
    """Jobs per status, and those whose quality gate failed (`--verify`): batch.json's and the CLI's summary."""
    counts = {s: sum(r.status == s for r in results) for s in ("done", "skipped", "failed", "planned")}
    counts["verify failed"] = sum(r.verify_failed for r in results)
    return counts


def write_reports(report_dir: Path, results: list[JobResult]) -> None:
    """REPORT/batch.json (every field of every job), REPORT/batch.md (the table a person reads) and
    REPORT/batch.png (per-layer error of every job, and KL where measured; converters/apps/batch_plot.py)."""
    from .batch_plot import INSTALL_HINT, load_job_reports, matplotlib_available, plot_layer_errors

    counts = job_counts(results)
    (report_dir / "batch.json").write_text(json.dumps({"qconvert": __version__, "counts": counts,
                                                       "jobs": [asdict(r) for r in results]}, indent=2) + "\n")
    measured = any(r.verify for r in results)
    head = ["src", "pair", "out", "status", "seconds", "bytes", "verdicts", "max abs err", "rms err"] + \
        (["KL mean", "KL max", "top-1", "ppl src / out", "quality"] if measured else []) + ["error"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def num(v, fmt=".3g"):
        return "-" if v is None else format(v, fmt)

    for r in results:
        verdicts = ", ".join(f"{v} {k}" for k, v in r.verdicts.items() if v)
        cells = [r.src, r.pair, r.out, r.status, str(r.seconds), str(r.bytes), verdicts, num(r.max_abs_err),
                 num(r.rms_err)]
        if measured:
            quality = r.gate or r.verify or "-"
            cells += [num(r.kl_mean), num(r.kl_max), num(r.top1_agreement, ".4f"),
                      f"{num(r.ppl_source, '.5g')} / {num(r.ppl_output, '.5g')}", quality]
        rows.append("| " + " | ".join(c.replace("|", "/") for c in cells + [r.error]) + " |")
    summary = ", ".join(f"{v} {k}" for k, v in counts.items() if v)
    png = plot_layer_errors(results, load_job_reports(report_dir), report_dir / "batch.png")
    figure = "![per-layer RMS error of every job](batch.png)" if png else \
        INSTALL_HINT if not matplotlib_available() else "the per-layer error plot was not written (see the warning)"
    (report_dir / "batch.md").write_text(f"# qconvert batch ({summary})\n\n" + "\n".join(rows) + f"\n\n{figure}\n")

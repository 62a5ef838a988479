"""One conversion split into parts that run in parallel (`--workers N` processes here, `--ray` tasks on a
cluster), with the same bytes as `run.convert`.

The driver plans once, from the headers (run.plan_conversion), checks the plan, and cuts the (record, plan)
pairs into parts (a worker plans nothing: it gets the driver's plans and writer once, as SplitJob, opens the
source's headers and takes its parts' records by their place in the stream, reading only their bytes): consecutive tensors of one source file, at most `part_values` source values each (so a
part reads only its own bytes of one shard; the cut depends on the plan alone, never on the worker count, so
a re-run with other workers resumes the same parts). The writer's `open_split` writes what only the driver
writes first (GGUF: the header, which fixes where every tensor's bytes go); each part's `open_part` session
converts its tensors, writes them at their places, and measures each one as run.convert does. The driver then
writes what comes last (`finish`) and the report, and renames the files next to OUT.

Resuming: the work happens in `.<OUT name>.qconvert-split` beside OUT, which holds the plan's fingerprint and,
per finished part, a manifest (parts/NNNNN.json) with the sha256 of every byte range it wrote and its tensors'
measured errors. A re-run of the same plan keeps each part whose ranges still hash to its manifest and redoes
the others (missing, unfinished, or not verifying); another plan (other options, a changed source) starts over.

Memory: a part holds one tensor at a time (its source values, their float32 dequantization, the encoded bytes
and the decoded values), so what it needs is bounded by its largest tensor, estimated as batch's jobs are
(`part_memory_bytes`); a part needing more than a worker may use is refused before any starts.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from .checker import EXACT, NEAR_EXACT
from .errors import QConvertError
from .plan import BitIdentical, Options, TensorPlan, Writer, check_plan
from .registry import get_format
from .report import NotFinite, Report, TensorResult, kernel_summary, measure
from .run import _not_finite_refusal, device_scope, open_source, plan_conversion, return_large_buffers
from ..kernels import kernel_trace

__all__ = ["convert_split", "SplitStats", "Part", "make_parts", "part_memory_bytes", "run_part_on_node",
           "ProcessWorkers", "DEFAULT_PART_VALUES"]

DEFAULT_PART_VALUES = 250_000_000  # source values per part: 1 GB as float32 (--part-size 1G)
# what a part's process holds at its peak: the interpreter, torch and the formats (~250 MB), plus per value of
# its largest tensor about 29 bytes when requantizing (measured for batch jobs: converters/apps/batch.py)
_PART_BASE_MEMORY = 512 << 20
_PEAK_BYTES_PER_VALUE = 32


@dataclass(frozen=True)
class Part:
    index: int
    pairs: tuple[int, ...]  # indices into the planned (record, plan) pairs
    largest_values: int
    first: str  # the first tensor's name, and the source file, to name the part in a message
    source_file: str

    def label(self, total: int) -> str:
        more = f" and {len(self.pairs) - 1} more tensor(s)" if len(self.pairs) > 1 else ""
        return f"part {self.index + 1} of {total} ({self.first}{more}, from {self.source_file})"


@dataclass
class SplitStats:
    parts: int = 0
    kept: int = 0  # verified from an earlier run, not redone
    converted: int = 0
    workers: int = 0


@dataclass(frozen=True)
class SplitJob:
    """What a worker on any node needs to convert its parts, sent once per worker: the driver's plan (the
    writer as planning left it, every tensor's TensorPlan, the source files' sizes and times), where the
    split's files are, and the plan's fingerprint. A worker plans nothing: it opens the source's headers and
    takes the records of its parts by their place in the stream."""

    src_format: str
    src_path: str
    dst_format: str
    options: Options
    folder: str
    layout: Any
    fingerprint: str
    part_values: int
    writer: Writer
    plans: list
    files: list  # source_files(): what the plan read, checked on the node before a byte is read
    threads: int = 1


def make_parts(pairs, part_values: int, group_of=lambda plan: None) -> list[Part]:
    """Consecutive pairs of one source file, at most `part_values` values each (a larger tensor alone); never
    cut inside a group (`Writer.part_group`): a group may span files and values."""
    parts, current, values, largest = [], [], 0, 0
    last_of: dict = {}
    for i, (_, plan) in enumerate(pairs):
        g = group_of(plan)
        if g is not None:
            last_of[g] = i
    open_until = -1  # the last pair of a group begun in the current part

    def close():
        rec0, plan0 = pairs[current[0]]
        parts.append(Part(len(parts), tuple(current), largest, plan0.name, plan0.source_file or str(rec0.source_file)))

    for i, (rec, plan) in enumerate(pairs):
        n = math.prod(plan.shape) if plan.shape else 1
        if current and i > open_until and (plan.source_file != pairs[current[-1]][1].source_file
                                           or values + n > part_values):
            close()
            current, values, largest = [], 0, 0
        g = group_of(plan)
        if g is not None:
            open_until = max(open_until, last_of[g])
        current.append(i)
        values += n
        largest = max(largest, n)
    if current:
        close()
    return parts


def part_memory_bytes(part: Part) -> int:
    return _PART_BASE_MEMORY + _PEAK_BYTES_PER_VALUE * part.largest_values


def machine_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def source_files(source) -> list[list]:
    """[name, size, mtime_ns] of every file the source's tensors are read from."""
    files = []
    for f in source.weight_files():
        p = Path(source.path) / f if Path(source.path).is_dir() else Path(source.path)
        st = p.stat()
        files.append([str(f), st.st_size, st.st_mtime_ns])
    return files


def plan_fingerprint(src_format: str, source, dst_format: str, options: Options, plans: list[TensorPlan],
                     part_values: int) -> str:
    """The plan and what its bytes depend on: the options, every source file's size and mtime, the tensors'
    targets and verdicts, the cut into parts."""
    files = [tuple(f) for f in source_files(source)]
    doc = {"src": src_format, "dst": dst_format, "files": files, "part_values": part_values,
           "options": [options.type, options.tensor_types, options.allow_requant, sorted(map(str, options.extra.items())),
                       str(options.device)],
           "plans": [[p.name, p.out_name, p.target, p.verdict, list(p.shape), p.source_file] for p in plans]}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


class _RecordStream:
    """The source's records as the writer takes them (`adapt_records`), in the stream order the driver planned,
    advanced to each part's records: the records before them are passed over, not loaded (a reader whose
    records read their parameters on use, `TensorRecord.params_loader`, reads nothing of them), and a part
    earlier in the stream than the last one taken starts the stream again. A record that is not the planned
    tensor at its place means the node's source is not the driver's: refused."""

    def __init__(self, source, writer: Writer, plans: list[TensorPlan]):
        self.source, self.writer, self.plans = source, writer, plans
        self._start()

    def _start(self) -> None:
        self.records = iter(self.writer.adapt_records(self.source.records(), self.source))
        self.position = 0  # the index of the next record the stream yields

    def take(self, indices) -> Iterator[tuple[int, Any]]:
        for i in indices:
            if i < self.position:
                self._start()
            while True:
                rec = next(self.records, None)
                if rec is None:
                    raise QConvertError(f"the source on this node has fewer tensors than the driver planned "
                                        f"({self.position}, not {len(self.plans)})", path=self.source.path)
                self.position += 1
                if self.position - 1 == i:
                    break
            if rec.name != self.plans[i].name:
                raise QConvertError(f"the source on this node differs from the driver's: tensor {i} is {rec.name}, "
                                    f"planned {self.plans[i].name}", path=self.source.path)
            yield i, rec


# What a worker process holds for a job, by fingerprint: the source opened from its headers, the driver's
# writer and plans, and the record stream its parts advance.
_PREPARED: dict[str, tuple[Any, Writer, list, _RecordStream]] = {}


def _prepared(job: SplitJob):
    if job.fingerprint not in _PREPARED:
        with device_scope(job.options.device):
            source = open_source(job.src_format, Path(job.src_path), job.options)
        if source_files(source) != job.files:
            raise QConvertError("the source on this node differs from the driver's (its files' sizes or times)",
                                path=job.src_path)
        _PREPARED.clear()  # one job at a time: an earlier job's source and plans are not kept
        _PREPARED[job.fingerprint] = (source, job.writer, job.plans, _RecordStream(source, job.writer, job.plans))
    return _PREPARED[job.fingerprint]


def run_part(job: SplitJob, part: Part) -> dict:
    """Convert one part: each tensor loaded, encoded and written at its place, measured as run.convert measures
    it; the manifest (its written ranges and results) is written last, atomically, and returned."""
    source, writer, plans, stream = _prepared(job)
    results = []
    with device_scope(job.options.device):
        session = writer.open_part(Path(job.folder), source, plans, job.options, job.layout)
        for i, rec in stream.take(part.pairs):
            plan = plans[i]
            with kernel_trace() as used:
                item = rec.load()
                decoded = session.add(plan, item)
            reference = session.take_reference()
            try:
                max_err, rmse = ((0.0, 0.0) if isinstance(decoded, BitIdentical)
                                 else measure(item, decoded, reference))
            except NotFinite as e:
                raise _not_finite_refusal(e, rec, plan) from None
            del item, decoded, reference, rec
            verdict = plan.verdict
            if verdict == EXACT and max_err != 0.0:
                raise QConvertError(f"internal error: planned exact but measured max error {max_err:g}",
                                    tensor=plan.name)
            if verdict == NEAR_EXACT and max_err == 0.0:
                verdict = EXACT
            results.append({"pair": i, "verdict": verdict, "max_abs_err": max_err, "rmse": rmse,
                            "kernel": kernel_summary(used)})
        session.close()
    manifest = {"part": part.index, "pairs": list(part.pairs), "pid": os.getpid(),
                "written": [[w.file, w.offset, w.nbytes, w.sha256] for w in session.written], "results": results,
                "writer": session.part_record()}
    path = Path(job.folder) / "parts" / f"{part.index:05d}.json"
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(manifest))
    os.replace(tmp, path)
    return manifest


def run_part_on_node(job: SplitJob, part: Part) -> dict:
    """run_part in a worker (a process of ProcessWorkers, a Ray task): a refusal or a bug comes back as
    {"error": line}, for the driver to name the part in one line."""
    _use_threads(job.threads)
    return_large_buffers()
    try:
        return run_part(job, part)
    except QConvertError as e:
        return {"error": str(e)}
    except Exception as e:  # noqa: BLE001 - one line naming the part, not a worker's traceback
        return {"error": f"internal error: {type(e).__name__}: {e}"}


def _use_threads(threads: int) -> None:
    import torch

    os.environ["QCONVERT_THREADS"] = str(threads)  # the K-quantizer's threads, read per call
    torch.set_num_threads(threads)


def _verified(folder: Path, part: Part) -> dict | None:
    """The part's manifest if every range it wrote still hashes to it, else None (redo the part)."""
    path = folder / "parts" / f"{part.index:05d}.json"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("pairs") != list(part.pairs):
        return None
    for fname, offset, nbytes, digest in manifest["written"]:
        try:
            with open(folder / fname, "rb") as f:
                f.seek(offset)
                h, left = hashlib.sha256(), nbytes
                while left:
                    chunk = f.read(min(left, 16 << 20))
                    if not chunk:
                        return None
                    h.update(chunk)
                    left -= len(chunk)
        except OSError:
            return None
        if h.hexdigest() != digest:
            return None
    return manifest


class ProcessWorkers:
    """Parts run by `workers` processes of this machine, forked when this object is made: before the driver
    plans, while it has run no thread pool (a fork of a process whose pools have run, torch's OpenMP threads or
    the K-quantizer's, can inherit a lock one of them held, and hang). Each worker plans once from the headers,
    as a Ray node does, then converts the parts the driver sends it over its pipe; a worker that dies (killed,
    out of memory) fails the part it was converting in one line naming it."""

    def __init__(self, workers: int):
        import multiprocessing as mp

        self.workers = max(1, workers)
        ctx = mp.get_context("fork")
        self.procs, self.conns = [], []
        self.sent = [None] * self.workers  # the fingerprint of the job each worker holds
        for _ in range(self.workers):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(theirs,), daemon=True)
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(ours)

    def node_memory(self) -> int:
        return machine_memory_bytes()

    def run(self, job: SplitJob, parts: list[Part], total: int, progress: bool) -> list[dict]:
        from multiprocessing.connection import wait

        todo, done = list(parts), []
        held: dict[int, Part] = {}  # worker -> the part it is converting
        idle = list(range(len(self.procs)))
        while todo or held:
            while todo and idle:
                w = idle.pop(0)
                held[w] = todo.pop(0)
                try:  # the job (the plan) once per worker, then its parts
                    self.conns[w].send((None if self.sent[w] == job.fingerprint else job, job.fingerprint, held[w]))
                    self.sent[w] = job.fingerprint
                except OSError:  # the worker died while idle (killed between parts)
                    self.procs[w].join()
                    raise QConvertError(f"{held[w].label(total)} failed: its worker had ended (status "
                                        f"{self.procs[w].exitcode}) before it could take the part") from None
            ready = wait([self.conns[w] for w in held] + [self.procs[w].sentinel for w in held])
            for w in list(held):
                conn, proc = self.conns[w], self.procs[w]
                message = None
                if conn in ready or proc.sentinel in ready:
                    try:
                        message = conn.recv() if conn.poll() else None
                    except (EOFError, OSError):
                        message = None
                    if message is None and proc.sentinel in ready:
                        proc.join()
                        why = (f"killed (signal {-proc.exitcode})" if (proc.exitcode or 0) < 0
                               else f"ended with status {proc.exitcode}")
                        raise QConvertError(f"{held[w].label(total)} failed: its worker was {why}")
                if message is None:
                    continue
                part = held.pop(w)
                idle.append(w)
                if "error" in message:
                    raise QConvertError(f"{part.label(total)} failed: {message['error']}")
                done.append(message)
                if progress:
                    print(f"split: {len(done)} of {len(parts)} part(s) converted", file=sys.stderr)
        return done

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):  # our own workers, by their process
            if proc.is_alive():
                try:
                    conn.send(None)
                except OSError:
                    pass
        for conn, proc in zip(self.conns, self.procs):
            proc.join(timeout=5)
            if proc.exitcode is None:
                proc.kill()
                proc.join()
            conn.close()


def _worker_main(conn) -> None:
    """A forked worker: converts the parts it receives until None, answering each with the part's manifest or
    {"error": line}. A message is (job, fingerprint, part), the job (the driver's plan) sent with a worker's
    first part only and kept."""
    jobs: dict[str, SplitJob] = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the driver is gone
            return
        if message is None:
            return
        job, fingerprint, part = message
        if job is not None:
            jobs = {fingerprint: job}
        conn.send(run_part_on_node(jobs[fingerprint], part))


def work_folder(out: Path) -> Path:
    return out.with_name(f".{out.name}.qconvert-split")


def convert_split(src_format: str, src_path: Path, dst_format: str, out_path: Path, options: Options, workers,
                  *, force: bool = False, progress: bool = True, part_values: int = DEFAULT_PART_VALUES,
                  worker_memory: int | None = None) -> tuple[Report, SplitStats]:
    """run.convert's conversion, its tensors converted in parts by `workers` (ProcessWorkers, or the Ray
    executor of apps/split_ray.py); see the module docstring."""
    start = time.perf_counter()
    return_large_buffers()
    out = Path(out_path)
    target = get_format(dst_format)
    if not target.can_write:
        raise QConvertError(f"format {target.name!r} cannot be written yet")
    if out.exists() and not force:
        raise QConvertError("output exists; pass --force to replace it", path=out)
    with device_scope(options.device):
        source = open_source(src_format, src_path, options)
        writer = target.writer.for_conversion(source, options)
        pairs = plan_conversion(source, writer, options, progress)
    plans = [plan for _, plan in pairs]
    check_plan(plans, options.allow_requant)
    if type(writer).open_split is Writer.open_split:  # the default: this writer cannot be split
        raise QConvertError(f"--workers/--ray: a {target.name} output cannot be split into parts yet "
                            "(gguf, uqff, hf and gptq outputs can); convert without them")
    parts = make_parts(pairs, part_values, writer.part_group)
    limit = worker_memory or workers.node_memory()
    for part in parts:
        need = part_memory_bytes(part)
        if need > limit:
            raise QConvertError(f"{part.label(len(parts))} needs about {need / (1 << 30):.1f} GiB of memory (from its "
                                f"largest tensor), more than a worker may use ({limit / (1 << 30):.1f} GiB)")
    fingerprint = plan_fingerprint(src_format, source, dst_format, options, plans, part_values)
    folder = work_folder(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    folder.mkdir(exist_ok=True)
    with open(folder / "lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise QConvertError("another qconvert run is converting to this output", path=out) from None
        plan_file = folder / "plan.json"
        try:
            previous = json.loads(plan_file.read_text()).get("fingerprint")
        except (OSError, ValueError):
            previous = None
        if previous != fingerprint:  # another plan's parts: start over
            for entry in folder.iterdir():
                if entry.name != "lock":
                    shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        (folder / "parts").mkdir(exist_ok=True)
        for stale in (folder / "parts").glob("*.error"):
            stale.unlink()
        plan_file.write_text(json.dumps({"fingerprint": fingerprint, "part_values": part_values}))
        split_out = writer.open_split(folder, out.name, source, plans, options)
        manifests = {}
        for part in parts:
            m = _verified(folder, part)
            if m is not None:
                manifests[part.index] = m
        todo = [p for p in parts if p.index not in manifests]
        stats = SplitStats(len(parts), len(manifests), len(todo), getattr(workers, "workers", 0))
        threads = max(1, (os.cpu_count() or 1) // max(1, stats.workers)) if isinstance(workers, ProcessWorkers) else 1
        job = SplitJob(src_format, str(Path(src_path).absolute()), dst_format, options, str(folder.absolute()),
                       split_out.layout, fingerprint, part_values, writer, plans, source_files(source), threads)
        for m in workers.run(job, todo, len(parts), progress):
            manifests[m["part"]] = m
        split_out.finish([manifests[p.index].get("writer", {}) for p in parts])
        report = Report(source.format_name, target.name, str(src_path), str(out),
                        ignored_files=dict(source.ignored_files), not_carried=dict(source.not_carried))
        by_pair = {r["pair"]: r for m in manifests.values() for r in m["results"]}
        for i, plan in enumerate(plans):
            r = by_pair[i]
            plan.verdict = r["verdict"]
            report.results.append(TensorResult(plan, r["max_abs_err"], r["rmse"], r["kernel"]))
        finals = [out.with_name(f) for f in split_out.files]
        clashes = [f for f in finals if f.exists()]
        if clashes and not force:
            raise QConvertError("output exists; pass --force to replace it", path=clashes[0])
        for f, final in zip(split_out.files, finals):
            if final.is_dir() and not final.is_symlink():  # --force over a folder output
                shutil.rmtree(final)
            os.replace(folder / f, final)
    shutil.rmtree(folder, ignore_errors=True)
    report.seconds = time.perf_counter() - start
    return report, stats

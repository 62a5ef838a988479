"""The driver: Fuzzer plans the cases (the seed of each drawn with Random("master:reader:case")), runs them
and the seeds' own conversions (the references a structural mutation's output is compared with, cached under
--work/refs/CODE_HASH) in the fork pool, builds the GGUF seeds, and counts outcomes and records findings.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import tempfile
import time
from pathlib import Path

from . import common
from .child import child_build_gguf, child_case
from .classify import FINDING_OUTCOMES, SEVERITY, classify_case, compare_digests, compared_outcome
from .common import MB, read_text
from .pool import ForkPool
from .seeds import LLAMA_BUILDS, Seed, gguf_builds, gguf_seed_dir, is_done, seeds_for
from .tested_code import code_hash


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


class Fuzzer:
    def __init__(self, args):
        self.args = args
        self.work = Path(args.work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.cases_dir = Path(tempfile.mkdtemp(prefix="cases-", dir=self.work))
        self.pool = ForkPool(args.jobs)
        self.counts: dict[str, dict[str, int]] = {}
        self.kind_counts: dict[str, dict[str, dict[str, int]]] = {}  # reader -> mutation kind -> outcome -> cases
        self.command_seconds: dict[str, dict[str, float]] = {}  # reader -> command (and "case", the whole child) -> seconds
        self.findings: list[dict] = []
        self.seed_failures: list[str] = []
        self.refs: dict[tuple[str, str], object] = {}  # digest, None (seed failed) or [pending cases]
        self.ref_queue: list[dict] = []
        self.seed_of: dict[tuple[str, str], Seed] = {}
        self.findings_fh = None
        self.hash = getattr(args, "code_hash", None) or code_hash()
        for old in (self.work / "refs").glob("*"):  # references of older code versions, unused for an hour
            if old.name != self.hash and time.time() - old.stat().st_mtime > 3600:
                shutil.rmtree(old, ignore_errors=True)
        self.only = args.mutations
        self.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
        self._t0 = self._progress_at = time.monotonic()

    # -- seeds ---------------------------------------------------------------------------------------------
    def build_gguf_seeds(self) -> None:
        d = gguf_seed_dir(self.work)
        d.mkdir(parents=True, exist_ok=True)
        jobs = []
        for name, (fmt, src, extra) in gguf_builds().items():
            if not (d / f"{name}.gguf").exists() and is_done(src.parent if fmt == "gptq" else src):
                jobs.append({"how": "qconvert", "src_fmt": fmt, "src": str(src), "args": extra,
                             "dst": str(d / f"{name}.gguf")})
        wide = common.FIXTURES / "uqff" / "wide"
        try:
            import importlib.util
            have_llama = importlib.util.find_spec("llama_cpp") is not None
        except Exception:
            have_llama = False
        if have_llama and is_done(wide):
            todo = [(n, ft) for n, ft in LLAMA_BUILDS.items() if not (d / f"{n}.gguf").exists()]
            if todo:
                # the F32 file first (one job), then the quantizations
                jobs.append({"how": "llama", "src": str(wide), "f32": str(d / "wide-f32.gguf"), "ftype": todo[0][1],
                             "dst": str(d / f"{todo[0][0]}.gguf"), "first": True})
                for n, ft in todo[1:]:
                    jobs.append({"how": "llama", "src": str(wide), "f32": str(d / "wide-f32.gguf"), "ftype": ft,
                                 "dst": str(d / f"{n}.gguf")})
        for job in jobs:
            job.update(dir=str(Path(tempfile.mkdtemp(prefix="build-", dir=self.cases_dir))), timeout=600)

            def done(job, status, rusage, seconds, killed):
                if not Path(job["dst"]).exists():
                    self.seed_failures.append(f"gguf seed {Path(job['dst']).name}: "
                                              f"{read_text(Path(job['dir']) / 'build.err').strip()[-500:] or 'failed'}")
            if job.get("first"):  # the F32 file is shared: build it before the others start
                self.pool.drain()
                self.pool.submit(job, child_build_gguf, done)
                self.pool.drain()
            else:
                self.pool.submit(job, child_build_gguf, done)
        self.pool.drain()

    def ref_path(self, reader: str, seed: Seed) -> Path:
        mtime = int(max((p.stat().st_mtime for p in ([seed.path] if seed.kind == "file" else seed.path.rglob("*"))
                         if p.is_file()), default=0))
        return self.work / "refs" / self.hash / f"{reader}--{_safe(seed.name)}--{mtime}.json"

    # -- the seeds' own conversions (the silent-corruption references), made when a case first needs one ----
    def need_ref(self, reader: str, seed: Seed, pending=None) -> None:
        """Compare a pending case with the seed's conversion once it exists (pending None: start making it)."""
        key = (reader, seed.name)
        if key in self.refs:
            if isinstance(self.refs[key], list):  # being made
                if pending is not None:
                    self.refs[key].append(pending)
            elif pending is not None:
                self.finish(*pending, ref=self.refs[key])
            return
        path = self.ref_path(reader, seed)
        if path.exists():
            self.refs[key] = json.loads(path.read_text())
            if pending is not None:
                self.finish(*pending, ref=self.refs[key])
            return
        self.refs[key] = [pending] if pending is not None else []
        path.parent.mkdir(parents=True, exist_ok=True)
        case_dir = Path(tempfile.mkdtemp(prefix="ref-", dir=self.cases_dir))
        job = {"dir": str(case_dir), "reader": reader, "seed_name": seed.name, "seed_path": str(seed.path),
               "seed_kind": seed.kind, "seed_ignore": list(seed.ignore), "mutate": False, "ref_out": str(path), "timeout": self.args.timeout * 4,
               "inspect": True, "case": -1, "master_seed": self.args.seed, "targets": self.targets}
        self.ref_queue.append(job)

    def on_ref(self, job, status, rusage, seconds, killed) -> None:
        key = (job["reader"], job["seed_name"])
        o, _, _ = classify_case(Path(job["dir"]), status, rusage, killed)
        path = Path(job["ref_out"])
        waiting = self.refs[key]
        if not path.exists():
            self.refs[key] = None
            self.seed_failures.append(f"{job['reader']} seed {job['seed_name']}: its own conversion gave "
                                      f"{o.outcome}: {o.line}")
        else:
            self.refs[key] = json.loads(path.read_text())
        if path.exists() and o.outcome not in ("ok", "noisy"):
            self.seed_failures.append(f"{job['reader']} seed {job['seed_name']}: {o.outcome}: {o.line}")
        shutil.rmtree(job["dir"], ignore_errors=True)
        for pending in waiting:
            self.finish(*pending, ref=self.refs[key])

    def _submit_refs(self) -> None:
        while self.ref_queue:
            self.pool.submit(self.ref_queue.pop(0), child_case, self.on_ref)

    # -- cases ---------------------------------------------------------------------------------------------
    def case_job(self, reader: str, seed: Seed, case: int) -> dict:
        case_dir = self.cases_dir / f"{reader}-{case:05d}"
        if case_dir.exists():
            shutil.rmtree(case_dir)
        case_dir.mkdir(parents=True)
        return {"dir": str(case_dir), "reader": reader, "seed_name": seed.name, "seed_path": str(seed.path),
                "seed_kind": seed.kind, "seed_ignore": list(seed.ignore), "case": case, "master_seed": self.args.seed, "timeout": self.args.timeout,
                "only": self.only, "inspect": getattr(self.args, "inspect", True), "targets": self.targets}

    def on_case(self, job, status, rusage, seconds, killed) -> None:
        o, meta, res = classify_case(Path(job["dir"]), status, rusage, killed)
        pending = (job, o, meta, res, seconds)
        if res.get("digest") is not None and SEVERITY[o.outcome] < SEVERITY["silent"]:  # hf exited 0
            self.need_ref(job["reader"], self.seed_of[(job["reader"], job["seed_name"])], pending)
        else:
            self.finish(*pending, ref=None)

    def finish(self, job, o, meta, res, seconds, ref) -> None:
        case_dir = Path(job["dir"])
        reader = job["reader"]
        if ref is not None and res.get("digest") is not None:
            o = compared_outcome(o, meta, compare_digests(ref, res["digest"]))
        row = self.counts.setdefault(reader, {})
        row[o.outcome] = row.get(o.outcome, 0) + 1
        by_kind = self.kind_counts.setdefault(reader, {}).setdefault(meta.get("kind") or "-", {})
        by_kind[o.outcome] = by_kind.get(o.outcome, 0) + 1  # which mutations end exact / changed / refused
        times = self.command_seconds.setdefault(reader, {"case": 0.0})
        times["case"] = round(times["case"] + seconds, 3)
        for c in res.get("commands", ()):
            times[c["name"]] = round(times.get(c["name"], 0.0) + c["seconds"], 3)
        o.line = o.line.replace(str(case_dir / "in"), "IN").replace(str(case_dir), "CASE")
        record = None
        if o.outcome in FINDING_OUTCOMES:
            record = {"reader": reader, "seed": job["seed_name"], "seed_path": job["seed_path"], "case": job["case"],
                      "master_seed": job["master_seed"], "kind": meta.get("kind"), "mutation": meta.get("mutation"),
                      "structural": meta.get("structural"), "outcome": o.outcome, "command": o.command,
                      "line": o.line, "signature": o.signature, "seconds": round(seconds, 2),
                      "rss_growth_mb": round((res.get("rss_growth") or 0) / MB, 1), "only": job.get("only")}
            if self.args.keep:
                keep = Path(self.args.keep) / f"{reader}-{job['case']:05d}"
                shutil.rmtree(keep, ignore_errors=True)
                shutil.copytree(case_dir, keep, ignore=shutil.ignore_patterns("out", "out-debug", "tmp",
                                                                              ".*qconvert-tmp*"))
                (keep / "case.json").write_text(json.dumps(record, indent=1))
                record["kept"] = str(keep)
            self.findings.append(record)
            if self.findings_fh:
                self.findings_fh.write(json.dumps(record) + "\n")
                self.findings_fh.flush()
        if self.args.verbose or (record and not self.args.quiet):
            print(f"{reader:>8} #{job['case']:<5} {o.outcome:<13} {meta.get('mutation') or ''}"[:200]
                  + (f"\n{'':>16}{o.line[:180]!r}"[:200] if (record or self.args.verbose) and o.line else ""), flush=True)
        self.last = (o, meta, res)
        if self.args.summary_json and time.monotonic() - self._progress_at > 60:  # a long run's counts so far
            self._progress_at = time.monotonic()
            self.seconds = time.monotonic() - self._t0
            from .report import write_summary_json
            write_summary_json(Path(self.args.summary_json), self, finished=False)
        if not self.args.replay_mode:
            shutil.rmtree(case_dir, ignore_errors=True)

    def run(self, readers: list[str], n_cases: int) -> None:
        self.findings_fh = open(self.args.findings, "w") if self.args.findings else None
        t0 = self._t0 = time.monotonic()
        if "gguf" in readers:
            self.build_gguf_seeds()
        plan = []
        for reader in readers:
            seeds = seeds_for(reader, self.work)
            if self.args.max_seeds:
                seeds = seeds[: self.args.max_seeds]
            if not seeds:
                self.seed_failures.append(f"{reader}: no seeds (are the fixtures built?)")
                continue
            for case in range(n_cases):
                seed = seeds[random.Random(f"{self.args.seed}:{reader}:{case}").randrange(len(seeds))]
                plan.append((reader, seed, case))
                self.seed_of[(reader, seed.name)] = seed
        # every seed used is converted once as it is: the reference for silent corruption, and a check that the
        # seed itself is fine (a seed that fails is reported); these run first, alongside the first cases
        for (reader, _), seed in sorted(self.seed_of.items(), key=lambda kv: kv[0]):
            self.need_ref(reader, seed)
        # interleave the readers so that a slow one does not come last
        plan.sort(key=lambda x: (x[2], readers.index(x[0])))
        for reader, seed, case in plan:
            self._submit_refs()
            self.pool.submit(self.case_job(reader, seed, case), child_case, self.on_case)
        while self.pool.running or self.ref_queue:
            self._submit_refs()
            self.pool.drain()
        self.seconds = time.monotonic() - t0
        if self.findings_fh:
            self.findings_fh.close()
        shutil.rmtree(self.cases_dir, ignore_errors=True)

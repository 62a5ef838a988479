"""Benchmark: one requantizing conversion split into parts (`--workers N`, converters/split.py) against the
same conversion in one process.

Builds once (cached under --work) a synthetic GPTQ 4-bit g128 llama with a few wide layers
(scripts/synthetic_gptq.py: hidden 2048, intermediate 5632, --layers layers), then converts it to GGUF
--type q4_k_m (every grid requantized to the llama-quantize mix) three ways: one process (its kernels' threads
on every core), `--workers 1`, `--workers N` (each worker with cores / N threads), and one process on one
thread (QCONVERT_THREADS=1 OMP_NUM_THREADS=1: what the split's own scaling is measured against). Each run is timed; the
driver's peak RSS is os.wait4's (the kernel's high-water mark), each worker's is its VmHWM sampled from /proc
every 0.1 s (a forked worker's includes the pages it shares with the driver). Checks that every run wrote the
same bytes and prints the seconds, the speed-up and the peaks; --json PATH writes them. Nothing is asserted.

    python scripts/bench_split.py [--work DIR] [--layers 3] [--workers 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic_gptq import make_synthetic_gptq  # noqa: E402

SAMPLE_SECONDS = 0.1


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _hwm_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def run(src: Path, out: Path, extra: list[str], env: dict | None = None) -> dict:
    cmd = [sys.executable, "-m", "qconvert", "gptq->gguf", str(src), str(out), "--type", "q4_k_m",
           "--allow-requant", "--quiet", "--force", *extra]
    start = time.perf_counter()
    log = out.with_suffix(".log")
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, **(env or {})})
    workers: dict[int, float] = {}
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        for child in _children(proc.pid):
            hwm = _hwm_mb(child)
            if hwm is not None:
                workers[child] = max(workers.get(child, 0.0), hwm)
        time.sleep(SAMPLE_SECONDS)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{log.read_text()}")
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    label = " ".join(extra) or "(one process)"
    if env:
        label += " " + " ".join(f"{k}={v}" for k, v in env.items())
    return {"options": label, "seconds": round(seconds, 2),
            "driver_peak_mb": round(usage.ru_maxrss / 1024, 1),
            "worker_peak_mb": round(max(workers.values()), 1) if workers else None, "workers_seen": len(workers),
            "sha256": digest}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/qconvert-bench-split"))
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--part-size", default="200M", help="--part-size of the split runs")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    src = args.work / f"gptq-wide-{args.layers}"
    if not (src / ".done").exists():
        shutil.rmtree(src, ignore_errors=True)
        make_synthetic_gptq(src, hidden=2048, intermediate=5632, layers=args.layers, heads=16, kv_heads=16)
        (src / ".done").write_text("ok")
    one_thread = {"QCONVERT_THREADS": "1", "OMP_NUM_THREADS": "1"}
    runs = [run(src, args.work / "one.gguf", []),
            run(src, args.work / "w1.gguf", ["--workers", "1", "--part-size", args.part_size]),
            run(src, args.work / f"w{args.workers}.gguf", ["--workers", str(args.workers), "--part-size", args.part_size]),
            run(src, args.work / "one-1t.gguf", [], one_thread)]
    same = len({r["sha256"] for r in runs}) == 1
    print(f"{'options':<40} {'s':>8} {'driver peak MB':>15} {'worker peak MB':>15}")
    for r in runs:
        print(f"{r['options']:<40} {r['seconds']:>8.2f} {r['driver_peak_mb'] or 0:>15.1f} {r['worker_peak_mb'] or 0:>15.1f}")
    result = {"layers": args.layers, "runs": runs, "same_bytes": same, "cpus": os.cpu_count(),
              "speedup_vs_one_process": round(runs[0]["seconds"] / runs[2]["seconds"], 2),
              "speedup_vs_one_worker": round(runs[1]["seconds"] / runs[2]["seconds"], 2),
              "speedup_vs_one_thread": round(runs[3]["seconds"] / runs[2]["seconds"], 2)}
    print(f"speed-up with {args.workers} workers: {result['speedup_vs_one_process']}x one process, "
          f"{result['speedup_vs_one_worker']}x one worker, {result['speedup_vs_one_thread']}x one process on one "
          f"thread; same bytes: {'yes' if same else 'NO'}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark: whole conversions timed as a user times them, qconvert against the route a llama.cpp user
takes today, on synthetic GPTQ 4-bit g128 llamas (scripts/synthetic_gptq.py) of real widths.

For each case, each round, interleaved (qconvert first in odd rounds, the llama.cpp route first in even
ones), every command a fresh process:

  qconvert          `qconvert SRC->gguf SRC OUT --type T [--allow-requant] --report R`
  llama.cpp route   llama.cpp's own converter (convert_hf_to_gguf.py from the llama-cpp-python sdist,
                    scripts/llama_cpp_reference.py: it dequantizes GPTQ) to a bf16 GGUF, then
                    llama-quantize (`llama_model_quantize` through llama-cpp-python) with --threads
                    threads. The converter runs once per source and round; its time counts in the
                    route of every target type of that source. An HQQ source has no llama.cpp route:
                    its route starts with `qconvert hqq->hf --type bf16` (counted as its first step).

Printed per case: wall seconds of each round, peak RSS (os.wait4: the kernel's high-water mark of
the process and what it waited for; the route's peak is the larger of its steps), the weight error of
the output against the source (RMSE and max |error| over the 2-D weights: qconvert's own report, and
`qconvert verify SRC OUT` for the route's file), whether both outputs hold the same tensor bytes, and
the ratio route / qconvert of the best times. Also the disk-speed bound of each case (read the source
files, write as many bytes as the output has: page cache speed, as the runs see it) and qconvert's
start-up (importing the CLI; `qconvert formats`, which discovers the registry).

--load idle,busy runs every timed command with the machine as it is, and again with one core kept
busy by another process (a Python loop) for the whole timed part: on a 2-core machine that is what
"other work running" means (--busy-cases: a subset for that load). The untimed checks (errors, bytes,
disk bound) run once per case, on the first load's files: every load writes the same bytes. Both use --threads threads (qconvert: QCONVERT_THREADS / OMP_NUM_THREADS).
An IQ target (iq1_s, iq2_xxs, ...) is quantized on both sides with one synthetic importance matrix per source
(scripts/llama_quantize_route.py: uniform in [0.5, 1.5), one value per input column of every weight, made untimed
from a Q4_0 probe file's tensor names): qconvert's `--imatrix`, llama-quantize's imatrix entries. The default
IQ case is IQ1_S, whose llama-quantize mix qconvert's `--type iq1_s` writes too (the same bytes from a dense
source); `--type iq2_xxs` is the plain type in qconvert and a mix in llama-quantize, so those files differ.
--sizes 1b,3b,8b adds the scaling points (qconvert only, Q4_0 and Q4_K_M: seconds, seconds per GB of
bf16-equivalent weights, peak RSS against the largest shard). Nothing is asserted on the timings.

    python scripts/bench_e2e.py [--work DIR] [--size 1b] [--rounds 2] [--load idle,busy]
        [--cases gptq:q4_0,gptq:q8_0,gptq:q4_k_m,gptq:q6_k,hf:q4_k_m,hqq:q4_k_m,hf:iq1_s,gptq:iq1_s] [--sizes 1b,3b,8b]
        [--scale-rounds 1] [--threads 2] [--json out.json]
    python scripts/bench_e2e.py --hidden 256 --intermediate 512 --layers 2 --rounds 1   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from llama_quantize_route import QUANTIZE_SCRIPT, ftype, write_synthetic_imatrix  # noqa: E402
from synthetic_gptq import make_synthetic_gptq  # noqa: E402

MB = 1_000_000
# Llama-3.2-1B's width with the head layout (8 heads, 8 KV heads: 1.07 B linear weights), and
# Llama-3.2-3B- and Llama-3-8B-shaped models
PRESETS = {
    "1b": dict(hidden=2048, intermediate=8192, layers=16, heads=8, kv_heads=8),
    "3b": dict(hidden=3072, intermediate=8192, layers=28, heads=24, kv_heads=8),
    "8b": dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8),
}
DEFAULT_CASES = "gptq:q4_0,gptq:q8_0,gptq:q4_k_m,gptq:q6_k,hf:q4_k_m,hqq:q4_k_m,hf:iq1_s,gptq:iq1_s"
REQUANT = {"q4_k_m", "q6_k", "q3_k", "q3_k_m", "q5_k_m", "q2_k", "q4_k", "q5_k"}  # lossy from any source
# the lattice types, which both sides quantize with an importance matrix (llama-quantize requires one for most)
IMATRIX = {"iq3_s", "iq3_xxs", "iq2_s", "iq2_xs", "iq2_xxs", "iq1_s", "iq1_m"}
_SPIN = "while True: pass"


@dataclass
class Run:
    seconds: float
    peak_mb: float


_GNU_TIME = shutil.which("time") if Path("/usr/bin/time").exists() else None


def run_timed(cmd: list[str], env: dict | None = None) -> Run:
    """Run a command to completion: wall seconds and peak RSS (MB). Fails loudly.

    The peak is the kernel's high-water mark (ru_maxrss) of the command's process as its parent reaps it.
    Linux starts a forked child's mark at its parent's size, so the command is started from GNU time (a
    small process: its -f %M is that mark) where /usr/bin/time exists; else from this process (os.wait4),
    whose own size then bounds the figure from below."""
    t0 = time.perf_counter()
    fd, rss_file = tempfile.mkstemp(prefix="bench-e2e-rss-")
    os.close(fd)
    try:
        full = ["/usr/bin/time", "-f", "%M", "-o", rss_file, *cmd] if _GNU_TIME else cmd
        proc = subprocess.Popen(full, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(map(str, cmd))[:300]} failed ({proc.returncode}):\n"
                               f"{out.decode(errors='replace')[-4000:]}")
        kb = usage.ru_maxrss
        if _GNU_TIME:
            lines = [x for x in Path(rss_file).read_text().split() if x.isdigit()]
            kb = int(lines[-1]) if lines else kb
        return Run(seconds, kb * 1024 / MB)
    finally:
        os.unlink(rss_file)


def qconvert_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("qconvert")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "qconvert"]


def _env(threads: int) -> dict:
    env = dict(os.environ)
    env.setdefault("QCONVERT_THREADS", str(threads))
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.pop("NO_LOCAL_GGUF", None)
    return env


class Spinner:
    """Another process keeping one core busy while it lives."""

    def __init__(self, on: bool):
        self.proc = subprocess.Popen([sys.executable, "-c", _SPIN]) if on else None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def folder_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def disk_bound(src: Path, out_bytes: int, work: Path) -> float:
    """Seconds to read every source file and write `out_bytes` bytes (page cache speed, no fsync)."""
    chunk = 16 << 20
    t0 = time.perf_counter()
    for p in sorted(src.rglob("*") if src.is_dir() else [src]):
        if p.is_file():
            with open(p, "rb", buffering=0) as f:
                while f.read(chunk):
                    pass
    buf = bytes(chunk)
    tmp = work / ".disk-bound.bin"
    with open(tmp, "wb", buffering=0) as f:
        left = out_bytes
        while left > 0:
            n = min(chunk, left)
            f.write(buf[:n])
            left -= n
    seconds = time.perf_counter() - t0
    tmp.unlink()
    return seconds


def weight_error(report: Path) -> tuple[float, float]:
    """(RMSE, max |error|) over the 2-D tensors of a qconvert report (convert or verify)."""
    tensors = json.loads(report.read_text())["tensors"]
    sq, n, mx = 0.0, 0, 0.0
    for t in tensors:
        if len(t["shape"]) != 2 or t.get("rmse") is None:
            continue
        k = math.prod(t["shape"])
        sq += t["rmse"] ** 2 * k
        n += k
        mx = max(mx, t["max_abs_err"] or 0.0)
    return (math.sqrt(sq / n) if n else float("nan")), mx


def same_tensor_bytes(a: Path, b: Path) -> bool:
    """Whether two GGUF files hold the same tensors (names, types, shapes and bytes; metadata aside)."""
    import gguf
    import numpy as np

    ra, rb = gguf.GGUFReader(str(a)), gguf.GGUFReader(str(b))
    ta = {t.name: t for t in ra.tensors}
    tb = {t.name: t for t in rb.tensors}
    if set(ta) != set(tb):
        return False
    for name, t in ta.items():
        u = tb[name]
        if t.tensor_type != u.tensor_type or list(t.shape) != list(u.shape):
            return False
        if not np.array_equal(np.asarray(t.data).view(np.uint8), np.asarray(u.data).view(np.uint8)):
            return False
    return True


@dataclass
class Case:
    source: str  # gptq | hf | hqq
    target: str  # a --type of the gguf writer / llama-quantize ftype name
    ours: list[Run] = field(default_factory=list)
    route: list[Run] = field(default_factory=list)  # totals
    route_steps: list[tuple[float, float]] = field(default_factory=list)  # (prepare + convert, quantize) seconds
    err_ours: tuple[float, float] | None = None
    err_route: tuple[float, float] | None = None
    same: bool | None = None
    disk: float | None = None
    out_bytes: int = 0

    @property
    def name(self) -> str:
        return f"{self.source}->{self.target}"


def make_sources(work: Path, shape: dict, sources: set[str], shard_mb: float, threads: int) -> dict[str, Path]:
    """The synthetic GPTQ checkpoint and, from it (untimed), the dense bf16 and HQQ sources."""
    tag = f"h{shape['hidden']}-f{shape['intermediate']}-l{shape['layers']}-a{shape['heads']}-kv{shape['kv_heads']}"
    paths = {"gptq": work / f"gptq-{tag}"}
    if not (paths["gptq"] / "config.json").exists():
        info = make_synthetic_gptq(paths["gptq"], shard_mb=shard_mb, **shape)
        print(f"made {paths['gptq']}: {len(info['shards'])} shards, largest {info['largest_shard_bytes'] / MB:.0f} MB",
              flush=True)
    env = _env(threads)
    if "hf" in sources or "hqq" in sources:
        paths["hf"] = work / f"hf-{tag}"
        if not (paths["hf"] / "config.json").exists():
            run_timed([*qconvert_cmd(), "gptq->hf", str(paths["gptq"]), str(paths["hf"]), "--type", "bf16", "--quiet"],
                      env)
    if "hqq" in sources:
        paths["hqq"] = work / f"hqq-{tag}"
        if not (paths["hqq"] / "config.json").exists():
            run_timed([*qconvert_cmd(), "gptq->hqq", str(paths["gptq"]), str(paths["hqq"]), "--quiet"], env)
    return paths


def largest_shard(src: Path) -> int:
    return max((p.stat().st_size for p in src.glob("*.safetensors")), default=0)


def run_cases(cases: list[Case], paths: dict[str, Path], out: Path, rounds: int, threads: int, busy: bool,
              errors: bool) -> None:
    from llama_cpp_reference import reference_command

    env = _env(threads)

    def imatrix_for(source: str) -> Path:
        """One synthetic importance matrix per source, made untimed from a Q4_0 probe file (its tensor names and
        widths), the same file for qconvert and llama-quantize."""
        path = out / f"synthetic-{source}.imatrix.dat"
        if not path.exists():
            probe = out / f"probe-{source}.gguf"
            run_timed([*qconvert_cmd(), f"{source}->gguf", str(paths[source]), str(probe), "--type", "q4_0", "--force",
                       "--quiet", "--allow-requant"], env)
            print(f"  imatrix for {source}: {write_synthetic_imatrix(probe, path)} entries", flush=True)
            probe.unlink()
        return path

    for r in range(rounds):
        spinner = Spinner(busy)
        try:
            converted: dict[str, tuple[Path, float, float]] = {}  # source -> (bf16 gguf, seconds, peak MB)

            def route(case: Case) -> None:
                if case.source not in converted:
                    seconds, peak = 0.0, 0.0
                    model = paths[case.source]
                    if case.source == "hqq":  # no llama.cpp route: dense bf16 first
                        model = out / "hqq-as-hf"
                        shutil.rmtree(model, ignore_errors=True)
                        step = run_timed([*qconvert_cmd(), "hqq->hf", str(paths["hqq"]), str(model), "--type", "bf16",
                                          "--quiet"], env)
                        seconds, peak = step.seconds, step.peak_mb
                    bf16 = out / f"route-{case.source}-bf16.gguf"
                    bf16.unlink(missing_ok=True)
                    step = run_timed(reference_command(model, bf16, outtype="bf16", model_name="bench"), env)
                    converted[case.source] = (bf16, seconds + step.seconds, max(peak, step.peak_mb))
                bf16, conv_s, conv_peak = converted[case.source]
                dst = out / f"route-{case.name.replace('->', '-')}.gguf"
                dst.unlink(missing_ok=True)
                cmd = [sys.executable, "-c", QUANTIZE_SCRIPT, str(bf16), str(dst), str(ftype(case.target)), str(threads)]
                if case.target in IMATRIX:
                    cmd.append(str(imatrix_for(case.source)))
                q = run_timed(cmd, env)
                case.route.append(Run(conv_s + q.seconds, max(conv_peak, q.peak_mb)))
                case.route_steps.append((conv_s, q.seconds))

            def ours(case: Case) -> None:
                dst = out / f"ours-{case.name.replace('->', '-')}.gguf"
                rep = out / f"ours-{case.name.replace('->', '-')}.json"
                cmd = [*qconvert_cmd(), f"{case.source}->gguf", str(paths[case.source]), str(dst), "--type",
                       case.target, "--force", "--quiet", "--report", str(rep)]
                if case.target in REQUANT | IMATRIX or case.source == "hf":  # a dense source: every type requantizes
                    cmd.append("--allow-requant")
                if case.target in IMATRIX:
                    cmd += ["--imatrix", str(imatrix_for(case.source))]
                case.ours.append(run_timed(cmd, env))

            for case in cases:
                steps = (ours, route) if r % 2 == 0 else (route, ours)
                for step in steps:
                    step(case)
                print(f"  round {r + 1} {'busy' if busy else 'idle'} {case.name}: qconvert {case.ours[-1].seconds:.1f} s, "
                      f"route {case.route[-1].seconds:.1f} s", flush=True)
        finally:
            spinner.stop()
    if not errors:
        return
    for case in cases:  # untimed: errors, same bytes, disk bound
        name = case.name.replace("->", "-")
        ours_out, route_out = out / f"ours-{name}.gguf", out / f"route-{name}.gguf"
        case.out_bytes = ours_out.stat().st_size
        case.err_ours = weight_error(out / f"ours-{name}.json")
        rep = out / f"route-{name}-verify.json"
        run_timed([*qconvert_cmd(), "verify", str(paths[case.source]), str(route_out), "--quiet", "--report", str(rep)],
                  env)
        case.err_route = weight_error(rep)
        case.same = same_tensor_bytes(ours_out, route_out)
        case.disk = min(disk_bound(paths[case.source], case.out_bytes, out) for _ in range(2))


def print_table(cases: list[Case], load: str, threads: int) -> list[str]:
    lines = [f"load: {load}, {threads} threads; seconds per round; route = convert (+ dense first for hqq) + quantize",
             f"{'case':<15} {'qconvert s':>16} {'peak MB':>8} {'rmse':>9} {'max err':>8} | "
             f"{'llama.cpp route s':>20} {'(convert+quant)':>16} {'peak MB':>8} {'rmse':>9} {'max err':>8} | "
             f"{'ratio':>5} {'same':>5} {'disk s':>6}"]
    for c in cases:
        o = "/".join(f"{r.seconds:.1f}" for r in c.ours)
        t = "/".join(f"{r.seconds:.1f}" for r in c.route)
        best_o, best_t = min(r.seconds for r in c.ours), min(r.seconds for r in c.route)
        i = min(range(len(c.route)), key=lambda k: c.route[k].seconds)
        split = f"{c.route_steps[i][0]:.1f}+{c.route_steps[i][1]:.1f}"
        eo = c.err_ours or (float("nan"), float("nan"))
        er = c.err_route or (float("nan"), float("nan"))
        lines.append(f"{c.name:<15} {o:>16} {max(r.peak_mb for r in c.ours):>8.0f} {eo[0]:>9.3e} {eo[1]:>8.2e} | "
                     f"{t:>20} {split:>16} {max(r.peak_mb for r in c.route):>8.0f} {er[0]:>9.3e} {er[1]:>8.2e} | "
                     f"{best_t / best_o:>5.2f} {str(c.same) if c.same is not None else '-':>5} "
                     f"{c.disk if c.disk is not None else float('nan'):>6.2f}")
    return lines


def startup(threads: int) -> list[str]:
    env = _env(threads)
    imp = min(run_timed([sys.executable, "-c", "import qconvert.converters.apps.cli"], env).seconds for _ in range(3))
    fmt = min(run_timed([*qconvert_cmd(), "formats"], env).seconds for _ in range(3))
    return [f"start-up: import qconvert.converters.apps.cli {imp:.2f} s; `qconvert formats` (registry) {fmt:.2f} s"]


def scaling(work: Path, sizes: list[str], threads: int, shard_mb: float, rounds: int) -> list[str]:
    lines = [f"scaling (qconvert, idle, {threads} threads, best of {rounds}):",
             f"{'size':<5} {'linear weights':>14} {'largest shard MB':>16} {'case':<14} {'s':>7} {'s per GB bf16':>13} "
             f"{'peak MB':>8} {'peak/shard':>10}"]
    env = _env(threads)
    for size in sizes:
        shape = PRESETS[size]
        src = make_sources(work, shape, {"gptq"}, shard_mb, threads)["gptq"]
        h, f, n, a, kv = (shape[k] for k in ("hidden", "intermediate", "layers", "heads", "kv_heads"))
        linear = n * (2 * h * h + 2 * h * (h * kv // a) + 3 * h * f)
        shard = largest_shard(src)
        for target in ("q4_0", "q4_k_m"):
            dst = work / f"scale-{size}-{target}.gguf"
            cmd = [*qconvert_cmd(), "gptq->gguf", str(src), str(dst), "--type", target, "--force", "--quiet"]
            if target in REQUANT:
                cmd.append("--allow-requant")
            runs = [run_timed(cmd, env) for _ in range(rounds)]
            best = min(r.seconds for r in runs)
            peak = max(r.peak_mb for r in runs)
            dst.unlink(missing_ok=True)
            lines.append(f"{size:<5} {linear / 1e9:>13.2f}B {shard / MB:>16.0f} {'gptq->' + target:<14} {best:>7.1f} "
                         f"{best / (linear * 2 / 1e9):>13.2f} {peak:>8.0f} {peak / (shard / MB):>10.2f}")
            print(lines[-1], flush=True)
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "qconvert-bench-e2e",
                    help="folder for the synthetic models (kept between runs) and the outputs")
    ap.add_argument("--size", choices=sorted(PRESETS), default="1b", help="shape of the model of the table")
    for k in ("hidden", "intermediate", "layers", "heads", "kv_heads"):
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=None, help=f"override the preset's {k}")
    ap.add_argument("--shard-mb", type=float, default=1024, help="largest shard of the synthetic checkpoints")
    ap.add_argument("--cases", default=DEFAULT_CASES, help="SOURCE:TYPE,... (sources: gptq, hf, hqq)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--load", default="idle", help="idle, busy or idle,busy (busy: one core kept busy)")
    ap.add_argument("--busy", action="store_true", help="the same as --load busy")
    ap.add_argument("--busy-cases", default=None, help="the cases of the busy load (default: --cases)")
    ap.add_argument("--sizes", default="", help="scaling points, e.g. 1b,3b,8b (qconvert only)")
    ap.add_argument("--scale-rounds", type=int, default=1, help="runs per scaling point (the best is kept)")
    ap.add_argument("--no-errors", action="store_true", help="skip the untimed error, byte and disk checks")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    shape = dict(PRESETS[args.size])
    for k in shape:
        if getattr(args, k) is not None:
            shape[k] = getattr(args, k)
    args.work.mkdir(parents=True, exist_ok=True)
    specs = [tuple(c.split(":")) for c in args.cases.split(",") if c]
    loads = ["busy"] if args.busy else [x for x in args.load.split(",") if x]
    h, f, n, a, kv = (shape[k] for k in ("hidden", "intermediate", "layers", "heads", "kv_heads"))
    linear = n * (2 * h * h + 2 * h * (h * kv // a) + 3 * h * f)
    paths = make_sources(args.work, shape, {s for s, _ in specs}, args.shard_mb, args.threads)
    print(f"model: hidden {h}, ffn {f}, {n} layers, {a} heads / {kv} KV heads: {linear / 1e9:.2f} B linear "
          f"weights; GPTQ files {folder_bytes(paths['gptq']) / MB:.0f} MB, largest shard "
          f"{largest_shard(paths['gptq']) / MB:.0f} MB; {os.cpu_count()} CPUs", flush=True)
    lines = [*startup(args.threads)]
    results = {}
    checked: dict[str, Case] = {}  # the first load's untimed checks, by case: the files are the same bytes
    for load in loads:
        out = args.work / f"out-{load}"
        out.mkdir(exist_ok=True)
        wanted = specs if load != "busy" or not args.busy_cases else [
            tuple(c.split(":")) for c in args.busy_cases.split(",") if c]
        cases = [Case(s, t) for s, t in wanted]
        todo = [c for c in cases if c.name not in checked]
        run_cases(cases, paths, out, args.rounds, args.threads, load == "busy", errors=False)
        if not args.no_errors:
            run_cases(todo, paths, out, 0, args.threads, False, errors=True)
        for c in cases:
            if c.name in checked:
                first = checked[c.name]
                c.err_ours, c.err_route, c.same, c.disk, c.out_bytes = (first.err_ours, first.err_route, first.same,
                                                                        first.disk, first.out_bytes)
            else:
                checked[c.name] = c
        lines += print_table(cases, load, args.threads)
        results[load] = [dict(case=c.name, ours=[vars(r) for r in c.ours], route=[vars(r) for r in c.route],
                              route_steps=c.route_steps, err_ours=c.err_ours, err_route=c.err_route, same=c.same,
                              disk=c.disk, out_bytes=c.out_bytes) for c in cases]
    if args.sizes:
        lines += scaling(args.work, [s for s in args.sizes.split(",") if s], args.threads, args.shard_mb,
                         max(1, args.scale_rounds))
    print("\n".join(lines), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"shape": shape, "results": results, "table": lines}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

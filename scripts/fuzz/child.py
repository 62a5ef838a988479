"""What a forked child does (pool.ForkPool runs these, the parent never does): child_case copies one seed,
applies the case's mutation and runs `qconvert inspect` and the conversions with its fd 1/2 in files under
a time and a memory bound, writing case.json / result.json for classify.py; child_build_gguf makes a GGUF
seed. The child uses the modules the parent imported before forking; it imports torch (and llama_cpp,
gguf) itself, never qconvert code from disk.
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import random
import re
import resource
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from .common import MB
from .formats import Gguf, st_read, st_tensors
from .mutations import Ctx, Skip, apply_mutation
from .seeds import READER_SEEDS, READERS, Seed
from .tested_code import run_cli


def _status(field_name: str) -> int:
    try:
        for line in open("/proc/self/status"):
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _redirect(out: Path, err: Path) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, path in ((1, out), (2, err)):
        h = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(h, fd)
        os.close(h)


def st_digest(out_dir: Path) -> dict:
    """{tensor name: [dtype, shape, sha1 of its bytes]} of every safetensors file in an hf output folder."""
    digest = {}
    for p in sorted(out_dir.glob("*.safetensors")):
        b, n, h = st_read(p)
        for name in st_tensors(h):
            s, e = h[name]["data_offsets"]
            digest[name] = [h[name]["dtype"], h[name]["shape"], hashlib.sha1(b[8 + n + s:8 + n + e]).hexdigest()]
    return digest


def gguf_digest(path: Path) -> dict:
    """{tensor name: [ggml type, dims, sha1 of its bytes]} of a GGUF file (a tensor's bytes run to the next
    tensor's offset: the padding between them is part of what the writer wrote)."""
    b = path.read_bytes()
    g = Gguf(b)
    ts = sorted(g.tensors, key=lambda t: t.offset)
    digest = {}
    for i, t in enumerate(ts):
        start = g.data_start + t.offset
        end = g.data_start + ts[i + 1].offset if i + 1 < len(ts) else len(b)
        digest[t.name.decode("utf-8", "replace")] = [t.ttype, list(t.dims), hashlib.sha1(b[start:end]).hexdigest()]
    return digest


def output_digest(out: Path) -> dict:
    """The tensors of a conversion's output (an hf folder or a GGUF file), by name."""
    return gguf_digest(out) if out.is_file() else st_digest(out)


_KEEP_OPEN: list = []  # files faulthandler writes to (they must stay open)


def _child_setup(case_dir: Path) -> None:
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    tmp = case_dir / "tmp"
    tmp.mkdir(exist_ok=True)
    os.environ["TMPDIR"] = str(tmp)
    tempfile.tempdir = str(tmp)
    _redirect(case_dir / "setup.out", case_dir / "setup.err")
    _KEEP_OPEN.append(open(case_dir / "crash.txt", "w"))
    faulthandler.enable(_KEEP_OPEN[-1])


def _limit_memory(bound: int) -> None:
    vm = _status("VmSize")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = vm + bound
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def child_case(job: dict) -> int:
    case_dir = Path(job["dir"])
    _child_setup(case_dir)
    seed = Seed(job["seed_name"], Path(job["seed_path"]), job["seed_kind"])
    root = case_dir / "in"
    if seed.kind == "file":
        root.mkdir()
        shutil.copy(seed.path, root / "model.gguf")
        inp = root / "model.gguf"
    else:
        shutil.copytree(seed.path, root, ignore=shutil.ignore_patterns(".done", ".lock", "mistralrs_logprobs.json",
                                                                       *job.get("seed_ignore", ())))
        inp = root
    ctx = Ctx(root, inp, job["reader"])
    meta = {"kind": None, "mutation": None, "structural": None, "input": str(inp)}
    try:
        if job.get("mutate", True):
            rng = random.Random(f"{job['master_seed']}:{job['reader']}:{job['case']}:{seed.name}")
            only = re.compile(job["only"]) if job.get("only") else None
            meta["kind"], meta["mutation"] = apply_mutation(rng, ctx, only)
            meta["structural"] = ctx.structural
    except Skip as e:
        meta["skip"] = str(e)
    meta["input"] = str(ctx.input)
    (case_dir / "case.json").write_text(json.dumps(meta))
    if "skip" in meta:
        return 0
    import torch

    torch.set_num_threads(1)
    in_bytes = _tree_bytes(root)
    bound = max(512 * MB, 8 * in_bytes)
    res = {"in_bytes": in_bytes, "bound": bound, "commands": []}
    rss0 = _status("VmRSS")
    _reset_peak()
    _limit_memory(bound)
    _KEEP_OPEN.append(open(case_dir / "hang.txt", "w"))
    faulthandler.dump_traceback_later(job["timeout"], exit=True, file=_KEEP_OPEN[-1])
    fmt, target = READERS[job["reader"]], READER_SEEDS[job["reader"]].target
    out = case_dir / ("out.gguf" if target == "gguf" else "out")
    commands = [("inspect", ["inspect", str(ctx.input)], None)] if job.get("inspect", True) else []
    # "convert": the reader's target conversion, whose output the oracle compares with the seed's.
    # --allow-requant: only a rotated GPTQ's folded down_proj needs it (->hf f32 is exact otherwise); a
    # refused plan would hide what the reader does with the input
    commands.append(("convert", [f"{fmt}->{target}", str(ctx.input), str(out)]
                     + (["--type", "f32"] if target == "hf" else []) + ["--allow-requant", "--quiet"], out))
    if "gguf" in job.get("targets", ()) and target != "gguf":  # the GGUF writer reads what hf ignores (tokenizer, metadata)
        gguf_out = case_dir / "gguf-out.gguf"
        commands.append(("to-gguf", [f"{fmt}->gguf", str(ctx.input), str(gguf_out), "--type", "f16",
                                     "--allow-requant", "--quiet"], gguf_out))
    for name, argv, target_path in commands:
        _redirect(case_dir / f"{name}.out", case_dir / f"{name}.err")
        t0 = time.monotonic()
        rc = run_cli(argv)
        res["commands"].append({"name": name, "argv": argv, "rc": rc, "seconds": round(time.monotonic() - t0, 3),
                                "out": str(target_path) if target_path else None})
        (case_dir / "result.json").write_text(json.dumps(res))
        if rc not in (0, 2, 130):  # a bug: the CLI said so in one line; --debug gives the traceback's frames
            _redirect(case_dir / f"{name}.debug.out", case_dir / f"{name}.debug.err")
            run_cli([a + "-debug" if a == str(target_path) else a for a in argv] + ["--debug"])
    faulthandler.cancel_dump_traceback_later()
    res["rss_growth"] = max(0, _status("VmHWM") - rss0)
    hf = next((c for c in res["commands"] if c["name"] == "convert"), None)
    if hf is not None and hf["rc"] == 0:
        # the oracle: every tensor of the output, compared by the parent with the seed's own conversion for every
        # case that exits 0 (a data mutation too: whether it changed a value is measured, not assumed)
        if job.get("ref_out"):  # the seed's own conversion: keep its digest
            Path(job["ref_out"]).write_text(json.dumps(output_digest(out)))
        else:
            res["digest"] = output_digest(out)
    (case_dir / "result.json").write_text(json.dumps(res))
    return 0


def child_build_gguf(job: dict) -> int:
    """A GGUF seed: `qconvert SRC->gguf` from a fixture, or llama.cpp's quantizer on an F32 GGUF."""
    case_dir = Path(job["dir"])
    _child_setup(case_dir)
    import torch

    torch.set_num_threads(1)
    dst = Path(job["dst"])
    tmp = dst.with_name(dst.stem + ".part.gguf")
    if job["how"] == "qconvert":
        _redirect(case_dir / "build.out", case_dir / "build.err")
        rc = run_cli([f"{job['src_fmt']}->gguf", job["src"], str(tmp), "--quiet", "--force", *job["args"]])
    else:
        _redirect(case_dir / "build.out", case_dir / "build.err")
        f32 = Path(job["f32"])
        rc = 0
        if not f32.exists():
            rc = run_cli(["hf->gguf", job["src"], str(f32), "--type", "f32", "--quiet", "--force"])
        if rc == 0:
            import llama_cpp

            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = job["ftype"]
            params.nthread = 1
            rc = llama_cpp.llama_model_quantize(str(f32).encode(), str(tmp).encode(), params)
    if rc == 0 and tmp.exists():
        tmp.replace(dst)
    return 0 if rc == 0 else 3

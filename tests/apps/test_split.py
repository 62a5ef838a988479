"""One conversion split into parts (`--workers N`, `--ray`: converters/split.py): the same bytes and the same
report as the single-process conversion for gguf (one file and a --split-max-size set), uqff, hf and gptq
outputs of a MoE GPTQ checkpoint (expert stacks filled by several parts) and for a K-quant requantization of a
dense model; a local Ray gives the same bytes; kill -9 mid-run then a re-run redoes only the parts that are
unfinished or do not verify; a worker killed alone fails its part in one line naming it; a part needing more
memory than a worker may use, and a writer that cannot be split, are refused in one line before anything runs."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fixtures_moe
import wide_models
from helpers import run_cli

PAIRS = {  # name: (pair, options); every part holds a few tensors
    "gguf": ("gptq->gguf", ["--type", "q4_k_m", "--allow-requant"]),
    "gguf-split": ("gptq->gguf", ["--type", "q4_k_m", "--allow-requant", "--split-max-size", "40K"]),
    "uqff": ("gptq->uqff", []),
    "hf": ("gptq->hf", ["--type", "f16"]),
    "gptq": ("gptq->gptq", []),
}
SPLIT = ["--workers", "2", "--part-size", "200K"]
_STATS = re.compile(r"split: (\d+) part\(s\), (\d+) kept from an earlier run \(verified\), (\d+) converted")


@pytest.fixture(scope="module")
def moe_src() -> Path:
    return fixtures_moe.ensure_moe_gptq(kind="qwen3_moe")


@pytest.fixture(scope="module")
def dense_src() -> Path:
    return wide_models.model_dir("llama")


@pytest.fixture(scope="module")
def dense_one(dense_src, tmp_path_factory) -> Path:
    """The single-process Q4_K_M conversion of the dense model (and its report beside it)."""
    one = tmp_path_factory.mktemp("dense") / "one.gguf"
    _convert("hf->gguf", dense_src, one, "--type", "q4_k_m", "--allow-requant")
    return one


def _files(out: Path) -> dict[str, str]:
    """{relative name: sha256} of an output: a folder, a file, or a split set named after it."""
    if out.is_dir():
        paths = sorted(p for p in out.rglob("*") if p.is_file())
        return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}
    paths = sorted(out.parent.glob(out.stem + "*" + out.suffix))
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


def _report(path: Path) -> list:
    return [{k: v for k, v in t.items()} for t in json.loads(path.read_text())["tensors"]]


def _stats(proc) -> tuple[int, int, int]:
    m = _STATS.search(proc.stderr)
    assert m, proc.stderr
    return tuple(map(int, m.groups()))


def _convert(pair, src, out, *args, check_rc=0):
    return run_cli(pair, src, out, *args, "--report", f"{out}.report.json", check_rc=check_rc)


@pytest.mark.parametrize("name", list(PAIRS))
def test_split_same_bytes(name, moe_src, tmp_path):
    pair, opts = PAIRS[name]
    suffix = ".gguf" if "gguf" in name else ""
    one, split = tmp_path / "one" / f"m{suffix}", tmp_path / "split" / f"m{suffix}"
    _convert(pair, moe_src, one, *opts)
    proc = _convert(pair, moe_src, split, *opts, *SPLIT)
    parts, kept, converted = _stats(proc)
    assert parts >= 4 and kept == 0 and converted == parts
    assert _files(one) == _files(split) and _files(one)
    if name == "gguf-split":
        assert len(_files(one)) > 1
    assert _report(Path(f"{one}.report.json")) == _report(Path(f"{split}.report.json"))
    assert not list(split.parent.glob(".*qconvert-split"))  # the work folder is gone


def test_ray_requantize_same_bytes(dense_src, dense_one, tmp_path):
    opts = ["--type", "q4_k_m", "--allow-requant"]
    one, ray = dense_one, tmp_path / "ray.gguf"
    proc = _convert("hf->gguf", dense_src, ray, *opts, "--ray", "--workers", "2", "--part-size", "2M")
    assert _stats(proc)[0] > 1
    digest = hashlib.sha256(one.read_bytes()).hexdigest()
    assert hashlib.sha256(ray.read_bytes()).hexdigest() == digest
    assert _report(Path(f"{one}.report.json")) == _report(Path(f"{ray}.report.json"))


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "qconvert", *map(str, args)]


def _workers(pid: int) -> list[int]:
    """The driver's forked workers."""
    try:
        children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    found = []
    for child in children:
        try:
            if Path(f"/proc/{child}/cmdline").read_bytes() == Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(child)  # a forked worker runs the driver's command line
        except OSError:
            continue
    return found


def test_kill_9_then_resume_redoes_only_unfinished_parts(dense_src, dense_one, tmp_path):
    opts = ["--type", "q4_k_m", "--allow-requant", "--workers", "1", "--part-size", "400K"]
    one, out = dense_one, tmp_path / "out" / "m.gguf"
    work = out.parent / ".m.gguf.qconvert-split"
    proc = subprocess.Popen(_cli("hf->gguf", dense_src, out, *opts), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while len(list((work / "parts").glob("*.json"))) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and its worker, as a killed terminal would
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()
    done = len(list((work / "parts").glob("*.json")))
    assert done >= 3
    # one finished part whose bytes were damaged since: it does not verify, so it is redone too
    manifest = json.loads(sorted((work / "parts").glob("*.json"))[-1].read_text())
    fname, offset, nbytes, _ = manifest["written"][0]
    with open(work / fname, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    again = run_cli("hf->gguf", dense_src, out, *opts)
    parts, kept, converted = _stats(again)
    assert (kept, converted) == (done - 1, parts - done + 1)
    assert converted < parts
    assert hashlib.sha256(out.read_bytes()).hexdigest() == hashlib.sha256(one.read_bytes()).hexdigest()
    assert not work.exists()


def test_worker_killed_alone_fails_its_part(dense_src, tmp_path):
    out = tmp_path / "m.gguf"
    work = tmp_path / ".m.gguf.qconvert-split"
    proc = subprocess.Popen(_cli("hf->gguf", dense_src, out, "--type", "q4_k_m", "--allow-requant", "--workers", "1",
                                 "--part-size", "400K"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = None
    deadline = time.monotonic() + 120
    while not list((work / "parts").glob("*.json")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # the worker has planned and is converting parts
    while killed is None and proc.poll() is None and time.monotonic() < deadline:
        for child in _workers(proc.pid):
            try:
                os.kill(child, signal.SIGKILL)
                killed = child
            except ProcessLookupError:
                continue
            break
        time.sleep(0.005)
    _, err = proc.communicate(timeout=120)
    assert killed is not None
    assert proc.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert re.fullmatch(r"qconvert: error: part \d+ of \d+ \([a-z_.\d]+\.weight( and \d+ more tensor\(s\))?, "
                        r"from \S+/model\.safetensors\) failed: its worker was killed \(signal 9\)", lines[0]), lines[0]
    assert not out.exists()


def test_refusals_before_anything_runs(dense_src, tmp_path):
    out = tmp_path / "m.gguf"
    proc = run_cli("hf->gguf", dense_src, out, "--type", "q4_k_m", "--allow-requant", "--workers", "2",
                   "--worker-memory", "100M", check_rc=2)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs about 0.5 GiB of memory (from its largest tensor), more than a worker may " \
                               "use (0.1 GiB)" in lines[0] and lines[0].startswith("qconvert: error: part 1 of "), lines
    assert not out.exists() and not list(tmp_path.iterdir())
    proc = run_cli("hf->mlx", dense_src, tmp_path / "mlx", "--workers", "2", check_rc=2)
    assert proc.stderr.strip() == ("qconvert: error: --workers/--ray: a mlx output cannot be split into parts yet "
                                   "(gguf, uqff, hf and gptq outputs can); convert without them"), proc.stderr
    assert not list(tmp_path.iterdir())
    proc = run_cli("hf->gguf", dense_src, out, "--part-size", "1M", check_rc=2)
    assert "--part-size and --worker-memory are for --workers or --ray" in proc.stderr

"""`qconvert batch`: a manifest's matrix run by two workers, isolated failures, byte-identical outputs,
resuming (skip what is done, rerun what was deleted or interrupted by kill -9), bad manifests, and `--ray`
(a local Ray: the same bytes and failures as the local workers, a job too big for any node refused, the
one-line refusal without ray)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import run_cli

VARIANTS = ("v1_b4_g32_sym", "v2_b4_g32_sym", "v1_b8_g128_sym", "v1_b4_g32_sym_act")


def _tree_hash(path: Path) -> str:
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for p in files:
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


@pytest.fixture
def batch_dir(fx, tmp_path):
    src = tmp_path / "src"
    for v in VARIANTS:
        shutil.copytree(fx["variants"][v]["ckpt"], src / v)
    bad = src / VARIANTS[-1] / "model.safetensors"  # one source truncated
    os.truncate(bad, bad.stat().st_size // 2)
    (tmp_path / "m.yaml").write_text(
        "matrix:\n"
        f"  sources: [{', '.join('src/' + v for v in VARIANTS)}]\n"
        "  targets:\n"
        "    - {to: gguf, out: 'out/{name}.gguf'}\n"
        "    - {to: hf, out: 'out/{name}-hf', options: [--type, f32]}\n")
    return tmp_path


def _batch(d: Path, *args, check_rc=None):
    proc = subprocess.run([sys.executable, "-m", "qconvert", "batch", str(d / "m.yaml"), "--workers", "2", *args],
                          capture_output=True, text=True)
    if check_rc is not None:
        assert proc.returncode == check_rc, proc.stdout + proc.stderr
    return proc


def _report(d: Path) -> dict:
    return json.loads((d / "batch-report" / "batch.json").read_text())


def test_a_matrix_with_a_bad_source_runs_the_rest_byte_identical_and_resumes(batch_dir, tmp_path):
    d = batch_dir
    t0 = time.monotonic()
    _batch(d, check_rc=1)
    first_seconds = time.monotonic() - t0
    rep = _report(d)
    assert rep["counts"] == {"done": 6, "skipped": 0, "failed": 2, "planned": 0, "verify failed": 0}
    failed = [j for j in rep["jobs"] if j["status"] == "failed"]
    assert {Path(j["src"]).name for j in failed} == {VARIANTS[-1]}
    for j in failed:  # the single command's one-line error, naming the truncated file
        assert j["error"].startswith("qconvert: error:") and "model.safetensors" in j["error"]
        assert "\n" not in j["error"] and "truncated" in j["error"]
        assert not Path(j["out"]).exists()
    # every good output equals the single command's, byte for byte
    for j in (j for j in rep["jobs"] if j["status"] == "done"):
        pair = "gptq-v2->" if j["src"].endswith("v2_b4_g32_sym") else "gptq->"
        single = tmp_path / "single" / Path(j["out"]).name
        single.parent.mkdir(exist_ok=True)
        run_cli(pair + j["pair"].split("->")[1], j["src"], single, *j["options"], "--quiet")
        assert _tree_hash(Path(j["out"])) == _tree_hash(single), j["out"]
        assert j["verdicts"]["exact"] == 21 and j["max_abs_err"] == 0.0 and j["bytes"] > 0
    md = (d / "batch-report" / "batch.md").read_text()
    assert md.startswith("# qconvert batch (6 done, 2 failed)") and md.count("| failed |") == 2

    # a re-run skips the six (the failed two run again and fail again)
    t0 = time.monotonic()
    _batch(d, check_rc=1)
    print(f"first run {first_seconds:.1f} s, re-run {time.monotonic() - t0:.1f} s")  # measured, not asserted
    assert _report(d)["counts"] == {"done": 0, "skipped": 6, "failed": 2, "planned": 0, "verify failed": 0}

    # after deleting one output, exactly that job runs again, with the same bytes
    victim = Path(next(j["out"] for j in rep["jobs"] if j["status"] == "done" and j["out"].endswith(".gguf")))
    before = _tree_hash(victim)
    victim.unlink()
    _batch(d, check_rc=1)
    again = _report(d)
    assert [j["out"] for j in again["jobs"] if j["status"] == "done"] == [str(victim)]
    assert _tree_hash(victim) == before


def test_kill_9_midway_then_a_rerun_finishes_with_the_same_bytes(batch_dir):
    d = batch_dir
    proc = subprocess.Popen([sys.executable, "-m", "qconvert", "batch", str(d / "m.yaml"), "--workers", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    done_dir = d / "batch-report" / "done"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list(done_dir.glob("*.json"))) < 2:  # some done, some not
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    finished_before = len(list(done_dir.glob("*.json")))
    assert 0 < finished_before < 6
    _batch(d, check_rc=1)
    rep = _report(d)
    assert rep["counts"]["skipped"] == finished_before and rep["counts"]["done"] == 6 - finished_before
    # the same bytes as an uninterrupted batch into another folder
    fresh = d / "fresh"
    fresh.mkdir()
    shutil.copytree(d / "src", fresh / "src")
    shutil.copy(d / "m.yaml", fresh / "m.yaml")
    _batch(fresh, check_rc=1)
    for j in rep["jobs"]:
        if j["status"] != "failed":
            assert _tree_hash(Path(j["out"])) == _tree_hash(fresh / Path(j["out"]).relative_to(d)), j["out"]
    assert not [p for p in (d / "out").rglob("*") if ".qconvert-tmp-" in p.name]


def test_dry_run_plans_every_job_with_its_verdicts_and_writes_nothing(batch_dir):
    proc = _batch(batch_dir, "--dry-run", check_rc=1)  # the truncated source fails its plan as it would its run
    lines = proc.stdout.splitlines()
    assert sum(ln.startswith("planned") for ln in lines) == 6 and sum(ln.startswith("failed") for ln in lines) == 2
    assert not (batch_dir / "out").exists() and not list((batch_dir / "batch-report" / "done").iterdir())
    planned = [j for j in _report(batch_dir)["jobs"] if j["status"] == "planned"]
    assert all(j["verdicts"]["exact"] == 21 for j in planned)


@pytest.mark.parametrize("text,why", [
    ("jobs: [{src: a}]", "jobs[0] needs src, pair and out"),
    ("matrix: {sources: [a], targets: [{to: gguf, out: x.gguf}]}", "has no {name}"),
    ("jobs: [{src: a, pair: 'gptq', out: b}]", "is not SRC->DST"),
    ("- just a list", "expected a mapping with `jobs` and/or `matrix`"),
    ("jobs: [{src: a, pair: gptq->gguf, out: o.gguf}, {src: b, pair: gptq->gguf, out: o.gguf}]", "two jobs write"),
    ("{unclosed", "not valid YAML"),
])
def test_a_bad_manifest_is_one_line_and_exit_2(tmp_path, text, why):
    (tmp_path / "m.yaml").write_text(text)
    proc = _batch(tmp_path, check_rc=2)
    assert proc.stderr.startswith("qconvert: error:") and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert why in proc.stderr and "m.yaml" in proc.stderr


def _without_paths(error: str, root: Path) -> str:
    return error.replace(str(root), "ROOT")


def test_ray_gives_the_local_workers_bytes_and_failures(batch_dir, tmp_path_factory):
    local = _batch(batch_dir, check_rc=1)
    on_ray = tmp_path_factory.mktemp("on-ray")  # the same matrix into a fresh folder
    shutil.copytree(batch_dir / "src", on_ray / "src")
    shutil.copy(batch_dir / "m.yaml", on_ray / "m.yaml")
    ray = _batch(on_ray, "--ray", check_rc=1)  # no address: a local Ray started for this batch
    assert ray.stderr == local.stderr, ray.stderr  # nothing of Ray's own on the terminal
    local_rep, ray_rep = _report(batch_dir), _report(on_ray)
    assert ray_rep["counts"] == local_rep["counts"] == {"done": 6, "skipped": 0, "failed": 2, "planned": 0, "verify failed": 0}
    for mine, theirs in zip(local_rep["jobs"], ray_rep["jobs"], strict=True):
        assert Path(theirs["out"]).relative_to(on_ray) == Path(mine["out"]).relative_to(batch_dir)
        assert theirs["status"] == mine["status"], theirs
        assert _without_paths(theirs["error"], on_ray) == _without_paths(mine["error"], batch_dir)
        for k in ("bytes", "verdicts", "max_abs_err", "rms_err"):
            assert theirs[k] == mine[k], (k, theirs)
        if mine["status"] == "done":
            assert _tree_hash(Path(theirs["out"])) == _tree_hash(Path(mine["out"])), theirs["out"]
        else:
            assert "truncated" in theirs["error"] and not Path(theirs["out"]).exists()
    # each done job's own report (written on the node) and marker (by the driver), where the local run has them
    for kind in ("jobs", "done"):
        assert len(list((on_ray / "batch-report" / kind).glob("*.json"))) == 6 == \
            len(list((batch_dir / "batch-report" / kind).glob("*.json")))


def test_ray_fails_a_job_needing_more_memory_than_any_node_instead_of_waiting(tmp_path):
    # an int32 tensor (taken as packed 4-bit codes: 8 values a word, 32 bytes of peak memory each) whose
    # conversion would need more memory than this machine has, in a sparse file: none of it is ever converted
    words = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (8 * 32) + 1
    header = json.dumps({"model.embed_tokens.weight": {"dtype": "I32", "shape": [words],
                                                       "data_offsets": [0, 4 * words]}}).encode()
    src = tmp_path / "huge"
    src.mkdir()
    with open(src / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + 4 * words)
    (tmp_path / "m.yaml").write_text("jobs: [{src: huge, pair: hf->gguf, out: huge.gguf}]\n")
    proc = _batch(tmp_path, "--ray", check_rc=1)
    [job] = _report(tmp_path)["jobs"]
    assert job["status"] == "failed" and job["error"].startswith(f"qconvert: error: {src}: needs about ")
    assert "more than any Ray node has" in job["error"] and "\n" not in job["error"], job["error"]
    assert not (tmp_path / "huge.gguf").exists() and not list((tmp_path / "batch-report").glob("jobs/*"))
    assert job["error"] in proc.stdout and proc.stderr == ""


def test_ray_without_ray_installed_is_one_line_and_exit_2(batch_dir):
    blocked = "import sys; sys.modules['ray'] = None; from qconvert.converters.apps.cli import main; " \
              "sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run([sys.executable, "-c", blocked, "batch", str(batch_dir / "m.yaml"), "--ray"],
                          capture_output=True, text=True)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == 'qconvert: error: --ray needs ray (pip install "qconvert[batch]")\n'
    assert not (batch_dir / "out").exists() and not (batch_dir / "batch-report").exists()


def test_verify_adds_the_quality_gate_and_resumes_without_converting_again(fx, tmp_path):
    """`batch --verify`: every job's output measured in its runtime (the single `verify --logits` figures),
    a runtime that is not installed (hqq: it lives in its own environment, scripts/test_env.d/20-hqq.sh) is
    that job's one-line verify failure (exit 1), `--max-kl` judges
    each measured job, and a batch whose conversions were done without --verify is measured without
    converting again; batch.md holds the figures and the per-layer plot."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by scripts/run_tests.sh")
    pytest.importorskip("mistralrs", reason="mistralrs==0.9.5 is installed by scripts/test_env.d/30-mistralrs.sh")
    import importlib.util

    assert importlib.util.find_spec("hqq") is None, "hqq belongs in .venvs/hqq (its transformers pin conflicts)"
    src = tmp_path / "src" / "a"
    shutil.copytree(fx["variants"]["v1_b4_g128_sym"]["ckpt"], src)
    (tmp_path / "m.yaml").write_text(
        "matrix:\n  sources: [src/a]\n  targets:\n"
        "    - {to: gguf, out: 'out/{name}.gguf', options: [--type, q4_0]}\n"
        "    - {to: gptq-v2, out: 'out/{name}-v2'}\n"
        "    - {to: uqff, out: 'out/{name}-uqff'}\n"
        "    - {to: hqq, out: 'out/{name}-hqq'}\n")
    _batch(tmp_path, check_rc=0)  # converted, not measured
    mtimes = {p: p.stat().st_mtime_ns for p in (tmp_path / "out").rglob("*") if p.is_file()}
    proc = _batch(tmp_path, "--verify", "--max-kl", "0.01", check_rc=1)
    rep = _report(tmp_path)
    assert rep["counts"] == {"done": 0, "skipped": 4, "failed": 0, "planned": 0, "verify failed": 1}
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes  # measured, not converted again
    jobs = {Path(j["out"]).name: j for j in rep["jobs"]}
    v2, gg, uq, hq = jobs["a-v2"], jobs["a.gguf"], jobs["a-uqff"], jobs["a-hqq"]
    assert v2["verify"] == "measured" and v2["kl_mean"] == 0.0 and v2["top1_agreement"] == 1.0
    assert v2["gate"] == "passed" and v2["ppl_source"] == v2["ppl_output"]
    assert uq["verify"] == "measured" and uq["gate"] == "passed" and uq["kl_mean"] < 1e-3  # mistral.rs, exact codes
    assert hq["verify"] == ("qconvert: error: verify --logits runs hqq models with hqq, which is not installed "
                            "(pip install hqq)")
    assert hq["gate"] == "" and hq["kl_mean"] is None
    # the figures are the single command's
    run_cli("verify", src, gg["out"], "--logits", "--quiet", "--report", tmp_path / "single.json")
    single = json.loads((tmp_path / "single.json").read_text())["logits"]
    assert gg["verify"] == "measured" and gg["gate"] == "passed"
    assert {k: gg[k] for k in single if k in gg} == {k: single[k] for k in single if k in gg}
    assert 0 < gg["kl_mean"] < 0.01 and "KL mean" in proc.stdout
    md = (tmp_path / "batch-report" / "batch.md").read_text()
    assert "| KL mean |" in md and "![per-layer RMS error of every job](batch.png)" in md
    assert (tmp_path / "batch-report" / "batch.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a tighter gate fails the GGUF job on the stored figures, without measuring again
    proc = _batch(tmp_path, "--verify", "--max-kl", "0", check_rc=1)
    jobs = {Path(j["out"]).name: j for j in _report(tmp_path)["jobs"]}
    assert jobs["a.gguf"]["gate"].startswith("failed: KL mean") and jobs["a-v2"]["gate"] == "passed"
    assert jobs["a.gguf"]["seconds"] == 0.0  # skipped and not measured again: the marker holds the figures
    assert jobs["a-uqff"]["gate"].startswith("failed: KL mean")  # mistral.rs f32 against gptqmodel's fp16
    assert _report(tmp_path)["counts"]["verify failed"] == 3  # the GGUF, the UQFF and the unmeasured hqq
    proc = run_cli("batch", tmp_path / "m.yaml", "--max-kl", "0.1", check_rc=2)
    assert proc.stderr.strip() == "qconvert: error: --max-kl is for --verify"

"""hqq's own environment (<repo>/.venvs/hqq, made by scripts/test_env.d/20-hqq.sh), reached in a subprocess
through fixtures_hqq.py: `build` makes the fixtures with hqq (cached under tests/_fixtures/hqq), `verify` loads a
checkpoint with hqq's or transformers' own loader and dumps what that loader dequantizes, plus the logits. Used by
the HQQ tests and by every test that converts from or to HQQ."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
HQQ_PY = REPO / ".venvs" / "hqq" / "bin" / "python"
BUILDER = Path(__file__).with_name("fixtures_hqq.py")
ROOT = REPO / "tests" / "_fixtures" / "hqq"


def _hqq_run(*args, timeout=900) -> subprocess.CompletedProcess:
    if not HQQ_PY.exists():
        raise RuntimeError(f"{HQQ_PY} is missing: run `bash scripts/test_env.d/20-hqq.sh` (scripts/run_tests.sh "
                           "does) to create the hqq environment")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore",
           "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([str(HQQ_PY), str(BUILDER), *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=timeout)
    if proc.returncode:
        raise AssertionError(f"hqq environment: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


@pytest.fixture(scope="session")
def hqqfx():
    _hqq_run("build", "--root", ROOT)
    prompt = json.loads((ROOT / "prompt.json").read_text())["prompt_ids"]
    return {"root": ROOT, "prompt": prompt}


@pytest.fixture(scope="session")
def hqq_root():
    _hqq_run("build", "--root", ROOT)
    return ROOT


def _verify(ckpt: Path, out: Path, loader: str, compute: str = "float32") -> dict:
    _hqq_run("verify", ckpt, out, "--loader", loader, "--compute-dtype", compute)
    return load_file(str(out))

"""Helpers shared by the tests: the CLI runner and the two consumers (llama.cpp and transformers)
that decide whether an output is right. conftest.py puts this folder on sys.path."""

from __future__ import annotations

import atexit
import json
import locale
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np


# Environment variables a process reads when its libraries load (OpenMP, BLAS, torch, Triton, Python itself):
# a command whose environment differs from the fork server's in one of these runs as a plain subprocess.
_LOAD_TIME_ENV = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH", "CUDA", "TRITON", "PYTHON",
                  "LD_", "MALLOC")


class _ForkServer:
    """tests/support/cli_forkserver.py, started on first use: `python -m qconvert` without paying the imports each time.
    QCONVERT_TEST_FORKSERVER=0 turns it off (every command a plain `python -m qconvert`)."""

    def __init__(self):
        self.proc = None
        self.env: dict | None = None
        self.broken = os.environ.get("QCONVERT_TEST_FORKSERVER", "1") == "0" or not hasattr(os, "fork")

    def _start(self) -> bool:
        if self.proc is None and not self.broken:
            try:
                self.env = dict(os.environ)
                self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("cli_forkserver.py"))],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self.env)
                if json.loads(self.proc.stdout.readline() or b"{}").get("ready") is not True:
                    raise RuntimeError("the fork server did not start")
                atexit.register(self.close)
            except Exception:  # noqa: BLE001  (then every command is a plain subprocess)
                self.close()
                self.broken = True
        return self.proc is not None

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
            self.proc = None

    def run(self, argv: list[str]) -> subprocess.CompletedProcess | None:
        """The command's completed process, or None where it must run as a plain subprocess."""
        if not self._start():
            return None
        env = dict(os.environ)
        changed = {k for k in set(env) | set(self.env) if env.get(k) != self.env.get(k)}
        if any(k.startswith(_LOAD_TIME_ENV) for k in changed):
            return None
        with tempfile.TemporaryDirectory(prefix="qconvert-cli-") as d:
            out, err = Path(d) / "stdout", Path(d) / "stderr"
            req = {"argv": argv, "cwd": os.getcwd(), "env": env, "stdout": str(out), "stderr": str(err)}
            try:
                self.proc.stdin.write(json.dumps(req).encode() + b"\n")
                self.proc.stdin.flush()
                rc = json.loads(self.proc.stdout.readline())["rc"]
            except Exception:  # noqa: BLE001  (a dead server: plain subprocesses from now on)
                self.proc, self.broken = None, True
                return None

            def text(p: Path) -> str:  # as subprocess.run(text=True) decodes
                return p.read_bytes().decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")

            return subprocess.CompletedProcess([sys.executable, "-m", "qconvert", *argv], rc, text(out), text(err))


_FORK_SERVER = _ForkServer()


def run_cli(*args, check_rc: int | None = 0) -> subprocess.CompletedProcess:
    """Run `python -m qconvert ARGS` as a user would (a fresh process forked from one that has imported the CLI,
    see tests/support/cli_forkserver.py); return the completed process."""
    argv = list(map(str, args))
    proc = _FORK_SERVER.run(argv)
    if proc is None:
        proc = subprocess.run([sys.executable, "-m", "qconvert", *argv], capture_output=True, text=True)
    if check_rc is not None and proc.returncode != check_rc:
        raise AssertionError(f"exit {proc.returncode} (wanted {check_rc})\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def llama_logits(gguf_path: Path, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits for every position (F32 KV cache: an F16 cache would add its own rounding to the comparison).
    QCONVERT_LLAMA_NO_REPACK=1: the weights stay in their file's layout (llama.cpp's --no-repack, llama_model_params
    .use_extra_bufts false), not moved to the CPU's extra buffer types (repacked or AMX Q4_0 / Q8_0); for a
    llama-cpp-python whose extra buffers crash on the machine (a native build on an AMX CPU, docs/proofs.md)."""
    from llama_cpp import Llama
    from llama_cpp import llama as llama_module

    # llama-cpp-python's Llama takes no such argument: it reads llama_model_default_params() while it loads
    defaults = llama_module.llama_cpp.llama_model_default_params

    def without_extra_buffers():
        params = defaults()
        params.use_extra_bufts = False
        return params

    if os.environ.get("QCONVERT_LLAMA_NO_REPACK") == "1":
        llama_module.llama_cpp.llama_model_default_params = without_extra_buffers
    try:
        llm = Llama(str(gguf_path), n_ctx=128, n_batch=128, logits_all=True, n_threads=2, verbose=False,
                    type_k=0, type_v=0)
    finally:
        llama_module.llama_cpp.llama_model_default_params = defaults
    try:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()


def transformers_logits(model_dir: Path, ids: list[int]) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def gguf_tensors(path: Path) -> dict:
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {t.name: t for t in reader.tensors}


def gguf_dequant(tensor) -> np.ndarray:
    import gguf

    return gguf.quants.dequantize(tensor.data, tensor.tensor_type)


def expect_user_error(pair: str, src: Path, tmp_path: Path, *needles: str, out_name: str = "out") -> str:
    """Convert SRC with the CLI and check the user-error contract: exit 2, one line on stderr naming
    every needle, no traceback, nothing at OUT and no temporary left beside it. Returns the line."""
    out = Path(tmp_path) / out_name
    proc = run_cli(pair, src, out, check_rc=2)
    err = proc.stderr.strip()
    assert err.startswith("qconvert: error: ") and len(err.splitlines()) == 1, err
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in err, (needle, err)
    assert not out.exists()
    assert not [p for p in Path(tmp_path).iterdir() if "qconvert-tmp" in p.name]
    return err


def edit_safetensors(path: Path, fn) -> None:
    """Rewrite a safetensors file after `fn` edits its {name: tensor} dict in place."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def write_legacy_imatrix(path: Path, values: dict[str, np.ndarray], ncall: int = 10) -> None:
    """llama-imatrix's .dat layout: entries of (name, ncall, n values, mean * ncall), then ncall and the
    dataset name."""
    with open(path, "wb") as f:
        f.write(struct.pack("<i", len(values)))
        for name, v in sorted(values.items()):
            f.write(struct.pack("<i", len(name)) + name.encode())
            f.write(struct.pack("<ii", ncall, v.size))
            f.write((v * np.float32(ncall)).astype("<f4").tobytes())
        f.write(struct.pack("<i", ncall) + struct.pack("<i", 8) + b"calib.tx")

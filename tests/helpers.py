"""Helpers shared by the tests: the CLI runner and the two consumers (llama.cpp and transformers)
that decide whether an output is right. conftest.py puts this folder on sys.path."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np


def run_cli(*args, check_rc: int | None = 0) -> subprocess.CompletedProcess:
    """Run `python -m qconvert ARGS` as a user would; return the completed process."""
    proc = subprocess.run([sys.executable, "-m", "qconvert", *map(str, args)], capture_output=True, text=True)
    if check_rc is not None and proc.returncode != check_rc:
        raise AssertionError(f"exit {proc.returncode} (wanted {check_rc})\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def llama_logits(gguf_path: Path, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits for every position (F32 KV cache: an F16 cache would add its own rounding to the comparison)."""
    from llama_cpp import Llama

    llm = Llama(str(gguf_path), n_ctx=128, n_batch=128, logits_all=True, n_threads=2, verbose=False,
                type_k=0, type_v=0)
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

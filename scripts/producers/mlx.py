"""Remake tests/producer_fixtures/mlx/: mlx_lm.convert's own 4-bit group-64 quantization of the tiny llama.

    .venv/bin/python scripts/producers/mlx.py

The producer is mlx-lm (mlx_lm.convert(quantize=True, q_bits=4, q_group_size=64), its defaults' group), run
offline in .venvs/mlx (made by scripts/test_env.d/40-mlx.sh when missing) through tests/support/mlx_driver.py, on
tests/support/fixtures.py's tiny llama (hidden 128, 2 layers, vocab 512, fp16). Beside the folder it stores the
oracle, made by mlx itself: reference.safetensors = mx.dequantize of every quantized module (float16 as mlx
decodes it,
"<module>.weight") and mlx-lm's logits of the fixtures' prompt ("__logits__", float32 [T, vocab]), and
versions.json with the package versions.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# _common.py, beside this file, holds the scaffolding the producers share: this folder is on sys.path for that
# one import only, since the scripts here are named after the packages they drive (transformers, loaded here
# by tests/support/fixtures.py, must not take mlx.py or bitsandbytes.py for the packages)
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

_common.leave_import_path()
REPO = _common.REPO
OUT = _common.PRODUCER_FIXTURES / "mlx"
MLX_PY = REPO / ".venvs" / "mlx" / "bin" / "python"
DRIVER = REPO / "tests" / "mlx_driver.py"
BITS, GROUP = 4, 64


def _mlx(*args) -> str:
    proc = subprocess.run([str(MLX_PY), str(DRIVER), *map(str, args)], capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"mlx driver {args[0]} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def main() -> int:
    fixtures = _common.fixtures()
    if not MLX_PY.exists():
        subprocess.run(["bash", str(REPO / "scripts" / "test_env.d" / "40-mlx.sh")], check=True)
    with tempfile.TemporaryDirectory(prefix="qconvert-mlx-producer-") as tmp:
        base = fixtures.build_tiny_llama(Path(tmp) / "base", **fixtures.BASES["base"])
        if OUT.exists():
            shutil.rmtree(OUT)
        OUT.mkdir(parents=True)
        _mlx("convert", base, OUT / "model", BITS, GROUP)
        _mlx("load", OUT / "model", OUT / "reference.safetensors", json.dumps(fixtures.prompt_ids()), 0)
    versions = subprocess.run([str(MLX_PY), "-c", "import importlib.metadata as m, json; print(json.dumps("
                               "{p: m.version(p) for p in ('mlx', 'mlx-lm', 'transformers')}))"],
                              capture_output=True, text=True, check=True).stdout
    _common.write_json(OUT / "versions.json", {"producer": "mlx_lm.convert(quantize=True)", "q_bits": BITS,
                                               "q_group_size": GROUP, "base": "tests/support/fixtures.py BASES['base']",
                                               "packages": json.loads(versions)}, indent=2, sort_keys=False)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

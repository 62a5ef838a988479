"""Remake tests/producer_fixtures/mlx/: mlx_lm.convert's own 4-bit group-64 quantization of the tiny llama, and
its float modes beside it (mxfp8/, mxfp4/: E4M3 / E2M1 codes with an E8M0 exponent per 32), and of a tiny
Qwen3-MoE (moe/: the experts stacked in mlx-lm's switch layers, quantized after stacking).

    .venv/bin/python scripts/producers/mlx.py [affine|mxfp8|mxfp4|moe ...]    (default: all four)

The producer is mlx-lm (mlx_lm.convert(quantize=True, q_bits=4, q_group_size=64), its defaults' group), run
offline in .venvs/mlx (made by scripts/test_env.d/40-mlx.sh when missing) through tests/support/mlx_driver.py, on
tests/support/fixtures.py's tiny llama (hidden 128, 2 layers, vocab 512, fp16). Beside the folder it stores the
oracle, made by mlx itself: reference.safetensors = mx.dequantize of every quantized module (float16 as mlx
decodes it, float32 for the float modes,
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
DRIVER = REPO / "tests" / "support" / "mlx_driver.py"
# mode -> (bits, group, folder): the float modes' only group is 32 (mlx quantize_model defaults_for_mode)
VARIANTS = {"affine": (4, 64, OUT), "mxfp8": (8, 32, OUT / "mxfp8"), "mxfp4": (4, 32, OUT / "mxfp4"),
            "moe": (4, 64, OUT / "moe")}
MOE_BASE = "tests/support/fixtures_archs.py build_arch_model(kind='qwen3_moe'), config.json as released"


def _moe_base(folder: Path) -> Path:
    """The tiny Qwen3-MoE of tests/support/fixtures_archs.py (2 layers, hidden 128, 4 experts of 64, float32) with
    the config.json keys the released Qwen3-MoE checkpoints carry and mlx-lm 0.32 requires: transformers 5 writes
    the expert count as `num_local_experts`, leaves `head_dim` out when it is hidden / heads and keeps the rope
    base in `rope_parameters`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fixtures_archs", REPO / "tests" / "support" / "fixtures_archs.py")
    archs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(archs)
    archs.build_arch_model(folder, "qwen3_moe")
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(num_experts=cfg["num_local_experts"], head_dim=cfg["hidden_size"] // cfg["num_attention_heads"],
               rope_theta=cfg["rope_parameters"]["rope_theta"])
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    return folder


def _mlx(*args) -> str:
    proc = subprocess.run([str(MLX_PY), str(DRIVER), *map(str, args)], capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"mlx driver {args[0]} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def main(argv: list[str]) -> int:
    fixtures = _common.fixtures()
    if not MLX_PY.exists():
        subprocess.run(["bash", str(REPO / "scripts" / "test_env.d" / "40-mlx.sh")], check=True)
    versions = json.loads(subprocess.run([str(MLX_PY), "-c", "import importlib.metadata as m, json; print(json.dumps("
                                          "{p: m.version(p) for p in ('mlx', 'mlx-lm', 'transformers')}))"],
                                         capture_output=True, text=True, check=True).stdout)
    for mode in argv or list(VARIANTS):
        bits, group, out = VARIANTS[mode]
        with tempfile.TemporaryDirectory(prefix="qconvert-mlx-producer-") as tmp:
            if mode == "moe":
                base = _moe_base(Path(tmp) / "base")
            else:
                base = fixtures.build_tiny_llama(Path(tmp) / "base", **fixtures.BASES["base"])
            # remade in place: the affine folder holds the float modes' folders, which stay
            for stale in (out / "model", out / "reference.safetensors"):
                if stale.is_dir():
                    shutil.rmtree(stale)
                elif stale.exists():
                    stale.unlink()
            out.mkdir(parents=True, exist_ok=True)
            _mlx("convert", base, out / "model", bits, group, "affine" if mode == "moe" else mode)
            _mlx("load", out / "model", out / "reference.safetensors", json.dumps(fixtures.prompt_ids()), 0)
        q_mode = "affine" if mode == "moe" else mode
        _common.write_json(out / "versions.json", {"producer": f"mlx_lm.convert(quantize=True, q_mode={q_mode!r})",
                                                   "q_bits": bits, "q_group_size": group,
                                                   "base": MOE_BASE if mode == "moe" else
                                                   "tests/support/fixtures.py BASES['base']",
                                                   "packages": versions}, indent=2, sort_keys=False)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

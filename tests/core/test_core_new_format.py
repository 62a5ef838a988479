"""What a new format touches, and what a new architecture touches, each shown by adding one from outside the
package through the public API alone (docs/layout.md walks through the same two).

A format. "rowint8" is a toy format: a folder with config.json and `weights.safetensors`, every 2-D weight stored
as int8 codes `<name>.q` with one fp16 scale per output row `<name>.scale` (W = scale * q), everything else as
it is. Adding it takes exactly what a format folder in formats/ holds:

1. its scheme table: one `TargetScheme` (family "rowint8", registered with its handler through
   `register_family`, because no built-in family reads per-row int8 codes) -- the checker decides its verdicts;
2. a reader: a `ModelSource` yielding `TensorRecord`s (grids with `GridParams`, dense tensors as they are);
3. a writer: a `Writer` whose `plan_tensor` asks `check()` and turns the Decision into a plan with `Writer.plan`
   (what it decided beyond the verdict travels as its own typed action), and a `WriterSession` that stores a
   tensor and returns what it decodes to, so the runner measures the error;
4. `register_format(FormatEntry(...))` with a sniff, options and type vocabulary -- and then every command works:
   `qconvert 'hf->rowint8'`, `'rowint8->gguf'` (exact into Q8_0: the checker sees the grid), `inspect`, `verify`.

An architecture. A model class llama.cpp runs under another architecture name is one `register_arch(GgufArch(...))`
(formats/gguf/archs/: its HF classes, its GGUF name, which tensors each layer has, its quirks and hooks); the
names come from gguf-py's TensorNameMap for that architecture, and both directions (hf->gguf, gguf->hf) follow.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import fixtures
from qconvert.converters import registry
from qconvert.converters.checker import EXACT, REQUANTIZE, Decision, TargetScheme, check, register_family
from qconvert.converters.apps.cli import main
from qconvert.converters.errors import BadInput
from qconvert.converters.plan import TensorPlan, Writer, WriterSession
from qconvert.converters.records import Dense, Grid, GridParams, ModelSource, TensorRecord

WEIGHTS = "weights.safetensors"


# -- 1. the scheme table and its family ---------------------------------------------------------------------
def _rowint8_family(src, shape, scheme, native=None, prefer=()) -> Decision:
    if not isinstance(src, GridParams):
        return Decision(REQUANTIZE, "dense weights rounded to int8 per row")
    if src.bits == 8 and src.n_groups == 1 and src.symmetric and src.axis == 1 and src.scales.dtype == torch.float16:
        return Decision(EXACT, "codes and fp16 row scales kept", keeps_codes=True)
    return Decision(REQUANTIZE, f"{describe_grid_short(src)} is not int8 per row")


def describe_grid_short(p: GridParams) -> str:
    return f"{p.bits}-bit, {p.n_groups} group(s) per row"


ROWINT8 = None  # the scheme, made once the family is registered (in the fixture)


# -- 2. the reader -------------------------------------------------------------------------------------------
class RowInt8Source(ModelSource):
    format_name = "rowint8"

    def __init__(self, path: Path, **_):
        self.path = Path(path)
        cfg_path = self.path / "config.json"
        if not (self.path / WEIGHTS).is_file() or not cfg_path.is_file():
            raise BadInput(f"a rowint8 folder holds config.json and {WEIGHTS}", path=self.path)
        self.config = json.loads(cfg_path.read_text())
        self.quant_config = {"quant_method": "rowint8"}
        try:
            with safe_open(str(self.path / WEIGHTS), "pt") as f:
                self.names = list(f.keys())
        except Exception:
            raise BadInput("cannot read safetensors file", path=self.path / WEIGHTS) from None

    def _get(self, name: str) -> torch.Tensor:
        with safe_open(str(self.path / WEIGHTS), "pt") as f:
            return f.get_tensor(name)

    def records(self):
        for name in self.names:
            if name.endswith(".scale"):
                continue
            if name.endswith(".q"):
                base = name[: -len(".q")]
                scale = self._get(f"{base}.scale")[:, None]
                params = GridParams(bits=8, group_size=int(self._get(name).shape[1]), scales=scale,
                                    zeros=torch.full_like(scale, 128, dtype=torch.int16))
                codes = lambda n=name: (self._get(n).to(torch.int16) + 128).to(torch.uint8)  # noqa: E731
                yield TensorRecord(base, tuple(self._get(name).shape), "grid",
                                   lambda p=params, c=codes: Grid(p, c()), params=params, source_file=WEIGHTS)
            else:
                yield TensorRecord(name, tuple(self._get(name).shape), str(self._get(name).dtype)[6:],
                                   lambda n=name: Dense(self._get(n)), source_file=WEIGHTS)

    def side_files(self) -> dict[str, Path]:
        return {p.name: p for p in self.path.iterdir() if p.name.startswith("tokenizer")}

    def describe(self) -> dict:
        return {"format": "rowint8", "path": str(self.path)}


# -- 3. the writer -------------------------------------------------------------------------------------------
class AsRows:
    """The writer's action for a weight it stores as int8 rows (plans without one are copied)."""


class RowInt8Session(WriterSession):
    def __init__(self, path: Path, source):
        self.path, self.source, self.tensors = Path(path), source, {}

    def add(self, plan: TensorPlan, item) -> torch.Tensor:
        if isinstance(plan.action, AsRows):
            if plan.verdict == EXACT:
                codes, scale = item.codes.to(torch.int16) - 128, item.params.scales[:, 0].to(torch.float16)
            else:  # the format's own quantizer: round to int8 per row
                w = item.dequantize(torch.float32)
                scale = (w.abs().amax(1) / 127).clamp(min=1e-8).to(torch.float16)
                codes = torch.round(w / scale.to(torch.float32)[:, None]).clamp(-127, 127)
            self.tensors[f"{plan.name}.q"] = codes.to(torch.int8).contiguous()
            self.tensors[f"{plan.name}.scale"] = scale.contiguous()
            return scale.to(torch.float32)[:, None] * codes.to(torch.float32)
        t = item.dequantize(torch.float32) if isinstance(item, Grid) else item.tensor
        self.tensors[plan.name] = t.contiguous()
        return t.to(torch.float32)

    def close(self) -> None:  # a toy holds its tensors; real writers stream (formats/safetensors_dir.ShardWriter)
        self.path.mkdir(parents=True, exist_ok=True)
        save_file(self.tensors, str(self.path / WEIGHTS))
        (self.path / "config.json").write_text(json.dumps(self.source.config))
        for name, p in self.source.side_files().items():
            shutil.copy(p, self.path / name)


class RowInt8Writer(Writer):
    name = "rowint8"

    def plan_tensor(self, rec: TensorRecord, options, source) -> TensorPlan:
        as_grid = len(rec.shape) == 2 and rec.name.endswith("_proj.weight")
        if not as_grid:
            return self.plan(rec, Decision(EXACT, "copied"), rec.dtype)
        d = check(rec.params if rec.is_grid else rec.dtype, rec.shape, ROWINT8)
        return self.plan(rec, d, "rowint8", action=AsRows())

    def open(self, path: Path, source, plans, options) -> RowInt8Session:
        return RowInt8Session(path, source)


# -- 4. the registration -------------------------------------------------------------------------------------
@pytest.fixture
def rowint8():
    global ROWINT8
    registry.all_formats()
    saved = dict(registry._REGISTRY), dict(registry._ALIASES)
    from qconvert.converters import checker as align

    saved_families = dict(align._HANDLERS)
    register_family("rowint8", _rowint8_family)
    ROWINT8 = TargetScheme("rowint8", "rowint8", bits=8, zero="none", scale="fp16", offset=128)
    registry.register_format(registry.FormatEntry(
        "rowint8", aliases=("int8-rows",), description="toy: int8 codes, one fp16 scale per row",
        open_reader=RowInt8Source, writer=RowInt8Writer(), sniff=lambda p: (Path(p) / WEIGHTS).is_file(),
        type_help="rowint8 has one type", examples=("qconvert 'hf->rowint8' DIR OUT --allow-requant",)))
    try:
        yield
    finally:
        registry._REGISTRY.clear(), registry._REGISTRY.update(saved[0])
        registry._ALIASES.clear(), registry._ALIASES.update(saved[1])
        align._HANDLERS.clear(), align._HANDLERS.update(saved_families)


def _run(capsys, *args) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_a_format_added_through_the_public_api_converts_both_ways(rowint8, tmp_path, capsys):
    base = tmp_path / "base"
    # a dense HF llama, built on first use in a clean checkout (tests/support/fixtures.py)
    shutil.copytree(fixtures.ensure_base(fixtures.DEFAULT_ROOT, "base"), base)
    capsys.readouterr()  # building the fixture prints transformers' progress bars; they are not ours
    # dense -> rowint8: the checker says requantize, so it is refused without --allow-requant
    rc, out, err = _run(capsys, "hf->rowint8", base, tmp_path / "r8")
    assert rc == 2 and err.startswith("qconvert: error: refused:") and "dense weights rounded to int8 per row" in err
    rc, out, err = _run(capsys, "hf->rowint8", base, tmp_path / "r8", "--allow-requant", "--report", tmp_path / "a.json")
    assert rc == 0, err
    report = json.loads((tmp_path / "a.json").read_text())
    assert {t["verdict"] for t in report["tensors"] if t["name"].endswith("_proj.weight")} == {REQUANTIZE}
    # detected, inspected, and moved on: rowint8 -> rowint8 keeps the codes (exact), -> Q8_0 blocks exactly
    assert registry.detect_format(tmp_path / "r8") == "rowint8"
    rc, out, err = _run(capsys, "inspect", tmp_path / "r8")
    assert rc == 0 and "8-bit per-channel sym" in out
    rc, out, err = _run(capsys, "convert", tmp_path / "r8", tmp_path / "again", "--to", "int8-rows", "--quiet")
    assert rc == 0 and "21 tensors: 21 exact; max abs error 0.0" in out, err
    rc, out, err = _run(capsys, "rowint8->gguf", tmp_path / "r8", tmp_path / "r8.gguf", "--type", "q8_0",
                        "--report", tmp_path / "g.json")
    assert rc == 0, err
    report = json.loads((tmp_path / "g.json").read_text())
    grids = [t for t in report["tensors"] if t["name"].endswith("_proj.weight")]
    assert grids and all(t["verdict"] == EXACT and t["max_abs_err"] == 0.0 for t in grids)
    # and back: the GGUF's Q8_0 grid has a scale per 32-block, which one scale per row cannot hold; the
    # checker says so from the data, and the toy's own quantizer takes it with --allow-requant
    rc, out, err = _run(capsys, "gguf->rowint8", tmp_path / "r8.gguf", tmp_path / "back", "--quiet")
    assert rc == 2 and "8-bit, 8 group(s) per row is not int8 per row" in err, err
    rc, out, err = _run(capsys, "gguf->rowint8", tmp_path / "r8.gguf", tmp_path / "back", "--quiet", "--allow-requant")
    assert rc == 0 and "14 requantize" in out, err
    # a writer option of another format is refused by name
    rc, out, err = _run(capsys, "hf->rowint8", base, tmp_path / "x", "--imatrix", tmp_path / "i.dat")
    assert rc == 2 and "--imatrix applies to gguf output only (the target is rowint8)" in err


# -- an architecture ------------------------------------------------------------------------------------------
# A toy model class, "ToyLlamaForCausalLM" (model_type "toy_llama"), that llama.cpp would run as its `xverse`
# architecture (llama's blocks, q/k rows permuted for ggml's rope as llama.cpp's converter does for Xverse): one
# entry, and qconvert writes it to GGUF and reads it back.
@pytest.fixture
def toy_arch():
    from qconvert.formats.gguf.archs import GgufArch, register_arch
    from qconvert.formats.gguf.archs import base as arch_registry

    saved = dict(arch_registry._ARCHS)
    register_arch(GgufArch("xverse", ("ToyLlamaForCausalLM",), ("toy_llama",), "ToyLlamaForCausalLM", "toy_llama",
                           permute_qk=True))
    try:
        yield
    finally:
        arch_registry._ARCHS.clear(), arch_registry._ARCHS.update(saved)


def test_an_architecture_added_through_the_public_api_converts_both_ways(toy_arch, tmp_path, capsys):
    import gguf
    from safetensors.torch import load_file

    base = tmp_path / "toy"
    shutil.copytree(fixtures.ensure_base(fixtures.DEFAULT_ROOT, "base"), base)
    capsys.readouterr()
    config = json.loads((base / "config.json").read_text())
    config.update(architectures=["ToyLlamaForCausalLM"], model_type="toy_llama")
    (base / "config.json").write_text(json.dumps(config))
    rc, out, err = _run(capsys, "hf->gguf", base, tmp_path / "toy.gguf", "--type", "f32", "--quiet")
    assert rc == 0 and "exact" in out, err
    reader = gguf.GGUFReader(str(tmp_path / "toy.gguf"))
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "xverse"
    names = {t.name for t in reader.tensors}
    assert {"token_embd.weight", "blk.0.attn_q.weight", "blk.1.ffn_down.weight", "output.weight"} <= names
    # and back: the entry names the HF class and type, the names map back, every tensor bit for bit
    rc, out, err = _run(capsys, "gguf->hf", tmp_path / "toy.gguf", tmp_path / "back", "--type", "f32", "--quiet")
    assert rc == 0, err
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["architectures"] == ["ToyLlamaForCausalLM"] and back["model_type"] == "toy_llama"
    original = {}
    for f in sorted(base.glob("*.safetensors")):
        original.update(load_file(str(f)))
    again = {}
    for f in sorted((tmp_path / "back").glob("*.safetensors")):
        again.update(load_file(str(f)))
    assert set(again) == set(original)
    assert all(torch.equal(again[n], original[n].to(torch.float32)) for n in original)
    # an architecture nobody registered is refused in one line, naming the supported ones
    config.update(architectures=["NobodyForCausalLM"], model_type="nobody")
    (base / "config.json").write_text(json.dumps(config))
    rc, out, err = _run(capsys, "hf->gguf", base, tmp_path / "no.gguf")
    assert rc == 2 and "architecture NobodyForCausalLM is not supported for GGUF output" in err \
        and "ToyLlamaForCausalLM" in err, err

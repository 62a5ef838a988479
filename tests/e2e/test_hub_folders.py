"""Checkpoint folders as the Hub has them: which files are the model is decided as transformers and
gptqmodel decide it, and everything else that holds weights (a PEFT adapter, Mistral's consolidated
copy beside indexed shards, pickles, GGUF files) is ignored and named.

A folder with such extras converts to output byte-identical to the clean folder's; `qconvert inspect`
names each ignored file; folders where the model's files cannot be told apart are refused in one line;
a malformed or inconsistent index is refused in one line naming it.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from helpers import expect_user_error, run_cli

from qconvert.converters.errors import BadInput
from qconvert.formats.gptq.reader import GptqSource
from qconvert.formats.common.checkpoint import CheckpointDir

GPTQ = "v1_b4_g32_sym"  # bits 4, group_size 32: gptqmodel's own file name would be gptq_model-4bit-32g
INDEX = "model.safetensors.index.json"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
STRAYS = {"training_args.bin": "training state", "optimizer.pt": "training state",
          "pytorch_model.bin": "pickle", "model-q4_0.gguf": "GGUF"}


# -- building messy folders from real checkpoints -------------------------------------------------------------
def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _split_into_shards(folder: Path) -> dict[str, str]:
    """model.safetensors -> two shards and an index, as save_pretrained writes them (names in file order)."""
    tensors = load_file(str(folder / "model.safetensors"))
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        metadata = f.metadata()
    names = sorted(tensors)
    weight_map = {}
    for shard, part in zip(SHARDS, (names[: len(names) // 2], names[len(names) // 2:])):
        save_file({n: tensors[n] for n in part}, str(folder / shard), metadata=metadata)
        weight_map.update({n: shard for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (folder / "model.safetensors").unlink()
    return weight_map


def _add_adapter(folder: Path, rank: int = 4) -> None:
    """A PEFT LoRA adapter for q_proj and v_proj of every layer: adapter_config.json + adapter_model.safetensors
    with PEFT's tensor names and shapes (lora_A [r, in], lora_B [out, r])."""
    cfg = json.loads((folder / "config.json").read_text())
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * (hidden // cfg["num_attention_heads"])
    gen = torch.Generator().manual_seed(5)
    tensors = {}
    for i in range(layers):
        for proj, out in (("q_proj", hidden), ("v_proj", kv)):
            p = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{p}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen).to(torch.float16)
            tensors[f"{p}.lora_B.weight"] = torch.zeros(out, rank, dtype=torch.float16)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": str(folder), "task_type": "CAUSAL_LM"}))


def _add_consolidated(folder: Path, dense: Path) -> None:
    """Mistral's native copy of the weights (mistral-inference names), as Mistral repos ship beside the shards."""
    rename = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
              "lm_head.weight": "output.weight"}
    parts = {"self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
             "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
             "mlp.up_proj": "feed_forward.w3", "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm"}
    out = {}
    for name, t in load_file(str(dense / "model.safetensors")).items():
        new = rename.get(name)
        if new is None and name.startswith("model.layers."):
            new = name[len("model."):]
            for hf, mistral in parts.items():
                new = new.replace(f".{hf}.", f".{mistral}.")
        out[new or name] = t.to(torch.bfloat16)
    save_file(out, str(folder / "consolidated.safetensors"))


def _add_strays(folder: Path, gguf_bytes: bytes) -> None:
    torch.save({"learning_rate": 1e-4}, folder / "training_args.bin")
    torch.save({"state": {}, "param_groups": []}, folder / "optimizer.pt")
    torch.save({"model.norm.weight": torch.ones(4)}, folder / "pytorch_model.bin")
    (folder / "model-q4_0.gguf").write_bytes(gguf_bytes)


def _convert(src_fmt: str, src: Path, dst_fmt: str, out: Path, **kw) -> Path:
    from qconvert.converters.plan import Options
    from qconvert.converters.run import convert

    convert(src_fmt, Path(src), dst_fmt, Path(out), Options(**kw), progress=False)
    return out


def _files(out: Path) -> dict[str, bytes]:
    if out.is_file():
        return {"": out.read_bytes()}  # a GGUF file: its bytes, whatever its name
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def _assert_same_output(a: Path, b: Path) -> None:
    fa, fb = _files(a), _files(b)
    assert sorted(fa) == sorted(fb)
    for name in fa:
        assert fa[name] == fb[name], f"{name} differs between {a} and {b}"


@pytest.fixture(scope="module")
def gptq_folders(fx, tmp_path_factory):
    """The clean gptqmodel checkpoint, the same with an adapter and stray weight files, and an indexed
    two-shard copy with consolidated.safetensors, an adapter and strays."""
    root = tmp_path_factory.mktemp("hub")
    clean = _copy(fx["variants"][GPTQ]["ckpt"], root / "clean")
    gguf = _convert("gptq", clean, "gguf", root / "clean-out.gguf")
    adapter = _copy(clean, root / "adapter")
    _add_adapter(adapter)
    _add_strays(adapter, gguf.read_bytes())
    sharded = _copy(clean, root / "sharded")
    _split_into_shards(sharded)
    _add_consolidated(sharded, fx["bases"]["base"])
    _add_adapter(sharded)
    _add_strays(sharded, gguf.read_bytes())
    return {"root": root, "clean": clean, "adapter": adapter, "sharded": sharded}


# -- byte-identical outputs ----------------------------------------------------------------------------------
@pytest.mark.parametrize("target,out_name", [("gguf", "out.gguf"), ("hf", "hf"), ("uqff", "uqff")])
def test_gptq_folder_with_extras_converts_like_the_clean_one(gptq_folders, tmp_path, target, out_name):
    ref = _convert("gptq", gptq_folders["clean"], target, tmp_path / "clean" / out_name)
    for kind in ("adapter", "sharded"):
        out = _convert("gptq", gptq_folders[kind], target, tmp_path / kind / out_name)
        _assert_same_output(ref, out)


def test_inspect_names_every_ignored_file(gptq_folders):
    for kind, shards in (("adapter", 1), ("sharded", 2)):
        if kind == "sharded":
            info = json.loads(run_cli("inspect", gptq_folders[kind], "--json").stdout)
        else:
            info = GptqSource(gptq_folders[kind]).describe()
        ignored = info["ignored_files"]
        expected = {"adapter_model.safetensors", *STRAYS} | ({"consolidated.safetensors"} if kind == "sharded" else set())
        assert set(ignored) == expected, ignored
        assert "adapter" in ignored["adapter_model.safetensors"].lower()
        for name, word in STRAYS.items():
            assert word.lower() in ignored[name].lower(), (name, ignored[name])
        if kind == "sharded":
            assert "Mistral" in ignored["consolidated.safetensors"]
        assert info["shards"] == shards and info["format"] == "gptq"
    text = run_cli("inspect", gptq_folders["adapter"]).stdout
    assert "ignored_files" in text and "adapter_model.safetensors" in text and "training_args.bin" in text
    assert GptqSource(gptq_folders["clean"]).describe()["ignored_files"] == {}


def test_adapter_beside_a_gptq_model_converts_to_hf_through_the_cli(gptq_folders, tmp_path):
    """The reported case: gptq->hf with adapter_model.safetensors beside the model used to stop on a
    duplicate tensor name / foreign tensors; it now gives the clean folder's output."""
    _convert("gptq", gptq_folders["clean"], "hf", tmp_path / "a")
    proc = run_cli("gptq->hf", gptq_folders["adapter"], tmp_path / "b")
    assert "Traceback" not in proc.stderr
    _assert_same_output(tmp_path / "a", tmp_path / "b")


# -- the model's file names as the producers write them -------------------------------------------------------
def test_gptqmodel_and_autogptq_file_names(gptq_folders, tmp_path):
    ref = _convert("gptq", gptq_folders["clean"], "gguf", tmp_path / "ref.gguf")
    # gptqmodel 7.6 looks for gptq_model-{bits}bit-{group_size}g before model
    old = _copy(gptq_folders["clean"], tmp_path / "gptqmodel-name")
    (old / "model.safetensors").rename(old / "gptq_model-4bit-32g.safetensors")
    _add_adapter(old)
    _assert_same_output(ref, _convert("gptq", old, "gguf", tmp_path / "a.gguf"))
    assert CheckpointDir(old).shards == ["gptq_model-4bit-32g.safetensors"]
    # AutoGPTQ named the file in quantize_config.json (model_file_base_name)
    auto = _copy(gptq_folders["clean"], tmp_path / "autogptq-name")
    (auto / "model.safetensors").rename(auto / "llama-tiny-4bit.safetensors")
    qc = json.loads((auto / "config.json").read_text())
    qc.pop("quantization_config")
    (auto / "config.json").write_text(json.dumps(qc))
    q = json.loads((auto / "quantize_config.json").read_text())
    q["model_file_base_name"] = "llama-tiny-4bit"
    (auto / "quantize_config.json").write_text(json.dumps(q))
    shutil.copy(gptq_folders["clean"] / "model.safetensors", auto / "other-copy.safetensors")
    _assert_same_output(ref, _convert("gptq", auto, "gguf", tmp_path / "b.gguf"))
    assert CheckpointDir(auto).ignored == {"other-copy.safetensors": "not part of the model (AutoGPTQ read "
                                                                      "llama-tiny-4bit.safetensors)"}
    q["model_file_base_name"] = "../llama-tiny-4bit"
    (auto / "quantize_config.json").write_text(json.dumps(q))
    expect_user_error("gptq->gguf", auto, tmp_path, "quantize_config.json", "model_file_base_name",
                      out_name="c.gguf")


# -- ambiguous folders are refused in one line ----------------------------------------------------------------
def test_shards_without_an_index_are_refused_naming_them(gptq_folders, tmp_path):
    folder = _copy(gptq_folders["sharded"], tmp_path / "no-index")
    (folder / INDEX).unlink()
    err = expect_user_error("gptq->gguf", folder, tmp_path, *SHARDS, INDEX, out_name="x.gguf")
    assert "consolidated.safetensors" not in err and "adapter_model" not in err


def test_model_and_an_index_naming_other_files_are_refused(gptq_folders, tmp_path):
    folder = _copy(gptq_folders["sharded"], tmp_path / "both")
    shutil.copy(gptq_folders["clean"] / "model.safetensors", folder / "model.safetensors")
    expect_user_error("gptq->uqff", folder, tmp_path, "ambiguous", "transformers reads model.safetensors",
                      f"gptqmodel reads {INDEX}", out_name="x")


def test_gptqmodel_name_and_model_safetensors_are_refused(gptq_folders, tmp_path):
    folder = _copy(gptq_folders["clean"], tmp_path / "two-names")
    shutil.copy(folder / "model.safetensors", folder / "gptq_model-4bit-32g.safetensors")
    expect_user_error("gptq->hf", folder, tmp_path, "ambiguous", "gptq_model-4bit-32g.safetensors",
                      "model.safetensors", out_name="x")


def test_only_an_adapter_is_refused(gptq_folders, tmp_path):
    folder = _copy(gptq_folders["clean"], tmp_path / "adapter-only")
    (folder / "model.safetensors").unlink()
    _add_adapter(folder)
    expect_user_error("gptq->gguf", folder, tmp_path, "adapter_model.safetensors", "no model weights",
                      out_name="x.gguf")


# -- the index, checked -------------------------------------------------------------------------------------
def _with_index(base: Path, dst: Path, edit) -> Path:
    folder = _copy(base, dst)
    index = json.loads((folder / INDEX).read_text())
    text = edit(index)
    (folder / INDEX).write_text(text if isinstance(text, str) else json.dumps(index))
    return folder


def _first(index):
    return next(iter(index["weight_map"]))


@pytest.mark.parametrize("case,needles", [
    ("parent", ("'../model-00001-of-00002.safetensors'", "inside the folder")),
    ("absolute", ("'/tmp/model-00001-of-00002.safetensors'", "inside the folder")),
    ("subfolder", ("'sub/model-00001-of-00002.safetensors'", "no directories")),
    ("not-a-string", ("weight_map value is an integer",)),
    ("a-list", ("weight_map value is an array",)),  # unhashable: a TypeError before the fuzzer found it
    ("not-a-dict", ("weight_map is an array",)),
    ("empty", ("weight_map is an object",)),
    ("missing-shard", ("model-00003-of-00003.safetensors", "missing")),
    ("directory", ("a directory",)),
    ("twice", ("listed twice in weight_map",)),
    ("not-in-shard", ("model.extra.weight", "no shard holds it")),
])
def test_malformed_index_is_one_line(gptq_folders, tmp_path, case, needles):
    def edit(index):
        wm = index["weight_map"]
        name = _first(index)
        if case == "parent":
            wm[name] = "../" + wm[name]
        elif case == "absolute":
            wm[name] = "/tmp/" + wm[name]
        elif case == "subfolder":
            wm[name] = "sub/" + wm[name]
        elif case == "not-a-string":
            wm[name] = 3
        elif case == "a-list":
            wm[name] = [1, 2]
        elif case == "not-a-dict":
            index["weight_map"] = list(wm)
        elif case == "empty":
            index["weight_map"] = {}
        elif case == "missing-shard":
            wm[name] = "model-00003-of-00003.safetensors"
        elif case == "directory":
            wm[name] = "shard-dir.safetensors"
        elif case == "twice":
            text = json.dumps(index)
            return text.replace('"weight_map": {', f'"weight_map": {{"{name}": "{wm[name]}", ', 1)
        elif case == "not-in-shard":
            wm["model.extra.weight"] = SHARDS[0]
        return None

    folder = _with_index(gptq_folders["sharded"], tmp_path / case, edit)
    (folder / "shard-dir.safetensors").mkdir()
    with pytest.raises(BadInput) as e:
        GptqSource(folder)
    err = str(e.value)
    assert "\n" not in err and all(n in err for n in needles), err
    assert err.startswith(str(folder / INDEX)) or case in ("missing-shard", "directory"), err
    if case in ("parent", "not-in-shard"):  # and the whole contract through the CLI
        expect_user_error("gptq->gguf", folder, tmp_path, INDEX, *needles, out_name="x.gguf")


def test_shard_tensors_the_index_does_not_list_are_read_with_one_warning(gptq_folders, tmp_path):
    """transformers loads every tensor of the files the index names: so does qconvert, and says so."""
    def drop(index):
        index["weight_map"].pop("lm_head.weight")
    folder = _with_index(gptq_folders["sharded"], tmp_path / "unlisted", drop)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt = CheckpointDir(folder)
    assert "lm_head.weight" in ckpt.location
    lines = [str(w.message) for w in caught]
    assert len(lines) == 1 and "lm_head.weight" in lines[0] and INDEX in lines[0] and "\n" not in lines[0]
    _convert("gptq", gptq_folders["clean"], "gguf", tmp_path / "ref.gguf")
    proc = run_cli("gptq->gguf", folder, tmp_path / "out.gguf")
    assert "Traceback" not in proc.stderr
    assert [l for l in proc.stderr.splitlines() if "lm_head.weight" in l][0].startswith("qconvert: warning: ")
    _assert_same_output(tmp_path / "ref.gguf", tmp_path / "out.gguf")


# -- hqq and dense hf folders ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hqq_tf():
    import hqq_env

    hqq_env._hqq_run("build", "--root", hqq_env.ROOT)
    return hqq_env.ROOT / "b4_g64_ax1" / "tf"


def test_hqq_folder_with_an_adapter_converts_like_the_clean_one(hqq_tf, tmp_path):
    clean = _copy(hqq_tf, tmp_path / "clean")
    messy = _copy(hqq_tf, tmp_path / "messy")
    _add_adapter(messy)
    (messy / "model-q4_1.gguf").write_bytes(b"GGUF" + bytes(60))
    ref = _convert("hqq", clean, "gguf", tmp_path / "a.gguf")
    _assert_same_output(ref, _convert("hqq", messy, "gguf", tmp_path / "b.gguf"))
    info = json.loads(run_cli("inspect", messy, "--json").stdout)
    assert info["format"] == "hqq" and set(info["ignored_files"]) == {"adapter_model.safetensors", "model-q4_1.gguf"}


def test_hf_folder_sharded_with_consolidated_and_adapter(fx, tmp_path):
    base = fx["bases"]["base"]
    clean = _copy(base, tmp_path / "clean")
    messy = _copy(base, tmp_path / "messy")
    _split_into_shards(messy)
    _add_consolidated(messy, base)
    _add_adapter(messy)
    _add_strays(messy, b"GGUF" + bytes(60))
    ref = _convert("hf", clean, "gguf", tmp_path / "a.gguf", type="f16", allow_requant=True)
    _assert_same_output(ref, _convert("hf", messy, "gguf", tmp_path / "b.gguf", type="f16", allow_requant=True))
    info = json.loads(run_cli("inspect", messy, "--json").stdout)
    assert info["format"] == "hf" and info["shards"] == 2
    assert set(info["ignored_files"]) == {"adapter_model.safetensors", "consolidated.safetensors", *STRAYS}
    # an index beside model.safetensors: transformers reads model.safetensors and never opens the index
    both = _copy(clean, tmp_path / "both")
    shutil.copy(messy / INDEX, both / INDEX)
    for shard in SHARDS:
        shutil.copy(messy / shard, both / shard)
    ckpt = CheckpointDir(both)
    assert ckpt.shards == ["model.safetensors"] and set(ckpt.ignored) == {*SHARDS, INDEX}


def test_ambiguity_message_is_one_line_naming_the_candidates(tmp_path):
    folder = tmp_path / "f"
    folder.mkdir()
    for i in range(9):
        save_file({"w": torch.zeros(1)}, str(folder / f"part{i}.safetensors"))
    with pytest.raises(BadInput) as e:
        CheckpointDir(folder)
    msg = str(e.value)
    assert "\n" not in msg and "part0.safetensors" in msg and "and 3 more" in msg


# -- GGUF folders: a folder holding one GGUF (or one split set) is that GGUF ----------------------------------
def _write_side_gguf(path: Path, arch: str, kind: str | None) -> None:
    """A small GGUF that is not a model, as gguf-py writes them: a vision projector (arch clip, general.type
    mmproj), a LoRA adapter or an imatrix (general.type adapter / imatrix)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    if kind is not None:
        w.add_type(kind)
    w.add_tensor("v.patch_embd.weight", np.zeros((4, 32), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _hub_gguf_folder(dst: Path, *models: Path) -> Path:
    """A folder as Hub GGUF repos hold one: the model file(s) beside a README, .gitattributes, an imatrix
    in llama-imatrix's .dat form and a params file."""
    dst.mkdir(parents=True)
    for m in models:
        shutil.copy(m, dst / m.name)
    (dst / "README.md").write_text("# tiny\n")
    (dst / ".gitattributes").write_text("*.gguf filter=lfs diff=lfs merge=lfs -text\n")
    (dst / "imatrix.dat").write_bytes(bytes(64))
    (dst / "params").write_text("{}\n")
    return dst


@pytest.fixture(scope="module")
def gguf_folders(fx, tmp_path_factory):
    """The tiny GPTQ model as one GGUF file and as a split set of several parts, each alone in a Hub-like folder."""
    root = tmp_path_factory.mktemp("gguf-folders")
    file = _convert("gptq", fx["variants"][GPTQ]["ckpt"], "gguf", root / "files" / "tiny-Q4_0.gguf")
    _convert("gguf", file, "gguf", root / "split" / "tiny.gguf", extra={"split_max_size": 150_000})
    parts = sorted((root / "split").iterdir())
    assert len(parts) >= 3 and [p.name for p in parts] == [f"tiny-{i:05d}-of-{len(parts):05d}.gguf"
                                                           for i in range(1, len(parts) + 1)]
    return {"file": file, "parts": parts, "one": _hub_gguf_folder(root / "one", file),
            "split": _hub_gguf_folder(root / "split-folder", *parts)}


@pytest.mark.parametrize("kind", ["one", "split"])
def test_gguf_folder_converts_like_its_file(gguf_folders, tmp_path, kind):
    """The folder gives the bytes its file (or its split set, named by any part) gives, to hf and to gguf."""
    file = gguf_folders["file"] if kind == "one" else gguf_folders["parts"][1]
    folder = gguf_folders[kind]
    for target, name in (("hf", "hf"), ("gguf", "out.gguf")):
        ref = _convert("gguf", file, target, tmp_path / "file" / name)
        _assert_same_output(ref, _convert("gguf", folder, target, tmp_path / "folder" / name))
    # through the CLI: the pair form, and convert --to, which detects the folder as gguf
    proc = run_cli("gguf->hf", folder, tmp_path / "pair")
    assert "ignored" not in proc.stdout  # README.md, .gitattributes, imatrix.dat and params are not weights
    _assert_same_output(tmp_path / "file" / "hf", tmp_path / "pair")
    proc = run_cli("convert", folder, tmp_path / "detected", "--to", "hf")
    assert "detected source format: gguf" in proc.stderr
    _assert_same_output(tmp_path / "file" / "hf", tmp_path / "detected")


def test_inspect_gguf_folder_says_what_its_file_says(gguf_folders):
    for kind, file in (("one", gguf_folders["file"]), ("split", gguf_folders["parts"][0])):
        info = json.loads(run_cli("inspect", gguf_folders[kind], "--json").stdout)
        assert info.pop("folder") == str(gguf_folders[kind]) and info.pop("ignored_files") == {}
        assert info == json.loads(run_cli("inspect", file, "--json").stdout)
        assert info["format"] == "gguf" and info["tensors"] == 21
    assert info["parts"] == [p.name for p in gguf_folders["parts"]]


def test_verify_reads_gguf_folders_as_source_and_as_output(fx, gguf_folders, tmp_path):
    from qconvert.converters.apps.verify import verify

    def table(report):
        return [(r.plan.name, r.plan.verdict, r.max_abs_err) for r in report.results]

    gptq = fx["variants"][GPTQ]["ckpt"]
    as_output = verify(gptq, gguf_folders["one"], progress=False)
    assert table(as_output) == table(verify(gptq, gguf_folders["file"], progress=False))
    assert as_output.target_format == "gguf" and len(as_output.results) == 21
    hf = _convert("gguf", gguf_folders["file"], "hf", tmp_path / "hf")
    proc = run_cli("verify", gguf_folders["split"], hf, "--strict", check_rc=None)
    ref = run_cli("verify", gguf_folders["parts"][0], hf, "--strict", check_rc=None)
    assert proc.returncode == ref.returncode and proc.stdout.splitlines()[:-1] == ref.stdout.splitlines()[:-1]
    assert "21 tensors" in proc.stdout.splitlines()[-1]


def test_batch_job_with_a_gguf_folder_source(gguf_folders, tmp_path):
    """One dry-run job (each job is a qconvert process): its source a folder holding a split set, detected."""
    (tmp_path / "m.json").write_text(json.dumps({"jobs": [
        {"src": str(gguf_folders["split"]), "pair": "auto->hf", "out": "out/detected"}]}))
    proc = run_cli("batch", tmp_path / "m.json", "--workers", "1", "--dry-run")
    assert proc.stdout.split()[0] == "planned", proc.stdout
    (job,) = json.loads((tmp_path / "batch-report" / "batch.json").read_text())["jobs"]
    assert job["status"] == "planned" and sum(job["verdicts"].values()) == 21
    assert not (tmp_path / "out").exists()


def test_projector_adapter_and_imatrix_beside_the_model_are_named_not_read(gguf_folders, tmp_path):
    """llama.cpp takes a vision projector with --mmproj, an adapter with --lora: the model is the other
    file, and the report says the others were not carried (by name, mmproj-*.gguf, or by header)."""
    folder = _hub_gguf_folder(tmp_path / "vl", gguf_folders["file"])
    _write_side_gguf(folder / "mmproj-F16.gguf", "clip", "mmproj")
    _write_side_gguf(folder / "vision-projector-old.gguf", "clip", None)  # from before general.type
    _write_side_gguf(folder / "lora.gguf", "llama", "adapter")
    _write_side_gguf(folder / "imatrix.gguf", "llama", "imatrix")
    ref = _convert("gguf", gguf_folders["file"], "hf", tmp_path / "ref")
    proc = run_cli("gguf->hf", folder, tmp_path / "out")
    _assert_same_output(ref, tmp_path / "out")
    ignored = [ln for ln in proc.stdout.splitlines() if ln.startswith("ignored: ")]
    assert [ln.split()[1] for ln in ignored] == ["imatrix.gguf", "lora.gguf", "mmproj-F16.gguf",
                                                 "vision-projector-old.gguf"], ignored
    assert "--mmproj" in ignored[2] and "--mmproj" in ignored[3] and "--lora" in ignored[1]
    info = json.loads(run_cli("inspect", folder, "--json").stdout)
    assert "not carried" in info["ignored_files"]["mmproj-F16.gguf"] and info["tensors"] == 21


def test_several_ggufs_in_a_folder_are_refused_naming_them(gguf_folders, tmp_path):
    """Hub GGUF repos ship one file per quantization: only the user knows which is meant."""
    folder = _hub_gguf_folder(tmp_path / "repo", gguf_folders["file"], *gguf_folders["parts"])
    shutil.copy(gguf_folders["file"], folder / "tiny-Q8_0.gguf")
    _write_side_gguf(folder / "mmproj-F16.gguf", "clip", "mmproj")
    parts = gguf_folders["parts"]
    names = ("tiny-Q4_0.gguf", "tiny-Q8_0.gguf", f"{parts[0].name} (split set of {len(parts)})", "pass the file")
    err = expect_user_error("gguf->hf", folder, tmp_path, *names)
    assert "3 GGUF models" in err and "mmproj" not in err
    for args in (("convert", folder, tmp_path / "out", "--to", "gguf"), ("inspect", folder)):
        proc = run_cli(*args, check_rc=2)
        assert len(proc.stderr.strip().splitlines()) == 1 and all(n in proc.stderr for n in names), proc.stderr
    assert not (tmp_path / "out").exists()


def test_incomplete_split_set_or_only_a_projector_is_refused(gguf_folders, tmp_path):
    folder = _hub_gguf_folder(tmp_path / "split", *gguf_folders["parts"][::2])
    missing = gguf_folders["parts"][1].name
    expect_user_error("gguf->hf", folder, tmp_path, missing, "missing")
    proc = run_cli("convert", folder, tmp_path / "out", "--to", "hf", check_rc=2)
    assert f"{missing} is missing" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    projector = tmp_path / "projector"
    projector.mkdir()
    _write_side_gguf(projector / "mmproj-F16.gguf", "clip", "mmproj")
    expect_user_error("gguf->hf", projector, tmp_path, "mmproj-F16.gguf", "--mmproj", "no model")

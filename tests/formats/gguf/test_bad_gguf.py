"""Bad GGUF input, and bad inputs of the GGUF writer: one line naming the file (and the key or tensor),
exit 2, no traceback, no warning before it, no hang, nothing allocated beyond what the file holds.

Producers of the files mutated here: qconvert's own GGUF writer (`gptq->gguf` of a gptqmodel
checkpoint) and llama.cpp's quantizer (`llama_cpp.llama_model_quantize`, Q8_0, from qconvert's F32
GGUF of the same checkpoint). Each test copies a file and edits a few bytes in place through gguf-py's
memory-mapped reader (the value, count, type or dims where they sit in the file).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import shutil
import time
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest

from helpers import expect_user_error, run_cli

from qconvert.converters.apps.cli import main as cli_main
from qconvert.converters.errors import BadInput
from qconvert.converters.plan import Options
from qconvert.converters.run import convert
from qconvert.formats.gguf.reader import GgufSource, scan_header

import llama_cpp

ARCH = "llama"


# -- the files ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def made(fx, tmp_path_factory):
    """{"ours": Q4_0 GGUF written by qconvert from gptqmodel's checkpoint, "llama": Q8_0 by llama.cpp}."""
    d = tmp_path_factory.mktemp("bad_gguf")
    ckpt = fx["variants"]["v1_b4_g32_sym"]["ckpt"]
    ours, f32, q8 = d / "ours.gguf", d / "f32.gguf", d / "llama_q8_0.gguf"
    run_cli("gptq->gguf", ckpt, ours, "--quiet")
    run_cli("gptq->gguf", ckpt, f32, "--type", "f32", "--quiet")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = 7  # LLAMA_FTYPE_MOSTLY_Q8_0
    params.nthread = 2
    assert llama_cpp.llama_model_quantize(str(f32).encode(), str(q8).encode(), params) == 0
    return {"ours": ours, "llama": q8}


def _edit(src: Path, dst: Path, fn) -> Path:
    """Copy SRC to DST and let `fn(reader)` change bytes through gguf-py's writable memory map."""
    shutil.copy(src, dst)
    reader = gguf.GGUFReader(str(dst), "r+")
    fn(reader)
    reader.data.flush()
    del reader
    return dst


def _set(key: str, value):
    def fn(r):
        f = r.fields[key]
        f.parts[f.data[0]][0] = value
    return fn


def _tensor(r, name: str):
    return next(t for t in r.tensors if t.name == name)


def _inspect_fails(path: Path, *needles: str) -> str:
    """`qconvert inspect PATH` (the CLI's main in this process, to spare a torch import per case):
    exit 2, one line on stderr naming PATH and every needle, nothing on stdout."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(["inspect", str(path)])
    text = err.getvalue().strip()
    assert rc == 2, (rc, text)
    assert text.startswith("qconvert: error: ") and len(text.splitlines()) == 1, text
    assert "Traceback" not in text and out.getvalue() == ""
    for needle in needles:
        assert needle in text, (needle, text)
    return text


def _fails(path: Path, tmp_path: Path, *needles: str, named: Path | None = None) -> None:
    """gguf->hf (a real CLI process) and inspect both refuse PATH in one line naming it (or the part
    `named`) and every needle."""
    expect_user_error("gguf->hf", path, tmp_path, str(named or path), *needles, out_name="out_hf")
    _inspect_fails(path, str(named or path), *needles)


def _quietly_refused(path: Path, *needles: str) -> str:
    """The reader API itself refuses with BadInput and lets no warning or log record out."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    root = logging.getLogger()
    handler = Keep(logging.WARNING)
    root.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(BadInput) as ei:
                GgufSource(path)
    finally:
        root.removeHandler(handler)
    assert not caught, [str(w.message) for w in caught]
    assert not records, [r.getMessage() for r in records]
    msg = str(ei.value)
    for needle in needles:
        assert needle in msg, (needle, msg)
    return msg


# -- the originals read cleanly --------------------------------------------------------------------------
def test_the_unmutated_files_read(made, tmp_path):
    for name, path in made.items():
        src = GgufSource(path)
        assert src.config["num_hidden_layers"] == 2 and len(list(src.records())) > 0, name
        run_cli("gguf->hf", path, tmp_path / f"hf_{name}", "--quiet")


# -- metadata that contradicts the tensors --------------------------------------------------------------
@pytest.mark.parametrize("which", ["ours", "llama"])
@pytest.mark.parametrize("key,value,needle", [
    ("attention.head_count", 0, "llama.attention.head_count is 0"),
    ("attention.head_count", 3, "head_count 3 is not a multiple of"),
    ("attention.head_count_kv", 5, "llama.attention.head_count_kv is 5"),
    ("attention.key_length", 2**31, "llama.attention.key_length is 2147483648"),
    ("embedding_length", 0, "llama.embedding_length is 0"),
])
def test_metadata_out_of_range(made, tmp_path, which, key, value, needle):
    bad = _edit(made[which], tmp_path / "bad.gguf", _set(f"{ARCH}.{key}", value))
    _fails(bad, tmp_path, needle)


@pytest.mark.parametrize("which", ["ours", "llama"])
def test_key_length_that_contradicts_the_q_rows(made, tmp_path, which):
    """key_length 64 is a fine number, but 4 heads of 64 are not the 128 rows attn_q holds."""
    bad = _edit(made[which], tmp_path / "bad.gguf", _set(f"{ARCH}.attention.key_length", 64))
    _fails(bad, tmp_path, "tensor blk.0.attn_q.weight", "llama.attention.key_length 64", "[256, 128]")


def test_head_count_that_divides_but_contradicts(made, tmp_path):
    bad = _edit(made["ours"], tmp_path / "bad.gguf", _set(f"{ARCH}.attention.head_count", 8))
    _fails(bad, tmp_path, "tensor blk.0.attn_q.weight", "llama.attention.head_count 8")


def test_feed_forward_length_contradicts(made, tmp_path):
    bad = _edit(made["llama"], tmp_path / "bad.gguf", _set(f"{ARCH}.feed_forward_length", 512))
    _fails(bad, tmp_path, "tensor blk.0.ffn_gate.weight", "llama.feed_forward_length 512")


@pytest.mark.parametrize("which", ["ours", "llama"])
@pytest.mark.parametrize("count", [1, 3, 2**32 - 1])
def test_block_count_other_than_the_layers_present(made, tmp_path, which, count):
    """2**32 - 1 once looped over every layer index before comparing with the tensors: now it is
    refused before any per-layer work, in seconds."""
    bad = _edit(made[which], tmp_path / "bad.gguf", _set(f"{ARCH}.block_count", count))
    t0 = time.monotonic()
    _fails(bad, tmp_path, f"llama.block_count is {count}", "hold 2 layers")
    assert time.monotonic() - t0 < 60


def test_tensor_dims_edited_to_fewer_bytes(made, tmp_path):
    """ffn_up [256 rows] -> [128 rows]: its data no longer ends where the next tensor's begins."""
    def fn(r):
        _tensor(r, "blk.0.ffn_up.weight").field.parts[3][1] = 128
    bad = _edit(made["ours"], tmp_path / "bad.gguf", fn)
    _fails(bad, tmp_path, "blk.0.ffn_up.weight", "tensor infos contradict each other")


def test_tensor_dims_swapped(made, tmp_path):
    """token_embd [128 x 512] stored as [512 x 128]: the same bytes, the wrong shape for the metadata."""
    def fn(r):
        dims = _tensor(r, "token_embd.weight").field.parts[3]
        dims[0], dims[1] = int(dims[1]), int(dims[0])
    bad = _edit(made["llama"], tmp_path / "bad.gguf", fn)
    _fails(bad, tmp_path, "tensor token_embd.weight", "shape [128, 512]", "[512, 128]")


def test_last_tensor_dims_grow_past_the_file(made, tmp_path):
    def fn(r):
        r.tensors[-1].field.parts[3][-1] = 1 << 40
    bad = _edit(made["ours"], tmp_path / "bad.gguf", fn)
    _fails(bad, tmp_path, "truncated", "tensor ")


@pytest.mark.parametrize("which, name, itype", [("llama", "blk.0.attn_norm.weight", "I32"),
                                                ("ours", "output_norm.weight", "I32"),
                                                ("ours", "token_embd.weight", "I16")])
def test_float_weight_relabelled_as_an_integer_type(made, tmp_path, which, name, itype):
    """F32 -> I32, F16 -> I16: the same bytes fit where they stand, only the type now says integers (a norm of
    values near 1e9); llama.cpp aborts on an I32 norm, qconvert refuses it."""
    new_type = gguf.GGMLQuantizationType[itype]

    def fn(r):
        t = _tensor(r, name)
        assert gguf.GGML_QUANT_SIZES[t.tensor_type] == gguf.GGML_QUANT_SIZES[new_type]
        t.field.parts[4][0] = int(new_type)
    bad = _edit(made[which], tmp_path / "bad.gguf", fn)
    _fails(bad, tmp_path, f"tensor {name}", f"ggml type {itype} is an integer type", "float weight")


@pytest.mark.parametrize("which", ["ours", "llama"])
def test_flipped_byte_in_a_metadata_string(made, tmp_path, which):
    def fn(r):
        f = r.fields["general.architecture"]
        f.parts[f.data[0]][0] = 0xFF  # "llama" -> "\xfflama", not UTF-8
    bad = _edit(made[which], tmp_path / "bad.gguf", fn)
    _fails(bad, tmp_path, "general.architecture", "not valid UTF-8")


def test_flipped_byte_in_a_token(made, tmp_path):
    def fn(r):
        f = r.fields["tokenizer.ggml.tokens"]
        f.parts[f.data[100]][0] = 0xC0
    bad = _edit(made["llama"], tmp_path / "bad.gguf", fn)
    _fails(bad, tmp_path, "tokenizer.ggml.tokens", "element 100", "not valid UTF-8")


def test_flipped_byte_in_a_key_and_a_tensor_name(made, tmp_path):
    def key(r):
        r.fields["general.name"].parts[1][0] = 0xFE
    bad = _edit(made["ours"], tmp_path / "key.gguf", key)
    _fails(bad, tmp_path, "metadata key", "not valid UTF-8")

    def name(r):
        _tensor(r, "blk.1.attn_k.weight").field.parts[1][0] = 0xFE
    bad = _edit(made["ours"], tmp_path / "name.gguf", name)
    _fails(bad, tmp_path, "the name of tensor", "not valid UTF-8")


# -- counts from the header that once made gguf-py loop or allocate -----------------------------------
@pytest.mark.parametrize("which", ["ours", "llama"])
@pytest.mark.parametrize("count,needle", [(2**30, "declares 1073741824 elements"),
                                          (2**63, "declares 9223372036854775808 elements"),
                                          (None, None)])
def test_array_count_edited(made, tmp_path, which, count, needle):
    """tokens' element count: huge (once a 1G-iteration loop in gguf-py) or one more than written
    (the walk then reads the next key's bytes as a token and falls out of step)."""
    def fn(r):
        f = r.fields["tokenizer.ggml.tokens"]
        f.parts[4][0] = count if count is not None else int(f.parts[4][0]) + 1
    bad = _edit(made[which], tmp_path / "bad.gguf", fn)
    t0 = time.monotonic()
    _fails(bad, tmp_path, *([needle, "tokenizer.ggml.tokens"] if needle else []))
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("etype,needle", [(int(gguf.GGUFValueType.ARRAY), "array of arrays"),
                                          (int(gguf.GGUFValueType.STRING), "tokenizer.ggml.token_type"),
                                          (int(gguf.GGUFValueType.UINT64), None),
                                          (77, "array of unknown type id 77")])
def test_array_element_type_edited(made, tmp_path, etype, needle):
    def fn(r):
        r.fields["tokenizer.ggml.token_type"].parts[3][0] = etype
    bad = _edit(made["llama"], tmp_path / "bad.gguf", fn)
    t0 = time.monotonic()
    _fails(bad, tmp_path, *([needle] if needle else []))
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("field,value,needle", [("GGUF.kv_count", 2**40, "metadata keys, more than"),
                                                ("GGUF.tensor_count", 2**40, "tensors, more than"),
                                                ("GGUF.kv_count", None, None)])
def test_header_counts_edited(made, tmp_path, field, value, needle):
    def fn(r):
        part = r.fields[field].parts[0]
        part[0] = value if value is not None else int(part[0]) + 1
    bad = _edit(made["ours"], tmp_path / "bad.gguf", fn)
    _fails(bad, tmp_path, *([needle] if needle else []))


# -- silent corruption: fewer tensors, a missing one -------------------------------------------------
@pytest.mark.parametrize("which", ["ours", "llama"])
@pytest.mark.parametrize("fewer", [1, 2, 5])
def test_tensor_count_edited_down(made, tmp_path, which, fewer):
    """Once read as a model with fewer tensors and exit 0; now the tensor infos no longer describe
    the data section and the file is refused."""
    def fn(r):
        r.fields["GGUF.tensor_count"].parts[0][0] -= fewer
    bad = _edit(made[which], tmp_path / "bad.gguf", fn)
    _fails(bad, tmp_path)


@pytest.mark.parametrize("old,new", [("blk.1.ffn_up.weight", "blk.1.ffn_xx.weight"),
                                     ("output_norm.weight", "output_norx.weight"),
                                     ("blk.0.attn_v.weight", "blk.0.attn_w.weight")])
def test_required_tensor_missing(made, tmp_path, old, new):
    def fn(r):
        part = _tensor(r, old).field.parts[1]
        part[:] = np.frombuffer(new.encode(), dtype=np.uint8)
    bad = _edit(made["llama"], tmp_path / "bad.gguf", fn)
    _fails(bad, tmp_path, f"tensor {old}", "required tensor is missing")


def test_layer_numbers_with_a_gap(made, tmp_path):
    """blk.1.ffn_up renamed blk.7.ffn_up and block_count set to 8 to match the highest index: the gap
    is refused before anything loops over the eight layers the metadata claims."""
    def fn(r):
        _tensor(r, "blk.1.ffn_up.weight").field.parts[1][4] = ord("7")
        _set(f"{ARCH}.block_count", 8)(r)
    bad = _edit(made["ours"], tmp_path / "bad.gguf", fn)
    _fails(bad, tmp_path, "tensor blk.7.ffn_up.weight", "skip layer 2")


def test_no_library_message_and_no_warning(made, tmp_path):
    """The reader API: BadInput in our own words, no warning or log record on the way."""
    cases = {
        "count": lambda r: r.fields["tokenizer.ggml.tokens"].parts[4].__setitem__(0, 2**30),
        "kv": lambda r: r.fields["GGUF.kv_count"].parts[0].__setitem__(0, int(r.fields["GGUF.kv_count"].parts[0][0]) + 1),
        "heads": _set(f"{ARCH}.attention.head_count", 0),
        "fewer": lambda r: r.fields["GGUF.tensor_count"].parts[0].__setitem__(0, int(r.fields["GGUF.tensor_count"].parts[0][0]) - 1),
    }
    for name, fn in cases.items():
        bad = _edit(made["llama"], tmp_path / f"{name}.gguf", fn)
        msg = _quietly_refused(bad, str(bad))
        for internal in ("IndexError", "ValueError", "KeyError", "out of bounds", "unreadable GGUF ("):
            assert internal not in msg, (name, msg)


def test_cut_inside_the_header_names_the_offset(made, tmp_path):
    data = made["llama"].read_bytes()
    for cut in (30, 200, 3000):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        msg = _quietly_refused(bad, str(bad), "byte")
        assert "IndexError" not in msg


# -- split sets -------------------------------------------------------------------------------------------
@pytest.fixture
def split_set(made, tmp_path):
    d = tmp_path / "split"
    convert("gguf", made["ours"], "gguf", d / "m.gguf", Options(extra={"split_max_size": 60_000}), progress=False)
    parts = sorted(d.iterdir())
    assert len(parts) >= 3 and all("-of-" in p.name for p in parts)
    return parts


def test_split_part_without_split_count(split_set, tmp_path):
    def fn(r):
        r.fields["split.count"].parts[1][:] = np.frombuffer(b"split.cxunt", dtype=np.uint8)
    part = split_set[1]
    _edit(part, tmp_path / "tmp.gguf", fn)
    shutil.move(tmp_path / "tmp.gguf", part)
    _fails(split_set[0], tmp_path, "split part without metadata split.count", named=part)


def test_split_part_numbered_wrong(split_set, tmp_path):
    part = split_set[2]
    _edit(part, tmp_path / "tmp.gguf", _set("split.no", 0))
    shutil.move(tmp_path / "tmp.gguf", part)
    _fails(split_set[0], tmp_path, "metadata says split part 1 of", named=part)


def test_split_tensor_total(split_set, tmp_path):
    part = split_set[0]
    _edit(part, tmp_path / "tmp.gguf", _set("split.tensors.count", 5))
    shutil.move(tmp_path / "tmp.gguf", part)
    _fails(part, tmp_path, "split.tensors.count says 5 tensors")


def test_a_lone_part_that_claims_a_set(split_set, tmp_path):
    lone = tmp_path / "lone.gguf"
    shutil.copy(split_set[0], lone)
    _fails(lone, tmp_path, "split.count is", "-0000i-of-0000N.gguf")


def test_other_gguf_files_beside_a_split_set_are_ignored(split_set, made, tmp_path):
    d = split_set[0].parent
    n = len(split_set)
    (d / "m.gguf").write_bytes(b"GGUF junk")
    (d / f"m-{n + 1:05d}-of-{n:05d}.gguf").write_bytes(b"GGUF junk")
    shutil.copy(made["llama"], d / f"m-00001-of-{n + 1:05d}.gguf")  # another set's first part
    src = GgufSource(split_set[1])
    assert src.parts == split_set
    whole = GgufSource(made["ours"])
    assert [r.name for r in src.records()] == [r.name for r in whole.records()]
    run_cli("gguf->hf", split_set[0], tmp_path / "out", "--quiet")


# -- the header walk stays fast on a large file -------------------------------------------------------
def test_header_walk_of_a_1gb_file_reads_only_the_header(made, tmp_path):
    """A sparse 1 GiB GGUF (the header of a real file plus one 1 GiB F32 tensor): the walk touches
    the header only."""
    big = tmp_path / "big.gguf"
    w = gguf.GGUFWriter(str(big), ARCH)
    w.add_block_count(2)
    tokens = [f"tok{i}" for i in range(150_000)]
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_tensor_info("token_embd.weight", [2**28], np.dtype(np.float32), 2**30)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with open(big, "r+b") as f:
        header = f.seek(0, 2)
        f.truncate(header + (-header % 32) + 2**30)  # the data section starts at the next multiple of 32
    t0 = time.monotonic()
    h = scan_header(big)
    took = time.monotonic() - t0
    assert h.tensors[0].nbytes == 2**30 and h.data_offset + 2**30 == big.stat().st_size
    assert took < 5, took  # measured ~0.1 s for 150k tokens: one pass over the strings


# -- the GGUF writer's inputs: config.json and tokenizer.json of a gptq checkpoint ---------------------------
@pytest.fixture
def ckpt(fx, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(fx["variants"]["v1_b4_g32_sym"]["ckpt"], dst)
    return dst


def _edit_json(path: Path, fn) -> None:
    data = json.loads(path.read_text())
    data = fn(data)
    path.write_text(json.dumps(data))


def _set_key(key, value):
    def fn(cfg):
        cfg[key] = value
        return cfg
    return fn


@pytest.mark.parametrize("key,value,needles", [
    ("head_dim", 64, ("head_dim",)),  # the GPTQ reader itself names k_proj's rows
    ("head_dim", -1, ("head_dim is -1",)),
    ("rms_norm_eps", "x", ("rms_norm_eps is 'x'",)),
    ("rms_norm_eps", 1e300, ("rms_norm_eps is 1e+300",)),
    ("num_hidden_layers", None, ("num_hidden_layers is None",)),
    ("num_hidden_layers", 2**31, ("num_hidden_layers is 2147483648",)),
    ("num_hidden_layers", 1, ("num_hidden_layers", "model.layers.1")),  # the structure check names the layer
    ("rope_theta", "10000", ("rope_theta is '10000'",)),
    ("num_key_value_heads", 3, ("num_key_value_heads",)),
    ("num_key_value_heads", 0, ("num_key_value_heads is 0",)),
    ("vocab_size", 1000, ("vocab_size",)),
    ("hidden_size", "128", ("hidden_size is '128'",)),
    ("max_position_embeddings", -5, ("max_position_embeddings is -5",)),
    ("rope_scaling", [1, 2], ("rope_scaling is [1, 2]",)),
    # the fixture's config.json holds transformers 5's rope_parameters (which take precedence over rope_scaling)
    ("rope_parameters", {"rope_type": "longrope", "factor": 2.0}, ("type 'longrope' cannot be stored in GGUF",)),
    ("rope_parameters", {"rope_type": "linear", "rope_theta": 1e4}, ("rope_parameters.factor is missing",)),
    ("rope_parameters", {"rope_type": "linear", "factor": "2"}, ("rope_parameters.factor is '2'",)),
    ("rope_parameters", {"rope_type": "default", "rope_theta": "1e4"}, ("rope_parameters.rope_theta is '1e4'",)),
    ("rope_parameters", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0},
     ("high_freq_factor 4.0 is not above low_freq_factor 4.0",)),
])
def test_config_values_for_gguf(ckpt, tmp_path, key, value, needles):
    """One line naming config.json and the key, whichever check meets the value first (the GPTQ
    reader compares shapes with the config itself; the GGUF writer checks the rest)."""
    _edit_json(ckpt / "config.json", _set_key(key, value))
    t0 = time.monotonic()
    expect_user_error("gptq->gguf", ckpt, tmp_path, "config.json", *needles, out_name="out.gguf")
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("key,value,needles", [
    ("head_dim", 64, ("head_dim 64", "tensor model.layers.0.self_attn.q_proj.weight", "[256, 128]")),
    ("num_key_value_heads", 1, ("num_key_value_heads 1", "tensor model.layers.0.self_attn.k_proj.weight")),
    ("vocab_size", 1000, ("vocab_size 1000", "tensor model.embed_tokens.weight", "[1000, 128]")),
    ("intermediate_size", 512, ("intermediate_size 512", "tensor model.layers.0.mlp.gate_proj.weight")),
])
def test_writer_compares_the_config_with_the_tensors(ckpt, key, value, needles):
    """The GGUF writer's own check of config values against the tensors it is given (here a real GPTQ
    checkpoint's, with the value changed after the reader's checks): BadInput naming config.json, the
    key and the tensor, before anything is written."""
    from qconvert.converters.registry import get_format
    from qconvert.converters.run import open_source, plan_conversion

    source = open_source("gptq", ckpt)
    source.config[key] = value
    with pytest.raises(BadInput) as ei:
        plan_conversion(source, get_format("gguf").writer, Options(), progress=False)
    msg = str(ei.value)
    assert msg.startswith(str(ckpt / "config.json")), msg
    for needle in needles:
        assert needle in msg, (needle, msg)


@pytest.mark.parametrize("edit,needle", [
    (lambda tj: None, "expected a JSON object, found null"),
    (lambda tj: dict(tj, pre_tokenizer="ByteLevel"), "pre_tokenizer is a string"),
    (lambda tj: dict(tj, pre_tokenizer={"type": "Sequence", "pretokenizers": "x"}), "pre_tokenizer.pretokenizers"),
    (lambda tj: dict(tj, pre_tokenizer={"type": "Sequence", "pretokenizers": [3]}), "pre_tokenizer.pretokenizers[0]"),
    (lambda tj: dict(tj, added_tokens={"id": 1}), "added_tokens is an object"),
    (lambda tj: dict(tj, added_tokens=[1, 2]), "added_tokens[0] is an integer"),
    (lambda tj: dict(tj, added_tokens=[{"id": "0", "content": "<s>"}]), "added_tokens[0].id is a string"),
    (lambda tj: dict(tj, added_tokens=[{"id": 0, "content": 5}]), "added_tokens[0].content is an integer"),
    (lambda tj: dict(tj, model=dict(tj["model"], merges=[1, 2, 3])), "model.merges[0] is an integer"),
    (lambda tj: dict(tj, model=dict(tj["model"], merges=[["a"]])), "model.merges[0] is an array"),
    (lambda tj: dict(tj, model=dict(tj["model"], vocab={"a": "b"})), "model.vocab['a'] is a string"),
    (lambda tj: dict(tj, model="BPE"), "model is a string"),
    (lambda tj: dict(tj, post_processor={"type": "TemplateProcessing", "single": [5]}), "post_processor.single[0]"),
])
def test_tokenizer_json_for_gguf(ckpt, tmp_path, edit, needle):
    _edit_json(ckpt / "tokenizer.json", edit)
    expect_user_error("gptq->gguf", ckpt, tmp_path, str(ckpt / "tokenizer.json"), needle, out_name="out.gguf")


def test_tokenizer_config_that_is_not_an_object(ckpt, tmp_path):
    (ckpt / "tokenizer_config.json").write_text("[1, 2]")
    expect_user_error("gptq->gguf", ckpt, tmp_path, str(ckpt / "tokenizer_config.json"), "expected a JSON object",
                      out_name="out.gguf")


def test_unmutated_checkpoint_still_converts(ckpt, tmp_path):
    run_cli("gptq->gguf", ckpt, tmp_path / "ok.gguf", "--quiet")
    assert GgufSource(tmp_path / "ok.gguf").config["num_hidden_layers"] == 2

"""HQQ readers on real producers' files: mutated copies of real hqq 0.2.8 files (the library's qmodel.pt, the
transformers safetensors form) are refused in one line: every mutated fixture exits 2 with one line naming the file
and the tensor or key, and leaves nothing at OUT (tests/support/helpers.py expect_user_error). UQFF's HQQ layers
and mutated mistral.rs files: tests/formats/uqff/test_bad_uqff.py.
"""

from __future__ import annotations

import random
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from copy_edit import _copy, _edit
from helpers import expect_user_error, run_cli
from hqq_env import hqq_root  # noqa: F401  (the hqq fixtures, built by hqq's own environment)

HQQ_ROOT = Path(__file__).resolve().parents[2] / "_fixtures" / "hqq"


# =========================================================================================================
# 2a. hqq qmodel.pt: corrupt pickles


def _pickle_span(path: Path) -> tuple[int, int]:
    """(offset, size) of data.pkl's bytes inside the (uncompressed) torch zip."""
    raw = path.read_bytes()
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data.pkl"))
    off = info.header_offset
    name_len, extra_len = struct.unpack("<HH", raw[off + 26: off + 30])
    return off + 30 + name_len + extra_len, info.file_size


def _read_all(src: Path) -> None:
    """What a conversion does with a source: open it, plan every record, load every tensor."""
    from qconvert.formats.hqq.reader import open_hqq

    for rec in open_hqq(src).records():
        rec.load()


@pytest.fixture
def qmodel_copy(hqq_root, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(hqq_root / "b4_g64_ax1" / "lib", dst)
    return dst


def test_flipped_bytes_in_data_pkl_are_bad_input(qmodel_copy, tmp_path):
    """200 copies of hqq's qmodel.pt with one or two bits flipped inside data.pkl (in place, in the zip):
    each either reads or is a BadInput naming qmodel.pt (torch's unpickler raises KeyError, TypeError,
    IndexError, UnicodeDecodeError, struct.error... on such bytes); three of them through the CLI."""
    from qconvert.converters.errors import BadInput

    path = qmodel_copy / "qmodel.pt"
    original = path.read_bytes()
    start, size = _pickle_span(path)
    rng = random.Random(1234)
    refused: dict[str, bytes] = {}
    for _ in range(200):
        data = bytearray(original)
        for _ in range(rng.choice((1, 2))):
            data[start + rng.randrange(size)] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        try:
            _read_all(qmodel_copy)
        except BadInput as e:
            assert "qmodel.pt" in str(e) and "\n" not in str(e), str(e)
            refused.setdefault(e.detail.split(";")[0][:40], bytes(data))
    assert len(refused) >= 3, refused.keys()
    for data in list(refused.values())[:3]:
        path.write_bytes(data)
        expect_user_error("hqq->hf", qmodel_copy, tmp_path, "qmodel.pt")


def _rewrite_pickle(path: Path, edit) -> None:
    """Rewrite data.pkl of a torch zip (stored members, same order) after `edit(bytes) -> bytes`."""
    with zipfile.ZipFile(path) as z:
        members = [(i, z.read(i.filename)) for i in z.infolist()]
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as w:
        for info, data in members:
            w.writestr(info.filename, edit(data) if info.filename.endswith("/data.pkl") else data)
    tmp.replace(path)


def test_pickle_claiming_a_huge_storage(qmodel_copy, tmp_path):
    """A storage that claims 2**31 elements in a small file: refused from the zip's record sizes and the
    pickle's opcodes (walked, not executed) before torch reads anything."""
    import pickletools

    def edit(pk: bytes) -> bytes:
        ops = list(pickletools.genops(pk))
        # the first storage record: ('storage', <type>, key, 'cpu', numel) -> numel = 2**31 - 1
        i = next(n for n, (op, arg, _) in enumerate(ops) if op.name == "BINUNICODE" and arg == "cpu")
        op, arg, pos = ops[i + 2]
        assert op.name in ("BININT", "BININT1", "BININT2"), op.name
        width = {"BININT": 4, "BININT1": 1, "BININT2": 2}[op.name]
        return pk[:pos] + b"J" + (2**31 - 1).to_bytes(4, "little") + pk[pos + 1 + width:]

    _rewrite_pickle(qmodel_copy / "qmodel.pt", edit)
    expect_user_error("hqq->hf", qmodel_copy, tmp_path, "qmodel.pt", "claims 2147483647 x")


def test_compressed_or_legacy_pickle_is_refused(qmodel_copy, tmp_path):
    path = qmodel_copy / "qmodel.pt"
    with zipfile.ZipFile(path) as z:
        members = [(i.filename, z.read(i.filename)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as w:
        for name, data in members:
            w.writestr(name, data)
    expect_user_error("hqq->hf", qmodel_copy, tmp_path, "qmodel.pt", "compressed")
    weights = torch.load(HQQ_ROOT / "b4_g64_ax1" / "lib" / "qmodel.pt", weights_only=True)
    torch.save(weights, path, _use_new_zipfile_serialization=False)
    expect_user_error("hqq->hf", qmodel_copy, tmp_path, "qmodel.pt", "not a zip-format torch file")


@pytest.mark.parametrize("field, flip, needle", [
    (28, 0x01, "does not agree with the zip's directory"),  # extra length: the data one byte off
    (28, 0x40, "does not agree with the zip's directory"),  # by 64 bytes, still 64-aligned as torch aligns
    (26, 0x01, "its local header names 'qmodel/data/'"),  # name length: the name and the data both move
])
def test_flipped_byte_in_a_storages_local_header_is_refused(qmodel_copy, tmp_path, field, flip, needle):
    """torch finds a storage's bytes from its local header (offset + 30 + name and extra lengths): one flipped
    length byte there shifted the tensor and the conversion passed (a scale off by 0.127); refused now."""
    path = qmodel_copy / "qmodel.pt"
    with zipfile.ZipFile(path) as z:
        member = z.getinfo("qmodel/data/3")
    raw = bytearray(path.read_bytes())
    assert raw[member.header_offset:member.header_offset + 4] == b"PK\x03\x04"
    raw[member.header_offset + field] ^= flip
    path.write_bytes(bytes(raw))
    expect_user_error("hqq->hf", qmodel_copy, tmp_path, "qmodel.pt", "zip member 'qmodel/data/3'", needle)


@pytest.mark.parametrize("key,value,needle", [
    ("shape", torch.Size([1 << 30, 1 << 30]), "2-D [out, in] shape"),
    ("group_size", float("nan"), "finite number"),
    ("nbits", "four", "expected a number"),
    ("shape", ("a", 4), "shape of integers"),
    ("bias", torch.zeros(3), "bias is"),
    ("compute_dtype", torch.int32, "compute_dtype"),
])
def test_decoded_structure_is_checked(qmodel_copy, tmp_path, key, value, needle):
    """A pickle that decodes, with a wrong value where hqq keeps a layer setting."""
    path = qmodel_copy / "qmodel.pt"
    weights = torch.load(path, weights_only=True)
    weights["model.layers.0.mlp.up_proj"][key] = value
    torch.save(weights, path)
    expect_user_error("hqq->hf", qmodel_copy, tmp_path, "qmodel.pt", f"model.layers.0.mlp.up_proj", needle)


def test_qmodel_without_a_layer(qmodel_copy, tmp_path):
    """A module removed from the pickle would convert into a model without it."""
    path = qmodel_copy / "qmodel.pt"
    weights = torch.load(path, weights_only=True)
    del weights["model.layers.1.mlp.gate_proj"]
    torch.save(weights, path)
    expect_user_error("hqq->hf", qmodel_copy, tmp_path, "qmodel.pt", "model.layers.1.mlp.gate_proj.weight", "missing")


# 2b. transformers safetensors HQQ: a stray tensor beside a layer


@pytest.mark.parametrize("stray", ["qweight", "weight"])
def test_stray_tensor_beside_hqq_layer(hqq_root, tmp_path, stray):
    from helpers import edit_safetensors

    src = tmp_path / "ckpt"
    shutil.copytree(hqq_root / "b4_g64_ax1" / "tf", src)
    name = f"model.layers.0.self_attn.q_proj.{stray}"
    edit_safetensors(src / "model.safetensors", lambda t: t.__setitem__(name, torch.zeros(16, 128, dtype=torch.int32)))
    for pair in ("hqq->hf", "hqq->gguf"):
        expect_user_error(pair, src, tmp_path, "model.safetensors", name, "stray tensor",
                          out_name="out.gguf" if pair.endswith("gguf") else "out")


def test_hqq_key_without_its_layer(hqq_root, tmp_path):
    """An HQQ layer's setting under a name with no W_q (a renamed or half-deleted layer)."""
    from helpers import edit_safetensors

    src = tmp_path / "ckpt"
    shutil.copytree(hqq_root / "b4_g64_ax0" / "tf", src)
    old, new = "model.layers.1.self_attn.k_proj.round_zero", "model.fuzzed_layers.1.self_attn.k_proj.round_zero"
    edit_safetensors(src / "model.safetensors", lambda t: t.__setitem__(new, t.pop(old)))
    expect_user_error("hqq->hf", src, tmp_path, "model.safetensors", new, "without its")


@pytest.mark.parametrize("edit,needle", [
    (lambda t: t.__setitem__("model.layers.0.post_attention_layernorm.weight",
                             t["model.layers.0.post_attention_layernorm.weight"][None]),
     "shape (1, 128) does not match config.json: expected (128,) from hidden_size"),
    (lambda t: t.__setitem__("lm_head.weight", t["lm_head.weight"].reshape(256, 256)),
     "does not match config.json: expected (512, 128) from vocab_size, hidden_size"),
    (lambda t: t.__setitem__("model.layers.1.input_layernorm.weight",
                             t["model.layers.1.input_layernorm.weight"].view(torch.int32)),
     "is an integer type, but this is a norm weight"),
])
def test_hqq_dense_tensors_are_checked_against_the_config(hqq_root, tmp_path, edit, needle):
    """Fuzz findings (10,000-case run): the HQQ readers passed norms and heads of a wrong shape through
    (the conversion wrote them; GPTQ/QQQ/HF readers refuse them) and an integer-typed norm was refused only
    by the writer, without naming the file."""
    src = _copy(HQQ_ROOT / "b4_g64_ax1" / "tf", tmp_path / "m")
    _edit(src / "model.safetensors", edit)
    expect_user_error("hqq->hf", src, tmp_path, "model.safetensors", needle)


def test_qmodel_with_a_damaged_member_name_is_refused_in_our_words(hqq_root, tmp_path):
    """Fuzz finding (hqq-pt): a flipped byte in a UTF-8 member name made zipfile raise UnicodeDecodeError, and
    the line quoted that class name."""
    import zipfile

    src = _copy(HQQ_ROOT / "b4_g64_ax1" / "lib", tmp_path / "m")
    with zipfile.ZipFile(src / "qmodel.pt", "w") as z:
        z.writestr("archive/d\u00e9ta.pkl", b"x")  # a non-ASCII name: stored as UTF-8 with the flag set
    raw = bytearray((src / "qmodel.pt").read_bytes())
    raw[:] = raw.replace("\u00e9".encode(), b"\xff\xfe")  # in the local and the central header
    (src / "qmodel.pt").write_bytes(bytes(raw))
    err = expect_user_error("hqq->hf", src, tmp_path, "qmodel.pt", "not a readable zip file",
                            "a member name is not valid text")
    assert "Error" not in err


def test_a_qmodel_tensor_marked_requires_grad_converts_without_warnings(hqq_root, tmp_path):
    """Fuzz finding (hqq-pt): a pickle that marks a scale requires_grad made reading its scalars warn about
    autograd after a successful conversion."""
    src = _copy(HQQ_ROOT / "b4_g64_ax1" / "lib", tmp_path / "m")
    weights = torch.load(str(src / "qmodel.pt"), weights_only=True, map_location="cpu")
    layer = next(m for m in weights if "W_q" in weights[m])
    weights[layer]["scale"] = weights[layer]["scale"].clone().requires_grad_(True)
    torch.save(weights, str(src / "qmodel.pt"))
    proc = run_cli("hqq->hf", src, tmp_path / "out", "--type", "f32", "--quiet")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr

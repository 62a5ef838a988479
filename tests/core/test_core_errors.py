"""converters/errors.py: a user error is one printable, bounded line naming the file and the tensor."""

from __future__ import annotations

from pathlib import Path

import pytest

from qconvert.converters.apps import cli
from qconvert.converters.errors import BadInput, QConvertError, RefusedPlan

SHARD = Path("/models/m/model-00001-of-00002.safetensors")


@pytest.mark.parametrize("path, tensor, line", [
    (SHARD, "lm_head.weight", f"{SHARD}, tensor lm_head.weight: truncated"),
    (SHARD, None, f"{SHARD}: truncated"),
    (None, "lm_head.weight", "tensor lm_head.weight: truncated"),
    (None, None, "truncated"),
])
def test_the_line_names_the_path_then_the_tensor(path, tensor, line):
    e = QConvertError("truncated", path=path, tensor=tensor)
    assert str(e) == line
    assert e.path == (None if path is None else str(path))
    assert e.tensor == tensor
    assert e.detail == "truncated"  # the message without the location, for callers that re-word it


def test_control_characters_read_from_a_file_are_escaped():
    # a tensor name from a damaged header: newline, NUL, a terminal colour escape, a tab, a zero-width space
    e = QConvertError("bad dtype", path=SHARD, tensor="a\nb\x00c\x1b[31md\te\u200bf")
    assert str(e) == f"{SHARD}, tensor a\\nb\\x00c\\x1b[31md\\te\\u200bf: bad dtype"
    assert str(e).isprintable()


def test_printable_text_beyond_ascii_is_kept_as_it_is():
    assert str(QConvertError("poids", tensor="modèle.嵌入.weight")) == "tensor modèle.嵌入.weight: poids"


def test_the_line_is_bounded():
    assert str(QConvertError("x" * 2000)) == "x" * 2000
    long = str(QConvertError("x" * 5000))
    assert long == "x" * 1997 + "..."
    # escaping happens before the bound: 1,000 NULs are 4,000 characters once escaped
    escaped = str(QConvertError("\x00" * 1000))
    assert len(escaped) == 2000 and escaped == ("\\x00" * 500)[:1997] + "..."


def test_the_kinds_of_user_error_are_all_qconvert_errors():
    assert issubclass(BadInput, QConvertError) and issubclass(RefusedPlan, QConvertError)
    assert str(BadInput("truncated", path=SHARD, tensor="w")) == f"{SHARD}, tensor w: truncated"


def test_the_cli_prints_it_as_one_line_with_exit_2(tmp_path, capsys):
    # an inspect of a path that does not exist reaches the CLI as a QConvertError naming the path
    missing = tmp_path / "no\nsuch"
    rc = cli.main(["inspect", str(missing)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err == f"qconvert: error: {tmp_path}/no\\nsuch: no such file or directory\n"

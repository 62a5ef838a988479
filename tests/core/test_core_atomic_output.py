"""converters/run.py's atomic_output: the output appears at OUT whole or not at all, and temporaries of
killed runs are cleaned up while those of live runs stay."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from qconvert.converters.errors import QConvertError
from qconvert.converters.output import atomic_output, remove_stale_temporaries

TMP_MARK = "qconvert-tmp"


def temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if TMP_MARK in p.name)


class Boom(Exception):
    pass


def test_success_renames_a_file_into_place(tmp_path):
    out = tmp_path / "sub" / "model.gguf"  # a missing parent folder is made
    with atomic_output(out, is_file=True, force=False) as tmp:
        assert tmp.parent == out.parent and tmp != out and not out.exists()
        tmp.write_bytes(b"whole")
    assert out.read_bytes() == b"whole"
    assert temporaries(out.parent) == []


def test_success_renames_a_folder_into_place(tmp_path):
    out = tmp_path / "model-gptq"
    with atomic_output(out, is_file=False, force=False) as tmp:
        assert tmp.is_dir()  # a folder output gets its temporary folder made
        (tmp / "model.safetensors").write_bytes(b"w")
        (tmp / "config.json").write_text("{}")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert temporaries(tmp_path) == []


@pytest.mark.parametrize("is_file", [True, False])
def test_an_exception_leaves_nothing_at_out_and_no_temporary(tmp_path, is_file):
    out = tmp_path / "out"
    with pytest.raises(Boom):
        with atomic_output(out, is_file=is_file, force=False) as tmp:
            (tmp if is_file else tmp / "part").write_bytes(b"half")
            raise Boom()
    assert list(tmp_path.iterdir()) == []


def test_an_existing_out_is_refused_without_force_before_anything_runs(tmp_path):
    out = tmp_path / "model.gguf"
    out.write_bytes(b"old")
    ran = []
    with pytest.raises(QConvertError) as info:
        with atomic_output(out, is_file=True, force=False):
            ran.append(True)
    assert str(info.value) == f"{out}: output exists; pass --force to replace it"
    assert ran == [] and out.read_bytes() == b"old" and temporaries(tmp_path) == []


@pytest.mark.parametrize("old_is_dir", [False, True])
def test_force_replaces_an_existing_out(tmp_path, old_is_dir):
    out = tmp_path / "model"
    if old_is_dir:
        out.mkdir()
        (out / "stale.safetensors").write_bytes(b"old")
    else:
        out.write_bytes(b"old")
    with atomic_output(out, is_file=False, force=True) as tmp:
        (tmp / "model.safetensors").write_bytes(b"new")
    assert [p.name for p in out.iterdir()] == ["model.safetensors"]
    assert temporaries(tmp_path) == []


def test_a_failed_forced_run_keeps_the_existing_out(tmp_path):
    out = tmp_path / "model.gguf"
    out.write_bytes(b"old")
    with pytest.raises(Boom):
        with atomic_output(out, is_file=True, force=True) as tmp:
            tmp.write_bytes(b"half")
            raise Boom()
    assert out.read_bytes() == b"old" and temporaries(tmp_path) == []


def split_names(n: int) -> list[str]:
    return [f"model-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]


def test_several_files_are_moved_beside_out_only_when_all_are_written(tmp_path):
    out = tmp_path / "model.gguf"
    with atomic_output(out, is_file=True, force=False, several_files=True) as tmp:
        assert tmp.name == out.name and tmp.parent.parent == tmp_path and TMP_MARK in tmp.parent.name
        for name in split_names(2):
            (tmp.parent / name).write_bytes(name.encode())
        assert sorted(p.name for p in tmp_path.iterdir() if TMP_MARK not in p.name) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == split_names(2)
    assert all((tmp_path / n).read_bytes() == n.encode() for n in split_names(2))


def test_several_files_refuse_to_replace_an_existing_part_without_force(tmp_path):
    out = tmp_path / "model.gguf"
    clash = tmp_path / split_names(2)[1]
    clash.write_bytes(b"old")
    with pytest.raises(QConvertError) as info:
        with atomic_output(out, is_file=True, force=False, several_files=True) as tmp:
            for name in split_names(2):
                (tmp.parent / name).write_bytes(b"new")
    assert str(info.value) == f"{clash}: output exists; pass --force to replace it"
    assert sorted(p.name for p in tmp_path.iterdir()) == [clash.name] and clash.read_bytes() == b"old"

    with atomic_output(out, is_file=True, force=True, several_files=True) as tmp:
        for name in split_names(2):
            (tmp.parent / name).write_bytes(b"new")
    assert sorted(p.name for p in tmp_path.iterdir()) == split_names(2)
    assert clash.read_bytes() == b"new"


def test_several_files_leave_nothing_after_an_exception(tmp_path):
    out = tmp_path / "model.gguf"
    with pytest.raises(Boom):
        with atomic_output(out, is_file=True, force=False, several_files=True) as tmp:
            (tmp.parent / split_names(2)[0]).write_bytes(b"part")
            raise Boom()
    assert list(tmp_path.iterdir()) == []


# ---- temporaries of killed runs ----------------------------------------------------------------------

def own_temporary_name(folder: Path, out_name: str) -> str:
    """The temporary name this process gets for `out_name` (`.<name>.qconvert-tmp-<host>-<pid>`)."""
    with pytest.raises(Boom):
        with atomic_output(folder / out_name, is_file=True, force=False) as tmp:
            raise Boom()
    return tmp.name


def with_pid(temporary: str, pid: int) -> str:
    stem, own_pid = temporary.rsplit("-", 1)
    assert int(own_pid) == os.getpid()
    return f"{stem}-{pid}"


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_remove_stale_temporaries_removes_a_dead_runs_and_keeps_a_live_runs(tmp_path):
    mine = own_temporary_name(tmp_path, "model.gguf")
    mine_folder = own_temporary_name(tmp_path, "model-gptq")  # (atomic_output itself removes stale ones)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead_file = tmp_path / with_pid(mine, dead_pid())
        dead_file.write_bytes(b"half")
        dead_folder = tmp_path / with_pid(mine_folder, dead_pid())
        dead_folder.mkdir()
        (dead_folder / "model.safetensors").write_bytes(b"half")
        kept = [tmp_path / with_pid(mine, live.pid),  # a run still writing
                tmp_path / mine,  # this process's own
                # another host's sharing the folder: its pid means nothing on this host
                tmp_path / f".model.gguf.{TMP_MARK}-otherhost-{dead_pid()}",
                tmp_path / "model.gguf"]  # not a temporary
        for path in kept:
            path.write_bytes(b"x")

        removed = remove_stale_temporaries(tmp_path)

        assert sorted(removed) == sorted([dead_file, dead_folder])
        assert not dead_file.exists() and not dead_folder.exists()
        assert all(path.exists() for path in kept)
    finally:
        live.kill()
        live.wait()


def test_a_new_output_removes_the_stale_temporary_beside_it(tmp_path):
    stale = tmp_path / with_pid(own_temporary_name(tmp_path, "model.gguf"), dead_pid())
    stale.write_bytes(b"half")
    with atomic_output(tmp_path / "model.gguf", is_file=True, force=False) as tmp:
        tmp.write_bytes(b"whole")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_a_missing_folder_has_no_stale_temporaries(tmp_path):
    assert remove_stale_temporaries(tmp_path / "nowhere") == []

"""A folder holding a GGUF model, as llama.cpp users keep one and as Hub GGUF repos ship it: the model file
(or one split set `<stem>-0000i-of-0000N.gguf`) beside a README, a .gitattributes, an imatrix, a vision
projector. Such a folder is that GGUF for every command.

Which files are the model is decided as llama.cpp decides what to load:

- a vision projector is a separate file llama.cpp takes with `--mmproj` (Hub repos name it `mmproj*.gguf`;
  its header says general.type "mmproj", or, written before general.type existed, general.architecture
  "clip"); a LoRA adapter (general.type "adapter") is taken with `--lora`, and an importance matrix
  written as GGUF (general.type "imatrix") only by llama-quantize: none of them is the model. They are
  named in `ignored_files`, as checkpoint folders name the weight files beside their model;
- every other file that is not a .gguf (README.md, imatrix.dat, params) is not read, as the GGUF
  reader reads only its file;
- one model file, or one split set with all its parts, is the model; several (Hub repos ship one file per
  quantization, `model-Q4_K_M.gguf` beside `model-Q8_0.gguf`) are refused in one line naming them, since
  only the user knows which one is meant; an incomplete split set is refused as split_parts refuses it.

Headers are read only to tell several candidates apart: a folder with one candidate reads exactly as its
file does, with the same messages.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ...converters.errors import BadInput
from ..common.checkpoint import WEIGHT_SUFFIXES, weight_files_ignored
from .reader import SPLIT_NAME, GgufSource, scan_header, split_parts

__all__ = ["GgufFolder", "find_model", "is_gguf_folder", "open_gguf"]

GGUF_MAGIC = b"GGUF"
# Hub repos (ggml-org, unsloth, bartowski) name projectors mmproj-*.gguf or *-mmproj-*.gguf
_PROJECTOR_NAME = re.compile(r"mmproj", re.IGNORECASE)
_PROJECTOR = "a vision projector (llama.cpp loads it with --mmproj), not carried"
# general.type values (gguf-py's GGUFType) and architectures of GGUF files that are not a model
_NOT_A_MODEL_TYPE = {"mmproj": _PROJECTOR,
                     "adapter": "a LoRA adapter (llama.cpp loads it with --lora), not carried",
                     "imatrix": "an importance matrix (llama-quantize --imatrix reads it), not part of the model"}
_NOT_A_MODEL_ARCH = {"clip": _PROJECTOR}
_MAX_NAMED = 6  # candidates a refusal names before "and N more"


@dataclass(frozen=True)
class GgufFolder:
    """What a folder holds: the model's file (the single file, or part 1 of its split set) and the files
    beside it that are not read, with why."""
    path: Path
    model: Path
    ignored: dict[str, str]


def _gguf_files(folder: Path) -> list[Path]:
    return sorted((p for p in folder.iterdir() if p.name.lower().endswith(".gguf") and p.is_file()),
                  key=lambda p: p.name)


def _starts_with_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def is_gguf_folder(path: Path) -> bool:
    """A folder whose weight files are all .gguf, one of them a GGUF by its magic. A checkpoint folder with a
    GGUF copy beside its safetensors is not one: its own format reads it and names the GGUF as ignored."""
    path = Path(path)
    if not path.is_dir():
        return False
    weights = [p for p in path.iterdir() if p.name.lower().endswith(WEIGHT_SUFFIXES) and p.is_file()]
    if any(not p.name.lower().endswith(".gguf") for p in weights):
        return False
    return any(_starts_with_magic(p) for p in weights)


def _candidates(files: list[Path]) -> dict[str, list[Path]]:
    """The files grouped into candidate models: a split set (by stem and part count) is one candidate,
    under its first part's name; any other file is one by itself."""
    groups: dict[str, list[Path]] = {}
    for p in files:
        m = SPLIT_NAME.match(p.name)
        key = f"{m['stem']}-00001-of-{m['count']}.gguf" if m else p.name
        groups.setdefault(key, []).append(p)
    return groups


def _not_a_model(first: Path) -> str | None:
    """Why a GGUF file is not a model, from its header (general.type, general.architecture), or None."""
    scalars = scan_header(first).scalars
    kind, arch = scalars.get("general.type"), scalars.get("general.architecture")
    return _NOT_A_MODEL_TYPE.get(kind) or _NOT_A_MODEL_ARCH.get(arch)


def _label(key: str) -> str:
    m = SPLIT_NAME.match(key)
    return f"{key} (split set of {int(m['count'])})" if m else key


def find_model(folder: Path) -> GgufFolder:
    """The model a folder holds, or BadInput naming the folder: no model file, or several."""
    folder = Path(folder)
    files = _gguf_files(folder)
    ignored = {p.name: _PROJECTOR for p in files if _PROJECTOR_NAME.search(p.name)}
    groups = _candidates([p for p in files if p.name not in ignored])
    if len(groups) > 1:  # tell them apart by their headers
        for key, parts in list(groups.items()):
            why = _not_a_model(min(parts, key=lambda p: p.name))
            if why is not None:
                ignored.update({p.name: why for p in parts})
                del groups[key]
    if not groups:
        what = f"only {', '.join(f'{n} ({why})' for n, why in ignored.items())}" if ignored else "no .gguf file"
        raise BadInput(f"a folder read as GGUF holds {what}: no model to read", path=folder)
    if len(groups) > 1:
        labels = [_label(k) for k in groups]
        shown = ", ".join(labels[:_MAX_NAMED]) + (f" and {len(labels) - _MAX_NAMED} more"
                                                  if len(labels) > _MAX_NAMED else "")
        raise BadInput(f"the folder holds {len(labels)} GGUF models ({shown}); pass the file to read, e.g. "
                       f"{folder / next(iter(groups))}", path=folder)
    (parts,) = groups.values()
    model = split_parts(min(parts, key=lambda p: p.name))  # every part present, or BadInput naming the missing one
    used = {p.name for p in model}
    for p in parts:
        if p.name not in used:  # a file named as a part beyond the set's count
            ignored[p.name] = f"not a part of the split set {model[0].name}"
    ignored.update(weight_files_ignored(folder, {p.name for p in files}))  # weights of other formats (pair form)
    return GgufFolder(folder, model[0], dict(sorted(ignored.items())))


def open_gguf(path: Path, **_: object) -> GgufSource:
    """A GGUF file, any part of a split set, or a folder holding one of them (find_model)."""
    path = Path(path)
    if not path.is_dir():
        return GgufSource(path)
    found = find_model(path)
    return GgufSource(found.model, folder=found.path, ignored_files=found.ignored)

"""Reading HQQ checkpoints: the transformers safetensors folder (19 flat tensors per layer) and the entry point
that picks the container (open_hqq, sniff_hqq); the qmodel.pt pickle is qmodel.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator


from ...converters.errors import BadInput
from ...converters.records import Grid, TensorRecord
from ...converters.model_shapes import ModelShapes
from ..common.checkpoint import CheckpointDir, CheckpointSource, read_json
from .layer import (HqqLayer, LAYER_KEYS, QMODEL, HQQ_ONLY_KEYS, LayerDecoder, REQUIRED_KEYS, check_codes, grid_record,
                    unpacked_grid)
from .qmodel import HqqPickleSource
from .folder import check_complete, describe_checkpoint, quantization_config
from .layer import ShapeOnly
from ..common.quant_config import read_config


# --------------------------------------------------------------------------------------------------
# transformers safetensors


class HqqSafetensorsSource(CheckpointSource):
    """A transformers (or hqq save_to_safetensors) HQQ directory: flat `<module>.<key>` tensors."""

    format_name = "hqq"
    container = "safetensors"

    def __init__(self, path: Path):
        self.path = Path(path)
        conf = read_config(self.path)
        self.quant_config = quantization_config(conf.raw, conf.path)
        if self.quant_config and str(self.quant_config.get("quant_method", "")).lower() != "hqq":
            raise BadInput(f"quant_method is {self.quant_config.get('quant_method')!r}, not hqq",
                           path=self.path / "config.json")
        self.config = conf.model
        self.ckpt = CheckpointDir(self.path)
        self.modules: dict[str, dict[str, str]] = {}
        for name in self.ckpt.location:
            prefix, _, key = name.rpartition(".")
            if key == "W_q":
                self.modules[prefix] = {}
        for name in self.ckpt.location:
            prefix, _, key = name.rpartition(".")
            if prefix in self.modules and (key in LAYER_KEYS or key == "bias"):
                self.modules[prefix][key] = name
            elif prefix in self.modules:
                # e.g. a GPTQ `.qweight` or a dense `.weight` left beside the layer: which one would a loader
                # use? transformers' HQQ loader takes the 19 keys; we refuse rather than guess
                raise BadInput(f"stray tensor beside the HQQ layer {prefix}: an HQQ layer holds only "
                               f"{', '.join(REQUIRED_KEYS)} and hqq's flags (and bias)", path=self.ckpt.file_of(name),
                               tensor=name)
        if not self.modules:
            raise BadInput("no HQQ layers (no <module>.W_q tensors) in the safetensors files", path=self.path)
        for name in self.ckpt.location:
            prefix, _, key = name.rpartition(".")
            if key in HQQ_ONLY_KEYS and prefix not in self.modules:
                raise BadInput(f"HQQ layer {key} without its {prefix}.W_q", path=self.ckpt.file_of(name), tensor=name)
        check_complete(self.config, {f"{m}.weight" for m in self.modules} | set(self.ckpt.location), self.path)
        self.shapes = ModelShapes(self.config, self.path / "config.json")  # the dense tensors against config.json
        for prefix, parts in self.modules.items():
            if "bias" in parts:
                shape = tuple(self.ckpt.shape(parts["bias"]))
                if len(shape) != 1:
                    raise BadInput(f"bias of shape {shape} is not a vector", path=self.ckpt.file_of(parts["bias"]),
                                   tensor=parts["bias"])
        self._layers: dict[str, HqqLayer] = {}

    def layer(self, prefix: str, with_codes: bool = False) -> HqqLayer:
        """The decoded layer; the packed codes are read only when asked (planning reads the small tensors)."""
        if prefix in self._layers and not with_codes:
            return self._layers[prefix]
        parts = self.modules[prefix]
        values = {}
        for key, name in parts.items():
            if key == "bias":
                continue
            if key == "W_q" and not with_codes:
                values[key] = ShapeOnly(self.ckpt, name)
            else:
                values[key] = self.ckpt.get(name)
        where = self.ckpt.file_of(parts["W_q"])
        layer = LayerDecoder(values, where, prefix).decode()
        if not with_codes:
            self._layers[prefix] = layer
        return layer

    def _load_grid(self, prefix: str) -> Grid:
        layer = self.layer(prefix, with_codes=True)
        where = self.ckpt.file_of(self.modules[prefix]["W_q"])
        grid = unpacked_grid(layer, where, prefix)
        check_codes(layer, grid.codes, where, prefix)
        return grid

    def records(self) -> Iterator[TensorRecord]:
        consumed = {n for parts in self.modules.values() for k, n in parts.items() if k not in ("W_q", "bias")}
        for shard in self.ckpt.shards:
            for name in self.ckpt.keys(shard):
                if name in consumed:
                    continue
                prefix, _, key = name.rpartition(".")
                if key == "W_q":
                    yield grid_record(prefix, self.layer(prefix), lambda p=prefix: self._load_grid(p), shard)
                else:
                    self.shapes.check_dense(name, self.ckpt.shape(name), self.ckpt.path / shard, self.ckpt.dtype(name))
                    yield self.ckpt.dense_record(name, shard)

    def describe(self) -> dict:
        layers = {p: self.layer(p) for p in self.modules}
        return describe_checkpoint("hqq", "transformers safetensors", layers,
                         {"skip_modules": self.quant_config.get("skip_modules"), "shards": len(self.ckpt.shards),
                          "ignored_files": self.ignored_files})


def open_hqq(path: Path, **_: object):
    path = Path(path)
    if path.is_file() and path.suffix == ".pt":
        return HqqPickleSource(path)
    if not path.is_dir():
        raise BadInput("not a directory (expected an HQQ checkpoint folder or a qmodel.pt)", path=path)
    if (path / QMODEL).exists():
        return HqqPickleSource(path)
    return HqqSafetensorsSource(path)


def sniff_hqq(path: Path) -> bool:
    path = Path(path)
    if path.is_file():
        return path.name == QMODEL
    if not path.is_dir():
        return False
    if (path / QMODEL).exists():
        return True
    try:
        qc = read_json(path / "config.json").get("quantization_config") or {}
    except BadInput:
        return False
    if not isinstance(qc, dict):  # not for detection to judge: the reader named by the user refuses it
        return False
    if str(qc.get("quant_method", "")).lower() == "hqq":
        return True
    # hqq's save_to_safetensors writes no quantization_config: the per-layer W_q tensors of the model's own
    # files decide (not of an adapter or another weight file beside them)
    try:
        return any(k.endswith(".W_q") for k in CheckpointDir(path).location)
    except BadInput:
        return False

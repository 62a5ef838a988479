"""gpt-oss's MXFP4 checkpoints (OpenAI gpt-oss-20b / 120b as published: `quantization_config.quant_method` "mxfp4").

Per MoE layer `<head>` = `model.layers.N.mlp.experts.` (transformers 5.24 integrations/mxfp4.py, llama.cpp's
conversion/gpt_oss.py): `gate_up_proj_blocks` uint8 [E, 2f, hidden/32, 16] with `gate_up_proj_scales` uint8
[E, 2f, hidden/32], and `down_proj_blocks` [E, hidden, f/32, 16] with `down_proj_scales` [E, hidden, f/32]: rows in
[out, in] order, every byte two E2M1 codes (the even element in the low nibble), one E8M0 exponent per 32
(2**(e - 127)); gate_up's rows alternate gate, up, gate, up (transformers' forward takes columns 0::2 / 1::2 of the
dequantized [E, hidden, 2f]). transformers' dequantization (convert_moe_packed_tensors) is the table value times
2**(e - 127) by ldexp, exact, transposed to [E, in, out]. The biases (`gate_up_proj_bias` [E, 2f], `down_proj_bias`),
attention, router, embeddings and norms are stored dense (`modules_to_not_convert`).

Records: one float grid per expert and projection, in [out, in] order and named as the per-expert stacks the GGUF
writer builds (`<head>E.gate_proj.weight` = rows 0::2 of expert E's gate_up, `up_proj` = rows 1::2,
`down_proj`), each read from its expert's slab of the stacked tensor only (never the whole stack); everything else
passes as the dense tensor it is.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import torch

from ...converters.errors import BadInput
from ...converters.model_shapes import INTEGER_TAGS
from ...converters.validate import ConfigView
from ...converters.records import Grid, TensorRecord
from ...kernels.floatq import unpack_fp4
from ..common.float_grids import float_grid
from ..common.checkpoint import CheckpointDir, CheckpointSource, quantization_config_of
from ..common.quant_config import read_config

__all__ = ["Mxfp4Source", "open_mxfp4", "sniff_mxfp4"]

_BLOCKS = re.compile(r"^(?P<head>.+\.experts\.)(?P<what>gate_up_proj|down_proj)_blocks$")


def sniff_mxfp4(path: Path) -> bool:
    qc = quantization_config_of(path)
    return isinstance(qc, dict) and str(qc.get("quant_method", "")).lower() == "mxfp4"


class Mxfp4Source(CheckpointSource):
    """A gpt-oss MXFP4 checkpoint folder, read expert by expert."""

    format_name = "mxfp4"

    def __init__(self, path: Path):
        self.path = Path(path)
        conf = read_config(self.path)
        where = conf.path
        qc = conf.quantization()
        if qc is None or str(qc.get("quant_method", "")).lower() != "mxfp4":
            raise BadInput("quantization_config.quant_method is not 'mxfp4'", path=where)
        self.quant_config = qc.data
        self.config = conf.model
        self.ckpt = CheckpointDir(self.path)
        self.stacks: dict[str, tuple[str, str]] = {}  # blocks name -> (head, what)
        for name in self.ckpt.location:
            m = _BLOCKS.match(name)
            if m is not None:
                self.stacks[name] = (m["head"], m["what"])
                scales = name[: -len("_blocks")] + "_scales"
                if scales not in self.ckpt.location:
                    raise BadInput(f"{m['what']}_blocks without {m['what']}_scales", path=self.ckpt.file_of(name),
                                   tensor=scales)
            elif name.endswith("_scales") and name[: -len("_scales")] + "_blocks" not in self.ckpt.location:
                raise BadInput("_scales without _blocks", path=self.ckpt.file_of(name),
                               tensor=name[: -len("_scales")] + "_blocks")
            elif not name.endswith("_scales") and self.ckpt.dtype(name) in INTEGER_TAGS:
                # every tensor besides the MXFP4 stacks is a float parameter (biases, sinks, router, norms,
                # embeddings: modules_to_not_convert); an integer tag of a float's width would pass its bits
                # on as integers (found by scripts/fuzz: a bias retagged F32 -> U32 converted)
                raise BadInput(f"dtype {self.ckpt.dtype(name)} is an integer type, but gpt-oss stores every tensor "
                               "besides the MXFP4 blocks and scales as floats", path=self.ckpt.file_of(name),
                               tensor=name)
        for name in self.stacks:
            self._stack_shape(name)  # every stack checked before a record is made
        self._check_gpt_oss_layers(conf.path)

    def _check_gpt_oss_layers(self, config_path: Path) -> None:
        """Every tensor each gpt-oss layer has (transformers' GptOssDecoderLayer: q/k/v/o biases when
        attention_bias, which gpt-oss's config defaults to true; the sinks; the router's weight and bias; the
        experts and their biases), so that a checkpoint missing one is refused here, naming it: the core's
        per-architecture check (converters/model_shapes.py) covers only dense llama/mistral/qwen layouts, and
        without this a missing bias converted to a GGUF without it (llama.cpp's gpt-oss loader requires every
        one; found by scripts/fuzz)."""
        if self.config.get("model_type") != "gpt_oss":
            return
        view = ConfigView(self.config, config_path)
        n_layers = view.int("num_hidden_layers", lo=1, hi=100_000)
        attn = ["q_proj", "k_proj", "v_proj", "o_proj"]
        needed = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.sinks",
                  "mlp.router.weight", "mlp.router.bias", "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias"]
        needed += [f"self_attn.{p}.weight" for p in attn]
        if view.bool("attention_bias", default=True):
            needed += [f"self_attn.{p}.bias" for p in attn]
        for i in range(n_layers):
            head = f"model.layers.{i}."
            held = [n for n in self.ckpt.location if n.startswith(head)]
            where = self.ckpt.file_of(held[0]) if held else self.path
            for suffix in needed + ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]:
                name = head + suffix
                if name in self.ckpt.location:
                    continue
                if suffix.endswith("_proj") and name + "_blocks" in self.ckpt.location:  # stored as MXFP4 blocks
                    continue
                raise BadInput(f"missing: gpt-oss has it in every layer (config.json says {n_layers} layers)",
                               path=where, tensor=name + ("_blocks" if suffix.endswith("_proj") else ""))
        tied = view.bool("tie_word_embeddings", default=False)
        for name in ("model.embed_tokens.weight", "model.norm.weight") + (() if tied else ("lm_head.weight",)):
            if name not in self.ckpt.location:
                raise BadInput("missing: gpt-oss needs it", path=self.path / self.ckpt.shards[0], tensor=name)

    def _bad(self, msg: str, tensor: str) -> BadInput:
        return BadInput(msg, path=self.ckpt.file_of(tensor), tensor=tensor)

    def _stack_shape(self, blocks: str) -> tuple[int, int, int]:
        """(experts, rows, groups of 32) of a stack, its blocks and scales checked against each other."""
        scales = blocks[: -len("_blocks")] + "_scales"
        for n in (blocks, scales):
            if self.ckpt.dtype(n) != "U8":
                raise self._bad(f"dtype {self.ckpt.dtype(n)} is not U8 (MXFP4 nibbles and E8M0 exponents)", n)
        bshape, sshape = self.ckpt.shape(blocks), self.ckpt.shape(scales)
        if len(bshape) != 4 or bshape[3] != 16 or min(bshape) < 1 or tuple(sshape) != tuple(bshape[:3]):
            raise self._bad(f"blocks {list(bshape)} / scales {list(sshape)}: expected [experts, rows, groups, 16] "
                            "and [experts, rows, groups]", blocks)
        if self.stacks[blocks][1] == "gate_up_proj" and bshape[1] % 2:
            raise self._bad(f"gate_up_proj has {bshape[1]} rows: not gate and up rows in turn", blocks)
        return bshape[0], bshape[1], bshape[2]

    def _params(self, blocks: str, expert: int, rows: slice):
        scales = self.ckpt.get(blocks[: -len("_blocks")] + "_scales", outer=expert)[rows].contiguous()
        return float_grid("e2m1", scales.view(torch.float8_e8m0fnu), 32)

    def _load(self, blocks: str, expert: int, rows: slice) -> Grid:
        params = self._params(blocks, expert, rows)
        slab = self.ckpt.get(blocks, outer=expert)[rows]  # [rows, groups, 16]
        return Grid(params, codes=unpack_fp4(slab.reshape(slab.shape[0], -1)))

    def _expert_records(self, blocks: str, shard: str) -> Iterator[TensorRecord]:
        head, what = self.stacks[blocks]
        n_experts, n_rows, groups = self._stack_shape(blocks)
        parts = (("down_proj", slice(None)),) if what == "down_proj" else \
            (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2)))
        for e in range(n_experts):
            for proj, rows in parts:
                out_f = n_rows if what == "down_proj" else n_rows // 2
                # the expert's exponents are read on use (planning, writing: `params_loader`), not held from
                # planning to writing: one byte per 32 weights, 1/16 of the expert bytes (3.6 GB for gpt-oss-120b)
                yield TensorRecord(f"{head}{e}.{proj}.weight", (out_f, groups * 32), "grid",
                                   lambda b=blocks, e=e, r=rows: self._load(b, e, r),
                                   params_loader=lambda b=blocks, e=e, r=rows: self._params(b, e, r), source_file=shard,
                                   source_name=f"{blocks}[{e}]" + ("" if what == "down_proj" else
                                                                   f" rows {rows.start}::2"))

    # -- the ModelSource interface -----------------------------------------------------------------
    def records(self) -> Iterator[TensorRecord]:
        for shard in self.ckpt.shards:
            for name in self.ckpt.keys(shard):
                if name in self.stacks:
                    yield from self._expert_records(name, shard)
                elif name.endswith("_scales") and name[: -len("_scales")] + "_blocks" in self.stacks:
                    continue
                else:
                    yield self.ckpt.dense_record(name, shard)

    def describe(self) -> dict:
        experts = {self._stack_shape(n)[0] for n in self.stacks}
        return {"format": self.format_name, "expert_stacks": len(self.stacks),
                "experts": sorted(experts), "shards": len(self.ckpt.shards), "ignored_files": self.ignored_files,
                "modules_to_not_convert": self.quant_config.get("modules_to_not_convert", []),
                "layout": "expert weights as MXFP4 blocks (e2m1 codes, an E8M0 exponent per 32) in [experts, out, "
                          "in] order, gate_up rows interleaved gate/up; read as one float grid per expert and "
                          "projection; everything else dense"}


def open_mxfp4(path: Path, **_: object) -> Mxfp4Source:
    return Mxfp4Source(path)

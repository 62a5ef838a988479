"""The per-layer error plot beside batch.md: the numbers it draws (layer_errors, hand-computed), the PNG
it writes (read back, not one colour), its KL panel, its scales, and its failure contract (no matplotlib:
None; a drawing failure: a warning, or with strict the exception)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

from qconvert.converters.apps.batch_jobs import JobResult
from qconvert.converters.apps.batch_plot import layer_error_figure, layer_errors, load_job_reports, plot_layer_errors
from helpers import run_cli

ROOT = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _t(name, shape, rmse):
    return {"name": name, "shape": list(shape), "verdict": "exact" if rmse == 0 else "requantize",
            "max_abs_err": None if rmse is None else 2 * rmse, "rmse": rmse}


HF_REPORT = {"tensors": [
    _t("model.embed_tokens.weight", (16, 4), 9.0),  # outside every layer: not drawn
    _t("model.layers.0.self_attn.q_proj.weight", (2, 3), 1.0),
    _t("model.layers.0.input_layernorm.weight", (4,), 0.5),
    _t("model.layers.1.mlp.up_proj.weight", (3, 3), 0.0),  # a layer of exact tensors
    _t("model.layers.1.input_layernorm.weight", (3,), 0.0),
    _t("model.layers.12.mlp.down_proj.weight", (1, 1), 0.25),  # two digits, not layer 1
    _t("model.layers.5.mlp.down_proj.weight", (2, 2), None),  # not measured (a dry run): no point
    _t("lm_head.weight", (16, 4), 9.0),
]}

GGUF_REPORT = {"tensors": [
    _t("token_embd.weight", (16, 4), 9.0),
    _t("blk.0.attn_q.weight", (8, 8), 0.2),
    _t("blk.0.attn_norm.weight", (8,), 0.0),
    _t("blk.2.ffn_down.weight", (2, 2), 3.0),
    _t("output_norm.weight", (4,), 9.0),
]}


def test_layer_errors_weights_each_tensor_by_its_size_hf_names():
    errs = layer_errors(HF_REPORT)
    assert list(errs) == [0, 1, 12]
    # layer 0: (6 * 1.0^2 + 4 * 0.5^2) / 10 = 0.7; an unweighted mean would give sqrt(0.625)
    assert errs[0] == pytest.approx(math.sqrt(0.7), rel=1e-12)
    assert errs[1] == 0.0
    assert errs[12] == pytest.approx(0.25, rel=1e-12)


def test_layer_errors_gguf_names_and_the_output_name_when_the_source_name_has_no_layer():
    errs = layer_errors(GGUF_REPORT)
    # layer 0: 64 * 0.2^2 / (64 + 8) = 2.56 / 72
    assert errs == {0: pytest.approx(math.sqrt(2.56 / 72), rel=1e-12), 2: pytest.approx(3.0, rel=1e-12)}
    renamed = {"tensors": [{**_t("some.custom.name", (2, 2), 0.5), "out_name": "blk.7.attn_k.weight"}]}
    assert layer_errors(renamed) == {7: pytest.approx(0.5)}
    assert layer_errors({"tensors": []}) == {}


def _results(*outs_pairs, **kl):
    rs = [JobResult(src="src", pair=pair, out=out, status="done") for out, pair in outs_pairs]
    for r, (kl_mean, kl_max, top1) in zip(rs, kl.get("kl", [])):
        # set as attributes: the KL fields of JobResult are optional to the plot (getattr)
        r.kl_mean, r.kl_max, r.top1_agreement = kl_mean, kl_max, top1
    return rs


def _assert_png_with_content(path: Path):
    import matplotlib.image
    import numpy as np

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    img = matplotlib.image.imread(str(path))
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    colours = np.unique(img.reshape(-1, img.shape[2]), axis=0)
    assert len(colours) > 10, f"{len(colours)} colours: an empty picture"


def test_the_plot_writes_a_png_with_one_panel_without_kl(tmp_path):
    pytest.importorskip("matplotlib")
    results = _results(("/o/a.gguf", "gptq->gguf"), ("/o/b-hf", "gguf->hf"), ("/o/c.gguf", "gptq->gguf"))
    results[2].status = "failed"  # its report is an earlier run's: not drawn
    reports = {"/o/a.gguf": HF_REPORT, "/o/b-hf": GGUF_REPORT, "/o/c.gguf": HF_REPORT}
    png = plot_layer_errors(results, reports, tmp_path / "layers.png", strict=True)
    assert png == tmp_path / "layers.png"
    _assert_png_with_content(png)
    fig = layer_error_figure(results, reports)
    assert len(fig.axes) == 1
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["a.gguf (gptq->gguf)", "b-hf (gguf->hf)", "exact layer (error 0)"]
    # errors from 0.25 to 3.0 span more than 10x and layer 1 is exact: symlog keeps 0 on the axis
    assert ax.get_yscale() == "symlog"


def test_errors_within_10x_stay_linear_and_without_zeros_a_wide_span_is_log():
    pytest.importorskip("matplotlib")
    near = {"tensors": [_t("model.layers.0.q.weight", (2, 2), 0.1), _t("model.layers.1.q.weight", (2, 2), 0.5)]}
    wide = {"tensors": [_t("model.layers.0.q.weight", (2, 2), 0.01), _t("model.layers.1.q.weight", (2, 2), 0.5)]}
    r = _results(("/o/x", "gptq->hf"))
    assert layer_error_figure(r, {"/o/x": near}).axes[0].get_yscale() == "linear"
    assert layer_error_figure(r, {"/o/x": wide}).axes[0].get_yscale() == "log"


def test_a_one_layer_model_gets_integer_layer_ticks():
    pytest.importorskip("matplotlib")
    one = {"tensors": [_t("model.layers.0.q.weight", (2, 2), 0.1)]}
    ax = layer_error_figure(_results(("/o/x", "gptq->hf")), {"/o/x": one}).axes[0]
    lo, hi = ax.get_xlim()
    assert [t for t in ax.get_xticks() if lo <= t <= hi] == [0.0]


def test_kl_adds_a_second_panel_with_a_bar_per_measured_job(tmp_path):
    pytest.importorskip("matplotlib")
    results = _results(("/o/a.gguf", "gptq->gguf"), ("/o/b.gguf", "gptq->gguf"), ("/o/c-hf", "gptq->hf"),
                       kl=[(0.02, 0.3, 0.97), (0.5, None, None), (None, None, None)])
    reports = {"/o/a.gguf": HF_REPORT, "/o/b.gguf": GGUF_REPORT}
    fig = layer_error_figure(results, reports)
    assert len(fig.axes) == 2
    kl_ax = fig.axes[1]
    assert [round(p.get_height(), 6) for p in kl_ax.patches] == [0.02, 0.5]  # c-hf measured no KL: no bar
    assert [t.get_text() for t in kl_ax.get_xticklabels()] == ["a.gguf (gptq->gguf)", "b.gguf (gptq->gguf)"]
    assert any(t.get_text() == "top-1 97.0%" for t in kl_ax.texts)
    png = plot_layer_errors(results, reports, tmp_path / "kl.png", strict=True)
    _assert_png_with_content(png)


def test_a_real_report_from_the_cli(tmp_path):
    """The report shape qconvert writes, not only the hand-made one: q4_k_m requantizes the down projections."""
    pytest.importorskip("matplotlib")
    out, rep = tmp_path / "tiny.gguf", tmp_path / "tiny.json"
    run_cli("gptq->gguf", ROOT / "examples" / "tiny-llama-gptq-4bit", out, "--type", "q4_k_m", "--allow-requant",
            "--quiet", "--report", rep)
    report = json.loads(rep.read_text())
    errs = layer_errors(report)
    assert list(errs) == [0, 1] and all(e > 0 for e in errs.values())
    per_layer = [t for t in report["tensors"] if t["name"].startswith("model.layers.0.")]
    assert errs[0] <= max(t["rmse"] for t in per_layer)  # a weighted mean of squares is at most the largest
    results = _results((str(out), "gptq->gguf"))
    _assert_png_with_content(plot_layer_errors(results, _keyed_by_output(rep), tmp_path / "p.png",
                                               strict=True))


def _keyed_by_output(report_path: Path) -> dict[str, dict]:
    rep = json.loads(report_path.read_text())
    return {rep["target"]["path"]: rep}


def test_without_matplotlib_nothing_is_written_and_none_returned(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    png = tmp_path / "layers.png"
    assert plot_layer_errors(_results(("/o/a", "gptq->hf")), {"/o/a": HF_REPORT}, png) is None
    assert not png.exists()


def test_a_drawing_failure_warns_unless_strict(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    broken = {"tensors": [{"name": "model.layers.0.q.weight", "shape": ["x"], "rmse": 0.1}]}
    r = _results(("/o/a", "gptq->hf"))
    with pytest.raises(ValueError):
        plot_layer_errors(r, {"/o/a": broken}, tmp_path / "s.png", strict=True)
    assert plot_layer_errors(r, {"/o/a": broken}, tmp_path / "w.png") is None
    err = capsys.readouterr().err
    assert err.startswith("qconvert: warning:") and "w.png" in err and "ValueError" in err
    assert len(err.strip().splitlines()) == 1


def test_load_job_reports_keys_by_output_and_the_newest_wins(tmp_path):
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    old, new = jobs / "k1.json", jobs / "k2.json"
    old.write_text(json.dumps({"target": {"path": "/o/a.gguf"}, "tensors": [], "which": "old"}))
    new.write_text(json.dumps({"target": {"path": "/o/a.gguf"}, "tensors": [], "which": "new"}))
    os.utime(old, ns=(2_000_000_000_000_000_000, 2_000_000_000_000_000_000))
    os.utime(new, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    (jobs / "k3.json").write_text('{"target": {"path": "/o/b')  # a job killed while writing its report
    (jobs / "k4.json").write_text(json.dumps({"target": {"path": "/o/c-hf"}, "tensors": []}))
    got = load_job_reports(tmp_path)
    assert set(got) == {"/o/a.gguf", "/o/c-hf"}
    assert got["/o/a.gguf"]["which"] == "old"  # the later mtime, whatever the file name

"""Plots and report from synthetic summary rows: budget labels, Wilson bars, the metric's name on
the axis, heatmaps with colorbar, cell values and panels in numeric budget order, the 1x1 case,
and report.md linking the table, plots and failed runs; the partial-credit metric."""
from __future__ import annotations

import csv

import pytest

from kvsieve.eval import plots
from kvsieve.eval.config import from_dict
from kvsieve.eval.metrics import digit_prefix_match, mean_ci95
from kvsieve.eval.report import format_table, write_report
from kvsieve.eval.runner import SUMMARY_FIELDS
from kvsieve.eval.store import write_csv

pytest.importorskip("matplotlib")


def _row(out, task, length, selector, budget, tokens, scores, sparsity, depths):
    folder = f"{task}__{length}__m__{selector}__{budget}"
    (out / folder).mkdir(parents=True, exist_ok=True)
    write_csv(out / folder / "predictions.csv",
              [{"sample": i, "depth": d, "score": s} for i, (d, s) in enumerate(zip(depths, scores))],
              ["sample", "depth", "score"])
    m, lo, hi = mean_ci95(scores, binary=True)
    return {"task": task, "length": length, "selector": selector, "budget_label": budget, "budget_tokens": tokens,
            "achieved_sparsity": sparsity, "score": m, "ci95_low": lo, "ci95_high": hi, "n": len(scores),
            "status": "ok", "error": "", "folder": folder}


@pytest.fixture
def figures(monkeypatch):
    """Capture each figure instead of writing it; returns {file name: figure}."""
    seen = {}

    def save(fig, path):
        seen[path.name] = fig
        return path

    monkeypatch.setattr(plots, "_save", save)
    yield seen
    import matplotlib.pyplot as plt

    plt.close("all")


def _grid_rows(out, depths, lengths):
    rows = []
    for length in lengths:
        rows.append(_row(out, "passkey", length, "dense", "full", length, [1.0] * len(depths), 0.0, depths))
        for b, tokens in (("b512", 512), ("b64", 64), ("b128", 128)):
            rows.append(_row(out, "passkey", length, "quest", b, tokens, [1.0, 0.0][:len(depths)] + [1.0] *
                             (len(depths) - 2), 1 - tokens / length, depths))
    return rows


def test_score_plot_labels_bars_and_axis(tmp_path, figures):
    rows = _grid_rows(tmp_path, [25.0, 75.0], [1024])
    plots.write_plots(tmp_path, rows)
    ax = figures["score_vs_sparsity__passkey.png"].axes[0]
    assert ax.get_ylabel() == "pass key found (exact match)"
    assert {t.get_text() for t in ax.texts} == {"b64", "b128", "b512"}
    # one error bar per point, spanning the Wilson interval of 1 of 2
    lo, hi = mean_ci95([1.0, 0.0])[1:]
    segs = [s for c in ax.collections for s in c.get_segments()]
    assert len(segs) == 3
    assert all(seg[0][1] == pytest.approx(lo) and seg[1][1] == pytest.approx(hi) for seg in segs)


def test_fidelity_axis_is_mass_recall(tmp_path, figures):
    row = {"task": "fidelity", "length": 256, "selector": "quest", "budget_label": "b64", "budget_tokens": 64,
           "achieved_sparsity": 0.7, "score": 0.8, "ci95_low": 0.7, "ci95_high": 0.9, "n": 2, "folder": "x"}
    plots.write_plots(tmp_path, [row])
    assert figures["score_vs_sparsity__fidelity.png"].axes[0].get_ylabel() == "attention-mass recall"


def test_heatmap_colorbar_values_and_numeric_order(tmp_path, figures):
    rows = _grid_rows(tmp_path, [25.0, 75.0], [1024, 2048])
    plots.write_plots(tmp_path, rows)
    fig = figures["heatmap__passkey.png"]
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == ["dense", "quest b64", "quest b128", "quest b512"]
    assert any(ax.get_label() == "<colorbar>" for ax in fig.axes)
    assert [t.get_text() for t in panels[1].texts] == ["1.00", "1.00", "0.00", "0.00"]  # depth 75 fails


def test_one_cell_heatmap_is_one_panel(tmp_path, figures):
    rows = _grid_rows(tmp_path, [50.0], [1024])
    plots.write_plots(tmp_path, rows)
    fig = figures["heatmap__passkey.png"]
    panels = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
    assert len(panels) == 1
    ax = panels[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["dense", "quest b64", "quest b128", "quest b512"]
    assert [t.get_text() for t in ax.texts] == ["1.00"] * 4
    assert any(ax.get_label() == "<colorbar>" for ax in fig.axes)


def test_plots_written_as_png(tmp_path):
    rows = _grid_rows(tmp_path, [50.0], [1024])
    paths = plots.write_plots(tmp_path, rows)
    assert [p.name for p in paths] == ["score_vs_sparsity__passkey.png", "heatmap__passkey.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)
    assert not list(tmp_path.glob(".*.tmp"))


def test_report_links_table_plots_and_failures(tmp_path):
    rows = [{**r, "run_id": "x"} for r in _grid_rows(tmp_path, [50.0], [1024])]
    rows.append({"task": "passkey", "length": 1024, "selector": "snapkv", "budget_label": "b64", "budget_tokens": 64,
                 "status": "failed", "error": "RuntimeError: boom", "folder": "passkey__1024__m__snapkv__b64"})
    write_csv(tmp_path / "summary.csv", rows, SUMMARY_FIELDS)
    paths = plots.write_plots(tmp_path, [r for r in rows if r["status"] == "ok"])
    cfg = from_dict({"output_dir": str(tmp_path), "tasks": {"passkey": {"lengths": [1024]}}})
    report = write_report(tmp_path, cfg, rows, paths).read_text()
    assert "[summary.csv](summary.csv)" in report
    for p in paths:
        assert f"![{p.stem}]({p.name})" in report and f"[{p.name}]({p.name})" in report
    assert "[passkey__1024__m__snapkv__b64](passkey__1024__m__snapkv__b64/error.txt): RuntimeError: boom" in report
    assert "5 runs: 4 ok, 1 failed" in report
    table = format_table(rows)
    assert "FAILED: RuntimeError: boom" in table and "[0.21, 1.00]" in table  # Wilson for 1 of 1
    with (tmp_path / "summary.csv").open() as fh:
        assert len(list(csv.DictReader(fh))) == 5


def test_partial_credit_never_below_the_score():
    assert digit_prefix_match(":\n1. 6733903", "6733903") == 1.0
    assert digit_prefix_match("1. 67339 and 6733", "6733903") == pytest.approx(5 / 7)


def test_intervals():
    assert mean_ci95([0.8, 0.8], binary=False)[1:] == (pytest.approx(0.8), pytest.approx(0.8))
    m, lo, hi = mean_ci95([1.0, 1.0], binary=False)
    assert (m, lo, hi) == (1.0, 1.0, 1.0)
    assert mean_ci95([1.0, 1.0], binary=True)[1] == pytest.approx(0.342, abs=1e-3)
    with pytest.raises(ValueError, match="binary"):
        mean_ci95([0.5], binary=True)

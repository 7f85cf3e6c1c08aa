"""benchmarks/vllm_quality.py without vLLM: its answer from vLLM's generated tokens (the package's
``kvsieve.eval.served.agreement.answer_text``, which ``kvsieve eval --engine vllm`` uses too) is
the answer the eval's own decoding loop gives for the same tokens (stop rule, EOS), whether vLLM
stopped at EOS or generated past it (``ignore_eos``), and it matches a ``kvsieve eval`` output
folder's runs by task and length, sample by sample."""
from __future__ import annotations

import csv

import pytest
import torch

from benchmarks._timing import cpu_isa
from benchmarks.vllm_quality import _kvsieve_runs, _paired_modes, _same_tokens, _sample, aggregate_rows, make_prompts
from kvsieve.eval.served.agreement import answer_text
from kvsieve.eval.model import ByteTokenizer
from kvsieve.eval.tasks import Sample, get_task
from kvsieve.integrations.transformers import KvsieveSession

EOS = 0
CHARS = "\0abcdefghijklmnopqrstuvwxyz0123456789 ,.-"  # token i decodes to CHARS[i]; 0 is the EOS (special)


class _CharTokenizer:
    eos_token_id = EOS

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(CHARS[i] for i in ids if not (skip_special_tokens and i == EOS))


class _Scripted:
    """Stands in for a session's model: each ``decode`` returns the logits of the next scripted token."""

    def __init__(self, ids: list[int]) -> None:
        self.ids, self.n = ids, 0

    def logits(self) -> torch.Tensor:
        out = torch.zeros(1, len(CHARS))
        out[0, self.ids[self.n]] = 1.0
        return out

    def decode(self, tok: torch.Tensor) -> torch.Tensor:
        self.n += 1
        return self.logits()


def _ids(text: str) -> list[int]:
    return [CHARS.index(c) for c in text]


@pytest.mark.parametrize("task_name", ["passkey", "niah_single"])
@pytest.mark.parametrize("generated", ["12345 and more digits 678", "1234567, then 99999", "no digits at all here",
                                       "12\0", "9876543.21"])
def test_answer_equals_the_eval_decoding_loop(task_name, generated):
    """What vLLM generated (up to max_new_tokens, stopping at EOS), cut by the benchmark, gives the
    prediction and score the eval's Task.run gives when its greedy loop meets the same tokens."""
    task, tok = get_task(task_name), _CharTokenizer()
    ids = _ids(generated.replace("\0", "")) + ([EOS] if "\0" in generated else [])
    ids = ids[: task.max_new_tokens]
    sample = Sample(index=0, prompt="", answers=["12345" if task_name == "passkey" else "1234567"])
    script = _Scripted(ids + [EOS] * task.max_new_tokens)  # past vLLM's output the loop would read on
    row = task.run(_SessionLoop(script), script.logits(), None, sample, None, tok)
    vllm_out = ids[: ids.index(EOS) + 1] if EOS in ids else ids  # vLLM stops at EOS, as the loop does
    assert answer_text(tok, vllm_out, task.stop_regex) == row["prediction"]
    past_eos = (ids + [EOS] + [CHARS.index("7")] * task.max_new_tokens)[: task.max_new_tokens]  # ignore_eos
    assert answer_text(tok, past_eos, task.stop_regex) == row["prediction"]
    assert task.score(row["prediction"], _sample({"sample": 0, "answers": sample.answers, "depth": None})) == \
        row["score"]


class _SessionLoop:
    """The eval's real greedy loop (``KvsieveSession.continue_greedy``) over scripted logits."""

    def __init__(self, script: _Scripted) -> None:
        self.script = script

    def continue_greedy(self, logits, max_new_tokens, eos_token_id=None, stop=None):  # noqa: ANN001, ANN201
        return KvsieveSession.continue_greedy(self.script, logits, max_new_tokens, eos_token_id, stop)


def test_kvsieve_runs_are_matched_by_task_and_length(tmp_path):
    for name, scores in (("passkey__8192__gemma__dense", [1, 0, 1]), ("passkey__8192__gemma__dsa__x16", [1, 1, 0]),
                         ("passkey__4096__gemma__dense", [0, 0, 0]), ("niah_single__8192__gemma__dense", [1, 1, 1])):
        (tmp_path / name).mkdir()
        with open(tmp_path / name / "predictions.csv", "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=["sample", "score"])
            w.writeheader()
            w.writerows({"sample": i, "score": s} for i, s in enumerate(scores))
    (tmp_path / "passkey__8192__gemma__quest__x16").mkdir()  # unfinished: no predictions.csv
    runs = _kvsieve_runs(tmp_path, "passkey", 8192)
    assert runs == {"passkey__8192__gemma__dense": {0: 1.0, 1: 0.0, 2: 1.0},
                    "passkey__8192__gemma__dsa__x16": {0: 1.0, 1: 1.0, 2: 0.0}}


def test_cpu_isa_names_the_cpu_and_its_features():
    text = cpu_isa()
    model, _, features = text.partition(": ")
    assert model and set(features.split()) <= {"amx_bf16", "amx_tile", "avx512_bf16", "avx512_fp16", "avx512f",
                                               "avx2", "fma", "neon", "asimd", "sve"}
    flags = open("/proc/cpuinfo", encoding="utf-8").read()
    assert ("avx2" in features.split()) == (" avx2" in flags)


def test_shared_prefill_pairs_decode_only_selectors_and_refuses_the_rest(tmp_path):
    """--shared-prefill pairs a selector that selects only while decoding (its prompt cache is a dense
    request's) and refuses, by mode, one that selects in the prompt and a lossless @K mode."""
    decode_only = tmp_path / "dsa_dec.yaml"
    decode_only.write_text("selector: dsa\nparams: {index_topk: 64}\nphases: [generation]\n")
    both = tmp_path / "block.yaml"
    both.write_text("selector: block_select\nparams: {block_size: 16}\nphases: [context, generation]\n")
    modes = ["own", "dense", "quest:budget=64,page_size=16", str(decode_only)]
    assert _paired_modes(modes) == {"quest:budget=64,page_size=16", str(decode_only)}
    with pytest.raises(SystemExit, match=f"mode '{both}' selects in the prompt"):
        _paired_modes(["own", str(both)])
    with pytest.raises(SystemExit, match="streaming:budget=64.*selects in the prompt"):
        _paired_modes(["streaming:budget=64"])  # streaming's default phases include the prompt
    with pytest.raises(SystemExit, match="'quest:budget=64@2' is a lossless mode"):
        _paired_modes(["quest:budget=64@2"])
    with pytest.raises(SystemExit, match=r"none of the modes \['own', 'dense'\] is a selector mode"):
        _paired_modes(["own", "dense"])  # nothing to pair: refused, not a run without the pairing


def test_same_tokens_counts_prompts_equal_to_owns():
    generated = {"own": [[1, 2], [3, 4], [5]], "dense@q": [[1, 2], [3, 4], [5]], "q": [[1, 2], [3, 9], [5]]}
    assert _same_tokens(generated) == {"dense@q": 3, "q": 2}
    assert _same_tokens({"q": [[1]]}) == {}  # no own run: nothing to compare with


def test_every_task_gets_the_same_n_with_or_without_depths():
    """A needle task gets ``samples`` prompts per depth; cwe, which has no depth, ``samples`` x the
    number of depths, and they are the eval's first samples of that task (same index, same prompt)."""
    tok, depths = ByteTokenizer(), [10.0, 50.0, 90.0]
    tasks = {name: get_task(name) for name in ("niah_single_1", "cwe")}
    prompts = make_prompts(tok, tasks, 2048, depths, 2, seed=0)
    by_task = {name: [p for p in prompts if p["task"] == name] for name in tasks}
    assert [p["depth"] for p in by_task["niah_single_1"]] == [10.0, 10.0, 50.0, 50.0, 90.0, 90.0]
    assert [p["sample"] for p in by_task["cwe"]] == list(range(6))
    eval_cwe = tasks["cwe"].make_samples(tok, 2048, depths, 6, 0)
    assert [p["ids"] for p in by_task["cwe"]] == [tok.encode(s.prompt, add_special_tokens=True) for s in eval_cwe]


def test_aggregate_averages_niah_variants_as_one_family_and_refuses_a_ratio_to_zero():
    scores = {"dense": {"niah_single_1": [1.0, 1.0], "niah_multikey_1": [0.0, 1.0], "fwe": [0.0, 0.0]},
              "dsa": {"niah_single_1": [1.0, 0.0], "niah_multikey_1": [0.0, 1.0], "fwe": [1.0, 0.0]}}
    rows = {(r["mode"], r["family"]): r for r in aggregate_rows(scores, ["dense", "dsa"])}
    assert rows["dense", "niah"]["score"] == pytest.approx(0.75)
    assert rows["dsa", "niah"]["score"] == pytest.approx(0.5)
    assert rows["dsa", "niah"]["ratio_to_first"] == pytest.approx(0.5 / 0.75)
    assert rows["dsa", "aggregate"]["score"] == pytest.approx((0.5 + 0.5 + 0.5) / 3)
    assert rows["dense", "aggregate"]["score"] == pytest.approx((1.0 + 0.5 + 0.0) / 3)
    assert rows["dsa", "fwe"]["ratio_to_first"] is None  # dense scored 0: no ratio
    assert {f for _, f in rows} == {"niah", "fwe", "aggregate"}

def test_budgets_are_checked_per_paired_mode_before_any_engine_starts(tmp_path):
    """--budgets: every paired mode's selector must take each budget per request, as the plug-in checks
    a request's setting; Quest's page of 16 takes 32 and 128, refuses 24 (not whole pages), naming it."""
    decode_only = tmp_path / "dsa_dec.yaml"
    decode_only.write_text("selector: dsa\nparams: {index_topk: 64}\nphases: [generation]\n")
    modes = ["own", "quest:budget=64,page_size=16", str(decode_only)]
    assert _paired_modes(modes, [32, 128]) == {"quest:budget=64,page_size=16", str(decode_only)}
    with pytest.raises(SystemExit, match=r"--budgets: mode 'quest:budget=64,page_size=16' refuses budget 24 per "
                                         r"request: .*page_size"):
        _paired_modes(modes, [24])
    with pytest.raises(SystemExit, match=r"--budgets: \[32\] given twice"):
        _paired_modes(modes, [32, 128, 32])

"""Lossless sparse decoding in vLLM (docs/lossless.md, "In vLLM"): vLLM speculates with kvsieve's
drafter (``speculative_config`` method ``custom_class``), the selector drafts over vLLM's own cache,
vLLM's own attention verifies with its rejection sampler.

* greedy, Quest drafts at K = 2 and 4 on three 1-2K-token prompts and two short ones (SmolLM2, fp32):
  the tokens are vLLM's own (no speculation, no plug-in); where one differs, vLLM's own top two
  logprobs at that step are within rounding (:func:`first_differences`), else the test fails. The
  K = 2 engine runs the plug-in's per-block state check (``KVSIEVE_CHECK_STATE=1``: page summaries
  equal their recomputation from vLLM's cache after every hook, verify rows and draft steps
  included) and refuses a per-request kvsieve setting at admission; most drafts are accepted
  (vLLM's spec-decode counters), which garbage drafts would not be;
* sampling (temperature 1, seeded), DSA drafts with the state check on: the run completes and
  vLLM accepts and rejects drafts; the drafter reads no sampling setting: its proposals are the
  argmax of the draft pass's logits (:func:`test_drafter_chains_argmax_tokens_over_the_rows_it_drafts`,
  on a stand-in model), the deterministic proposal vLLM's rejection sampler keeps exact
  (docs/lossless.md);
* tensor parallelism 2 (a tiny Gemma 3 whose one KV head each rank replicates): the tokens are
  vLLM's own in one process, under the same rounding rule;
* start-up refusals: vLLM's ngram method with a selector on, and kvsieve's drafter with the plug-in
  off, each stop the engine before it serves, naming the setting.
The load test with speculation (prefix caching, chunked prefill, preemption, aborts) is in
``test_load.py``.
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm.platforms", reason="vLLM is not installed (it runs in its own venv, see .ci/run)")

from test_engine import _engine_process, _run_engine, model_dir, random_indexer  # noqa: E402, F401 (fixture)
from test_parallel import SMALL, write_tiny_gemma3  # noqa: E402

QUEST = "quest:budget=256,page_size=16"
LONG = ("--prompt-tokens", "1500", "--long-prompts", "3", "--max-tokens", "24", "--dtype", "float32",
        "--logprobs", "2")
TIE = 1e-3  # top-two logprob gap (= logit gap) that a K+1-row verify's fp32 rounding may flip (as docs/lossless.md)


def first_differences(own: dict, spec: dict) -> list[str]:
    """Per request, the first step where the speculative tokens leave vLLM's own, unless vLLM's own
    two top logprobs there are within :data:`TIE` and the speculative token is one of them: the
    list of such unexplained differences (empty: lossless)."""
    bad = []
    for r, (a, b) in enumerate(zip(own["tokens"], spec["tokens"])):
        step = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if step is None:
            assert len(a) == len(b), (r, a, b)
            continue
        top = sorted(own["logprobs"][r][step].items(), key=lambda kv: -kv[1])[:2]
        if not (len(top) == 2 and top[0][1] - top[1][1] <= TIE and str(b[step]) in dict(top)):
            bad.append(f"request {r}, step {step}: own {a[step]}, speculative {b[step]}, own top logprobs {top}")
    return bad


def test_greedy_drafts_give_vllm_own_tokens(model_dir, tmp_path):  # noqa: F811 (fixture)
    own = _run_engine(model_dir, tmp_path / "own.json", *LONG)
    assert own["drafted"] == 0 and min(own["prompt_lens"][2:]) > 1400
    for k, env, refused in ((2, {"KVSIEVE_CHECK_STATE": "1"}, ("--refused", "budget=128")), (4, {}, ())):
        spec = _run_engine(model_dir, tmp_path / f"k{k}.json", *LONG, "--speculate", str(k), *refused,
                           KVSIEVE_SELECTOR=QUEST, **env)
        assert first_differences(own, spec) == [], k
        assert spec["accepted"] > spec["drafted"] / 2 > 0, (k, spec["drafted"], spec["accepted"])
        assert spec["native_layers"] == list(range(30))  # the draft steps after a round's first: one call
        if refused:
            assert "not served under speculative decoding" in spec["refused"][0], spec["refused"]


def test_sampling_with_dsa_drafts_completes_and_rejects_some(model_dir, tmp_path):  # noqa: F811 (fixture)
    """DSA drafts (a random indexer, fp32 index keys, generation phase) under sampling, with the
    per-block state check on: every index key vLLM's own steps and the draft steps wrote is the
    key of the K/V there (test_engine.random_indexer: the plumbing, not the indexer's quality)."""
    config = tmp_path / "dsa.yaml"
    config.write_text(f"selector: dsa\nparams: {{projections: {random_indexer(tmp_path / 'x.pt', 576, 30)}, "
                      "index_topk: 128, index_k_dtype: float32}\nphases: [generation]\ncheck_state: true\n")
    spec = _run_engine(model_dir, tmp_path / "sampled.json", "--prompt-tokens", "1000", "--max-tokens", "24",
                       "--dtype", "float32", "--temperature", "1.0", "--speculate", "3", KVSIEVE_CONFIG=str(config))
    assert all(len(t) == 24 for t in spec["tokens"])
    assert 0 < spec["accepted"] < spec["drafted"], (spec["drafted"], spec["accepted"])


def test_tensor_parallel_drafts_give_vllm_own_tokens(model_dir, tmp_path):  # noqa: F811 (fixture)
    gemma = write_tiny_gemma3(tmp_path / "tiny-gemma3", model_dir)
    args = ("--prompt-tokens", "700", "--max-tokens", "12", "--dtype", "float32", "--kv-cache-mib", "256",
            "--logprobs", "2")
    own = _run_engine(gemma, tmp_path / "own.json", *args, **SMALL)
    spec = _run_engine(gemma, tmp_path / "tp2.json", *args, "--tensor-parallel-size", "2", "--speculate", "2",
                       KVSIEVE_SELECTOR="quest:budget=256,page_size=128", VLLM_CPU_OMP_THREADS_BIND="0|1", **SMALL)
    assert first_differences(own, spec) == []
    assert spec["drafted"] > 0 and spec["accepted"] > 0


def test_startup_refusals_name_the_setting(model_dir, tmp_path):  # noqa: F811 (fixture)
    ngram = json.dumps({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    proc = _engine_process(model_dir, tmp_path / "ngram.json", "--speculative-config", ngram,
                           KVSIEVE_SELECTOR=QUEST)
    assert proc.returncode != 0 and not (tmp_path / "ngram.json").exists()
    assert "speculative decoding with method 'ngram' (speculative_config.method) is not supported" in proc.stderr
    proc = _engine_process(model_dir, tmp_path / "off.json", "--speculate", "2")
    assert proc.returncode != 0 and not (tmp_path / "off.json").exists()
    assert "names kvsieve's drafter" in proc.stderr and "plug-in is not enabled" in proc.stderr


def _worker_config(k: int, **parallel: int):  # noqa: ANN202
    from types import SimpleNamespace

    from kvsieve.integrations.vllm.draft_steps import DRAFTER

    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=256, hf_config=SimpleNamespace(num_hidden_layers=2)),
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=256),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1,
                                        pipeline_parallel_size=parallel.get("pp", 1)),
        speculative_config=SimpleNamespace(method="custom_class", model=DRAFTER, num_speculative_tokens=k))


@pytest.mark.parametrize("spec, k, pp, message", [
    ("quest:budget=64,page_size=16", 2, 1, None),
    ("dense", 2, 1, "the plug-in serves dense attention"),
    ("quest:budget=64,page_size=16", 2, 2, "pipeline_parallel_size=2"),
    ("quest:budget=1024,page_size=16", 129, 1, r"num_speculative_tokens=129 is outside .* \(1 to 128\)"),
    ("quest:budget=64,page_size=16", 65, 1, "num_speculative_tokens=65 with kvsieve's drafter: .*budget of 64"),
    ("streaming:budget=64,num_sink=16", 2, 1, r"selects in the prompt.*phases: \[generation\] in a KVSIEVE_CONFIG file"),
])
def test_drafter_startup_refusals_name_the_field(spec, k, pp, message):
    """What kvsieve's drafter cannot serve exactly is refused when the worker's state is built,
    naming the field; the state it would serve is built otherwise."""
    import torch

    from kvsieve.integrations.vllm.config import read_plugin_config
    from kvsieve.integrations.vllm.state import PluginState

    config = read_plugin_config({"KVSIEVE_SELECTOR": spec})
    if message is None:
        assert PluginState(config, _worker_config(k, pp=pp), torch.device("cpu")).speculating
        return
    with pytest.raises((ValueError, NotImplementedError), match=message):
        PluginState(config, _worker_config(k, pp=pp), torch.device("cpu"))


def test_request_setting_refused_at_admission_only_under_the_drafter():
    """A per-request kvsieve setting is refused, alone, by an engine whose input processor names
    kvsieve's drafter, and parsed as before by one that does not speculate."""
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    from kvsieve.integrations.vllm.settings_processor import KvsieveRequestSettings

    params = SamplingParams(extra_args={"kvsieve": "budget=128"})
    admitting = object.__new__(InputProcessor)  # vLLM's caller of validate_params, config only

    def admit(self: InputProcessor) -> None:  # a method of the input processor: ``self`` up the stack
        KvsieveRequestSettings.validate_params(params)

    admitting.vllm_config = _worker_config(2)
    with pytest.raises(ValueError, match="not served under speculative decoding"):
        admit(admitting)
    admitting.vllm_config = SimpleNamespace(speculative_config=None)
    with pytest.raises(ValueError, match="plug-in is not enabled"):  # no KVSIEVE_* here: parsed as before
        admit(admitting)


def test_draft_counts_stop_at_the_blocks_a_request_holds():
    import numpy as np

    from kvsieve.integrations.vllm.drafter import draft_counts

    # rows: 9 cached of a 16-block -> 7 slots left, capped at K=4; a prompt chunk (nothing sampled);
    # position 32 starts a block vLLM has not allocated; position 15 is a block's last slot;
    # position 37 with max_model_len 40: the verify needs count + 1 positions below 40
    rows = draft_counts([[5], [], [7, 8], [9], [3]], np.array([10, 20, 33, 16, 38]),
                        [np.array([9, 20, 32, 16, 37])], [16], k=4, max_model_len=40)
    assert rows.rows.tolist() == [0, 3, 4] and rows.counts.tolist() == [4, 1, 2]
    assert rows.tokens.tolist() == [5, 9, 3] and rows.positions.tolist() == [9, 15, 37]


def test_drafter_chains_argmax_tokens_over_the_rows_it_drafts(monkeypatch):
    """:meth:`SparseDrafter.propose` on a stand-in model whose logits peak at ``(7 * token + position)
    % V``: each drafting row gets its capped count of drafts, each the argmax at its position, fed
    back as the next step's input; every step's metadata holds the drafting rows' positions, lengths
    and slots in their own blocks."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    import numpy as np
    import torch

    import vllm.forward_context
    from kvsieve.integrations.vllm import draft_steps
    from kvsieve.integrations.vllm.drafter import SparseDrafter

    vocab, built = 101, []

    class Target(torch.nn.Module):
        def forward(self, input_ids, positions):  # noqa: ANN001, ANN201
            return torch.stack([input_ids.double(), positions.double()], 1)

        def compute_logits(self, hidden):  # noqa: ANN001, ANN201
            peak = (7 * hidden[:, 0].long() + hidden[:, 1].long()) % vocab
            return torch.nn.functional.one_hot(peak, vocab).float()

    builder = SimpleNamespace(block_size=16, layer_names=["layer.0"],
                              build=lambda _, common: built.append(common) or common)
    common = SimpleNamespace(num_reqs=4, seq_lens=torch.tensor([9, 20, 30, 32]),
                             block_table_tensor=torch.tensor([[4, 0], [5, 6], [7, 8], [2, 3]]))
    monkeypatch.setattr(draft_steps, "_RECORDS", {1: (builder, common)})
    monkeypatch.setattr(vllm.forward_context, "set_forward_context", lambda *a, **k: nullcontext())
    config = SimpleNamespace(additional_config={"kvsieve": {"selector": "quest:budget=64,page_size=16"}},
                             speculative_config=SimpleNamespace(num_speculative_tokens=3),
                             model_config=SimpleNamespace(max_model_len=64))
    drafter = SparseDrafter(config)
    drafter.load_model(Target())
    # row 0: 3 drafts from position 9 (its block holds 16 positions); row 1: a prompt chunk (nothing
    # sampled); row 2: position 31, the last its 2 blocks hold: 1 draft; row 3: position 32 would start a
    # third block vLLM has not allocated: none
    drafts = drafter.propose([[11], [], [12, 13], [14]], np.array([10, 20, 32, 33]), np.zeros((4, 64)))
    chain = [(7 * 11 + 9) % vocab]
    for pos in (10, 11):
        chain.append((7 * chain[-1] + pos) % vocab)
    assert drafts == [chain, [], [(7 * 13 + 31) % vocab], []]
    assert [c.seq_lens.tolist() for c in built] == [[10, 32], [11], [12]]
    assert [c.slot_mapping.tolist() for c in built] == [[4 * 16 + 9, 8 * 16 + 15], [4 * 16 + 10], [4 * 16 + 11]]

"""Samples cost prefills, not settings: a sweep prefills each (length, prompt) densely once and shares
it with every run whose selector acts only while decoding (``share_prefill``, the default), and every
run's outputs equal those it gives with a prefill of its own (``share_prefill: false``)."""
from __future__ import annotations

import pytest

from kvsieve.eval.config import ConfigError, from_dict
from kvsieve.eval.model import load_model
from kvsieve.eval.runner import run_sweep
from kvsieve.eval.served.protocol import check_served
from kvsieve.integrations.transformers import KvsieveSession

SAMPLES, DEPTHS = 2, [30]
SHARING = {"oracle_topk": {"budgets": [8, 32]}, "streaming": {"budgets": [16], "params": {"num_sink": 2}},
           "quest": {"budgets": [32], "params": {"page_size": 8, "summary_dtype": "float32"}},
           "block_select": {"budgets": [32], "params": {"block_size": 8}}}
OWN = {"snapkv": {"budgets": [64], "phases": ["context"]}}  # evicts prompt tokens: its own prefill


def _raw(out, share: bool) -> dict:
    return {"model": "tiny-random", "output_dir": str(out), "seed": 0, "share_prefill": share,
            "tasks": {"passkey": {"lengths": [400], "depths": DEPTHS, "samples": SAMPLES},
                      "essay_continuation": {"lengths": [300], "samples": SAMPLES}},
            "selectors": {**SHARING, **OWN}}


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random")


def _sweep(out, share: bool, tiny, monkeypatch) -> int:
    """Run the sweep; the number of prefills it ran."""
    calls = []
    real = KvsieveSession.prefill

    def counted(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(KvsieveSession, "prefill", counted)
    result = run_sweep(from_dict(_raw(out, share)), loaded=tiny, progress=False, log=lambda _: None)
    assert result.failed == 0
    return len(calls)


def test_shared_prefill_gives_every_run_the_outputs_of_its_own_prefill(tmp_path, tiny, monkeypatch):
    shared = _sweep(tmp_path / "shared", True, tiny, monkeypatch)
    own = _sweep(tmp_path / "own", False, tiny, monkeypatch)
    folders = sorted(p.name for p in (tmp_path / "shared").iterdir() if p.is_dir())
    assert len(folders) == 2 * (1 + 5 + 1)  # 2 cells x (dense, 5 sharing settings, snapkv)
    for name in folders:  # predictions (answers, scores, attended fractions) byte for byte
        a = (tmp_path / "shared" / name / "predictions.csv").read_bytes()
        assert a == (tmp_path / "own" / name / "predictions.csv").read_bytes(), name
    assert (tmp_path / "shared" / "summary.csv").read_text().replace("shared", "own") == \
        (tmp_path / "own" / "summary.csv").read_text()
    # the cost: one dense prefill per prompt plus one per setting that selects in the prompt, against
    # one per setting; the prompts: passkey 1 depth x 2 samples, essay_continuation 2 samples
    prompts = len(DEPTHS) * SAMPLES + SAMPLES
    assert shared == prompts * (1 + 1) and own == prompts * (1 + 5 + 1)


def test_share_prefill_off_is_refused_through_vllm(tmp_path):
    cfg = from_dict({**_raw(tmp_path, False), "engine": "vllm", "model": "smollm2",
                     "tasks": {"passkey": {"lengths": [400]}}, "selectors": {}})
    with pytest.raises(ConfigError, match="share_prefill: false prefills every run"):
        check_served(cfg, calibrated=False)

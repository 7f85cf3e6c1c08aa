"""Dense parity of every attention family against transformers' own eager attention, fp32:
prefill + decode over a context five times longer than every window, logits max-diff < 1e-4.
A second check per family shows the test can fail: with the family's features switched off in
kvsieve (no window, no softcap, no sinks) the logits move far past the tolerance."""
from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from families import FAMILIES, build

from kvsieve import SparseAttentionConfig
from kvsieve.integrations.transformers import KvsieveSession

TOL = 1e-4
PROMPT, DECODE = 40, 3


def _ids(n: int = PROMPT) -> torch.Tensor:
    """Random token ids, none of them a special token (0..2: pad / eos / bos in these configs)."""
    return torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(0))


def max_logit_diff(session: KvsieveSession, ref: torch.nn.Module, ids: torch.Tensor, steps: int = DECODE) -> float:
    """Prefill ``ids`` then decode greedily ``steps`` tokens; the largest |logit - reference| seen."""
    logits, seq, worst = session.prefill(ids), ids, 0.0
    for i in range(steps + 1):
        with torch.no_grad():
            want = ref(seq).logits[:, -1]
        worst = max(worst, (logits - want).abs().max().item())
        if i == steps:
            return worst
        tok = logits.argmax(-1)
        seq = torch.cat([seq, tok[:, None]], dim=1)
        logits = session.decode(tok)
    raise AssertionError("unreachable")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("backend,fast", [("torch", True), ("vanilla", False)])
def test_dense_parity(family: str, backend: str, fast: bool) -> None:
    model, ref = build(family)
    session = KvsieveSession(model, None, backend=backend, dense_fast_path=fast, max_tokens=64)
    diff = max_logit_diff(session, ref, _ids())
    print(f"parity {family} backend={backend} fast_path={fast}: max |logit diff| {diff:.1e}")  # shown with -s
    assert diff < TOL


@pytest.mark.parametrize("family", ["qwen2", "mistral", "gemma2", "gemma3", "gpt_oss"])
def test_features_matter(family: str) -> None:
    """Dropping the family's window / softcap / sinks (what kvsieve did before) breaks parity."""
    model, ref = build(family)
    session = KvsieveSession(model, None, max_tokens=64)
    session.backend.features = [dataclasses.replace(f, window=None, softcap=None, sinks=None)
                                for f in session.features]
    assert max_logit_diff(session, ref, _ids(), steps=0) > 100 * TOL


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "gpt_oss"])
def test_selector_on_windowed_layers_sees_only_the_window(family: str) -> None:
    """A selector that keeps everything, run on every layer (sliding ones included): it keeps
    the whole window and nothing else, so the logits still match; the reported attended fraction of
    a sliding layer is the window's, not the whole context's."""
    model, ref = build(family)
    cfg = SparseAttentionConfig("oracle_topk", {"budget": 4096}, layer_types=("full_attention", "sliding_attention"))
    session = KvsieveSession(model, cfg, backend="vanilla", max_tokens=64)
    assert max_logit_diff(session, ref, _ids()) < TOL
    frac = session.attended_fraction("generation")
    for f, x in zip(session.features, frac):
        if f.window is None:
            assert x == pytest.approx(1.0)
        else:  # decode steps at positions 40..42 each read the window's 8 positions
            assert x == pytest.approx(sum(8 / n for n in (41, 42, 43)) / 3, rel=0.02)


def test_triton_backend_honours_windows_and_sinks() -> None:
    """The Triton kernels (interpreted on CPU) get the window as a token selection and the sinks
    from their LSE."""
    model, ref = build("gpt_oss")
    session = KvsieveSession(model, None, backend="triton", dense_fast_path=False, max_tokens=64)
    assert max_logit_diff(session, ref, _ids(24), steps=1) < TOL


def test_transformers_driven_generate_matches() -> None:
    """``model.generate`` with transformers' own cache, attention routed through kvsieve."""
    model, ref = build("gemma3")
    KvsieveSession(model, None, max_tokens=64)
    ids = _ids()
    got = model.generate(ids, max_new_tokens=4, do_sample=False)
    want = ref.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_windowed_prefill_in_query_chunks(family: str, monkeypatch) -> None:
    """The SDPA fast path runs a windowed prefill in chunks of query rows (each against its band of
    keys); forced to chunks of one window (8 rows), parity holds across chunk borders."""
    from kvsieve.integrations.transformers import feature_backend

    monkeypatch.setattr(feature_backend, "_WINDOW_CHUNK", 1)
    model, ref = build(family)
    assert max_logit_diff(KvsieveSession(model, None, max_tokens=64), ref, _ids(), steps=1) < TOL


@pytest.mark.parametrize("native", [True, False])
def test_dense_decode_rows_take_the_native_kernel(native: bool, monkeypatch) -> None:
    """A dense decode step's lone token is read in place by the native CPU kernel (``native_dense``)
    on full-attention layers and on windowed ones still inside their window; past the window, or
    with ``KVSIEVE_NATIVE=0``, SDPA over the gathered K/V runs. Parity holds either way."""
    if native and shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine: the native kernel cannot build")
    if not native:
        monkeypatch.setenv("KVSIEVE_NATIVE", "0")
    model, ref = build("gemma3")  # windows of 8 on every other layer
    session = KvsieveSession(model, None, backend="torch", dense_fast_path=True, max_tokens=64)
    last_paths: dict[int, dict[str, str]] = {}  # each layer's paths at its last forward
    session.observers.append(lambda i, q, result, md, layer: last_paths.__setitem__(i, result.paths))
    assert max_logit_diff(session, ref, _ids(6), steps=1) < TOL  # kv_len 7: inside every window
    within = [last_paths[i]["generation"] for i in range(len(session.layers))]
    assert max_logit_diff(session, ref, _ids(), steps=1) < TOL  # kv_len 41: past the windows
    past = [last_paths[i]["generation"] for i in range(len(session.layers))]
    windowed = [f.window is not None for f in session.features]
    assert any(windowed) and not all(windowed)
    want = "native_dense" if native else "sdpa_dense"
    assert within == [want if native else ("sdpa_window" if w else want) for w in windowed]
    assert past == [("sdpa_window" if w else want) for w in windowed]

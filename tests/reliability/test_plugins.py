"""Plug-in failures are clear errors at load or registration time, naming the plug-in: an entry point
whose import raises, a name taken twice, a selector with no hook, a hook returning the wrong type,
and the same for backends (one registry serves both)."""
from __future__ import annotations

import pytest
import torch

from kvsieve import Engine, KVCacheManager, KVCacheSpec, SparseAttention, SparseAttentionConfig, lower_config
from kvsieve.sparse import SparseRuntimeParams, SparseSelector, registry
from kvsieve.sparse.backends import BACKEND_ENTRY_POINT_GROUP, VanillaBackend, get_backend, register_backend
from kvsieve.sparse.backends.base import BACKENDS
from kvsieve.sparse.registry import SELECTORS, PluginError, register_selector


def install(tmp_path, monkeypatch, group: str, name: str, module_source: str, target: str) -> None:
    """A real distribution on sys.path: module ``plugmod`` and a .dist-info declaring ``name = target``."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "plugmod.py").write_text(module_source)
    info = site / "bad_plugin-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: bad-plugin\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n{name} = {target}\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(__import__("sys").modules, "plugmod", raising=False)


@pytest.fixture
def clean_registries():
    before = (dict(SELECTORS._classes), dict(BACKENDS._classes))
    yield
    for reg, saved in zip((SELECTORS, BACKENDS), before):
        reg._classes.clear()
        reg._classes.update(saved)


@pytest.mark.parametrize("group, source, error, lookup", [
    ("kvsieve.selectors", "import not_a_module_xyz\n", "ModuleNotFoundError", registry.create_selector),
    (BACKEND_ENTRY_POINT_GROUP, "raise RuntimeError('boom')\n", "RuntimeError: boom", get_backend),
])
def test_entry_point_whose_import_raises_names_entry_point_and_distribution(tmp_path, monkeypatch, group, source,
                                                                           error, lookup):
    install(tmp_path, monkeypatch, group, "broken", source, "plugmod:Obj")
    with pytest.raises(PluginError, match=rf"entry point 'broken' in group '{group}' \(plugmod:Obj, "
                                          rf"distribution bad-plugin 1.2.3\) failed to import: {error}"):
        lookup("broken")


def test_entry_point_reusing_a_builtin_name_is_an_error(tmp_path, monkeypatch):
    install(tmp_path, monkeypatch, "kvsieve.selectors", "streaming", "X = 1\n", "plugmod:X")
    with pytest.raises(ValueError, match=r"entry point 'streaming' .*bad-plugin 1.2.3\) uses the name of the "
                                         r"built-in selector 'streaming'"):
        registry.create_selector("streaming")


def test_backend_entry_point_reusing_a_builtin_name_is_an_error(tmp_path, monkeypatch):
    install(tmp_path, monkeypatch, BACKEND_ENTRY_POINT_GROUP, "torch", "X = 1\n", "plugmod:X")
    with pytest.raises(ValueError, match="uses the name of the built-in backend 'torch'"):
        get_backend("torch")


def test_registering_an_existing_name_is_an_error(clean_registries):
    class Again(SparseSelector):
        name = "streaming"

        def predict_attn(self, inputs):
            return None

    with pytest.raises(ValueError, match=r"selector name 'streaming' is already registered by "
                                         r"kvsieve.selectors.streaming.selector.StreamingSelector"):
        register_selector(Again)

    class Vanilla2(VanillaBackend):
        name = "vanilla"

    with pytest.raises(ValueError, match="backend name 'vanilla' is already registered"):
        register_backend(Vanilla2)


def test_selector_without_a_hook_is_refused_at_registration(clean_registries):
    class NoHook(SparseSelector):
        name = "no_hook"

    with pytest.raises(TypeError, match=r"selector 'no_hook' \(.*NoHook\) overrides neither predict_kv nor "
                                        r"predict_attn"):
        register_selector(NoHook)
    assert "no_hook" not in SELECTORS._classes


def test_entry_point_selector_without_a_hook_names_the_entry_point(tmp_path, monkeypatch, clean_registries):
    src = "from kvsieve.sparse import SparseSelector\nclass Sel(SparseSelector):\n    name = 'hookless'\n"
    install(tmp_path, monkeypatch, "kvsieve.selectors", "hookless", src, "plugmod:Sel")
    with pytest.raises(TypeError, match=r"entry point 'hookless' .*bad-plugin 1.2.3\): selector 'hookless'.*"
                                        r"overrides neither"):
        registry.create_selector("hookless")


def test_not_a_subclass_is_refused():
    with pytest.raises(TypeError, match="register_backend expects a AttentionBackend subclass"):
        register_backend(int)


class _Wrong(SparseSelector):
    name = "wrong_type"
    kind = "attn"

    def predict_attn(self, inputs):
        return {"indices": [1, 2]} if self.kind == "attn" else None

    def predict_kv(self, inputs):
        return [torch.zeros(1, 1, dtype=torch.int32)] if self.kind == "kv" else None


@pytest.mark.parametrize("kind, match", [
    ("attn", r"selector 'wrong_type': predict_attn must return SparseRuntimeParams or None, got dict"),
    ("kv", r"selector 'wrong_type': predict_kv must return \(sparse_kv_indices, sparse_kv_offsets\) tensors or "
           r"None, got list"),
])
def test_hook_returning_the_wrong_type_names_the_selector(kind, match, clean_registries):
    register_selector(_Wrong)
    _Wrong.kind = kind
    try:
        plan = lower_config(SparseAttentionConfig("wrong_type"), num_layers=1)[0]
        spec = KVCacheSpec(num_layers=1, num_blocks=8, tokens_per_block=4, num_kv_heads=1, head_dim=8,
                           max_requests=1, max_blocks_per_seq=4)
        cache = KVCacheManager(spec)
        eng = Engine(cache, [SparseAttention(layer_idx=0, num_q_heads=1, num_kv_heads=1, head_dim=8, plan=plan)],
                     max_num_requests=1, max_num_tokens=8)
        with pytest.raises(TypeError, match=match):
            eng.step([0], [5], 1, [(torch.randn(5, 1, 8), torch.randn(5, 1, 8), torch.randn(5, 1, 8))])
    finally:
        _Wrong.kind = "attn"


def test_offsets_for_the_wrong_rows_name_the_selector(clean_registries):
    class AllRows(SparseSelector):
        """Answers for every row of the step although it is asked only about generation rows."""
        name = "all_rows"

        def predict_attn(self, inputs):
            lens = inputs.metadata.token_kv_lens
            return SparseRuntimeParams.from_topk((lens - 1).view(-1, 1, 1))

    register_selector(AllRows)
    plan = lower_config(SparseAttentionConfig("all_rows", phases=("generation",)), num_layers=1)[0]
    spec = KVCacheSpec(num_layers=1, num_blocks=8, tokens_per_block=4, num_kv_heads=1, head_dim=8,
                       max_requests=2, max_blocks_per_seq=4)
    eng = Engine(KVCacheManager(spec), [SparseAttention(layer_idx=0, num_q_heads=1, num_kv_heads=1, head_dim=8,
                                                        plan=plan)], max_num_requests=2, max_num_tokens=16)
    eng.step([0], [5], 1, [(torch.randn(5, 1, 8), torch.randn(5, 1, 8), torch.randn(5, 1, 8))])
    with pytest.raises(ValueError, match=r"selector 'all_rows': predict_attn was asked about rows \[4, 5\) "
                                         r"\(1 rows\) and must return sparse_attn_offsets with 2 entries"):
        eng.step([1, 0], [4, 1], 1, [(torch.randn(5, 1, 8), torch.randn(5, 1, 8), torch.randn(5, 1, 8))])

"""The DSA indexer's hidden state inside vLLM, without vLLM: a toy model shaped as vLLM's (a decoder
layer calling ``self_attn(positions=..., hidden_states=...)``, whose ``attn`` child is the attention
layer the plug-in runs) shows what :class:`IndexerFeed` hands each layer's attention call, and the
plug-in's start-up refusals for a selector reading the indexer."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from kvsieve.integrations.vllm.config import PluginConfig, parse_selector_spec
from kvsieve.integrations.vllm.indexer_feed import IndexerFeed
from kvsieve.integrations.vllm.startup import lower_plans
from kvsieve.integrations.vllm.state import PluginState
from kvsieve.selectors.dsa.projections import IndexerProjections, save_projections

HIDDEN, LAYERS = 8, 3


class _AttnLayer(nn.Module):
    """Stands in for vLLM's ``Attention``: records the hidden state the feed hands its call."""

    def __init__(self, idx: int, feed: list, plugin: bool = True) -> None:
        super().__init__()
        self.layer_name, self.plugin, self.feed, self.got = f"model.layers.{idx}.self_attn.attn", plugin, feed, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx = int(self.layer_name.split(".")[2])
        if self.feed and idx in self.feed[0].layers:
            self.got.append(self.feed[0].take(idx, x.shape[0] - 1, x.shape[0]))  # the last row is padding
        return x


class _SelfAttn(nn.Module):
    def __init__(self, idx: int, feed: list, keyword: bool = True) -> None:
        super().__init__()
        self.proj, self.attn, self.keyword = nn.Linear(HIDDEN, HIDDEN), _AttnLayer(idx, feed), keyword

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.attn(self.proj(hidden_states))


class _Layer(nn.Module):
    def __init__(self, idx: int, feed: list, keyword: bool) -> None:
        super().__init__()
        self.norm, self.self_attn = nn.LayerNorm(HIDDEN), _SelfAttn(idx, feed)
        self.keyword = keyword

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        out = self.self_attn(positions=positions, hidden_states=h) if self.keyword else self.self_attn(positions, h)
        return x + out


class _Model(nn.Module):
    def __init__(self, keyword: bool = True) -> None:
        super().__init__()
        self.feed: list[IndexerFeed] = []
        self.layers = nn.ModuleList(_Layer(i, self.feed, keyword) for i in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[0])
        for layer in self.layers:
            x = layer(pos, x)
        return x


def _feed(model: _Model, layers: set[int], on_found=None) -> IndexerFeed:  # noqa: ANN001
    feed = IndexerFeed(layers, lambda m: isinstance(m, _AttnLayer) and m.plugin,
                       lambda m: int(m.layer_name.split(".")[2]), on_found=on_found)
    model.feed.append(feed)
    return feed


def test_feed_hands_each_layer_its_normalized_input():
    """Each selecting layer's attention call gets its decoder layer's normalized input (the
    ``hidden_states`` of its attention module), cut to the step's real tokens, every forward; other
    layers are not hooked; the finder is gone after the first forward."""
    model = _Model()
    found = []
    feed = _feed(model, {0, 2}, on_found=found.append)
    seen = {}

    def keep_norm(i):  # noqa: ANN001, ANN202
        return lambda mod, args, out: seen.__setitem__(i, out)

    for i, layer in enumerate(model.layers):
        layer.norm.register_forward_hook(keep_norm(i))
    for step in range(2):
        x = torch.randn(5, HIDDEN)
        model(x)
        for i in (0, 2):
            assert torch.equal(model.layers[i].self_attn.attn.got[step], seen[i][:4])
    assert model.layers[1].self_attn.attn.got == []
    assert found == [frozenset({0, 2})] and feed.hooked == frozenset({0, 2})
    feed.close()  # no hook left: nothing is kept, and the attention call says so instead of reading a stale one
    with pytest.raises(RuntimeError, match="layer 0 .* did not run before its attention"):
        model(torch.randn(5, HIDDEN))


def test_feed_refuses_what_it_cannot_serve_by_name():
    # the hidden state passed positionally: refused naming the layer and the module
    model = _Model(keyword=False)
    _feed(model, {1})
    with pytest.raises(NotImplementedError, match="layer 1's attention module _SelfAttn was called without a "
                                                  "hidden_states keyword"):
        model(torch.randn(4, HIDDEN))
    # a selecting layer whose module is not in the model
    model = _Model()
    feed = _feed(model, {0})
    model(torch.randn(4, HIDDEN))
    with pytest.raises(RuntimeError, match="layer 2 reads the DSA indexer's hidden state, but its attention "
                                           "module was not found"):
        feed.take(2, 3, 4)
    # taken twice in one forward, or with another row count than the attention call
    with pytest.raises(RuntimeError, match="did not run before its attention"):
        feed.take(0, 3, 4)
    model.layers[0].self_attn.attn.forward = lambda x: x  # the module runs, its attention call does not take
    model.layers[0].self_attn(positions=torch.arange(6), hidden_states=torch.randn(6, HIDDEN))
    with pytest.raises(RuntimeError, match="layer 0's hidden state has 6 rows, its attention call 4"):
        feed.take(0, 3, 4)


def _vllm_config(hidden: int = HIDDEN, mode: int = 0) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=256, hf_config=SimpleNamespace(num_hidden_layers=LAYERS,
                                                                                  hidden_size=hidden)),
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=256),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1),
        compilation_config=SimpleNamespace(mode=mode))


def _dsa_config(tmp_path, layers=range(LAYERS)) -> PluginConfig:  # noqa: ANN001
    path = tmp_path / "indexer.pt"
    save_projections(str(path), {i: IndexerProjections(HIDDEN, 2, 8, 4) for i in layers})
    return PluginConfig(sparse=parse_selector_spec(f"dsa:projections={path},index_topk=16"))


def test_dsa_plugin_start_up_checks(tmp_path):
    """DSA is served on CPU (every layer reads the indexer), and refused by name: compiled models,
    projections for another hidden size, a selecting layer without projections (when the feed finds
    the layers), no projections file at all, and the CUDA side."""
    state = PluginState(_dsa_config(tmp_path), _vllm_config(), torch.device("cpu"))
    assert state.indexer_layers == frozenset(range(LAYERS)) and state.feed is None
    with pytest.raises(NotImplementedError, match="compilation mode 2 traces it.*enforce-eager"):
        PluginState(_dsa_config(tmp_path), _vllm_config(mode=2), torch.device("cpu"))
    with pytest.raises(ValueError, match=r"take hidden size \[8\], the model's is 16"):
        PluginState(_dsa_config(tmp_path), _vllm_config(hidden=16), torch.device("cpu"))
    state = PluginState(_dsa_config(tmp_path, layers=(0, 1)), _vllm_config(), torch.device("cpu"))
    model = _Model()
    state.start_indexer_feed(lambda m: isinstance(m, _AttnLayer), lambda m: int(m.layer_name.split(".")[2]))
    model.feed.append(state.feed)
    with pytest.raises(ValueError, match=r"dsa has no indexer projections for layers \[2\]"):
        model(torch.randn(4, HIDDEN))
    state.feed.close()
    with pytest.raises(ValueError, match="feeds on vLLM's CPU platform only, not on 'cuda'"):
        lower_plans(_dsa_config(tmp_path), num_layers=LAYERS, backend_name="triton", device="cuda")
    with pytest.raises(ValueError, match="'dsa' needs its indexer projections"):
        lower_plans(PluginConfig(sparse=parse_selector_spec("dsa:index_topk=16")), num_layers=LAYERS,
                    backend_name="torch")


def test_other_model_inputs_are_refused(monkeypatch):
    from kvsieve.selectors.streaming.selector import StreamingSelector

    class Other:
        pass

    monkeypatch.setattr(StreamingSelector, "model_inputs_type", Other)
    with pytest.raises(ValueError, match=r"'streaming' needs per-step model inputs \(Other.*feeds IndexerInputs"):
        lower_plans(PluginConfig(sparse=parse_selector_spec("streaming:budget=8")), num_layers=2,
                    backend_name="torch")

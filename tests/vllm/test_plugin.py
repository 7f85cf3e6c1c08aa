"""The plug-in's start-up behaviour inside vLLM's own process model, without starting an engine:
registration, refusals, and that vLLM's own KV write lands where kvsieve's view reads it."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

# "vllm.platforms", not "vllm": where vLLM is not installed, this folder itself is importable as a
# namespace package named vllm (tests/ is on sys.path); an installed vLLM always takes precedence
pytest.importorskip("vllm.platforms", reason="vLLM is not installed (it runs in its own venv, see .ci/run)")

import vllm.config  # noqa: E402
from vllm.utils.import_utils import resolve_obj_by_qualname  # noqa: E402
from vllm.v1.attention.backend import AttentionType  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

from kvsieve.integrations.vllm import plugin  # noqa: E402
from kvsieve.integrations.vllm.config import ENV_CONFIG, ENV_SELECTOR  # noqa: E402
from kvsieve.integrations.vllm.cpu import RefuseMLABackend  # noqa: E402
from kvsieve.integrations.vllm.startup import probe_cpu_layout, refuse_layer_features  # noqa: E402

OVERRIDDEN = [AttentionBackendEnum.CPU_ATTN, AttentionBackendEnum.CPU_MLA, AttentionBackendEnum.AMX_MLA]


@pytest.fixture
def clean_registry(monkeypatch):
    for var in (ENV_SELECTOR, ENV_CONFIG, "KVSIEVE_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    before = {b: b.get_path() for b in OVERRIDDEN}
    yield
    for b in OVERRIDDEN:
        b.clear_override()
    assert {b: b.get_path() for b in OVERRIDDEN} == before


def test_not_enabled_leaves_vllm_alone(clean_registry):
    """Without the environment's settings the backends wait for vLLM's config: with no ``kvsieve``
    entry in it (or no config current) they resolve to vLLM's own classes."""
    plugin.register()
    assert {b.get_class() for b in OVERRIDDEN} == {resolve_obj_by_qualname(b.value) for b in OVERRIDDEN}


def test_additional_config_decides_when_vllm_picks_the_backend(clean_registry, monkeypatch):
    plugin.register()
    vllm_config = SimpleNamespace(additional_config={"kvsieve": {"selector": "quest", "budget": 128}})
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: vllm_config)
    backend = AttentionBackendEnum.CPU_ATTN.get_class()
    assert backend.get_impl_cls().__name__ == "KvsieveCPUAttentionImpl"
    with pytest.raises(NotImplementedError, match="MLA attention"):
        AttentionBackendEnum.CPU_MLA.get_class().get_name()
    vllm_config.additional_config = {"kvsieve": {"selector": "quest", "budjet": 128}}
    with pytest.raises(ValueError, match=r"\['budjet'\].*accepted fields"):
        AttentionBackendEnum.CPU_ATTN.get_class()
    monkeypatch.setenv(ENV_SELECTOR, "quest")
    vllm_config.additional_config = {"kvsieve": {"selector": "quest"}}
    with pytest.raises(ValueError, match=r"the environment's \['KVSIEVE_SELECTOR'\] both configure"):
        AttentionBackendEnum.CPU_ATTN.get_class()


def test_enabled_overrides_cpu_attention(clean_registry, monkeypatch):
    monkeypatch.setenv(ENV_SELECTOR, "quest:budget=128")
    plugin.register()
    assert AttentionBackendEnum.CPU_ATTN.get_path() == plugin.CPU_BACKEND
    backend = AttentionBackendEnum.CPU_ATTN.get_class()
    assert backend.get_name() == "CPU_ATTN" and backend.get_impl_cls().__name__ == "KvsieveCPUAttentionImpl"
    with pytest.raises(NotImplementedError, match="MLA attention"):
        AttentionBackendEnum.CPU_MLA.get_class().get_name()


@pytest.mark.parametrize("spec,message", [
    ("snapkv", "evicts prompt tokens"),
    ("rocketkv:prompt_budget=512", "evicts prompt tokens"),
    ("dsa:index_topk=64", "'dsa' needs its indexer projections"),
    ("quest:budget=8", "budget must be >= page_size"),
    ("quest:bogus=1", "accepted fields"),
    ("nosuch", "unknown selector"),
    ("quest:budget", "must look like key=value"),
])
def test_refused_at_start_up(clean_registry, monkeypatch, spec, message):
    monkeypatch.setenv(ENV_SELECTOR, spec)
    with pytest.raises(ValueError, match=message):
        plugin.register()
    assert not any(b.is_overridden() for b in OVERRIDDEN)  # nothing registered


def test_config_file_and_conflicts(clean_registry, monkeypatch, tmp_path):
    path = tmp_path / "kvsieve.yaml"
    path.write_text("selector: streaming\nparams: {budget: 64, num_sink: 4}\ndense_layers: [0, -1]\n")
    monkeypatch.setenv(ENV_CONFIG, str(path))
    plugin.register()
    assert AttentionBackendEnum.CPU_ATTN.get_path() == plugin.CPU_BACKEND
    AttentionBackendEnum.CPU_ATTN.clear_override()
    monkeypatch.setenv(ENV_SELECTOR, "dense")
    with pytest.raises(ValueError, match="not both"):
        plugin.register()
    monkeypatch.delenv(ENV_SELECTOR)
    path.write_text("selector: streaming\nwindow: 3\n")
    with pytest.raises(ValueError, match=r"unknown keys \['window'\]"):
        plugin.register()


@pytest.mark.parametrize("feature,kwargs", [
    ("ALiBi", {"alibi_slopes": [0.5]}),
    ("sliding-window", {"sliding_window": 128}),
    ("soft-capping", {"logits_soft_cap": 30.0}),
    ("sinks", {"sinks": torch.zeros(4)}),
    ("KV sharing", {"kv_sharing_target_layer_name": "model.layers.0.self_attn.attn"}),
    ("attention type 'encoder_only'", {"attn_type": AttentionType.ENCODER_ONLY}),
    ("KV cache dtype 'fp8'", {"kv_cache_dtype": "fp8"}),
])
def test_layer_features_refused_by_name(feature, kwargs):
    args = dict(alibi_slopes=None, sliding_window=None, logits_soft_cap=None, attn_type=AttentionType.DECODER,
                kv_sharing_target_layer_name=None, sinks=None, kv_cache_dtype="auto")
    refuse_layer_features(**args)  # a plain decoder layer passes
    with pytest.raises(NotImplementedError, match=feature):
        refuse_layer_features(**{**args, **kwargs})


@pytest.mark.parametrize("isa,block_size", [("vec", 32), ("vec", 128), ("vec16", 16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_vllm_kv_write_is_the_layout_kvsieve_views(isa, block_size, dtype):
    from vllm import _custom_ops as ops

    probe_cpu_layout(ops.cpu_attn_reshape_and_cache, isa, dtype, block_size, head_dim=64,
                     num_kv_heads=3)  # raises on a mismatch


def test_cpu_adapter_serves_vllm_dummy_steps_without_reading_the_batch(monkeypatch):
    """vLLM's profile and warm-up runs call each layer with ``attn_metadata=None``: the CPU adapter
    returns vLLM's output untouched without asking a prompt length (a process without the batch
    table would refuse any real step); fused output quantization is refused even there."""
    from types import SimpleNamespace

    from kvsieve.integrations.vllm import request_settings
    from kvsieve.integrations.vllm.cpu import KvsieveCPUAttentionImpl

    monkeypatch.setattr(request_settings, "_CURRENT", [None])
    with pytest.raises(RuntimeError, match="no batch table"):
        request_settings.row_prompt_lens(1)
    impl = object.__new__(KvsieveCPUAttentionImpl)  # what forward reads before it routes
    impl._layer_idx, impl.sliding_window = None, -1
    impl.state = SimpleNamespace(host_only=lambda layer_idx: False)
    layer = SimpleNamespace(layer_name="model.layers.3.self_attn.attn")
    q, out = torch.randn(4, 2, 8), torch.full((4, 16), 3.0)
    assert impl.forward(layer, q, q[:, :1], q[:, :1], torch.zeros(1), None, out) is out
    assert bool((out == 3.0).all()) and impl._layer_idx == 3
    with pytest.raises(NotImplementedError, match="fused output quantization"):
        impl.forward(layer, q, q[:, :1], q[:, :1], torch.zeros(1), None, out, output_scale=torch.ones(1))


def test_refuse_mla_backend_class():
    with pytest.raises(NotImplementedError, match="MLA attention"):
        RefuseMLABackend.get_supported_kernel_block_sizes()


def test_cuda_side_imports_and_declares_its_classes():
    """The CUDA side imports on CPU and is wired to vLLM's Triton backend (it has never run on a
    GPU: its kernels' data plumbing is covered by test_view.py's Triton cases in the interpreter)."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl

    from kvsieve.integrations.vllm import cuda

    assert issubclass(cuda.KvsieveTritonAttentionBackend, TritonAttentionBackend)
    assert cuda.KvsieveTritonAttentionBackend.get_name() == "TRITON_ATTN"
    assert issubclass(cuda.KvsieveTritonAttentionBackend.get_impl_cls(), TritonAttentionImpl)
    assert plugin.CUDA_BACKEND == f"{cuda.__name__}.{cuda.KvsieveTritonAttentionBackend.__name__}"
    with pytest.raises(NotImplementedError, match="only the TRITON_ATTN backend"):
        cuda.RefuseOtherCudaBackend.get_name()
    with pytest.raises(NotImplementedError, match="enforce-eager"):
        cuda.refuse_cuda_graphs(type("C", (), {"compilation_config": type("CC", (), {"cudagraph_mode": "FULL"})()})())


@pytest.mark.sm90
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (the CUDA side never ran on one)")
def test_cuda_plugin_dense_matches_vllm_triton_on_gpu(tmp_path):
    """On a GPU: the plug-in (dense) through kvsieve's Triton kernels gives vLLM's own greedy tokens."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from kvsieve.eval.model import smollm2_gguf_path
    from kvsieve.integrations.vllm.convert import converted_checkpoint

    script = Path(__file__).with_name("run_engine.py")
    model = converted_checkpoint(smollm2_gguf_path())
    tokens = []
    for extra in ({}, {"KVSIEVE_SELECTOR": "dense"}):
        out = tmp_path / f"out{len(tokens)}.json"
        subprocess.run([sys.executable, str(script), str(model), str(out), "--dtype", "float32", "--prompt-tokens",
                        "300", "--attention-backend", "TRITON_ATTN"], env={**os.environ, **extra}, check=True,
                       timeout=900)
        tokens.append(json.loads(out.read_text())["tokens"])
    assert tokens[0] == tokens[1]


def _decode_step_on_vllm_cache(dtype: torch.dtype, kv_lens: list[int], block_size: int, hkv: int, d: int,
                               translations: tuple[str, ...] = ("block_lists",)):
    """A decode step of ``len(kv_lens)`` requests whose K/V vLLM's own op wrote into a CPU cache
    (blocks scattered): the cache, the prepared step (with ``translations``) and the view."""
    import numpy as np
    from vllm import _custom_ops as ops

    from kvsieve.integrations.vllm.layouts import kv_views
    from kvsieve.integrations.vllm.step import StepTranslator, VllmStep
    from kvsieve.metadata.foreign_paged import ForeignKVSpec, ForeignPagedKV

    gen = torch.Generator().manual_seed(1)
    num_blocks, width = 24, 8
    cache = torch.zeros(num_blocks, hkv, block_size, 2 * d, dtype=dtype)
    key_cache, value_cache = cache.view(num_blocks, hkv, 2 * block_size, d).chunk(2, dim=2)
    perm = torch.randperm(num_blocks, generator=gen).numpy().astype(np.int32)
    table = perm[: len(kv_lens) * width].reshape(len(kv_lens), width)
    for r, n in enumerate(kv_lens):
        pos = np.arange(n)
        slots = torch.from_numpy(table[r, pos // block_size].astype(np.int64) * block_size + pos % block_size)
        k, v = (torch.randn(n, hkv, d, generator=gen).to(dtype) for _ in range(2))
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, "vec")
    spec = ForeignKVSpec(num_layers=1, num_blocks=num_blocks, tokens_per_block=block_size, num_kv_heads=hkv,
                         head_dim=d, dtype=dtype, device=torch.device("cpu"), layout="vllm-cpu", max_requests=8,
                         max_blocks_per_seq=width)
    view = ForeignPagedKV(spec)
    tr = StepTranslator(view, max_num_tokens=16, translations=translations)
    view.bind_layer(0, cache, *kv_views("vllm-cpu", cache))
    qsl = np.arange(len(kv_lens) + 1, dtype=np.int32)
    lens = np.asarray(kv_lens, dtype=np.int32)
    return cache, tr.prepare(VllmStep(qsl, lens, table, prompt_lens=lens - 1)), view


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_selection_runs_vllm_kernel_on_per_head_block_tables(dtype):
    """A selection of whole vLLM blocks (rows of different lengths, a head that skips its request's
    partial newest block) through vLLM's own paged kernel on per-(row, KV head) block tables equals
    kvsieve's Vanilla golden on the same selection, read from the same cache in place; so do the
    selections vLLM's kernel does not take, through kvsieve's native kernel on runs."""
    from types import SimpleNamespace

    from kvsieve.integrations.vllm.cpu import VllmHostAttention
    from kvsieve.integrations.vllm.host import native_runs_attention, per_head_block_tables, token_runs
    from kvsieve.sparse import AttentionGeometry, SparseRuntimeParams
    from kvsieve.sparse.backends import VanillaBackend

    bs, hkv, g, d = 32, 2, 3, 64
    kv_lens = [100, 64, 33]
    cache, prepared, view = _decode_step_on_vllm_cache(dtype, kv_lens, bs, hkv, d)
    # [T, Hkv, k] block ids, -1 = none: 4 blocks / 2 / 2 per request
    topk = torch.tensor([[[0, 3, -1], [1, 2, 3]], [[1, -1, -1], [0, 1, -1]], [[0, -1, -1], [1, 0, -1]]])
    params = SparseRuntimeParams.from_topk(topk, block_size=bs)
    q = torch.randn(3, hkv * g, d, generator=torch.Generator().manual_seed(2)).to(dtype)
    md = prepared.metadata
    tables = per_head_block_tables(params, md, view)
    assert tables.seq_lens.tolist() == [bs + 4, 2 * bs + 4, bs, 2 * bs, bs, bs + 1]  # newest block: 4 of 32
    host = VllmHostAttention(SimpleNamespace(scale=d ** -0.5), SimpleNamespace(isa="vec", _k_scale_float=1.0,
                             _v_scale_float=1.0), None, None, None, cache, None)
    out = host.paged_per_head(q.reshape(-1, g, d), tables).view(3, hkv * g, d)
    geometry = AttentionGeometry(kind="gqa", num_q_heads=hkv * g, num_kv_heads=hkv, head_dim=d, sm_scale=d ** -0.5)
    ref = VanillaBackend().forward(q, md, 0, geometry, params).out
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    # not whole vLLM blocks, or a (row, KV head) that selects nothing: not vLLM's kernel but kvsieve's
    # native one on runs of the same cache
    empty = topk.clone()
    empty[1, 0] = -1
    for other in (SparseRuntimeParams.from_topk(topk, block_size=bs // 2),
                  SparseRuntimeParams.from_topk(empty, block_size=bs)):
        assert per_head_block_tables(other, md, view) is None
        runs = token_runs(other, md, view)
        got = native_runs_attention(q, runs, view, 0, geometry)
        want = VanillaBackend().forward(q, md, 0, geometry, other).out
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert runs.attended[1, 0] == 0 and not bool(got[1, :g].any())  # selects nothing: out 0


class _NoBackend:
    """Stands in for kvsieve's backend where a layer call must not reach it."""

    name = "none"

    def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003
        raise AssertionError("the layer call went to kvsieve's backend")


@pytest.mark.parametrize("spec", ["oracle_topk:budget=40", "streaming:budget=48,num_sink=4",
                                  "oracle_topk:budget=64,block_size=16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_selection_runs_native_kernel_on_vllm_cache(dtype, spec):
    """Decode rows whose selection is not whole vLLM blocks (tokens; pages of 16 in 32-token blocks):
    per-(row, KV head) runs read in place from a cache vLLM's own op wrote (blocks scattered, GQA,
    three requests of different lengths) by kvsieve's native kernel (path ``native_runs``, never the
    backend); equal to the kvsieve backend's gather path and to the Vanilla golden on the same
    selection, reading exactly the selected positions."""
    from types import SimpleNamespace

    from kvsieve.integrations.vllm.config import PluginConfig, parse_selector_spec
    from kvsieve.integrations.vllm.cpu import VllmHostAttention
    from kvsieve.integrations.vllm.layer import LayerRunner
    from kvsieve.integrations.vllm.startup import lower_plans
    from kvsieve.sparse import AttentionGeometry, get_backend
    from kvsieve.sparse.backends import VanillaBackend

    bs, hkv, g, d = 32, 2, 3, 64
    kv_lens = [150, 64, 97]
    cache, prepared, view = _decode_step_on_vllm_cache(dtype, kv_lens, bs, hkv, d,
                                                 translations=("block_lists", "ragged_page_table"))
    md = prepared.metadata
    geometry = AttentionGeometry(kind="gqa", num_q_heads=hkv * g, num_kv_heads=hkv, head_dim=d, sm_scale=d ** -0.5)
    plan = lower_plans(PluginConfig(sparse=parse_selector_spec(spec)), num_layers=1, backend_name="torch")[0]
    runner = LayerRunner(layer_idx=0, geometry=geometry, plan=plan, backend=get_backend("torch"))
    runner.backend = _NoBackend()
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(3, h, d, generator=gen).to(dtype) for h in (hkv * g, hkv, hkv))
    host = VllmHostAttention(SimpleNamespace(scale=d ** -0.5), SimpleNamespace(isa="vec", _k_scale_float=1.0,
                             _v_scale_float=1.0), q, k, v, cache, None)
    res = runner.forward(q, k, v, prepared, host)
    assert res.paths == {"generation": "native_runs"}
    params = runner.select(q, k, v, md)  # the same selection (the selector is deterministic)
    ref = VanillaBackend().forward(q, md, 0, geometry, params)
    gathered = get_backend("torch").forward(q, md, 0, geometry, params)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(res.out.float(), ref.out.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(res.out.float(), gathered.out.float(), atol=tol, rtol=tol)
    assert torch.equal(res.attended, VanillaBackend().effective_attended_tokens(params, md, geometry).to(torch.int64))
    assert torch.equal(res.attended, gathered.attended.to(torch.int64))
    assert int(res.attended.sum()) < sum(kv_lens) * hkv  # it skips: fewer positions than the dense step

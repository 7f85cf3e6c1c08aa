"""Backends declare what they compute (BackendCapabilities); an impossible layer/selector/backend
combination is refused when the plan is set or the Engine is built, before any step, and a
refused plan leaves the layer as it was. A sliding window is applied by the layer for every core
backend: each one alone on a windowed layer equals plain attention under an independent window mask."""
from __future__ import annotations

import pytest
import torch

from kvsieve import Engine, KVCacheManager, KVCacheSpec, SparseAttention, SparseAttentionConfig, lower_config
from kvsieve.integrations.transformers.attention_features import LayerFeatures
from kvsieve.integrations.transformers.feature_backend import FeatureBackend
from kvsieve.sparse.backends import BackendCapabilities, VanillaBackend, available_backends, get_backend
from kvsieve.sparse.backends.triton_backend import TritonBackend
from kvsieve.sparse.backends.vanilla import masked_attention

CORE = ("vanilla", "torch", "triton", "sdpa")


def _spec(**kw) -> KVCacheSpec:
    return KVCacheSpec(num_layers=1, num_blocks=16, tokens_per_block=16, num_kv_heads=2, head_dim=16, max_requests=2,
                       max_blocks_per_seq=8, **kw)


def test_every_built_in_backend_declares_its_capabilities():
    for name in ("vanilla", "torch", "triton", "cute", "sdpa"):
        assert name in available_backends()
        caps = get_backend(name).capabilities
        assert isinstance(caps, BackendCapabilities)
        assert caps.attention_kinds and caps.devices and caps.dtypes
    assert get_backend("cute").capabilities.devices == {"cuda"}
    assert get_backend("torch").capabilities.skip_softmax_devices == {"cpu"}


def test_a_backend_without_skip_softmax_is_refused_when_the_plan_is_set_and_the_layer_keeps_its_plan():
    class NoSkip(VanillaBackend):
        name = "vanilla_no_skip"
        capabilities = BackendCapabilities()

    dense_plan = lower_config(SparseAttentionConfig("streaming", {"budget": 8}), num_layers=1)[0]
    layer = SparseAttention(layer_idx=0, num_q_heads=4, num_kv_heads=2, head_dim=16, plan=dense_plan,
                            backend=NoSkip())
    skip = lower_config(SparseAttentionConfig("skip_softmax", {"threshold_scale_factor_generation": 1.0}),
                        num_layers=1)[0]
    with pytest.raises(ValueError, match="layer 0: backend 'vanilla_no_skip' does not run skip-softmax thresholds"):
        layer.plan = skip
    assert layer.plan is dense_plan
    with pytest.raises(ValueError, match="does not run skip-softmax"):
        SparseAttention(layer_idx=0, num_q_heads=4, num_kv_heads=2, head_dim=16, plan=skip, backend=NoSkip())


def test_skip_softmax_on_a_cuda_cache_is_refused_for_the_cpu_tile_walk():
    skip = lower_config(SparseAttentionConfig("skip_softmax", {"threshold_scale_factor_generation": 1.0}),
                        num_layers=1)[0]
    for backend in ("vanilla", "torch"):
        layer = SparseAttention(layer_idx=0, num_q_heads=4, num_kv_heads=2, head_dim=16, plan=skip, backend=backend)
        with pytest.raises(ValueError, match=rf"backend '{backend}' runs skip-softmax thresholds only on \['cpu'\], "
                                             "not on 'cuda'"):
            layer.check_backend(skip, device="cuda")
        layer.check_backend(skip, device="cpu")  # the CPU walk is fine


def test_the_engine_refuses_a_backend_for_the_cache_device_before_any_step(monkeypatch):
    cache = KVCacheManager(_spec())
    cute = SparseAttention(layer_idx=0, num_q_heads=4, num_kv_heads=2, head_dim=16, backend="cute")
    with pytest.raises(ValueError, match=r"layer 0: backend 'cute' does not support device 'cpu'; supported: \['cuda'\]"):
        Engine(cache, [cute], max_num_requests=2, max_num_tokens=64)
    monkeypatch.delenv("TRITON_INTERPRET")  # without the interpreter the Triton kernels need CUDA tensors
    triton = SparseAttention(layer_idx=0, num_q_heads=4, num_kv_heads=2, head_dim=16, backend=TritonBackend())
    with pytest.raises(ValueError, match="backend 'triton' does not support device 'cpu'"):
        Engine(cache, [triton], max_num_requests=2, max_num_tokens=64)


def test_lower_config_refuses_an_impossible_backend():
    cfg = SparseAttentionConfig("skip_softmax", {"threshold_scale_factor_generation": 1.0})
    with pytest.raises(ValueError, match="backend 'torch' runs skip-softmax thresholds only on"):
        lower_config(cfg, num_layers=1, device="cuda", backend="torch")
    with pytest.raises(ValueError, match="backend 'cute' does not support device 'cpu'"):
        lower_config(SparseAttentionConfig("quest"), num_layers=1, backend="cute")
    assert lower_config(cfg, num_layers=1, backend="torch")[0] is not None


def test_the_feature_backend_declares_gqa_sinks_window_and_softcap_only_over_plain_pytorch():
    feats = [LayerFeatures(layer_type="full_attention", window=None, softcap=None, sinks=None, scaling=0.25)]
    fb = FeatureBackend(get_backend("torch"), feats, dense_fast_path=False)
    assert fb.capabilities.attention_kinds == {"gqa"} and fb.capabilities.sinks and fb.capabilities.window
    assert fb.capabilities.softcap
    assert not FeatureBackend(get_backend("triton"), feats, dense_fast_path=False).capabilities.softcap
    with pytest.raises(ValueError, match="layer 0: backend 'torch' does not support attention kind 'mla'"):
        SparseAttention(layer_idx=0, num_q_heads=4, num_kv_heads=1, head_dim=80, kind="mla", kv_lora_rank=64,
                        backend=fb)


def test_softcap_is_decided_by_the_declared_capability_and_a_backend_without_it_is_refused_by_name():
    feats = [LayerFeatures(layer_type="full_attention", window=None, softcap=30.0, sinks=None, scaling=0.25)]

    class Declares(VanillaBackend):
        name = "vanilla_declares_softcap"
        capabilities = BackendCapabilities(torch_softcap=True)

    class Undeclared(VanillaBackend):
        name = "vanilla_without_softcap"
        capabilities = BackendCapabilities()

    assert FeatureBackend(Declares(), feats, dense_fast_path=False).capabilities.softcap
    with pytest.raises(ValueError, match=r"backend 'vanilla_without_softcap' cannot apply attention logit "
                                         r"soft-capping \(attn_logit_softcapping=30.0\): its capabilities do not "
                                         "declare torch_softcap"):
        FeatureBackend(Undeclared(), feats, dense_fast_path=False)
    # the built-ins, by what each declares: the plain-PyTorch ones yes, the kernel and SDPA ones no
    assert {name for name in ("vanilla", "torch", "triton", "cute", "sdpa")
            if get_backend(name).capabilities.torch_softcap} == {"vanilla", "torch"}
    for name in ("triton", "sdpa"):
        with pytest.raises(ValueError, match=f"backend '{name}' cannot apply attention logit soft-capping"):
            FeatureBackend(get_backend(name), feats, dense_fast_path=False)
    assert FeatureBackend(get_backend("torch"), feats, dense_fast_path=False).capabilities.softcap


@pytest.mark.parametrize("backend", CORE)
@pytest.mark.parametrize("selector", [None, "oracle_topk"])
def test_a_core_backend_alone_on_a_windowed_layer_equals_attention_inside_the_window(backend, selector):
    window, prompt, hq, hkv, d = 24, 70, 4, 2, 16
    plan = None if selector is None else lower_config(SparseAttentionConfig(selector, {"budget": 16}),
                                                      num_layers=1, layer_windows=[window])[0]
    layer = SparseAttention(layer_idx=0, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, plan=plan, backend=backend,
                            window=window)
    eng = Engine(KVCacheManager(_spec()), [layer], max_num_requests=2, max_num_tokens=128)
    g = torch.Generator().manual_seed(3)
    keys, values = torch.empty(0, hkv, d), torch.empty(0, hkv, d)
    for n in (prompt, 1, 1):
        q, k, v = torch.randn(n, hq, d, generator=g), torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
        keys, values = torch.cat([keys, k]), torch.cat([values, v])
        (res,) = eng.step([0], [n], 1 if n == prompt else 0, [(q, k, v)])
        length = keys.shape[0]
        qpos = torch.arange(length - n, length).view(-1, 1)
        kpos = torch.arange(length).view(1, -1)
        mask = (kpos <= qpos) & (kpos > qpos - window)  # causal, inside the window: [n, L]
        if res.params is not None and res.params.selects_positions("generation" if n == 1 else "context"):
            chosen = torch.zeros(hkv, n, length, dtype=torch.bool)
            off, idx = res.params.sparse_attn_offsets, res.params.sparse_attn_indices
            for t in range(n):
                for h in range(hkv):
                    sel = idx[h, int(off[t]): int(off[t + 1])]
                    chosen[h, t, sel[sel >= 0].long()] = True
            full = mask.unsqueeze(0) & chosen
        else:
            full = mask.unsqueeze(0).expand(hkv, n, length)
        ref, _ = masked_attention(q, keys, values, full, 1.0 / d ** 0.5)
        torch.testing.assert_close(res.out.float(), ref, rtol=2e-5, atol=2e-5)
        if backend != "triton":  # exact tokens (triton counts whole pages)
            assert int(res.stats.attended) <= n * hkv * window

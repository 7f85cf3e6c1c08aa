"""DSAConfig.rope_theta is honoured: the default RoPE tables come from it, and projections made for
another theta are refused naming it."""
from __future__ import annotations

import pytest
import torch

from kvsieve.selectors.dsa.projections import IndexerInputs, IndexerProjections, apply_rope, rope_cos_sin

from .rig import make_rig

GEOM = dict(n_heads=2, head_dim=8, rope_dim=4, index_topk=3, index_k_dtype="float32", topk_engine="torch")


def _projections(theta: float, seed: int = 0) -> IndexerProjections:
    torch.manual_seed(seed)
    return IndexerProjections(16, 2, 8, 4, rope_theta=theta)


def test_projections_of_another_theta_are_refused():
    rig = make_rig("dsa", {**GEOM, "rope_theta": 500.0}, num_layers=1)
    with pytest.raises(ValueError, match=r"rope_theta=10000.0; the config has .* 500.0"):
        rig.engine.layers[0].plan.selector.set_projections({0: _projections(10000.0)})


@pytest.mark.parametrize("theta", [500.0, 10000.0])
def test_index_keys_use_the_configured_theta(theta):
    """The selection from hidden states equals the one from index tensors rotated by hand with
    ``theta``; with theta 500 vs 10000 the positions rotate differently, so a wrong theta shows."""
    proj = _projections(theta)
    hidden_rig = make_rig("dsa", {**GEOM, "rope_theta": theta}, num_layers=1)
    finished_rig = make_rig("dsa", {**GEOM, "rope_theta": theta}, num_layers=1)
    hidden_rig.engine.layers[0].plan.selector.set_projections({0: proj})
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(24, 16, generator=gen)
    with torch.no_grad():
        q = proj.wq(hidden).view(24, 2, 8)
        k = proj.k_norm(proj.wk(hidden))
        w = proj.weights_proj(hidden) * (8 ** -0.5 * 2 ** -0.5)
        cos, sin = rope_cos_sin(torch.arange(24), 4, theta)
        q = torch.cat([apply_rope(q[..., :4], cos, sin, False), q[..., 4:]], -1)
        k = torch.cat([apply_rope(k[..., :4], cos, sin, False), k[..., 4:]], -1)
    inputs = hidden_rig.inputs(24, seed=4)
    (got_res,) = hidden_rig.engine.step([1], [24], 1, inputs, [IndexerInputs(hidden=hidden)])
    (want_res,) = finished_rig.engine.step([1], [24], 1, inputs, [IndexerInputs(q_index=q, k_index=k, weights=w)])
    got, want = got_res.out, want_res.out
    p_got, p_want = got_res.params, want_res.params
    assert torch.equal(p_got.sparse_attn_indices, p_want.sparse_attn_indices)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("interleave", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("rope_dim", [0, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_forward_equals_queries_and_keys(rope_dim, interleave, dtype):
    """``forward`` (one buffer and one in-place RoPE for q and k, what a decode step runs) gives
    :meth:`queries`' and :meth:`keys`' values bit for bit, with the default RoPE and given cos/sin, with
    or without autograd recording."""
    torch.manual_seed(1)
    proj = IndexerProjections(16, 2, 8, rope_dim, rope_theta=500.0, rope_interleave=interleave)
    hidden, pos = torch.randn(5, 16).to(dtype), torch.arange(40, 45)
    tables = [(None, None)]
    if rope_dim:
        tables.append(rope_cos_sin(pos * 3, rope_dim, 77.0))
    for cos, sin in tables:
        for grad in (False, True):
            with torch.set_grad_enabled(grad):
                q, k, w = proj(hidden, pos, cos=cos, sin=sin)
                q2, w2 = proj.queries(hidden, pos, cos=cos, sin=sin)
                k2 = proj.keys(hidden, pos, cos=cos, sin=sin)
            assert q.shape == (5, 2, 8) and k.shape == (5, 8) and w.shape == (5, 2)
            assert torch.equal(q, q2) and torch.equal(k, k2) and torch.equal(w, w2)
            with torch.no_grad():  # one matmul of the stacked weights: the same up to its rounding
                for got, want in zip(proj(hidden, pos, cos=cos, sin=sin, stacked=proj.stacked_weight()), (q, k, w)):
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_stacked_weight_only_where_the_queries_read_the_hidden_state():
    proj = IndexerProjections(16, 2, 8, 4, q_input_size=12)
    assert proj.stacked_weight() is None
    assert IndexerProjections(16, 2, 8, 4).stacked_weight().shape == (2 * 8 + 2 + 8, 16)


def test_stacked_weight_is_refused_with_q_input_or_another_shape():
    """``stacked`` cannot apply to queries of another input, nor be another layer's: an error, not a
    silent fallback to three matmuls."""
    proj = IndexerProjections(16, 2, 8, 4)
    hidden, pos = torch.randn(3, 16), torch.arange(3)
    with torch.no_grad(), pytest.raises(ValueError, match=r"comes without q_input; got \(26, 16\) with q_input"):
        proj(hidden, pos, q_input=hidden, stacked=proj.stacked_weight())
    with torch.no_grad(), pytest.raises(ValueError, match=r"stacked must be \[26, 16\].*got \(26, 12\)"):
        proj(hidden, pos, stacked=torch.zeros(26, 12))

"""The ``dsa`` selector against the reference DSA of ``transformers`` (DeepseekV32).

A tiny random DeepSeek-V3.2 runs eagerly (its indexer's top-k folded into the attention mask);
hooks capture each layer's indexer inputs, top-k and attention output. kvsieve's selector gets
the same hidden states, low-rank query and RoPE tables through ``IndexerInputs`` with the HF
indexer weights copied into ``IndexerProjections``; its selection must equal HF's top-k set
(rows longer than ``index_topk``; shorter rows select everything), and absorbed-MLA attention
through kvsieve's paged latent cache over that selection must match HF's attention output.
"""
from __future__ import annotations

import pytest
import torch

from kvsieve import Engine, KVCacheManager, KVCacheSpec, SparseAttention, SparseAttentionConfig, lower_config
from kvsieve.selectors import IndexerInputs
from kvsieve.selectors.dsa.projections import IndexerProjections

dsv32 = pytest.importorskip("transformers.models.deepseek_v32",
                            reason="transformers has no DeepseekV32 (needs transformers >= 5.x)")

TOPK, SEQ = 24, 80


def _tiny_model():
    cfg = dsv32.DeepseekV32Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, index_topk=TOPK, index_n_heads=4, index_head_dim=32,
        max_position_embeddings=512, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return dsv32.DeepseekV32ForCausalLM(cfg).eval()


def _capture(model, ids):
    rec = {}

    def indexer_hook(i):
        def hook(mod, args, kwargs, out):
            hidden, q_resid, (cos, sin) = args[0], args[1], args[2]
            rec.setdefault(i, {}).update(hidden=hidden[0], q_resid=q_resid[0], cos=cos[0], sin=sin[0], topk=out[0])
        return hook

    def attn_hook(i):
        def hook(mod, args, kwargs, out):
            rec[i]["attn_out"] = out[0][0]
        return hook

    handles = []
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.self_attn.indexer.register_forward_hook(indexer_hook(i), with_kwargs=True))
        handles.append(layer.self_attn.register_forward_hook(attn_hook(i), with_kwargs=True))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for h in handles:
        h.remove()
    return rec


def _projections(indexer, cfg) -> IndexerProjections:
    p = IndexerProjections(cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim,
                           q_input_size=cfg.q_lora_rank)
    p.wq.weight.data.copy_(indexer.wq_b.weight)
    p.wk.weight.data.copy_(indexer.wk.weight)
    p.k_norm.load_state_dict(indexer.k_norm.state_dict())
    p.weights_proj.weight.data.copy_(indexer.weights_proj.weight)
    return p


def _hf_index_scores(indexer, r) -> torch.Tensor:
    """fp32 ``[T, T]`` causal index scores, recomputed from the HF indexer's modules."""
    t, rd = r["hidden"].shape[0], indexer.qk_rope_head_dim
    q = indexer.wq_b(r["q_resid"]).view(t, indexer.n_heads, indexer.head_dim)
    k = indexer.k_norm(indexer.wk(r["hidden"]))
    q_rot, k_rot = dsv32.modeling_deepseek_v32.apply_rotary_pos_emb(
        q[..., :rd], k[:, None, :rd], r["cos"], r["sin"], unsqueeze_dim=1)
    q = torch.cat([q_rot, q[..., rd:]], -1)
    k = torch.cat([k_rot[:, 0], k[:, rd:]], -1)
    w = indexer.weights_proj(r["hidden"]) * indexer.n_heads ** -0.5
    s = torch.einsum("thd,sd->ths", q, k).mul(indexer.softmax_scale).relu()
    scores = torch.einsum("th,ths->ts", w, s)
    return scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))


def _assert_same_topk(ours: set[int], hf: set[int], scores: torch.Tensor, where: str) -> bool:
    """Equal sets, except entries tied (to 1e-6 relative) with the k-th largest score; returns
    whether the sets are identical."""
    assert len(ours) == len(hf), where
    if ours == hf:
        return True
    kth = scores[sorted(hf)].min()
    diff = torch.tensor(sorted(ours ^ hf))
    tol = 1e-6 * max(1.0, float(kth.abs()))
    assert bool(((scores[diff] - kth).abs() <= tol).all()), f"{where}: sets differ by {diff.tolist()} beyond ties"
    return False


def _mla_inputs(attn, hidden, cos, sin):
    """Absorbed-MLA q ``[T, H, R + P]`` and latent ``[T, R + P]`` of an HF DeepseekV32Attention."""
    t = hidden.shape[0]
    h, nope, r = attn.num_heads, attn.qk_nope_head_dim, attn.kv_lora_rank
    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hidden))).view(t, h, -1)
    q_pass, q_rot = q.split([nope, attn.qk_rope_head_dim], -1)
    kv_pass, k_rot = attn.kv_a_proj_with_mqa(hidden).split([r, attn.qk_rope_head_dim], -1)
    q_rot, k_rot = dsv32.modeling_deepseek_v32.apply_rotary_pos_emb_interleave(
        q_rot.transpose(0, 1), k_rot.unsqueeze(0), cos.unsqueeze(0), sin.unsqueeze(0))
    w_kv = attn.kv_b_proj.weight.view(h, nope + attn.v_head_dim, r)
    q_abs = torch.einsum("thn,hnr->thr", q_pass, w_kv[:, :nope])
    q_mla = torch.cat([q_abs, q_rot[0].transpose(0, 1)], -1)  # q_rot came back [1, H, T, P]
    latent = torch.cat([attn.kv_a_layernorm(kv_pass), k_rot.reshape(t, -1)], -1)
    return q_mla, latent, w_kv[:, nope:]


@pytest.mark.parametrize("topk_engine,logits_kernel", [("torch", "reference"), ("radix", "triton")])
def test_selection_and_attention_match_transformers(topk_engine, logits_kernel):
    model = _tiny_model()
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(1))
    rec = _capture(model, ids)
    lat_dim = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    spec = KVCacheSpec(num_layers=cfg.num_hidden_layers, num_blocks=32, tokens_per_block=16, kind="mla",
                       kv_lora_rank=cfg.kv_lora_rank, rope_dim=cfg.qk_rope_head_dim, max_requests=1,
                       max_blocks_per_seq=16)
    cache = KVCacheManager(spec)
    dsa_cfg = dict(index_topk=TOPK, n_heads=cfg.index_n_heads, head_dim=cfg.index_head_dim,
                   rope_dim=cfg.qk_rope_head_dim, index_k_dtype="float32", topk_engine=topk_engine,
                   logits_kernel=logits_kernel)
    plans = lower_config(SparseAttentionConfig("dsa", dsa_cfg), num_layers=cfg.num_hidden_layers,
                         attention_kind="mla")
    selector = plans[0].selector
    layers = []
    for i, plan in enumerate(plans):
        attn = model.model.layers[i].self_attn
        selector.set_projections({i: _projections(attn.indexer, cfg)})
        layers.append(SparseAttention(layer_idx=i, num_q_heads=cfg.num_attention_heads, num_kv_heads=1,
                                      head_dim=lat_dim, plan=plan, kind="mla", kv_lora_rank=cfg.kv_lora_rank,
                                      sm_scale=attn.scaling))
    engine = Engine(cache, layers, max_num_requests=1, max_num_tokens=SEQ)
    md = engine.begin_step([0], [SEQ], num_contexts=1)
    with torch.no_grad():
        for i, layer in enumerate(layers):
            r = rec[i]
            attn = model.model.layers[i].self_attn
            q_mla, latent, w_uv = _mla_inputs(attn, r["hidden"], r["cos"], r["sin"])
            res = layer.forward(q_mla, latent, None, md, model_inputs=IndexerInputs(
                hidden=r["hidden"], q_input=r["q_resid"], cos=r["cos"], sin=r["sin"]))
            out_lat, _ = res.out, res.lse
            out = attn.o_proj(torch.einsum("thr,hvr->thv", out_lat, w_uv).reshape(SEQ, -1))
            params = res.params
            idx, off = params.sparse_attn_indices[0], params.sparse_attn_offsets
            scores = _hf_index_scores(attn.indexer, r)
            same = torch.tensor([_assert_same_topk({int(x) for x in idx[off[t]:off[t + 1]] if x >= 0},
                                                   {int(x) for x in r["topk"][t] if x <= t}, scores[t],
                                                   f"layer {i} row {t}") for t in range(SEQ)])
            assert int(same.sum()) >= SEQ // 2  # ties: scores exactly 0 when every head is ReLU-d away
            # rows whose tie was broken differently attend different tokens: compare the others
            torch.testing.assert_close(out[same], r["attn_out"][same], atol=2e-5, rtol=1e-4)
    engine.end_step()
    assert selector.stats.indexed_steps == cfg.num_hidden_layers
    assert selector.topk_engine == topk_engine

"""Blocks the KV ledger holds, measured with the ledger alone (no model, no attention).

* **Prefix sharing**: ``N`` requests whose prompts start with one system prompt, each with its own
  user turn, added one after another; with sharing each is added with its token ids
  (``KVCacheManager.add_request(tokens=)``: the cached system-prompt blocks are reused, only the rest
  is appended) and its full blocks are named after its prefill (``cache_full_blocks``, as
  ``Engine.end_step`` does); without, each appends its whole prompt into private blocks.
* **Prefix caching through the session**: ``N`` prompts sharing one system prompt, one after
  another, through ``KvsieveSession.prefill`` (a tiny random Llama: the counts do not depend on the
  weights) with and without ``prefix_caching``: positions the model ran, blocks the live request
  holds and blocks it took from the cache by reference.
* **Window release**: one Gemma 3 270M request (18 layers: 15 sliding-window layers with a
  512-position window, 3 full-attention layers; 1 KV head of 256, bf16) prefilled to ``L`` positions
  in chunks, then decoding; two cache groups as ``KvsieveSession`` builds them. With release the
  windowed group drops the blocks wholly before ``valid + 1 - window`` after every step
  (``KVCacheManager.release_before``, the call ``Engine.end_step`` makes); without, it keeps all.
  Bytes = blocks x layers of the group x K and V x tokens per block x head dim x 2 bytes.

``python -m benchmarks.ledger_memory`` prints the Markdown tables of docs/results/memory.md.
"""
from __future__ import annotations

import argparse
import random

import torch

from kvsieve.metadata import KVCacheManager, KVCacheSpec

__all__ = ["prefix_sharing", "session_prefix", "window_release", "main"]

GEMMA3_270M = dict(num_layers=18, window=512, full_layers=(5, 11, 17), num_kv_heads=1, head_dim=256, dtype_bytes=2)


def _ledger(num_blocks: int, max_requests: int, max_blocks_per_seq: int, tpb: int,
            layers: tuple[int, ...] | None = None, num_layers: int = 1) -> KVCacheManager:
    """A ledger whose pools are tiny (1 head of width 1): only the block counts matter here."""
    return KVCacheManager(KVCacheSpec(num_layers=num_layers, num_blocks=num_blocks, tokens_per_block=tpb,
                                      num_kv_heads=1, head_dim=1, max_requests=max_requests,
                                      max_blocks_per_seq=max_blocks_per_seq, layers=layers))


def prefix_sharing(n_requests: int, system_len: int, user_len: tuple[int, int], tpb: int = 16,
                   seed: int = 0) -> dict[str, object]:
    """Blocks held by ``n_requests`` live requests with and without prefix sharing (``private``,
    ``shared``), the prompt tokens found cached (``reused_tokens``) and the prompts' lengths."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 32000) for _ in range(system_len)]
    prompts = [system + [rng.randrange(1, 32000) for _ in range(rng.randint(*user_len))] for _ in range(n_requests)]
    per_seq = -(-(system_len + user_len[1]) // tpb)
    held = {}
    for share in (False, True):
        m = _ledger(n_requests * per_seq + 1, n_requests, per_seq, tpb)
        reused = 0
        for rid, prompt in enumerate(prompts):
            if share:
                m.add_request(rid, tokens=prompt)
                n = m.valid_len(rid)
                reused += n
                m.append_tokens(rid, len(prompt) - n, tokens=prompt[n:])
                m.cache_full_blocks([rid])
            else:
                m.add_request(rid, len(prompt))
        m.allocator.check()
        held["shared" if share else "private"] = m.allocator.num_held
        if share:
            held["reused_tokens"] = reused
    held["prompt_lens"] = [len(p) for p in prompts]
    return held


def session_prefix(n_calls: int, system_len: int, user_len: tuple[int, int], tpb: int = 16,
                   seed: int = 0) -> dict[str, int]:
    """Over ``n_calls`` prefills of prompts sharing a system prompt: positions the model ran
    (``computed_<tag>``), blocks the last live request holds (``held_<tag>``; cached blocks nobody
    holds are not counted) and, with prefix caching, blocks reused from the cache over all calls
    (``reused_blocks``); tag ``plain`` or ``shared``."""
    from kvsieve.eval.model import tiny_random_llama
    from kvsieve.integrations.transformers import KvsieveSession

    rng = random.Random(seed)
    system = [rng.randrange(1, 256) for _ in range(system_len)]
    prompts = [system + [rng.randrange(1, 256) for _ in range(rng.randint(*user_len))] for _ in range(n_calls)]
    model = tiny_random_llama(seed)
    ran: list[int] = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: ran.append(kw["input_ids"].shape[1]), with_kwargs=True)
    out: dict[str, int] = {"prompt_tokens": sum(len(p) for p in prompts), "reused_blocks": 0}
    for share in (False, True):
        ran.clear()
        with KvsieveSession(model, None, max_tokens=system_len + user_len[1], tokens_per_block=tpb,
                            prefix_caching=share) as session:
            for prompt in prompts:
                session.prefill(torch.tensor([prompt]))
                if share:  # the positions the model did not run are whole cached blocks
                    out["reused_blocks"] += (len(prompt) - ran[-1]) // tpb
            tag = "shared" if share else "plain"
            out[f"computed_{tag}"], out[f"held_{tag}"] = sum(ran), session.cache.allocator.num_held
    hook.remove()
    return out


def window_release(length: int, decode: int = 256, chunk: int = 2048, tpb: int = 16,
                   model: dict | None = None) -> dict[str, float]:
    """Blocks (per group) and bytes held by one request after a chunked prefill of ``length`` and
    ``decode`` decode steps, with and without the window release; ``peak_*``: the most held during
    any step (its new tokens appended, before the release at its end)."""
    g = model or GEMMA3_270M
    full = tuple(g["full_layers"])
    windowed = tuple(i for i in range(g["num_layers"]) if i not in full)
    per_seq = -(-(length + decode) // tpb)
    block_bytes = 2 * tpb * g["num_kv_heads"] * g["head_dim"] * g["dtype_bytes"]
    out: dict[str, float] = {}
    for release in (False, True):
        groups = [_ledger(per_seq + 1, 1, per_seq, tpb, layers, g["num_layers"]) for layers in (full, windowed)]
        peak = [0, 0]
        steps = [chunk] * (length // chunk) + ([length % chunk] if length % chunk else []) + [1] * decode
        for i, n in enumerate(steps):
            for gi, m in enumerate(groups):
                if i == 0:
                    m.add_request(0)
                m.append_tokens(0, n)
                peak[gi] = max(peak[gi], m.allocator.num_held)  # during the step: its chunk is held
                if gi == 1 and release:
                    m.release_before(0, m.valid_len(0) + 1 - g["window"])
        tag = "release" if release else "keep"
        held = [m.allocator.num_held for m in groups]
        out[f"full_blocks_{tag}"], out[f"windowed_blocks_{tag}"] = held
        out[f"bytes_{tag}"] = (held[0] * len(full) + held[1] * len(windowed)) * block_bytes
        out[f"peak_bytes_{tag}"] = (peak[0] * len(full) + peak[1] * len(windowed)) * block_bytes
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", type=int, default=2048)
    ap.add_argument("--length", type=int, default=32768)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"### Prefix sharing (system prompt {args.system} tokens, user turns 64-192 tokens, 16 tokens per block)\n")
    print("| requests | prompt tokens | blocks held, private | blocks held, shared | tokens reused | ratio |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in (1, 4, 16, 64, 128):
        r = prefix_sharing(n, args.system, (64, 192))
        print(f"| {n} | {sum(r['prompt_lens'])} | {r['private']} | {r['shared']} | {r['reused_tokens']} | "
              f"{r['private'] / r['shared']:.2f}x |")
    print(f"\n### Prefix caching through KvsieveSession (system prompt {args.system} tokens, user turns 64-192 "
          "tokens, prompts one after another)\n")
    print("| prompts | prompt tokens | positions run, plain | positions run, prefix caching | blocks held (live "
          "request), both | blocks reused |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in (1, 4, 16):
        r = session_prefix(n, args.system, (64, 192))
        assert r["held_plain"] == r["held_shared"]
        print(f"| {n} | {r['prompt_tokens']} | {r['computed_plain']} | {r['computed_shared']} | {r['held_shared']} | "
              f"{r['reused_blocks']} |")
    print("\n### Gemma 3 270M, one request: prefill in 2048-token chunks, then 256 decode steps\n")
    print("| length | full-attn blocks (x3 layers) | windowed blocks (x15), kept | windowed blocks (x15), released "
          "| KV bytes kept | KV bytes released | peak bytes kept | peak bytes released |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for length in (8192, 16384, args.length):
        r = window_release(length)
        mib = 2 ** 20
        print(f"| {length} | {r['full_blocks_keep']:.0f} | {r['windowed_blocks_keep']:.0f} | "
              f"{r['windowed_blocks_release']:.0f} | {r['bytes_keep'] / mib:.1f} MiB | "
              f"{r['bytes_release'] / mib:.1f} MiB | {r['peak_bytes_keep'] / mib:.1f} MiB | "
              f"{r['peak_bytes_release'] / mib:.1f} MiB |")


if __name__ == "__main__":
    main()

"""The native decode-layer call on its own (``kernels/decode_layer``, the vLLM plug-in's one-call decode
path): a model's attention geometry on vLLM's CPU cache layout (K stored by channel), one call per layer
with the layers cycled, so that each call reads its cache cold, as a decode step does.

    python benchmarks/decode_layer_call.py [--geometry smollm2|gemma3] [--dtype bfloat16|float32]
        [--rows 1,8] [--programs indexer-random,indexer-clustered,streaming,pages] [--threads 1]
        [--kv-len N] [--layers N] [--reps 15] [--budget N] [--selections FILE [--selection-prompt filler]]

Programs, each at density 1/16 of ``--kv-len`` (``--budget N``: N positions instead; a small budget
leaves what the selection itself costs, for DSA the index scores and the top-k):

* ``indexer-random``: DSA's program with random index keys. The selection is scattered and touches about
  88% of K's cache lines (32 bf16 tokens of one channel a line).
* ``indexer-clustered``: the same, with 24 runs of 20 positions whose keys point along the index
  query, so that they hold most of the selection. This touches about as many lines as a real DSA
  selection of a served prompt (0.25-0.30: ``benchmarks/dsa_k_lines.py``).
* ``indexer-recorded`` (with ``--selections FILE``): the same, with the keys planted at real selections,
  those ``benchmarks/dsa_k_lines.py --save FILE`` kept from the model and its indexer on a prompt
  (``--selection-prompt``): layer ``l``, row ``r`` takes the recorded layer ``l`` and row ``r`` (cycled),
  at the recorded budget (the served SmolLM2 config's 512). Their runs are short and many (about 200).
* ``streaming``: the first 4 positions and the last ones, in two runs.
* ``pages``: Quest's program on 128-token pages (vLLM's block size).

Prints the CPU's instruction set and the load average, then, per program and row count, the median
and minimum time of one layer call and the positions each (row, KV head) attended.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._timing import cpu_isa, load_average  # noqa: E402
from kvsieve.kernels.decode_layer.native import DecodeLayerCall  # noqa: E402
from kvsieve.kernels.decode_layer.plan import DecodeProgram, IndexerStep  # noqa: E402

BLOCK = 128  # vLLM's CPU block size
INDEX_HEADS, INDEX_DIM = 8, 32  # the served indexers' geometry
PROGRAMS = ("indexer-random", "indexer-clustered", "indexer-recorded", "streaming", "pages")


@dataclass(frozen=True)
class Geometry:
    """A model's attention layers as the plug-in sees them: ``kv_heads`` x ``group`` query heads of
    ``head_dim``, ``layers`` of them, decoding at ``kv_len`` tokens."""

    kv_heads: int
    group: int
    head_dim: int
    layers: int
    kv_len: int


GEOMETRIES = {"smollm2": Geometry(3, 3, 64, 30, 8000), "gemma3": Geometry(1, 4, 256, 6, 16000)}


def _layer(g: Geometry, program: str, rows: int, table: np.ndarray, iq: torch.Tensor, dtype: torch.dtype,
           gen: torch.Generator, recorded: torch.Tensor | None = None,
           budget: int | None = None) -> tuple[torch.Tensor, torch.Tensor, DecodeProgram]:
    """One layer's K/V views ``[blocks, Hkv, BLOCK, D]`` (K by channel) and its program with pools;
    ``recorded [rows', positions]``: the layer's real selections (``indexer-recorded``); ``budget``: the
    positions each (row, KV head) attends (default: 1/16 of the cache; the recorded program's are its own)."""
    blocks = int(table.max()) + 1
    raw = torch.randn(blocks, g.kv_heads, BLOCK, 2 * g.head_dim, generator=gen).to(dtype)
    half = raw.view(blocks, g.kv_heads, 2 * BLOCK, g.head_dim)
    k = half[:, :, :BLOCK].reshape(blocks, g.kv_heads, g.head_dim, BLOCK).transpose(2, 3)
    v = half[:, :, BLOCK:]
    if recorded is not None and budget is not None:
        raise ValueError("indexer-recorded attends its recorded selections' budget; pass no budget with them")
    units = recorded.shape[-1] if recorded is not None else budget if budget is not None else max(1, g.kv_len // 16)
    if program == "streaming":
        return k, v, DecodeProgram("streaming", units=units, num_sink=4)
    if program == "pages":
        pool = torch.randn(blocks, g.kv_heads, 1, 2, g.head_dim, generator=gen).to(dtype)
        return k, v, DecodeProgram("pages", units=-(-units // BLOCK), unit=BLOCK, mode="bound", page_size=BLOCK,
                                   pool=pool)
    keys = torch.randn(blocks, BLOCK, INDEX_DIM, generator=gen)
    if program != "indexer-random":  # small keys, and row r's planted positions along its index query
        keys *= 0.1
        for r in range(rows):
            if program == "indexer-clustered":
                starts = torch.randint(0, g.kv_len - 20, (24,), generator=gen).tolist()
                planted = [p for start in starts for p in range(start, start + 20)]
            else:
                planted = recorded[r % recorded.shape[0]].tolist()
            for p in planted:
                keys[int(table[r, p // BLOCK]), p % BLOCK] = iq[r, 0]
    return k, v, DecodeProgram("indexer", units=units, index_keys=keys.to(torch.bfloat16))


def measure(g: Geometry, program: str, rows: int, dtype: torch.dtype, reps: int, threads: int,
            recorded: torch.Tensor | None = None, budget: int | None = None) -> tuple[float, float, list[int]]:
    """``(median ms, min ms, attended positions of row 0 per KV head)`` of one layer call, over ``reps``
    passes through the layers (after 3 untimed); ``recorded [layers', rows', positions]``: real
    selections for ``indexer-recorded``, layer ``l`` taking ``recorded[l % layers']``; ``budget``: as
    :func:`_layer`'s."""
    gen = torch.Generator().manual_seed(0)
    per = -(-g.kv_len // BLOCK)
    table = (torch.randperm(per * rows, generator=gen).numpy().astype(np.int32) + 1).reshape(rows, per)
    iq = torch.randn(rows, INDEX_HEADS, INDEX_DIM, generator=gen).to(torch.bfloat16).float()
    index = None
    if program.startswith("indexer"):
        index = IndexerStep(iq, torch.rand(rows, INDEX_HEADS, generator=gen) + 0.1,
                            torch.randn(rows, INDEX_DIM, generator=gen))
    calls = []
    for layer in range(g.layers):
        k, v, prog = _layer(g, program, rows, table, iq, dtype, gen,
                            None if program != "indexer-recorded" else recorded[layer % recorded.shape[0]], budget)
        calls.append(DecodeLayerCall(k, v, prog, num_q_heads=g.kv_heads * g.group, sm_scale=g.head_dim ** -0.5,
                                     threads=threads))
    lens = np.full(rows, g.kv_len, dtype=np.int32)
    q = torch.randn(rows, g.kv_heads * g.group, g.head_dim, generator=gen).to(dtype)
    out = torch.empty_like(q)

    def one_pass() -> tuple[float, np.ndarray]:
        spent, attended = 0.0, None
        for call in calls:
            t0 = time.perf_counter()
            attended = call.run(table, lens, q, out, index)
            spent += time.perf_counter() - t0
        return spent / len(calls), attended

    for _ in range(3):
        one_pass()
    times = sorted(one_pass()[0] for _ in range(reps))
    return times[len(times) // 2] * 1e3, times[0] * 1e3, one_pass()[1][0].tolist()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--geometry", default="smollm2", choices=sorted(GEOMETRIES))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--rows", default="1,8", help="decode rows (requests) per call, comma-separated")
    ap.add_argument("--programs", help="comma-separated (default: all; indexer-recorded with --selections)")
    ap.add_argument("--threads", type=int, default=1, help="OpenMP threads of the call")
    ap.add_argument("--kv-len", type=int, help="tokens in the cache (default: the geometry's)")
    ap.add_argument("--layers", type=int, help="layers cycled (default: the geometry's)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--budget", type=int, help="positions each (row, KV head) attends (default: 1/16 of the cache)")
    ap.add_argument("--selections", help="real selections for indexer-recorded (benchmarks/dsa_k_lines.py --save)")
    ap.add_argument("--selection-prompt", help="which prompt's selections of that file (default: filler)")
    args = ap.parse_args(argv)
    g = GEOMETRIES[args.geometry]
    g = Geometry(g.kv_heads, g.group, g.head_dim, args.layers or g.layers, args.kv_len or g.kv_len)
    if g.kv_len < 64:  # the clustered program plants 20-token runs; 1/16 of fewer than 64 is a handful
        ap.error(f"--kv-len {g.kv_len}: at least 64 tokens")
    programs = args.programs.split(",") if args.programs else [
        p for p in PROGRAMS if p != "indexer-recorded" or args.selections]
    unknown = sorted(set(programs) - set(PROGRAMS))
    if unknown:
        ap.error(f"unknown programs {unknown}; choose from {', '.join(PROGRAMS)}")
    recorded = None
    if args.budget is not None and not 1 <= args.budget <= g.kv_len:
        ap.error(f"--budget {args.budget}: between 1 and --kv-len {g.kv_len}")
    if args.budget is not None and "indexer-recorded" in programs:
        ap.error("--budget: indexer-recorded attends its recorded selections' budget")
    if args.budget is not None and "pages" in programs and args.budget % BLOCK:
        ap.error(f"--budget {args.budget}: the pages program keeps whole {BLOCK}-token pages; give a multiple of "
                 f"{BLOCK} or leave pages out of --programs")
    if args.selections and "indexer-recorded" not in programs:
        ap.error("--selections is read by indexer-recorded only; add it to --programs")
    if args.selections:
        prompt = args.selection_prompt or "filler"
        kept = torch.load(args.selections)
        if prompt not in kept:
            ap.error(f"--selection-prompt {prompt!r}: {args.selections} holds {sorted(kept)}")
        recorded = kept[prompt].long()
        if int(recorded.min()) < 0 or int(recorded.max()) >= g.kv_len:
            ap.error(f"{args.selections}: positions {int(recorded.min())}..{int(recorded.max())}, outside "
                     f"[0, --kv-len {g.kv_len})")
    elif "indexer-recorded" in programs or args.selection_prompt:
        ap.error("indexer-recorded and --selection-prompt need --selections FILE")
    torch.set_num_threads(args.threads)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    print(f"CPU {cpu_isa()}; threads {args.threads}; load average {load_average():.2f}")
    print(f"{args.geometry}: {g.kv_heads} KV heads x {g.group}, head dim {g.head_dim}, {g.layers} layers cycled, "
          f"{g.kv_len} tokens, {args.dtype}, " + (f"budget {args.budget}" if args.budget else "density 1/16"))
    print(f"  {'program':<18} {'rows':>4} {'median ms':>10} {'min ms':>8}  attended by row 0's KV heads")
    for program in programs:
        for rows in (int(r) for r in args.rows.split(",")):
            median, low, attended = measure(g, program, rows, dtype, args.reps, args.threads, recorded, args.budget)
            print(f"  {program:<18} {rows:>4} {median:>10.3f} {low:>8.3f}  {attended}")
    print(f"load average after {load_average():.2f}")


if __name__ == "__main__":
    main()

"""kvsieve performance benchmarks (``python -m benchmarks``; not part of the installed package).

``performance.json`` (in ``--out``, default ``bench_out/``; ``docs/results/`` only with ``--update-docs``;
schema_version 2):

* ``meta``: ``command`` (the command line that ran), ``date`` (UTC), torch/python versions,
  ``cpu_count``, ``cpu_capability``, ``torch_threads``, ``load_1m_start``/``load_1m_end`` (1-minute
  load average) and ``loadavg_start``/``loadavg_end`` (``os.getloadavg``: 1, 5, 15 minutes),
  ``wall_s``, ``quick``, ``cuda``.
* ``targets``: list of ``{target, value, met}`` (``met`` is ``None`` when not measured).
* ``prepare``: ``grid`` rows ``{translation, batch, context, page, blocks, library, baseline, speedup,
  baseline_matches, us_per_request, ns_per_block}``; ``target``; ``offsets_scaling`` rows
  ``{batch, context, page, capacity_tokens, max_blocks_per_seq, capped, speculative,
  capped_us_per_request}`` and ``offsets_scaling_summary``.
* ``cpu_attention``: ``config``, ``copy_bandwidth {bytes, timing, gb_per_s, gb_per_s_best}``, ``decode``
  rows ``{context, density, sparse, sdpa_dense, torch_dense, speedup_vs_sdpa, ideal_speedup,
  fraction_of_ideal, gathered_bytes, gathered_gb_per_s, fraction_of_copy_bandwidth,
  max_abs_err_vs_masked_sdpa, ...}``, ``prefill`` rows ``{length, density, sparse, flex, flex_mode,
  sdpa_dense_causal, speedup_vs_sdpa, speedup_vs_flex, max_abs_err_vs_flex, ...}``, ``flex {mode,
  compile_error, compile_s}``, ``target``.
* ``selector_overhead``: ``config``, ``dense_attention``, ``selectors`` rows ``{selector, config,
  selector_step, sparse_attention, attended_fraction, saved_s, overhead_fraction_of_saved}``,
  ``skipped {name: reason}``.
* ``gpu``: ``{"skipped": reason}`` or per kernel script ``{status, wall_s, result}``.

Every timing is ``{median_s, min_s, max_s, q1_s, q3_s, reps, warmup, load_1m}``
(:class:`benchmarks._timing.Timing`).
"""

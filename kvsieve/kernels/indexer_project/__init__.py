"""The DSA lightning indexer's projections of a step's few tokens, on the CPU: the native C kernel
beside its plain-PyTorch twin. A decode step projects one token per row, and as torch ops (a
matmul, a layer norm, a RoPE, casts and copies: some twenty dispatches) the step costs about five
times the matmul's own memory traffic; the kernel does it in one call.

* ``hidden [T, hidden_size]``: the tokens' hidden states, fp32 or bf16, channels contiguous (rows
  any stride); ``T <= MAX_TOKENS`` for the native kernel.
* ``stacked [H * D + H + D, hidden_size]`` fp32 contiguous: ``wq``, ``weights_proj`` and ``wk``
  stacked (:meth:`~kvsieve.selectors.dsa.IndexerProjections.stacked_weight`).
* ``norm_weight``, ``norm_bias [D]`` fp32: the key's LayerNorm (``eps``), or both ``None`` (no norm).
* ``cos``, ``sin [T, rope_dim]`` fp32 (``cat(freqs, freqs)``): the neox RoPE of the first
  ``rope_dim`` channels of every query head and of the key; ``None`` when ``rope_dim == 0``.
* ``w_scale``: the factor of the weights (``D**-0.5 * H**-0.5``).

Returns ``(q [T, H, D], k [T, D], w [T, H])`` fp32: ``q = rope(x @ wq.T)``, ``k = rope(norm(x @
wk.T))``, ``w = (x @ weights_proj.T) * w_scale`` with ``x`` the hidden state in fp32. The kernel
sums in another order than torch's matmul, so the two agree to fp32 rounding, not bit for bit.

``native`` (:func:`~.native.indexer_project_native` and :func:`~.native.supports_native`, the C
kernel behind ctypes; ``NativeUnavailable`` where its library does not build) + ``indexer_project.c``,
``naive`` (the plain twin, the kernel's test reference). The DSA selector projects a CPU step of at most
``MAX_TOKENS`` tokens with the kernel where it takes the inputs, and everything else with
:class:`~kvsieve.selectors.dsa.IndexerProjections` (which computes the same values in torch ops).
"""

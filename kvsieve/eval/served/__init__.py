"""``kvsieve eval --engine vllm``: the sweep's runs through vLLM with the kvsieve plug-in.

Modules: :mod:`.protocol` (what runs where, the engine's fixed settings, what is refused),
:mod:`.launch` (the one launcher of vLLM engine processes, shared with the ``benchmarks/vllm_*``
scripts: environment, model folder, modes), :mod:`.engine` (the sweep's engine processes),
:mod:`.worker` (one engine process, in vLLM's environment), :mod:`.sweep` (running the pending
runs, timing the decode speed-up) and :mod:`.agreement` (the eval's stop rule on tokens generated elsewhere; two sweeps compared prompt by
prompt). Nothing is imported here: :mod:`kvsieve.eval.run_plan` reads :mod:`.protocol` alone.
"""

"""CuTe-DSL gather-attention kernel (SM90 wgmma / SM100 tcgen05), bf16 or FP8 latent rows, shared
by the GQA and MLA CuTe decodes. Kernel modules (``sm90``, ``sm100``, ``tile_ops``) import
``cutlass`` and are loaded lazily; ``host`` imports only torch and kvsieve."""

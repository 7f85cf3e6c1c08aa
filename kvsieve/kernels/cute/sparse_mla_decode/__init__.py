"""CuTe-DSL sparse absorbed-MLA decode (SM90 wgmma / SM100 tcgen05), bf16 or FP8 latent cache."""

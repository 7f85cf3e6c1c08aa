"""DSA lightning-indexer logits: ragged prefill and paged decode, and the FP8 index-key quantizer of
the aux pool. ``plan`` (argument checks, launch table), ``triton`` (the kernel), ``naive`` (its
plain-PyTorch reference), ``quant`` (the power-of-two FP8 quantizer)."""

"""In-place KV-cache compaction after prompt-token eviction (GQA and MLA caches).

``plan`` (argument checks), ``triton`` (the kernel), ``naive`` (its plain-PyTorch reference).
"""

"""Attention of a prompt's query rows over runs of a paged cache on the CPU: ``native`` +
``prompt_runs.c`` (rows in tiles that visit their runs block by block, reading the cache in place),
``naive`` (the plain-PyTorch reference, a masked dense softmax over the whole cache)."""

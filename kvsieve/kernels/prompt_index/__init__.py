"""DSA's selection for many rows at once on the CPU (a prompt's rows above all): the lightning
indexer's scores of each row's causal prefix over the paged pool of index keys and their top-k, in
one call: ``native`` + ``prompt_index.c`` (rows of a request in tiles sharing each loaded tile of keys),
``naive`` (the plain-PyTorch reference: a row at a time, its keys gathered, a stable sort)."""

"""block_select's selection by Quest's bound for many query rows at once on the CPU (a prompt's rows
above all): per row and KV head the group's largest bound of every visible block (the own block from
the row's own summary), the forced blocks, the top-k ascending, in one call: ``native`` +
``block_bound.c`` (summaries channel-major, sixteen blocks' bounds a vector), ``naive`` (the
plain-PyTorch reference: a row and head at a time, a stable sort)."""

/* Min/max key summaries of a list of pages, on the CPU (the op's contract: page_minmax/__init__.py).
 *
 * Page i is the first counts[i] keys from token starts[i] of cache block blocks[i]; for each KV head
 * its element-wise min and max over those keys (fp32 or bf16, read where they lie through their
 * strides) are written to that block's summary rows of sub-page starts[i] / page_size (fp32, or bf16
 * rounded to nearest-even as torch's conversion does). A channel holding a NaN summarizes to NaN in
 * both rows, as torch's amin/amax propagate it.
 * Built with -O3 -march=native -fopenmp-simd -fno-math-errno. */
#include <stdint.h>

#include "page_minmax.h"

/* The exported entry: minmax_pages (page_minmax.h) with its arguments. */
int kvsieve_page_minmax(const void* keys, int keys_bf16, int64_t k_blk, int64_t k_head, int64_t k_tok,
                        int64_t k_ch, int64_t num_blocks, int hkv, int block_size, int D, const int64_t* blocks,
                        const int64_t* starts, const int64_t* counts, int64_t n_pages, int page_size, void* out,
                        int out_bf16, int64_t o_blk, int64_t o_head, int64_t o_sub, int64_t o_max) {
  return minmax_pages(keys, keys_bf16, k_blk, k_head, k_tok, k_ch, num_blocks, hkv, block_size, D, blocks, starts,
                      counts, n_pages, page_size, out, out_bf16, o_blk, o_head, o_sub, o_max);
}

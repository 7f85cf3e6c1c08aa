/* Min/max key summaries of a list of pages, on the CPU (the op's contract: page_minmax/__init__.py).
 *
 * Page i is the first counts[i] keys from token starts[i] of cache block blocks[i]; for each KV head
 * its element-wise min and max over those keys (fp32 or bf16, read where they lie through their
 * strides) are written to that block's summary rows of sub-page starts[i] / page_size (fp32, or bf16
 * rounded to nearest-even as torch's conversion does). A channel holding a NaN summarizes to NaN in
 * both rows, as torch's amin/amax propagate it.
 * Built with -O3 -march=native -fopenmp -fno-math-errno -ffp-contract=fast. */
#include <stdint.h>

#include "vec_math.h"

#define MAX_D 1024

static inline float minmax_load(const void* base, int is_bf16, int64_t i) {
  return is_bf16 ? bf16_to_f32(((const uint16_t*)base)[i]) : ((const float*)base)[i];
}

static inline void minmax_store(void* base, int is_bf16, int64_t i, float v) {
  if (is_bf16) ((uint16_t*)base)[i] = f32_to_bf16(v);
  else ((float*)base)[i] = v;
}

/* keys: element (block b, head h, token t, channel d) at keys[b * k_blk + h * k_head + t * k_tok + d * k_ch],
 * num_blocks x hkv x block_size x D (channels contiguous, or tokens: vLLM's CPU layout); out: min of (block b, head h, sub-page s, channel d) at
 * out[b * o_blk + h * o_head + s * o_sub + d], max o_max further. Returns 0; 1 for D outside
 * [1, MAX_D]; 2 for a page outside its block, not starting on a page boundary, or of no key. */
int kvsieve_page_minmax(const void* keys, int keys_bf16, int64_t k_blk, int64_t k_head, int64_t k_tok,
                        int64_t k_ch, int64_t num_blocks, int hkv, int block_size, int D, const int64_t* blocks,
                        const int64_t* starts, const int64_t* counts, int64_t n_pages, int page_size, void* out,
                        int out_bf16, int64_t o_blk, int64_t o_head, int64_t o_sub, int64_t o_max) {
  if (D < 1 || D > MAX_D) return 1;
  for (int64_t i = 0; i < n_pages; ++i) {
    if (blocks[i] < 0 || blocks[i] >= num_blocks || starts[i] < 0 || starts[i] % page_size || counts[i] < 1
        || counts[i] > page_size || starts[i] + counts[i] > block_size)
      return 2;
  }
  float lo[MAX_D], hi[MAX_D];
  unsigned char nan[MAX_D];
  for (int64_t i = 0; i < n_pages; ++i) {
    for (int h = 0; h < hkv; ++h) {
      for (int d = 0; d < D; ++d) { lo[d] = 1.0f / 0.0f; hi[d] = -1.0f / 0.0f; nan[d] = 0; }
      int64_t base = blocks[i] * k_blk + h * k_head;
      if (k_ch == 1) { /* channels contiguous: a row of D per token */
        for (int64_t t = starts[i]; t < starts[i] + counts[i]; ++t) {
          int64_t row = base + t * k_tok;
#pragma omp simd
          for (int d = 0; d < D; ++d) {
            float v = minmax_load(keys, keys_bf16, row + d);
            nan[d] |= v != v;
            lo[d] = v < lo[d] ? v : lo[d];
            hi[d] = v > hi[d] ? v : hi[d];
          }
        }
      } else { /* any other strides (vLLM's CPU layout: tokens contiguous): a reduction per channel */
        for (int d = 0; d < D; ++d) {
          float l = lo[d], u = hi[d];
          unsigned char bad = 0;
          int64_t col = base + d * k_ch;
#pragma omp simd reduction(min : l) reduction(max : u) reduction(| : bad)
          for (int64_t t = starts[i]; t < starts[i] + counts[i]; ++t) {
            float v = minmax_load(keys, keys_bf16, col + t * k_tok);
            bad |= v != v;
            l = v < l ? v : l;
            u = v > u ? v : u;
          }
          lo[d] = l; hi[d] = u; nan[d] = bad;
        }
      }
      int64_t dst = blocks[i] * o_blk + h * o_head + (starts[i] / page_size) * o_sub;
      for (int d = 0; d < D; ++d) {
        float q = 0.0f / 0.0f;
        minmax_store(out, out_bf16, dst + d, nan[d] ? q : lo[d]);
        minmax_store(out, out_bf16, dst + o_max + d, nan[d] ? q : hi[d]);
      }
    }
  }
  return 0;
}

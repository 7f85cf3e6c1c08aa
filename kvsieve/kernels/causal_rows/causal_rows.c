/* Attention of each request's last query rows over its paged KV cache, each row causal (the
 * contract: native.py). A request's R rows and its G query heads per KV head are one group of
 * H = R * G folded query heads: every cache block is read once for all of them (a verify pass of K + 1
 * rows reads the context once, not K + 1 times), and row i of R sees the first kv_len - R + i + 1
 * positions (the later positions of the tile are masked for it). Per (request, KV head, group of rows,
 * part of the blocks) a task keeps an online softmax over tiles of CR_TILE tokens: the logits of the
 * tile for all H heads (q scaled beforehand; K stored by channel: per 16 tokens, 3 or 4 heads at a
 * time with their sums in registers while the channels pass, the tile's maximum taken from them, the
 * next block's K and V requested meanwhile; K by rows: one dot product per token and head), the
 * softmax update, then the weighted V rows (two heads a pass, 32 channels of each in registers while
 * the tokens pass). When the requests x KV heads are fewer than twice the threads, each one's blocks
 * are cut into parts merged afterwards by their log-sum-exp (flash-decoding's split).
 * Built with -O3 -march=native -fopenmp -fno-math-errno -ffp-contract=fast: the loops marked `omp simd`
 * are vectorized, a product added to a sum is one fused multiply-add, nothing else is reassociated. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attend_runs.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define CR_MAX_H 32 /* folded query heads (rows x group) of one task */
#define CR_TILE 128 /* tokens scored before their softmax update */
#define HB 4 /* the folded heads are padded with zero rows to a multiple of this */

typedef float f32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

/* 8 consecutive elements as fp32. */
static inline __attribute__((always_inline)) f32x8 load8(const void* p, const int BF16, int64_t off) {
  f32x8 x;
  if (BF16) {
    u16x8 h;
    memcpy(&h, (const uint16_t*)p + off, sizeof(h));
    u32x8 w = __builtin_convertvector(h, u32x8) << 16;
    memcpy(&x, &w, sizeof(x));
  } else {
    memcpy(&x, (const float*)p + off, sizeof(x));
  }
  return x;
}

/* The cache and the call's shapes. K element (block b, head h, token t, channel d) at b * k_blk +
 * h * k_head + t * k_tok + d * k_ch (K by channel: k_tok = 1; by rows: k_ch = 1); V's at b * v_blk +
 * h * v_head + t * v_tok + d. */
typedef struct {
  const void *k, *v;
  int is_bf16;
  int64_t k_blk, k_head, k_tok, k_ch, v_blk, v_head, v_tok;
  int block_size, hkv, D, G;
} Cache;

/* Lane-wise maximum. */
static inline f32x8 max8(f32x8 a, f32x8 b) {
  const u32x8 up = (u32x8)(a > b);
  return (f32x8)((up & (u32x8)a) | (~up & (u32x8)b));
}

/* The logits of the tokens [t0, t0 + Tr) of a block whose K (by channel) starts at kb, for the H folded
 * heads of q [.][D] (rows past H zero, to a multiple of NB): for each 16 tokens, NB heads at a time
 * with their 16 x NB sums in registers while the channels pass (the 16 tokens' K stays in L1 for all
 * the heads), stored to s[g][t - t0] and their lane-wise maximum to top[g]. pk >= 0: the same tile's K
 * lines of the next block (at pk) and the lines of its V rows from pv are requested into the L2
 * meanwhile, one each per channel step: a task reads its blocks once, cold. BF16 and NB are constants
 * at the calls. */
static inline __attribute__((always_inline)) void logits_by_channel(const Cache* c, const int BF16, const int NB,
                                                                    int64_t kb, int t0, int Tr, const float* q, int H,
                                                                    int64_t pk, int64_t pv, float s[][CR_TILE],
                                                                    f32x8* top) {
  const int D = c->D, es = BF16 ? 2 : 4;
  int line = 0;
  for (int j = 0; j < Tr; j += 16) {
    for (int g0 = 0; g0 < H; g0 += NB) {
      const float* q0 = q + (int64_t)g0 * D;
      const int fetch = pk >= 0 && g0 == 0;
      /* named sums, not an array: GCC kept an array's sums on the stack, a store per product */
      f32x8 a00 = {0}, a01 = {0}, a10 = {0}, a11 = {0}, a20 = {0}, a21 = {0}, a30 = {0}, a31 = {0};
      for (int d = 0; d < D; ++d) {
        const int64_t o = kb + (int64_t)d * c->k_ch + t0 + j;
        const f32x8 x0 = load8(c->k, BF16, o), x1 = load8(c->k, BF16, o + 8);
        if (fetch) {
          __builtin_prefetch((const char*)c->k + (pk + (int64_t)d * c->k_ch + t0 + j) * es, 0, 2);
          __builtin_prefetch((const char*)c->v + pv * es + (int64_t)(line++) * 64, 0, 2);
        }
        const float q0d = q0[d], q1d = q0[D + d], q2d = q0[2 * D + d];
        a00 += q0d * x0;
        a01 += q0d * x1;
        a10 += q1d * x0;
        a11 += q1d * x1;
        a20 += q2d * x0;
        a21 += q2d * x1;
        if (NB == 4) {
          const float q3d = q0[3 * D + d];
          a30 += q3d * x0;
          a31 += q3d * x1;
        }
      }
      const f32x8 sums[4][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}};
      for (int g = 0; g < NB && g0 + g < H; ++g) {
        memcpy(s[g0 + g] + j, &sums[g][0], sizeof(f32x8));
        memcpy(s[g0 + g] + j + 8, &sums[g][1], sizeof(f32x8));
        top[g0 + g] = max8(top[g0 + g], max8(sums[g][0], sums[g][1]));
      }
    }
  }
}

/* Tokens of a tile of T that a row seeing `see` more positions from the tile's first attends. */
static inline int tile_rows(int64_t see, int T) { return see < T ? (see > 0 ? (int)see : 0) : T; }

/* acc_a [D] += sum_t pa[t] V[t] for the tokens [t0, t0 + n) of the block whose V starts at vb, and
 * acc_b with pb when NH == 2: 32 channels of each head in registers while the tokens pass, each V line
 * loaded once for both heads. BF16 and NH are constants at the calls. */
static inline __attribute__((always_inline)) void weigh_v_nh(const Cache* c, const int BF16, const int NH, int64_t vb,
                                                             int t0, int n, const float* pa, const float* pb,
                                                             float* acc_a, float* acc_b) {
  const int D = c->D;
  int d0 = 0;
  for (; d0 + 32 <= D; d0 += 32) {
    f32x8 a0, a1, a2, a3, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
    memcpy(&a0, acc_a + d0, 32);
    memcpy(&a1, acc_a + d0 + 8, 32);
    memcpy(&a2, acc_a + d0 + 16, 32);
    memcpy(&a3, acc_a + d0 + 24, 32);
    if (NH == 2) {
      memcpy(&b0, acc_b + d0, 32);
      memcpy(&b1, acc_b + d0 + 8, 32);
      memcpy(&b2, acc_b + d0 + 16, 32);
      memcpy(&b3, acc_b + d0 + 24, 32);
    }
    for (int t = 0; t < n; ++t) {
      const int64_t o = vb + (int64_t)(t0 + t) * c->v_tok + d0;
      const f32x8 x0 = load8(c->v, BF16, o), x1 = load8(c->v, BF16, o + 8), x2 = load8(c->v, BF16, o + 16),
                  x3 = load8(c->v, BF16, o + 24);
      const float p = pa[t];
      a0 += p * x0;
      a1 += p * x1;
      a2 += p * x2;
      a3 += p * x3;
      if (NH == 2) {
        const float w = pb[t];
        b0 += w * x0;
        b1 += w * x1;
        b2 += w * x2;
        b3 += w * x3;
      }
    }
    memcpy(acc_a + d0, &a0, 32);
    memcpy(acc_a + d0 + 8, &a1, 32);
    memcpy(acc_a + d0 + 16, &a2, 32);
    memcpy(acc_a + d0 + 24, &a3, 32);
    if (NH == 2) {
      memcpy(acc_b + d0, &b0, 32);
      memcpy(acc_b + d0 + 8, &b1, 32);
      memcpy(acc_b + d0 + 16, &b2, 32);
      memcpy(acc_b + d0 + 24, &b3, 32);
    }
  }
  for (; d0 < D; d0 += 8) { /* D % 32 channels left: 8 at a time */
    f32x8 a0, b0 = {0};
    memcpy(&a0, acc_a + d0, 32);
    if (NH == 2) memcpy(&b0, acc_b + d0, 32);
    for (int t = 0; t < n; ++t) {
      const f32x8 x = load8(c->v, BF16, vb + (int64_t)(t0 + t) * c->v_tok + d0);
      a0 += pa[t] * x;
      if (NH == 2) b0 += pb[t] * x;
    }
    memcpy(acc_a + d0, &a0, 32);
    if (NH == 2) memcpy(acc_b + d0, &b0, 32);
  }
}

static void weigh_v(const Cache* c, int BF16, int NH, int64_t vb, int t0, int n, const float* pa, const float* pb,
                    float* acc_a, float* acc_b) {
  if (BF16 && NH == 2) weigh_v_nh(c, 1, 2, vb, t0, n, pa, pb, acc_a, acc_b);
  else if (BF16) weigh_v_nh(c, 1, 1, vb, t0, n, pa, pb, acc_a, acc_b);
  else if (NH == 2) weigh_v_nh(c, 0, 2, vb, t0, n, pa, pb, acc_a, acc_b);
  else weigh_v_nh(c, 0, 1, vb, t0, n, pa, pb, acc_a, acc_b);
}

/* One task: KV head h, folded heads q [H][D] (fp32, rows r0.. of the request, G heads each; H padded to
 * a multiple of HB with zero rows), row j's length lens[j / G] (positions attended); the blocks
 * [b0, b1) of the request's table row. Writes out [H][D] and lse [H] of this part (a head that sees
 * no position of it: out 0, lse +inf). */
static void task_attend(const Cache* c, const int32_t* table, int h, const float* q, int H, const int64_t* lens,
                        int64_t b0, int64_t b1, float* out, float* lse) {
  const int D = c->D, G = c->G, bs = c->block_size, BF16 = c->is_bf16;
  float acc[CR_MAX_H][KV_MAX_D], m[CR_MAX_H], l[CR_MAX_H], s[CR_MAX_H][CR_TILE];
  f32x8 top[CR_MAX_H];
  int64_t maxlen = 0;
  for (int j = 0; j < H; ++j) {
    m[j] = -INFINITY;
    l[j] = 0.0f;
    memset(acc[j], 0, sizeof(float) * D);
    if (lens[j / G] > maxlen) maxlen = lens[j / G];
  }
  for (int64_t bi = b0; bi < b1; ++bi) {
    const int64_t blk = table[bi], first = bi * bs;
    const int64_t kb = blk * c->k_blk + h * c->k_head, vb = blk * c->v_blk + h * c->v_head;
    const int64_t nxt = bi + 1 < b1 ? table[bi + 1] : -1; /* the next block: its K/V requested meanwhile */
    const int64_t next_kb = nxt < 0 ? -1 : nxt * c->k_blk + h * c->k_head;
    const int64_t next_vb = nxt < 0 ? -1 : nxt * c->v_blk + h * c->v_head;
    const int valid = (int)(maxlen - first < bs ? maxlen - first : bs);
    for (int t0 = 0; t0 < valid; t0 += CR_TILE) {
      const int T = valid - t0 < CR_TILE ? valid - t0 : CR_TILE;
      const int64_t pos0 = first + t0;
      int Tr = 0; /* > 0: top[g] holds the maximum of the tile's Tr logits of head g (K by channel) */
      if (c->k_tok == 1) { /* K by channel */
        for (int g = 0; g < H; ++g) top[g] = (f32x8){0} - INFINITY;
        Tr = (T + 15) / 16 * 16; /* read whole vectors: the block holds them (bs % 16 == 0) */
        const int nb = (H + 2) / 3 <= (H + 3) / 4 ? 3 : 4; /* heads a pass: the fewer passes, 3 at a tie */
        const int64_t pv = next_vb < 0 ? -1 : next_vb + (int64_t)t0 * c->v_tok;
        if (nb == 4 && BF16) logits_by_channel(c, 1, 4, kb, t0, Tr, q, H, next_kb, pv, s, top);
        else if (nb == 4) logits_by_channel(c, 0, 4, kb, t0, Tr, q, H, next_kb, pv, s, top);
        else if (BF16) logits_by_channel(c, 1, 3, kb, t0, Tr, q, H, next_kb, pv, s, top);
        else logits_by_channel(c, 0, 3, kb, t0, Tr, q, H, next_kb, pv, s, top);
      } else { /* K by rows (channels contiguous: k_ch = 1) */
        float row[KV_MAX_D];
        for (int t = 0; t < T; ++t) {
          load_row(c->k, BF16, kb + (int64_t)(t0 + t) * c->k_tok, D, row);
          for (int g = 0; g < H; ++g) {
            const float* qg = q + (int64_t)g * D;
            float x = 0.0f;
            for (int d = 0; d < D; ++d) x += qg[d] * row[d];
            s[g][t] = x;
          }
        }
      }
      for (int g = 0; g < H; ++g) { /* mask past the row's length, then the softmax update */
        const int n = tile_rows(lens[g / G] - pos0, T);
        float* sg = s[g];
        const int n8 = (n + 7) / 8 * 8; /* the weights past n are 0: a pass of two heads runs to the longer one's n */
        if (n8 < T) memset(sg + n8, 0, sizeof(float) * (size_t)(T - n8));
        if (n == 0) continue; /* this row sees none of the tile */
        /* the logits' max (q is scaled): the logits pass's when the row sees all it scored, else 8 at a
         * time with the lanes past n at -inf */
        const vm_i32x8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
        const vm_f32x8 ninf = (vm_f32x8){0} - INFINITY;
        vm_f32x8 vmax = ninf;
        if (n == Tr) {
          vmax = top[g];
        } else {
          for (int t = 0; t < n; t += 8) {
            vm_f32x8 x;
            memcpy(&x, sg + t, sizeof(x));
            const vm_i32x8 in = lane + t < n;
            vmax = max8((vm_f32x8)((in & (vm_i32x8)x) | (~in & (vm_i32x8)ninf)), vmax);
          }
        }
        float mx = m[g];
        for (int j = 0; j < 8; ++j) mx = vmax[j] > mx ? vmax[j] : mx;
        const float corr = m[g] == -INFINITY ? 0.0f : exp_nonpositive(m[g] - mx);
        vm_f32x8 vsum = (vm_f32x8){0};
        for (int t = 0; t < n; t += 8) {
          vm_f32x8 x;
          memcpy(&x, sg + t, sizeof(x));
          const vm_i32x8 in = lane + t < n;
          x = (vm_f32x8)(in & (vm_i32x8)exp8_nonpositive(x - mx));
          memcpy(sg + t, &x, sizeof(x));
          vsum += x;
        }
        l[g] = l[g] * corr + lane_sum(vsum);
        m[g] = mx;
        if (corr == 1.0f) continue; /* the maximum held: the sums stand */
        float* ag = acc[g];
#pragma omp simd
        for (int d = 0; d < D; ++d) ag[d] *= corr;
      }
      for (int g = 0; g < H; g += 2) { /* the weighted V rows, two heads a pass: each V line read once for both */
        const int n = tile_rows(lens[g / G] - pos0, T);
        if (g + 1 == H) {
          weigh_v(c, BF16, 1, vb, t0, n, s[g], NULL, acc[g], NULL);
        } else {
          const int n1 = tile_rows(lens[(g + 1) / G] - pos0, T); /* the longer run: the other's weights past it are 0 */
          weigh_v(c, BF16, 2, vb, t0, n > n1 ? n : n1, s[g], s[g + 1], acc[g], acc[g + 1]);
        }
      }
    }
  }
  for (int g = 0; g < H; ++g) {
    float* og = out + (int64_t)g * D;
    if (l[g] == 0.0f) {
      for (int d = 0; d < D; ++d) og[d] = 0.0f;
      lse[g] = INFINITY;
      continue;
    }
    const float inv = 1.0f / l[g];
#pragma omp simd
    for (int d = 0; d < D; ++d) og[d] = acc[g][d] * inv;
    lse[g] = m[g] + logf(l[g]);
  }
}

/* A task of the call: request r, KV head h, its rows [r0, r0 + R), the part of its blocks [b0, b1),
 * its scratch at `at` (rows x G heads of out and lse). */
typedef struct {
  int64_t r, r0, b0, b1, at;
  int h, R;
} Task;

/* q [N, hkv * G, D] fp32 (request r's rows [qo[r], qo[r + 1]), its last positions); kv_lens [n_req] (int64:
 * positions cached, this step's rows included); table [n_req] rows of table_stride int32 block ids;
 * out [N, hkv * G, D], lse [N, hkv * G] fp32. threads: the OpenMP threads (0: the runtime's default).
 * Returns 0; -1 for a shape past KV_MAX_D, a group past CR_MAX_H, D % 8 != 0, K by channel with
 * block_size % 16 != 0, K by rows with channels not contiguous, or a request with fewer than 0 or
 * more rows than positions; -2 when out of memory; -3 when a request's positions need more blocks than a table row
 * holds. Nothing is written unless it returns 0. */
int kvsieve_causal_rows(const void* k, const void* v, int is_bf16, int64_t k_blk, int64_t k_head, int64_t k_tok,
                        int64_t k_ch, int64_t v_blk, int64_t v_head, int64_t v_tok, int block_size,
                        const int32_t* table, int64_t table_stride, const int64_t* qo, const int64_t* kv_lens,
                        int64_t n_req, int hkv, int D, const float* q, int G, float sm_scale, int threads,
                        float* out, float* lse) {
  if (D > KV_MAX_D || D < 8 || D % 8 != 0 || G < 1 || G > CR_MAX_H || block_size < 1) return -1;
  if ((k_tok == 1 && block_size % 16 != 0) || (k_tok != 1 && k_ch != 1)) return -1;
  const Cache c = {k, v, is_bf16, k_blk, k_head, k_tok, k_ch, v_blk, v_head, v_tok, block_size, hkv, D, G};
  const int rows_max = CR_MAX_H / G; /* rows of a request in one task */
  int64_t items = 0;
  for (int64_t r = 0; r < n_req; ++r) {
    const int64_t R = qo[r + 1] - qo[r];
    if (R < 0 || R > kv_lens[r]) return -1;
    if ((kv_lens[r] + block_size - 1) / block_size > table_stride) return -3;
    items += hkv * ((R + rows_max - 1) / rows_max);
  }
  int nt = threads > 0 ? threads : 1;
#ifdef _OPENMP
  if (threads <= 0) nt = omp_get_max_threads();
#endif
  const int64_t want = items > 0 && items < 2 * nt ? (2 * nt + items - 1) / items : 1; /* parts per item */
  Task* tasks = (Task*)malloc(sizeof(Task) * (size_t)(items * want + 1));
  if (tasks == NULL) return -2;
  int64_t n_tasks = 0, scratch = 0;
  for (int64_t r = 0; r < n_req; ++r) {
    const int64_t nb = (kv_lens[r] + block_size - 1) / block_size, parts = want < nb ? want : (nb > 0 ? nb : 1);
    for (int h = 0; h < hkv; ++h)
      for (int64_t r0 = qo[r]; r0 < qo[r + 1]; r0 += rows_max) {
        const int R = (int)(qo[r + 1] - r0 < rows_max ? qo[r + 1] - r0 : rows_max);
        for (int64_t p = 0; p < parts; ++p) {
          tasks[n_tasks++] = (Task){r, r0, nb * p / parts, nb * (p + 1) / parts, scratch, h, R};
          scratch += (int64_t)R * G;
        }
      }
  }
  float* s_out = (float*)malloc(sizeof(float) * (size_t)(scratch * D + 1));
  float* s_lse = (float*)malloc(sizeof(float) * (size_t)(scratch + 1));
  if (s_out == NULL || s_lse == NULL) {
    free(tasks);
    free(s_out);
    free(s_lse);
    return -2;
  }
  const int64_t hq = (int64_t)hkv * G;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
  for (int64_t i = 0; i < n_tasks; ++i) {
    const Task t = tasks[i];
    float qp[(CR_MAX_H + HB) * KV_MAX_D]; /* the folded heads, D apart, zero rows up to a multiple of HB */
    int64_t lens[CR_MAX_H];
    const int H = t.R * G, Hp = (H + HB - 1) / HB * HB;
    const int64_t first = kv_lens[t.r] - (qo[t.r + 1] - qo[t.r]); /* positions before the request's rows */
    for (int j = 0; j < t.R; ++j) {
      lens[j] = first + (t.r0 - qo[t.r]) + j + 1;
      const float* qj = q + ((t.r0 + j) * hq + (int64_t)t.h * G) * D;
      for (int e = 0; e < G * D; ++e) qp[(int64_t)j * G * D + e] = qj[e] * sm_scale; /* logits come out scaled */
    }
    memset(qp + (int64_t)H * D, 0, sizeof(float) * (Hp - H) * D);
    task_attend(&c, table + t.r * table_stride, t.h, qp, H, lens, t.b0, t.b1, s_out + t.at * D, s_lse + t.at);
  }
  /* each item's parts (consecutive tasks, their scratch consecutive: part p of an item at its first
   * part's + p * R * G heads) merged by their log-sum-exp (one part: copied), then its rows written */
  float merged[CR_MAX_H * KV_MAX_D], merged_lse[CR_MAX_H];
  for (int64_t i = 0; i < n_tasks;) {
    int64_t e = i + 1;
    while (e < n_tasks && tasks[e].r == tasks[i].r && tasks[e].h == tasks[i].h && tasks[e].r0 == tasks[i].r0) ++e;
    const Task t = tasks[i];
    const float *o = s_out + t.at * D, *o_lse = s_lse + t.at;
    if (e - i > 1) {
      merge_parts(o, o_lse, (int)(e - i), t.R * G, D, merged, merged_lse);
      o = merged;
      o_lse = merged_lse;
    }
    for (int j = 0; j < t.R; ++j) {
      const int64_t at = (t.r0 + j) * hq + (int64_t)t.h * G;
      memcpy(out + at * D, o + (int64_t)j * G * D, sizeof(float) * G * D);
      memcpy(lse + at, o_lse + j * G, sizeof(float) * G);
    }
    i = e;
  }
  free(tasks);
  free(s_out);
  free(s_lse);
  return 0;
}

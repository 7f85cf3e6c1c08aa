/* Attention of one decode token's KV head over runs of a paged cache (online softmax, fp32), shared
 * by the native CPU kernels that attend (sparse_gqa_decode.c, decode_layer.c); included, not compiled
 * alone. Built with -O3 -march=native -fopenmp -fno-math-errno -ffp-contract=fast: the loops marked
 * `omp simd` are vectorized, a product added to a sum is one fused multiply-add, nothing else is
 * reassociated. */
#ifndef KVSIEVE_ATTEND_RUNS_H
#define KVSIEVE_ATTEND_RUNS_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec_math.h"

#define ATTEND_CHUNK 64 /* tokens scored before their softmax update */
#define PREFETCH_RUNS 8 /* how many runs ahead the V rows are requested */
#define PREFETCH_K_RUNS 3 /* and the K lines (nearer: a span's K is D lines a kept line) */

/* n consecutive elements as fp32: a row of D channels, or n tokens of one K channel stored by channel. */
static inline void load_row(const void* pool, int is_bf16, int64_t off, int n, float* dst) {
  if (is_bf16) {
    const uint16_t* src = (const uint16_t*)pool + off;
#pragma omp simd
    for (int j = 0; j < n; ++j) dst[j] = bf16_to_f32(src[j]);
  } else {
    memcpy(dst, (const float*)pool + off, sizeof(float) * n);
  }
}

/* Request the lines holding bytes [p, p + bytes) into the L2 (locality hint 2: prefetcht1): a decode step reads each row once,
 * and the L2 keeps more misses in flight than the L1, so more of the step's scattered lines arrive at
 * once. */
static inline void prefetch_span(const char* p, int64_t bytes) {
  const char* end = p + bytes;
  for (p = (const char*)((uintptr_t)p & ~(uintptr_t)63); p < end; p += 64) __builtin_prefetch(p, 0, 2);
}

/* Ask for the K (want_k) and V (want_v) of a later run (its valid tokens) while this one is computed:
 * a decode step reads each run once, cold, so without this every run waits on memory. K by rows
 * (k_ch = 0): n_tok rows of D from k_off; by channel: D spans of n_tok tokens, k_ch apart. V: n_tok
 * rows of D. A span (keep != NULL): in every channel, the K lines holding its n_keep kept tokens, and
 * their V rows. */
static inline void prefetch_run(const void* kpool, const void* vpool, int is_bf16, int64_t k_off, int64_t v_off,
                                int n_tok, int64_t k_ch, int D, const int32_t* keep, int n_keep, int want_k, int want_v) {
  const int es = is_bf16 ? 2 : 4;
  if (n_tok <= 0) return;
  const char* k = (const char*)kpool + k_off * es;
  const char* v = (const char*)vpool + v_off * es;
  if (keep != NULL) { /* a span: the K lines holding a kept token, in every channel, and the kept V rows */
    int64_t last = -1;
    for (int i = 0; i < n_keep; ++i) {
      const int64_t line = ((int64_t)(k - (const char*)kpool) + (int64_t)keep[i] * es) >> 6;
      if (want_k && line != last)
        for (int d = 0; d < D; ++d) prefetch_span(k + ((int64_t)d * k_ch + keep[i]) * es, 1);
      last = line;
      if (want_v) prefetch_span(v + (int64_t)keep[i] * D * es, (int64_t)D * es);
    }
    return;
  }
  if (want_k && k_ch == 0) prefetch_span(k, (int64_t)n_tok * D * es);
  else if (want_k) for (int d = 0; d < D; ++d) prefetch_span(k + (int64_t)d * k_ch * es, (int64_t)n_tok * es);
  if (want_v) prefetch_span(v, (int64_t)n_tok * D * es);
}

/* Spans (K stored by channel only): run u is a span of cnt[u] consecutive tokens of one cache block
 * whose tokens keep[at[u]], ..., keep[at[u] + kept[u] - 1] (offsets in the span, ascending) are
 * attended; at[u] < 0: every token of the run. A span's K is read channel by channel in tiles of
 * SPAN_TILE tokens, only the tiles holding a kept token (whole cache lines, in order, where gathering
 * scattered tokens reads nearly the same lines at random); the kept tokens' logits are taken in order,
 * so the scores, and the output, are those of the kept tokens as runs of their own. Its V: the kept
 * rows alone. `aligned`: every channel row of a cache block starts at a multiple of SPAN_TILE elements
 * and holds a multiple of SPAN_TILE tokens, so a span's tiles are taken on that grid (a tile is then
 * one 64-byte line of fp32 K, half of one of bf16) and may start before the span, inside its block. */
typedef struct {
  const int32_t* keep;
  const int64_t* at;
  const int32_t* kept;
  int aligned;
} RunSpans;

#define SPAN_MAX 256 /* tokens in a span at most */

#define SPAN_TILE 16 /* a span's tokens whose logits stay in registers while every channel passes */
#define SPAN_ROW (SPAN_MAX + SPAN_TILE) /* a span's logits from its first tile's start */
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

/* 16 consecutive elements as fp32 (a generic vector: the compiler lowers it to this CPU's registers). */
static inline f32x16 load16(const void* pool, int is_bf16, int64_t off) {
  f32x16 x;
  if (is_bf16) {
    u16x16 h;
    memcpy(&h, (const uint16_t*)pool + off, sizeof(h));
    u32x16 w = __builtin_convertvector(h, u32x16) << 16;
    memcpy(&x, &w, sizeof(x));
  } else {
    memcpy(&x, (const float*)pool + off, sizeof(x));
  }
  return x;
}

/* The unscaled logits of a span's kept tokens (K by channel: channel d of the span's token j at off +
 * d*k_ch + j): out[g][lead + j] = sum over d, in order, of qh[g][d] * K[d][j] (the products and sums a
 * run of its own computes, in the same order) for every kept j (keep [n_keep], ascending, < w; keep NULL:
 * every j < n_keep, a whole run), computed
 * by tiles of SPAN_TILE tokens starting lead tokens before the span (lead < SPAN_TILE), the tiles without
 * a kept token skipped; up to four tiles share a channel's pass, their G x SPAN_TILE sums in registers.
 * `readable`: the tokens from the first tile's start that may be read (a tile reaching past it is read
 * only up to it). */
static inline __attribute__((always_inline)) void span_logits(const void* kpool, int is_bf16, int64_t off,
                                                              int lead, int readable, int64_t k_ch, int D,
                                                              const float* qh, int G,
                                                              const int32_t* keep, int n_keep,
                                                              float out[][SPAN_ROW]) {
  int tiles[SPAN_ROW / SPAN_TILE], n_tiles = 0;
  if (keep == NULL)
    for (int tile = lead / SPAN_TILE; tile * SPAN_TILE < lead + n_keep; ++tile) tiles[n_tiles++] = tile;
  for (int i = 0; keep != NULL && i < n_keep; ++i) {
    const int tile = (lead + keep[i]) / SPAN_TILE;
    if (n_tiles == 0 || tiles[n_tiles - 1] != tile) tiles[n_tiles++] = tile;
  }
  const int64_t base = off - lead;
  int last_full = n_tiles; /* tiles[i] whole inside the row for i < last_full */
  while (last_full > 0 && (tiles[last_full - 1] + 1) * SPAN_TILE > readable) --last_full;
  int i = 0;
  for (; i + 4 <= last_full; i += 4) { /* four tiles: one channel pass loads 64 tokens */
    const int j0 = tiles[i] * SPAN_TILE, j1 = tiles[i + 1] * SPAN_TILE, j2 = tiles[i + 2] * SPAN_TILE,
              j3 = tiles[i + 3] * SPAN_TILE;
    f32x16 acc[KV_MAX_G][4];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < 4; ++c) acc[g][c] = (f32x16){0};
    for (int d = 0; d < D; ++d) {
      const int64_t o = base + (int64_t)d * k_ch;
      const f32x16 x0 = load16(kpool, is_bf16, o + j0), x1 = load16(kpool, is_bf16, o + j1),
                   x2 = load16(kpool, is_bf16, o + j2), x3 = load16(kpool, is_bf16, o + j3);
      for (int g = 0; g < G; ++g) {
        const float qd = qh[g * D + d];
        acc[g][0] += qd * x0;
        acc[g][1] += qd * x1;
        acc[g][2] += qd * x2;
        acc[g][3] += qd * x3;
      }
    }
    for (int g = 0; g < G; ++g) {
      memcpy(out[g] + j0, &acc[g][0], sizeof(f32x16));
      memcpy(out[g] + j1, &acc[g][1], sizeof(f32x16));
      memcpy(out[g] + j2, &acc[g][2], sizeof(f32x16));
      memcpy(out[g] + j3, &acc[g][3], sizeof(f32x16));
    }
  }
  for (; i < last_full; ++i) {
    const int j0 = tiles[i] * SPAN_TILE;
    f32x16 acc[KV_MAX_G];
    for (int g = 0; g < G; ++g) acc[g] = (f32x16){0};
    for (int d = 0; d < D; ++d) {
      const f32x16 x = load16(kpool, is_bf16, base + (int64_t)d * k_ch + j0);
      for (int g = 0; g < G; ++g) acc[g] += qh[g * D + d] * x;
    }
    for (int g = 0; g < G; ++g) memcpy(out[g] + j0, &acc[g], sizeof(f32x16));
  }
  if (i < n_tiles) { /* the last tile, cut where reading must stop */
    const int j0 = tiles[i] * SPAN_TILE, tw = readable - j0;
    float x[SPAN_TILE];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < tw; ++j) out[g][j0 + j] = 0.0f;
    for (int d = 0; d < D; ++d) {
      load_row(kpool, is_bf16, base + (int64_t)d * k_ch + j0, tw, x);
      for (int g = 0; g < G; ++g) {
        const float qd = qh[g * D + d];
        float* o = out[g] + j0;
#pragma omp simd
        for (int j = 0; j < tw; ++j) o[j] += qd * x[j];
      }
    }
  }
}

/* One KV head: online softmax over its runs. Run u: cnt[u] tokens; token t's K at k_off[u] + t*D of
 * kpool (K_COLS = 0: rows of D, channels contiguous) or channel d at k_off[u] + t + d*k_ch (K_COLS = 1:
 * K stored by channel, vLLM's CPU layout); its V row at v_off[u] + t*D of vpool. With K_COLS, `spans`
 * (or NULL) makes runs spans of which only the kept tokens are attended (RunSpans). D, G and K_COLS
 * are constants at the call sites that matter. */
static inline __attribute__((always_inline)) void head_attend(
    const void* kpool, const void* vpool, int is_bf16, const int64_t* k_off, const int64_t* v_off, const int32_t* cnt,
    int64_t n_runs, int K_COLS, int64_t k_ch, const RunSpans* spans, int D, const float* qh, int G, float sm_scale,
    float* out, float* lse) {
  float acc[KV_MAX_G][KV_MAX_D], m[KV_MAX_G], l[KV_MAX_G], s[KV_MAX_G][ATTEND_CHUNK];
  float row[KV_MAX_D > SPAN_MAX ? KV_MAX_D : SPAN_MAX], span_s[KV_MAX_G][SPAN_ROW];
  int lead = 0; /* the open span's first tile starts lead tokens before it */
  int64_t v_off_of[ATTEND_CHUNK];
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
    for (int d = 0; d < D; ++d) acc[g][d] = 0.0f;
  }
  const int64_t pf_ch = K_COLS ? k_ch : 0;
  const RunSpans* sp = K_COLS ? spans : NULL;
#define KEEP_OF(r) (sp != NULL && sp->at[r] >= 0 ? sp->keep + sp->at[r] : (const int32_t*)NULL)
#define N_OF(r) (sp != NULL && sp->at[r] >= 0 ? sp->kept[r] : cnt[r]) /* the run's attended tokens */
#define PREFETCH(r, K, V) \
  prefetch_run(kpool, vpool, is_bf16, k_off[r], v_off[r], cnt[r], pf_ch, D, KEEP_OF(r), N_OF(r), K, V)
  for (int64_t r = 0; r < PREFETCH_RUNS && r < n_runs; ++r) PREFETCH(r, r < PREFETCH_K_RUNS, 1);
  int64_t u = 0;
  int t = 0; /* the run's next attended token (an index into its kept tokens for a span) */
  while (u < n_runs) {
    int n = 0; /* gather up to ATTEND_CHUNK tokens' scores */
    while (u < n_runs && n < ATTEND_CHUNK) {
      if (t >= N_OF(u)) { ++u; t = 0; continue; }
      if (t == 0 && u + PREFETCH_RUNS < n_runs) PREFETCH(u + PREFETCH_RUNS, 0, 1);
      if (t == 0 && u + PREFETCH_K_RUNS < n_runs) PREFETCH(u + PREFETCH_K_RUNS, 1, 0);
      int take = 1;
      const int32_t* keep = KEEP_OF(u);
      if (!K_COLS) {
        load_row(kpool, is_bf16, k_off[u] + (int64_t)t * D, D, row);
        for (int g = 0; g < G; ++g) {
          const float* qg = qh + g * D;
          float a = 0.0f;
#pragma omp simd reduction(+ : a)
          for (int d = 0; d < D; ++d) a += qg[d] * row[d];
          s[g][n] = a * sm_scale;
        }
      } else if (keep != NULL || cnt[u] <= SPAN_MAX) {
        /* a span, or a run that fits one: its (kept) tiles' logits once, then its tokens' in order */
        if (t == 0) {
          const int aligned = sp != NULL && sp->aligned;
          lead = aligned ? (int)(k_off[u] % SPAN_TILE) : 0;
          const int readable = aligned ? (lead + cnt[u] + SPAN_TILE - 1) / SPAN_TILE * SPAN_TILE : cnt[u];
          span_logits(kpool, is_bf16, k_off[u], lead, readable, k_ch, D, qh, G, keep, N_OF(u), span_s);
        }
        take = N_OF(u) - t < ATTEND_CHUNK - n ? N_OF(u) - t : ATTEND_CHUNK - n;
        for (int g = 0; g < G; ++g)
          for (int j = 0; j < take; ++j) s[g][n + j] = span_s[g][lead + (keep != NULL ? keep[t + j] : t + j)] * sm_scale;
      } else { /* a run longer than a span: its next tokens at once, channel by channel */
        take = cnt[u] - t < ATTEND_CHUNK - n ? cnt[u] - t : ATTEND_CHUNK - n;
        for (int g = 0; g < G; ++g)
          for (int j = 0; j < take; ++j) s[g][n + j] = 0.0f;
        for (int d = 0; d < D; ++d) {
          load_row(kpool, is_bf16, k_off[u] + t + (int64_t)d * k_ch, take, row);
          for (int g = 0; g < G; ++g) {
            float qd = qh[g * D + d], *sg = s[g] + n;
#pragma omp simd
            for (int j = 0; j < take; ++j) sg[j] += qd * row[j];
          }
        }
        for (int g = 0; g < G; ++g)
          for (int j = 0; j < take; ++j) s[g][n + j] *= sm_scale;
      }
      for (int j = 0; j < take; ++j) v_off_of[n + j] = v_off[u] + (int64_t)(keep != NULL ? keep[t + j] : t + j) * D;
      n += take;
      t += take;
    }
#undef PREFETCH
#undef N_OF
#undef KEEP_OF
    if (n == 0) break;
    for (int g = 0; g < G; ++g) { /* rescale by the new running max */
      float mx = m[g];
      for (int j = 0; j < n; ++j) mx = s[g][j] > mx ? s[g][j] : mx;
      float corr = exp_nonpositive(m[g] - mx); /* m = -inf at first: 0 (clamped, times 0 state) */
      if (m[g] == -INFINITY) corr = 0.0f;
      l[g] *= corr;
#pragma omp simd
      for (int d = 0; d < D; ++d) acc[g][d] *= corr;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int j = 0; j < n; ++j) { s[g][j] = exp_nonpositive(s[g][j] - mx); sum += s[g][j]; }
      l[g] += sum;
      m[g] = mx;
    }
    for (int j = 0; j < n; ++j) {
      load_row(vpool, is_bf16, v_off_of[j], D, row);
      for (int g = 0; g < G; ++g) {
        float p = s[g][j];
#pragma omp simd
        for (int d = 0; d < D; ++d) acc[g][d] += p * row[d];
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    if (l[g] == 0.0f) { /* attends nothing: out 0, lse +inf */
      for (int d = 0; d < D; ++d) out[g * D + d] = 0.0f;
      lse[g] = INFINITY;
      continue;
    }
    float inv = 1.0f / l[g];
#pragma omp simd
    for (int d = 0; d < D; ++d) out[g * D + d] = acc[g][d] * inv;
    lse[g] = m[g] + logf(l[g]);
  }
}

/* One head's runs with D (and G, K_COLS) made constants for the common shapes; `spans`: RunSpans or NULL
 * (read with K stored by channel only). */
static void attend_dispatch(const void* kpool, const void* vpool, int is_bf16, const int64_t* ko, const int64_t* vo,
                            const int32_t* c, int64_t n_runs, int k_cols, int64_t k_ch, const RunSpans* spans, int D,
                            const float* qh, int G, float sm_scale, float* oh, float* lh) {
#define ATTEND(KC, DD, GG) \
  head_attend(kpool, vpool, is_bf16, ko, vo, c, n_runs, KC, k_ch, spans, DD, qh, GG, sm_scale, oh, lh)
  if (!k_cols) {
    if (D == 64 && G == 3) ATTEND(0, 64, 3);
    else if (D == 64 && G == 4) ATTEND(0, 64, 4);
    else if (D == 64) ATTEND(0, 64, G);
    else if (D == 128) ATTEND(0, 128, G);
    else ATTEND(0, D, G);
  } else {
    if (D == 64 && G == 3) ATTEND(1, 64, 3);
    else if (D == 256 && G == 4) ATTEND(1, 256, 4);
    else if (D == 64) ATTEND(1, 64, G);
    else if (D == 128) ATTEND(1, 128, G);
    else ATTEND(1, D, G);
  }
#undef ATTEND
}

/* A head's runs cut at run boundaries into at most `team` parts of about equal work (a run's
 * attended tokens, plus SPAN_TILE for its fixed cost): part i is runs [cut[i], cut[i + 1]). Returns
 * the parts (1 when team <= 1; fewer than team when the runs are few or uneven). `spans` as
 * head_attend's (or NULL). */
static int cut_runs(const int32_t* cnt, const RunSpans* spans, int64_t n_runs, int team, int64_t* cut) {
  int64_t total = 0, acc = 0;
  int n = 1;
  cut[0] = 0;
#define COST(r) ((spans != NULL && spans->at[r] >= 0 ? spans->kept[r] : cnt[r]) + SPAN_TILE)
  for (int64_t r = 0; r < n_runs; ++r) total += COST(r);
  for (int64_t r = 0; r + 1 < n_runs && n < team; ++r) {
    acc += COST(r);
    if (acc * team >= total * n) cut[n++] = r + 1;
  }
#undef COST
  cut[n] = n_runs;
  return n;
}

/* Parts of one head's runs attended apart (out [n][G * D], lse [n][G]: head_attend's) merged into
 * the head's output o [G * D], as one softmax over all their tokens (flash-decoding's split): each
 * part weighted by exp(lse - the largest lse). A part that attends nothing (lse +inf) weighs
 * nothing; o is 0 when none attends anything, NaN when a part's lse is NaN. o_lse [G] (or NULL): the
 * merged log-sum-exp (+inf when none attends anything, NaN with a NaN part). */
static void merge_parts(const float* out, const float* lse, int n, int G, int D, float* o, float* o_lse) {
  for (int g = 0; g < G; ++g) {
    float top = -INFINITY, sum = 0.0f;
    int nan = 0;
    for (int i = 0; i < n; ++i) {
      const float x = lse[i * G + g];
      nan |= x != x;
      if (x != INFINITY && x > top) top = x;
    }
    float* og = o + (int64_t)g * D;
    for (int d = 0; d < D; ++d) og[d] = nan ? NAN : 0.0f;
    if (nan || top == -INFINITY) {
      if (o_lse != NULL) o_lse[g] = nan ? NAN : INFINITY;
      continue;
    }
    for (int i = 0; i < n; ++i) {
      const float x = lse[i * G + g];
      if (x == INFINITY) continue;
      const float wi = exp_nonpositive(x - top);
      const float* oi = out + ((int64_t)i * G + g) * D;
      sum += wi;
#pragma omp simd
      for (int d = 0; d < D; ++d) og[d] += wi * oi[d];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int d = 0; d < D; ++d) og[d] *= inv;
    if (o_lse != NULL) o_lse[g] = top + logf(sum);
  }
}

#endif

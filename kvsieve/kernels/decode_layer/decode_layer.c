/* One attention layer's decode step on the CPU in one call: the selector's per-step state update,
 * its selection, the runs of the paged cache it selects, and the attention over them (the op's
 * contract: decode_layer/__init__.py). Every row is one request's one new token, already in the cache.
 *
 * Programs (kind):
 *   PAGES         Quest / RocketKV stage 2: refresh the newest page's min/max summary from the cache,
 *                 rank pages (page_rank.h: softmax over pages, mean over the group, newest forced),
 *                 keep min(units, pages).
 *   STREAMING     the first num_sink positions and the last units - num_sink.
 *   TOKENS_EXACT  oracle top-k: the true attention probabilities summed over the group, per unit of
 *                 `unit` positions; keep min(units, its units).
 *   BLOCKS_EXACT  block selection: per block of `unit` positions the group's largest logit (mode 0)
 *                 or logit against the block's mean key (mode 1); the first init_units and last
 *                 local_units forced; keep min(units, blocks).
 *   BLOCKS_BOUND  the same from page min/max summaries (Quest's bound, group max); the newest page
 *                 refreshed first.
 *   INDEXER       DSA: write this token's index key, score I[s] = sum_h w[h] relu(q[h] . k[s]), keep
 *                 the `units` best positions (every position when there are no more); one set for
 *                 every KV head.
 * Ties rank the lower unit first. K/V/pools are read where they lie (bf16 or fp32); the math is fp32.
 * Threads (OpenMP, torch's own runtime and thread count): a call with at least as many rows as threads
 * gives each thread whole rows; otherwise each row's team shares it (DSA's scores by tiles; each
 * head's runs cut into a part a thread, attended apart and merged by their log-sum-exp), which sums
 * the same products in another order, so outputs equal one thread's to fp32 rounding (selections,
 * pools and counts exactly).
 * Built with -O3 -march=native -fopenmp -fno-math-errno -ffp-contract=fast. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attend_runs.h"
#include "index_score.h"
#include "page_rank.h"

enum { KIND_PAGES = 1, KIND_STREAMING = 2, KIND_TOKENS_EXACT = 3, KIND_BLOCKS_EXACT = 4, KIND_BLOCKS_BOUND = 5,
       KIND_INDEXER = 6 };
#define TEAM_MIN_LEN 1024 /* shorter rows run on one thread (a team costs more than it saves) */
#define SPAN_GAP 64   /* tokens between two pieces of one block that one span covers, less than */

enum { OK = 0, ERR_SHAPE = -1, ERR_MEMORY = -2, ERR_TABLE = -3, ERR_KIND = -4 };

/* Mirrored field by field by decode_layer/native.py's DecodeLayerArgs. */
typedef struct {
  /* the step: n_rows decode rows; row n's blocks table[n * table_stride + j], j < table_width */
  int64_t n_rows;
  const int32_t* table;
  int64_t table_stride, table_width;
  const int32_t* kv_lens;
  /* the layer's cache: K element (b, h, t, d) at k[b*k_blk + h*k_head + t*k_tok + d*k_ch], V rows of D */
  const void* k;
  const void* v;
  int64_t k_blk, k_head, k_tok, k_ch, v_blk, v_head, v_tok, num_blocks;
  int32_t kv_bf16, block_size, hkv, D, G;
  float sm_scale;
  /* q, out [n_rows, hkv * G, D]: row n at n * q_stride / n * out_stride elements, heads D apart */
  const void* q;
  void* out;
  int64_t q_stride, out_stride;
  int32_t q_bf16, out_bf16;
  /* the program */
  int32_t kind, mode, unit, num_sink, init_units, local_units;
  int64_t units;
  /* page summaries: (min, max) rows of 2*D at ((block * hkv + h) * pool_sub + s) * 2*D */
  void* pool;
  int32_t pool_bf16, pool_sub, page_size, ih;
  /* indexer: key pool [num_blocks, block_size, id]; q [n_rows, ih, id], w [n_rows, ih], new keys [n_rows, id] fp32 */
  void* ik;
  const float* iq;
  const float* iw;
  const float* ik_new;
  int32_t ik_bf16, id;
  /* out: positions each (row, KV head) attends [n_rows, hkv] */
  int64_t* attended;
  /* threads sharing the call (0: OpenMP's default, torch's thread count) */
  int32_t threads;
} DecodeLayerArgs;

typedef struct { /* one call's scratch, sized for its longest row */
  float* scores;   /* [(G + hkv + 1) * n_max] */
  uint64_t* keys;  /* [n_max] */
  int32_t* sel;    /* [hkv * n_max] unit ids per head */
  int64_t* ra;     /* [n_max + 2] range starts */
  int64_t* rb;     /* [n_max + 2] range ends */
  int64_t *k_off, *v_off; /* [max_runs] */
  int32_t* cnt;    /* [max_runs] */
  int64_t* blocks; /* [table_width] int64 block ids of the row */
  int32_t* keep;   /* [n_max] spans' kept offsets (RunSpans) */
  int64_t* at;     /* [max_runs] */
  int32_t* kept;   /* [max_runs] */
  int64_t max_runs;
  float* qf;       /* [hkv * G * D] the row's query, fp32 */
  float* part_o;   /* [team * G * D] a head's parts' outputs (attend_head) */
  float* part_lse; /* [team * G] their log-sum-exps */
  int64_t* cut;    /* [team + 1] the parts' first runs */
  int64_t total;   /* the head's attended tokens */
  int parts;       /* its parts */
} Scratch;

static inline float load_f(const void* base, int is_bf16, int64_t i) {
  return is_bf16 ? bf16_to_f32(((const uint16_t*)base)[i]) : ((const float*)base)[i];
}

/* Units (ascending ids) of `unit` positions, clipped to len, as ranges [ra, rb) merged where they touch. */
static int64_t units_to_ranges(const int32_t* sel, int64_t m, int64_t unit, int64_t len, int64_t* ra, int64_t* rb) {
  int64_t r = 0;
  for (int64_t i = 0; i < m; ++i) {
    int64_t a = (int64_t)sel[i] * unit, b = a + unit < len ? a + unit : len;
    if (a >= b) continue;
    if (r > 0 && rb[r - 1] == a) rb[r - 1] = b;
    else { ra[r] = a; rb[r] = b; ++r; }
  }
  return r;
}

/* Head h's ranges as runs inside cache blocks (element offsets of K and V, token counts). With K
 * stored by channel (use_spans), pieces of ranges in one cache block less than SPAN_GAP tokens
 * apart become one span (attend_runs.h's RunSpans) of at most SPAN_MAX tokens, its kept offsets in
 * s->keep: a K cache line holds 16-32 tokens of a channel, so scattered tokens read nearly every line
 * of their block either way, and a span reads them in order. *total: the tokens attended. */
static int64_t ranges_to_runs(const DecodeLayerArgs* a, const int64_t* blocks, int h, const int64_t* ra,
                              const int64_t* rb, int64_t n_ranges, Scratch* s, int use_spans, int64_t* total) {
  int64_t r = 0, nk = 0, bs = a->block_size, last_blk = -1, span0 = 0; /* span0: the open span's first offset */
  *total = 0;
  for (int64_t i = 0; i < n_ranges; ++i) {
    for (int64_t p = ra[i]; p < rb[i];) {
      int64_t blk = p / bs, off = p % bs, end = (blk + 1) * bs < rb[i] ? (blk + 1) * bs : rb[i];
      int64_t n = end - p, end_off = off + n;
      *total += n;
      const int64_t gap = off - (span0 + (r > 0 ? s->cnt[r - 1] : 0));
      if (use_spans && r > 0 && blk == last_blk && gap >= 0 && gap < SPAN_GAP && end_off - span0 <= SPAN_MAX) {
        if (s->at[r - 1] < 0) { /* the open run becomes a span: its own tokens kept first */
          s->at[r - 1] = nk;
          for (int32_t j = 0; j < s->cnt[r - 1]; ++j) s->keep[nk++] = j;
          s->kept[r - 1] = s->cnt[r - 1];
        }
        for (int64_t j = off; j < end_off; ++j) s->keep[nk++] = (int32_t)(j - span0);
        s->kept[r - 1] += (int32_t)n;
        s->cnt[r - 1] = (int32_t)(end_off - span0);
      } else {
        int64_t b = blocks[blk];
        if (r >= s->max_runs) return -1;
        s->k_off[r] = b * a->k_blk + h * a->k_head + off * a->k_tok;
        s->v_off[r] = b * a->v_blk + h * a->v_head + off * a->v_tok;
        s->cnt[r] = (int32_t)n;
        s->at[r] = -1; /* every token (kept[r] is read for spans only) */
        last_blk = blk;
        span0 = off;
        ++r;
      }
      p = end;
    }
  }
  return r;
}

/* Query row n as fp32 [hkv * G * D]. */
static void load_q(const DecodeLayerArgs* a, int64_t n, float* qf) {
  int64_t w = (int64_t)a->hkv * a->G * a->D;
  for (int64_t i = 0; i < w; ++i) qf[i] = load_f(a->q, a->q_bf16, n * a->q_stride + i);
}

/* Logits of query head row qh [D] against positions [0, len) of KV head h, times sm_scale. */
static void head_logits_all(const DecodeLayerArgs* a, const int64_t* blocks, int h, const float* qh, int64_t len,
                            float* out) {
  float row[KV_MAX_D];
  for (int64_t p = 0; p < len; ++p) out[p] = 0.0f;
  for (int64_t blk = 0; blk * a->block_size < len; ++blk) {
    int64_t p0 = blk * a->block_size, n = len - p0 < a->block_size ? len - p0 : a->block_size;
    int64_t base = blocks[blk] * a->k_blk + h * a->k_head;
    if (a->k_ch == 1) { /* channels contiguous: a row of D per token */
      for (int64_t t = 0; t < n; ++t) {
        load_row(a->k, a->kv_bf16, base + t * a->k_tok, a->D, row);
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int d = 0; d < a->D; ++d) acc += qh[d] * row[d];
        out[p0 + t] = acc;
      }
    } else { /* K stored by channel (tokens contiguous): accumulate channel by channel */
      for (int d = 0; d < a->D; ++d) {
        float qd = qh[d];
        for (int64_t t0 = 0; t0 < n; t0 += KV_MAX_D) {
          int m = (int)(n - t0 < KV_MAX_D ? n - t0 : KV_MAX_D);
          load_row(a->k, a->kv_bf16, base + d * a->k_ch + t0 * a->k_tok, m, row);
          float* o = out + p0 + t0;
#pragma omp simd
          for (int j = 0; j < m; ++j) o[j] += qd * row[j];
        }
      }
    }
  }
  for (int64_t p = 0; p < len; ++p) out[p] *= a->sm_scale;
}

/* The summary of the page holding position len - 1, positions up to it: the new token alone when it
 * opens the page, else the page's summary over [first, len - 1) (which every earlier step wrote) widened
 * by the new token. Rounding to the summary dtype is monotonic, so this equals recomputing the page. */
static int refresh_newest_page(const DecodeLayerArgs* a, const int64_t* blocks, int64_t len) {
  const int64_t ps = a->page_size, d = a->D, pos = len - 1, first = pos / ps * ps;
  const int64_t blk = blocks[pos / a->block_size], tok = pos % a->block_size;
  const int opens = pos == first;
  for (int h = 0; h < a->hkv; ++h) {
    const int64_t src = blk * a->k_blk + h * a->k_head + tok * a->k_tok;
    const int64_t dst = ((blk * a->hkv + h) * a->pool_sub + (first % a->block_size) / ps) * 2 * d;
    for (int64_t c = 0; c < d; ++c) {
      float x = load_f(a->k, a->kv_bf16, src + c * a->k_ch);
      float lo = x, hi = x;
      if (!opens) {
        float old_lo = load_f(a->pool, a->pool_bf16, dst + c), old_hi = load_f(a->pool, a->pool_bf16, dst + d + c);
        lo = x != x || old_lo != old_lo ? x + old_lo : (old_lo < x ? old_lo : x); /* NaN stays NaN */
        hi = x != x || old_hi != old_hi ? x + old_hi : (old_hi > x ? old_hi : x);
      }
      if (a->pool_bf16) {
        ((uint16_t*)a->pool)[dst + c] = f32_to_bf16(lo);
        ((uint16_t*)a->pool)[dst + d + c] = f32_to_bf16(hi);
      } else {
        ((float*)a->pool)[dst + c] = lo;
        ((float*)a->pool)[dst + d + c] = hi;
      }
    }
  }
  return OK;
}

/* Per head, the selected units of row n into s->sel (head h at h * n_max), counts in m[h]. */
static int select_units(const DecodeLayerArgs* a, int64_t n, const int64_t* blocks, int64_t len, const float* qf,
                        Scratch* s, int64_t n_max, int64_t* m) {
  const int hkv = a->hkv, G = a->G, D = a->D;
  const int64_t unit = a->unit, n_units = (len + unit - 1) / unit, k = a->units < n_units ? a->units : n_units;
  switch (a->kind) {
    case KIND_PAGES: {
      if (refresh_newest_page(a, blocks, len) != OK) return ERR_SHAPE;
      float* logits = s->scores;
      float* scores = s->scores + (int64_t)G * n_max;
      /* blocks are in units of cache blocks; the ranker walks pool_sub pages per block */
      topk_row(a->pool, a->pool_bf16, blocks, n_units, hkv, a->pool_sub, D, qf, G, a->sm_scale, a->mode, k, scores,
               s->sel, n_max, logits, s->keys);
      for (int h = 0; h < hkv; ++h) m[h] = k;
      return OK;
    }
    case KIND_TOKENS_EXACT: {
      float* logits = s->scores;
      float* mass = s->scores + (int64_t)G * n_max;
      for (int h = 0; h < hkv; ++h) {
        for (int64_t u = 0; u < n_units; ++u) mass[u] = 0.0f;
        for (int g = 0; g < G; ++g) {
          float* l = logits + (int64_t)g * n_max;
          head_logits_all(a, blocks, h, qf + ((int64_t)h * G + g) * D, len, l);
          float mx = -INFINITY, sum = 0.0f;
          for (int64_t p = 0; p < len; ++p) mx = l[p] > mx ? l[p] : mx;
#pragma omp simd reduction(+ : sum)
          for (int64_t p = 0; p < len; ++p) { l[p] = exp_nonpositive(l[p] - mx); sum += l[p]; }
          float inv = 1.0f / sum;
          for (int64_t p = 0; p < len; ++p) mass[p / unit] += l[p] * inv;
        }
        m[h] = top_ascending(mass, n_units, k, s->keys, s->sel + h * n_max);
      }
      return OK;
    }
    case KIND_BLOCKS_EXACT:
    case KIND_BLOCKS_BOUND: {
      float* score = s->scores + (int64_t)G * n_max;
      if (a->kind == KIND_BLOCKS_BOUND && refresh_newest_page(a, blocks, len) != OK) return ERR_SHAPE;
      const int64_t ps = a->kind == KIND_BLOCKS_BOUND ? a->page_size : 1, n_pages = (len + ps - 1) / ps, per = unit / ps;
      for (int h = 0; h < hkv; ++h) {
        for (int64_t u = 0; u < n_units; ++u) score[u] = -INFINITY;
        if (a->kind == KIND_BLOCKS_BOUND) {
          float lo[KV_MAX_D], hi[KV_MAX_D];
          for (int64_t u = 0; u < n_units; ++u) {
            for (int d = 0; d < D; ++d) { lo[d] = INFINITY; hi[d] = -INFINITY; }
            for (int64_t pg = u * per; pg < (u + 1) * per && pg < n_pages; ++pg) {
              int64_t row = ((blocks[pg / a->pool_sub] * hkv + h) * a->pool_sub + pg % a->pool_sub) * 2 * D;
              for (int d = 0; d < D; ++d) {
                float x = load_f(a->pool, a->pool_bf16, row + d), y = load_f(a->pool, a->pool_bf16, row + D + d);
                lo[d] = x < lo[d] ? x : lo[d];
                hi[d] = y > hi[d] ? y : hi[d];
              }
            }
            for (int g = 0; g < G; ++g) {
              const float* qg = qf + ((int64_t)h * G + g) * D;
              float acc = 0.0f;
              for (int d = 0; d < D; ++d) acc += qg[d] > 0.0f ? qg[d] * hi[d] : qg[d] * lo[d];
              acc *= a->sm_scale;
              score[u] = acc > score[u] ? acc : score[u];
            }
          }
        } else if (a->mode == 0) { /* the group's largest logit in the block */
          float* l = s->scores;
          for (int g = 0; g < G; ++g) {
            head_logits_all(a, blocks, h, qf + ((int64_t)h * G + g) * D, len, l);
            for (int64_t p = 0; p < len; ++p) score[p / unit] = l[p] > score[p / unit] ? l[p] : score[p / unit];
          }
        } else { /* the logit against the block's mean key (positions < len): the block's logits averaged */
          float* l = s->scores;
          for (int g = 0; g < G; ++g) {
            head_logits_all(a, blocks, h, qf + ((int64_t)h * G + g) * D, len, l);
            for (int64_t u = 0; u < n_units; ++u) {
              int64_t p0 = u * unit, p1 = p0 + unit < len ? p0 + unit : len;
              float acc = 0.0f;
              for (int64_t p = p0; p < p1; ++p) acc += l[p];
              acc /= (float)(p1 - p0);
              score[u] = acc > score[u] ? acc : score[u];
            }
          }
        }
        for (int64_t u = 0; u < n_units; ++u)
          if (u < a->init_units || u >= n_units - a->local_units) score[u] = INFINITY;
        m[h] = top_ascending(score, n_units, k, s->keys, s->sel + h * n_max);
      }
      return OK;
    }
    default:
      return ERR_KIND;
  }
}

/* DSA's selection of row n, by every thread of the row's team: this token's index key into the pool
 * (one thread), the positions' scores (the tiles split evenly among the team), the `units` best (one
 * thread); one set for every KV head. */
static void index_select(const DecodeLayerArgs* a, int64_t n, const int64_t* blocks, int64_t len, Scratch* s,
                         int64_t n_max, int64_t* m) {
  const int id = a->id;
  const int64_t pos = len - 1, bs = a->block_size;
#pragma omp single
  {
    int64_t dst = (blocks[pos / bs] * bs + pos % bs) * id;
    const float* kn = a->ik_new + n * id;
    for (int d = 0; d < id; ++d) {
      if (a->ik_bf16) ((uint16_t*)a->ik)[dst + d] = f32_to_bf16(kn[d]);
      else ((float*)a->ik)[dst + d] = kn[d];
    }
  }
  if (len > a->units) {
    const IndexPool pool = {a->ik, a->ik_bf16, id, bs};
    const int64_t tiles = (len + INDEX_TILE - 1) / INDEX_TILE, me = omp_get_thread_num(), of = omp_get_num_threads();
    index_scores(&pool, blocks, len, a->iq + n * (int64_t)a->ih * id, a->iw + n * (int64_t)a->ih, a->ih,
                 tiles * me / of, tiles * (me + 1) / of, s->scores);
#pragma omp barrier
  }
#pragma omp single
  {
    if (len <= a->units) { /* every position */
      for (int64_t p = 0; p < len; ++p) s->sel[p] = (int32_t)p;
      m[0] = len;
    } else {
      m[0] = top_ascending(s->scores, len, a->units, s->keys, s->sel);
    }
    for (int h = 1; h < a->hkv; ++h) {
      memcpy(s->sel + h * n_max, s->sel, sizeof(int32_t) * (size_t)m[0]);
      m[h] = m[0];
    }
  }
}

/* KV head h of row n (length len) over its selection (m: the units per head in s->sel; NULL: the
 * ranges already in s->ra/rb, n_ranges of them), by every thread of the row's team: its runs (one
 * thread), cut into a part a thread (cut_runs; one part with one thread: the runs in one online
 * softmax), the parts attended apart and merged into the head's output. *rc: set on an error, the same
 * for every thread after each barrier. */
static void attend_head(const DecodeLayerArgs* a, int64_t n, int h, int64_t len, const int64_t* m, int64_t n_ranges,
                        int64_t n_max, int team, int aligned, Scratch* s, int* rc) {
  const int G = a->G, D = a->D;
  const int64_t k_ch = a->k_ch == 1 ? 0 : a->k_ch; /* attend_dispatch: 0 = K rows of D */
  const RunSpans spans = {s->keep, s->at, s->kept, aligned};
#pragma omp single
  if (*rc == OK) {
    if (m != NULL) n_ranges = units_to_ranges(s->sel + h * n_max, m[h], a->unit, len, s->ra, s->rb);
    const int64_t runs = ranges_to_runs(a, s->blocks, h, s->ra, s->rb, n_ranges, s, k_ch > 0, &s->total);
    if (runs < 0) *rc = ERR_MEMORY;
    else s->parts = cut_runs(s->cnt, &spans, runs, team, s->cut);
  }
  if (*rc != OK) return;
#pragma omp for schedule(dynamic, 1)
  for (int i = 0; i < s->parts; ++i) {
    const int64_t r0 = s->cut[i];
    const RunSpans part = {s->keep, s->at + r0, s->kept + r0, aligned};
    attend_dispatch(a->k, a->v, a->kv_bf16, s->k_off + r0, s->v_off + r0, s->cnt + r0, s->cut[i + 1] - r0, k_ch > 0,
                    k_ch, &part, D, s->qf + (int64_t)h * G * D, G, a->sm_scale, s->part_o + (int64_t)i * G * D,
                    s->part_lse + (int64_t)i * G);
  }
#pragma omp single
  {
    float merged[KV_MAX_G * KV_MAX_D];
    const float* o = s->part_o;
    if (s->parts > 1) {
      merge_parts(s->part_o, s->part_lse, s->parts, G, D, merged, NULL);
      o = merged;
    }
    int64_t dst = n * a->out_stride + (int64_t)h * G * D;
    for (int64_t i = 0; i < (int64_t)G * D; ++i) {
      if (a->out_bf16) ((uint16_t*)a->out)[dst + i] = f32_to_bf16(o[i]);
      else ((float*)a->out)[dst + i] = o[i];
    }
    a->attended[n * a->hkv + h] = s->total;
  }
}

/* Row n: its selection and attention by a team of `team` threads (1: the calling thread alone). */
static int decode_row(const DecodeLayerArgs* a, int64_t n, Scratch* s, int64_t n_max, int team, int aligned) {
  const int64_t len = a->kv_lens[n];
  for (int64_t j = 0; j * a->block_size < len; ++j) s->blocks[j] = a->table[n * a->table_stride + j];
  load_q(a, n, s->qf);
  int64_t n_stream = 0;
  if (a->kind == KIND_STREAMING) { /* [0, sink) and [recent, len), merged where they touch */
    int64_t sink = a->num_sink < len ? a->num_sink : len, recent = len - (a->units - a->num_sink);
    recent = recent > sink ? recent : sink;
    if (sink > 0) { s->ra[0] = 0; s->rb[0] = sink; n_stream = 1; }
    if (recent < len) {
      if (n_stream && s->rb[0] == recent) s->rb[0] = len;
      else { s->ra[n_stream] = recent; s->rb[n_stream] = len; ++n_stream; }
    }
  }
  int rc = OK;
  int64_t m[KV_MAX_G * 64];
  team = len < TEAM_MIN_LEN ? 1 : team;
#pragma omp parallel num_threads(team) if (team > 1)
  {
    if (a->kind == KIND_INDEXER) {
      index_select(a, n, s->blocks, len, s, n_max, m);
    } else if (a->kind != KIND_STREAMING) {
#pragma omp single
      rc = select_units(a, n, s->blocks, len, s->qf, s, n_max, m);
    }
    for (int h = 0; h < a->hkv; ++h)
      attend_head(a, n, h, len, a->kind == KIND_STREAMING ? NULL : m, n_stream, n_max, team, aligned, s, &rc);
  }
  return rc;
}

static void scratch_free(Scratch* s) {
  free(s->scores); free(s->keys); free(s->sel); free(s->ra); free(s->rb); free(s->k_off); free(s->v_off);
  free(s->cnt); free(s->blocks); free(s->keep); free(s->at); free(s->kept); free(s->qf); free(s->part_o);
  free(s->part_lse); free(s->cut);
}

/* Scratch for rows of up to n_max - 2 positions attended by teams of up to `team` threads. */
static int scratch_init(Scratch* s, const DecodeLayerArgs* a, int64_t n_max, int team) {
  const int64_t G = a->G, hkv = a->hkv, D = a->D;
  s->max_runs = 2 * n_max + a->table_width + 4;
  s->scores = malloc(sizeof(float) * (size_t)((G + hkv + 1) * n_max));
  s->keys = malloc(sizeof(uint64_t) * (size_t)n_max);
  s->sel = malloc(sizeof(int32_t) * (size_t)(hkv * n_max));
  s->ra = malloc(sizeof(int64_t) * (size_t)n_max);
  s->rb = malloc(sizeof(int64_t) * (size_t)n_max);
  s->k_off = malloc(sizeof(int64_t) * (size_t)s->max_runs);
  s->v_off = malloc(sizeof(int64_t) * (size_t)s->max_runs);
  s->cnt = malloc(sizeof(int32_t) * (size_t)s->max_runs);
  s->blocks = malloc(sizeof(int64_t) * (size_t)(a->table_width > 0 ? a->table_width : 1));
  s->keep = malloc(sizeof(int32_t) * (size_t)n_max);
  s->at = malloc(sizeof(int64_t) * (size_t)s->max_runs);
  s->kept = malloc(sizeof(int32_t) * (size_t)s->max_runs);
  s->qf = malloc(sizeof(float) * (size_t)(hkv * G * D));
  s->part_o = malloc(sizeof(float) * (size_t)(team * G * D));
  s->part_lse = malloc(sizeof(float) * (size_t)(team * G));
  s->cut = malloc(sizeof(int64_t) * (size_t)(team + 1));
  return s->scores && s->keys && s->sel && s->ra && s->rb && s->k_off && s->v_off && s->cnt && s->blocks && s->keep
         && s->at && s->kept && s->qf && s->part_o && s->part_lse && s->cut ? OK : ERR_MEMORY;
}

int kvsieve_decode_layer(const DecodeLayerArgs* a) {
  const int hkv = a->hkv, G = a->G, D = a->D;
  if (D < 1 || D > KV_MAX_D || G < 1 || G > KV_MAX_G || hkv < 1 || hkv > KV_MAX_G * 64 || a->unit < 1 || a->units < 1
      || a->block_size < 1 || a->threads < 0)
    return ERR_SHAPE;
  if (!((a->k_ch == 1 && a->k_tok == D) || a->k_tok == 1)) return ERR_SHAPE; /* K rows of D, or by channel */
  if (a->kind == KIND_INDEXER && (a->id < 1 || a->id > KV_MAX_D || a->ih < 1 || a->ih > INDEX_MAX_H || a->unit != 1))
    return ERR_SHAPE;
  if ((a->kind == KIND_PAGES || a->kind == KIND_BLOCKS_BOUND)
      && (a->page_size < 1 || a->block_size % a->page_size || a->block_size / a->page_size != a->pool_sub
          || (a->kind == KIND_PAGES && a->unit != a->page_size) || (a->kind == KIND_BLOCKS_BOUND && a->unit % a->page_size)))
    return ERR_SHAPE;
  int64_t longest = 1;
  for (int64_t n = 0; n < a->n_rows; ++n) { /* every row's blocks inside its table and the cache */
    int64_t len = a->kv_lens[n], nb = (len + a->block_size - 1) / a->block_size;
    if (len < 1 || nb > a->table_width) return ERR_TABLE;
    for (int64_t j = 0; j < nb; ++j) {
      int32_t b = a->table[n * a->table_stride + j];
      if (b < 0 || b >= a->num_blocks) return ERR_TABLE;
    }
    longest = len > longest ? len : longest;
  }
  const int64_t n_max = longest + 2, k_ch = a->k_ch == 1 ? 0 : a->k_ch;
  const int aligned = a->block_size % SPAN_TILE == 0 && a->k_blk % SPAN_TILE == 0 && a->k_head % SPAN_TILE == 0
                      && k_ch % SPAN_TILE == 0; /* RunSpans.aligned: channel rows on the tile grid */
  const int threads = omp_in_parallel() ? 1 : a->threads > 0 ? a->threads : omp_get_max_threads();
  int rc = OK;
  if (threads > 1 && a->n_rows >= threads) { /* a row a thread at a time, each alone */
#pragma omp parallel num_threads(threads) reduction(min : rc)
    {
      Scratch s;
      rc = scratch_init(&s, a, n_max, 1);
#pragma omp for schedule(dynamic, 1)
      for (int64_t n = 0; n < a->n_rows; ++n)
        if (rc == OK) rc = decode_row(a, n, &s, n_max, 1, aligned);
      scratch_free(&s);
    }
  } else { /* the rows in turn, each by the whole team */
    Scratch s;
    rc = scratch_init(&s, a, n_max, threads);
    for (int64_t n = 0; rc == OK && n < a->n_rows; ++n) rc = decode_row(a, n, &s, n_max, threads, aligned);
    scratch_free(&s);
  }
  return rc;
}

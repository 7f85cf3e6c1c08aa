/* Per-(row, KV head) block tables of a whole-block selection (see head_tables/__init__.py).
 * sel: [heads, row_stride] int32 block indices of the n rows' segments (off [n + 1]), -1 = none,
 * ascending among the valid ones; table: [n, table_stride] int32 physical block ids of each row's
 * request (table_width entries per row, rows table_stride apart); kv_lens [n]. Writes pseudo
 * [n * heads, width] (block * heads + head, 0 past a row's blocks) and seq [n * heads] (positions
 * attended: whole blocks but the last, which ends at kv_len). Returns 2 when a selected block starts
 * at or past its row's kv_len or its table row's width (nothing is read there), else 1 when some
 * (row, head) selects no block (nothing is then usable), else 0. */
#include <stdint.h>

int kvsieve_head_tables(const int32_t *sel, int64_t row_stride, int32_t heads, const int32_t *off, int64_t n,
                        const int32_t *table, int64_t table_stride, int64_t table_width, const int32_t *kv_lens,
                        int32_t block_size, int64_t width, int32_t *pseudo, int32_t *seq) {
    int empty = 0;
    for (int64_t r = 0; r < n; ++r) {
        const int32_t *blocks = table + r * table_stride;
        for (int32_t h = 0; h < heads; ++h) {
            const int32_t *s = sel + (int64_t)h * row_stride;
            int32_t *out = pseudo + (r * heads + h) * width;
            int64_t k = 0, last = -1;
            for (int64_t j = off[r]; j < off[r + 1]; ++j) {
                if (s[j] < 0)
                    continue;
                last = s[j];
                if (last >= table_width || last * block_size >= (int64_t)kv_lens[r])
                    return 2;
                out[k++] = blocks[last] * heads + h;
            }
            if (k == 0) { /* keep checking the other rows' ranges: a range error wins */
                empty = 1;
                continue;
            }
            for (int64_t j = k; j < width; ++j)
                out[j] = 0;
            int64_t tail = (int64_t)kv_lens[r] - last * block_size;
            seq[r * heads + h] = (int32_t)((k - 1) * block_size + (tail < block_size ? tail : block_size));
        }
    }
    return empty;
}

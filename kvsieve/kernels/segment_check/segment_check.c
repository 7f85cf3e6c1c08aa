/* Checks of a selection carrier's (indices, offsets) pair in one pass: the offsets start at 0,
 * never decrease and end at the indices' width; every entry is >= lowest (-1 with padding, else 0),
 * below its row's limit (ceil(len / block_size), when lens are given); the valid entries of one
 * (head, row) segment are strictly ascending and the padding (-1) trails them. Returns 0 when all
 * hold, else the number of the first rule broken (1: offsets, 2: entry below lowest, 3: out of
 * range, 4: order, 5: a valid entry after padding); the caller then runs the plain path, which
 * names the entry. */
#include <stdint.h>

int kvsieve_segment_check(const int32_t *idx, int64_t row_stride, int32_t heads, int64_t total,
                          const int32_t *off, int64_t n_rows, const int64_t *lens, int32_t block_size,
                          int32_t lowest) {
    if (off[0] != 0 || (int64_t)off[n_rows] != total)
        return 1;
    for (int64_t r = 0; r < n_rows; ++r)
        if (off[r + 1] < off[r])
            return 1;
    for (int32_t h = 0; h < heads; ++h) {
        const int32_t *row = idx + (int64_t)h * row_stride;
        for (int64_t r = 0; r < n_rows; ++r) {
            int64_t limit = lens ? (lens[r] + block_size - 1) / block_size : INT64_MAX;
            int64_t prev = -1;
            int padded = 0;
            for (int64_t j = off[r]; j < off[r + 1]; ++j) {
                int64_t v = row[j];
                if (v < lowest)
                    return 2;
                if (v < 0) {
                    padded = 1;
                    continue;
                }
                if (padded)
                    return 5;
                if (v >= limit)
                    return 3;
                if (v <= prev)
                    return 4;
                prev = v;
            }
        }
    }
    return 0;
}

// Rotary position embedding on a contiguous rank-4 x, one thread per (row, pair). Rows are
// [B, H, T] (layout 0, Bhtd) or [B, T, H] (layout 1, Bthd); tables are [T, R] or [B, T, R] (f32).
// Interleaved pairs (2i, 2i+1) or half-split pairs (i, i+R); features past 2R are copied. The
// backward is the same kernel with sign −1 (rotation by the negative angle).

#define ROPE(SUF, T) \
extern "C" __global__ void rope_##SUF(const T* x, T* y, const float* cs, const float* sn, \
        i64 rows, i64 heads, i64 t_len, i64 d, i64 r, int layout, int batched, int interleaved, float sign) { \
    i64 half_d = d / 2; \
    FOR_EACH(t, rows * half_d) { \
        i64 row = t / half_d, i = t % half_d; \
        i64 b = row / (heads * t_len); \
        i64 pos = layout == 0 ? row % t_len : (row / heads) % t_len; \
        i64 tr = batched ? b * t_len + pos : pos; \
        const T* xr = x + row * d; \
        T* yr = y + row * d; \
        if (i < r) { \
            float c = cs[tr * r + i], s = sign * sn[tr * r + i]; \
            i64 ia = interleaved ? 2 * i : i, ib = interleaved ? 2 * i + 1 : i + r; \
            float a = ld(xr, ia), bb = ld(xr, ib); \
            st(yr, ia, a * c - bb * s); \
            st(yr, ib, a * s + bb * c); \
        } else { \
            /* the pass-through tail: pair slot i (≥ r) copies features 2i and 2i+1 */ \
            st(yr, 2 * i, ld(xr, 2 * i)); \
            st(yr, 2 * i + 1, ld(xr, 2 * i + 1)); \
        } \
    } \
}
ROPE(f32, float)
ROPE(bf16, bf16_t)

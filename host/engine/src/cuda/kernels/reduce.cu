// Reductions over one dim of a contiguous tensor viewed as [outer, n, inner], in f32 and in a
// fixed order (no atomics), so a run is bitwise reproducible. Op codes follow `ReduceOp`:
// 0 sum, 1 max, 2 min, 3 argmax, 4 argmin (first index on ties; the index out as i64).

__device__ __forceinline__ float reduce_init(int op) {
    return op == 0 ? 0.0f : ((op == 1 || op == 3) ? NEG_INF : POS_INF);
}

// Whether `v` replaces the best so far `b` (strictly better keeps the first index on ties).
__device__ __forceinline__ bool better(int op, float v, float b) {
    return (op == 1 || op == 3) ? v > b : v < b;
}

// inner > 1: one thread per (outer, inner) column walks the n values in order (coalesced over
// inner).
#define REDUCE_COLS(SUF, T) \
extern "C" __global__ void reduce_cols_##SUF(int op, const T* x, T* y, i64* idx, i64 outer, i64 n, i64 inner) { \
    FOR_EACH(t, outer * inner) { \
        i64 o = t / inner, j = t % inner; \
        const i64 base = o * n * inner + j; \
        float acc = reduce_init(op); \
        i64 best = 0; \
        for (i64 k = 0; k < n; ++k) { \
            float v = ld(x, base + k * inner); \
            if (op == 0) acc += v; \
            else if (better(op, v, acc) || (k == 0)) { acc = v; best = k; } \
        } \
        if (op >= 3) idx[t] = best; else st(y, t, acc); \
    } \
}
REDUCE_COLS(f32, float)
REDUCE_COLS(bf16, bf16_t)

// inner == 1: one block per row; each thread folds a strided slice, then a fixed tree joins them.
#define REDUCE_ROWS(SUF, T) \
extern "C" __global__ void reduce_rows_##SUF(int op, const T* x, T* y, i64* idx, i64 n) { \
    __shared__ float vals[1024]; \
    __shared__ i64 at[1024]; \
    const T* row = x + (i64)blockIdx.x * n; \
    float acc = reduce_init(op); \
    i64 best = n; \
    for (i64 k = threadIdx.x; k < n; k += blockDim.x) { \
        float v = ld(row, k); \
        if (op == 0) acc += v; \
        else if (better(op, v, acc) || best == n) { acc = v; best = k; } \
    } \
    vals[threadIdx.x] = acc; \
    at[threadIdx.x] = best; \
    __syncthreads(); \
    for (int s = blockDim.x / 2; s > 0; s >>= 1) { \
        if (threadIdx.x < s) { \
            float a = vals[threadIdx.x], b = vals[threadIdx.x + s]; \
            i64 ia = at[threadIdx.x], ib = at[threadIdx.x + s]; \
            if (op == 0) vals[threadIdx.x] = a + b; \
            else if (ib != n && (ia == n || better(op, b, a) || (b == a && ib < ia))) { \
                vals[threadIdx.x] = b; at[threadIdx.x] = ib; \
            } \
        } \
        __syncthreads(); \
    } \
    if (threadIdx.x == 0) { \
        if (op >= 3) idx[blockIdx.x] = at[0] == n ? 0 : at[0]; else st(y, blockIdx.x, vals[0]); \
    } \
}
REDUCE_ROWS(f32, float)
REDUCE_ROWS(bf16, bf16_t)

// Softmax and log-softmax over the last dim, one block per row: max, then Σ exp, each a fixed
// tree (deterministic). The backward: softmax dx = y (g − Σ g y); log-softmax dx = g − e^y Σ g.

#define SOFTMAX(SUF, T) \
extern "C" __global__ void softmax_##SUF(const T* x, T* y, i64 n, int log_out) { \
    __shared__ float buf[32]; \
    const T* xr = x + (i64)blockIdx.x * n; \
    T* yr = y + (i64)blockIdx.x * n; \
    float m = NEG_INF; \
    for (i64 k = threadIdx.x; k < n; k += blockDim.x) m = fmaxf(m, ld(xr, k)); \
    m = block_max(m, buf); \
    float s = 0.0f; \
    for (i64 k = threadIdx.x; k < n; k += blockDim.x) s += expf(ld(xr, k) - m); \
    s = block_sum(s, buf); \
    float ls = logf(s), inv = 1.0f / s; \
    for (i64 k = threadIdx.x; k < n; k += blockDim.x) { \
        float v = ld(xr, k) - m; \
        st(yr, k, log_out ? v - ls : expf(v) * inv); \
    } \
} \
extern "C" __global__ void softmax_backward_##SUF(const T* y, const T* g, T* dx, i64 n, int log_out) { \
    __shared__ float buf[32]; \
    const T* yr = y + (i64)blockIdx.x * n; \
    const T* gr = g + (i64)blockIdx.x * n; \
    T* dr = dx + (i64)blockIdx.x * n; \
    float s = 0.0f; \
    for (i64 k = threadIdx.x; k < n; k += blockDim.x) s += log_out ? ld(gr, k) : ld(gr, k) * ld(yr, k); \
    s = block_sum(s, buf); \
    for (i64 k = threadIdx.x; k < n; k += blockDim.x) { \
        float yv = ld(yr, k), gv = ld(gr, k); \
        st(dr, k, log_out ? gv - expf(yv) * s : yv * (gv - s)); \
    } \
}
SOFTMAX(f32, float)
SOFTMAX(bf16, bf16_t)

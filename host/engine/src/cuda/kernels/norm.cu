// RMSNorm over the last dim, one block per row. The weight (optional) is passed as f32; the
// per-row reciprocal RMS is kept (f32) for the backward. The weight gradient sums g·x̂ over rows
// in two fixed-order stages (chunks of rows, then the chunks), never with atomics.

#define RMS_NORM(SUF, T) \
extern "C" __global__ void rms_norm_##SUF(const T* x, const float* w, T* y, float* rstd, i64 d, float eps) { \
    __shared__ float buf[32]; \
    const T* xr = x + (i64)blockIdx.x * d; \
    T* yr = y + (i64)blockIdx.x * d; \
    float ss = 0.0f; \
    for (i64 k = threadIdx.x; k < d; k += blockDim.x) { float v = ld(xr, k); ss += v * v; } \
    ss = block_sum(ss, buf); \
    float r = 1.0f / sqrtf(ss / (float)d + eps); \
    if (threadIdx.x == 0) rstd[blockIdx.x] = r; \
    for (i64 k = threadIdx.x; k < d; k += blockDim.x) { \
        float v = ld(xr, k) * r; \
        st(yr, k, w ? v * w[k] : v); \
    } \
} \
extern "C" __global__ void rms_norm_backward_##SUF(const T* x, const float* w, const float* rstd, const T* g, T* dx, i64 d) { \
    __shared__ float buf[32]; \
    const T* xr = x + (i64)blockIdx.x * d; \
    const T* gr = g + (i64)blockIdx.x * d; \
    T* dr = dx + (i64)blockIdx.x * d; \
    float r = rstd[blockIdx.x]; \
    float dot = 0.0f; \
    for (i64 k = threadIdx.x; k < d; k += blockDim.x) { \
        float gh = w ? ld(gr, k) * w[k] : ld(gr, k); \
        dot += gh * ld(xr, k) * r; \
    } \
    float c2 = block_sum(dot, buf) / (float)d; \
    for (i64 k = threadIdx.x; k < d; k += blockDim.x) { \
        float gh = w ? ld(gr, k) * w[k] : ld(gr, k); \
        st(dr, k, r * (gh - ld(xr, k) * r * c2)); \
    } \
} \
/* Stage one of dw: part[c, j] = Σ over rows c·chunk .. (c+1)·chunk of g·x̂ (grid: columns × chunks). */ \
extern "C" __global__ void rms_norm_dw_partial_##SUF(const T* x, const float* rstd, const T* g, float* part, i64 rows, i64 d, i64 chunk) { \
    i64 j = (i64)blockIdx.x * blockDim.x + threadIdx.x; \
    if (j >= d) return; \
    i64 c = blockIdx.y, r0 = c * chunk, r1 = min(rows, r0 + chunk); \
    float acc = 0.0f; \
    for (i64 r = r0; r < r1; ++r) acc += ld(g, r * d + j) * ld(x, r * d + j) * rstd[r]; \
    part[c * d + j] = acc; \
}
RMS_NORM(f32, float)
RMS_NORM(bf16, bf16_t)

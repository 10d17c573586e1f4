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

// LayerNorm over the last dim, one block per row: the mean, then the variance of the centered
// values (two passes, as the CPU backend). Weight and bias (optional) are passed as f32; the
// per-row mean and reciprocal std are kept (f32) for the backward.
#define LAYER_NORM(SUF, T) \
extern "C" __global__ void layer_norm_##SUF(const T* x, const float* w, const float* b, T* y, float* mean, \
        float* rstd, i64 d, float eps) { \
    __shared__ float buf[32]; \
    const T* xr = x + (i64)blockIdx.x * d; \
    T* yr = y + (i64)blockIdx.x * d; \
    float s = 0.0f; \
    for (i64 k = threadIdx.x; k < d; k += blockDim.x) s += ld(xr, k); \
    float m = block_sum(s, buf) / (float)d; \
    float ss = 0.0f; \
    for (i64 k = threadIdx.x; k < d; k += blockDim.x) { float v = ld(xr, k) - m; ss += v * v; } \
    ss = block_sum(ss, buf); \
    float r = 1.0f / sqrtf(ss / (float)d + eps); \
    if (threadIdx.x == 0) { mean[blockIdx.x] = m; rstd[blockIdx.x] = r; } \
    for (i64 k = threadIdx.x; k < d; k += blockDim.x) { \
        float v = (ld(xr, k) - m) * r; \
        if (w) v = v * w[k]; \
        if (b) v = v + b[k]; \
        st(yr, k, v); \
    } \
} \
/* dx = rstd (gh − mean(gh) − x̂ · mean(gh · x̂)) with gh = g·w. */ \
extern "C" __global__ void layer_norm_backward_##SUF(const T* x, const float* w, const float* mean, \
        const float* rstd, const T* g, T* dx, i64 d) { \
    __shared__ float buf[32]; \
    const T* xr = x + (i64)blockIdx.x * d; \
    const T* gr = g + (i64)blockIdx.x * d; \
    T* dr = dx + (i64)blockIdx.x * d; \
    float m = mean[blockIdx.x], r = rstd[blockIdx.x]; \
    float dot = 0.0f, sum = 0.0f; \
    for (i64 k = threadIdx.x; k < d; k += blockDim.x) { \
        float gh = w ? ld(gr, k) * w[k] : ld(gr, k); \
        dot += gh * (ld(xr, k) - m) * r; \
        sum += gh; \
    } \
    float c2 = block_sum(dot, buf) / (float)d; \
    __syncthreads(); \
    float c1 = block_sum(sum, buf) / (float)d; \
    for (i64 k = threadIdx.x; k < d; k += blockDim.x) { \
        float gh = w ? ld(gr, k) * w[k] : ld(gr, k); \
        st(dr, k, r * (gh - c1 - (ld(xr, k) - m) * r * c2)); \
    } \
} \
/* Stage one of dw and db: pw[c, j] = Σ g·x̂ and pb[c, j] = Σ g over rows c·chunk .. (c+1)·chunk \
   (grid: columns × chunks); either pointer may be null. */ \
extern "C" __global__ void layer_norm_dwb_partial_##SUF(const T* x, const float* mean, const float* rstd, \
        const T* g, float* pw, float* pb, i64 rows, i64 d, i64 chunk) { \
    i64 j = (i64)blockIdx.x * blockDim.x + threadIdx.x; \
    if (j >= d) return; \
    i64 c = blockIdx.y, r0 = c * chunk, r1 = min(rows, r0 + chunk); \
    float aw = 0.0f, ab = 0.0f; \
    for (i64 r = r0; r < r1; ++r) { \
        float gv = ld(g, r * d + j); \
        aw += gv * (ld(x, r * d + j) - mean[r]) * rstd[r]; \
        ab += gv; \
    } \
    if (pw) pw[c * d + j] = aw; \
    if (pb) pb[c * d + j] = ab; \
}
LAYER_NORM(f32, float)
LAYER_NORM(bf16, bf16_t)

// Cross-entropy over logits [N, V] (f32 or bf16) with i64 targets, one block per row. Targets
// are checked in range on the host when their values are there; a target the device computed
// outside 0..V (and not ignored) gives a NaN loss, which stops the step, never a wild read. Forward: loss = (1−ε)(lse − x_t) + ε(lse − mean x), 0 on ignored rows; the
// per-row logsumexp is kept for the backward: dx = (softmax − ε/V)·scale, minus (1−ε)·scale at
// the target.

#define CROSS_ENTROPY(SUF, T) \
extern "C" __global__ void cross_entropy_##SUF(const T* logits, const i64* targets, float* loss, float* lse, \
        i64 v, int has_ignore, i64 ignore, float eps) { \
    __shared__ float buf[32]; \
    i64 row = blockIdx.x; \
    i64 t = targets[row]; \
    if (has_ignore && t == ignore) { \
        if (threadIdx.x == 0) { loss[row] = 0.0f; lse[row] = 0.0f; } \
        return; \
    } \
    if (t < 0 || t >= v) { \
        if (threadIdx.x == 0) { loss[row] = __int_as_float(0x7fc00000); lse[row] = 0.0f; } \
        return; \
    } \
    const T* x = logits + row * v; \
    float m = NEG_INF; \
    for (i64 k = threadIdx.x; k < v; k += blockDim.x) m = fmaxf(m, ld(x, k)); \
    m = block_max(m, buf); \
    float s = 0.0f, sum = 0.0f; \
    for (i64 k = threadIdx.x; k < v; k += blockDim.x) { float xv = ld(x, k); s += expf(xv - m); sum += xv; } \
    s = block_sum(s, buf); \
    sum = block_sum(sum, buf); \
    if (threadIdx.x == 0) { \
        float z = m + logf(s); \
        float nll = z - ld(x, t); \
        loss[row] = eps > 0.0f ? (1.0f - eps) * nll + eps * (z - sum / (float)v) : nll; \
        lse[row] = z; \
    } \
} \
extern "C" __global__ void cross_entropy_backward_##SUF(const T* logits, const i64* targets, const float* lse, \
        const float* scale, T* dx, i64 v, int has_ignore, i64 ignore, float eps) { \
    i64 row = blockIdx.x; \
    i64 t = targets[row]; \
    float sc = scale[row]; \
    const T* x = logits + row * v; \
    T* d = dx + row * v; \
    bool skip = (has_ignore && t == ignore) || sc == 0.0f; \
    float z = lse[row], floor = eps / (float)v; \
    for (i64 k = threadIdx.x; k < v; k += blockDim.x) { \
        float g = skip ? 0.0f : (expf(ld(x, k) - z) - floor) * sc; \
        if (!skip && k == t) g -= (1.0f - eps) * sc; \
        st(d, k, g); \
    } \
}
CROSS_ENTROPY(f32, float)
CROSS_ENTROPY(bf16, bf16_t)

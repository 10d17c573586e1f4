// Embedding lookup and its deterministic backward. The backward never uses atomics: the host
// groups the positions by token (a stable sort of the ids), and one thread per (token, column)
// sums that token's gradient rows in position order.

#define EMBEDDING(SUF, T) \
extern "C" __global__ void embedding_##SUF(const T* weight, const i64* ids, T* out, i64 n, i64 d) { \
    FOR_EACH(t, n * d) { \
        i64 r = t / d, j = t % d; \
        out[t] = weight[ids[r] * d + j]; \
    } \
} \
/* grid: (unique tokens, column blocks); order: positions sorted by token; starts: CSR offsets */ \
extern "C" __global__ void embedding_backward_##SUF(const T* g, const i64* order, const i64* starts, \
        const i64* tokens, float* dw, i64 d) { \
    i64 j = (i64)blockIdx.y * blockDim.x + threadIdx.x; \
    if (j >= d) return; \
    i64 u = blockIdx.x; \
    float acc = 0.0f; \
    for (i64 k = starts[u]; k < starts[u + 1]; ++k) acc += ld(g, order[k] * d + j); \
    dw[tokens[u] * d + j] = acc; \
}
EMBEDDING(f32, float)
EMBEDDING(bf16, bf16_t)

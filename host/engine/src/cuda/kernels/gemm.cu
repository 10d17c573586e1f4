// Batch-invariant matrix products (batch-invariant mode, RL rollouts and logprobs): c[b] =
// a[b] · b[b] with a [m, k], b [k, n], c [m, n] row-major. Every output element is one fused
// multiply-add chain over k in order, starting from zero, accumulated in f32: the same bits
// whatever the row count, the tile an element falls in or the batch it sits in, and for f32
// operands the bits of the CPU's packed kernel (cpu::sgemm). cuBLAS picks its algorithm (split
// k, tile shape) by size, so a decode step's row would round differently than the same row in a
// full forward; this kernel is slower than cuBLAS and only runs in that mode.
//
// A block of 256 threads computes a GT×GT tile of c, thread (ty, tx) the elements at rows
// ty + 16i and columns tx + 16j (i, j < 4); a and b are staged through shared memory GK values
// of k at a time. The k loop stops at k itself (no zero padding: fma(0, 0, -0) would turn a
// negative zero positive).

#define GT 64
#define GK 16

#define GEMM_INVARIANT(SUF, T) \
extern "C" __global__ void gemm_invariant_##SUF(const T* a, const T* b, T* c, i64 m, i64 k, i64 n) { \
    __shared__ float as[GK][GT + 1]; \
    __shared__ float bs[GK][GT]; \
    const T* ab = a + (i64)blockIdx.z * m * k; \
    const T* bb = b + (i64)blockIdx.z * k * n; \
    T* cb = c + (i64)blockIdx.z * m * n; \
    i64 r0 = (i64)blockIdx.y * GT, c0 = (i64)blockIdx.x * GT; \
    int tx = threadIdx.x % 16, ty = threadIdx.x / 16; \
    float acc[4][4]; \
    for (int i = 0; i < 4; ++i) for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f; \
    for (i64 k0 = 0; k0 < k; k0 += GK) { \
        for (int e = threadIdx.x; e < GT * GK; e += blockDim.x) { \
            int r = e / GK, ka = e % GK; \
            i64 gr = r0 + r, gka = k0 + ka; \
            as[ka][r] = gr < m && gka < k ? ld(ab, gr * k + gka) : 0.0f; \
            int kb = e / GT, col = e % GT; \
            i64 gkb = k0 + kb, gc = c0 + col; \
            bs[kb][col] = gkb < k && gc < n ? ld(bb, gkb * n + gc) : 0.0f; \
        } \
        __syncthreads(); \
        int steps = (int)min((i64)GK, k - k0); \
        for (int kk = 0; kk < steps; ++kk) { \
            float av[4], bv[4]; \
            for (int i = 0; i < 4; ++i) av[i] = as[kk][ty + 16 * i]; \
            for (int j = 0; j < 4; ++j) bv[j] = bs[kk][tx + 16 * j]; \
            for (int i = 0; i < 4; ++i) \
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]); \
        } \
        __syncthreads(); \
    } \
    for (int i = 0; i < 4; ++i) { \
        i64 r = r0 + ty + 16 * i; \
        if (r >= m) continue; \
        for (int j = 0; j < 4; ++j) { \
            i64 col = c0 + tx + 16 * j; \
            if (col < n) st(cb, r * n + col, acc[i][j]); \
        } \
    } \
}
GEMM_INVARIANT(f32, float)
GEMM_INVARIANT(bf16, bf16_t)

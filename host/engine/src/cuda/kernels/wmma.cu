// Tensor-core bf16 products through nvcuda::wmma: c[m, n] = a[m, k] · b in f32, b either [k, n]
// row-major (`_nn`) or given as bᵀ, [n, k] row-major (`_nt`: b column-major, the layout of a
// linear layer's weight), m, n and k multiples of 16. What they are for: the tested vehicle of the
// wmma fragments and cp.async (kernels/include/ on the GPU, the CUDA emulation's include/ in CI)
// that tensor-core attention builds on; the backend's bf16 products stay on cuBLAS, which is
// faster than this.
//
// A block of 4 warps computes a WT×WT tile of c, warp w the 16×16 tile (w / 2, w % 2) of it, with
// one f32 accumulator fragment. The k dimension goes by WK: the block stages a's WT×WK and b's
// WK×WT slices in shared memory by cp.async, 16 bytes per thread and matrix (rows past m or
// columns past n zero-filled), double-buffered so the next slice loads while this one multiplies.
// Each warp then loads its fragments from shared memory and accumulates, in k order.

#include <mma.h>
#include <cuda_pipeline.h>

using namespace nvcuda;

#define WT 32
#define WK 16

// Stage k slice [k0, k0 + WK) of the block's rows of a and columns of b into `as` (WT rows of WK)
// and `bs` (nn: WK rows of WT; nt: WT rows of WK). Threads 0–63 copy a, 64–127 copy b, 8 bf16 each.
template <bool BT>
__device__ __forceinline__ void wmma_stage(bf16_t* as, bf16_t* bs, const bf16_t* a, const bf16_t* b,
        i64 m, i64 n, i64 k, i64 r0, i64 c0, i64 k0) {
    int e = threadIdx.x;
    if (e < 64) {
        int row = e / 2, kc = (e % 2) * 8;
        bool in = r0 + row < m;
        const bf16_t* src = in ? a + (r0 + row) * k + k0 + kc : a;
        __pipeline_memcpy_async(as + row * WK + kc, src, 16, in ? 0 : 16);
    } else if (BT) {
        e -= 64;
        int col = e / 2, kc = (e % 2) * 8;
        bool in = c0 + col < n;
        const bf16_t* src = in ? b + (c0 + col) * k + k0 + kc : b;
        __pipeline_memcpy_async(bs + col * WK + kc, src, 16, in ? 0 : 16);
    } else {
        e -= 64;
        int kk = e / 4, cc = (e % 4) * 8;
        bool in = c0 + cc < n;
        const bf16_t* src = in ? b + (k0 + kk) * n + c0 + cc : b;
        __pipeline_memcpy_async(bs + kk * WT + cc, src, 16, in ? 0 : 16);
    }
}

// b's fragment layout: column-major when b comes transposed.
template <bool BT> struct WmmaB { typedef wmma::row_major layout; };
template <> struct WmmaB<true> { typedef wmma::col_major layout; };

// grid (ceil(n / WT), ceil(m / WT)), 128 threads.
template <bool BT>
__device__ void wmma_gemm(const bf16_t* a, const bf16_t* b, float* c, i64 m, i64 n, i64 k) {
    __shared__ __align__(32) bf16_t as[2][WT * WK];
    __shared__ __align__(32) bf16_t bs[2][WT * WK];
    typedef typename WmmaB<BT>::layout BLayout;
    int warp = threadIdx.x / 32, wr = warp / 2, wc = warp % 2;
    i64 r0 = (i64)blockIdx.y * WT, c0 = (i64)blockIdx.x * WT;
    // Warp-uniform: a warp whose tile is past m or n stages its share but multiplies nothing.
    bool active = r0 + wr * 16 < m && c0 + wc * 16 < n;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    wmma_stage<BT>(as[0], bs[0], a, b, m, n, k, r0, c0, 0);
    __pipeline_commit();
    int buf = 0;
    for (i64 k0 = 0; k0 < k; k0 += WK, buf ^= 1) {
        if (k0 + WK < k) wmma_stage<BT>(as[buf ^ 1], bs[buf ^ 1], a, b, m, n, k, r0, c0, k0 + WK);
        __pipeline_commit();
        __pipeline_wait_prior(1);
        __syncthreads();
        if (active) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, BLayout> fb;
            wmma::load_matrix_sync(fa, (const __nv_bfloat16*)(as[buf] + wr * 16 * WK), WK);
            if (BT)
                wmma::load_matrix_sync(fb, (const __nv_bfloat16*)(bs[buf] + wc * 16 * WK), WK);
            else
                wmma::load_matrix_sync(fb, (const __nv_bfloat16*)(bs[buf] + wc * 16), WT);
            wmma::mma_sync(acc, fa, fb, acc);
        }
        __syncthreads();
    }
    if (active)
        wmma::store_matrix_sync(c + (r0 + wr * 16) * n + c0 + wc * 16, acc, (unsigned)n,
                                wmma::mem_row_major);
}

extern "C" __global__ void wmma_gemm_bf16_nn(const bf16_t* a, const bf16_t* b, float* c, i64 m, i64 n,
        i64 k) {
    wmma_gemm<false>(a, b, c, m, n, k);
}

extern "C" __global__ void wmma_gemm_bf16_nt(const bf16_t* a, const bf16_t* b, float* c, i64 m, i64 n,
        i64 k) {
    wmma_gemm<true>(a, b, c, m, n, k);
}

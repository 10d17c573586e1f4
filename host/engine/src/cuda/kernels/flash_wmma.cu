// Tensor-core attention forward for bf16 (FlashAttention-2 style): a block takes WQ query rows,
// 16 per warp, and walks the keys in tiles of WKT staged in shared memory by cp.async. Per tile
// and warp, S = Q·Kᵀ on tensor cores (bf16 products, f32 accumulation) into shared memory, then
// the online softmax in f32 (two lanes per query row: mask, soft-cap, running max and sum), P
// rounded to bf16, and P·V on tensor cores, added into the output rows the lanes hold in
// registers, rescaled as the max moves. Masks, GQA, soft-capping and sinks are attention.cu's
// (`AttnDims`, `visible`), and the results flash.cu's up to bf16 rounding of P and the order of
// the f32 sums; flash.cu stays the kernel of f32 and of batch-invariant mode.
//
// Fragments never go through their element layout (which CUDA leaves unspecified): scores and
// each 16-column slice of P·V leave the tensor cores through store_matrix_sync into the warp's
// own shared scratch, from which lane l reads row l / 2, columns 8·(l % 2) .. + 8 of the slice.
//
// Head dims D and Dv are multiples of 16 up to 16·WMAXC. Dynamic shared memory (bytes):
// Q WQ·D·2, K WKT·D·2, V WKT·Dv·2, then per warp S (16·WKT f32, also the P·V scratch) and
// P (16·WKT bf16): 192·D + 64·Dv + 12288, at most 45056 at D = Dv = 128.

#include <mma.h>
#include <cuda_pipeline.h>

using namespace nvcuda;

#define WQ 64
#define WKT 32
#define WWARPS (WQ / 16)
#define WMAXC 8

// Rows [r0, r0 + rows) of a [total, width] bf16 tensor into shared memory by 16-byte cp.async
// copies, rows past `total` zero-filled; the caller commits and waits.
__device__ __forceinline__ void fw_stage(bf16_t* dst, const bf16_t* src, i64 r0, int rows, i64 total,
        i64 width) {
    int chunks = (int)(width / 8);
    for (int e = threadIdx.x; e < rows * chunks; e += blockDim.x) {
        int r = e / chunks, c = (e % chunks) * 8;
        bool in = r0 + r < total;
        __pipeline_memcpy_async(dst + (i64)r * width + c, in ? src + (r0 + r) * width + c : src, 16,
                                in ? 0 : 16);
    }
}

// Whether any query of the block's rows sees any key of the tile at j0; a block-wide barrier.
__device__ __forceinline__ bool fw_any_visible(const AttnDims& a, const i64* q_pos, const i64* k_pos,
        i64 q0, i64 j0) {
    int vis = 0;
    for (int e = threadIdx.x; e < WQ * WKT; e += blockDim.x) {
        i64 i = q0 + e / WKT, j = j0 + e % WKT;
        vis |= i < a.tq && j < a.tk && visible(a, q_pos[i], k_pos[j]);
    }
    return __syncthreads_or(vis) != 0;
}

// grid (ceil(Tq / WQ), B·Hq), WWARPS·32 threads; the arguments of flash_fwd_bf16.
extern "C" __global__ void flash_wmma_fwd_bf16(const bf16_t* q, const bf16_t* k, const bf16_t* v,
        const float* sinks, const i64* q_pos, const i64* k_pos, bf16_t* out, float* lse, AttnDims a) {
    extern __shared__ __align__(128) unsigned char fw_smem[];
    bf16_t* qs = (bf16_t*)fw_smem;
    bf16_t* ks = qs + WQ * a.d;
    bf16_t* vs = ks + WKT * a.d;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float* ss = (float*)(vs + WKT * a.dv) + warp * 16 * WKT;
    bf16_t* ps = (bf16_t*)((float*)(vs + WKT * a.dv) + WWARPS * 16 * WKT) + warp * 16 * WKT;
    i64 q0 = (i64)blockIdx.x * WQ, bh = blockIdx.y;
    i64 h = bh % a.hq, bb = bh / a.hq, kvh = bb * a.hkv + h / (a.hq / a.hkv);
    const bf16_t* kh = k + kvh * a.tk * a.d;
    const bf16_t* vh = v + kvh * a.tk * a.dv;
    fw_stage(qs, q + bh * a.tq * a.d, q0, WQ, a.tq, a.d);
    __pipeline_commit();

    // This lane's query row and its half of a tile's (or a 16-column slice's) columns.
    int r = lane / 2, half = lane % 2;
    i64 qi = q0 + warp * 16 + r;
    int dchunks = (int)(a.dv / 16);
    // Row statistics (the same in both lanes of a row); a sink starts the row's softmax.
    float m = a.has_sinks ? sinks[h] : NEG_INF, l = a.has_sinks ? 1.0f : 0.0f;
    float acc[WMAXC * 8];
#pragma unroll
    for (int n = 0; n < WMAXC * 8; ++n) acc[n] = 0.0f;

    const __nv_bfloat16* qw = (const __nv_bfloat16*)(qs + warp * 16 * a.d);
    for (i64 j0 = 0; j0 < a.tk; j0 += WKT) {
        if (!fw_any_visible(a, q_pos, k_pos, q0, j0)) continue;
        fw_stage(ks, kh, j0, WKT, a.tk, a.d);
        fw_stage(vs, vh, j0, WKT, a.tk, a.dv);
        __pipeline_commit();
        __pipeline_wait_prior(0);
        __syncthreads();

        // S = Q·Kᵀ for the warp's 16 rows, 16 keys at a time (K row-major is Kᵀ column-major).
        for (int sub = 0; sub < WKT / 16; ++sub) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> s;
            wmma::fill_fragment(s, 0.0f);
            for (i64 kk = 0; kk < a.d; kk += 16) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fq;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fk;
                wmma::load_matrix_sync(fq, qw + kk, (unsigned)a.d);
                wmma::load_matrix_sync(fk, (const __nv_bfloat16*)(ks + sub * 16 * a.d + kk), (unsigned)a.d);
                wmma::mma_sync(s, fq, fk, s);
            }
            wmma::store_matrix_sync(ss + sub * 16, s, WKT, wmma::mem_row_major);
        }
        __syncwarp();

        // Online softmax over the tile: this lane's 16 columns of row r, then the row's pair.
        float sv[WKT / 2];
        float mt = m;
#pragma unroll
        for (int c = 0; c < WKT / 2; ++c) {
            int col = half * (WKT / 2) + c;
            i64 j = j0 + col;
            float x = NEG_INF;
            if (qi < a.tq && j < a.tk && visible(a, q_pos[qi], k_pos[j])) {
                x = ss[r * WKT + col] * a.scale;
                if (a.softcap > 0.0f) x = a.softcap * tanhf(x / a.softcap);
            }
            sv[c] = x;
            mt = fmaxf(mt, x);
        }
        mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
        float al = (mt == NEG_INF || m == NEG_INF) ? (m == NEG_INF ? 0.0f : 1.0f) : expf(m - mt);
        float sum = 0.0f;
#pragma unroll
        for (int c = 0; c < WKT / 2; ++c) {
            float p = (mt == NEG_INF || sv[c] == NEG_INF) ? 0.0f : expf(sv[c] - mt);
            ps[r * WKT + half * (WKT / 2) + c] = f32_to_bf16(p);
            sum += p;
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        l = l * al + sum;
        m = mt;
        __syncwarp();

        // O = O·al + P·V, 16 columns of V at a time through the warp's scratch (S is spent).
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fp[WKT / 16];
#pragma unroll
        for (int kk = 0; kk < WKT / 16; ++kk)
            wmma::load_matrix_sync(fp[kk], (const __nv_bfloat16*)(ps + kk * 16), WKT);
#pragma unroll
        for (int n = 0; n < WMAXC; ++n) {
            if (n >= dchunks) break;
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> o;
            wmma::fill_fragment(o, 0.0f);
#pragma unroll
            for (int kk = 0; kk < WKT / 16; ++kk) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fv;
                wmma::load_matrix_sync(fv, (const __nv_bfloat16*)(vs + kk * 16 * a.dv + n * 16), (unsigned)a.dv);
                wmma::mma_sync(o, fp[kk], fv, o);
            }
            wmma::store_matrix_sync(ss, o, 16, wmma::mem_row_major);
            __syncwarp();
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[n * 8 + e] = acc[n * 8 + e] * al + ss[r * 16 + half * 8 + e];
            __syncwarp();
        }
        __syncthreads();
    }
    __pipeline_wait_prior(0);
    if (qi >= a.tq) return;
    float z = (l > 0.0f && m != NEG_INF) ? m + logf(l) : NEG_INF;
    bf16_t* orow = out + (bh * a.tq + qi) * a.dv;
#pragma unroll
    for (int n = 0; n < WMAXC; ++n) {
        if (n >= dchunks) break;
#pragma unroll
        for (int e = 0; e < 8; ++e) orow[n * 16 + half * 8 + e] = f32_to_bf16(z == NEG_INF ? 0.0f : acc[n * 8 + e] / l);
    }
    if (half == 0) lse[bh * a.tq + qi] = z;
}

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

// ---- The backward on tensor cores (FlashAttention-2's two passes, bf16 products, f32 sums) ----
//
// From the forward's log-sum-exp and delta_i = Σ_c dO_ic O_ic (attention_delta): per query row
// i and key j, P_ij = exp(score(S_ij) − lse_i), dS_ij = P_ij (dP_ij − delta_i) score'(S_ij) with
// dP = dO·Vᵀ; then dQ = dS·K, dK = dSᵀ·Q, dV = Pᵀ·dO. Two kernels so no sum crosses blocks (no
// atomics, fixed order): flash_wmma_dq_bf16 walks the keys for a block of query rows,
// flash_wmma_dkv_bf16 walks the queries of every head of a key head's group for a block of key
// rows. P and dS are rounded to bf16 for their products, as FlashAttention-2 does; scores and
// the softmax are f32. As in the forward, fragments leave the tensor cores only through
// store_matrix_sync into the warp's scratch (lane l: row l / 2, 8 columns of a 16-column slice).

#define BQ 32   // dq: query rows per block (2 warps)
#define BKT 32  // dq: keys per tile
#define BK 64   // dkv: key rows per block (4 warps)
#define BQT 16  // dkv: queries per tile

// The score of a raw product s (softmax's input) and its derivative.
__device__ __forceinline__ float bw_score(const AttnDims& a, float s, float* dscore) {
    float x = s * a.scale;
    if (a.softcap > 0.0f) {
        float t = tanhf(x / a.softcap);
        *dscore = a.scale * (1.0f - t * t);
        return a.softcap * t;
    }
    *dscore = a.scale;
    return x;
}

// Whether any of queries [q0, q0 + nq) sees any of keys [j0, j0 + nk); a block-wide barrier.
__device__ __forceinline__ bool bw_any_visible(const AttnDims& a, const i64* q_pos,
        const i64* k_pos, i64 q0, int nq, i64 j0, int nk) {
    int vis = 0;
    for (int e = threadIdx.x; e < nq * nk; e += blockDim.x) {
        i64 i = q0 + e / nk, j = j0 + e % nk;
        vis |= i < a.tq && j < a.tk && visible(a, q_pos[i], k_pos[j]);
    }
    return __syncthreads_or(vis) != 0;
}

// acc[n·8 + e] += the 16×16 product a·b over `kk` 16-wide steps, for every 16-column slice n of
// the output (`chunks` of them): a from `a` (row-major, lda), b's slice n at b + n·16 (row-major,
// ldb, `step` elements between its 16-row steps), through the warp's scratch `sc` (16×16 f32).
__device__ __forceinline__ void bw_accumulate(float* acc, const __nv_bfloat16* a, unsigned lda,
        const __nv_bfloat16* b, unsigned ldb, i64 step, int steps, int chunks, float* sc, int r,
        int half) {
    for (int n = 0; n < WMAXC; ++n) {
        if (n >= chunks) break;
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> o;
        wmma::fill_fragment(o, 0.0f);
        for (int kk = 0; kk < steps; ++kk) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fb;
            wmma::load_matrix_sync(fa, a + kk * 16, lda);
            wmma::load_matrix_sync(fb, b + kk * step + n * 16, ldb);
            wmma::mma_sync(o, fa, fb, o);
        }
        wmma::store_matrix_sync(sc, o, 16, wmma::mem_row_major);
        __syncwarp();
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[n * 8 + e] += sc[r * 16 + half * 8 + e];
        __syncwarp();
    }
}

// out[16 × 16·cols] (f32, ld) = a[16 × depth] · bᵀ where b is [16·cols × depth] row-major (so
// column-major as bᵀ): scores from rows of two operands, `cols` 16-column slices.
__device__ __forceinline__ void bw_scores(float* out, unsigned ld, const __nv_bfloat16* a,
        const __nv_bfloat16* b, i64 depth, int cols) {
    for (int sub = 0; sub < cols; ++sub) {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> s;
        wmma::fill_fragment(s, 0.0f);
        for (i64 kk = 0; kk < depth; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
            wmma::load_matrix_sync(fa, a + kk, (unsigned)depth);
            wmma::load_matrix_sync(fb, b + sub * 16 * depth + kk, (unsigned)depth);
            wmma::mma_sync(s, fa, fb, s);
        }
        wmma::store_matrix_sync(out + sub * 16, s, ld, wmma::mem_row_major);
    }
}

// grid (ceil(Tq / BQ), B·Hq), 64 threads; dynamic shared memory 128·(D + Dv) + 6144 bytes:
// Q and dO of the block's rows, a K and a V tile, per warp scores (f32) and dS (bf16).
extern "C" __global__ void flash_wmma_dq_bf16(const bf16_t* q, const bf16_t* k, const bf16_t* v,
        const bf16_t* dout, const float* lse, const float* delta, const i64* q_pos,
        const i64* k_pos, float* dq, AttnDims a) {
    extern __shared__ __align__(128) unsigned char bw_smem[];
    bf16_t* qs = (bf16_t*)bw_smem;
    bf16_t* dos = qs + BQ * a.d;
    bf16_t* ks = dos + BQ * a.dv;
    bf16_t* vs = ks + BKT * a.d;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float* ss = (float*)(vs + BKT * a.dv) + warp * 16 * BKT;
    bf16_t* ps = (bf16_t*)((float*)(vs + BKT * a.dv) + (BQ / 16) * 16 * BKT) + warp * 16 * BKT;
    i64 q0 = (i64)blockIdx.x * BQ, bh = blockIdx.y;
    i64 h = bh % a.hq, bb = bh / a.hq, kvh = bb * a.hkv + h / (a.hq / a.hkv);
    const bf16_t* kh = k + kvh * a.tk * a.d;
    const bf16_t* vh = v + kvh * a.tk * a.dv;
    fw_stage(qs, q + bh * a.tq * a.d, q0, BQ, a.tq, a.d);
    fw_stage(dos, dout + bh * a.tq * a.dv, q0, BQ, a.tq, a.dv);
    __pipeline_commit();

    int r = lane / 2, half = lane % 2;
    i64 qi = q0 + warp * 16 + r;
    float li = qi < a.tq ? lse[bh * a.tq + qi] : NEG_INF;
    float di = qi < a.tq ? delta[bh * a.tq + qi] : 0.0f;
    float acc[WMAXC * 8];
#pragma unroll
    for (int n = 0; n < WMAXC * 8; ++n) acc[n] = 0.0f;
    const __nv_bfloat16* qw = (const __nv_bfloat16*)(qs + warp * 16 * a.d);
    const __nv_bfloat16* dow = (const __nv_bfloat16*)(dos + warp * 16 * a.dv);

    for (i64 j0 = 0; j0 < a.tk; j0 += BKT) {
        if (!bw_any_visible(a, q_pos, k_pos, q0, BQ, j0, BKT)) continue;
        fw_stage(ks, kh, j0, BKT, a.tk, a.d);
        fw_stage(vs, vh, j0, BKT, a.tk, a.dv);
        __pipeline_commit();
        __pipeline_wait_prior(0);
        __syncthreads();

        // P of this lane's half of row r, from S = Q·Kᵀ.
        bw_scores(ss, BKT, qw, (const __nv_bfloat16*)ks, a.d, BKT / 16);
        __syncwarp();
        float pv[BKT / 2], dsc[BKT / 2];
#pragma unroll
        for (int c = 0; c < BKT / 2; ++c) {
            int col = half * (BKT / 2) + c;
            i64 j = j0 + col;
            float p = 0.0f, d = 0.0f;
            if (qi < a.tq && j < a.tk && li != NEG_INF && visible(a, q_pos[qi], k_pos[j])) {
                float x = bw_score(a, ss[r * BKT + col], &d);
                p = expf(x - li);
            }
            pv[c] = p;
            dsc[c] = d;
        }
        __syncwarp();
        // dP = dO·Vᵀ, then dS (bf16) for the product with K.
        bw_scores(ss, BKT, dow, (const __nv_bfloat16*)vs, a.dv, BKT / 16);
        __syncwarp();
#pragma unroll
        for (int c = 0; c < BKT / 2; ++c) {
            int col = half * (BKT / 2) + c;
            ps[r * BKT + col] = f32_to_bf16(pv[c] * (ss[r * BKT + col] - di) * dsc[c]);
        }
        __syncwarp();
        // dQ += dS·K.
        bw_accumulate(acc, (const __nv_bfloat16*)ps, BKT, (const __nv_bfloat16*)ks, (unsigned)a.d,
                      16 * a.d, BKT / 16, (int)(a.d / 16), ss, r, half);
        __syncthreads();
    }
    __pipeline_wait_prior(0);
    if (qi >= a.tq) return;
    float* row = dq + (bh * a.tq + qi) * a.d;
    for (int n = 0; n < WMAXC; ++n) {
        if (n >= a.d / 16) break;
#pragma unroll
        for (int e = 0; e < 8; ++e) row[n * 16 + half * 8 + e] = acc[n * 8 + e];
    }
}

// grid (ceil(Tk / BK), B·Hkv), 128 threads; dynamic shared memory 160·(D + Dv) + 6272 bytes:
// K and V of the block's rows, a Q and a dO tile with their lse and delta, per warp scores
// (f32) and P / dS (bf16).
extern "C" __global__ void flash_wmma_dkv_bf16(const bf16_t* q, const bf16_t* k, const bf16_t* v,
        const bf16_t* dout, const float* lse, const float* delta, const i64* q_pos,
        const i64* k_pos, float* dk, float* dv, AttnDims a) {
    extern __shared__ __align__(128) unsigned char bw_smem[];
    bf16_t* ks = (bf16_t*)bw_smem;
    bf16_t* vs = ks + BK * a.d;
    bf16_t* qs = vs + BK * a.dv;
    bf16_t* dos = qs + BQT * a.d;
    float* lse_s = (float*)(dos + BQT * a.dv);
    float* del_s = lse_s + BQT;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float* ss = del_s + BQT + warp * 16 * BQT;
    bf16_t* ps = (bf16_t*)(del_s + BQT + (BK / 16) * 16 * BQT) + warp * 16 * BQT;
    i64 k0 = (i64)blockIdx.x * BK, bkv = blockIdx.y;
    i64 bb = bkv / a.hkv, group = a.hq / a.hkv, h0 = (bkv % a.hkv) * group;
    fw_stage(ks, k + bkv * a.tk * a.d, k0, BK, a.tk, a.d);
    fw_stage(vs, v + bkv * a.tk * a.dv, k0, BK, a.tk, a.dv);
    __pipeline_commit();

    int r = lane / 2, half = lane % 2;
    i64 kj = k0 + warp * 16 + r;
    float acck[WMAXC * 8], accv[WMAXC * 8];
#pragma unroll
    for (int n = 0; n < WMAXC * 8; ++n) acck[n] = accv[n] = 0.0f;
    const __nv_bfloat16* kw = (const __nv_bfloat16*)(ks + warp * 16 * a.d);
    const __nv_bfloat16* vw = (const __nv_bfloat16*)(vs + warp * 16 * a.dv);

    for (i64 g = 0; g < group; ++g) {
        i64 bh = bb * a.hq + h0 + g;
        for (i64 i0 = 0; i0 < a.tq; i0 += BQT) {
            if (!bw_any_visible(a, q_pos, k_pos, i0, BQT, k0, BK)) continue;
            fw_stage(qs, q + bh * a.tq * a.d, i0, BQT, a.tq, a.d);
            fw_stage(dos, dout + bh * a.tq * a.dv, i0, BQT, a.tq, a.dv);
            __pipeline_commit();
            if (threadIdx.x < BQT) {
                i64 i = i0 + threadIdx.x;
                lse_s[threadIdx.x] = i < a.tq ? lse[bh * a.tq + i] : NEG_INF;
                del_s[threadIdx.x] = i < a.tq ? delta[bh * a.tq + i] : 0.0f;
            }
            __pipeline_wait_prior(0);
            __syncthreads();

            // Pᵀ of this lane's half of key row r, from Sᵀ = K·Qᵀ.
            bw_scores(ss, BQT, kw, (const __nv_bfloat16*)qs, a.d, BQT / 16);
            __syncwarp();
            float pv[BQT / 2], dsc[BQT / 2];
#pragma unroll
            for (int c = 0; c < BQT / 2; ++c) {
                int col = half * (BQT / 2) + c;
                i64 i = i0 + col;
                float p = 0.0f, d = 0.0f;
                if (kj < a.tk && i < a.tq && lse_s[col] != NEG_INF &&
                    visible(a, q_pos[i], k_pos[kj])) {
                    float x = bw_score(a, ss[r * BQT + col], &d);
                    p = expf(x - lse_s[col]);
                }
                pv[c] = p;
                dsc[c] = d;
                ps[r * BQT + col] = f32_to_bf16(p);
            }
            __syncwarp();
            // dV += Pᵀ·dO.
            bw_accumulate(accv, (const __nv_bfloat16*)ps, BQT, (const __nv_bfloat16*)dos,
                          (unsigned)a.dv, 16 * a.dv, BQT / 16, (int)(a.dv / 16), ss, r, half);
            // dPᵀ = V·dOᵀ, then dSᵀ (bf16) for the product with Q.
            bw_scores(ss, BQT, vw, (const __nv_bfloat16*)dos, a.dv, BQT / 16);
            __syncwarp();
#pragma unroll
            for (int c = 0; c < BQT / 2; ++c) {
                int col = half * (BQT / 2) + c;
                ps[r * BQT + col] = f32_to_bf16(pv[c] * (ss[r * BQT + col] - del_s[col]) * dsc[c]);
            }
            __syncwarp();
            // dK += dSᵀ·Q.
            bw_accumulate(acck, (const __nv_bfloat16*)ps, BQT, (const __nv_bfloat16*)qs,
                          (unsigned)a.d, 16 * a.d, BQT / 16, (int)(a.d / 16), ss, r, half);
            __syncthreads();
        }
    }
    __pipeline_wait_prior(0);
    if (kj >= a.tk) return;
    float* krow = dk + (bkv * a.tk + kj) * a.d;
    float* vrow = dv + (bkv * a.tk + kj) * a.dv;
    for (int n = 0; n < WMAXC; ++n) {
        if (n < a.d / 16) {
#pragma unroll
            for (int e = 0; e < 8; ++e) krow[n * 16 + half * 8 + e] = acck[n * 8 + e];
        }
        if (n < a.dv / 16) {
#pragma unroll
            for (int e = 0; e < 8; ++e) vrow[n * 16 + half * 8 + e] = accv[n * 8 + e];
        }
    }
}

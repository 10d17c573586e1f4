// Grouped expert GEMMs for mixture-of-experts in one launch each, with the per-expert row counts
// read on the device only (an i64 [E] tensor), so the host never waits for the routing.
//
// Rows of x [N, K] are grouped by expert: counts[e] consecutive rows for expert e, in expert
// order. Counts are taken as given, without host checks, so the kernels make any counts safe: a
// negative count is 0, a group running past N is cut at N (start_e = min(Σ_{<e} c, N), end_e =
// min(start_e + c_e, N)), rows past the sum of the counts are written as zeros, and no row past
// N (or column past K or M) is ever read or written.
//
// Forward (moe_gemm_*): out [N, M] = rows of x times w[e] (w [E, K, M], `nn`) or w[e]ᵀ
// (w [E, M, K], `nt`). Each expert's rows are cut into row tiles of MG_BM; the tiles of all
// experts, then those of the rows past the counts (zeros), are numbered in order, and block
// (blockIdx.x, blockIdx.y) computes row tile blockIdx.x, columns blockIdx.y·MG_BN.. of out. The
// host launches ceil(N / MG_BM) + E + 1 row tiles, an upper bound for any counts (each group
// wastes less than one tile); blocks past the last tile exit. Each block finds its tile with a
// block-wide scan of the counts (mg_find_tile: O(E / threads) per thread, shared memory
// independent of E).
//
// Weight gradient (moe_wgrad_*): out[e] = x_eᵀ · g_e, [E, K, M] for g [N, M]; grid
// (ceil(M / MG_BN), ceil(K / MG_BM), E); each block walks its expert's rows in chunks, an empty
// group writing zeros.
//
// bf16 on tensor cores (`_wmma_`, sm_80+): 4 warps, each a 32×32 quarter of the 64×64 tile as
// 2×2 16×16 fragments with f32 accumulators; operands staged in shared memory as bf16 with zero
// padding past the valid rows and columns (so any K, M, N work), rows padded by MG_PAD elements
// (leading dims stay multiples of 16 bytes and fragment pointers 32-byte aligned); accumulators
// leave through shared memory (their element layout is unspecified) and are written with bounds
// checks, rounded to bf16. SIMT (f32, or bf16 below sm_80): 256 threads, thread (ty, tx) the 4×4
// elements at rows ty + 16i, columns tx + 16j, staged in f32, fmaf chains in k order.
//
// Deterministic: no atomics; every output element is summed in a fixed order (k, or rows of the
// group, ascending), whatever the grid or the other groups.

#include <mma.h>

using namespace nvcuda;

#define MG_BM 64   // output rows per block (forward: rows of x; weight grad: rows of K)
#define MG_BN 64   // output columns per block
#define MG_BK 32   // k per staging step (wmma forward)
#define MG_PAD 8   // bf16 elements of padding per staged row
#define MG_CP 4    // f32 elements of padding per row of the accumulator scratch
#define MG_WR 32   // rows of x and g per staging step (wmma weight grad)
#define MG_SK 16   // k, or rows, per staging step (SIMT)
#define MG_MAX_THREADS 256

// What a forward block computes: rows [r0, r1) of out for expert e; e = -1: rows past the
// counts (zeros); e = -2: no tile (the block exits).
struct MgTile {
    i64 r0, r1;
    i64 e;
};

// counts[e] clamped to [0, n]: no sum of them overflows, and no group is longer than x.
__device__ __forceinline__ i64 mg_count(const i64* counts, i64 e, i64 n) {
    i64 c = counts[e];
    return c < 0 ? 0 : (c > n ? n : c);
}

// Exclusive prefix of one value per thread across the block, `total` (shared) getting the sum.
// Thread 0 scans the blockDim.x partial sums in order; integer sums are exact, so the result is
// the same in any order. Starts with a barrier, so `sh` may be reused call after call.
__device__ i64 mg_block_exclusive(i64 v, i64* sh, i64* total) {
    __syncthreads();
    sh[threadIdx.x] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        i64 s = 0;
        for (int t = 0; t < (int)blockDim.x; ++t) {
            i64 c = sh[t];
            sh[t] = s;
            s += c;
        }
        *total = s;
    }
    __syncthreads();
    return sh[threadIdx.x];
}

// Row tile `tile` of the forward's numbering (see the top) for `ne` experts over n rows, into
// `out` (shared). Thread t owns the consecutive experts [t·per, (t + 1)·per): a first scan of
// their row sums gives each thread the row where its experts start, a second of their tile
// counts the tile number where they start, and the thread holding `tile` writes it out.
__device__ void mg_find_tile(const i64* counts, i64 ne, i64 n, i64 tile, MgTile* out) {
    __shared__ i64 sh[MG_MAX_THREADS];
    __shared__ i64 rows_total, tiles_total;
    i64 nt = blockDim.x, per = (ne + nt - 1) / nt;
    i64 e0 = min(ne, (i64)threadIdx.x * per), e1 = min(ne, e0 + per);
    i64 rows = 0;
    for (i64 e = e0; e < e1; ++e) rows += mg_count(counts, e, n);
    i64 p = mg_block_exclusive(rows, sh, &rows_total);
    i64 tiles = 0;
    for (i64 e = e0, q = p; e < e1; ++e) {
        i64 c = mg_count(counts, e, n), s = min(q, n), f = min(q + c, n);
        tiles += (f - s + MG_BM - 1) / MG_BM;
        q += c;
    }
    if (threadIdx.x == 0) out->e = -2; // read only after the barriers below
    i64 tp = mg_block_exclusive(tiles, sh, &tiles_total);
    if (tile >= tp && tile < tp + tiles) {
        for (i64 e = e0, q = p, at = tp; e < e1; ++e) {
            i64 c = mg_count(counts, e, n), s = min(q, n), f = min(q + c, n);
            i64 k = (f - s + MG_BM - 1) / MG_BM;
            if (tile < at + k) {
                out->e = e;
                out->r0 = s + (tile - at) * MG_BM;
                out->r1 = min(out->r0 + MG_BM, f);
                break;
            }
            at += k;
            q += c;
        }
    }
    if (threadIdx.x == 0 && tile >= tiles_total) {
        // Rows past the counts' sum: tiles of zeros after the experts' tiles.
        i64 used = min(rows_total, n), r0 = used + (tile - tiles_total) * MG_BM;
        if (r0 < n) {
            out->e = -1;
            out->r0 = r0;
            out->r1 = min(r0 + MG_BM, n);
        }
    }
    __syncthreads();
}

// Rows [start, end) of expert `e` for the weight gradient: a block-wide sum of the counts
// before it (the same clamping as the forward). Written to `range` (shared).
__device__ void mg_expert_rows(const i64* counts, i64 e, i64 n, i64* range) {
    __shared__ i64 sh[MG_MAX_THREADS];
    __shared__ i64 before;
    i64 s = 0;
    for (i64 i = threadIdx.x; i < e; i += blockDim.x) s += mg_count(counts, i, n);
    mg_block_exclusive(s, sh, &before);
    if (threadIdx.x == 0) {
        range[0] = min(before, n);
        range[1] = min(before + mg_count(counts, e, n), n);
    }
    __syncthreads();
}

// ---- tensor cores (bf16) ----

// Stages the ROWS×COLS block at (r0, c0) of a row-major bf16 matrix `src` (leading dim `ld`) into
// `dst` (leading dim `ldd`), zeros at rows ≥ rows_end or columns ≥ cols_end. 8 values per
// thread and step: one 16-byte copy where `vec` says the source allows it (ld a multiple of 8,
// src 16-byte aligned), else one by one.
template <int ROWS, int COLS>
__device__ __forceinline__ void mg_stage(bf16_t* dst, int ldd, const bf16_t* src, i64 ld, i64 r0,
        i64 rows_end, i64 c0, i64 cols_end, bool vec) {
    for (int i = threadIdx.x; i < ROWS * COLS / 8; i += blockDim.x) {
        int r = i / (COLS / 8), c = (i % (COLS / 8)) * 8;
        i64 gr = r0 + r, gc = c0 + c;
        bf16_t* d = dst + r * ldd + c;
        if (gr < rows_end && vec && gc + 8 <= cols_end) {
            *(uint4*)d = *(const uint4*)(src + gr * ld + gc);
        } else {
            for (int j = 0; j < 8; ++j)
                d[j] = gr < rows_end && gc + j < cols_end ? src[gr * ld + gc + j] : (bf16_t)0;
        }
    }
}

// Whether 16-byte copies can read a row-major bf16 matrix with leading dim `ld`.
__device__ __forceinline__ bool mg_vec(const bf16_t* p, i64 ld) {
    return ld % 8 == 0 && ((unsigned long long)p & 15) == 0;
}

typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> MgAcc;

// The 2×2 accumulators of warp (wr, wc) into the tile's f32 scratch `cs` [MG_BM][MG_BN + MG_CP],
// then rows [0, rows) and columns [0, cols) of the tile into out (leading dim ld) at (r0, c0).
__device__ void mg_write_tile(MgAcc (&acc)[2][2], float* cs, bf16_t* out, i64 ld, i64 r0, i64 c0,
        i64 rows, i64 cols) {
    int warp = threadIdx.x / 32, wr = warp / 2, wc = warp % 2;
    const int ldc = MG_BN + MG_CP;
    for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 2; ++j)
            wmma::store_matrix_sync(cs + (wr * 32 + i * 16) * ldc + wc * 32 + j * 16, acc[i][j],
                                    ldc, wmma::mem_row_major);
    __syncthreads();
    for (int i = threadIdx.x; i < MG_BM * MG_BN; i += blockDim.x) {
        int r = i / MG_BN, c = i % MG_BN;
        if (r < rows && c < cols) st(out, (r0 + r) * ld + c0 + c, cs[r * ldc + c]);
    }
}

// b's fragment layout: column-major when w[e] is used transposed.
template <bool NT> struct MgB { typedef wmma::row_major layout; };
template <> struct MgB<true> { typedef wmma::col_major layout; };

// grid (ceil(N / MG_BM) + E + 1, ceil(M / MG_BN)), 128 threads.
template <bool NT>
__device__ void mg_forward_wmma(const bf16_t* x, const bf16_t* w, const i64* counts, bf16_t* out,
        i64 n, i64 k, i64 m, i64 ne) {
    const int lda = MG_BK + MG_PAD, ldb = NT ? MG_BK + MG_PAD : MG_BN + MG_PAD;
    __shared__ __align__(32) bf16_t as[MG_BM * (MG_BK + MG_PAD)];
    // nn: k rows of MG_BN columns; nt: MG_BN rows (columns of out) of k, i.e. b column-major.
    __shared__ __align__(32) bf16_t bs[MG_BN * (MG_BK + MG_PAD)];
    __shared__ __align__(32) float cs[MG_BM * (MG_BN + MG_CP)];
    __shared__ MgTile t;
    mg_find_tile(counts, ne, n, blockIdx.x, &t);
    if (t.e == -2) return;
    i64 c0 = (i64)blockIdx.y * MG_BN;
    if (t.e == -1) {
        for (i64 i = threadIdx.x; i < (t.r1 - t.r0) * MG_BN; i += blockDim.x) {
            i64 r = t.r0 + i / MG_BN, c = c0 + i % MG_BN;
            if (c < m) st(out, r * m + c, 0.0f);
        }
        return;
    }
    const bf16_t* we = w + t.e * k * m;
    bool vx = mg_vec(x, k), vw = mg_vec(we, NT ? k : m);
    int warp = threadIdx.x / 32, wr = warp / 2, wc = warp % 2;
    // Warp-uniform: a warp whose rows or columns all fall outside stages but multiplies nothing.
    bool active = wr * 32 < t.r1 - t.r0 && c0 + wc * 32 < m;
    typedef typename MgB<NT>::layout BLayout;
    MgAcc acc[2][2];
    for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
    for (i64 k0 = 0; k0 < k; k0 += MG_BK) {
        // Rows past the tile's end belong to the next group (or lie past N): zeros, not read.
        mg_stage<MG_BM, MG_BK>(as, lda, x, k, t.r0, t.r1, k0, k, vx);
        if (NT)
            mg_stage<MG_BN, MG_BK>(bs, ldb, we, k, c0, m, k0, k, vw);
        else
            mg_stage<MG_BK, MG_BN>(bs, ldb, we, m, k0, k, c0, m, vw);
        __syncthreads();
        for (int kk = 0; active && kk < MG_BK && k0 + kk < k; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, BLayout> fb[2];
            for (int i = 0; i < 2; ++i)
                wmma::load_matrix_sync(fa[i], (const __nv_bfloat16*)(as + (wr * 32 + i * 16) * lda + kk),
                                       lda);
            for (int j = 0; j < 2; ++j) {
                int col = wc * 32 + j * 16;
                const bf16_t* p = NT ? bs + col * ldb + kk : bs + kk * ldb + col;
                wmma::load_matrix_sync(fb[j], (const __nv_bfloat16*)p, ldb);
            }
            for (int i = 0; i < 2; ++i)
                for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
        }
        __syncthreads();
    }
    mg_write_tile(acc, cs, out, m, t.r0, c0, t.r1 - t.r0, min((i64)MG_BN, m - c0));
}

extern "C" __global__ void moe_gemm_wmma_nn_bf16(const bf16_t* x, const bf16_t* w, const i64* counts,
        bf16_t* out, i64 n, i64 k, i64 m, i64 ne) {
    mg_forward_wmma<false>(x, w, counts, out, n, k, m, ne);
}

extern "C" __global__ void moe_gemm_wmma_nt_bf16(const bf16_t* x, const bf16_t* w, const i64* counts,
        bf16_t* out, i64 n, i64 k, i64 m, i64 ne) {
    mg_forward_wmma<true>(x, w, counts, out, n, k, m, ne);
}

// grid (ceil(M / MG_BN), ceil(K / MG_BM), E), 128 threads. x_eᵀ comes from the staged rows of x
// read as a column-major matrix_a; the group's rows go by MG_WR, in order.
extern "C" __global__ void moe_wgrad_wmma_bf16(const bf16_t* x, const bf16_t* g, const i64* counts,
        bf16_t* out, i64 n, i64 k, i64 m, i64 ne) {
    const int ld = MG_BM + MG_PAD;
    __shared__ __align__(32) bf16_t xs[MG_WR * (MG_BM + MG_PAD)];
    __shared__ __align__(32) bf16_t gs[MG_WR * (MG_BN + MG_PAD)];
    __shared__ __align__(32) float cs[MG_BM * (MG_BN + MG_CP)];
    __shared__ i64 range[2];
    i64 e = blockIdx.z, i0 = (i64)blockIdx.y * MG_BM, j0 = (i64)blockIdx.x * MG_BN;
    mg_expert_rows(counts, e, n, range);
    i64 s = range[0], f = range[1];
    bool vx = mg_vec(x, k), vg = mg_vec(g, m);
    int warp = threadIdx.x / 32, wr = warp / 2, wc = warp % 2;
    bool active = i0 + wr * 32 < k && j0 + wc * 32 < m;
    MgAcc acc[2][2];
    for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
    for (i64 r = s; r < f; r += MG_WR) {
        mg_stage<MG_WR, MG_BM>(xs, ld, x, k, r, f, i0, k, vx);
        mg_stage<MG_WR, MG_BN>(gs, ld, g, m, r, f, j0, m, vg);
        __syncthreads();
        for (int rr = 0; active && rr < MG_WR && r + rr < f; rr += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::col_major> fa[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fb[2];
            for (int i = 0; i < 2; ++i)
                wmma::load_matrix_sync(fa[i], (const __nv_bfloat16*)(xs + rr * ld + wr * 32 + i * 16), ld);
            for (int j = 0; j < 2; ++j)
                wmma::load_matrix_sync(fb[j], (const __nv_bfloat16*)(gs + rr * ld + wc * 32 + j * 16), ld);
            for (int i = 0; i < 2; ++i)
                for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
        }
        __syncthreads();
    }
    mg_write_tile(acc, cs, out + e * k * m, m, i0, j0, min((i64)MG_BM, k - i0),
                  min((i64)MG_BN, m - j0));
}

// ---- SIMT (f32, and bf16 without tensor cores) ----

// grid (ceil(N / MG_BM) + E + 1, ceil(M / MG_BN)), 256 threads.
template <typename T, bool NT>
__device__ void mg_forward_simt(const T* x, const T* w, const i64* counts, T* out, i64 n, i64 k,
        i64 m, i64 ne) {
    __shared__ float as[MG_SK][MG_BM + 1];
    __shared__ float bs[MG_SK][MG_BN];
    __shared__ MgTile t;
    mg_find_tile(counts, ne, n, blockIdx.x, &t);
    if (t.e == -2) return;
    i64 c0 = (i64)blockIdx.y * MG_BN;
    if (t.e == -1) {
        for (i64 i = threadIdx.x; i < (t.r1 - t.r0) * MG_BN; i += blockDim.x) {
            i64 r = t.r0 + i / MG_BN, c = c0 + i % MG_BN;
            if (c < m) st(out, r * m + c, 0.0f);
        }
        return;
    }
    const T* we = w + t.e * k * m;
    int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    float acc[4][4];
    for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
    for (i64 k0 = 0; k0 < k; k0 += MG_SK) {
        for (int i = threadIdx.x; i < MG_BM * MG_SK; i += blockDim.x) {
            int r = i / MG_SK, kk = i % MG_SK;
            i64 gr = t.r0 + r, gk = k0 + kk;
            as[kk][r] = gr < t.r1 && gk < k ? ld(x, gr * k + gk) : 0.0f;
            // nt reads w[e] rows (k contiguous), nn its columns' slices (m contiguous).
            int j = NT ? i / MG_SK : i % MG_BN, kb = NT ? i % MG_SK : i / MG_BN;
            i64 gc = c0 + j, gkb = k0 + kb;
            bs[kb][j] = gc < m && gkb < k ? ld(we, NT ? gc * k + gkb : gkb * m + gc) : 0.0f;
        }
        __syncthreads();
        int steps = (int)min((i64)MG_SK, k - k0);
        for (int kk = 0; kk < steps; ++kk) {
            float av[4], bv[4];
            for (int i = 0; i < 4; ++i) av[i] = as[kk][ty + 16 * i];
            for (int j = 0; j < 4; ++j) bv[j] = bs[kk][tx + 16 * j];
            for (int i = 0; i < 4; ++i)
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
        __syncthreads();
    }
    for (int i = 0; i < 4; ++i) {
        i64 r = t.r0 + ty + 16 * i;
        if (r >= t.r1) continue;
        for (int j = 0; j < 4; ++j) {
            i64 c = c0 + tx + 16 * j;
            if (c < m) st(out, r * m + c, acc[i][j]);
        }
    }
}

// grid (ceil(M / MG_BN), ceil(K / MG_BM), E), 256 threads: the group's rows by MG_SK, in order.
template <typename T>
__device__ void mg_wgrad_simt(const T* x, const T* g, const i64* counts, T* out, i64 n, i64 k,
        i64 m, i64 ne) {
    __shared__ float xs[MG_SK][MG_BM];
    __shared__ float gs[MG_SK][MG_BN];
    __shared__ i64 range[2];
    i64 e = blockIdx.z, i0 = (i64)blockIdx.y * MG_BM, j0 = (i64)blockIdx.x * MG_BN;
    mg_expert_rows(counts, e, n, range);
    i64 s = range[0], f = range[1];
    int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    float acc[4][4];
    for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
    for (i64 r = s; r < f; r += MG_SK) {
        for (int i = threadIdx.x; i < MG_SK * MG_BM; i += blockDim.x) {
            int rr = i / MG_BM, c = i % MG_BM;
            i64 gr = r + rr, gi = i0 + c, gj = j0 + c;
            xs[rr][c] = gr < f && gi < k ? ld(x, gr * k + gi) : 0.0f;
            gs[rr][c] = gr < f && gj < m ? ld(g, gr * m + gj) : 0.0f;
        }
        __syncthreads();
        int steps = (int)min((i64)MG_SK, f - r);
        for (int rr = 0; rr < steps; ++rr) {
            float av[4], bv[4];
            for (int i = 0; i < 4; ++i) av[i] = xs[rr][ty + 16 * i];
            for (int j = 0; j < 4; ++j) bv[j] = gs[rr][tx + 16 * j];
            for (int i = 0; i < 4; ++i)
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
        __syncthreads();
    }
    T* oe = out + e * k * m;
    for (int i = 0; i < 4; ++i) {
        i64 r = i0 + ty + 16 * i;
        if (r >= k) continue;
        for (int j = 0; j < 4; ++j) {
            i64 c = j0 + tx + 16 * j;
            if (c < m) st(oe, r * m + c, acc[i][j]);
        }
    }
}

#define MG_SIMT(SUF, T) \
extern "C" __global__ void moe_gemm_nn_##SUF(const T* x, const T* w, const i64* counts, T* out, \
        i64 n, i64 k, i64 m, i64 ne) { \
    mg_forward_simt<T, false>(x, w, counts, out, n, k, m, ne); \
} \
extern "C" __global__ void moe_gemm_nt_##SUF(const T* x, const T* w, const i64* counts, T* out, \
        i64 n, i64 k, i64 m, i64 ne) { \
    mg_forward_simt<T, true>(x, w, counts, out, n, k, m, ne); \
} \
extern "C" __global__ void moe_wgrad_##SUF(const T* x, const T* g, const i64* counts, T* out, \
        i64 n, i64 k, i64 m, i64 ne) { \
    mg_wgrad_simt<T>(x, g, counts, out, n, k, m, ne); \
}
MG_SIMT(f32, float)
MG_SIMT(bf16, bf16_t)

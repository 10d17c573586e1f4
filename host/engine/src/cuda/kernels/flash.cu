// Tiled attention (FlashAttention-style) for long sequences: a block takes FQ query rows and
// walks the keys in tiles of FK that it stages in shared memory, keeping a running max and sum
// per row (online softmax) and f32 accumulators in registers, so no row of scores is ever held
// whole and the key length is unbounded. Masks, GQA, soft-capping and sinks are those of
// attention.cu (its `AttnDims`, `visible`), and every sum runs in a fixed order (key tiles in
// order, keys in order inside a tile), so results are bitwise reproducible.
//
// Blocks are FQ·FT threads: FT threads per row, thread `t` of a row owning the feature columns
// t, t + FT, ... (at most FMAXC of them, so head dims up to FT·FMAXC). Dynamic shared memory:
// the query tile, the key and value tiles and the FQ×FK score tile, all f32.

#define FQ 16
#define FK 16
#define FT 8
#define FMAXC 32

// The score of query `qrow` (f32 in shared memory) against key `krow` (f32 in shared memory),
// soft-capped; `dcap` receives d(capped)/d(raw).
__device__ __forceinline__ float flash_score(const AttnDims& a, const float* qrow, const float* krow,
        float* dcap) {
    float s = 0.0f;
    for (i64 c = 0; c < a.d; ++c) s += qrow[c] * krow[c];
    s *= a.scale;
    *dcap = 1.0f;
    if (a.softcap > 0.0f) {
        float t = tanhf(s / a.softcap);
        *dcap = 1.0f - t * t;
        s = a.softcap * t;
    }
    return s;
}

// Whether any query of the tile at q0 sees any key of the tile at j0. Also the barrier that
// starts a tile (every thread takes the same branch): a tile with nothing visible (above the
// diagonal, outside the window) is skipped, which leaves the results bit for bit the same
// (it would add zeros and rescale by exactly 1).
__device__ __forceinline__ bool any_visible(const AttnDims& a, const i64* q_pos, const i64* k_pos, i64 q0,
        i64 j0) {
    int vis = 0;
    for (int e = threadIdx.x; e < FQ * FK; e += blockDim.x) {
        i64 i = q0 + e / FK, j = j0 + e % FK;
        vis |= i < a.tq && j < a.tk && visible(a, q_pos[i], k_pos[j]);
    }
    return __syncthreads_or(vis) != 0;
}

// Rows [r0, r0 + FQ) of a [rows, width] tensor into shared memory as f32 (zeros past `rows`).
template <typename T>
__device__ void stage(float* dst, const T* src, i64 r0, i64 rows, i64 width) {
    for (i64 e = threadIdx.x; e < FQ * width; e += blockDim.x) {
        i64 r = r0 + e / width;
        dst[e] = r < rows ? ld(src, r * width + e % width) : 0.0f;
    }
}

// Forward: grid (ceil(Tq / FQ), B·Hq). Shared: FQ·D + FK·(D + Dv) + FQ·FK + 2·FQ floats.
#define FLASH_FWD(SUF, T) \
extern "C" __global__ void flash_fwd_##SUF(const T* q, const T* k, const T* v, const float* sinks, \
        const i64* q_pos, const i64* k_pos, T* out, float* lse, AttnDims a) { \
    extern __shared__ float smem[]; \
    float* qs = smem; \
    float* ks = qs + FQ * a.d; \
    float* vs = ks + FK * a.d; \
    float* ss = vs + FK * a.dv; \
    float* mrow = ss + FQ * FK; \
    float* alpha = mrow + FQ; \
    i64 q0 = (i64)blockIdx.x * FQ, bh = blockIdx.y; \
    i64 h = bh % a.hq, bb = bh / a.hq, kvh = bb * a.hkv + h / (a.hq / a.hkv); \
    const T* kh = k + kvh * a.tk * a.d; \
    const T* vh = v + kvh * a.tk * a.dv; \
    stage(qs, q + bh * a.tq * a.d, q0, a.tq, a.d); \
    int r = threadIdx.x / FT, t = threadIdx.x % FT; \
    /* Row statistics live with the row's first thread; a sink starts the row's softmax. */ \
    float m = a.has_sinks ? sinks[h] : NEG_INF, l = a.has_sinks ? 1.0f : 0.0f; \
    float acc[FMAXC]; \
    for (int n = 0; n < FMAXC; ++n) acc[n] = 0.0f; \
    i64 qi = q0 + r; \
    for (i64 j0 = 0; j0 < a.tk; j0 += FK) { \
        if (!any_visible(a, q_pos, k_pos, q0, j0)) continue; \
        for (i64 e = threadIdx.x; e < FK * a.d; e += blockDim.x) { \
            i64 j = j0 + e / a.d; \
            ks[e] = j < a.tk ? ld(kh, j * a.d + e % a.d) : 0.0f; \
        } \
        for (i64 e = threadIdx.x; e < FK * a.dv; e += blockDim.x) { \
            i64 j = j0 + e / a.dv; \
            vs[e] = j < a.tk ? ld(vh, j * a.dv + e % a.dv) : 0.0f; \
        } \
        __syncthreads(); \
        for (int e = threadIdx.x; e < FQ * FK; e += blockDim.x) { \
            int rr = e / FK, cc = e % FK; \
            i64 i = q0 + rr, j = j0 + cc; \
            float dcap; \
            bool vis = i < a.tq && j < a.tk && visible(a, q_pos[i], k_pos[j]); \
            ss[e] = vis ? flash_score(a, qs + rr * a.d, ks + cc * a.d, &dcap) : NEG_INF; \
        } \
        __syncthreads(); \
        if (t == 0) { \
            float mt = m; \
            for (int c = 0; c < FK; ++c) mt = fmaxf(mt, ss[r * FK + c]); \
            float al = (mt == NEG_INF || m == NEG_INF) ? (m == NEG_INF ? 0.0f : 1.0f) : expf(m - mt); \
            float sum = 0.0f; \
            for (int c = 0; c < FK; ++c) { \
                float p = (mt == NEG_INF || ss[r * FK + c] == NEG_INF) ? 0.0f : expf(ss[r * FK + c] - mt); \
                ss[r * FK + c] = p; \
                sum += p; \
            } \
            l = l * al + sum; \
            m = mt; \
            alpha[r] = al; \
        } \
        __syncthreads(); \
        float al = alpha[r]; \
        for (int n = 0; n < FMAXC; ++n) { \
            i64 c = t + (i64)n * FT; \
            if (c >= a.dv) break; \
            float s = acc[n] * al; \
            for (int cc = 0; cc < FK; ++cc) s += ss[r * FK + cc] * vs[cc * a.dv + c]; \
            acc[n] = s; \
        } \
    } \
    __syncthreads(); \
    if (t == 0) { \
        mrow[r] = (l > 0.0f && m != NEG_INF) ? m + logf(l) : NEG_INF; \
        alpha[r] = l; \
    } \
    __syncthreads(); \
    if (qi >= a.tq) return; \
    float z = mrow[r], lr = alpha[r]; \
    T* orow = out + (bh * a.tq + qi) * a.dv; \
    for (int n = 0; n < FMAXC; ++n) { \
        i64 c = t + (i64)n * FT; \
        if (c >= a.dv) break; \
        st(orow, c, z == NEG_INF ? 0.0f : acc[n] / lr); \
    } \
    if (t == 0) lse[bh * a.tq + qi] = z; \
}
FLASH_FWD(f32, float)
FLASH_FWD(bf16, bf16_t)

// dq: grid (ceil(Tq / FQ), B·Hq). Per key tile: p = exp(s − lse), dp = dO·v, ds = p (dp − delta)
// dcap, then dq += scale · ds·k in the row's registers. Shared: FQ·(D + Dv) + FK·(D + Dv) +
// FQ·FK floats. dq is written in f32.
#define FLASH_DQ(SUF, T) \
extern "C" __global__ void flash_dq_##SUF(const T* q, const T* k, const T* v, const T* g, \
        const float* lse, const float* delta, const i64* q_pos, const i64* k_pos, float* dq, AttnDims a) { \
    extern __shared__ float smem[]; \
    float* qs = smem; \
    float* gs = qs + FQ * a.d; \
    float* ks = gs + FQ * a.dv; \
    float* vs = ks + FK * a.d; \
    float* ds = vs + FK * a.dv; \
    i64 q0 = (i64)blockIdx.x * FQ, bh = blockIdx.y; \
    i64 h = bh % a.hq, bb = bh / a.hq, kvh = bb * a.hkv + h / (a.hq / a.hkv); \
    const T* kh = k + kvh * a.tk * a.d; \
    const T* vh = v + kvh * a.tk * a.dv; \
    stage(qs, q + bh * a.tq * a.d, q0, a.tq, a.d); \
    stage(gs, g + bh * a.tq * a.dv, q0, a.tq, a.dv); \
    int r = threadIdx.x / FT, t = threadIdx.x % FT; \
    float acc[FMAXC]; \
    for (int n = 0; n < FMAXC; ++n) acc[n] = 0.0f; \
    for (i64 j0 = 0; j0 < a.tk; j0 += FK) { \
        if (!any_visible(a, q_pos, k_pos, q0, j0)) continue; \
        for (i64 e = threadIdx.x; e < FK * a.d; e += blockDim.x) { \
            i64 j = j0 + e / a.d; \
            ks[e] = j < a.tk ? ld(kh, j * a.d + e % a.d) : 0.0f; \
        } \
        for (i64 e = threadIdx.x; e < FK * a.dv; e += blockDim.x) { \
            i64 j = j0 + e / a.dv; \
            vs[e] = j < a.tk ? ld(vh, j * a.dv + e % a.dv) : 0.0f; \
        } \
        __syncthreads(); \
        for (int e = threadIdx.x; e < FQ * FK; e += blockDim.x) { \
            int rr = e / FK, cc = e % FK; \
            i64 i = q0 + rr, j = j0 + cc; \
            float val = 0.0f; \
            if (i < a.tq && j < a.tk && visible(a, q_pos[i], k_pos[j])) { \
                float dcap; \
                float s = flash_score(a, qs + rr * a.d, ks + cc * a.d, &dcap); \
                float z = lse[bh * a.tq + i]; \
                float p = z == NEG_INF ? 0.0f : expf(s - z); \
                float dp = 0.0f; \
                for (i64 c = 0; c < a.dv; ++c) dp += gs[rr * a.dv + c] * vs[cc * a.dv + c]; \
                val = p * (dp - delta[bh * a.tq + i]) * dcap; \
            } \
            ds[e] = val; \
        } \
        __syncthreads(); \
        for (int n = 0; n < FMAXC; ++n) { \
            i64 c = t + (i64)n * FT; \
            if (c >= a.d) break; \
            float s = acc[n]; \
            for (int cc = 0; cc < FK; ++cc) s += ds[r * FK + cc] * ks[cc * a.d + c]; \
            acc[n] = s; \
        } \
    } \
    i64 qi = q0 + r; \
    if (qi >= a.tq) return; \
    for (int n = 0; n < FMAXC; ++n) { \
        i64 c = t + (i64)n * FT; \
        if (c >= a.d) break; \
        dq[(bh * a.tq + qi) * a.d + c] = acc[n] * a.scale; \
    } \
}
FLASH_DQ(f32, float)
FLASH_DQ(bf16, bf16_t)

// dk, dv: grid (ceil(Tk / FK), B·Hkv). A block owns FK keys and walks the query rows of every
// head sharing their kv head in (head, query) order, FQ rows at a time: ds and p for the tile,
// then dv += pᵀ·dO and dk += scale · dsᵀ·q in the key's registers. Shared: FK·(D + Dv) +
// FQ·(D + Dv) + 2·FQ·FK floats; blocks are FK·FT threads. dk and dv are written in f32.
#define FLASH_DKV(SUF, T) \
extern "C" __global__ void flash_dkv_##SUF(const T* q, const T* k, const T* v, const T* g, \
        const float* lse, const float* delta, const i64* q_pos, const i64* k_pos, float* dk, float* dv, \
        AttnDims a) { \
    extern __shared__ float smem[]; \
    float* ks = smem; \
    float* vs = ks + FK * a.d; \
    float* qs = vs + FK * a.dv; \
    float* gs = qs + FQ * a.d; \
    float* ps = gs + FQ * a.dv; \
    float* dss = ps + FQ * FK; \
    i64 j0 = (i64)blockIdx.x * FK, bkv = blockIdx.y; \
    i64 bb = bkv / a.hkv, kvhead = bkv % a.hkv, group = a.hq / a.hkv; \
    const T* kh = k + bkv * a.tk * a.d; \
    const T* vh = v + bkv * a.tk * a.dv; \
    for (i64 e = threadIdx.x; e < FK * a.d; e += blockDim.x) { \
        i64 j = j0 + e / a.d; \
        ks[e] = j < a.tk ? ld(kh, j * a.d + e % a.d) : 0.0f; \
    } \
    for (i64 e = threadIdx.x; e < FK * a.dv; e += blockDim.x) { \
        i64 j = j0 + e / a.dv; \
        vs[e] = j < a.tk ? ld(vh, j * a.dv + e % a.dv) : 0.0f; \
    } \
    int r = threadIdx.x / FT, t = threadIdx.x % FT; /* r: this thread's key in the tile */ \
    float adk[FMAXC], adv[FMAXC]; \
    for (int n = 0; n < FMAXC; ++n) { adk[n] = 0.0f; adv[n] = 0.0f; } \
    for (i64 hh = 0; hh < group; ++hh) { \
        i64 h = kvhead * group + hh, bh = bb * a.hq + h; \
        const T* qh = q + bh * a.tq * a.d; \
        const T* gh = g + bh * a.tq * a.dv; \
        for (i64 q0 = 0; q0 < a.tq; q0 += FQ) { \
            if (!any_visible(a, q_pos, k_pos, q0, j0)) continue; \
            stage(qs, qh, q0, a.tq, a.d); \
            stage(gs, gh, q0, a.tq, a.dv); \
            __syncthreads(); \
            for (int e = threadIdx.x; e < FQ * FK; e += blockDim.x) { \
                int rr = e / FK, cc = e % FK; \
                i64 i = q0 + rr, j = j0 + cc; \
                float p = 0.0f, dsv = 0.0f; \
                if (i < a.tq && j < a.tk && visible(a, q_pos[i], k_pos[j])) { \
                    float dcap; \
                    float s = flash_score(a, qs + rr * a.d, ks + cc * a.d, &dcap); \
                    float z = lse[bh * a.tq + i]; \
                    p = z == NEG_INF ? 0.0f : expf(s - z); \
                    float dp = 0.0f; \
                    for (i64 c = 0; c < a.dv; ++c) dp += gs[rr * a.dv + c] * vs[cc * a.dv + c]; \
                    dsv = p * (dp - delta[bh * a.tq + i]) * dcap; \
                } \
                ps[e] = p; \
                dss[e] = dsv; \
            } \
            __syncthreads(); \
            for (int n = 0; n < FMAXC; ++n) { \
                i64 c = t + (i64)n * FT; \
                if (c >= a.dv) break; \
                float s = adv[n]; \
                for (int rr = 0; rr < FQ; ++rr) s += ps[rr * FK + r] * gs[rr * a.dv + c]; \
                adv[n] = s; \
            } \
            for (int n = 0; n < FMAXC; ++n) { \
                i64 c = t + (i64)n * FT; \
                if (c >= a.d) break; \
                float s = adk[n]; \
                for (int rr = 0; rr < FQ; ++rr) s += dss[rr * FK + r] * qs[rr * a.d + c]; \
                adk[n] = s; \
            } \
        } \
    } \
    i64 j = j0 + r; \
    if (j >= a.tk) return; \
    for (int n = 0; n < FMAXC; ++n) { \
        i64 c = t + (i64)n * FT; \
        if (c < a.d) dk[(bkv * a.tk + j) * a.d + c] = adk[n] * a.scale; \
        if (c < a.dv) dv[(bkv * a.tk + j) * a.dv + c] = adv[n]; \
    } \
}
FLASH_DKV(f32, float)
FLASH_DKV(bf16, bf16_t)

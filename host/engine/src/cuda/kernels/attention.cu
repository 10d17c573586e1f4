// Scaled dot-product attention, exact and deterministic: causal and sliding-window masks over
// explicit positions, GQA (query head h reads kv head h / (Hq/Hkv)), logit soft-capping and
// sinks (a per-head logit in every row's softmax denominator, without a value).
//
// The exact kernel (flash.cu is the tiled one, used from a key length on; this one is its
// reference): one block per query row keeps that row's Tk scores in shared memory (dynamic, Tk
// floats), so Tk is bounded by shared memory, and sums run in key (or query) order so results
// are bitwise reproducible. Layouts are
// contiguous q [B, Hq, Tq, D], k [B, Hkv, Tk, D], v [B, Hkv, Tk, Dv]; lse is [B, Hq, Tq] (f32).

// `AttnDims` and `visible` are in attention.cuh (shared with flash.cu).

// The masked, soft-capped logit of query row `qrow` (already in shared memory, f32) against key
// `j`, or -inf when masked. `dcap` receives d(capped)/d(raw) for the backward.
template <typename T>
__device__ float logit(const AttnDims& a, const float* q, const T* kh, i64 j, bool vis, float* dcap) {
    if (!vis) return NEG_INF;
    float s = 0.0f;
    const T* kr = kh + j * a.d;
    for (i64 c = 0; c < a.d; ++c) s += q[c] * ld(kr, c);
    s *= a.scale;
    if (a.softcap > 0.0f) {
        float t = tanhf(s / a.softcap);
        if (dcap) *dcap = 1.0f - t * t;
        s = a.softcap * t;
    } else if (dcap) {
        *dcap = 1.0f;
    }
    return s;
}

// Forward: grid (Tq, B·Hq), shared memory Tk + D floats.
#define ATTN_FWD(SUF, T) \
extern "C" __global__ void attention_fwd_##SUF(const T* q, const T* k, const T* v, const float* sinks, \
        const i64* q_pos, const i64* k_pos, T* out, float* lse, AttnDims a) { \
    extern __shared__ float smem[]; \
    __shared__ float buf[32]; \
    float* s = smem; \
    float* qs = smem + a.tk; \
    i64 i = blockIdx.x, bh = blockIdx.y; \
    i64 h = bh % a.hq, bb = bh / a.hq, kvh = bb * a.hkv + h / (a.hq / a.hkv); \
    const T* qr = q + (bh * a.tq + i) * a.d; \
    for (i64 c = threadIdx.x; c < a.d; c += blockDim.x) qs[c] = ld(qr, c); \
    __syncthreads(); \
    const T* kh = k + kvh * a.tk * a.d; \
    const T* vh = v + kvh * a.tk * a.dv; \
    i64 qp = q_pos[i]; \
    float m = a.has_sinks ? sinks[h] : NEG_INF; \
    for (i64 j = threadIdx.x; j < a.tk; j += blockDim.x) { \
        s[j] = logit(a, qs, kh, j, visible(a, qp, k_pos[j]), (float*)0); \
        m = fmaxf(m, s[j]); \
    } \
    m = block_max(m, buf); \
    float l = 0.0f; \
    for (i64 j = threadIdx.x; j < a.tk; j += blockDim.x) l += s[j] == NEG_INF ? 0.0f : expf(s[j] - m); \
    l = block_sum(l, buf); \
    if (a.has_sinks && m != NEG_INF) l += expf(sinks[h] - m); \
    float z = (l > 0.0f && m != NEG_INF) ? m + logf(l) : NEG_INF; \
    __syncthreads(); \
    for (i64 j = threadIdx.x; j < a.tk; j += blockDim.x) s[j] = (z == NEG_INF || s[j] == NEG_INF) ? 0.0f : expf(s[j] - z); \
    __syncthreads(); \
    T* orow = out + (bh * a.tq + i) * a.dv; \
    for (i64 c = threadIdx.x; c < a.dv; c += blockDim.x) { \
        float acc = 0.0f; \
        for (i64 j = 0; j < a.tk; ++j) acc += s[j] * ld(vh, j * a.dv + c); \
        st(orow, c, acc); \
    } \
    if (threadIdx.x == 0) lse[bh * a.tq + i] = z; \
}
ATTN_FWD(f32, float)
ATTN_FWD(bf16, bf16_t)

// delta[row] = Σ_c dO[row, c] · O[row, c] (one block per row; grid B·Hq·Tq).
#define ATTN_DELTA(SUF, T) \
extern "C" __global__ void attention_delta_##SUF(const T* out, const T* g, float* delta, i64 dv) { \
    __shared__ float buf[32]; \
    i64 r = blockIdx.x; \
    float acc = 0.0f; \
    for (i64 c = threadIdx.x; c < dv; c += blockDim.x) acc += ld(out, r * dv + c) * ld(g, r * dv + c); \
    acc = block_sum(acc, buf); \
    if (threadIdx.x == 0) delta[r] = acc; \
}
ATTN_DELTA(f32, float)
ATTN_DELTA(bf16, bf16_t)

// dq: grid (Tq, B·Hq), shared memory Tk + D + Dv floats. ds_j = p_j (dO·v_j − delta) · dcap_j;
// dq = scale Σ_j ds_j k_j, in key order. dq is written in f32.
#define ATTN_DQ(SUF, T) \
extern "C" __global__ void attention_dq_##SUF(const T* q, const T* k, const T* v, const T* g, \
        const float* lse, const float* delta, const i64* q_pos, const i64* k_pos, float* dq, AttnDims a) { \
    extern __shared__ float smem[]; \
    float* ds = smem; \
    float* qs = smem + a.tk; \
    float* gs = qs + a.d; \
    i64 i = blockIdx.x, bh = blockIdx.y; \
    i64 h = bh % a.hq, bb = bh / a.hq, kvh = bb * a.hkv + h / (a.hq / a.hkv); \
    i64 row = bh * a.tq + i; \
    for (i64 c = threadIdx.x; c < a.d; c += blockDim.x) qs[c] = ld(q, row * a.d + c); \
    for (i64 c = threadIdx.x; c < a.dv; c += blockDim.x) gs[c] = ld(g, row * a.dv + c); \
    __syncthreads(); \
    const T* kh = k + kvh * a.tk * a.d; \
    const T* vh = v + kvh * a.tk * a.dv; \
    float z = lse[row], dl = delta[row]; \
    i64 qp = q_pos[i]; \
    for (i64 j = threadIdx.x; j < a.tk; j += blockDim.x) { \
        float dcap = 1.0f; \
        float sj = logit(a, qs, kh, j, visible(a, qp, k_pos[j]), &dcap); \
        float p = (z == NEG_INF || sj == NEG_INF) ? 0.0f : expf(sj - z); \
        float dp = 0.0f; \
        for (i64 c = 0; c < a.dv; ++c) dp += gs[c] * ld(vh, j * a.dv + c); \
        ds[j] = p * (dp - dl) * dcap; \
    } \
    __syncthreads(); \
    for (i64 c = threadIdx.x; c < a.d; c += blockDim.x) { \
        float acc = 0.0f; \
        for (i64 j = 0; j < a.tk; ++j) acc += ds[j] * ld(kh, j * a.d + c); \
        dq[row * a.d + c] = acc * a.scale; \
    } \
}
ATTN_DQ(f32, float)
ATTN_DQ(bf16, bf16_t)

// dk, dv: grid (Tk, B·Hkv), shared memory 2·chunk + D + Dv floats. For key j, the query rows of
// every head sharing its kv head are walked in (head, query) order, `chunk` queries at a time:
// first p and ds for the chunk, then each thread adds them into the feature columns it owns.
#define ATTN_DKV(SUF, T) \
extern "C" __global__ void attention_dkv_##SUF(const T* q, const T* k, const T* v, const T* g, \
        const float* lse, const float* delta, const i64* q_pos, const i64* k_pos, float* dk, float* dv, \
        AttnDims a, i64 chunk) { \
    extern __shared__ float smem[]; \
    float* ps = smem; \
    float* dss = smem + chunk; \
    float* ks = dss + chunk; \
    float* vs = ks + a.d; \
    i64 j = blockIdx.x, bkv = blockIdx.y; \
    i64 bb = bkv / a.hkv, kvhead = bkv % a.hkv, group = a.hq / a.hkv; \
    for (i64 c = threadIdx.x; c < a.d; c += blockDim.x) ks[c] = ld(k, (bkv * a.tk + j) * a.d + c); \
    for (i64 c = threadIdx.x; c < a.dv; c += blockDim.x) vs[c] = ld(v, (bkv * a.tk + j) * a.dv + c); \
    __syncthreads(); \
    i64 kp = k_pos[j]; \
    /* each thread owns columns threadIdx.x + n·blockDim.x of dk and dv: at most 4 of each */ \
    float adk[4] = {0.0f, 0.0f, 0.0f, 0.0f}, adv[4] = {0.0f, 0.0f, 0.0f, 0.0f}; \
    i64 rows = group * a.tq; \
    for (i64 r0 = 0; r0 < rows; r0 += chunk) { \
        i64 r1 = min(rows, r0 + chunk); \
        for (i64 r = r0 + threadIdx.x; r < r1; r += blockDim.x) { \
            i64 h = kvhead * group + r / a.tq, i = r % a.tq; \
            i64 row = (bb * a.hq + h) * a.tq + i; \
            const T* qr = q + row * a.d; \
            float s = 0.0f, dcap = 1.0f, p = 0.0f, dp = 0.0f; \
            if (visible(a, q_pos[i], kp)) { \
                for (i64 c = 0; c < a.d; ++c) s += ld(qr, c) * ks[c]; \
                s *= a.scale; \
                if (a.softcap > 0.0f) { float t = tanhf(s / a.softcap); dcap = 1.0f - t * t; s = a.softcap * t; } \
                float z = lse[row]; \
                p = z == NEG_INF ? 0.0f : expf(s - z); \
                for (i64 c = 0; c < a.dv; ++c) dp += ld(g, row * a.dv + c) * vs[c]; \
            } \
            ps[r - r0] = p; \
            dss[r - r0] = p * (dp - delta[row]) * dcap; \
        } \
        __syncthreads(); \
        for (i64 r = r0; r < r1; ++r) { \
            i64 h = kvhead * group + r / a.tq, i = r % a.tq; \
            i64 row = (bb * a.hq + h) * a.tq + i; \
            float p = ps[r - r0], d = dss[r - r0]; \
            if (p == 0.0f && d == 0.0f) continue; \
            for (int n = 0; n < 4; ++n) { \
                i64 c = threadIdx.x + n * blockDim.x; \
                if (c < a.dv) adv[n] += p * ld(g, row * a.dv + c); \
                if (c < a.d) adk[n] += d * ld(q, row * a.d + c); \
            } \
        } \
        __syncthreads(); \
    } \
    for (int n = 0; n < 4; ++n) { \
        i64 c = threadIdx.x + n * blockDim.x; \
        if (c < a.d) dk[(bkv * a.tk + j) * a.d + c] = adk[n] * a.scale; \
        if (c < a.dv) dv[(bkv * a.tk + j) * a.dv + c] = adv[n]; \
    } \
}
ATTN_DKV(f32, float)
ATTN_DKV(bf16, bf16_t)

// The sinks' gradient: d/dsink_h = −Σ exp(sink_h − lse_r) · delta_r over the rows r of head h
// (batch-major, then query order: the CPU's order), one thread per head, so no value goes back
// to the host.
extern "C" __global__ void attention_dsinks(const float* sinks, const float* lse,
                                            const float* delta, float* out, i64 b, i64 hq,
                                            i64 tq) {
    i64 h = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (h >= hq) return;
    float total = 0.0f;
    for (i64 bb = 0; bb < b; ++bb)
        for (i64 t = 0; t < tq; ++t) {
            i64 r = (bb * hq + h) * tq + t;
            float l = lse[r];
            if (l != NEG_INF) total -= expf(sinks[h] - l) * delta[r];
        }
    out[h] = total;
}

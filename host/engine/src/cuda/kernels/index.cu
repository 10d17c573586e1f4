// Index ops: index_select, gather and cat are pure copies of elements of 2, 4 or 8 bytes (any
// dtype, bit for bit); index_add and scatter_add accumulate in f32 with one thread per output
// column walking its sources in increasing source position, which is the CPU backend's order,
// so results match it bit for bit and never use atomics. Indices are i64, checked on the host
// when their values are there; indices the device computed are not read back, so every use is
// bounds-checked here: an index outside its dim reads zero and adds nothing.

// index_select: out[o, l, i] = x[o, idx[l], i] for x [outer, n, inner].
#define INDEX_SELECT(SUF, T) \
extern "C" __global__ void index_select_##SUF(const T* x, const i64* idx, T* out, i64 outer, i64 n, \
        i64 len, i64 inner) { \
    FOR_EACH(t, outer * len * inner) { \
        i64 i = t % inner, l = (t / inner) % len, o = t / (inner * len); \
        i64 r = idx[l]; \
        out[t] = r >= 0 && r < n ? x[(o * n + r) * inner + i] : (T)0; \
    } \
}
INDEX_SELECT(b2, unsigned short)
INDEX_SELECT(b4, unsigned int)
INDEX_SELECT(b8, unsigned long long)

// gather: for the index position (o, j, k) of idx [outer, len, inner],
// out = x[xo[o]·n·xinner + idx·xinner + xi[k]], where xo/xi map the index's outer/inner
// coordinates to x's (the index may be smaller than x in every dim, as in PyTorch).
#define GATHER(SUF, T) \
extern "C" __global__ void gather_##SUF(const T* x, const i64* idx, const i64* xo, const i64* xi, T* out, \
        i64 outer, i64 len, i64 inner, i64 n, i64 xinner) { \
    FOR_EACH(t, outer * len * inner) { \
        i64 k = t % inner, o = t / (inner * len); \
        i64 r = idx[t]; \
        out[t] = r >= 0 && r < n ? x[xo[o] * n * xinner + r * xinner + xi[k]] : (T)0; \
    } \
}
GATHER(b2, unsigned short)
GATHER(b4, unsigned int)
GATHER(b8, unsigned long long)

// cat: one input's slabs into their place in the output: out[o, at + r] = src[o, r] for
// r < width (both in elements, rows of the output `total` wide).
#define CAT(SUF, T) \
extern "C" __global__ void cat_##SUF(const T* src, T* out, i64 outer, i64 width, i64 total, i64 at) { \
    FOR_EACH(t, outer * width) { \
        i64 o = t / width, r = t % width; \
        out[o * total + at + r] = src[t]; \
    } \
}
CAT(b2, unsigned short)
CAT(b4, unsigned int)
CAT(b8, unsigned long long)

// index_add on f32 `out` (already a copy of the base): one thread per (o, i) column adds
// src[o, l, i] at [o, idx[l], i] for l in order. Distinct columns never touch the same element.
extern "C" __global__ void index_add_f32(float* out, const float* src, const i64* idx, i64 outer, i64 n,
        i64 len, i64 inner) {
    FOR_EACH(t, outer * inner) {
        i64 o = t / inner, i = t % inner;
        for (i64 l = 0; l < len; ++l) {
            i64 r = idx[l];
            if (r < 0 || r >= n) continue;
            i64 d = (o * n + r) * inner + i;
            out[d] = out[d] + src[(o * len + l) * inner + i];
        }
    }
}

// scatter_add on f32 `out` (already a copy of x): one thread per index column (o, k) adds
// src[so[o]·sn·sinner + j·sinner + si[k]] at out[xo[o]·n·xinner + idx[o, j, k]·xinner + xi[k]]
// for j in order. Each output element belongs to exactly one column, so there is no race.
extern "C" __global__ void scatter_add_f32(float* out, const float* src, const i64* idx,
        const i64* xo, const i64* xi, const i64* so, const i64* si,
        i64 outer, i64 len, i64 inner, i64 n, i64 xinner, i64 sn, i64 sinner) {
    FOR_EACH(t, outer * inner) {
        i64 o = t / inner, k = t % inner;
        i64 xbase = xo[o] * n * xinner + xi[k];
        i64 sbase = so[o] * sn * sinner + si[k];
        for (i64 j = 0; j < len; ++j) {
            i64 r = idx[(o * len + j) * inner + k];
            if (r < 0 || r >= n) continue;
            i64 d = xbase + r * xinner;
            out[d] = out[d] + src[sbase + j * sinner];
        }
    }
}

// where: cond != 0 ? a : b over three f32 views of one shape (broadcast views read in place).
extern "C" __global__ void where_f32(const float* c, Strided sc, const float* a, Strided sa,
        const float* b, Strided sb, float* out, i64 n) {
    FOR_EACH(i, n) {
        out[i] = c[strided_index(sc, i)] != 0.0f ? a[strided_index(sa, i)] : b[strided_index(sb, i)];
    }
}

// top-k: the CPU's total order (NaN above every number, then the value, then the lower index).
// `before` says whether (va, ia) ranks ahead of (vb, ib).
__device__ __forceinline__ bool before(int largest, float va, i64 ia, float vb, i64 ib) {
    bool an = va != va, bn = vb != vb;
    int cmp = (an && bn) ? 0 : an ? 1 : bn ? -1 : (va > vb ? 1 : (va < vb ? -1 : 0));
    if (!largest) cmp = -cmp;
    return cmp > 0 || (cmp == 0 && ia < ib);
}

// One block per row of x [rows, n] (f32, contiguous): k rounds, each a fixed-order block
// reduction for the best element ranked after the previous pick, so picks come best first.
// With `sorted` 0 the row's picks are then reordered by increasing index (thread 0, insertion
// sort: k is small where routers use it).
extern "C" __global__ void topk_f32(const float* x, float* vals, i64* idxs, i64 n, i64 k, int largest,
        int sorted) {
    __shared__ float bv[256];
    __shared__ i64 bi[256];
    const float* row = x + (i64)blockIdx.x * n;
    float* vo = vals + (i64)blockIdx.x * k;
    i64* io = idxs + (i64)blockIdx.x * k;
    float pv = 0.0f;
    i64 pi = -1; // no pick yet
    for (i64 r = 0; r < k; ++r) {
        float best = 0.0f;
        i64 at = -1;
        for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
            float v = row[j];
            if (pi >= 0 && !before(largest, pv, pi, v, j)) continue;
            if (at < 0 || before(largest, v, j, best, at)) { best = v; at = j; }
        }
        bv[threadIdx.x] = best;
        bi[threadIdx.x] = at;
        __syncthreads();
        for (int s = blockDim.x / 2; s > 0; s >>= 1) {
            if (threadIdx.x < s) {
                i64 ob = bi[threadIdx.x + s];
                if (ob >= 0 && (bi[threadIdx.x] < 0 ||
                        before(largest, bv[threadIdx.x + s], ob, bv[threadIdx.x], bi[threadIdx.x]))) {
                    bv[threadIdx.x] = bv[threadIdx.x + s];
                    bi[threadIdx.x] = ob;
                }
            }
            __syncthreads();
        }
        pv = bv[0];
        pi = bi[0];
        if (threadIdx.x == 0) { vo[r] = pv; io[r] = pi; }
        __syncthreads();
    }
    if (!sorted && threadIdx.x == 0) {
        for (i64 a = 1; a < k; ++a) {
            float v = vo[a];
            i64 i = io[a], b = a - 1;
            while (b >= 0 && io[b] > i) { vo[b + 1] = vo[b]; io[b + 1] = io[b]; --b; }
            vo[b + 1] = v;
            io[b + 1] = i;
        }
    }
}

// Philox 4x32-10, as `anneal_engine::rng::philox4x32`.
__device__ __forceinline__ uint4 philox(uint4 c, unsigned int k0, unsigned int k1) {
    for (int r = 0; r < 10; ++r) {
        unsigned int hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        unsigned int hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return c;
}

// dropout: element i keeps x·scale when the uniform draw of the (seed, stream) Philox stream at
// offset + i is at least p (the draw is `RngKey::uniform_vec`'s: 24 high bits of one word of
// block (offset + i) / 4), so the mask is the CPU backend's, bit for bit.
#define DROPOUT(SUF, T) \
extern "C" __global__ void dropout_##SUF(const T* x, T* y, unsigned long long seed, unsigned long long stream, \
        unsigned long long offset, float p, float scale, i64 n) { \
    FOR_EACH(i, n) { \
        unsigned long long at = offset + (unsigned long long)i, blk = at / 4; \
        uint4 r = philox(make_uint4((unsigned int)blk, (unsigned int)(blk >> 32), (unsigned int)stream, \
                                    (unsigned int)(stream >> 32)), (unsigned int)seed, (unsigned int)(seed >> 32)); \
        unsigned int w = (at & 3) == 0 ? r.x : (at & 3) == 1 ? r.y : (at & 3) == 2 ? r.z : r.w; \
        float u = (float)(w >> 8) * (1.0f / 16777216.0f); \
        st(y, i, u >= p ? __fmul_rn(ld(x, i), scale) : 0.0f); \
    } \
}
DROPOUT(f32, float)
DROPOUT(bf16, bf16_t)

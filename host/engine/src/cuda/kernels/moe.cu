// Dropless MoE routing: the stable sort of top-k choices by expert, rows into expert order
// (dispatch) and weighted expert outputs back into token order (combine), with their gradients.
// Everything is f32; every output element is written by one thread summing a token's k choices
// in choice order, as the CPU backend does (products rounded before the add, no fused
// multiply-add), so results match it bit for bit. The routing's indices are computed on the
// device and never checked on the host, so every read through one is bounds-checked here: an
// index outside its tensor reads as zero rather than out of bounds.

// Assignments per block of the sort's histogram and scatter passes.
#define SORT_CHUNK 256

// hist[c, e]: choices of expert e among assignments c·SORT_CHUNK.. of ids [n] (ids outside
// 0..e are skipped). Counts in shared memory (e ints): integer adds, so any order gives the
// same counts.
extern "C" __global__ void moe_sort_hist(const i64* ids, i64* hist, i64 n, i64 e) {
    extern __shared__ int cnt[];
    for (i64 x = threadIdx.x; x < e; x += blockDim.x) cnt[x] = 0;
    __syncthreads();
    i64 a = (i64)blockIdx.x * SORT_CHUNK + threadIdx.x;
    if (a < n) {
        i64 id = ids[a];
        if (id >= 0 && id < e) atomicAdd(&cnt[id], 1);
    }
    __syncthreads();
    for (i64 x = threadIdx.x; x < e; x += blockDim.x) hist[(i64)blockIdx.x * e + x] = cnt[x];
}

// One block: each expert's chunk counts become exclusive prefixes over the chunks (where its
// assignments of chunk c start among its own), counts[e] their totals, start[e] where expert e's
// slots begin (the exclusive prefix over experts).
extern "C" __global__ void moe_sort_scan(i64* hist, i64* counts, i64* start, i64 chunks, i64 e) {
    for (i64 x = threadIdx.x; x < e; x += blockDim.x) {
        i64 run = 0;
        for (i64 c = 0; c < chunks; ++c) {
            i64 h = hist[c * e + x];
            hist[c * e + x] = run;
            run += h;
        }
        counts[x] = run;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        i64 s = 0;
        for (i64 x = 0; x < e; ++x) {
            start[x] = s;
            s += counts[x];
        }
    }
}

// Assignment a of expert id goes to slot start[id] + (its expert's assignments in earlier chunks)
// + (in earlier positions of its chunk): a stable sort. order[slot] = a, token[slot] = a / k,
// inverse[a] = slot.
extern "C" __global__ void moe_sort_scatter(const i64* ids, const i64* hist, const i64* start,
        i64* order, i64* token, i64* inverse, i64 n, i64 e, i64 k) {
    __shared__ i64 chunk[SORT_CHUNK];
    i64 a = (i64)blockIdx.x * SORT_CHUNK + threadIdx.x;
    i64 id = a < n ? ids[a] : -1;
    chunk[threadIdx.x] = id;
    __syncthreads();
    if (a >= n) return;
    if (id < 0 || id >= e) {
        inverse[a] = 0;
        return;
    }
    i64 rank = 0;
    for (unsigned j = 0; j < threadIdx.x; ++j) rank += chunk[j] == id;
    i64 slot = start[id] + hist[(i64)blockIdx.x * e + id] + rank;
    order[slot] = a;
    token[slot] = a / k;
    inverse[a] = slot;
}

// Row r of a [rows, d] matrix at column c, or 0 when r is not a row.
__device__ __forceinline__ float row_at(const float* m, i64 r, i64 rows, i64 d, i64 c) {
    return r >= 0 && r < rows ? m[r * d + c] : 0.0f;
}

// out[s, c] = x[token[s], c] for x [n, d].
extern "C" __global__ void moe_dispatch_f32(const float* x, const i64* token, float* out, i64 s, i64 d,
        i64 n) {
    FOR_EACH(t, s * d) out[t] = row_at(x, token[t / d], n, d, t % d);
}

// dx[t, c] = Σ_j g[inverse[t·k + j], c] for g [s, d].
extern "C" __global__ void moe_dispatch_backward_f32(const float* g, const i64* inverse, float* dx,
        i64 n, i64 k, i64 d, i64 s) {
    FOR_EACH(t, n * d) {
        i64 r = t / d, c = t % d;
        float acc = 0.0f;
        for (i64 j = 0; j < k; ++j) acc = acc + row_at(g, inverse[r * k + j], s, d, c);
        dx[t] = acc;
    }
}

// out[t, c] = Σ_j w[t, j] · y[inverse[t·k + j], c] for y [s, d].
extern "C" __global__ void moe_combine_f32(const float* y, const float* w, const i64* inverse, float* out,
        i64 n, i64 k, i64 d, i64 s) {
    FOR_EACH(t, n * d) {
        i64 r = t / d, c = t % d;
        float acc = 0.0f;
        for (i64 j = 0; j < k; ++j)
            acc = acc + __fmul_rn(w[r * k + j], row_at(y, inverse[r * k + j], s, d, c));
        out[t] = acc;
    }
}

// dy[s, c] = w[a] · g[a / k, c] with a = order[s] (zero for an a outside the s assignments).
extern "C" __global__ void moe_combine_dy_f32(const float* w, const float* g, const i64* order, float* dy,
        i64 s, i64 k, i64 d) {
    FOR_EACH(t, s * d) {
        i64 a = order[t / d];
        dy[t] = a >= 0 && a < s ? __fmul_rn(w[a], g[(a / k) * d + t % d]) : 0.0f;
    }
}

// dw[a] = ⟨g[a / k], y[inverse[a]]⟩ in f64: one block per assignment, a fixed tree over the
// threads' strided partial sums (blockDim.x a power of two, at most 256).
extern "C" __global__ void moe_combine_dw_f32(const float* y, const float* g, const i64* inverse, float* dw,
        i64 k, i64 d, i64 s) {
    __shared__ double part[256];
    i64 a = blockIdx.x;
    i64 r = inverse[a];
    const float* gr = g + (a / k) * d;
    double acc = 0.0;
    for (i64 c = threadIdx.x; c < d; c += blockDim.x) acc += (double)row_at(y, r, s, d, c) * (double)gr[c];
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) dw[a] = (float)part[0];
}

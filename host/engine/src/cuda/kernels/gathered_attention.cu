// Gathered sparse attention (ops/gathered_attention.rs: DeepSeek-V4's compressed sparse and
// heavily compressed attention) on the device, forward and backward, in f32, nothing read back
// to the host. Layouts (contiguous): q, out, g, dq [B, H, T, D]; keys [B, S, D]; blocks
// [B, N, D]; lse and delta [B, H, T]; positions i64 [qb, T] and [kb, S] (qb, kb: 1 or B); the
// selection's rows sorted and deduplicated by ga_select into list [sb·T, k] (the first count[r]
// entries of row r).
//
// A query row's visible columns (c < S: window key c; else block c − S) form a list — window
// keys by index, then blocks ascending — that is handed out in chunks of GA_CHUNK by list
// position. Chunk boundaries, and so every rounding, depend only on the row's own list, never
// on the batch, the other queries or where the keys sit in the cache: a decode step reproduces
// the training forward's bits. No float atomics; every sum runs in a fixed order.

// Columns (or queries) per step; ga_fwd, ga_dq, ga_dkv and ga_select run this many threads.
#define GA_CHUNK 128
#define GA_NONE 0xffffffffu

// The `GaDims` struct of cuda/gathered_attention.rs.
struct GaDims {
    i64 b, h, t, d, s, n, qb, kb, sb, k, window, rate;
    float scale;
    int has_sinks, has_sel;
};

// The exclusive prefix sum of `v` over the block's threads in thread order, and the total
// (blockDim.x a multiple of 32). `buf` holds 32 ints.
__device__ int block_scan(int v, int* total, int* buf) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    int x = v;
    for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads(); // the previous scan's readers of buf are done
    if (lane == 31) buf[warp] = x;
    __syncthreads();
    int before = 0, all = 0;
    for (int w = 0; w < warps; ++w) {
        all += buf[w];
        if (w < warp) before += buf[w];
    }
    *total = all;
    return before + x - v;
}

// The first i in [lo, hi) where `past(i)` holds, given that it holds from some i on (else hi).
template <class Past>
__device__ i64 first_where(i64 lo, i64 hi, Past past) {
    while (lo < hi) {
        i64 mid = lo + (hi - lo) / 2;
        if (past(mid)) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

// A list being handed out in chunks: `pend` (shared, 2·GA_CHUNK) holds the items not yet
// visited, `n` how many (the same value in every thread).
struct GaList {
    i64* pend;
    int* buf;
    int n;
};

// Appends map(i) for the i in [lo, hi) where keep(i) holds, in ascending i, and calls
// visit(items, GA_CHUNK) on each chunk that fills. Every thread of the block calls it alike.
template <class Keep, class Map, class Visit>
__device__ void list_push(GaList& l, i64 lo, i64 hi, Keep keep, Map map, Visit& visit) {
    for (i64 i0 = lo; i0 < hi; i0 += GA_CHUNK) {
        i64 i = i0 + threadIdx.x;
        int kept = (i < hi && keep(i)) ? 1 : 0;
        int total;
        int at = block_scan(kept, &total, l.buf);
        if (kept) l.pend[l.n + at] = map(i);
        l.n += total;
        __syncthreads();
        if (l.n >= GA_CHUNK) {
            visit((const i64*)l.pend, GA_CHUNK);
            __syncthreads();
            // The rest (fewer than GA_CHUNK) moves to the front; source and target are disjoint.
            int rest = l.n - GA_CHUNK;
            if ((int)threadIdx.x < rest) l.pend[threadIdx.x] = l.pend[GA_CHUNK + threadIdx.x];
            l.n = rest;
            __syncthreads();
        }
    }
}

// Visits what is left of the list (a last, shorter chunk).
template <class Visit>
__device__ void list_flush(GaList& l, Visit& visit) {
    if (l.n > 0) {
        visit((const i64*)l.pend, l.n);
        __syncthreads();
        l.n = 0;
    }
}

// Σ x·y in the CPU op's order (its `dot`): eight lanes, a fixed tree, then the tail.
__device__ float ga_dot(const float* x, const float* y, i64 n) {
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    i64 n8 = n - n % 8;
    for (i64 i = 0; i < n8; i += 8)
        for (int l = 0; l < 8; ++l) acc[l] += x[i + l] * y[i + l];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (i64 i = n8; i < n; ++i) s += x[i] * y[i];
    return s;
}

// The row of column c of batch row bb: window key c, or block c − S.
__device__ __forceinline__ const float* col_row(const GaDims& a, const float* keys,
                                                const float* blocks, i64 bb, i64 c) {
    return c < a.s ? keys + (bb * a.s + c) * a.d : blocks + (bb * a.n + (c - a.s)) * a.d;
}

// Walks the visible columns of query t of batch row bb in list order (see the top).
template <class Visit>
__device__ void row_cols(const GaDims& a, i64 bb, i64 t, const i64* q_pos, const i64* k_pos,
                         const int* k_sorted, const i64* list, const i64* count, GaList& l,
                         Visit& visit) {
    i64 p = q_pos[(bb % a.qb) * a.t + t];
    const i64* kr = k_pos + (bb % a.kb) * a.s;
    i64 lo = 0, hi = a.s;
    if (k_sorted[bb % a.kb]) {
        // Ascending positions: the visible keys are one range, found by bisection.
        lo = first_where(0, a.s, [&](i64 j) { return p - kr[j] < a.window; });
        hi = first_where(lo, a.s, [&](i64 j) { return kr[j] > p; });
    }
    list_push(
        l, lo, hi, [&](i64 j) { return kr[j] <= p && p - kr[j] < a.window; },
        [](i64 j) { return j; }, visit);
    i64 ready = p + 1 > 0 ? (p + 1) / a.rate : 0;
    if (ready > a.n) ready = a.n;
    if (!a.has_sel) {
        list_push(l, 0, ready, [](i64) { return true; }, [&](i64 w) { return a.s + w; }, visit);
    } else {
        // The row's sorted unique choices below `ready` are a prefix of its list.
        i64 r = (bb % a.sb) * a.t + t;
        const i64* e = list + r * a.k;
        i64 m = first_where(0, count[r], [&](i64 i) { return e[i] >= ready; });
        list_push(l, 0, m, [](i64) { return true; }, [&](i64 i) { return a.s + e[i]; }, visit);
    }
    list_flush(l, visit);
}

// Whether query t of batch row bb chose block w (a bisection of its sorted choices).
__device__ bool ga_chose(const GaDims& a, const i64* list, const i64* count, i64 bb, i64 t,
                         i64 w) {
    i64 r = (bb % a.sb) * a.t + t;
    const i64* e = list + r * a.k;
    i64 c = count[r];
    i64 i = first_where(0, c, [&](i64 j) { return e[j] >= w; });
    return i < c && e[i] == w;
}

// flags[r] = whether row r of `pos [rows, n]` ascends (non-strictly). Grid rows.
extern "C" __global__ void ga_sorted(const i64* pos, i64 n, int* flags) {
    const i64* p = pos + (i64)blockIdx.x * n;
    int bad = 0;
    for (i64 i = threadIdx.x + 1; i < n; i += blockDim.x) bad |= p[i - 1] > p[i] ? 1 : 0;
    bad = __syncthreads_or(bad);
    if (threadIdx.x == 0) flags[blockIdx.x] = bad ? 0 : 1;
}

// Each selection row sorted ascending, repeats and entries outside [0, N) dropped, into list
// (count[r] entries). Grid sb·T, GA_CHUNK threads, kp2 (a power of two, at least k) shared
// unsigned ints: a bitonic sort, then an ordered compaction.
extern "C" __global__ void ga_select(const i64* sel, i64* list, i64* count, GaDims a, i64 kp2) {
    extern __shared__ unsigned int su[];
    __shared__ int ibuf[32];
    i64 r = blockIdx.x;
    const i64* e = sel + r * a.k;
    for (i64 i = threadIdx.x; i < kp2; i += blockDim.x) {
        i64 v = i < a.k ? e[i] : -1;
        // N < 2^32 - 1 (checked by the caller), so no valid entry equals GA_NONE.
        su[i] = (v >= 0 && v < a.n) ? (unsigned int)v : GA_NONE;
    }
    __syncthreads();
    for (i64 size = 2; size <= kp2; size <<= 1)
        for (i64 stride = size >> 1; stride > 0; stride >>= 1) {
            for (i64 i = threadIdx.x; i < kp2; i += blockDim.x) {
                i64 j = i ^ stride;
                if (j > i) {
                    unsigned int x = su[i], y = su[j];
                    bool up = (i & size) == 0;
                    if (up ? x > y : x < y) {
                        su[i] = y;
                        su[j] = x;
                    }
                }
            }
            __syncthreads();
        }
    i64 kept = 0;
    for (i64 i0 = 0; i0 < kp2; i0 += blockDim.x) {
        i64 i = i0 + threadIdx.x;
        int keep = (i < kp2 && su[i] != GA_NONE && (i == 0 || su[i] != su[i - 1])) ? 1 : 0;
        int total;
        int at = block_scan(keep, &total, ibuf);
        if (keep) list[r * a.k + kept + at] = su[i];
        kept += total;
    }
    if (threadIdx.x == 0) count[r] = kept;
}

// Forward: grid (B·T, H), GA_CHUNK threads, 2·D shared floats (the query row, the output's
// accumulator). An online softmax over the row's chunks: a chunk that raises the running max
// rescales the sum and the accumulator, so a row may see any number of columns. A row that sees
// nothing (and has no sink) gets lse −inf and output 0.
extern "C" __global__ void ga_fwd(const float* q, const float* keys, const float* blocks,
                                  const float* sinks, const i64* q_pos, const i64* k_pos,
                                  const int* k_sorted, const i64* list, const i64* count,
                                  float* out, float* lse, GaDims a) {
    extern __shared__ float smem[];
    __shared__ i64 pend[2 * GA_CHUNK];
    __shared__ float w[GA_CHUNK];
    __shared__ float fbuf[32];
    __shared__ int ibuf[32];
    float* qs = smem;
    float* acc = smem + a.d;
    i64 r = blockIdx.x, h = blockIdx.y, bb = r / a.t, t = r % a.t;
    i64 row = (bb * a.h + h) * a.t + t;
    for (i64 c = threadIdx.x; c < a.d; c += blockDim.x) {
        qs[c] = q[row * a.d + c];
        acc[c] = 0.0f;
    }
    __syncthreads();
    float m = a.has_sinks ? sinks[h] : NEG_INF, sum = 0.0f;
    auto visit = [&](const i64* cols, int cnt) {
        float sc = NEG_INF;
        if ((int)threadIdx.x < cnt)
            sc = ga_dot(qs, col_row(a, keys, blocks, bb, cols[threadIdx.x]), a.d) * a.scale;
        float mn = fmaxf(m, block_max(sc, fbuf));
        float corr = m == NEG_INF ? 0.0f : expf(m - mn);
        w[threadIdx.x] = ((int)threadIdx.x < cnt && mn != NEG_INF) ? expf(sc - mn) : 0.0f;
        sum = sum * corr + block_sum(w[threadIdx.x], fbuf);
        __syncthreads();
        for (i64 c = threadIdx.x; c < a.d; c += blockDim.x) {
            float v = acc[c] * corr;
            for (int i = 0; i < cnt; ++i) v += w[i] * col_row(a, keys, blocks, bb, cols[i])[c];
            acc[c] = v;
        }
        m = mn;
    };
    GaList l = {pend, ibuf, 0};
    row_cols(a, bb, t, q_pos, k_pos, k_sorted, list, count, l, visit);
    float z = NEG_INF, inv = 0.0f;
    if (m != NEG_INF) {
        if (a.has_sinks) sum += expf(sinks[h] - m);
        z = m + logf(sum);
        inv = 1.0f / sum;
    }
    for (i64 c = threadIdx.x; c < a.d; c += blockDim.x) out[row * a.d + c] = acc[c] * inv;
    if (threadIdx.x == 0) lse[row] = z;
}

// dq and delta: grid (B·T, H), GA_CHUNK threads, 3·D shared floats (q, g, dq's accumulator).
// delta = g·out; per column ds = p (g·k − delta) · scale and dq = Σ ds·k in list order.
extern "C" __global__ void ga_dq(const float* q, const float* keys, const float* blocks,
                                 const float* out, const float* g, const float* lse,
                                 const i64* q_pos, const i64* k_pos, const int* k_sorted,
                                 const i64* list, const i64* count, float* dq, float* delta,
                                 GaDims a) {
    extern __shared__ float smem[];
    __shared__ i64 pend[2 * GA_CHUNK];
    __shared__ float ds[GA_CHUNK];
    __shared__ float dl_s;
    __shared__ int ibuf[32];
    float* qs = smem;
    float* gs = smem + a.d;
    float* acc = gs + a.d;
    i64 r = blockIdx.x, h = blockIdx.y, bb = r / a.t, t = r % a.t;
    i64 row = (bb * a.h + h) * a.t + t;
    for (i64 c = threadIdx.x; c < a.d; c += blockDim.x) {
        qs[c] = q[row * a.d + c];
        gs[c] = g[row * a.d + c];
        acc[c] = 0.0f;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        dl_s = ga_dot(gs, out + row * a.d, a.d);
        delta[row] = dl_s;
    }
    __syncthreads();
    float dl = dl_s, z = lse[row];
    if (z != NEG_INF) { // the same in every thread: a row that saw nothing gets dq = 0
        auto visit = [&](const i64* cols, int cnt) {
            float v = 0.0f;
            if ((int)threadIdx.x < cnt) {
                const float* k = col_row(a, keys, blocks, bb, cols[threadIdx.x]);
                float p = expf(ga_dot(qs, k, a.d) * a.scale - z);
                v = p * (ga_dot(gs, k, a.d) - dl) * a.scale;
            }
            ds[threadIdx.x] = v;
            __syncthreads();
            for (i64 c = threadIdx.x; c < a.d; c += blockDim.x) {
                float x = acc[c];
                for (int i = 0; i < cnt; ++i) x += ds[i] * col_row(a, keys, blocks, bb, cols[i])[c];
                acc[c] = x;
            }
        };
        GaList l = {pend, ibuf, 0};
        row_cols(a, bb, t, q_pos, k_pos, k_sorted, list, count, l, visit);
    }
    for (i64 c = threadIdx.x; c < a.d; c += blockDim.x) dq[row * a.d + c] = acc[c];
}

// dkeys and dblocks: grid (S + N, B), GA_CHUNK threads, 2·D shared floats (the column's row,
// its gradient's accumulator). Column c of batch row bb gathers from the queries that see it,
// found by a scan of the queries (a bisected range when their positions ascend), GA_CHUNK
// queries at a time, head by head: grad += ds·q + p·g per (query, head), in that fixed order.
extern "C" __global__ void ga_dkv(const float* q, const float* keys, const float* blocks,
                                  const float* g, const float* lse, const float* delta,
                                  const i64* q_pos, const i64* k_pos, const int* q_sorted,
                                  const i64* list, const i64* count, float* dkeys,
                                  float* dblocks, GaDims a) {
    extern __shared__ float smem[];
    __shared__ i64 pend[2 * GA_CHUNK];
    __shared__ float ps[GA_CHUNK];
    __shared__ float dss[GA_CHUNK];
    __shared__ int ibuf[32];
    float* ks = smem;
    float* acc = smem + a.d;
    i64 c = blockIdx.x, bb = blockIdx.y;
    const float* src = col_row(a, keys, blocks, bb, c);
    for (i64 x = threadIdx.x; x < a.d; x += blockDim.x) {
        ks[x] = src[x];
        acc[x] = 0.0f;
    }
    __syncthreads();
    const i64* qp = q_pos + (bb % a.qb) * a.t;
    bool sorted = q_sorted[bb % a.qb] != 0;
    auto visit = [&](const i64* ts, int cnt) {
        for (i64 h = 0; h < a.h; ++h) {
            float p = 0.0f, d = 0.0f;
            if ((int)threadIdx.x < cnt) {
                i64 row = (bb * a.h + h) * a.t + ts[threadIdx.x];
                float z = lse[row];
                if (z != NEG_INF) {
                    p = expf(ga_dot(q + row * a.d, ks, a.d) * a.scale - z);
                    d = p * (ga_dot(g + row * a.d, ks, a.d) - delta[row]) * a.scale;
                }
            }
            ps[threadIdx.x] = p;
            dss[threadIdx.x] = d;
            __syncthreads();
            for (i64 x = threadIdx.x; x < a.d; x += blockDim.x) {
                float v = acc[x];
                for (int i = 0; i < cnt; ++i) {
                    i64 at = ((bb * a.h + h) * a.t + ts[i]) * a.d + x;
                    v += dss[i] * q[at];
                    v += ps[i] * g[at];
                }
                acc[x] = v;
            }
            __syncthreads();
        }
    };
    GaList l = {pend, ibuf, 0};
    auto same = [](i64 t) { return t; };
    if (c < a.s) {
        i64 kp = k_pos[(bb % a.kb) * a.s + c];
        i64 lo = 0, hi = a.t;
        if (sorted) {
            lo = first_where(0, a.t, [&](i64 t) { return qp[t] >= kp; });
            hi = first_where(lo, a.t, [&](i64 t) { return qp[t] - kp >= a.window; });
        }
        list_push(
            l, lo, hi, [&](i64 t) { return kp <= qp[t] && qp[t] - kp < a.window; }, same, visit);
    } else {
        // Block w is complete for a query at p when (p + 1) / rate > w (w < N already).
        i64 w = c - a.s;
        auto complete = [&](i64 t) {
            i64 p1 = qp[t] + 1;
            return p1 > 0 && p1 / a.rate > w;
        };
        i64 lo = sorted ? first_where(0, a.t, complete) : 0;
        list_push(
            l, lo, a.t,
            [&](i64 t) { return complete(t) && (!a.has_sel || ga_chose(a, list, count, bb, t, w)); },
            same, visit);
    }
    list_flush(l, visit);
    float* dst = c < a.s ? dkeys + (bb * a.s + c) * a.d : dblocks + (bb * a.n + (c - a.s)) * a.d;
    for (i64 x = threadIdx.x; x < a.d; x += blockDim.x) dst[x] = acc[x];
}

// The sinks' gradient: dsink_h = −Σ exp(sink_h − lse) · delta over head h's rows that saw
// something. Grid H, blockDim threads each summing rows in order, then a fixed tree.
extern "C" __global__ void ga_dsinks(const float* sinks, const float* lse, const float* delta,
                                     float* out, GaDims a) {
    __shared__ float fbuf[32];
    i64 h = blockIdx.x;
    float acc = 0.0f;
    for (i64 r = threadIdx.x; r < a.b * a.t; r += blockDim.x) {
        i64 row = ((r / a.t) * a.h + h) * a.t + r % a.t;
        float z = lse[row];
        if (z != NEG_INF) acc -= expf(sinks[h] - z) * delta[row];
    }
    acc = block_sum(acc, fbuf);
    if (threadIdx.x == 0) out[h] = acc;
}

// The gated delta rule (Gated DeltaNet, Kimi Delta Attention) as a recurrence on the GPU: one
// block per (batch, value head), one thread per value channel j, which holds column j of the
// state S [Dk, Dv] in registers. Per token t, as the CPU's recurrence computes it:
//   S ← e^{g_t} ⊙ S (rows scaled: one decay per head, or one per key channel),
//   y = β_t (v_t − Sᵀ k_t),  S ← S + k_t yᵀ,  o_t = Sᵀ (scale · q_t).
// Column j never reads another column, so the forward needs no communication between threads
// beyond the token's q, k and decay, staged in shared memory. The backward runs the chunks last
// to first: it recomputes each chunk's states from the state entering it (saved by the
// forward every CHUNK tokens) into a scratch buffer, then walks the chunk backwards; the
// gradients of q, k, the decay and β sum over the value channels, in a fixed order (warp
// shuffles, then the warps in order), so results are deterministic. Inputs are contiguous f32
// `[B, T, H, ·]`; q and k are per value head here (the host expands grouped heads and sums
// their gradients back).

#define DR_CHUNK 64

struct DeltaDims {
    i64 t;       // tokens
    i64 hv;      // value heads
    i64 dk;      // key channels (<= DK)
    i64 dv;      // value channels (= threads in use)
    i64 gd;      // decays per token and head: 1 or dk
    float scale; // multiplies q
};

// The token's scaled q, k and decay factors e^g, staged for every thread.
template <int DK>
__device__ void dr_stage(const DeltaDims& m, i64 row, const float* q, const float* k,
                         const float* g, float* sq, float* sk, float* se) {
    for (int d = threadIdx.x; d < DK; d += blockDim.x) {
        bool in = d < m.dk;
        sq[d] = in ? q[row * m.dk + d] * m.scale : 0.0f;
        sk[d] = in ? k[row * m.dk + d] : 0.0f;
        se[d] = in ? expf(g[row * m.gd + (m.gd == 1 ? 0 : d)]) : 1.0f;
    }
}

// One token forward for column j: decays and updates `s`, returns (y, mem, o).
template <int DK>
__device__ __forceinline__ void dr_step(float* s, const float* sq, const float* sk,
                                        const float* se, float beta, float v, float& y,
                                        float& mem, float& o) {
    mem = 0.0f;
#pragma unroll
    for (int d = 0; d < DK; d++) {
        s[d] *= se[d];
        mem += s[d] * sk[d];
    }
    y = beta * (v - mem);
    o = 0.0f;
#pragma unroll
    for (int d = 0; d < DK; d++) {
        s[d] += sk[d] * y;
        o += s[d] * sq[d];
    }
}

// Forward: out [B, T, Hv, Dv], the final state into `state` [B, Hv, Dk, Dv] (which holds the
// initial state on entry), and, when `chunks` is not null, the state entering every chunk
// [B·Hv, ceil(T / CHUNK), Dk, Dv].
template <int DK>
__device__ void dr_forward(DeltaDims m, const float* q, const float* k, const float* v,
                           const float* g, const float* beta, float* state, float* out,
                           float* chunks) {
    __shared__ float sq[DK], sk[DK], se[DK];
    const i64 bh = blockIdx.x, b = bh / m.hv, h = bh % m.hv;
    const int j = threadIdx.x;
    const bool col = j < m.dv;
    float* s0 = state + bh * m.dk * m.dv;
    float s[DK];
#pragma unroll
    for (int d = 0; d < DK; d++) s[d] = (col && d < m.dk) ? s0[d * m.dv + j] : 0.0f;
    const i64 n_chunks = (m.t + DR_CHUNK - 1) / DR_CHUNK;
    for (i64 t = 0; t < m.t; t++) {
        if (chunks && col && t % DR_CHUNK == 0) {
            float* c = chunks + (bh * n_chunks + t / DR_CHUNK) * m.dk * m.dv;
            for (int d = 0; d < m.dk; d++) c[d * m.dv + j] = s[d];
        }
        const i64 row = (b * m.t + t) * m.hv + h;
        dr_stage<DK>(m, row, q, k, g, sq, sk, se);
        __syncthreads();
        if (col) {
            float y, mem, o;
            dr_step<DK>(s, sq, sk, se, beta[row], v[row * m.dv + j], y, mem, o);
            out[row * m.dv + j] = o;
        }
        __syncthreads();
    }
    if (col)
        for (int d = 0; d < m.dk; d++) s0[d * m.dv + j] = s[d];
}

// A sum over the block's threads in a fixed order: each warp's shuffle sum of `x` goes to
// warp_part[warp][slot] (dr_sum, every thread calls it), then, after a __syncthreads, one thread
// adds the warps in order (dr_finish).
__device__ __forceinline__ void dr_sum(float x, float* warp_part, int slot, int stride) {
    x = warp_sum(x);
    if ((threadIdx.x & 31) == 0) warp_part[(threadIdx.x >> 5) * stride + slot] = x;
}

__device__ __forceinline__ void dr_finish(const float* warp_part, int slot, int stride,
                                          float* dst) {
    const int warps = (blockDim.x + 31) >> 5;
    float acc = 0.0f;
    for (int w = 0; w < warps; w++) acc += warp_part[w * stride + slot];
    *dst = acc;
}

// Backward: per value head, dq and dk [B, T, Hv, Dk], dv [B, T, Hv, Dv], dg shaped like g,
// dbeta [B, T, Hv], and the initial state's gradient into `dstate` (which holds the final
// state's gradient on entry). `scratch` holds min(T, CHUNK) states of Dk × Dv per block.
template <int DK>
__device__ void dr_backward(DeltaDims m, const float* q, const float* k, const float* v,
                            const float* g, const float* beta, const float* chunks,
                            const float* dout, float* dstate, float* scratch, float* dq,
                            float* dk, float* dv, float* dg, float* dbeta) {
    __shared__ float sq[DK], sk[DK], se[DK];
    // Per warp (at most 8: Dv <= 256): DK values each of dq, dk and dg, then dbeta (slot 3·DK).
    __shared__ float part[8 * (3 * DK + 1)];
    const int stride = 3 * DK + 1;
    const i64 bh = blockIdx.x, b = bh / m.hv, h = bh % m.hv;
    const int j = threadIdx.x;
    const bool col = j < m.dv;
    const i64 ss = m.dk * m.dv;
    // Each block's scratch holds min(T, CHUNK) states.
    float* mine = scratch + bh * (m.t < DR_CHUNK ? m.t : DR_CHUNK) * ss;
    float* ds0 = dstate + bh * ss;
    float ds[DK];
#pragma unroll
    for (int d = 0; d < DK; d++) ds[d] = (col && d < m.dk) ? ds0[d * m.dv + j] : 0.0f;
    float ys[DR_CHUNK], mems[DR_CHUNK];
    const i64 n_chunks = (m.t + DR_CHUNK - 1) / DR_CHUNK;
    for (i64 c = n_chunks - 1; c >= 0; c--) {
        const i64 t0 = c * DR_CHUNK;
        const int len = (int)(m.t - t0 < DR_CHUNK ? m.t - t0 : DR_CHUNK);
        const float* entry = chunks + (bh * n_chunks + c) * ss;
        // Recompute the chunk's states S_t (after token t) into the scratch.
        float s[DK];
#pragma unroll
        for (int d = 0; d < DK; d++) s[d] = (col && d < m.dk) ? entry[d * m.dv + j] : 0.0f;
        for (int i = 0; i < len; i++) {
            const i64 row = (b * m.t + t0 + i) * m.hv + h;
            dr_stage<DK>(m, row, q, k, g, sq, sk, se);
            __syncthreads();
            if (col) {
                float o;
                dr_step<DK>(s, sq, sk, se, beta[row], v[row * m.dv + j], ys[i], mems[i], o);
                for (int d = 0; d < m.dk; d++) mine[(i64)i * ss + d * m.dv + j] = s[d];
            }
            __syncthreads();
        }
        for (int i = len - 1; i >= 0; i--) {
            const i64 row = (b * m.t + t0 + i) * m.hv + h;
            dr_stage<DK>(m, row, q, k, g, sq, sk, se);
            __syncthreads();
            const float* st = mine + (i64)i * ss;             // S_t
            const float* prev = i > 0 ? st - ss : entry;      // S_{t-1}
            const float bt = beta[row];
            const float doj = col ? dout[row * m.dv + j] : 0.0f;
            // o = Sᵀq: dS += q do, dq = S do; then y's gradient dy = Σ_d dS k.
            float dy = 0.0f;
#pragma unroll
            for (int d = 0; d < DK; d++) {
                const float sd = (col && d < m.dk) ? st[d * m.dv + j] : 0.0f;
                ds[d] += sq[d] * doj;
                dr_sum(sd * doj, part, d, stride);
                dy += ds[d] * sk[d];
            }
            if (!col) dy = 0.0f;
            const float vj = col ? v[row * m.dv + j] : 0.0f;
            const float dmem = -dy * bt;
            dr_sum(col ? dy * (vj - mems[i]) : 0.0f, part, 3 * DK, stride);
            if (col) dv[row * m.dv + j] = dy * bt;
            // S_t = e ⊙ S_{t-1} + k yᵀ with mem = (e ⊙ S_{t-1})ᵀ k.
            float de_head = 0.0f;
            const float yj = col ? ys[i] : 0.0f;
#pragma unroll
            for (int d = 0; d < DK; d++) {
                const float pd = (col && d < m.dk) ? prev[d * m.dv + j] : 0.0f;
                const float dsp = ds[d] + dmem * sk[d];
                dr_sum(ds[d] * yj + dmem * se[d] * pd, part, DK + d, stride);
                const float de = dsp * pd * se[d];
                if (m.gd == 1) {
                    de_head += de;
                } else {
                    dr_sum(de, part, 2 * DK + d, stride);
                }
                ds[d] = se[d] * dsp;
            }
            if (m.gd == 1) dr_sum(de_head, part, 2 * DK, stride);
            __syncthreads();
            for (int d = threadIdx.x; d < m.dk; d += blockDim.x) {
                dr_finish(part, d, stride, &dq[row * m.dk + d]);
                dq[row * m.dk + d] *= m.scale;
                dr_finish(part, DK + d, stride, &dk[row * m.dk + d]);
                if (m.gd != 1) dr_finish(part, 2 * DK + d, stride, &dg[row * m.dk + d]);
            }
            if (threadIdx.x == 0) {
                if (m.gd == 1) dr_finish(part, 2 * DK, stride, &dg[row]);
                dr_finish(part, 3 * DK, stride, &dbeta[row]);
            }
            __syncthreads();
        }
    }
    if (col)
        for (int d = 0; d < m.dk; d++) ds0[d * m.dv + j] = ds[d];
}

#define DR_KERNELS(DK)                                                                          \
    extern "C" __global__ void delta_rule_fwd_##DK(DeltaDims m, const float* q, const float* k, \
                                                   const float* v, const float* g,              \
                                                   const float* beta, float* state, float* out, \
                                                   float* chunks) {                             \
        dr_forward<DK>(m, q, k, v, g, beta, state, out, chunks);                                \
    }                                                                                           \
    extern "C" __global__ void delta_rule_bwd_##DK(                                             \
        DeltaDims m, const float* q, const float* k, const float* v, const float* g,            \
        const float* beta, const float* chunks, const float* dout, float* dstate,               \
        float* scratch, float* dq, float* dk, float* dv, float* dg, float* dbeta) {             \
        dr_backward<DK>(m, q, k, v, g, beta, chunks, dout, dstate, scratch, dq, dk, dv, dg,     \
                        dbeta);                                                                 \
    }

DR_KERNELS(16)
DR_KERNELS(32)
DR_KERNELS(64)
DR_KERNELS(128)

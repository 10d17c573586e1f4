// Dropless MoE routing: rows into expert order (dispatch) and weighted expert outputs back into
// token order (combine), with their gradients. Everything is f32; every output element is
// written by one thread summing a token's k choices in choice order, as the CPU backend does
// (products rounded before the add, no fused multiply-add), so results match it bit for bit.

// out[s, c] = x[token[s], c].
extern "C" __global__ void moe_dispatch_f32(const float* x, const i64* token, float* out, i64 s, i64 d) {
    FOR_EACH(t, s * d) out[t] = x[token[t / d] * d + t % d];
}

// dx[t, c] = Σ_j g[inverse[t·k + j], c].
extern "C" __global__ void moe_dispatch_backward_f32(const float* g, const i64* inverse, float* dx,
        i64 n, i64 k, i64 d) {
    FOR_EACH(t, n * d) {
        i64 r = t / d, c = t % d;
        float acc = 0.0f;
        for (i64 j = 0; j < k; ++j) acc = acc + g[inverse[r * k + j] * d + c];
        dx[t] = acc;
    }
}

// out[t, c] = Σ_j w[t, j] · y[inverse[t·k + j], c].
extern "C" __global__ void moe_combine_f32(const float* y, const float* w, const i64* inverse, float* out,
        i64 n, i64 k, i64 d) {
    FOR_EACH(t, n * d) {
        i64 r = t / d, c = t % d;
        float acc = 0.0f;
        for (i64 j = 0; j < k; ++j) acc = acc + __fmul_rn(w[r * k + j], y[inverse[r * k + j] * d + c]);
        out[t] = acc;
    }
}

// dy[s, c] = w[a] · g[a / k, c] with a = order[s].
extern "C" __global__ void moe_combine_dy_f32(const float* w, const float* g, const i64* order, float* dy,
        i64 s, i64 k, i64 d) {
    FOR_EACH(t, s * d) {
        i64 a = order[t / d];
        dy[t] = __fmul_rn(w[a], g[(a / k) * d + t % d]);
    }
}

// dw[a] = ⟨g[a / k], y[inverse[a]]⟩ in f64: one block per assignment, a fixed tree over the
// threads' strided partial sums (blockDim.x a power of two, at most 256).
extern "C" __global__ void moe_combine_dw_f32(const float* y, const float* g, const i64* inverse, float* dw,
        i64 k, i64 d) {
    __shared__ double part[256];
    i64 a = blockIdx.x;
    const float* yr = y + inverse[a] * d;
    const float* gr = g + (a / k) * d;
    double acc = 0.0;
    for (i64 c = threadIdx.x; c < d; c += blockDim.x) acc += (double)yr[c] * (double)gr[c];
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) dw[a] = (float)part[0];
}

// AdamW over many f32 tensors in one launch: each block updates one chunk of one tensor, named by
// the block table the host builds (tensor index and start per block). Same formula and f32
// constants as the CPU kernel, so both backends agree to rounding.

struct AdamWTensor {
    float* p;
    const float* g;
    float* m;
    float* v;
    i64 n;
};

struct AdamWConsts {
    float b1, one_minus_b1, b2, one_minus_b2, inv_bc1, inv_bc2, eps, lr, decay;
};

extern "C" __global__ void adamw_multi(const AdamWTensor* tensors, const int* block_tensor,
        const i64* block_start, i64 chunk, AdamWConsts c) {
    AdamWTensor t = tensors[block_tensor[blockIdx.x]];
    i64 start = block_start[blockIdx.x];
    i64 end = min(t.n, start + chunk);
    for (i64 i = start + threadIdx.x; i < end; i += blockDim.x) {
        float gi = t.g[i];
        float mi = t.m[i] * c.b1 + gi * c.one_minus_b1;
        float vi = t.v[i] * c.b2 + (gi * gi) * c.one_minus_b2;
        t.m[i] = mi;
        t.v[i] = vi;
        float denom = sqrtf(vi * c.inv_bc2) + c.eps;
        float update = (mi * c.inv_bc1) / denom;
        t.p[i] = t.p[i] * c.decay - update * c.lr;
    }
}

// Σ x² of many f32 tensors in two launches (a gradient norm's parts): each block sums the
// squares of one chunk of one tensor (the same block table as adamw_multi) in a fixed tree
// order, then one thread per tensor adds its blocks' sums in order, in f64.
struct SquaresTensor {
    const float* x;
    i64 n;
};

extern "C" __global__ void sum_squares_multi(const SquaresTensor* tensors, const int* block_tensor,
        const i64* block_start, i64 chunk, float* partial) {
    __shared__ float buf[32];
    SquaresTensor t = tensors[block_tensor[blockIdx.x]];
    i64 start = block_start[blockIdx.x];
    i64 end = min(t.n, start + chunk);
    float acc = 0.0f;
    for (i64 i = start + threadIdx.x; i < end; i += blockDim.x) acc += t.x[i] * t.x[i];
    float s = block_sum(acc, buf);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

extern "C" __global__ void sum_squares_finish(const float* partial, const i64* first_block,
        i64 tensors, float* out) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= tensors) return;
    double acc = 0.0;
    for (i64 b = first_block[i]; b < first_block[i + 1]; ++b) acc += (double)partial[b];
    out[i] = (float)acc;
}

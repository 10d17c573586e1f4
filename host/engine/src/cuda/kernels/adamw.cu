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

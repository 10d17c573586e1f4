// Shared by every kernel (prepended to each source before NVRTC compiles it, so no include
// paths or CUDA headers are needed). bf16 is handled as raw bits with round-to-nearest-even,
// which is what the CPU backend (the `half` crate) does, so both backends round alike.

typedef unsigned short bf16_t;
typedef long long i64;

// No math.h under NVRTC: the infinities by their bits.
#define NEG_INF __int_as_float(0xff800000)
#define POS_INF __int_as_float(0x7f800000)

__device__ __forceinline__ float bf16_to_f32(bf16_t h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (bf16_t)((u >> 16) | 0x40u); // quiet NaN, sign kept
    }
    unsigned int rounding = 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)((u + rounding) >> 16);
}

// Loads and stores in f32 whatever the element type.
__device__ __forceinline__ float ld(const float* p, i64 i) { return p[i]; }
__device__ __forceinline__ float ld(const bf16_t* p, i64 i) { return bf16_to_f32(p[i]); }
__device__ __forceinline__ void st(float* p, i64 i, float v) { p[i] = v; }
__device__ __forceinline__ void st(bf16_t* p, i64 i, float v) { p[i] = f32_to_bf16(v); }

// A grid-stride loop over `n` elements.
#define FOR_EACH(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)blockDim.x * gridDim.x)

// Up to 8 dims of a strided view: the element at row-major index `i` sits at `offset + Σ idx·stride`.
#define MAX_RANK 8
struct Strided {
    int rank;
    i64 shape[MAX_RANK];
    i64 stride[MAX_RANK];
    i64 offset;
};

__device__ __forceinline__ i64 strided_index(const Strided& s, i64 i) {
    i64 off = s.offset;
    for (int d = s.rank - 1; d >= 0; --d) {
        i64 n = s.shape[d];
        off += (i % n) * s.stride[d];
        i /= n;
    }
    return off;
}

// Block-wide reductions over blockDim.x threads (a power of two, at most 1024) in a fixed tree
// order: the same inputs give the same bits on every run (no atomics). `buf` holds 32 floats.
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ float block_sum(float v, float* buf) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) buf[warp] = v;
    __syncthreads();
    float r = lane < warps ? buf[lane] : 0.0f;
    r = warp_sum(r);
    return r;
}

__device__ float block_max(float v, float* buf) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) buf[warp] = v;
    __syncthreads();
    float r = lane < warps ? buf[lane] : NEG_INF;
    r = warp_max(r);
    return r;
}

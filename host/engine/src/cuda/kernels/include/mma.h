// <mma.h> for NVRTC without the CUDA toolkit's headers: the part of `nvcuda::wmma` the kernels
// use, 16×16×16 tiles of bf16 or half with f32 (or half) accumulators, under CUDA's names and
// signatures, over the compiler builtins that CUDA's own mma.hpp calls. kernels.rs hands it to
// NVRTC as an in-memory header, so `#include <mma.h>` needs no include path at run time; the
// CUDA emulation has its own (tools/cuda-emu/include/mma.h) with the same names. sm_80 and
// later (bf16 fragments need sm_80).
//
// Also the part of cuda_bf16.h / cuda_fp16.h the fragments need: `__nv_bfloat16` and `__half`
// (`half`) as 16 raw bits, converted from f32 with round-to-nearest-even and to f32 exactly, so
// `frag.x[i] = frag.x[i] * s` works on every fragment type.
#pragma once

struct __align__(2) __nv_bfloat16 {
    unsigned short __x;
    __nv_bfloat16() = default;
    __device__ __nv_bfloat16(float f) {
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(__x) : "f"(f));
    }
    __device__ operator float() const { return __uint_as_float(((unsigned)__x) << 16); }
};

struct __align__(2) __half {
    unsigned short __x;
    __half() = default;
    __device__ __half(float f) { asm("cvt.rn.f16.f32 %0, %1;" : "=h"(__x) : "f"(f)); }
    __device__ operator float() const {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(__x));
        return f;
    }
};
typedef __half half;

__device__ inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
__device__ inline float __bfloat162float(__nv_bfloat16 h) { return float(h); }
__device__ inline __half __float2half(float f) { return __half(f); }
__device__ inline float __half2float(__half h) { return float(h); }

namespace nvcuda {
namespace wmma {

struct row_major;
struct col_major;
struct matrix_a;
struct matrix_b;
struct accumulator;

enum layout_t { mem_row_major, mem_col_major };

template <typename T, int size>
struct __align__(8) __frag_base {
    enum { num_elements = size, num_storage_elements = size };
    T x[size];
};

template <typename Use, int m, int n, int k, typename T, typename Layout = void>
class fragment;

template <> class fragment<matrix_a, 16, 16, 16, __nv_bfloat16, row_major> : public __frag_base<__nv_bfloat16, 8> {};
template <> class fragment<matrix_a, 16, 16, 16, __nv_bfloat16, col_major> : public __frag_base<__nv_bfloat16, 8> {};
template <> class fragment<matrix_b, 16, 16, 16, __nv_bfloat16, row_major> : public __frag_base<__nv_bfloat16, 8> {};
template <> class fragment<matrix_b, 16, 16, 16, __nv_bfloat16, col_major> : public __frag_base<__nv_bfloat16, 8> {};
template <> class fragment<matrix_a, 16, 16, 16, __half, row_major> : public __frag_base<__half, 16> {};
template <> class fragment<matrix_a, 16, 16, 16, __half, col_major> : public __frag_base<__half, 16> {};
template <> class fragment<matrix_b, 16, 16, 16, __half, row_major> : public __frag_base<__half, 16> {};
template <> class fragment<matrix_b, 16, 16, 16, __half, col_major> : public __frag_base<__half, 16> {};
template <> class fragment<accumulator, 16, 16, 16, float> : public __frag_base<float, 8> {};
template <> class fragment<accumulator, 16, 16, 16, __half> : public __frag_base<__half, 8> {};

// The builtins' layout argument: 0 row-major, 1 column-major; an mma's is 2·a + b.
template <typename Layout> struct __layout_bit;
template <> struct __layout_bit<row_major> { enum { v = 0 }; };
template <> struct __layout_bit<col_major> { enum { v = 1 }; };

template <typename T> struct __fill_type { typedef T type; };

template <typename T, int size>
__device__ inline void fill_fragment(__frag_base<T, size>& f, const typename __fill_type<T>::type& v) {
#pragma unroll
    for (int i = 0; i < size; ++i) f.x[i] = v;
}

template <typename L>
__device__ inline void load_matrix_sync(fragment<matrix_a, 16, 16, 16, __nv_bfloat16, L>& a, const __nv_bfloat16* p, unsigned ldm) {
    __mma_bf16_m16n16k16_ld_a((int*)&a, (const int*)p, ldm, __layout_bit<L>::v);
}
template <typename L>
__device__ inline void load_matrix_sync(fragment<matrix_b, 16, 16, 16, __nv_bfloat16, L>& b, const __nv_bfloat16* p, unsigned ldm) {
    __mma_bf16_m16n16k16_ld_b((int*)&b, (const int*)p, ldm, __layout_bit<L>::v);
}
template <typename L>
__device__ inline void load_matrix_sync(fragment<matrix_a, 16, 16, 16, __half, L>& a, const __half* p, unsigned ldm) {
    __hmma_m16n16k16_ld_a((int*)&a, (const int*)p, ldm, __layout_bit<L>::v);
}
template <typename L>
__device__ inline void load_matrix_sync(fragment<matrix_b, 16, 16, 16, __half, L>& b, const __half* p, unsigned ldm) {
    __hmma_m16n16k16_ld_b((int*)&b, (const int*)p, ldm, __layout_bit<L>::v);
}
__device__ inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& c, const float* p, unsigned ldm, layout_t layout) {
    if (layout == mem_row_major)
        __hmma_m16n16k16_ld_c_f32((float*)&c, p, ldm, 0);
    else
        __hmma_m16n16k16_ld_c_f32((float*)&c, p, ldm, 1);
}
__device__ inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, __half>& c, const __half* p, unsigned ldm, layout_t layout) {
    if (layout == mem_row_major)
        __hmma_m16n16k16_ld_c_f16((int*)&c, (const int*)p, ldm, 0);
    else
        __hmma_m16n16k16_ld_c_f16((int*)&c, (const int*)p, ldm, 1);
}

__device__ inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& c, unsigned ldm, layout_t layout) {
    if (layout == mem_row_major)
        __hmma_m16n16k16_st_c_f32(p, (const float*)&c, ldm, 0);
    else
        __hmma_m16n16k16_st_c_f32(p, (const float*)&c, ldm, 1);
}
__device__ inline void store_matrix_sync(__half* p, const fragment<accumulator, 16, 16, 16, __half>& c, unsigned ldm, layout_t layout) {
    if (layout == mem_row_major)
        __hmma_m16n16k16_st_c_f16((int*)p, (const int*)&c, ldm, 0);
    else
        __hmma_m16n16k16_st_c_f16((int*)p, (const int*)&c, ldm, 1);
}

template <typename LA, typename LB>
__device__ inline void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
        const fragment<matrix_a, 16, 16, 16, __nv_bfloat16, LA>& a,
        const fragment<matrix_b, 16, 16, 16, __nv_bfloat16, LB>& b,
        const fragment<accumulator, 16, 16, 16, float>& c) {
    __mma_bf16_m16n16k16_mma_f32((float*)&d, (const int*)&a, (const int*)&b, (const float*)&c,
        2 * __layout_bit<LA>::v + __layout_bit<LB>::v, 0);
}
template <typename LA, typename LB>
__device__ inline void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
        const fragment<matrix_a, 16, 16, 16, __half, LA>& a,
        const fragment<matrix_b, 16, 16, 16, __half, LB>& b,
        const fragment<accumulator, 16, 16, 16, float>& c) {
    __hmma_m16n16k16_mma_f32f32((float*)&d, (const int*)&a, (const int*)&b, (const float*)&c,
        2 * __layout_bit<LA>::v + __layout_bit<LB>::v, 0);
}
template <typename LA, typename LB>
__device__ inline void mma_sync(fragment<accumulator, 16, 16, 16, __half>& d,
        const fragment<matrix_a, 16, 16, 16, __half, LA>& a,
        const fragment<matrix_b, 16, 16, 16, __half, LB>& b,
        const fragment<accumulator, 16, 16, 16, __half>& c) {
    __hmma_m16n16k16_mma_f16f16((int*)&d, (const int*)&a, (const int*)&b, (const int*)&c,
        2 * __layout_bit<LA>::v + __layout_bit<LB>::v, 0);
}

} // namespace wmma
} // namespace nvcuda

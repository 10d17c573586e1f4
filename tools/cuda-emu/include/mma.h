// <mma.h> under CUDA emulation: the part of `nvcuda::wmma` the kernels use, with CUDA's names and
// signatures (the NVRTC side is host/engine/src/cuda/kernels/include/mma.h, the same subset over
// the hardware's builtins): fragments of 16×16×16 tiles of bf16 or half, accumulators in f32 or
// half, fill_fragment, load_matrix_sync, mma_sync and store_matrix_sync.
//
// load_matrix_sync, store_matrix_sync and mma_sync are warp-collective, as on the hardware: every
// lane of a full warp must call them together with the same pointer, stride and layout (checked
// here: a diverged warp, a partial warp, lanes passing different pointers, a pointer not 256-bit
// aligned or a stride not a multiple of 16 bytes fail the kernel naming the lane). fill_fragment
// and elementwise work on `frag.x[i]` are the lane's own.
//
// Which elements a lane holds is unspecified in CUDA; here the 256 elements of a tile, in
// row-major order of the matrix (A: M×K, B: K×N, C: M×N), are dealt out in runs:
// x[i] of lane l is element (l·n + i) mod 256, n = num_elements (16 for half A/B fragments, so
// lanes 16–31 hold a second copy; 8 otherwise). Not the hardware's mapping, deliberately: a
// kernel that relies on one is wrong on some GPU, and here it computes garbage.
//
// mma_sync computes d = c + a·b per element as c, then the 16 products in k order added in f32
// (a product of two bf16 or half values is exact in f32); a half accumulator is rounded once at
// the end. Tensor cores add in another order, so results agree to f32 rounding, not bitwise.
#pragma once

namespace emu {

inline unsigned short f32_to_bf16_bits(float f) {
    unsigned u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float bf16_bits_to_f32(unsigned short h) {
    unsigned u = (unsigned)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/// f32 to IEEE half, round to nearest even (subnormals, infinities and NaN included).
inline unsigned short f32_to_f16_bits(float f) {
    unsigned u;
    memcpy(&u, &f, 4);
    unsigned sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (unsigned short)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u); // rounds past 65504
    if (a < 0x38800000u) {
        // Below 2^-14: a subnormal half, |f|·2^24 rounded to an integer (1024 is 2^-14 itself).
        return (unsigned short)(sign | (unsigned)std::nearbyint(std::fabs(f) * 16777216.0f));
    }
    unsigned r = a - 0x38000000u; // exponent rebiased from 127 to 15
    return (unsigned short)(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
}

inline float f16_bits_to_f32(unsigned short h) {
    unsigned sign = (unsigned)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
        float v = (float)m * 5.9604644775390625e-8f; // m·2^-24, exact
        return sign ? -v : v;
    }
    unsigned u = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
    float f;
    memcpy(&f, &u, 4);
    return f;
}

} // namespace emu

struct __align__(2) __nv_bfloat16 {
    unsigned short __x;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) : __x(emu::f32_to_bf16_bits(f)) {}
    operator float() const { return emu::bf16_bits_to_f32(__x); }
};

struct __align__(2) __half {
    unsigned short __x;
    __half() = default;
    __half(float f) : __x(emu::f32_to_f16_bits(f)) {}
    operator float() const { return emu::f16_bits_to_f32(__x); }
};
typedef __half half;

inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline float __bfloat162float(__nv_bfloat16 h) { return float(h); }
inline __half __float2half(float f) { return __half(f); }
inline float __half2float(__half h) { return float(h); }

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

template <typename Layout> struct __layout_bit;
template <> struct __layout_bit<row_major> { enum { v = 0 }; };
template <> struct __layout_bit<col_major> { enum { v = 1 }; };

template <typename T> struct __fill_type { typedef T type; };

template <typename T, int size>
inline void fill_fragment(__frag_base<T, size>& f, const typename __fill_type<T>::type& v) {
    for (int i = 0; i < size; ++i) f.x[i] = v;
}

namespace __emu {

/// The tile element (row-major index) that x[i] of `lane` holds in a fragment of n per lane.
inline int element(int lane, int i, int n) { return (lane * n + i) % 256; }

/// Enters a load or store of a tile at `p` with stride `ldm` (elements of `bytes` each).
inline void enter_memory_op(const char* op, const void* p, unsigned ldm, int col_major,
                            int bytes) {
    static const char* const names[3] = {"the pointer", "ldm", "the layout"};
    unsigned long long args[3] = {(unsigned long long)(uintptr_t)p, ldm,
                                  (unsigned long long)col_major};
    emu::warp_collective(op, args, names, 3);
    if ((uintptr_t)p % 32 != 0)
        emu::fault("%s: pointer %p is not 256-bit (32-byte) aligned", op, p);
    if ((ldm * (unsigned)bytes) % 16 != 0)
        emu::fault("%s: ldm %u is not a multiple of 16 bytes (%d elements)", op, ldm,
                   16 / bytes);
}

/// x[i] of the calling lane from (or into) the tile at p: element (r, c) at p[r·ldm + c]
/// row-major, p[c·ldm + r] column-major.
template <typename T, int n, typename P>
inline P* at(P* p, unsigned ldm, int col_major, int i) {
    int e = element(emu::g.current % 32, i, n), r = e / 16, c = e % 16;
    return p + (col_major ? (size_t)c * ldm + r : (size_t)r * ldm + c);
}

template <typename T, int n>
inline void load(const char* op, __frag_base<T, n>& f, const T* p, unsigned ldm, int col_major) {
    enter_memory_op(op, p, ldm, col_major, (int)sizeof(T));
    for (int i = 0; i < n; ++i) f.x[i] = *at<T, n>(p, ldm, col_major, i);
    emu::warp_collective_end(op);
}

template <typename T, int n>
inline void store(const char* op, T* p, const __frag_base<T, n>& f, unsigned ldm, int col_major) {
    enter_memory_op(op, p, ldm, col_major, (int)sizeof(T));
    for (int i = 0; i < n; ++i) *at<T, n>(p, ldm, col_major, i) = f.x[i];
    emu::warp_collective_end(op);
}

/// d = c + a·b over the warp: every lane shares its a and b fragments and computes its own
/// elements of d.
template <typename TD, typename TA, int NA, typename TB, int NB, typename TC>
inline void mma(__frag_base<TD, 8>& d, const __frag_base<TA, NA>& a, const __frag_base<TB, NB>& b,
                const __frag_base<TC, 8>& c) {
    const char* op = "wmma::mma_sync";
    emu::warp_collective(op, nullptr, nullptr, 0, &a, &b);
    emu::Warp& w = emu::my_warp();
    int lane = emu::g.current % 32;
    float out[8];
    for (int i = 0; i < 8; ++i) {
        int e = element(lane, i, 8), r = e / 16, col = e % 16;
        float acc = float(c.x[i]);
        for (int k = 0; k < 16; ++k) {
            int ea = r * 16 + k, eb = k * 16 + col;
            auto* fa = static_cast<const __frag_base<TA, NA>*>(w.operand[ea / NA][0]);
            auto* fb = static_cast<const __frag_base<TB, NB>*>(w.operand[eb / NB][1]);
            acc += float(fa->x[ea % NA]) * float(fb->x[eb % NB]);
        }
        out[i] = acc;
    }
    emu::warp_collective_end(op);
    for (int i = 0; i < 8; ++i) d.x[i] = out[i];
}

} // namespace __emu

template <typename L>
inline void load_matrix_sync(fragment<matrix_a, 16, 16, 16, __nv_bfloat16, L>& a, const __nv_bfloat16* p, unsigned ldm) {
    __emu::load("wmma::load_matrix_sync", a, p, ldm, __layout_bit<L>::v);
}
template <typename L>
inline void load_matrix_sync(fragment<matrix_b, 16, 16, 16, __nv_bfloat16, L>& b, const __nv_bfloat16* p, unsigned ldm) {
    __emu::load("wmma::load_matrix_sync", b, p, ldm, __layout_bit<L>::v);
}
template <typename L>
inline void load_matrix_sync(fragment<matrix_a, 16, 16, 16, __half, L>& a, const __half* p, unsigned ldm) {
    __emu::load("wmma::load_matrix_sync", a, p, ldm, __layout_bit<L>::v);
}
template <typename L>
inline void load_matrix_sync(fragment<matrix_b, 16, 16, 16, __half, L>& b, const __half* p, unsigned ldm) {
    __emu::load("wmma::load_matrix_sync", b, p, ldm, __layout_bit<L>::v);
}
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& c, const float* p, unsigned ldm, layout_t layout) {
    __emu::load("wmma::load_matrix_sync", c, p, ldm, layout == mem_col_major);
}
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, __half>& c, const __half* p, unsigned ldm, layout_t layout) {
    __emu::load("wmma::load_matrix_sync", c, p, ldm, layout == mem_col_major);
}

inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& c, unsigned ldm, layout_t layout) {
    __emu::store("wmma::store_matrix_sync", p, c, ldm, layout == mem_col_major);
}
inline void store_matrix_sync(__half* p, const fragment<accumulator, 16, 16, 16, __half>& c, unsigned ldm, layout_t layout) {
    __emu::store("wmma::store_matrix_sync", p, c, ldm, layout == mem_col_major);
}

template <typename LA, typename LB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
        const fragment<matrix_a, 16, 16, 16, __nv_bfloat16, LA>& a,
        const fragment<matrix_b, 16, 16, 16, __nv_bfloat16, LB>& b,
        const fragment<accumulator, 16, 16, 16, float>& c) {
    __emu::mma(d, a, b, c);
}
template <typename LA, typename LB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
        const fragment<matrix_a, 16, 16, 16, __half, LA>& a,
        const fragment<matrix_b, 16, 16, 16, __half, LB>& b,
        const fragment<accumulator, 16, 16, 16, float>& c) {
    __emu::mma(d, a, b, c);
}
template <typename LA, typename LB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, __half>& d,
        const fragment<matrix_a, 16, 16, 16, __half, LA>& a,
        const fragment<matrix_b, 16, 16, 16, __half, LB>& b,
        const fragment<accumulator, 16, 16, 16, __half>& c) {
    __emu::mma(d, a, b, c);
}

} // namespace wmma
} // namespace nvcuda

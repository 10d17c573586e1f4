// Strided copies with casts: how views become contiguous and how dtypes change on the GPU.
// Floats go through f32; integers through i64.

#define COPY_FLOAT(NAME, S, D) \
extern "C" __global__ void NAME(const S* src, D* dst, Strided s, i64 n) { \
    FOR_EACH(i, n) st(dst, i, ld(src, strided_index(s, i))); \
}
COPY_FLOAT(copy_f32_f32, float, float)
COPY_FLOAT(copy_f32_bf16, float, bf16_t)
COPY_FLOAT(copy_bf16_f32, bf16_t, float)
COPY_FLOAT(copy_bf16_bf16, bf16_t, bf16_t)

#define COPY_INT(NAME, S, D) \
extern "C" __global__ void NAME(const S* src, D* dst, Strided s, i64 n) { \
    FOR_EACH(i, n) dst[i] = (D)src[strided_index(s, i)]; \
}
COPY_INT(copy_i64_i64, i64, i64)
COPY_INT(copy_i32_i32, int, int)
COPY_INT(copy_i32_i64, int, i64)
COPY_INT(copy_i64_i32, i64, int)

#define INT_TO_FLOAT(NAME, S, D) \
extern "C" __global__ void NAME(const S* src, D* dst, Strided s, i64 n) { \
    FOR_EACH(i, n) st(dst, i, (float)src[strided_index(s, i)]); \
}
INT_TO_FLOAT(copy_i64_f32, i64, float)
INT_TO_FLOAT(copy_i64_bf16, i64, bf16_t)
INT_TO_FLOAT(copy_i32_f32, int, float)

// Float to integer truncates toward zero, as Rust's `as` does (NaN to 0).
#define FLOAT_TO_INT(NAME, S, D) \
extern "C" __global__ void NAME(const S* src, D* dst, Strided s, i64 n) { \
    FOR_EACH(i, n) { float v = ld(src, strided_index(s, i)); dst[i] = v != v ? (D)0 : (D)v; } \
}
FLOAT_TO_INT(copy_f32_i64, float, i64)
FLOAT_TO_INT(copy_bf16_i64, bf16_t, i64)
FLOAT_TO_INT(copy_f32_i32, float, int)

extern "C" __global__ void fill_f32(float* dst, float v, i64 n) { FOR_EACH(i, n) dst[i] = v; }

// Writes into a strided view: dst[view(i)] = src[i] (src contiguous, already in dst's dtype).
// How a KV cache appends, a narrowed gradient lands in zeros, and `assign` writes, on the GPU.
#define PUT(NAME, T) \
extern "C" __global__ void NAME(const T* src, T* dst, Strided s, i64 n) { \
    FOR_EACH(i, n) dst[strided_index(s, i)] = src[i]; \
}
PUT(put_f32, float)
PUT(put_bf16, bf16_t)
PUT(put_i64, i64)
PUT(put_i32, int)

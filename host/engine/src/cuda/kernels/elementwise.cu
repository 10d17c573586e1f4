// Elementwise maps in f32 (inputs and output f32 or bf16), matching the CPU backend's formulas:
// unary ops and their gradients, broadcasting binary ops, affine, powf, clamp, add-assign.
// Op codes follow the order of `UnaryOp` / `BinaryOp` in ops/elementwise.rs.

#define SQRT_2_OVER_PI 0.7978846f
#define GELU_C 0.044715f
#define INV_SQRT_2 0.70710678f
#define INV_SQRT_2PI 0.3989423f

__device__ __forceinline__ float sigmoidf(float v) { return 1.0f / (1.0f + expf(-v)); }

__device__ float unary_f(int op, float v) {
    switch (op) {
    case 0: return -v;
    case 1: return expf(v);
    case 2: return logf(v);
    case 3: return sqrtf(v);
    case 4: return 1.0f / sqrtf(v);
    case 5: return tanhf(v);
    case 6: return sigmoidf(v);
    case 7: return v * sigmoidf(v);
    case 8: return 0.5f * v * (1.0f + tanhf(SQRT_2_OVER_PI * (v + GELU_C * v * v * v)));
    case 9: return 0.5f * v * (1.0f + erff(v * INV_SQRT_2));
    case 10: return fmaxf(v, 0.0f);
    case 11: return v > 20.0f ? v : fmaxf(v, 0.0f) + log1pf(expf(-fabsf(v)));
    case 12: return fabsf(v);
    case 13: return sinf(v);
    default: return cosf(v);
    }
}

__device__ float unary_grad_f(int op, float v, float g) {
    switch (op) {
    case 0: return -g;
    case 1: return g * expf(v);
    case 2: return g / v;
    case 3: return g * 0.5f / sqrtf(v);
    case 4: return g * -0.5f / (v * sqrtf(v));
    case 5: { float t = tanhf(v); return g * (1.0f - t * t); }
    case 6: { float s = sigmoidf(v); return g * s * (1.0f - s); }
    case 7: { float s = sigmoidf(v); return g * s * (1.0f + v * (1.0f - s)); }
    case 8: {
        float u = SQRT_2_OVER_PI * (v + GELU_C * v * v * v);
        float t = tanhf(u);
        float du = SQRT_2_OVER_PI * (1.0f + 3.0f * GELU_C * v * v);
        return g * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du);
    }
    case 9: {
        float cdf = 0.5f * (1.0f + erff(v * INV_SQRT_2));
        float pdf = INV_SQRT_2PI * expf(-0.5f * v * v);
        return g * (cdf + v * pdf);
    }
    case 10: return v > 0.0f ? g : 0.0f;
    case 11: return v > 20.0f ? g : g * sigmoidf(v);
    case 12: return v > 0.0f ? g : (v < 0.0f ? -g : 0.0f);
    case 13: return g * cosf(v);
    default: return -g * sinf(v);
    }
}

__device__ __forceinline__ float binary_f(int op, float a, float b) {
    switch (op) {
    case 0: return a + b;
    case 1: return a - b;
    case 2: return a * b;
    case 3: return a / b;
    case 4: return fmaxf(a, b);
    case 5: return fminf(a, b);
    case 6: return a >= b ? 1.0f : 0.0f;
    case 7: return a <= b ? 1.0f : 0.0f;
    default: return a == b ? 1.0f : 0.0f;
    }
}

#define ELEMENTWISE(SUF, T) \
extern "C" __global__ void unary_##SUF(int op, const T* x, T* y, i64 n) { \
    FOR_EACH(i, n) st(y, i, unary_f(op, ld(x, i))); \
} \
extern "C" __global__ void unary_grad_##SUF(int op, const T* x, const T* g, T* out, i64 n) { \
    FOR_EACH(i, n) st(out, i, unary_grad_f(op, ld(x, i), ld(g, i))); \
} \
extern "C" __global__ void binary_##SUF(int op, const T* a, Strided sa, const T* b, Strided sb, T* out, i64 n) { \
    FOR_EACH(i, n) st(out, i, binary_f(op, ld(a, strided_index(sa, i)), ld(b, strided_index(sb, i)))); \
} \
extern "C" __global__ void affine_##SUF(const T* x, T* y, float mul, float add, i64 n) { \
    FOR_EACH(i, n) st(y, i, ld(x, i) * mul + add); \
} \
extern "C" __global__ void powf_##SUF(const T* x, T* y, float e, i64 n) { \
    FOR_EACH(i, n) st(y, i, powf(ld(x, i), e)); \
} \
extern "C" __global__ void clamp_##SUF(const T* x, T* y, float lo, float hi, i64 n) { \
    FOR_EACH(i, n) st(y, i, fminf(fmaxf(ld(x, i), lo), hi)); \
} \
extern "C" __global__ void add_assign_##SUF(T* dst, const T* src, Strided s, i64 n) { \
    FOR_EACH(i, n) st(dst, i, ld(dst, i) + ld(src, strided_index(s, i))); \
}
ELEMENTWISE(f32, float)
ELEMENTWISE(bf16, bf16_t)

// SwiGLU, fused: silu(gate) * up and its two gradients.
#define SWIGLU(SUF, T) \
extern "C" __global__ void swiglu_##SUF(const T* gate, const T* up, T* out, i64 n) { \
    FOR_EACH(i, n) { float g = ld(gate, i); st(out, i, g * sigmoidf(g) * ld(up, i)); } \
} \
extern "C" __global__ void swiglu_backward_##SUF(const T* gate, const T* up, const T* grad, T* dgate, T* dup, i64 n) { \
    FOR_EACH(i, n) { \
        float g = ld(gate, i), u = ld(up, i), d = ld(grad, i), s = sigmoidf(g); \
        st(dup, i, d * g * s); \
        st(dgate, i, d * u * s * (1.0f + g * (1.0f - s))); \
    } \
}
SWIGLU(f32, float)
SWIGLU(bf16, bf16_t)

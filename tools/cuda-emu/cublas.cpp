// cuBLAS on the CPU, for the emulated driver (runtime.cpp): the products the CUDA backend asks
// for, accumulated in f32 (TF32 rounds f32 operands first when asked), f32 or bf16 operands, in
// an order that depends on the shape as the real library's does (split-k for few output rows).
// A handle's products run on its stream's device and may only touch that device's blocks.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

#include "emu_shared.h"

namespace {

constexpr int CUDA_R_32F = 0;
constexpr int CUDA_R_16BF = 14;

/// `f` rounded to TF32 (10 mantissa bits, to nearest even), as tensor cores read f32 operands.
float tf32(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0xfffu + ((u >> 13) & 1u)) & ~0x1fffu;
    memcpy(&f, &u, 4);
    return f;
}

float load(const void* p, int type, size_t i) {
    if (type == CUDA_R_16BF) {
        uint32_t bits = uint32_t(static_cast<const uint16_t*>(p)[i]) << 16;
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    return static_cast<const float*>(p)[i];
}

void store(void* p, int type, size_t i, float v) {
    if (type == CUDA_R_16BF) {
        uint32_t u;
        memcpy(&u, &v, 4);
        uint16_t h;
        if ((u & 0x7fffffffu) > 0x7f800000u)
            h = uint16_t((u >> 16) | 0x40u);
        else
            h = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        static_cast<uint16_t*>(p)[i] = h;
    } else {
        static_cast<float*>(p)[i] = v;
    }
}

size_t type_size(int type) { return type == CUDA_R_16BF ? 2 : 4; }

/// Column-major C = alpha·op(A)·op(B) + beta·C for one batch entry. Like the real library,
/// the summation order depends on the shape: with few output columns (the rows of a row-major
/// product: a decode step) k is split in two halves summed apart (split-k), so code that needs
/// a row's bits not to depend on the rows beside it cannot rely on cuBLAS here either.
void gemm(int ta, int tb, int m, int n, int k, float alpha, const void* A, int at, long lda,
          const void* B, int bt, long ldb, float beta, void* C, int ct, long ldc, bool use_tf32) {
    std::vector<float> a(size_t(m) * k), b(k), acc(m), part(m);
    for (int p = 0; p < k; ++p)
        for (int i = 0; i < m; ++i)
            a[size_t(p) * m + i] = load(A, at, ta ? size_t(i) * lda + p : size_t(p) * lda + i);
    if (use_tf32)
        for (auto& x : a) x = tf32(x);
    int split = n < 8 && k >= 32 ? k / 2 : k;
    for (int j = 0; j < n; ++j) {
        for (int p = 0; p < k; ++p)
            b[p] = load(B, bt, tb ? size_t(p) * ldb + j : size_t(j) * ldb + p);
        if (use_tf32)
            for (auto& x : b) x = tf32(x);
        std::fill(acc.begin(), acc.end(), 0.0f);
        std::fill(part.begin(), part.end(), 0.0f);
        for (int p = 0; p < k; ++p) {
            const float* ap = &a[size_t(p) * m];
            float bp = b[p];
            float* dst = p < split ? acc.data() : part.data();
            for (int i = 0; i < m; ++i) dst[i] += ap[i] * bp;
        }
        for (int i = 0; i < m; ++i) acc[i] += part[i];
        for (int i = 0; i < m; ++i) {
            size_t ci = size_t(j) * ldc + i;
            float v = alpha * acc[i];
            if (beta != 0.0f) v += beta * load(C, ct, ci);
            store(C, ct, ci, v);
        }
    }
}

/// The bytes operand X of a product spans: the last element's offset plus one.
size_t span(int trans, int rows, int cols, long ld, long long stride, int batch, int type) {
    if (rows == 0 || cols == 0 || batch == 0) return 0;
    // op(X) is rows x cols; stored X is (trans ? cols x rows : rows x cols), column-major.
    long r = trans ? cols : rows, c = trans ? rows : cols;
    size_t last = size_t(stride) * (batch - 1) + size_t(ld) * (c - 1) + (r - 1);
    return (last + 1) * type_size(type);
}

} // namespace

extern "C" {


// A handle remembers its stream: products run on that stream's device.
struct Blas {
    void* stream;
    int dev;
};
int cublasCreate_v2(void** h) {
    *h = new Blas{nullptr, emu_rt::current_device()};
    return 0;
}
int cublasDestroy_v2(void* h) {
    delete static_cast<Blas*>(h);
    return 0;
}
int cublasSetStream_v2(void* h, void* s) {
    auto* b = static_cast<Blas*>(h);
    b->stream = s;
    b->dev = emu_rt::stream_device(s);
    return 0;
}
int cublasSetMathMode(void*, int) { return 0; }
int cublasSetWorkspace_v2(void*, void*, size_t) { return 0; }

int cublasGemmStridedBatchedEx(void* handle, int ta, int tb, int m, int n, int k, const void* alpha,
                               const void* A, int at, int lda, long long sa, const void* B,
                               int bt, int ldb, long long sb, const void* beta, void* C, int ct,
                               int ldc, long long sc, int batch, int compute, int) {
    std::lock_guard<std::recursive_mutex> l(emu_rt::big_lock);
    for (int t : {at, bt, ct})
        if (t != CUDA_R_32F && t != CUDA_R_16BF) {
            emu_rt::complain("cuBLAS: only f32 and bf16 products are emulated");
            return 15; // CUBLAS_STATUS_NOT_SUPPORTED
        }
    // CUBLAS_COMPUTE_32F, or CUBLAS_COMPUTE_32F_FAST_TF32 (f32 operands rounded to TF32).
    if (compute != 68 && compute != 77) {
        emu_rt::complain("cuBLAS: only CUBLAS_COMPUTE_32F and CUBLAS_COMPUTE_32F_FAST_TF32 are emulated");
        return 15;
    }
    bool use_tf32 = compute == 77 && at == CUDA_R_32F && bt == CUDA_R_32F;
    if (m < 0 || n < 0 || k < 0 || batch < 0 || lda < (ta ? k : m) || ldb < (tb ? n : k) ||
        ldc < m)
        return 7; // CUBLAS_STATUS_INVALID_VALUE
    auto a = reinterpret_cast<uintptr_t>(A), b = reinterpret_cast<uintptr_t>(B),
         c = reinterpret_cast<uintptr_t>(C);
    size_t an = span(ta, m, k, lda, sa, batch, at), bn = span(tb, k, n, ldb, sb, batch, bt),
           cn = span(0, m, n, ldc, sc, batch, ct);
    int dev = static_cast<Blas*>(handle)->dev;
    auto on_device = [dev](uintptr_t p, size_t n) { return emu_rt::kernel_range(p, n, dev); };
    if (an && k && !on_device(a, an)) return emu_rt::bad_range("cuBLAS A", a, an, dev), 14;
    if (bn && k && !on_device(b, bn)) return emu_rt::bad_range("cuBLAS B", b, bn, dev), 14;
    if (cn && !on_device(c, cn)) return emu_rt::bad_range("cuBLAS C", c, cn, dev), 14;
    // alpha and beta are host values read now; the product runs when the stream reaches it.
    float al = *static_cast<const float*>(alpha), be = *static_cast<const float*>(beta);
    int rc = emu_rt::enqueue(static_cast<Blas*>(handle)->stream, [=]() {
        for (int i = 0; i < batch; ++i)
            gemm(ta, tb, m, n, k, al, static_cast<const char*>(A) + sa * i * type_size(at), at,
                 lda, static_cast<const char*>(B) + sb * i * type_size(bt), bt, ldb, be,
                 static_cast<char*>(C) + sc * i * type_size(ct), ct, ldc, use_tf32);
        return 0;
    });
    return rc ? 13 : 0; // CUBLAS_STATUS_EXECUTION_FAILED after an earlier failure
}
int cublasGemmEx(void* h, int ta, int tb, int m, int n, int k, const void* alpha, const void* A,
                 int at, int lda, const void* B, int bt, int ldb, const void* beta, void* C,
                 int ct, int ldc, int compute, int algo) {
    return cublasGemmStridedBatchedEx(h, ta, tb, m, n, k, alpha, A, at, lda, 0, B, bt, ldb, 0,
                                      beta, C, ct, ldc, 0, 1, compute, algo);
}
int cublasSgemm_v2(void* h, int ta, int tb, int m, int n, int k, const float* alpha,
                   const float* A, int lda, const float* B, int ldb, const float* beta, float* C,
                   int ldc) {
    return cublasGemmEx(h, ta, tb, m, n, k, alpha, A, CUDA_R_32F, lda, B, CUDA_R_32F, ldb, beta,
                        C, CUDA_R_32F, ldc, 68, -1);
}

} // extern "C"

// The prelude of a kernel module under CUDA emulation: what NVRTC provides to a kernel source
// (the built-in indices, shared memory, barriers, warp shuffles, intrinsics), written for the
// host's C++ compiler, plus the scheduler that runs a launch's threads on the CPU.
//
// A launch runs its blocks one after another; a block's threads are fibers on one OS thread,
// switched cooperatively at __syncthreads, warp shuffles and warp-collective calls (the wmma
// fragment operations of include/mma.h), so barrier semantics hold exactly (a thread never runs
// past a barrier the others have not reached) and a kernel that waits for threads that exited
// or diverged is reported instead of hanging, as is a warp-collective call that not every lane
// of its warp makes with the same arguments. `__shared__` variables are function statics, which
// is shared memory's meaning when one block runs at a time.
//
// The CUDA headers a kernel may include are in include/ beside this file (mma.h: nvcuda::wmma;
// cuda_pipeline.h: the cp.async primitives, as copies done at the wait); runtime.cpp compiles
// with that folder on the include path.
//
// What emulation cannot show: speed, the GPU's rounding where NVRTC contracts a*b+c into an FMA
// (here contraction is off), races between blocks, and memory-model subtleties. It runs the
// kernels' logic, indexing and launch shapes as the GPU would, and checks every pointer argument
// against the emulated device memory.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sys/mman.h>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__ EMU_GLOBAL
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
#ifndef EMU_SCAN
#define EMU_GLOBAL
#endif

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
typedef dim3 uint3;
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
struct int2 { int x, y; };
struct int4 { int x, y, z, w; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline int2 make_int2(int x, int y) { return {x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

namespace emu {

/// A CUDA thread as a fiber: its saved stack pointer and whether it has returned.
struct Fiber {
    void* sp = nullptr;
    bool done = false;
};

/// A barrier among `alive` threads: arrivals counted, released by bumping the generation.
struct Barrier {
    int arrived = 0;
    unsigned generation = 0;
    int alive = 0;
};

struct Warp {
    Barrier bar;
    unsigned long long slot[32];
    /// Where each lane is in a warp-wide call (the call's name), checked by warp collectives.
    const char* op[32];
    /// The arguments a warp collective needs equal on every lane, and the operands it shares.
    unsigned long long args[32][3];
    const void* operand[32][2];
};

/// A cp.async copy issued and not yet waited for, in the commit batch `batch`.
struct AsyncCopy {
    void* dst;
    const void* src;
    unsigned bytes, zfill, batch;
};

/// A thread's pipeline (cuda_pipeline.h): copies in flight and batches committed so far.
struct Pipeline {
    std::vector<AsyncCopy> pending;
    unsigned committed = 0;
};

constexpr int MAX_THREADS = 1024;
constexpr size_t STACK_BYTES = 256 << 10;

struct State {
    dim3 thread_idx, block_idx, block_dim, grid_dim;
    int current = 0;
    int threads = 0;
    void* scheduler_sp = nullptr;
    Fiber fibers[MAX_THREADS];
    char* stacks = nullptr;
    Barrier block;
    Warp warps[MAX_THREADS / 32];
    int sync_or = 0;
    unsigned long long progress = 0;
    void (*body)(void*) = nullptr;
    void* body_ctx = nullptr;
    unsigned char* dynamic_smem = nullptr;
    size_t dynamic_smem_bytes = 0;
    int (*is_device_ptr)(const void*) = nullptr;
    /// Where each thread waits (the barrier's or call's name), for the deadlock report.
    const char* waits_at[MAX_THREADS];
    Pipeline pipes[MAX_THREADS];
    /// A kernel error found by a thread (emu::fault): the block stops and the launch fails.
    bool faulted = false;
    char fault[512];
};

static State g;

} // namespace emu

#define threadIdx (::emu::g.thread_idx)
#define blockIdx (::emu::g.block_idx)
#define blockDim (::emu::g.block_dim)
#define gridDim (::emu::g.grid_dim)
#define warpSize 32

// Context switch between fibers (x86-64 System V): pushes the callee-saved registers, saves the
// stack pointer to *from, loads `to` and pops the other fiber's registers.
extern "C" void emu_switch(void** from, void* to);
#if defined(__x86_64__)
asm(".text\n"
    ".type emu_switch,@function\n"
    "emu_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
    "  ret\n"
    ".size emu_switch, .-emu_switch\n");
#else
#error "CUDA emulation switches fibers with x86-64 assembly"
#endif

namespace emu {

inline int linear_tid() { return g.current; }

/// Back to the scheduler; returns when the scheduler resumes this thread.
inline void yield() { emu_switch(&g.fibers[g.current].sp, g.scheduler_sp); }

inline void release(Barrier& b) {
    b.arrived = 0;
    b.generation++;
    g.progress++;
}

inline void wait(Barrier& b, const char* what) {
    unsigned gen = b.generation;
    if (++b.arrived >= b.alive) {
        release(b);
        return;
    }
    g.waits_at[g.current] = what;
    while (b.generation == gen) yield();
    g.waits_at[g.current] = nullptr;
}

inline Warp& my_warp() { return g.warps[g.current / 32]; }

/// Ends the block with a kernel error (what CUDA leaves undefined and the hardware would run
/// into silently): the message, after the thread's index, becomes the launch's error.
[[noreturn]] __attribute__((format(printf, 1, 2))) inline void fault(const char* fmt, ...) {
    if (!g.faulted) {
        int n = snprintf(g.fault, sizeof g.fault, "thread (%u, %u, %u) (warp %d, lane %d): ",
                         g.thread_idx.x, g.thread_idx.y, g.thread_idx.z, g.current / 32,
                         g.current % 32);
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(g.fault + n, sizeof g.fault - n, fmt, ap);
        va_end(ap);
        g.faulted = true;
    }
    g.fibers[g.current].done = true;
    void* dead;
    emu_switch(&dead, g.scheduler_sp);
    __builtin_unreachable();
}

/// Completes the thread's cp.async copies of batches before `limit` (all of them at ~0u).
inline void pipeline_complete(unsigned limit) {
    auto& pending = g.pipes[g.current].pending;
    size_t kept = 0;
    for (size_t i = 0; i < pending.size(); ++i) {
        const AsyncCopy& c = pending[i];
        if (c.batch < limit) {
            memcpy(c.dst, c.src, c.bytes - c.zfill);
            memset(static_cast<char*>(c.dst) + (c.bytes - c.zfill), 0, c.zfill);
        } else {
            pending[kept++] = c;
        }
    }
    pending.resize(kept);
}

/// Enters the warp-collective call `op`: every lane of a full warp must make it together, with
/// equal `args` (`names` says what they are, for the report); `operands` are shared with the
/// other lanes (read through `my_warp().operand` until warp_collective_end). Anything else fails
/// the kernel, as a diverged barrier does.
inline void warp_collective(const char* op, const unsigned long long* args, const char* const* names,
                            int nargs, const void* op0 = nullptr, const void* op1 = nullptr) {
    Warp& w = my_warp();
    int lane = g.current % 32;
    if (w.bar.alive != 32)
        fault("%s is warp-collective, but only %d lanes of warp %d are running (a block of %d "
              "threads, or lanes that returned): every lane of the warp must call it",
              op, w.bar.alive, g.current / 32, g.threads);
    w.op[lane] = op;
    for (int i = 0; i < nargs; ++i) w.args[lane][i] = args[i];
    w.operand[lane][0] = op0;
    w.operand[lane][1] = op1;
    wait(w.bar, op);
    for (int l = 0; l < 32; ++l) {
        if (!w.op[l] || strcmp(w.op[l], op) != 0)
            fault("%s is warp-collective, but lane %d of the warp is at %s meanwhile (a diverged "
                  "warp): every lane must call it",
                  op, l, w.op[l] ? w.op[l] : "no warp-wide call");
        for (int i = 0; i < nargs; ++i)
            if (w.args[l][i] != args[i])
                fault("%s: lane %d passes %s = %#llx, lane %d passes %#llx: every lane of the "
                      "warp must pass the same",
                      op, lane, names[i], args[i], l, w.args[l][i]);
    }
}

/// Leaves a warp collective: no lane goes on (and changes its operands) before all are done.
inline void warp_collective_end(const char* op) {
    Warp& w = my_warp();
    wait(w.bar, op);
    w.op[g.current % 32] = nullptr;
}

[[noreturn]] inline void thread_exit() {
    pipeline_complete(~0u);
    Fiber& f = g.fibers[g.current];
    f.done = true;
    g.progress++;
    g.block.alive--;
    if (g.block.arrived > 0 && g.block.arrived >= g.block.alive) release(g.block);
    Warp& w = my_warp();
    w.bar.alive--;
    w.op[g.current % 32] = "return (the thread exited)";
    if (w.bar.arrived > 0 && w.bar.arrived >= w.bar.alive) release(w.bar);
    void* dead;
    emu_switch(&dead, g.scheduler_sp);
    __builtin_unreachable();
}

inline void fiber_main() {
    g.body(g.body_ctx);
    thread_exit();
}

/// Runs one block of `g.threads` fibers to completion; false when they deadlock.
inline bool run_block() {
    if (!g.stacks) {
        void* m = mmap(nullptr, MAX_THREADS * STACK_BYTES, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) return false;
        g.stacks = static_cast<char*>(m);
    }
    int n = g.threads;
    for (int i = 0; i < n; ++i) {
        // The initial frame: six zeroed callee-saved registers, then fiber_main as the return
        // address, leaving the stack aligned as after a call.
        auto* top = reinterpret_cast<void**>(g.stacks + (size_t)(i + 1) * STACK_BYTES);
        top[-1] = nullptr;
        top[-2] = reinterpret_cast<void*>(&fiber_main);
        for (int r = 3; r <= 8; ++r) top[-r] = nullptr;
        g.fibers[i].sp = &top[-8];
        g.fibers[i].done = false;
        g.waits_at[i] = nullptr;
        g.pipes[i].pending.clear();
        g.pipes[i].committed = 0;
    }
    g.block = Barrier{0, g.block.generation, n};
    for (int w = 0; w * 32 < n; ++w) {
        g.warps[w].bar = Barrier{0, g.warps[w].bar.generation, std::min(32, n - w * 32)};
        for (int l = 0; l < 32; ++l) g.warps[w].op[l] = nullptr;
    }
    int alive = n;
    while (alive > 0) {
        unsigned long long before = g.progress;
        for (int i = 0; i < n; ++i) {
            if (g.fibers[i].done) continue;
            g.current = i;
            g.thread_idx.x = i % g.block_dim.x;
            g.thread_idx.y = (i / g.block_dim.x) % g.block_dim.y;
            g.thread_idx.z = i / (g.block_dim.x * g.block_dim.y);
            emu_switch(&g.scheduler_sp, g.fibers[i].sp);
            if (g.faulted) return false;
            if (g.fibers[i].done) alive--;
        }
        if (alive > 0 && g.progress == before) return false;
    }
    return true;
}

/// Where the block's threads wait, for a deadlock's report: the first waiting thread and the
/// first that waits somewhere else.
inline void describe_waits(char* out, int len) {
    int first = -1, other = -1;
    for (int i = 0; i < g.threads; ++i) {
        if (g.fibers[i].done || !g.waits_at[i]) continue;
        if (first < 0) {
            first = i;
        } else if (strcmp(g.waits_at[i], g.waits_at[first]) != 0) {
            other = i;
            break;
        }
    }
    if (first < 0)
        snprintf(out, len, "no thread waits");
    else if (other < 0)
        snprintf(out, len, "threads from %d wait at %s", first, g.waits_at[first]);
    else
        snprintf(out, len, "thread %d waits at %s, thread %d at %s", first, g.waits_at[first],
                 other, g.waits_at[other]);
}

template <class T>
inline T exchange(T v, int src_lane) {
    static_assert(sizeof(T) <= 8, "warp shuffles move at most 8 bytes");
    Warp& w = my_warp();
    int lane = g.current % 32;
    unsigned long long bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    w.slot[lane] = bits;
    w.op[lane] = "a warp shuffle";
    wait(w.bar, "a warp shuffle");
    T r = v;
    int base = (g.current / 32) * 32;
    if (src_lane >= 0 && src_lane < 32 && base + src_lane < g.threads &&
        !g.fibers[base + src_lane].done) {
        std::memcpy(&r, &w.slot[src_lane], sizeof(T));
    }
    wait(w.bar, "a warp shuffle");
    w.op[lane] = nullptr;
    return r;
}

template <class... A>
struct Call {
    void (*kernel)(A...);
    void** params;
    static void run(void* self) {
        static_cast<Call*>(self)->invoke(std::index_sequence_for<A...>{});
    }
    template <size_t... I>
    void invoke(std::index_sequence<I...>) {
        kernel(*static_cast<std::decay_t<A>*>(params[I])...);
    }
};

template <class T>
inline bool pointer_ok(void** params, size_t i, char* err, int errlen, const char* name) {
    if constexpr (std::is_pointer_v<std::decay_t<T>>) {
        const void* p = *static_cast<void* const*>(params[i]);
        if (p && g.is_device_ptr && !g.is_device_ptr(p)) {
            snprintf(err, errlen, "kernel %s: argument %zu (%p) is not device memory", name, i,
                     p);
            return false;
        }
    }
    return true;
}

template <class... A, size_t... I>
inline bool pointers_ok(void** params, char* err, int errlen, const char* name,
                        std::index_sequence<I...>) {
    return (pointer_ok<A>(params, I, err, errlen, name) && ...);
}

/// Runs the whole grid of `kernel`; 0 on success, else an error in `err`.
template <class... A>
inline int launch(void (*kernel)(A...), const char* name, void** params, const unsigned* grid,
                  const unsigned* block, unsigned smem, char* err, int errlen) {
    if (!pointers_ok<A...>(params, err, errlen, name, std::index_sequence_for<A...>{})) return 1;
    Call<A...> call{kernel, params};
    g.body = &Call<A...>::run;
    g.body_ctx = &call;
    g.block_dim = dim3{block[0], block[1], block[2]};
    g.grid_dim = dim3{grid[0], grid[1], grid[2]};
    g.threads = (int)(block[0] * block[1] * block[2]);
    if (g.threads < 1 || g.threads > MAX_THREADS) {
        snprintf(err, errlen, "kernel %s: %d threads per block", name, g.threads);
        return 1;
    }
    if (smem > g.dynamic_smem_bytes) {
        free(g.dynamic_smem);
        // 128-byte aligned, as the hardware's shared memory window (wmma needs 32).
        g.dynamic_smem = static_cast<unsigned char*>(aligned_alloc(128, (smem + 127) / 128 * 128));
        g.dynamic_smem_bytes = smem;
    }
    for (unsigned z = 0; z < grid[2]; ++z)
        for (unsigned y = 0; y < grid[1]; ++y)
            for (unsigned x = 0; x < grid[0]; ++x) {
                g.block_idx = dim3{x, y, z};
                if (!run_block()) {
                    if (g.faulted) {
                        g.faulted = false;
                        snprintf(err, errlen, "kernel %s: block (%u, %u, %u), %s", name, x, y, z,
                                 g.fault);
                        return 1;
                    }
                    char where[256];
                    describe_waits(where, sizeof where);
                    snprintf(err, errlen,
                             "kernel %s: block (%u, %u, %u) deadlocked: threads wait at a "
                             "barrier, shuffle or warp-collective call that others never reach "
                             "(%s)",
                             name, x, y, z, where);
                    return 1;
                }
            }
    return 0;
}

/// A copy of a launch's arguments, so the launch can run after cuLaunchKernel returned (the
/// caller's `params` may be gone by then, as on the hardware): one malloc'd block whose start is
/// the pointer array a launch takes, followed by the values. Null, with `err` set, when a pointer
/// argument is not device memory (checked now, so the launch fails at once, as it does on a GPU).
template <class... A>
inline void** capture(void (*)(A...), const char* name, void** params, char* err, int errlen) {
    if (!pointers_ok<A...>(params, err, errlen, name, std::index_sequence_for<A...>{}))
        return nullptr;
    constexpr size_t n = sizeof...(A);
    const size_t sizes[] = {sizeof(std::decay_t<A>)..., 0};
    size_t total = (n + 1) * sizeof(void*);
    for (size_t i = 0; i < n; ++i) total = (total + 15) / 16 * 16 + sizes[i];
    char* mem = static_cast<char*>(malloc(total ? total : 1));
    void** ptrs = reinterpret_cast<void**>(mem);
    size_t at = (n + 1) * sizeof(void*);
    for (size_t i = 0; i < n; ++i) {
        at = (at + 15) / 16 * 16;
        memcpy(mem + at, params[i], sizes[i]);
        ptrs[i] = mem + at;
        at += sizes[i];
    }
    ptrs[n] = nullptr;
    return ptrs;
}

} // namespace emu

extern "C" __attribute__((visibility("default"))) void emu_set_pointer_check(
    int (*check)(const void*)) {
    emu::g.is_device_ptr = check;
}

#define EMU_EXPORT(name)                                                                        \
    extern "C" __attribute__((visibility("default"))) int emu_launch_##name(                  \
        void** params, const unsigned* grid, const unsigned* block, unsigned smem, char* err, \
        int errlen) {                                                                          \
        return ::emu::launch(&name, #name, params, grid, block, smem, err, errlen);           \
    }                                                                                          \
    extern "C" __attribute__((visibility("default"))) void** emu_capture_##name(              \
        void** params, char* err, int errlen) {                                                \
        return ::emu::capture(&name, #name, params, err, errlen);                              \
    }

// ---- what NVRTC provides to a kernel ----

inline void* emu_dynamic_smem() { return emu::g.dynamic_smem; }

inline void __syncthreads() { emu::wait(emu::g.block, "__syncthreads"); }
inline int __syncthreads_or(int p) {
    emu::wait(emu::g.block, "__syncthreads_or");
    if (p) emu::g.sync_or = 1;
    emu::wait(emu::g.block, "__syncthreads_or");
    int r = emu::g.sync_or;
    emu::wait(emu::g.block, "__syncthreads_or");
    if (emu::linear_tid() == 0) emu::g.sync_or = 0;
    emu::wait(emu::g.block, "__syncthreads_or");
    return r;
}
inline int __syncthreads_and(int p) { return !__syncthreads_or(!p); }
inline void __syncwarp(unsigned = 0xffffffffu) {
    emu::Warp& w = emu::my_warp();
    w.op[emu::g.current % 32] = "__syncwarp";
    emu::wait(w.bar, "__syncwarp");
    w.op[emu::g.current % 32] = nullptr;
}
inline void __threadfence() {}
inline void __threadfence_block() {}

template <class T>
inline T __shfl_xor_sync(unsigned, T v, int mask, int width = 32) {
    int lane = emu::g.current % 32;
    int src = lane ^ mask;
    if ((src / width) != (lane / width)) src = lane;
    return emu::exchange(v, src);
}
template <class T>
inline T __shfl_sync(unsigned, T v, int src, int width = 32) {
    int lane = emu::g.current % 32;
    return emu::exchange(v, (lane / width) * width + (src % width));
}
template <class T>
inline T __shfl_down_sync(unsigned, T v, unsigned d, int width = 32) {
    int lane = emu::g.current % 32;
    int src = lane + (int)d;
    if ((src / width) != (lane / width)) src = lane;
    return emu::exchange(v, src);
}
template <class T>
inline T __shfl_up_sync(unsigned, T v, unsigned d, int width = 32) {
    int lane = emu::g.current % 32;
    int src = lane - (int)d;
    if (src < 0 || (src / width) != (lane / width)) src = lane;
    return emu::exchange(v, src);
}

inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline int __float_as_int(float f) {
    int i;
    std::memcpy(&i, &f, 4);
    return i;
}
inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline double __longlong_as_double(long long i) {
    double d;
    std::memcpy(&d, &i, 8);
    return d;
}
inline long long __double_as_longlong(double d) {
    long long i;
    std::memcpy(&i, &d, 8);
    return i;
}
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __expf(float a) { return std::exp(a); }
inline float __logf(float a) { return std::log(a); }
inline float __sinf(float a) { return std::sin(a); }
inline float __cosf(float a) { return std::cos(a); }
inline float __powf(float a, float b) { return std::pow(a, b); }
inline float __saturatef(float a) { return a < 0.0f ? 0.0f : (a > 1.0f ? 1.0f : a); }
inline float rsqrtf(float a) { return 1.0f / std::sqrt(a); }
inline double rsqrt(double a) { return 1.0 / std::sqrt(a); }
inline unsigned __umulhi(unsigned a, unsigned b) {
    return (unsigned)(((unsigned long long)a * b) >> 32);
}
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __clz(int v) { return v == 0 ? 32 : __builtin_clz((unsigned)v); }
inline int __ffs(int v) { return __builtin_ffs(v); }
template <class T>
inline T __ldg(const T* p) {
    return *p;
}
using std::isfinite;
using std::isinf;
using std::isnan;

// CUDA's min/max take mixed integer and float arguments.
template <class A, class B>
inline std::common_type_t<A, B> min(A a, B b) {
    return b < a ? b : a;
}
template <class A, class B>
inline std::common_type_t<A, B> max(A a, B b) {
    return a < b ? b : a;
}

// Atomics: the fibers of a launch never preempt one another, so plain reads and writes are atomic.
template <class T>
inline T atomicAdd(T* p, T v) {
    T old = *p;
    *p = old + v;
    return old;
}
template <class T>
inline T atomicMax(T* p, T v) {
    T old = *p;
    *p = old < v ? v : old;
    return old;
}
template <class T>
inline T atomicMin(T* p, T v) {
    T old = *p;
    *p = v < old ? v : old;
    return old;
}
template <class T>
inline T atomicExch(T* p, T v) {
    T old = *p;
    *p = v;
    return old;
}
template <class T>
inline T atomicCAS(T* p, T cmp, T v) {
    T old = *p;
    if (old == cmp) *p = v;
    return old;
}

// CUDA emulation on the CPU: the parts of the CUDA driver API, NVRTC and cuBLAS that the
// engine's CUDA backend calls, so its kernels, launch shapes and device-memory handling run
// where no GPU is. Built as one shared library that build.sh links under the names cudarc
// opens (libcuda.so, libcublas.so, libnvrtc.so, and libnccl.so; cuBLAS is in cublas.cpp, NCCL in
// nccl.cpp); it is only ever found through LD_LIBRARY_PATH, which scripts/test.sh sets for the
// emulated runs.
//
// - ANNEAL_CUDA_EMU_DEVICES devices (default 2), each with its own primary context and memory:
//   a block belongs to the device whose context (or stream) allocated it.
// - Device memory is host memory from mmap, each block followed by a guard page, and every
//   copy, memset, kernel pointer argument and cuBLAS operand is checked against the live
//   blocks, so a host pointer handed to a kernel or a copy past a block's end fails loudly.
//   Kernels and cuBLAS products may only touch blocks of their stream's device (or of a peer
//   enabled with cuCtxEnablePeerAccess); copies may name any device's blocks, as with unified
//   addressing on the hardware.
// - NVRTC "compiles" a kernel source with the host's C++ compiler after emu_kernel.h, into a
//   cached shared library; the "PTX" names that library and cuModuleLoadData opens it.
// - Kernels, copies and products run when they are queued (the stream is always idle), one at
//   a time across threads. Dynamic shared memory above 48 KiB is refused unless raised with
//   cuFuncSetAttribute, as on the hardware.
// - cuBLAS products (cublas.cpp) accumulate in f32, in an order that depends on the shape as the
//   real library's does.
#include <dlfcn.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "emu_shared.h"

std::recursive_mutex emu_rt::big_lock;

namespace {

using emu_rt::big_lock;

constexpr int CUDA_SUCCESS = 0;
constexpr int CUDA_ERROR_INVALID_VALUE = 1;
constexpr int CUDA_ERROR_OUT_OF_MEMORY = 2;
constexpr int CUDA_ERROR_INVALID_DEVICE = 101;
constexpr int CUDA_ERROR_INVALID_CONTEXT = 201;
constexpr int CUDA_ERROR_INVALID_IMAGE = 200;
constexpr int CUDA_ERROR_NOT_FOUND = 500;
constexpr int CUDA_ERROR_ILLEGAL_ADDRESS = 700;
constexpr int CUDA_ERROR_LAUNCH_FAILED = 719;

constexpr size_t PAGE = 4096;
constexpr size_t TOTAL_MEM = size_t(16) << 30;
constexpr int DEFAULT_DYNAMIC_SMEM = 48 << 10;
constexpr int MAX_DYNAMIC_SMEM = 227 << 10;

// ---- devices, contexts and streams ----

constexpr int MAX_DEVICES = 64;
constexpr int DEFAULT_DEVICES = 2;

/// The number of emulated devices: ANNEAL_CUDA_EMU_DEVICES, else DEFAULT_DEVICES; -1 (and a
/// message naming the variable) when it is not a number from 1 to MAX_DEVICES.
int device_count() {
    static int n = [] {
        const char* env = getenv("ANNEAL_CUDA_EMU_DEVICES");
        if (!env || !*env) return DEFAULT_DEVICES;
        char* end = nullptr;
        long v = strtol(env, &end, 10);
        if (*end || v < 1 || v > MAX_DEVICES) {
            fprintf(stderr,
                    "anneal cuda emulation: ANNEAL_CUDA_EMU_DEVICES = \"%s\" is not a number of "
                    "devices from 1 to %d\n",
                    env, MAX_DEVICES);
            return -1;
        }
        return int(v);
    }();
    return n;
}

bool valid_device(int dev) { return dev >= 0 && dev < device_count(); }

/// A device's primary context (the only kind the backend makes).
struct Context {
    int dev;
};
Context contexts[MAX_DEVICES] = {};

struct Stream {
    int dev;
};

thread_local Context* current_ctx;

int current_device() { return current_ctx ? current_ctx->dev : 0; }

/// The device work queued on `s` runs on; the null stream is the current context's.
int stream_device(void* s) { return s ? static_cast<Stream*>(s)->dev : current_device(); }

/// peer[a][b]: kernels on device a may read device b's memory (cuCtxEnablePeerAccess).
bool peer[MAX_DEVICES][MAX_DEVICES] = {};

// ---- device memory ----

struct Block {
    size_t bytes;
    size_t mapped;
    int dev;
};
std::map<uintptr_t, Block> blocks;
size_t used[MAX_DEVICES] = {};

/// The device kernels launched now may touch (-1: none is being launched).
int launching_device = -1;

const Block* find_block(uintptr_t p, uintptr_t* start) {
    auto it = blocks.upper_bound(p);
    if (it == blocks.begin()) return nullptr;
    --it;
    if (p >= it->first + it->second.bytes && !(it->second.bytes == 0 && p == it->first))
        return nullptr;
    *start = it->first;
    return &it->second;
}

/// Whether [p, p + n) lies inside one live device block (of device `dev`, unless it is -1).
bool device_range(uintptr_t p, size_t n, int dev = -1) {
    uintptr_t start;
    const Block* b = find_block(p, &start);
    return b && p + n <= start + b->bytes && (dev < 0 || b->dev == dev);
}

void complain(const std::string& what) {
    fprintf(stderr, "anneal cuda emulation: %s\n", what.c_str());
}

/// Whether a kernel on the launching device may touch `p`: a live block of that device or of
/// an enabled peer. A block of another device is named, since "not device memory" would mislead.
int device_ptr_check(const void* p) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    uintptr_t start;
    const Block* b = find_block(reinterpret_cast<uintptr_t>(p), &start);
    if (!b) return 0;
    int dev = launching_device;
    if (dev < 0 || b->dev == dev || peer[dev][b->dev]) return 1;
    char buf[200];
    snprintf(buf, sizeof buf, "%p is memory of device %d, used by a kernel on device %d", p,
             b->dev, dev);
    complain(buf);
    return 0;
}

int bad_range(const char* op, uintptr_t p, size_t n, int dev = -1) {
    char buf[240];
    if (dev >= 0)
        snprintf(buf, sizeof buf,
                 "%s: [0x%lx, +%zu) is not inside one allocation of device %d", op,
                 (unsigned long)p, n, dev);
    else
        snprintf(buf, sizeof buf, "%s: [0x%lx, +%zu) is not inside one device allocation", op,
                 (unsigned long)p, n);
    complain(buf);
    return CUDA_ERROR_ILLEGAL_ADDRESS;
}

} // namespace

int emu_rt::current_device() { return ::current_device(); }
int emu_rt::stream_device(void* s) { return ::stream_device(s); }
void emu_rt::complain(const std::string& what) { ::complain(what); }
int emu_rt::bad_range(const char* op, uintptr_t p, size_t n, int dev) {
    return ::bad_range(op, p, n, dev);
}

bool emu_rt::kernel_range(uintptr_t p, size_t n, int dev) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    uintptr_t start;
    const Block* b = find_block(p, &start);
    return b && device_range(p, n) && (b->dev == dev || peer[dev][b->dev]);
}

bool emu_rt::device_block(uintptr_t p, size_t n, int dev, int* owner) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    uintptr_t start;
    const Block* b = find_block(p, &start);
    *owner = b ? b->dev : -1;
    return b && b->dev == dev && p + n >= p && p + n <= start + b->bytes;
}

namespace {

// ---- modules and functions ----

typedef int (*LaunchFn)(void**, const unsigned*, const unsigned*, unsigned, char*, int);

struct Module {
    void* handle;
};
struct Function {
    LaunchFn launch;
    std::string name;
    int max_dynamic_smem = DEFAULT_DYNAMIC_SMEM;
};

// ---- NVRTC ----

struct Program {
    std::string source;
    std::string name;
    std::string log;
    std::string ptx;
};

std::string self_dir() {
    Dl_info info;
    if (dladdr(reinterpret_cast<void*>(&self_dir), &info) && info.dli_fname) {
        std::string p = info.dli_fname;
        auto slash = p.rfind('/');
        if (slash != std::string::npos) return p.substr(0, slash);
    }
    return ".";
}

std::string cache_dir() {
    const char* env = getenv("ANNEAL_CUDA_EMU_CACHE");
    std::string dir;
    if (env && *env) {
        dir = env;
    } else {
        const char* tmp = getenv("TMPDIR");
        dir = std::string(tmp && *tmp ? tmp : "/tmp") + "/anneal-cuda-emu-" +
              std::to_string(getuid());
    }
    mkdir(dir.c_str(), 0700);
    return dir;
}

std::string read_file(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    std::stringstream s;
    s << f.rdbuf();
    return s.str();
}

bool write_file(const std::string& path, const std::string& text) {
    std::ofstream f(path, std::ios::binary);
    f << text;
    return bool(f);
}

/// Runs `cmd` (stderr into `log`); true when it exits 0.
bool run(const std::string& cmd, const std::string& log_path, std::string* log) {
    int rc = system((cmd + " 2>" + log_path).c_str());
    *log = read_file(log_path);
    return rc == 0;
}

uint64_t fnv1a(const std::string& s) {
    uint64_t h = 1469598103934665603ull;
    for (unsigned char c : s) {
        h ^= c;
        h *= 1099511628211ull;
    }
    return h;
}

const char* PTX_MAGIC = "// anneal cuda emulation module: ";

/// Compiles `p.source` into a cached shared library; `p.ptx` names it.
bool compile(Program& p) {
    // `extern __shared__ T name[];` has no host meaning: it becomes a pointer to the launch's
    // dynamic shared memory.
    static const std::regex dyn(
        R"(extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([A-Za-z_][\w\s]*?)\s+(\w+)\s*\[\s*\]\s*;)");
    std::string src = std::regex_replace(p.source, dyn,
                                         "$1* $2 = reinterpret_cast<$1*>(emu_dynamic_smem());");
    std::string header = self_dir() + "/emu_kernel.h";
    const char* cxx_env = getenv("ANNEAL_CUDA_EMU_CXX");
    std::string cxx = cxx_env && *cxx_env ? cxx_env : "c++";
    std::string dir = cache_dir();
    std::string key = std::to_string(fnv1a(read_file(header) + "\n" + src + cxx));
    std::string so = dir + "/" + key + ".so";
    p.ptx = std::string(PTX_MAGIC) + so + "\n";
    if (access(so.c_str(), R_OK) == 0) return true;

    std::string base = dir + "/" + key + "." + std::to_string(getpid());
    std::string cu = base + ".cpp", pre = base + ".i", log = base + ".log";
    if (!write_file(cu, "#include \"" + header + "\"\n#line 1 \"" + p.name + "\"\n" + src)) {
        p.log = "cannot write " + cu;
        return false;
    }
    // Pass 1: preprocess with __global__ left visible, to list the kernels the macros make.
    std::string out;
    if (!run(cxx + " -std=c++17 -E -P -DEMU_SCAN -x c++ " + cu + " -o " + pre, log, &out)) {
        p.log = out;
        return false;
    }
    std::string expanded = read_file(pre);
    static const std::regex kernel(R"(EMU_GLOBAL\s+void\s+(\w+)\s*\()");
    std::set<std::string> names;
    for (auto it = std::sregex_iterator(expanded.begin(), expanded.end(), kernel);
         it != std::sregex_iterator(); ++it)
        names.insert((*it)[1]);
    std::string exports = "\n";
    for (auto& n : names) exports += "EMU_EXPORT(" + n + ")\n";
    write_file(cu, "#include \"" + header + "\"\n#line 1 \"" + p.name + "\"\n" + src + exports);
    // Pass 2: the module. No FMA contraction, so results do not depend on the compiler's mood.
    std::string tmp_so = base + ".so";
    bool ok = run(cxx + " -std=c++17 -O2 -fPIC -shared -ffp-contract=off -fno-strict-aliasing "
                        "-fvisibility=hidden -w -x c++ " +
                      cu + " -o " + tmp_so,
                  log, &out);
    if (!ok) {
        p.log = out;
        return false;
    }
    rename(tmp_so.c_str(), so.c_str());
    unlink(cu.c_str());
    unlink(pre.c_str());
    unlink(log.c_str());
    return true;
}

} // namespace

extern "C" {

// ---------------- driver API ----------------

int cuInit(unsigned) { return CUDA_SUCCESS; }
int cuDriverGetVersion(int* v) {
    *v = 13000;
    return CUDA_SUCCESS;
}
int cuDeviceGetCount(int* n) {
    if (device_count() < 0) return CUDA_ERROR_INVALID_VALUE;
    *n = device_count();
    return CUDA_SUCCESS;
}
int cuDeviceGet(int* dev, int ordinal) {
    if (!valid_device(ordinal)) return CUDA_ERROR_INVALID_DEVICE;
    *dev = ordinal;
    return CUDA_SUCCESS;
}
int cuDeviceGetName(char* name, int len, int) {
    snprintf(name, len, "CUDA emulation on the CPU");
    return CUDA_SUCCESS;
}
int cuDeviceTotalMem_v2(size_t* bytes, int) {
    *bytes = TOTAL_MEM;
    return CUDA_SUCCESS;
}
int cuDeviceGetAttribute(int* v, int attr, int) {
    switch (attr) {
    case 75: *v = 9; break;                  // compute capability major
    case 76: *v = 0; break;                  // minor
    case 16: *v = 1; break;                  // multiprocessors
    case 97: *v = MAX_DYNAMIC_SMEM; break;   // opt-in shared memory per block
    case 8: *v = DEFAULT_DYNAMIC_SMEM; break; // shared memory per block
    case 1: *v = 1024; break;                // threads per block
    case 10: *v = 32; break;                 // warp size
    case 115: *v = 0; break;                 // memory pools: not emulated
    default: *v = 0;
    }
    return CUDA_SUCCESS;
}
int cuDevicePrimaryCtxRetain(void** ctx, int dev) {
    if (!valid_device(dev)) return CUDA_ERROR_INVALID_DEVICE;
    contexts[dev].dev = dev;
    *ctx = &contexts[dev];
    return CUDA_SUCCESS;
}
int cuDevicePrimaryCtxRelease_v2(int) { return CUDA_SUCCESS; }
int cuDevicePrimaryCtxRelease(int) { return CUDA_SUCCESS; }
int cuCtxSetCurrent(void* ctx) {
    auto* c = static_cast<Context*>(ctx);
    if (c && (c < contexts || c >= contexts + MAX_DEVICES)) {
        complain("cuCtxSetCurrent: not a context of this emulation");
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    current_ctx = c;
    return CUDA_SUCCESS;
}
int cuCtxGetCurrent(void** ctx) {
    *ctx = current_ctx;
    return CUDA_SUCCESS;
}
int cuCtxGetDevice(int* dev) {
    *dev = current_device();
    return CUDA_SUCCESS;
}
int cuDeviceCanAccessPeer(int* can, int dev, int peer_dev) {
    if (!valid_device(dev) || !valid_device(peer_dev)) return CUDA_ERROR_INVALID_DEVICE;
    *can = dev != peer_dev;
    return CUDA_SUCCESS;
}
int cuCtxEnablePeerAccess(void* peer_ctx, unsigned) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    auto* p = static_cast<Context*>(peer_ctx);
    if (!p || p < contexts || p >= contexts + MAX_DEVICES) return CUDA_ERROR_INVALID_CONTEXT;
    if (p->dev == current_device()) return CUDA_ERROR_INVALID_DEVICE;
    peer[current_device()][p->dev] = true;
    return CUDA_SUCCESS;
}
int cuCtxDisablePeerAccess(void* peer_ctx) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    auto* p = static_cast<Context*>(peer_ctx);
    if (!p || p < contexts || p >= contexts + MAX_DEVICES) return CUDA_ERROR_INVALID_CONTEXT;
    peer[current_device()][p->dev] = false;
    return CUDA_SUCCESS;
}
int cuCtxSynchronize() { return CUDA_SUCCESS; }
int cuCtxPushCurrent_v2(void* ctx) { return cuCtxSetCurrent(ctx); }
int cuCtxPopCurrent_v2(void** ctx) {
    if (ctx) *ctx = current_ctx;
    return CUDA_SUCCESS;
}

int cuGetErrorString(int err, const char** s) {
    static std::map<int, std::string> names;
    std::lock_guard<std::recursive_mutex> l(big_lock);
    auto& n = names[err];
    if (n.empty()) n = "CUDA emulation error " + std::to_string(err) + " (details on stderr)";
    *s = n.c_str();
    return CUDA_SUCCESS;
}
int cuGetErrorName(int err, const char** s) { return cuGetErrorString(err, s); }

// Streams and events: work runs when queued, so every stream is idle and every event complete.
// A stream belongs to the device of the context current when it was made.
int cuStreamCreate(void** s, unsigned) {
    *s = new Stream{current_device()};
    return CUDA_SUCCESS;
}
int cuStreamCreateWithPriority(void** s, unsigned, int) { return cuStreamCreate(s, 0); }
int cuStreamDestroy_v2(void* s) {
    delete static_cast<Stream*>(s);
    return CUDA_SUCCESS;
}
int cuStreamSynchronize(void*) { return CUDA_SUCCESS; }
int cuStreamQuery(void*) { return CUDA_SUCCESS; }
int cuStreamWaitEvent(void*, void*, unsigned) { return CUDA_SUCCESS; }
int cuEventCreate(void** e, unsigned) {
    *e = new int(0);
    return CUDA_SUCCESS;
}
int cuEventDestroy_v2(void* e) {
    delete static_cast<int*>(e);
    return CUDA_SUCCESS;
}
int cuEventRecord(void*, void*) { return CUDA_SUCCESS; }
int cuEventRecordWithFlags(void*, void*, unsigned) { return CUDA_SUCCESS; }
int cuEventSynchronize(void*) { return CUDA_SUCCESS; }
int cuEventQuery(void*) { return CUDA_SUCCESS; }
int cuEventElapsedTime(float* ms, void*, void*) {
    *ms = 0.0f;
    return CUDA_SUCCESS;
}
int cuEventElapsedTime_v2(float* ms, void* a, void* b) { return cuEventElapsedTime(ms, a, b); }

/// A block of `bytes` on device `dev`.
int alloc_on(int dev, uint64_t* dptr, size_t bytes) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    if (used[dev] + bytes > TOTAL_MEM) return CUDA_ERROR_OUT_OF_MEMORY;
    size_t mapped = (bytes + PAGE - 1) / PAGE * PAGE + PAGE;
    void* m = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    // The page after the block faults, so a kernel reading past its end crashes here too.
    mprotect(static_cast<char*>(m) + mapped - PAGE, PAGE, PROT_NONE);
    // Fresh device memory is not zeroed on a GPU; make reads of it stand out.
    memset(m, 0xff, bytes);
    blocks[reinterpret_cast<uintptr_t>(m)] = Block{bytes, mapped, dev};
    used[dev] += bytes;
    *dptr = reinterpret_cast<uint64_t>(m);
    return CUDA_SUCCESS;
}
int cuMemAlloc_v2(uint64_t* dptr, size_t bytes) { return alloc_on(current_device(), dptr, bytes); }
int cuMemFree_v2(uint64_t dptr) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    auto it = blocks.find(dptr);
    if (it == blocks.end()) {
        complain("cuMemFree of an address that is not a live allocation");
        return CUDA_ERROR_INVALID_VALUE;
    }
    munmap(reinterpret_cast<void*>(dptr), it->second.mapped);
    used[it->second.dev] -= it->second.bytes;
    blocks.erase(it);
    return CUDA_SUCCESS;
}
int cuMemAllocAsync(uint64_t* dptr, size_t bytes, void* s) {
    return alloc_on(stream_device(s), dptr, bytes);
}
int cuMemFreeAsync(uint64_t dptr, void*) { return cuMemFree_v2(dptr); }
int cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    *free_bytes = TOTAL_MEM - used[current_device()];
    *total = TOTAL_MEM;
    return CUDA_SUCCESS;
}
int cuMemHostAlloc(void** p, size_t bytes, unsigned) {
    *p = malloc(bytes ? bytes : 1);
    return *p ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}
int cuMemAllocHost_v2(void** p, size_t bytes) { return cuMemHostAlloc(p, bytes, 0); }
int cuMemFreeHost(void* p) {
    free(p);
    return CUDA_SUCCESS;
}

int cuMemcpyHtoD_v2(uint64_t dst, const void* src, size_t n) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    if (n && !device_range(dst, n)) return bad_range("copy to device", dst, n);
    if (n && device_ptr_check(src)) return bad_range("copy to device from device memory", dst, n);
    memcpy(reinterpret_cast<void*>(dst), src, n);
    return CUDA_SUCCESS;
}
int cuMemcpyDtoH_v2(void* dst, uint64_t src, size_t n) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    if (n && !device_range(src, n)) return bad_range("copy to host", src, n);
    memcpy(dst, reinterpret_cast<const void*>(src), n);
    return CUDA_SUCCESS;
}
int cuMemcpyDtoD_v2(uint64_t dst, uint64_t src, size_t n) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    if (n && !device_range(src, n)) return bad_range("device copy source", src, n);
    if (n && !device_range(dst, n)) return bad_range("device copy destination", dst, n);
    memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
    return CUDA_SUCCESS;
}
int cuMemcpyHtoDAsync_v2(uint64_t dst, const void* src, size_t n, void*) {
    return cuMemcpyHtoD_v2(dst, src, n);
}
int cuMemcpyDtoHAsync_v2(void* dst, uint64_t src, size_t n, void*) {
    return cuMemcpyDtoH_v2(dst, src, n);
}
int cuMemcpyDtoDAsync_v2(uint64_t dst, uint64_t src, size_t n, void*) {
    return cuMemcpyDtoD_v2(dst, src, n);
}
int cuMemcpyPeer(uint64_t dst, void* dst_ctx, uint64_t src, void* src_ctx, size_t n) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    auto *d = static_cast<Context*>(dst_ctx), *s = static_cast<Context*>(src_ctx);
    if (!d || !s) return CUDA_ERROR_INVALID_CONTEXT;
    if (n && !device_range(src, n, s->dev)) return bad_range("peer copy source", src, n, s->dev);
    if (n && !device_range(dst, n, d->dev))
        return bad_range("peer copy destination", dst, n, d->dev);
    memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
    return CUDA_SUCCESS;
}
int cuMemcpyPeerAsync(uint64_t dst, void* dst_ctx, uint64_t src, void* src_ctx, size_t n, void*) {
    return cuMemcpyPeer(dst, dst_ctx, src, src_ctx, n);
}
int cuMemsetD8_v2(uint64_t dst, unsigned char v, size_t n) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    if (n && !device_range(dst, n)) return bad_range("memset", dst, n);
    memset(reinterpret_cast<void*>(dst), v, n);
    return CUDA_SUCCESS;
}
int cuMemsetD8Async(uint64_t dst, unsigned char v, size_t n, void*) {
    return cuMemsetD8_v2(dst, v, n);
}
int cuMemsetD32_v2(uint64_t dst, unsigned v, size_t n) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    if (n && !device_range(dst, n * 4)) return bad_range("memset", dst, n * 4);
    auto* p = reinterpret_cast<unsigned*>(dst);
    for (size_t i = 0; i < n; ++i) p[i] = v;
    return CUDA_SUCCESS;
}
int cuMemsetD32Async(uint64_t dst, unsigned v, size_t n, void*) {
    return cuMemsetD32_v2(dst, v, n);
}

int cuModuleLoadData(void** module, const void* image) {
    const char* text = static_cast<const char*>(image);
    size_t magic = strlen(PTX_MAGIC);
    if (strncmp(text, PTX_MAGIC, magic) != 0) {
        complain("cuModuleLoadData: the image is not from the emulated NVRTC");
        return CUDA_ERROR_INVALID_IMAGE;
    }
    std::string path(text + magic);
    while (!path.empty() && (path.back() == '\n' || path.back() == ' ')) path.pop_back();
    void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        complain(std::string("cuModuleLoadData: ") + dlerror());
        return CUDA_ERROR_INVALID_IMAGE;
    }
    if (auto set = reinterpret_cast<void (*)(int (*)(const void*))>(
            dlsym(h, "emu_set_pointer_check")))
        set(&device_ptr_check);
    *module = new Module{h};
    return CUDA_SUCCESS;
}
int cuModuleUnload(void* module) {
    // The library stays loaded: functions of it may still be cached by callers.
    delete static_cast<Module*>(module);
    return CUDA_SUCCESS;
}
int cuModuleGetFunction(void** f, void* module, const char* name) {
    auto* m = static_cast<Module*>(module);
    std::string sym = std::string("emu_launch_") + name;
    auto fn = reinterpret_cast<LaunchFn>(dlsym(m->handle, sym.c_str()));
    if (!fn) return CUDA_ERROR_NOT_FOUND;
    *f = new Function{fn, name};
    return CUDA_SUCCESS;
}
int cuFuncSetAttribute(void* f, int attr, int value) {
    auto* fn = static_cast<Function*>(f);
    if (attr == 8) { // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        if (value > MAX_DYNAMIC_SMEM) return CUDA_ERROR_INVALID_VALUE;
        fn->max_dynamic_smem = value;
    }
    return CUDA_SUCCESS;
}
int cuFuncGetAttribute(int* v, int attr, void* f) {
    auto* fn = static_cast<Function*>(f);
    *v = attr == 8 ? fn->max_dynamic_smem : (attr == 0 ? 1024 : 0);
    return CUDA_SUCCESS;
}

int cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned smem, void* stream, void** params, void** extra) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    auto* fn = static_cast<Function*>(f);
    char err[512] = {0};
    if (extra) {
        complain("cuLaunchKernel: `extra` arguments are not emulated");
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (gx == 0 || gy == 0 || gz == 0 || gy > 65535 || gz > 65535 || gx > 0x7fffffffu) {
        snprintf(err, sizeof err, "kernel %s: grid (%u, %u, %u) is outside the hardware's limits",
                 fn->name.c_str(), gx, gy, gz);
        complain(err);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (bx * by * bz > 1024 || bz > 64) {
        snprintf(err, sizeof err, "kernel %s: block (%u, %u, %u) is over 1024 threads",
                 fn->name.c_str(), bx, by, bz);
        complain(err);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if ((int)smem > fn->max_dynamic_smem) {
        snprintf(err, sizeof err,
                 "kernel %s: %u bytes of dynamic shared memory, over the %d allowed "
                 "(cuFuncSetAttribute raises it)",
                 fn->name.c_str(), smem, fn->max_dynamic_smem);
        complain(err);
        return CUDA_ERROR_INVALID_VALUE;
    }
    unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
    launching_device = stream_device(stream);
    int rc = fn->launch(params, grid, block, smem, err, sizeof err);
    launching_device = -1;
    if (rc != 0) {
        complain(err);
        return CUDA_ERROR_LAUNCH_FAILED;
    }
    return CUDA_SUCCESS;
}

// ---------------- NVRTC ----------------

const char* nvrtcGetErrorString(int r) {
    return r == 0 ? "NVRTC_SUCCESS" : "NVRTC_ERROR (emulated compile; see the log)";
}
int nvrtcVersion(int* major, int* minor) {
    *major = 13;
    *minor = 0;
    return 0;
}
int nvrtcCreateProgram(void** prog, const char* src, const char* name, int, const char* const*,
                       const char* const*) {
    *prog = new Program{src, name ? name : "kernel.cu", "", ""};
    return 0;
}
int nvrtcDestroyProgram(void** prog) {
    delete static_cast<Program*>(*prog);
    *prog = nullptr;
    return 0;
}
int nvrtcCompileProgram(void* prog, int, const char* const*) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    return compile(*static_cast<Program*>(prog)) ? 0 : 6; // NVRTC_ERROR_COMPILATION
}
int nvrtcGetPTXSize(void* prog, size_t* n) {
    *n = static_cast<Program*>(prog)->ptx.size() + 1;
    return 0;
}
int nvrtcGetPTX(void* prog, char* out) {
    auto& p = static_cast<Program*>(prog)->ptx;
    memcpy(out, p.c_str(), p.size() + 1);
    return 0;
}
int nvrtcGetProgramLogSize(void* prog, size_t* n) {
    *n = static_cast<Program*>(prog)->log.size() + 1;
    return 0;
}
int nvrtcGetProgramLog(void* prog, char* out) {
    auto& p = static_cast<Program*>(prog)->log;
    memcpy(out, p.c_str(), p.size() + 1);
    return 0;
}

} // extern "C"

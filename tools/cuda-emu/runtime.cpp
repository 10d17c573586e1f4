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
//   cached shared library; the "PTX" names that library and cuModuleLoadData opens it. The CUDA
//   headers a kernel includes (<mma.h>, <cuda_pipeline.h>) are the emulation's own, in include/
//   beside the library; headers handed to nvrtcCreateProgram are not used (what a program passes
//   there for the real NVRTC is written for the hardware's builtins).
// - Streams are queues and events order them (see "streams and events" below): queued work runs
//   when something waits for it, so a missing cuStreamWaitEvent shows as stale values, every
//   time; ANNEAL_CUDA_EMU_STREAMS=eager runs work as it is queued. Work runs one op at a time
//   across threads. Dynamic shared memory above 48 KiB is refused unless raised with
//   cuFuncSetAttribute, as on the hardware.
// - ANNEAL_CUDA_EMU_TRANSFER_LOG=FILE appends one line per device->host copy ("dtoh BYTES") and
//   per host wait for the device ("wait stream|context|event"), so a test can count what a
//   training step reads back and how often the host stalls (tests/cuda_train_cli.rs).
// - Events created without CU_EVENT_DISABLE_TIMING take the host's clock when their work runs,
//   so cuEventElapsedTime gives the time between two events' work (kernels run one at a time).
// - cuBLAS products (cublas.cpp) accumulate in f32, in an order that depends on the shape as the
//   real library's does.
#include <dirent.h>
#include <dlfcn.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <memory>
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

/// A stream: its device and the work queued on it and not run yet (see "streams" below).
struct Stream {
    int dev;
    std::deque<std::function<int()>> queue;
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

// ---- streams and events ----
//
// A stream is a queue: its work runs in order, but only once something needs it (the default,
// "lazy"): cuStreamSynchronize, cuEventSynchronize, cuCtxSynchronize; a stream waiting on an
// event (cuStreamWaitEvent: when the waiting stream reaches the wait, the recording stream runs
// up to the record); work on the legacy null stream, synchronous copies and memsets, cuMemFree
// and cuMemFreeHost (every stream first, as the driver synchronises there); a copy into pageable
// host memory (its stream first: the driver returns only once such a copy is done); an NCCL
// call (its stream first, then NCCL runs it). So a program that reads another stream's results
// without an event wait reads the values from before that work, every time, instead of racing,
// and a correct program gets the same bits as when everything runs at once. cuEventQuery and
// cuStreamQuery answer "not ready" while the work is queued, as on a busy GPU. Host copies keep
// CUDA's rules: a pageable source is read when the copy is queued, a pinned one (cuMemHostAlloc)
// when it runs. ANNEAL_CUDA_EMU_STREAMS=eager runs all work as it is queued (every stream idle).
// Queued work that fails (a kernel's deadlock) says so on stderr when it runs; the error is then
// returned by every later synchronisation and queued call of the device (sticky, as a GPU's).

constexpr int CUDA_ERROR_NOT_READY = 600;

// ANNEAL_CUDA_EMU_TRANSFER_LOG: one line per device->host copy or host wait, appended (so the
// ranks of a job may share one file).
void log_transfer(const std::string& line) {
    static const char* path = getenv("ANNEAL_CUDA_EMU_TRANSFER_LOG");
    if (!path || !*path) return;
    if (FILE* f = fopen(path, "a")) {
        fprintf(f, "%s\n", line.c_str());
        fclose(f);
    }
}

bool eager_streams() {
    static bool eager = [] {
        const char* env = getenv("ANNEAL_CUDA_EMU_STREAMS");
        if (!env || !*env || !strcmp(env, "lazy")) return false;
        if (!strcmp(env, "eager")) return true;
        complain(std::string("ANNEAL_CUDA_EMU_STREAMS = \"") + env +
                 "\" is not lazy or eager; streams run lazily");
        return false;
    }();
    return eager;
}

std::set<Stream*> live_streams;
int sticky[MAX_DEVICES] = {};

/// An event's state, shared with the queued work that records or waits on it (an event may be
/// destroyed while that work is still queued).
struct EventState {
    Stream* stream = nullptr; // where it was last recorded (only read while a record is queued)
    uint64_t recorded = 0;    // records made
    uint64_t completed = 0;   // records that ran
    bool timing = true;       // created without CU_EVENT_DISABLE_TIMING
    double ran_ms = 0;        // the host's steady clock when the last record ran
};

double steady_ms() {
    using namespace std::chrono;
    return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}
struct Event {
    std::shared_ptr<EventState> st = std::make_shared<EventState>();
};

/// Runs the oldest queued op of `s`; in lazy mode its failure becomes the device's sticky error.
int run_one(Stream* s) {
    auto op = std::move(s->queue.front());
    s->queue.pop_front();
    int rc = op();
    if (rc && !eager_streams() && !sticky[s->dev]) sticky[s->dev] = rc;
    return rc;
}

/// Runs everything queued on `s`; the device's sticky error, or success.
int drain(Stream* s) {
    while (!s->queue.empty()) run_one(s);
    return sticky[s->dev];
}

/// Runs the queued work of every stream; the first sticky error of any device, or success.
int drain_all() {
    for (bool again = true; again;) {
        again = false;
        for (Stream* s : live_streams)
            if (!s->queue.empty()) {
                drain(s);
                again = true;
            }
    }
    for (int d = 0; d < MAX_DEVICES; ++d)
        if (sticky[d]) return sticky[d];
    return CUDA_SUCCESS;
}

/// Runs `s`'s work until the record numbered `gen` of event `st` ran. Waits only name records
/// queued before them, so this never needs work queued after the wait: no cycles.
void run_until(const std::shared_ptr<EventState>& st, uint64_t gen) {
    while (st->completed < gen && st->stream && !st->stream->queue.empty()) run_one(st->stream);
}

/// Queues `op` on stream `sp`; on the null stream, runs every stream's work and then `op`. In
/// eager mode the stream runs at once and `op`'s own result is returned.
int enqueue(void* sp, std::function<int()> op) {
    auto* s = static_cast<Stream*>(sp);
    if (!s) {
        int rc = drain_all();
        return rc ? rc : op();
    }
    if (sticky[s->dev]) return sticky[s->dev];
    s->queue.push_back(std::move(op));
    if (!eager_streams()) return CUDA_SUCCESS;
    int rc = CUDA_SUCCESS;
    while (!s->queue.empty()) rc = run_one(s);
    return rc;
}

/// Host allocations from cuMemHostAlloc (pinned: queued copies read and write them when they
/// run), by start address.
std::map<uintptr_t, size_t> pinned;

bool is_pinned(const void* p, size_t n) {
    auto a = reinterpret_cast<uintptr_t>(p);
    auto it = pinned.upper_bound(a);
    if (it == pinned.begin()) return false;
    --it;
    return a + n <= it->first + it->second;
}

} // namespace

int emu_rt::enqueue(void* stream, std::function<int()> op) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    return ::enqueue(stream, std::move(op));
}

int emu_rt::drain_stream(void* stream) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    return stream ? drain(static_cast<Stream*>(stream)) : drain_all();
}

namespace {

// ---- modules and functions ----

typedef int (*LaunchFn)(void**, const unsigned*, const unsigned*, unsigned, char*, int);
typedef void** (*CaptureFn)(void**, char*, int);

struct Module {
    void* handle;
};
struct Function {
    LaunchFn launch;
    CaptureFn capture; // copies the arguments so the launch can be queued (null: runs at once)
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

/// The text of every header in `dir`, in name order (part of a module's cache key).
std::string headers_text(const std::string& dir) {
    std::set<std::string> names;
    if (DIR* d = opendir(dir.c_str())) {
        while (dirent* e = readdir(d))
            if (e->d_name[0] != '.') names.insert(e->d_name);
        closedir(d);
    }
    std::string text;
    for (auto& n : names) text += "\n// " + n + "\n" + read_file(dir + "/" + n);
    return text;
}

/// Compiles `p.source` into a cached shared library; `p.ptx` names it.
bool compile(Program& p) {
    // `extern __shared__ T name[];` has no host meaning: it becomes a pointer to the launch's
    // dynamic shared memory.
    static const std::regex dyn(
        R"(extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([A-Za-z_][\w\s]*?)\s+(\w+)\s*\[\s*\]\s*;)");
    std::string src = std::regex_replace(p.source, dyn,
                                         "$1* $2 = reinterpret_cast<$1*>(emu_dynamic_smem());");
    std::string header = self_dir() + "/emu_kernel.h";
    std::string include = self_dir() + "/include";
    const char* cxx_env = getenv("ANNEAL_CUDA_EMU_CXX");
    std::string cxx = cxx_env && *cxx_env ? cxx_env : "c++";
    std::string dir = cache_dir();
    std::string key =
        std::to_string(fnv1a(read_file(header) + headers_text(include) + "\n" + src + cxx));
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
    if (!run(cxx + " -std=c++17 -E -P -DEMU_SCAN -I" + include + " -x c++ " + cu + " -o " + pre,
             log, &out)) {
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
                        "-fvisibility=hidden -w -I" +
                      include + " -x c++ " + cu + " -o " + tmp_so,
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
    // One SM of an H100 SXM: its clocks, and its share (1/132) of the 5120-bit memory bus, so
    // the peaks a roofline derives keep the hardware's ratio of compute to bandwidth.
    case 13: *v = 1980000; break;            // clock rate, kHz
    case 36: *v = 2619000; break;            // memory clock rate, kHz
    case 37: *v = 40; break;                 // global memory bus width, bits
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
int cuCtxSynchronize() {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    log_transfer("wait context");
    return drain_all();
}
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

// Streams and events: queues, see "streams and events" above. A stream belongs to the device of
// the context current when it was made.
int cuStreamCreate(void** s, unsigned) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    auto* st = new Stream{current_device(), {}};
    live_streams.insert(st);
    *s = st;
    return CUDA_SUCCESS;
}
int cuStreamCreateWithPriority(void** s, unsigned, int) { return cuStreamCreate(s, 0); }
int cuStreamDestroy_v2(void* s) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    auto* st = static_cast<Stream*>(s);
    if (!st) return CUDA_ERROR_INVALID_VALUE;
    // Its queued work still runs (as on the hardware), before the queue goes away.
    drain(st);
    live_streams.erase(st);
    delete st;
    return CUDA_SUCCESS;
}
int cuStreamSynchronize(void* s) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    log_transfer("wait stream");
    return s ? drain(static_cast<Stream*>(s)) : drain_all();
}
int cuStreamQuery(void* s) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    if (s) return static_cast<Stream*>(s)->queue.empty() ? sticky[static_cast<Stream*>(s)->dev]
                                                         : CUDA_ERROR_NOT_READY;
    for (Stream* st : live_streams)
        if (!st->queue.empty()) return CUDA_ERROR_NOT_READY;
    return CUDA_SUCCESS;
}
int cuStreamWaitEvent(void* s, void* e, unsigned) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    if (!e) return CUDA_ERROR_INVALID_VALUE;
    auto st = static_cast<Event*>(e)->st;
    uint64_t gen = st->recorded;
    if (st->completed >= gen) return CUDA_SUCCESS; // nothing outstanding to wait for
    return enqueue(s, [st, gen]() {
        run_until(st, gen);
        return CUDA_SUCCESS;
    });
}
int cuEventCreate(void** e, unsigned flags) {
    auto* ev = new Event();
    ev->st->timing = !(flags & 0x2); // CU_EVENT_DISABLE_TIMING
    *e = ev;
    return CUDA_SUCCESS;
}
int cuEventDestroy_v2(void* e) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    delete static_cast<Event*>(e);
    return CUDA_SUCCESS;
}
int cuEventRecord(void* e, void* s) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    if (!e) return CUDA_ERROR_INVALID_VALUE;
    auto st = static_cast<Event*>(e)->st;
    uint64_t gen = ++st->recorded;
    st->stream = static_cast<Stream*>(s);
    return enqueue(s, [st, gen]() {
        st->completed = std::max(st->completed, gen);
        st->ran_ms = steady_ms();
        return CUDA_SUCCESS;
    });
}
int cuEventRecordWithFlags(void* e, void* s, unsigned) { return cuEventRecord(e, s); }
int cuEventSynchronize(void* e) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    if (!e) return CUDA_ERROR_INVALID_VALUE;
    log_transfer("wait event");
    auto st = static_cast<Event*>(e)->st;
    if (st->completed >= st->recorded) return CUDA_SUCCESS;
    Stream* on = st->stream;
    run_until(st, st->recorded);
    return on ? sticky[on->dev] : CUDA_SUCCESS;
}
int cuEventQuery(void* e) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    if (!e) return CUDA_ERROR_INVALID_VALUE;
    auto& st = static_cast<Event*>(e)->st;
    return st->completed >= st->recorded ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}
// The time between two events' work, as the driver answers it: both must be timing events
// (else CUDA_ERROR_INVALID_HANDLE) whose records have run (else CUDA_ERROR_NOT_READY).
int cuEventElapsedTime(float* ms, void* start, void* end) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    if (!ms || !start || !end) return CUDA_ERROR_INVALID_VALUE;
    auto a = static_cast<Event*>(start)->st, b = static_cast<Event*>(end)->st;
    if (!a->timing || !b->timing || !a->recorded || !b->recorded) return 400;
    if (a->completed < a->recorded || b->completed < b->recorded) return CUDA_ERROR_NOT_READY;
    *ms = static_cast<float>(b->ran_ms - a->ran_ms);
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
    // The driver synchronises here: queued work that uses the block runs first.
    drain_all();
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
    std::lock_guard<std::recursive_mutex> l(big_lock);
    *p = malloc(bytes ? bytes : 1);
    if (!*p) return CUDA_ERROR_OUT_OF_MEMORY;
    pinned[reinterpret_cast<uintptr_t>(*p)] = bytes;
    return CUDA_SUCCESS;
}
int cuMemAllocHost_v2(void** p, size_t bytes) { return cuMemHostAlloc(p, bytes, 0); }
int cuMemFreeHost(void* p) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    drain_all();
    pinned.erase(reinterpret_cast<uintptr_t>(p));
    free(p);
    return CUDA_SUCCESS;
}

// Copies and memsets: the ranges are checked when the call is made (so a bad one fails at once),
// the bytes move when the work runs. The synchronous forms run on the null stream.
int cuMemcpyHtoDAsync_v2(uint64_t dst, const void* src, size_t n, void* s) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    if (n && !device_range(dst, n)) return bad_range("copy to device", dst, n);
    if (n && device_ptr_check(src)) return bad_range("copy to device from device memory", dst, n);
    auto* d = reinterpret_cast<void*>(dst);
    if (!n) return CUDA_SUCCESS;
    if (is_pinned(src, n))
        return enqueue(s, [d, src, n]() {
            memcpy(d, src, n);
            return CUDA_SUCCESS;
        });
    // Pageable memory is read now: the caller may reuse it as soon as the call returns.
    auto bytes = std::make_shared<std::vector<char>>(static_cast<const char*>(src),
                                                     static_cast<const char*>(src) + n);
    return enqueue(s, [d, bytes]() {
        memcpy(d, bytes->data(), bytes->size());
        return CUDA_SUCCESS;
    });
}
int cuMemcpyDtoHAsync_v2(void* dst, uint64_t src, size_t n, void* s) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    if (n && !device_range(src, n)) return bad_range("copy to host", src, n);
    log_transfer("dtoh " + std::to_string(n));
    auto* from = reinterpret_cast<const void*>(src);
    auto copy = [dst, from, n]() {
        memcpy(dst, from, n);
        return CUDA_SUCCESS;
    };
    if (!n) return CUDA_SUCCESS;
    if (is_pinned(dst, n)) return enqueue(s, copy);
    // Into pageable memory the driver returns only once the copy is done.
    int rc = s ? drain(static_cast<Stream*>(s)) : drain_all();
    return rc ? rc : copy();
}
int cuMemcpyDtoDAsync_v2(uint64_t dst, uint64_t src, size_t n, void* s) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    if (n && !device_range(src, n)) return bad_range("device copy source", src, n);
    if (n && !device_range(dst, n)) return bad_range("device copy destination", dst, n);
    auto *d = reinterpret_cast<void*>(dst), *f = reinterpret_cast<void*>(src);
    return enqueue(s, [d, f, n]() {
        memmove(d, f, n);
        return CUDA_SUCCESS;
    });
}
int cuMemcpyHtoD_v2(uint64_t dst, const void* src, size_t n) {
    return cuMemcpyHtoDAsync_v2(dst, src, n, nullptr);
}
int cuMemcpyDtoH_v2(void* dst, uint64_t src, size_t n) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    if (n && !device_range(src, n)) return bad_range("copy to host", src, n);
    log_transfer("dtoh " + std::to_string(n));
    int rc = drain_all();
    if (!rc) memcpy(dst, reinterpret_cast<const void*>(src), n);
    return rc;
}
int cuMemcpyDtoD_v2(uint64_t dst, uint64_t src, size_t n) {
    return cuMemcpyDtoDAsync_v2(dst, src, n, nullptr);
}
int cuMemcpyPeerAsync(uint64_t dst, void* dst_ctx, uint64_t src, void* src_ctx, size_t n,
                      void* s) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    auto *d = static_cast<Context*>(dst_ctx), *c = static_cast<Context*>(src_ctx);
    if (!d || !c) return CUDA_ERROR_INVALID_CONTEXT;
    if (n && !device_range(src, n, c->dev)) return bad_range("peer copy source", src, n, c->dev);
    if (n && !device_range(dst, n, d->dev))
        return bad_range("peer copy destination", dst, n, d->dev);
    auto *to = reinterpret_cast<void*>(dst), *from = reinterpret_cast<void*>(src);
    return enqueue(s, [to, from, n]() {
        memmove(to, from, n);
        return CUDA_SUCCESS;
    });
}
int cuMemcpyPeer(uint64_t dst, void* dst_ctx, uint64_t src, void* src_ctx, size_t n) {
    return cuMemcpyPeerAsync(dst, dst_ctx, src, src_ctx, n, nullptr);
}
int cuMemsetD8Async(uint64_t dst, unsigned char v, size_t n, void* s) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    if (n && !device_range(dst, n)) return bad_range("memset", dst, n);
    auto* d = reinterpret_cast<void*>(dst);
    return enqueue(s, [d, v, n]() {
        memset(d, v, n);
        return CUDA_SUCCESS;
    });
}
int cuMemsetD8_v2(uint64_t dst, unsigned char v, size_t n) {
    return cuMemsetD8Async(dst, v, n, nullptr);
}
int cuMemsetD32Async(uint64_t dst, unsigned v, size_t n, void* s) {
    std::lock_guard<std::recursive_mutex> l(big_lock);
    if (n && !device_range(dst, n * 4)) return bad_range("memset", dst, n * 4);
    auto* p = reinterpret_cast<unsigned*>(dst);
    return enqueue(s, [p, v, n]() {
        for (size_t i = 0; i < n; ++i) p[i] = v;
        return CUDA_SUCCESS;
    });
}
int cuMemsetD32_v2(uint64_t dst, unsigned v, size_t n) {
    return cuMemsetD32Async(dst, v, n, nullptr);
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
    auto cap = reinterpret_cast<CaptureFn>(dlsym(m->handle, (std::string("emu_capture_") + name).c_str()));
    *f = new Function{fn, cap, name};
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
    int dev = stream_device(stream);
    if (!fn->capture) {
        // A module without argument capture runs at once, after its stream's queued work.
        int rc = stream ? drain(static_cast<Stream*>(stream)) : drain_all();
        if (rc) return rc;
        unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
        launching_device = dev;
        rc = fn->launch(params, grid, block, smem, err, sizeof err);
        launching_device = -1;
        if (rc != 0) complain(err);
        return rc ? CUDA_ERROR_LAUNCH_FAILED : CUDA_SUCCESS;
    }
    // The arguments are checked and copied now (a bad pointer fails the call); the grid runs
    // when the stream reaches it.
    launching_device = dev;
    void** args = fn->capture(params, err, sizeof err);
    launching_device = -1;
    if (!args) {
        complain(err);
        return CUDA_ERROR_LAUNCH_FAILED;
    }
    return enqueue(stream, [fn, gx, gy, gz, bx, by, bz, smem, dev, args]() {
        unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
        char e[512] = {0};
        launching_device = dev;
        int rc = fn->launch(args, grid, block, smem, e, sizeof e);
        launching_device = -1;
        free(args);
        if (rc != 0) {
            complain(e);
            return CUDA_ERROR_LAUNCH_FAILED;
        }
        return CUDA_SUCCESS;
    });
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

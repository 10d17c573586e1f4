// NCCL emulated between processes on one machine: the calls cudarc's NCCL bindings make, over
// POSIX shared memory (nccl_shm.h), for ranks that each run this CUDA emulation. build.sh links
// the library as libnccl.so too.
//
// - ncclGetUniqueId makes a random nonce; ncclCommInitRank maps the shared object named from it.
// - Work runs when it is enqueued, after the work queued before it on its stream (runtime.cpp's
//   streams are queues: that runs it, and through the stream's event waits whatever it waits
//   for), so running a call to completion before returning is the stream order NCCL promises,
//   and a call whose stream does not wait for the kernels that wrote its buffers reads the
//   values from before them. Inside ncclGroupStart/End the
//   calls wait for ncclGroupEnd, which posts every send first, then runs the collectives in
//   order, then the receives, then waits until its sends were taken: ranks that both send and
//   then receive in one group do not deadlock.
// - Reductions combine the ranks' values in rank order, in the power-of-two tree of
//   anneal_dist::rank_order_sum (for 2 or 3 ranks: ((r0 + r1) + r2)), so every rank gets the
//   same bits and they equal the MPI collectives' bits. bf16/f16 round after every addition.
// - Checks: buffers must be live blocks of the communicator's device, large enough for the call;
//   the n-th collective of every rank must be the same call (op, count, dtype, root); a send
//   must meet a receive of the same count and type; ranks waiting for each other in a cycle
//   (a collective against a send/recv, receives in a ring), a peer process that exited, or no
//   progress for ANNEAL_NCCL_EMU_TIMEOUT seconds (default 600) fail the communicator on every
//   rank, with the calls involved named on stderr, instead of hanging.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "emu_shared.h"
#include "nccl_shm.h"

using namespace emu_nccl;

namespace {

using Clock = std::chrono::steady_clock;

const char* kind_name(int k) {
    static const char* names[] = {"none",          "ncclAllReduce", "ncclReduce",
                                  "ncclBroadcast", "ncclAllGather", "ncclReduceScatter",
                                  "ncclAlltoAll",  "ncclGather",    "ncclScatter",
                                  "ncclSend",      "ncclRecv"};
    return k >= 0 && k <= RECV ? names[k] : "?";
}

const char* dtype_name(int t) {
    static const char* names[] = {"int8",    "uint8",   "int32",   "uint32",  "int64",
                                  "uint64",  "float16", "float32", "float64", "bfloat16"};
    return t >= 0 && t < NUM_DTYPES ? names[t] : "unknown type";
}

size_t dtype_size(int t) {
    static const size_t sizes[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};
    return sizes[t];
}

std::string describe(const Desc& d) {
    static const char* ops[] = {"sum", "prod", "max", "min", "avg"};
    char buf[200];
    int at = snprintf(buf, sizeof buf, "%s(count %llu, %s", kind_name(d.kind),
                      (unsigned long long)d.count, dtype_name(d.dtype));
    if (d.op >= 0 && d.op < NUM_OPS) at += snprintf(buf + at, sizeof buf - at, ", %s", ops[d.op]);
    if (d.root >= 0)
        at += snprintf(buf + at, sizeof buf - at, ", %s %d",
                       d.kind == SEND || d.kind == RECV ? "peer" : "root", d.root);
    snprintf(buf + at, sizeof buf - at, ")");
    return buf;
}

bool same(const Desc& a, const Desc& b) {
    return a.kind == b.kind && a.dtype == b.dtype && a.op == b.op && a.root == b.root &&
           a.count == b.count;
}

thread_local std::string last_message;

void say(const Comm* c, const std::string& what) {
    if (c)
        fprintf(stderr, "anneal nccl emulation: rank %d of %d: %s\n", c->rank, c->n,
                what.c_str());
    else
        fprintf(stderr, "anneal nccl emulation: %s\n", what.c_str());
    last_message = what;
}

/// Fails the communicator on every rank: the first failure's text is kept for the others.
int fail(Comm& c, int code, const std::string& why) {
    say(&c, why);
    int zero = 0;
    if (c.hdr->error.compare_exchange_strong(zero, code)) {
        std::string text = "rank " + std::to_string(c.rank) + ": " + why;
        snprintf(c.hdr->why, sizeof c.hdr->why, "%s", text.c_str());
        c.hdr->why_ready.store(1, std::memory_order_release);
    }
    c.error = code;
    c.last_error = why;
    return code;
}

/// The error another rank left on the communicator, taken over by this one.
int failed_elsewhere(Comm& c, const Desc& call) {
    for (int i = 0; i < 1000 && !c.hdr->why_ready.load(std::memory_order_acquire); ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::string why = c.hdr->why_ready.load(std::memory_order_acquire) ? c.hdr->why : "";
    c.error = ncclRemoteError;
    c.last_error = describe(call) + " failed: the communicator failed on " + why;
    say(&c, c.last_error);
    return c.error;
}

double timeout_seconds() {
    static double t = [] {
        const char* env = getenv("ANNEAL_NCCL_EMU_TIMEOUT");
        if (env && *env) {
            char* end = nullptr;
            double v = strtod(env, &end);
            if (!*end && v > 0) return v;
            say(nullptr, std::string("ANNEAL_NCCL_EMU_TIMEOUT = \"") + env +
                             "\" is not a positive number of seconds; using 600");
        }
        return 600.0;
    }();
    return t;
}

bool alive(int pid) {
    if (pid <= 0) return true;
    if (kill(pid, 0) != 0 && errno == ESRCH) return false;
    // An exited child its parent has not reaped yet still answers kill().
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    auto paren = text.rfind(')');
    return paren == std::string::npos || paren + 2 >= text.size() || text[paren + 2] != 'Z';
}

// ---- what each rank waits for ----

struct Wait {
    int kind;
    int peer;
    uint64_t seq;
    Desc call;
};

void publish(Slot& s, const Wait& w) {
    s.epoch.fetch_add(1, std::memory_order_acq_rel);
    s.wait_kind.store(w.kind, std::memory_order_relaxed);
    s.wait_peer.store(w.peer, std::memory_order_relaxed);
    s.wait_seq.store(w.seq, std::memory_order_relaxed);
    s.wait_call = w.call;
    s.epoch.fetch_add(1, std::memory_order_acq_rel);
}

/// Rank k's published wait, or false while it changes.
bool read_wait(Slot& s, Wait* w, uint64_t* epoch) {
    uint64_t e = s.epoch.load(std::memory_order_acquire);
    if (e & 1) return false;
    w->kind = s.wait_kind.load(std::memory_order_relaxed);
    w->peer = s.wait_peer.load(std::memory_order_relaxed);
    w->seq = s.wait_seq.load(std::memory_order_relaxed);
    w->call = s.wait_call;
    *epoch = e;
    return s.epoch.load(std::memory_order_acquire) == e;
}

/// Whether `w` (rank `who`'s wait) cannot end until rank `me` acts, judged on the shared data
/// itself, so a wait that is already satisfied never counts.
bool blocked_by(Comm& c, int who, const Wait& w, int me) {
    switch (w.kind) {
    case W_POST: return c.slots[me].posted.load(std::memory_order_acquire) < w.seq;
    case W_DONE: return c.slots[me].done.load(std::memory_order_acquire) < w.seq;
    case W_RECV: {
        Pair& p = c.pair(me, who);
        return w.peer == me && p.sent.load(std::memory_order_acquire) <=
                                   p.taken.load(std::memory_order_acquire);
    }
    case W_ACK: {
        Pair& p = c.pair(who, me);
        return w.peer == me && p.taken.load(std::memory_order_acquire) <
                                   p.sent.load(std::memory_order_acquire);
    }
    case W_SPACE: {
        Pair& p = c.pair(who, me);
        return w.peer == me && p.sent.load(std::memory_order_acquire) -
                                       p.taken.load(std::memory_order_acquire) >=
                                   QUEUE;
    }
    default: return false;
    }
}

/// A cycle of waits through this rank (this rank waits for the first, ..., the last for this
/// one), found on the published waits, or empty. Every wait in it is judged on the shared data,
/// so each rank in it cannot move until the next one does: a deadlock, once it lasts (the
/// caller's grace covers waits read while they end). `sig` gets the ranks' wait epochs.
template <class WaitsOn>
std::vector<int> wait_cycle(Comm& c, WaitsOn waits_on, std::vector<Wait>* waits,
                            std::vector<uint64_t>* sig) {
    int n = c.n;
    waits->assign(n, Wait{W_NONE, -1, 0, Desc{}});
    std::vector<uint64_t> epoch(n, 0);
    for (int k = 0; k < n; ++k)
        if (k != c.rank && !read_wait(c.slots[k], &(*waits)[k], &epoch[k]))
            (*waits)[k].kind = W_NONE;
    // Breadth first from the ranks this one waits for, along "k waits for j", back to here.
    std::vector<int> parent(n, -2), queue;
    for (int j = 0; j < n; ++j)
        if (j != c.rank && waits_on(j)) {
            parent[j] = -1;
            queue.push_back(j);
        }
    for (size_t at = 0; at < queue.size(); ++at) {
        int k = queue[at];
        for (int j = 0; j < n; ++j) {
            if (!blocked_by(c, k, (*waits)[k], j)) continue;
            if (j == c.rank) {
                std::vector<int> path;
                for (int x = k; x >= 0; x = parent[x]) path.insert(path.begin(), x);
                sig->clear();
                for (int x : path) sig->push_back(uint64_t(x) << 48 ^ epoch[x]);
                return path;
            }
            if (parent[j] == -2) {
                parent[j] = k;
                queue.push_back(j);
            }
        }
    }
    return {};
}

/// Waits until `ready()`, failing the communicator when another rank failed it, a rank it
/// waits for exited, the ranks wait for each other in a cycle (a deadlock: their calls do not
/// match), or nothing happened for the timeout. `waits_on(k)`: whether this wait needs rank k.
template <class Ready, class WaitsOn>
int wait_until(Comm& c, const Wait& w, Ready ready, WaitsOn waits_on) {
    if (ready()) return ncclSuccess;
    Slot& mine = c.slots[c.rank];
    publish(mine, w);
    auto start = Clock::now(), last_check = start;
    std::vector<uint64_t> cycle_sig, sig;
    std::vector<Wait> waits;
    Clock::time_point cycle_since = start;
    int rc = ncclSuccess;
    for (int spin = 0;; ++spin) {
        if (ready()) break;
        if (c.hdr->error.load(std::memory_order_acquire)) {
            rc = failed_elsewhere(c, w.call);
            break;
        }
        if (spin < 100)
            std::this_thread::yield();
        else
            std::this_thread::sleep_for(std::chrono::microseconds(spin < 1000 ? 20 : 200));
        auto now = Clock::now();
        if (now - last_check < std::chrono::milliseconds(100)) continue;
        last_check = now;
        for (int k = 0; k < c.n && rc == ncclSuccess; ++k) {
            if (k == c.rank || !waits_on(k)) continue;
            int pid = c.slots[k].pid.load(std::memory_order_acquire);
            if (!alive(pid)) {
                rc = fail(c, ncclRemoteError,
                          describe(w.call) + ": rank " + std::to_string(k) + " (pid " +
                              std::to_string(pid) + ") exited before taking part");
                break;
            }
        }
        if (rc != ncclSuccess) break;
        std::vector<int> cycle;
        if (w.kind != W_JOIN) cycle = wait_cycle(c, waits_on, &waits, &sig);
        if (cycle.empty()) {
            cycle_sig.clear();
        } else if (sig != cycle_sig) {
            cycle_sig = sig;
            cycle_since = now;
        } else if (now - cycle_since > std::chrono::seconds(1)) {
            std::string text = "the ranks' calls do not match, they wait for each other: rank " +
                               std::to_string(c.rank) + " in " + describe(w.call);
            for (int k : cycle)
                text += " waits for rank " + std::to_string(k) + ", rank " + std::to_string(k) +
                        " in " + describe(waits[k].call);
            text += " waits for rank " + std::to_string(c.rank);
            rc = fail(c, ncclInvalidUsage, text);
            break;
        }
        if (std::chrono::duration<double>(now - start).count() > timeout_seconds()) {
            std::string missing;
            for (int k = 0; k < c.n; ++k)
                if (k != c.rank && waits_on(k)) missing += " " + std::to_string(k);
            rc = fail(c, ncclSystemError,
                      describe(w.call) + ": no progress for ANNEAL_NCCL_EMU_TIMEOUT = " +
                          std::to_string(int(timeout_seconds())) + " s; waiting for rank(s)" +
                          missing);
            break;
        }
    }
    publish(mine, Wait{W_NONE, -1, 0, Desc{}});
    return rc;
}

// ---- staging objects ----

std::string shm_name(const std::string& base, char kind, int rank) {
    return "/" + base + "-" + kind + std::to_string(rank);
}

/// Grows this rank's staging object to hold `bytes` and publishes its size in `cap`.
bool ensure(Staging& s, size_t bytes, std::atomic<uint64_t>& cap) {
    if (bytes <= s.len) return true;
    size_t len = std::max<size_t>({bytes, 2 * s.len, 1 << 16});
    len = (len + 4095) / 4096 * 4096;
    if (ftruncate(s.fd, off_t(len)) != 0) return false;
    void* m = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, s.fd, 0);
    if (m == MAP_FAILED) return false;
    if (s.map) munmap(s.map, s.len);
    s.map = static_cast<char*>(m);
    s.len = len;
    cap.store(len, std::memory_order_release);
    return true;
}

/// A peer's staging object mapped far enough to read [0, bytes).
const char* view(Staging& s, size_t bytes, const std::atomic<uint64_t>& cap) {
    if (bytes <= s.len) return s.map;
    size_t len = cap.load(std::memory_order_acquire);
    if (len < bytes) return nullptr;
    void* m = mmap(nullptr, len, PROT_READ, MAP_SHARED, s.fd, 0);
    if (m == MAP_FAILED) return nullptr;
    if (s.map) munmap(s.map, s.len);
    s.map = static_cast<char*>(m);
    s.len = len;
    return s.map;
}

void release(Staging& s) {
    if (s.map) munmap(s.map, s.len);
    if (s.fd >= 0) close(s.fd);
    s = Staging{};
}

void destroy(Comm* c) {
    release(c->coll);
    release(c->p2p);
    for (auto& s : c->peer_coll) release(s);
    for (auto& s : c->peer_p2p) release(s);
    if (c->shm) munmap(c->shm, c->shm_len);
    delete c;
}

} // namespace

// The pieces of nccl.cpp the second file (nccl_ops.cpp) needs.
namespace emu_nccl {
const char* call_name(int kind) { return kind_name(kind); }
std::string call_text(const Desc& d) { return describe(d); }
bool same_call(const Desc& a, const Desc& b) { return same(a, b); }
size_t type_size(int dtype) { return dtype_size(dtype); }
int fail_comm(Comm& c, int code, const std::string& why) { return fail(c, code, why); }
int failed_before(Comm& c, const Desc& call) { return failed_elsewhere(c, call); }
void note(const Comm* c, const std::string& what) { say(c, what); }
bool grow(Staging& s, size_t bytes, std::atomic<uint64_t>& cap) { return ensure(s, bytes, cap); }
const char* peek(Staging& s, size_t bytes, const std::atomic<uint64_t>& cap) {
    return view(s, bytes, cap);
}
int wait_all(Comm& c, int kind, uint64_t seq, const Desc& call) {
    auto field = [&](int k) -> std::atomic<uint64_t>& {
        return kind == W_POST ? c.slots[k].posted : c.slots[k].done;
    };
    auto behind = [&](int k) { return field(k).load(std::memory_order_acquire) < seq; };
    return wait_until(
        c, Wait{kind, -1, seq, call},
        [&] {
            for (int k = 0; k < c.n; ++k)
                if (behind(k)) return false;
            return true;
        },
        behind);
}
int wait_peer(Comm& c, int kind, int peer, const Desc& call, const std::function<bool()>& ready) {
    return wait_until(c, Wait{kind, peer, 0, call}, ready, [peer](int k) { return k == peer; });
}
} // namespace emu_nccl

extern "C" {

const char* ncclGetErrorString(int r) {
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (emulated NCCL: see stderr)";
    case ncclSystemError: return "unhandled system error (emulated NCCL: see stderr)";
    case ncclInternalError: return "internal error (emulated NCCL: see stderr)";
    case ncclInvalidArgument: return "invalid argument (emulated NCCL: see stderr)";
    case ncclInvalidUsage: return "invalid usage (emulated NCCL: see stderr)";
    case ncclRemoteError: return "remote process exited or there was a network error "
                                 "(emulated NCCL: see stderr)";
    default: return "unknown result code (emulated NCCL)";
    }
}

const char* ncclGetLastError(void*) { return last_message.c_str(); }

int ncclGetVersion(int* version) {
    *version = 23000; // 2.30.0, the version cudarc's bindings are generated for
    return ncclSuccess;
}

int ncclGetUniqueId(char* id) {
    // "anneal-emu" then a random nonce, as hex text so it can name the shared object.
    std::random_device rd;
    char nonce[33];
    for (int i = 0; i < 4; ++i) snprintf(nonce + 8 * i, 9, "%08x", unsigned(rd()));
    memset(id, 0, 128);
    snprintf(id, 128, "anneal-emu %s", nonce);
    return ncclSuccess;
}

/// ncclUniqueId: passed by value, so in memory on the stack, not as a pointer.
struct UniqueId {
    char internal[128];
};

int ncclCommInitRank(void** out, int nranks, UniqueId unique, int rank) {
    *out = nullptr;
    std::string id(unique.internal, strnlen(unique.internal, 128));
    if (id.rfind("anneal-emu ", 0) != 0 || id.size() != 11 + 32) {
        say(nullptr, "ncclCommInitRank: the unique id does not come from this emulation's "
                     "ncclGetUniqueId");
        return ncclInvalidArgument;
    }
    if (nranks < 1 || rank < 0 || rank >= nranks) {
        say(nullptr, "ncclCommInitRank: rank " + std::to_string(rank) + " of " +
                         std::to_string(nranks) + " is out of range");
        return ncclInvalidArgument;
    }
    auto* c = new Comm;
    c->rank = rank;
    c->n = nranks;
    c->dev = emu_rt::current_device();
    c->name = "anneal-nccl-" + id.substr(11);
    size_t need = sizeof(Header) + sizeof(Slot) * nranks + sizeof(Pair) * nranks * nranks;
    std::string path = "/" + c->name;
    int fd = shm_open(path.c_str(), O_CREAT | O_RDWR, 0600);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0 ||
        (size_t(st.st_size) < need && ftruncate(fd, off_t(need)) != 0)) {
        say(nullptr, "ncclCommInitRank: cannot create the shared object " + path + ": " +
                         strerror(errno));
        if (fd >= 0) close(fd);
        destroy(c);
        return ncclSystemError;
    }
    void* m = mmap(nullptr, need, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) {
        destroy(c);
        return ncclSystemError;
    }
    c->shm = static_cast<char*>(m);
    c->shm_len = need;
    c->hdr = reinterpret_cast<Header*>(c->shm);
    c->slots = reinterpret_cast<Slot*>(c->shm + sizeof(Header));
    c->pairs = reinterpret_cast<Pair*>(c->shm + sizeof(Header) + sizeof(Slot) * nranks);
    c->sent.assign(nranks, 0);
    c->taken.assign(nranks, 0);
    Desc call{NONE, 0, -1, -1, 0};

    uint64_t zero64 = 0;
    c->hdr->magic.compare_exchange_strong(zero64, MAGIC);
    int32_t zero = 0;
    if (!c->hdr->nranks.compare_exchange_strong(zero, nranks) && zero != nranks) {
        int rc = fail(*c, ncclInvalidUsage,
                      "ncclCommInitRank: the ranks disagree on the communicator's size (" +
                          std::to_string(zero) + " and " + std::to_string(nranks) + ")");
        destroy(c);
        return rc;
    }
    zero = 0;
    if (!c->slots[rank].pid.compare_exchange_strong(zero, int32_t(getpid()))) {
        int rc = fail(*c, ncclInvalidUsage,
                      "ncclCommInitRank: rank " + std::to_string(rank) +
                          " joined twice (pids " + std::to_string(zero) + " and " +
                          std::to_string(getpid()) + ")");
        destroy(c);
        return rc;
    }
    c->coll.fd = shm_open(shm_name(c->name, 'c', rank).c_str(), O_CREAT | O_RDWR | O_TRUNC, 0600);
    c->p2p.fd = shm_open(shm_name(c->name, 'p', rank).c_str(), O_CREAT | O_RDWR | O_TRUNC, 0600);
    if (c->coll.fd < 0 || c->p2p.fd < 0 || !ensure(c->coll, 1, c->slots[rank].coll_cap) ||
        !ensure(c->p2p, 1, c->slots[rank].p2p_cap)) {
        int rc = fail(*c, ncclSystemError,
                      std::string("ncclCommInitRank: cannot create staging memory: ") +
                          strerror(errno));
        destroy(c);
        return rc;
    }
    c->slots[rank].joined.store(1, std::memory_order_release);
    c->hdr->joined.fetch_add(1, std::memory_order_acq_rel);
    auto not_joined = [c](int k) { return !c->slots[k].joined.load(std::memory_order_acquire); };
    int rc = wait_until(
        *c, Wait{W_JOIN, -1, 0, call},
        [c] { return c->hdr->joined.load(std::memory_order_acquire) >= c->n; }, not_joined);
    c->peer_coll.resize(nranks);
    c->peer_p2p.resize(nranks);
    for (int k = 0; k < nranks && rc == ncclSuccess; ++k) {
        if (k == rank) continue;
        c->peer_coll[k].fd = shm_open(shm_name(c->name, 'c', k).c_str(), O_RDONLY, 0);
        c->peer_p2p[k].fd = shm_open(shm_name(c->name, 'p', k).c_str(), O_RDONLY, 0);
        if (c->peer_coll[k].fd < 0 || c->peer_p2p[k].fd < 0)
            rc = fail(*c, ncclSystemError,
                      "ncclCommInitRank: cannot open rank " + std::to_string(k) +
                          "'s staging memory: " + strerror(errno));
    }
    if (rc == ncclSuccess) {
        c->hdr->opened.fetch_add(1, std::memory_order_acq_rel);
        rc = wait_until(
            *c, Wait{W_JOIN, -1, 0, call},
            [c] { return c->hdr->opened.load(std::memory_order_acquire) >= c->n; },
            [](int) { return true; });
    }
    // Every rank holds what it needs open: the names can go, so nothing is left in /dev/shm.
    shm_unlink(shm_name(c->name, 'c', rank).c_str());
    shm_unlink(shm_name(c->name, 'p', rank).c_str());
    if (rank == 0 || rc != ncclSuccess) shm_unlink(path.c_str());
    if (rc != ncclSuccess) {
        destroy(c);
        return rc;
    }
    *out = c;
    return ncclSuccess;
}

int ncclCommInitRankConfig(void** out, int nranks, UniqueId id, int rank, void*) {
    return ncclCommInitRank(out, nranks, id, rank);
}

int ncclCommDestroy(void* comm) {
    if (comm) destroy(static_cast<Comm*>(comm));
    return ncclSuccess;
}
int ncclCommAbort(void* comm) { return ncclCommDestroy(comm); }
int ncclCommFinalize(void*) { return ncclSuccess; }

int ncclCommCount(void* comm, int* n) {
    *n = static_cast<Comm*>(comm)->n;
    return ncclSuccess;
}
int ncclCommUserRank(void* comm, int* r) {
    *r = static_cast<Comm*>(comm)->rank;
    return ncclSuccess;
}
int ncclCommCuDevice(void* comm, int* d) {
    *d = static_cast<Comm*>(comm)->dev;
    return ncclSuccess;
}
int ncclCommGetAsyncError(void* comm, int* err) {
    auto* c = static_cast<Comm*>(comm);
    *err = c->error ? c->error : (c->hdr->error.load() ? ncclRemoteError : ncclSuccess);
    return ncclSuccess;
}

// Registration only speeds up the hardware's transfers: nothing to do here.
int ncclCommRegister(void*, void*, size_t, void** handle) {
    *handle = nullptr;
    return ncclSuccess;
}
int ncclCommDeregister(void*, void*) { return ncclSuccess; }

#define NOT_EMULATED(name, ...)                                                                \
    int name(__VA_ARGS__) {                                                                    \
        say(nullptr, #name " is not emulated (tools/cuda-emu/nccl.cpp)");                       \
        return ncclInvalidUsage;                                                               \
    }
NOT_EMULATED(ncclCommInitAll, void**, int, const int*)
NOT_EMULATED(ncclCommSplit, void*, int, int, void**, void*)
NOT_EMULATED(ncclRedOpCreatePreMulSum, void*, void*, int, int, void*)
NOT_EMULATED(ncclRedOpDestroy, int, void*)
NOT_EMULATED(ncclMemAlloc, void**, size_t)
NOT_EMULATED(ncclMemFree, void*)
NOT_EMULATED(ncclCommGetUniqueId, void*, void*)
NOT_EMULATED(ncclCommInitRankScalable, void**, int, int, int, void*, void*)
NOT_EMULATED(ncclCommShrink, void*, int*, int, void**, void*, int)
NOT_EMULATED(ncclGroupSimulateEnd, void*)

} // extern "C"

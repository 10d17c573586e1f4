// The emulated NCCL's operations (nccl.cpp has the communicator and the waiting): argument and
// buffer checks, groups, the collectives over the ranks' staged data, and sends and receives.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "emu_shared.h"
#include "nccl_shm.h"

using namespace emu_nccl;

namespace {

// ---- element arithmetic ----

float bf16_to_float(uint16_t h) {
    uint32_t bits = uint32_t(h) << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

uint16_t float_to_bf16(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
    return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

float half_to_float(uint16_t h) {
    uint32_t sign = uint32_t(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    float f;
    if (exp == 0x1f) {
        uint32_t u = sign | 0x7f800000u | (man << 13);
        memcpy(&f, &u, 4);
        return f;
    }
    f = exp == 0 ? std::ldexp(float(man), -24) : std::ldexp(float(man | 0x400), int(exp) - 25);
    return sign ? -f : f;
}

uint16_t float_to_half(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    uint16_t sign = uint16_t((u >> 16) & 0x8000u);
    float a = std::fabs(v);
    if (std::isnan(v)) return uint16_t(sign | 0x7e00u);
    if (a >= 65520.0f) return uint16_t(sign | 0x7c00u); // rounds to infinity
    if (a < std::ldexp(1.0f, -14)) {
        // Subnormal: a multiple of 2^-24, rounded to nearest even by nearbyint.
        return uint16_t(sign | uint16_t(std::nearbyint(std::ldexp(a, 24))));
    }
    int e;
    std::frexp(a, &e); // a = m * 2^e, m in [0.5, 1)
    float scaled = std::nearbyint(std::ldexp(a, 11 - e)); // 11 significant bits
    if (scaled >= 2048.0f) {
        scaled /= 2;
        ++e;
    }
    uint32_t exp = uint32_t(e - 1 + 15), man = uint32_t(scaled) & 0x3ffu;
    if (exp >= 0x1f) return uint16_t(sign | 0x7c00u);
    return uint16_t(sign | (exp << 10) | man);
}

template <class T>
T apply(T a, T b, int op) {
    switch (op) {
    case Prod: return T(a * b);
    case Max: return a > b ? a : b;
    case Min: return a < b ? a : b;
    default: return T(a + b); // Sum, and Avg before its division
    }
}

/// acc[i] = acc[i] (op) x[i] for `count` elements; integers wrap, as on the GPU.
template <class T>
void combine_as(char* acc, const char* x, size_t count, int op) {
    for (size_t i = 0; i < count; ++i) {
        T a, b;
        memcpy(&a, acc + i * sizeof(T), sizeof(T));
        memcpy(&b, x + i * sizeof(T), sizeof(T));
        T r = apply(a, b, op);
        memcpy(acc + i * sizeof(T), &r, sizeof(T));
    }
}

template <float (*Load)(uint16_t), uint16_t (*Store)(float)>
void combine_half(char* acc, const char* x, size_t count, int op) {
    for (size_t i = 0; i < count; ++i) {
        uint16_t a, b;
        memcpy(&a, acc + 2 * i, 2);
        memcpy(&b, x + 2 * i, 2);
        uint16_t r = Store(apply(Load(a), Load(b), op));
        memcpy(acc + 2 * i, &r, 2);
    }
}

void combine(int dtype, int op, char* acc, const char* x, size_t count) {
    switch (dtype) {
    case Int8: // signed sums wrap through the unsigned type; max/min compare signed
        if (op == Max || op == Min) combine_as<int8_t>(acc, x, count, op);
        else combine_as<uint8_t>(acc, x, count, op);
        break;
    case Uint8: combine_as<uint8_t>(acc, x, count, op); break;
    case Int32:
        if (op == Max || op == Min) combine_as<int32_t>(acc, x, count, op);
        else combine_as<uint32_t>(acc, x, count, op);
        break;
    case Uint32: combine_as<uint32_t>(acc, x, count, op); break;
    case Int64:
        if (op == Max || op == Min) combine_as<int64_t>(acc, x, count, op);
        else combine_as<uint64_t>(acc, x, count, op);
        break;
    case Uint64: combine_as<uint64_t>(acc, x, count, op); break;
    case Float16: combine_half<half_to_float, float_to_half>(acc, x, count, op); break;
    case Float32: combine_as<float>(acc, x, count, op); break;
    case Float64: combine_as<double>(acc, x, count, op); break;
    case Bfloat16: combine_half<bf16_to_float, float_to_bf16>(acc, x, count, op); break;
    }
}

template <class T>
void divide_as(char* p, size_t count, int n) {
    for (size_t i = 0; i < count; ++i) {
        T v;
        memcpy(&v, p + i * sizeof(T), sizeof(T));
        v = T(v / T(n));
        memcpy(p + i * sizeof(T), &v, sizeof(T));
    }
}

/// ncclAvg's last step: the sum divided by the rank count.
void divide(int dtype, char* p, size_t count, int n) {
    switch (dtype) {
    case Int8: divide_as<int8_t>(p, count, n); break;
    case Uint8: divide_as<uint8_t>(p, count, n); break;
    case Int32: divide_as<int32_t>(p, count, n); break;
    case Uint32: divide_as<uint32_t>(p, count, n); break;
    case Int64: divide_as<int64_t>(p, count, n); break;
    case Uint64: divide_as<uint64_t>(p, count, n); break;
    case Float32: divide_as<float>(p, count, n); break;
    case Float64: divide_as<double>(p, count, n); break;
    case Float16:
    case Bfloat16: {
        bool bf = dtype == Bfloat16;
        for (size_t i = 0; i < count; ++i) {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            float f = (bf ? bf16_to_float(h) : half_to_float(h)) / float(n);
            h = bf ? float_to_bf16(f) : float_to_half(f);
            memcpy(p + 2 * i, &h, 2);
        }
    }
    }
}

/// out = src[lo] (op) ... (op) src[hi - 1], in anneal_dist::rank_order_sum's tree: the lower
/// power-of-two half, then the rest, so the result does not depend on which rank computes it.
void reduce_tree(int dtype, int op, const std::vector<const char*>& src, int lo, int hi,
                 size_t count, char* out) {
    size_t bytes = count * type_size(dtype);
    if (hi - lo == 1) {
        memcpy(out, src[lo], bytes);
        return;
    }
    int half = 1;
    while (half < hi - lo) half *= 2;
    int mid = lo + half / 2;
    reduce_tree(dtype, op, src, lo, mid, count, out);
    std::vector<char> rest(bytes);
    reduce_tree(dtype, op, src, mid, hi, count, rest.data());
    combine(dtype, op, out, rest.data(), count);
}

// ---- calls ----

struct Op {
    Comm* c;
    Desc d;
    const void* send;
    void* recv;
};

thread_local int group_depth = 0;
thread_local std::vector<Op> pending;
thread_local int group_error = ncclSuccess;

bool is_reduction(int kind) { return kind == ALL_REDUCE || kind == REDUCE || kind == REDUCE_SCATTER; }
bool has_root(int kind) {
    return kind == REDUCE || kind == BROADCAST || kind == GATHER || kind == SCATTER ||
           kind == SEND || kind == RECV;
}

/// Bytes rank `r` stages (and so its send buffer must hold) for collective `d` of `n` ranks.
size_t send_bytes(const Desc& d, int n, int r) {
    size_t b = d.count * type_size(d.dtype);
    switch (d.kind) {
    case BROADCAST: return r == d.root ? b : 0;
    case REDUCE_SCATTER:
    case ALL_TO_ALL: return b * n;
    case SCATTER: return r == d.root ? b * n : 0;
    case RECV: return 0;
    default: return b;
    }
}

/// Bytes rank `r`'s receive buffer must hold.
size_t recv_bytes(const Desc& d, int n, int r) {
    size_t b = d.count * type_size(d.dtype);
    switch (d.kind) {
    case REDUCE: return r == d.root ? b : 0;
    case ALL_GATHER:
    case ALL_TO_ALL: return b * n;
    case GATHER: return r == d.root ? b * n : 0;
    case SEND: return 0;
    default: return b;
    }
}

int check_buffer(Comm& c, const Desc& d, const char* which, const void* p, size_t bytes) {
    if (bytes == 0) return ncclSuccess;
    int owner;
    if (emu_rt::device_block(uintptr_t(p), bytes, c.dev, &owner)) return ncclSuccess;
    std::string what = owner < 0          ? "no device memory (a host pointer, or freed)"
                       : owner == c.dev   ? "an allocation shorter than that"
                                          : "memory of device " + std::to_string(owner);
    char range[80];
    snprintf(range, sizeof range, "[%p, +%zu bytes)", p, bytes);
    return fail_comm(c, ncclInvalidArgument,
                     call_text(d) + ": the " + which + " buffer " + range +
                         " is not inside one allocation of device " + std::to_string(c.dev) +
                         " (the communicator's): it is " + what);
}

int post_send(const Op& o) {
    Comm& c = *o.c;
    int peer = o.d.root;
    size_t bytes = o.d.count * type_size(o.d.dtype), off = c.p2p_fill;
    c.p2p_fill += (bytes + 63) / 64 * 64;
    if (!grow(c.p2p, c.p2p_fill, c.slots[c.rank].p2p_cap))
        return fail_comm(c, ncclSystemError, call_text(o.d) + ": cannot grow the staging memory");
    if (bytes) memcpy(c.p2p.map + off, o.send, bytes);
    Pair& p = c.pair(c.rank, peer);
    uint64_t idx = c.sent[peer];
    int rc = wait_peer(c, W_SPACE, peer, o.d, [&] {
        return idx - p.taken.load(std::memory_order_acquire) < uint64_t(QUEUE);
    });
    if (rc) return rc;
    p.q[idx % QUEUE] = Msg{off, o.d};
    p.sent.store(idx + 1, std::memory_order_release);
    c.sent[peer] = idx + 1;
    return ncclSuccess;
}

int take_recv(const Op& o) {
    Comm& c = *o.c;
    int src = o.d.root;
    Pair& p = c.pair(src, c.rank);
    uint64_t idx = c.taken[src];
    // A rank's sends to itself are posted before its receives: none there is none to come.
    if (src == c.rank && p.sent.load(std::memory_order_acquire) <= idx)
        return fail_comm(c, ncclInvalidUsage,
                         call_text(o.d) + ": a receive from this rank itself with no send to "
                                          "itself before it in the same group");
    int rc = wait_peer(c, W_RECV, src, o.d,
                       [&] { return p.sent.load(std::memory_order_acquire) > idx; });
    if (rc) return rc;
    Msg m = p.q[idx % QUEUE];
    if (m.desc.dtype != o.d.dtype || m.desc.count != o.d.count)
        return fail_comm(c, ncclInvalidUsage,
                         "a send meets a receive of another count or type: " +
                             call_text(m.desc) + " on rank " + std::to_string(src) + ", " +
                             call_text(o.d) + " on rank " + std::to_string(c.rank));
    size_t bytes = o.d.count * type_size(o.d.dtype);
    const char* from = src == c.rank ? c.p2p.map
                                     : peek(c.peer_p2p[src], m.offset + bytes,
                                            c.slots[src].p2p_cap);
    if (!from) return fail_comm(c, ncclSystemError, call_text(o.d) + ": cannot map the sender's data");
    if (bytes) memcpy(o.recv, from + m.offset, bytes);
    p.taken.store(idx + 1, std::memory_order_release);
    c.taken[src] = idx + 1;
    return ncclSuccess;
}

/// Writes rank `me`'s output of collective `d` from every rank's staged data.
void compute(Comm& c, const Desc& d, const std::vector<const char*>& src, void* recv) {
    int n = c.n, me = c.rank;
    size_t b = d.count * type_size(d.dtype);
    char* out = static_cast<char*>(recv);
    switch (d.kind) {
    case ALL_REDUCE:
    case REDUCE:
    case REDUCE_SCATTER: {
        if (d.kind == REDUCE && me != d.root) return;
        std::vector<const char*> parts(src);
        if (d.kind == REDUCE_SCATTER)
            for (auto& p : parts) p += me * b;
        if (b) reduce_tree(d.dtype, d.op, parts, 0, n, d.count, out);
        if (d.op == Avg) divide(d.dtype, out, d.count, n);
        return;
    }
    case BROADCAST: memcpy(out, src[d.root], b); return;
    case SCATTER: memcpy(out, src[d.root] + me * b, b); return;
    case ALL_GATHER:
    case GATHER:
        if (d.kind == GATHER && me != d.root) return;
        for (int k = 0; k < n; ++k) memcpy(out + k * b, src[k], b);
        return;
    case ALL_TO_ALL:
        for (int k = 0; k < n; ++k) memcpy(out + k * b, src[k] + me * b, b);
        return;
    }
}

int collective(const Op& o) {
    Comm& c = *o.c;
    const Desc& d = o.d;
    Slot& mine = c.slots[c.rank];
    uint64_t seq = ++c.seq;
    size_t stage = send_bytes(d, c.n, c.rank);
    if (!grow(c.coll, stage, mine.coll_cap))
        return fail_comm(c, ncclSystemError, call_text(d) + ": cannot grow the staging memory");
    if (stage) memcpy(c.coll.map, o.send, stage);
    mine.desc = d;
    mine.posted.store(seq, std::memory_order_release);
    if (int rc = wait_all(c, W_POST, seq, d)) return rc;
    for (int k = 1; k < c.n; ++k)
        if (!same_call(c.slots[k].desc, c.slots[0].desc))
            return fail_comm(c, ncclInvalidUsage,
                             "collective #" + std::to_string(seq) +
                                 " does not match across ranks: rank 0 called " +
                                 call_text(c.slots[0].desc) + ", rank " + std::to_string(k) +
                                 " called " + call_text(c.slots[k].desc));
    std::vector<const char*> src(c.n);
    for (int k = 0; k < c.n; ++k) {
        src[k] = k == c.rank ? c.coll.map
                             : peek(c.peer_coll[k], send_bytes(d, c.n, k), c.slots[k].coll_cap);
        if (!src[k])
            return fail_comm(c, ncclSystemError,
                             call_text(d) + ": cannot map rank " + std::to_string(k) + "'s data");
    }
    compute(c, d, src, o.recv);
    mine.done.store(seq, std::memory_order_release);
    return wait_all(c, W_DONE, seq, d);
}

/// Runs a group's calls: every send posted, the collectives in order, every receive, then
/// the wait until the peers took what was sent (the staging memory is reused next time).
int run(const std::vector<Op>& ops) {
    for (const Op& o : ops) {
        Comm& c = *o.c;
        int r = c.rank;
        if (int rc = check_buffer(c, o.d, "send", o.send, send_bytes(o.d, c.n, r))) return rc;
        if (int rc = check_buffer(c, o.d, "receive", o.recv, recv_bytes(o.d, c.n, r))) return rc;
        c.p2p_fill = 0;
    }
    for (const Op& o : ops)
        if (o.d.kind == SEND)
            if (int rc = post_send(o)) return rc;
    for (const Op& o : ops)
        if (o.d.kind != SEND && o.d.kind != RECV)
            if (int rc = collective(o)) return rc;
    for (const Op& o : ops)
        if (o.d.kind == RECV)
            if (int rc = take_recv(o)) return rc;
    for (const Op& o : ops) {
        if (o.d.kind != SEND) continue;
        Comm& c = *o.c;
        int peer = o.d.root;
        Pair& p = c.pair(c.rank, peer);
        uint64_t want = c.sent[peer];
        int rc = wait_peer(c, W_ACK, peer, o.d,
                           [&] { return p.taken.load(std::memory_order_acquire) >= want; });
        if (rc) return rc;
    }
    return ncclSuccess;
}

/// Checks a call's arguments and runs it, or keeps it for ncclGroupEnd inside a group.
int enqueue(void* comm, Desc d, const void* send, void* recv, void* stream) {
    // The call runs now, so the work queued before it on its stream runs first (and, through
    // that stream's event waits, whatever it waits for): stream order.
    if (emu_rt::drain_stream(stream)) {
        note(nullptr, std::string(call_name(d.kind)) + ": earlier work on its stream failed");
        return group_depth ? (group_error = ncclUnhandledCudaError) : ncclUnhandledCudaError;
    }
    auto* c = static_cast<Comm*>(comm);
    if (!c) {
        note(nullptr, std::string(call_name(d.kind)) + ": the communicator is null");
        return group_depth ? (group_error = ncclInvalidArgument) : ncclInvalidArgument;
    }
    if (!is_reduction(d.kind)) d.op = -1;
    if (!has_root(d.kind)) d.root = -1;
    int rc = ncclSuccess;
    if (c->error) {
        note(c, call_text(d) + ": the communicator failed earlier: " + c->last_error);
        rc = c->error;
    } else if (c->hdr->error.load(std::memory_order_acquire)) {
        rc = failed_before(*c, d);
    } else if (d.dtype < 0 || d.dtype >= NUM_DTYPES) {
        rc = fail_comm(*c, ncclInvalidArgument,
                       std::string(call_name(d.kind)) + ": data type " + std::to_string(d.dtype) +
                           " is not emulated (fp8 types are not)");
    } else if (is_reduction(d.kind) && (d.op < 0 || d.op >= NUM_OPS)) {
        rc = fail_comm(*c, ncclInvalidArgument,
                       std::string(call_name(d.kind)) + ": reduction " + std::to_string(d.op) +
                           " is not emulated (sum, prod, max, min and avg are)");
    } else if (has_root(d.kind) && (d.root < 0 || d.root >= c->n)) {
        rc = fail_comm(*c, ncclInvalidArgument,
                       call_text(d) + ": rank " + std::to_string(d.root) + " is not in 0.." +
                           std::to_string(c->n - 1));
    }
    if (rc) {
        if (group_depth) group_error = rc;
        return rc;
    }
    if (group_depth) {
        pending.push_back(Op{c, d, send, recv});
        return ncclSuccess;
    }
    return run({Op{c, d, send, recv}});
}

} // namespace

extern "C" {

int ncclAllReduce(const void* s, void* r, size_t count, int dtype, int op, void* comm,
                  void* st) {
    return enqueue(comm, Desc{ALL_REDUCE, dtype, op, -1, count}, s, r, st);
}
int ncclReduce(const void* s, void* r, size_t count, int dtype, int op, int root, void* comm,
               void* st) {
    return enqueue(comm, Desc{REDUCE, dtype, op, root, count}, s, r, st);
}
int ncclBroadcast(const void* s, void* r, size_t count, int dtype, int root, void* comm,
                  void* st) {
    return enqueue(comm, Desc{BROADCAST, dtype, -1, root, count}, s, r, st);
}
int ncclBcast(void* buf, size_t count, int dtype, int root, void* comm, void* stream) {
    return ncclBroadcast(buf, buf, count, dtype, root, comm, stream);
}
int ncclAllGather(const void* s, void* r, size_t count, int dtype, void* comm, void* st) {
    return enqueue(comm, Desc{ALL_GATHER, dtype, -1, -1, count}, s, r, st);
}
int ncclReduceScatter(const void* s, void* r, size_t count, int dtype, int op, void* comm,
                      void* st) {
    return enqueue(comm, Desc{REDUCE_SCATTER, dtype, op, -1, count}, s, r, st);
}
int ncclAlltoAll(const void* s, void* r, size_t count, int dtype, void* comm, void* st) {
    return enqueue(comm, Desc{ALL_TO_ALL, dtype, -1, -1, count}, s, r, st);
}
int ncclGather(const void* s, void* r, size_t count, int dtype, int root, void* comm,
               void* st) {
    return enqueue(comm, Desc{GATHER, dtype, -1, root, count}, s, r, st);
}
int ncclScatter(const void* s, void* r, size_t count, int dtype, int root, void* comm,
                void* st) {
    return enqueue(comm, Desc{SCATTER, dtype, -1, root, count}, s, r, st);
}
int ncclSend(const void* s, size_t count, int dtype, int peer, void* comm, void* st) {
    return enqueue(comm, Desc{SEND, dtype, -1, peer, count}, s, nullptr, st);
}
int ncclRecv(void* r, size_t count, int dtype, int peer, void* comm, void* st) {
    return enqueue(comm, Desc{RECV, dtype, -1, peer, count}, nullptr, r, st);
}

int ncclGroupStart() {
    if (group_depth++ == 0) {
        pending.clear();
        group_error = ncclSuccess;
    }
    return ncclSuccess;
}

int ncclGroupEnd() {
    if (group_depth == 0) {
        note(nullptr, "ncclGroupEnd without ncclGroupStart");
        return ncclInvalidUsage;
    }
    if (--group_depth > 0) return ncclSuccess;
    std::vector<Op> ops;
    ops.swap(pending);
    if (group_error) return group_error;
    return run(ops);
}

} // extern "C"

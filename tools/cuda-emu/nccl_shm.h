// The emulated NCCL's shared state: one POSIX shared-memory object per communicator (named
// from the random nonce in its unique id) that every rank maps, plus two staging objects per
// rank (collective and point-to-point data) that the other ranks read. Only nccl.cpp includes it.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace emu_nccl {

enum Result {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
};

// ncclDataType_t (NCCL 2.24+): fp8 types are not emulated.
enum Dtype { Int8, Uint8, Int32, Uint32, Int64, Uint64, Float16, Float32, Float64, Bfloat16 };
constexpr int NUM_DTYPES = 10;
enum RedOp { Sum, Prod, Max, Min, Avg };
constexpr int NUM_OPS = 5;

enum Kind : int32_t {
    NONE,
    ALL_REDUCE,
    REDUCE,
    BROADCAST,
    ALL_GATHER,
    REDUCE_SCATTER,
    ALL_TO_ALL,
    GATHER,
    SCATTER,
    SEND,
    RECV,
};

/// One call as the ranks compare it: `op` is -1 for calls that do not reduce, `root` the root
/// (or the peer of a send/recv) and -1 for calls without one, `count` the call's count argument.
struct Desc {
    int32_t kind;
    int32_t dtype;
    int32_t op;
    int32_t root;
    uint64_t count;
};

/// What a rank is blocked on, published so a peer can tell a deadlock from a slow rank.
enum WaitKind : int32_t {
    W_NONE,
    W_JOIN,  // every rank to join the communicator
    W_POST,  // every rank to post collective `seq`
    W_DONE,  // every rank to finish reading collective `seq`
    W_RECV,  // a message from `peer`
    W_ACK,   // `peer` to take our messages
    W_SPACE, // room in the queue to `peer`
};

/// Written by its own rank only.
struct Slot {
    std::atomic<int32_t> pid;
    std::atomic<int32_t> joined;
    std::atomic<uint64_t> posted; // the last collective whose data and Desc are published
    std::atomic<uint64_t> done;   // the last collective it finished reading
    Desc desc;                    // of collective `posted`
    std::atomic<uint64_t> coll_cap, p2p_cap; // bytes of its staging objects
    // Its current wait, under a sequence lock: odd `epoch` while the fields change.
    std::atomic<uint64_t> epoch;
    std::atomic<int32_t> wait_kind;
    std::atomic<int32_t> wait_peer;
    std::atomic<uint64_t> wait_seq;
    Desc wait_call;
};

constexpr int QUEUE = 64;

/// A message waiting in a queue: where its bytes lie in the sender's point-to-point staging.
struct Msg {
    uint64_t offset;
    Desc desc;
};

/// The queue from one rank to another: the sender advances `sent`, the receiver `taken`.
struct Pair {
    std::atomic<uint64_t> sent;
    std::atomic<uint64_t> taken;
    Msg q[QUEUE];
};

constexpr uint64_t MAGIC = 0x6363'6e6c'6165'6e6eull;

struct Header {
    std::atomic<uint64_t> magic;
    std::atomic<int32_t> nranks;
    std::atomic<int32_t> joined;
    std::atomic<int32_t> opened;
    std::atomic<int32_t> error;     // a Result once any rank failed the communicator
    std::atomic<int32_t> why_ready; // `why` is written
    char why[1024];
};

/// A staging object: its owner writes and grows it, peers map it read-only on demand.
struct Staging {
    int fd = -1;
    char* map = nullptr;
    size_t len = 0;
};

struct Comm {
    int rank = 0, n = 0, dev = 0;
    std::string name; // of the shared object, without the leading slash
    char* shm = nullptr;
    size_t shm_len = 0;
    Header* hdr = nullptr;
    Slot* slots = nullptr;
    Pair* pairs = nullptr; // [src * n + dst]
    Staging coll, p2p;
    std::vector<Staging> peer_coll, peer_p2p;
    uint64_t seq = 0;
    std::vector<uint64_t> sent, taken; // messages sent to / taken from each peer
    size_t p2p_fill = 0;               // bytes of the current group's sends
    int error = 0;
    std::string last_error;

    Pair& pair(int src, int dst) { return pairs[size_t(src) * n + dst]; }
};

// Defined in nccl.cpp, used by nccl_ops.cpp.
const char* call_name(int kind);
std::string call_text(const Desc& d);
bool same_call(const Desc& a, const Desc& b);
size_t type_size(int dtype);
/// Fails the communicator on every rank with `why` (printed on stderr); returns `code`.
int fail_comm(Comm& c, int code, const std::string& why);
/// The communicator already failed elsewhere: says so for `call` and returns the code.
int failed_before(Comm& c, const Desc& call);
void note(const Comm* c, const std::string& what);
bool grow(Staging& s, size_t bytes, std::atomic<uint64_t>& cap);
const char* peek(Staging& s, size_t bytes, const std::atomic<uint64_t>& cap);
/// Waits until every rank's `posted` (W_POST) or `done` (W_DONE) reached `seq`.
int wait_all(Comm& c, int kind, uint64_t seq, const Desc& call);
/// Waits on one peer (W_RECV, W_ACK, W_SPACE) until `ready()`.
int wait_peer(Comm& c, int kind, int peer, const Desc& call, const std::function<bool()>& ready);

} // namespace emu_nccl

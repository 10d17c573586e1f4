// What runtime.cpp (the emulated driver) shares with nccl.cpp (the emulated NCCL): both are
// compiled into the one library build.sh links under every name.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>

namespace emu_rt {

/// Held by every call that reads or changes the emulator's state.
extern std::recursive_mutex big_lock;

/// The device of the calling thread's current context (0 without one).
int current_device();

/// Whether [p, p + n) lies inside one live block of device `dev`. Otherwise `*owner` is the
/// device of the block `p` lies in, or -1 when `p` is no device memory at all.
bool device_block(uintptr_t p, size_t n, int dev, int* owner);

/// Whether [p, p + n) lies inside one live block that work on device `dev` may touch: one of
/// that device, or of a peer it enabled.
bool kernel_range(uintptr_t p, size_t n, int dev);

/// The device of stream `s` (the null stream: the current context's).
int stream_device(void* s);

/// One line on stderr, prefixed with the emulation's name.
void complain(const std::string& what);

/// Says [p, p + n) is not inside one allocation (of device `dev`, unless -1) and returns
/// CUDA_ERROR_ILLEGAL_ADDRESS.
int bad_range(const char* op, uintptr_t p, size_t n, int dev = -1);

/// Queues `op` on stream `stream` (runtime.cpp's "streams and events"): it runs when something
/// waits for that stream. The null stream runs every stream's queued work, then `op`, now.
/// Returns a sticky error of the device, or in eager mode `op`'s result.
int enqueue(void* stream, std::function<int()> op);

/// Runs the work queued on `stream` (the null stream: on every stream); a sticky error or 0.
int drain_stream(void* stream);

} // namespace emu_rt

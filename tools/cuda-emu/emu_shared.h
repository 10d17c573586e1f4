// What runtime.cpp (the emulated driver) shares with nccl.cpp (the emulated NCCL): both are
// compiled into the one library build.sh links under every name.
#pragma once
#include <cstddef>
#include <cstdint>
#include <mutex>

namespace emu_rt {

/// Held by every call that reads or changes the emulator's state.
extern std::recursive_mutex big_lock;

/// The device of the calling thread's current context (0 without one).
int current_device();

/// Whether [p, p + n) lies inside one live block of device `dev`. Otherwise `*owner` is the
/// device of the block `p` lies in, or -1 when `p` is no device memory at all.
bool device_block(uintptr_t p, size_t n, int dev, int* owner);

} // namespace emu_rt

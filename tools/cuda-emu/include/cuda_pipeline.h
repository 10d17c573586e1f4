// <cuda_pipeline.h> under CUDA emulation: the cp.async primitives with CUDA's names (the NVRTC
// side is host/engine/src/cuda/kernels/include/cuda_pipeline.h, inline PTX). A copy is queued
// by the thread that issues it and done when that thread waits for its batch (or exits), so a
// kernel that reads the destination before __pipeline_wait_prior sees the old values, every time.
// Sizes other than 4, 8 or 16 bytes, misaligned pointers, a source outside device memory or a
// destination inside it (it must be shared memory) fail the kernel.
#pragma once

inline void __pipeline_memcpy_async(void* __restrict__ dst_shared,
        const void* __restrict__ src_global, size_t size_and_align, size_t zfill = 0) {
    const char* op = "__pipeline_memcpy_async";
    size_t n = size_and_align;
    if (n != 4 && n != 8 && n != 16) emu::fault("%s: %zu bytes (4, 8 or 16 only)", op, n);
    if (zfill > n) emu::fault("%s: zfill %zu is over the %zu bytes", op, zfill, n);
    if ((uintptr_t)dst_shared % n || (uintptr_t)src_global % n)
        emu::fault("%s: %p and %p must be %zu-byte aligned", op, dst_shared, src_global, n);
    if (auto device = emu::g.is_device_ptr) {
        if (n > zfill && (!device(src_global) || !device((const char*)src_global + (n - zfill) - 1)))
            emu::fault("%s: the source %p is not device memory", op, src_global);
        if (device(dst_shared))
            emu::fault("%s: the destination %p is device memory, not shared memory", op,
                       dst_shared);
    }
    emu::Pipeline& pipe = emu::g.pipes[emu::g.current];
    pipe.pending.push_back(
        {dst_shared, src_global, (unsigned)n, (unsigned)zfill, pipe.committed});
}

inline void __pipeline_commit() { emu::g.pipes[emu::g.current].committed++; }

inline void __pipeline_wait_prior(size_t prior) {
    unsigned committed = emu::g.pipes[emu::g.current].committed;
    if (prior < committed) emu::pipeline_complete(committed - (unsigned)prior);
}

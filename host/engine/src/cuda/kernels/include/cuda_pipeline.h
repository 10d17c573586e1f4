// <cuda_pipeline.h> for NVRTC without the CUDA toolkit's headers: the pipeline primitives
// (cp.async, sm_80 and later) under CUDA's names, as inline PTX. Handed to NVRTC as an in-memory
// header by kernels.rs; the CUDA emulation has its own (tools/cuda-emu/include/cuda_pipeline.h).
//
// __pipeline_memcpy_async copies `size_and_align` bytes (4, 8 or 16; both pointers aligned to
// it) from global to shared memory in the background, the last `zfill` of them as zeros;
// __pipeline_commit closes the batch of copies this thread issued since the last commit, and
// __pipeline_wait_prior(n) waits until at most the `n` latest committed batches are in flight.
// The copied data is visible to the block after the wait and a __syncthreads.
#pragma once

__device__ inline void __pipeline_memcpy_async(void* __restrict__ dst_shared,
        const void* __restrict__ src_global, size_t size_and_align, size_t zfill = 0) {
    unsigned dst = (unsigned)__cvta_generic_to_shared(dst_shared);
    size_t src = __cvta_generic_to_global(src_global);
    unsigned src_bytes = (unsigned)(size_and_align - zfill);
    switch (size_and_align) {
    case 16:
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
        break;
    case 8:
        asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
        break;
    case 4:
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
        break;
    default:
        __trap();
    }
}

__device__ inline void __pipeline_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

__device__ inline void __pipeline_wait_prior(size_t prior) {
    switch (prior) {
    case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
    case 4: asm volatile("cp.async.wait_group 4;" ::: "memory"); break;
    case 5: asm volatile("cp.async.wait_group 5;" ::: "memory"); break;
    case 6: asm volatile("cp.async.wait_group 6;" ::: "memory"); break;
    case 7: asm volatile("cp.async.wait_group 7;" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 8;" ::: "memory"); break;
    }
}

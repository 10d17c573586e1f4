//! The compute and communication streams, events between them and the allocator's cross-stream
//! rule (`anneal_engine::streams`). Needs a GPU or the CPU's emulation of one (tools/cuda-emu,
//! whose streams run their work only when something waits for it, so a missing wait shows as
//! stale values every time); elsewhere each test prints SKIP, unless `ANNEAL_REQUIRE_CUDA=1`.
//! The checks that a *missing* wait or record goes wrong run on the emulation only (on a GPU
//! that is a race, not a certainty).
#![cfg(feature = "cuda")]

use anneal_engine::streams::{record_stream, synchronize_stream, Stream, StreamEvent};
use anneal_engine::{DType, Device, Tensor};
use std::sync::Mutex;

const GPU: Device = Device::Cuda(0);
const N: usize = 4096;

/// The tests share device 0's allocator and streams: one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// `Some(emulated)` when CUDA device 0 can run ops; else prints why not.
fn gpu_or_skip(test: &str) -> Option<bool> {
    match anneal_engine::cuda::probe(0) {
        Ok(info) => Some(
            info.name.contains("emulation")
                && std::env::var("ANNEAL_CUDA_EMU_STREAMS").as_deref() != Ok("eager"),
        ),
        Err(why) => {
            assert!(
                std::env::var("ANNEAL_REQUIRE_CUDA").as_deref() != Ok("1"),
                "ANNEAL_REQUIRE_CUDA=1 but {why}"
            );
            println!("SKIP {test}: {why}");
            None
        }
    }
}

fn ptr(t: &Tensor) -> u64 {
    t.cuda_ptr().expect("a contiguous GPU tensor").1
}

/// Queues a copy of `src` into `dst` (same size) on the communication stream: what a
/// collective reading `src` and writing `dst` does.
fn copy_on_comm(dst: &Tensor, src: &Tensor) {
    let comm = anneal_engine::cuda::comm_stream(0).expect("communication stream");
    let bytes = src.numel() * src.dtype().size_in_bytes();
    // SAFETY: both are live, contiguous f32 blocks of `bytes` on device 0; the callers keep
    // them (or record them on the stream) until the stream's work is done.
    unsafe {
        cudarc::driver::result::memcpy_dtod_async(ptr(dst), ptr(src), bytes, comm.cu_stream())
    }
    .expect("queued copy");
}

fn iota(scale: f32) -> Vec<f32> {
    (0..N).map(|i| i as f32 * scale).collect()
}

/// The first index where `got` and `want` differ in bits, if any.
fn first_difference(got: &[f32], want: &[f32]) -> Option<usize> {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .position(|(a, b)| a.to_bits() != b.to_bits())
}

/// Compute writes `y = factor x`; the communication stream copies `y` out. Returns what it
/// copied.
fn copy_after_compute(wait: bool, factor: f32) -> Vec<f32> {
    let x = Tensor::from_slice(&iota(1.0), &[N])
        .unwrap()
        .to_device(GPU)
        .unwrap();
    let out = Tensor::zeros_on(&[N], DType::F32, GPU).unwrap();
    anneal_engine::synchronize(GPU).unwrap();
    let y = x.mul_scalar(factor).unwrap(); // queued on the compute stream
    if wait {
        StreamEvent::record(GPU, Stream::Compute)
            .unwrap()
            .wait(Stream::Comm)
            .unwrap();
    }
    copy_on_comm(&out, &y);
    // The host waits for the communication stream alone (which, with the wait, first waits for
    // the product on the device).
    synchronize_stream(GPU, Stream::Comm).unwrap();
    let got = out.to_vec_f32();
    drop(y);
    got
}

#[test]
fn the_comm_stream_sees_compute_results_after_an_event_wait() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let Some(emulated) = gpu_or_skip("streams: event wait") else {
        return;
    };
    let got = copy_after_compute(true, 2.0);
    assert_eq!(first_difference(&got, &iota(2.0)), None, "bit for bit");
    if emulated {
        // Without the wait the copy runs before the product (`y`'s block then holds the last
        // call's values or fresh memory's): the test above would fail.
        let got = copy_after_compute(false, 3.0);
        assert!(
            first_difference(&got, &iota(3.0)).is_some(),
            "a missing wait must show"
        );
    }
}

/// The communication stream copies `a` out; `a` is dropped before that ran and compute then
/// allocates and fills a tensor of the same size. Returns (what the copy read, whether compute
/// got `a`'s block).
fn drop_while_comm_reads(record: bool) -> (Vec<f32>, bool) {
    let a = Tensor::from_slice(&iota(1.0), &[N])
        .unwrap()
        .to_device(GPU)
        .unwrap();
    let out = Tensor::zeros_on(&[N], DType::F32, GPU).unwrap();
    anneal_engine::synchronize(GPU).unwrap();
    StreamEvent::record(GPU, Stream::Compute)
        .unwrap()
        .wait(Stream::Comm)
        .unwrap();
    copy_on_comm(&out, &a);
    record_stream(&out, Stream::Comm).unwrap();
    if record {
        record_stream(&a, Stream::Comm).unwrap();
    }
    let old = ptr(&a);
    drop(a);
    // Compute's next tensor of that size, filled, and compute's queue run before the copy's
    // (uploads do not wait for the device, so the wait is explicit).
    let b = Tensor::from_slice(&vec![-1.0f32; N], &[N])
        .unwrap()
        .to_device(GPU)
        .unwrap();
    synchronize_stream(GPU, Stream::Compute).unwrap();
    let reused = ptr(&b) == old;
    synchronize_stream(GPU, Stream::Comm).unwrap();
    let got = out.to_vec_f32();
    drop(b);
    (got, reused)
}

#[test]
fn a_block_recorded_on_the_comm_stream_is_not_reused_before_its_work_is_done() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let Some(emulated) = gpu_or_skip("streams: record_stream") else {
        return;
    };
    let (got, reused) = drop_while_comm_reads(true);
    assert_eq!(first_difference(&got, &iota(1.0)), None, "bit for bit");
    if emulated {
        // The copy was still queued when compute allocated (elsewhere it may have finished,
        // and then the block may be reused).
        assert!(
            !reused,
            "the block was handed out while the copy still reads it"
        );
        // Without the record compute gets the block at once and overwrites it first.
        let (got, reused) = drop_while_comm_reads(false);
        assert!(reused, "same size, same stream: the cached block");
        assert!(
            first_difference(&got, &iota(1.0)).is_some(),
            "a missing record_stream must show"
        );
    }
    // Once the communication stream's work is done the block is cached again: no growth.
    drop_while_comm_reads(true);
    synchronize_stream(GPU, Stream::Comm).unwrap();
    let before = anneal_engine::cuda::memory_stats(0).unwrap().reserved;
    for _ in 0..3 {
        drop_while_comm_reads(true);
        synchronize_stream(GPU, Stream::Comm).unwrap();
    }
    let after = anneal_engine::cuda::memory_stats(0).unwrap().reserved;
    assert_eq!(before, after, "pending blocks came back to the cache");
}

#[test]
fn streams_and_events_are_no_ops_on_the_cpu() {
    let ev = StreamEvent::record(Device::Cpu, Stream::Compute).unwrap();
    ev.wait(Stream::Comm).unwrap();
    ev.synchronize().unwrap();
    assert!(ev.is_complete().unwrap());
    let t = Tensor::ones(&[3], DType::F32);
    record_stream(&t, Stream::Comm).unwrap();
    synchronize_stream(Device::Cpu, Stream::Comm).unwrap();
    anneal_engine::streams::wait_stream(Device::Cpu, Stream::Compute, Stream::Comm).unwrap();
}

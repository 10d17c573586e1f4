//! The emulated NCCL (tools/cuda-emu) when a peer process dies: two plain processes (this test
//! and a child of it, no MPI) join a communicator, the child exits, and the parent's all-reduce
//! fails naming the exited rank instead of waiting forever. Runs only on the emulation (real
//! NCCL would wait); skipped elsewhere.

#![cfg(feature = "nccl")]

use cudarc::driver::{CudaContext, DevicePtrMut};
use cudarc::nccl::{result, sys};
use std::process::Command;

/// Set in the child's environment to the unique id, as hex.
const CHILD_ENV: &str = "ANNEAL_NCCL_EXIT_CHILD";

fn emulated() -> bool {
    if let Some(why) = anneal_dist::nccl::unavailable() {
        assert!(
            std::env::var("ANNEAL_REQUIRE_CUDA").as_deref() != Ok("1"),
            "ANNEAL_REQUIRE_CUDA=1 but NCCL is unavailable: {why}"
        );
        println!("SKIP: NCCL is unavailable here: {why}");
        return false;
    }
    let name = CudaContext::new(0).and_then(|c| c.name());
    name.as_deref().is_ok_and(|n| n.contains("emulation"))
}

fn join(id: sys::ncclUniqueId, rank: i32) -> sys::ncclComm_t {
    let ctx = CudaContext::new(0).unwrap();
    ctx.bind_to_thread().unwrap();
    let mut comm = std::mem::MaybeUninit::uninit();
    // SAFETY: `comm` is read only after a successful init.
    unsafe {
        result::comm_init_rank(comm.as_mut_ptr(), 2, id, rank).unwrap();
        comm.assume_init()
    }
}

/// Rank 1: joins, then exits without taking part in anything.
#[test]
fn peer_child() {
    let Ok(hex) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mut internal = [0 as std::ffi::c_char; 128];
    for (i, b) in internal.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap() as std::ffi::c_char;
    }
    let _comm = join(sys::ncclUniqueId { internal }, 1);
    std::process::exit(0);
}

#[test]
fn a_peer_that_exited_fails_the_call_instead_of_hanging() {
    if std::env::var_os(CHILD_ENV).is_some() || !emulated() {
        return;
    }
    let id = result::get_uniqueid().unwrap();
    let hex: String = id
        .internal
        .iter()
        .map(|&b| format!("{:02x}", b as u8))
        .collect();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "peer_child", "--nocapture"])
        .env(CHILD_ENV, hex)
        .spawn()
        .unwrap();
    let comm = join(id, 0);
    let stream = CudaContext::new(0).unwrap().default_stream();
    let mut buf = stream.alloc_zeros::<f32>(4).unwrap();
    let (p, _p) = buf.device_ptr_mut(&stream);
    let ptr = p as usize as *mut std::ffi::c_void;
    // SAFETY: 4 floats on the communicator's device, in place.
    let r = unsafe {
        result::all_reduce(
            ptr,
            ptr,
            4,
            sys::ncclDataType_t::ncclFloat32,
            sys::ncclRedOp_t::ncclSum,
            comm,
            stream.cu_stream() as sys::cudaStream_t,
        )
    };
    assert!(r.is_err(), "an all-reduce with a rank that exited");
    // SAFETY: the communicator is live; the message is NCCL's C string.
    let last = unsafe { std::ffi::CStr::from_ptr(sys::ncclGetLastError(comm)) }
        .to_string_lossy()
        .into_owned();
    assert!(last.contains("rank 1") && last.contains("exited"), "{last}");
    assert!(child.wait().unwrap().success());
    // SAFETY: destroyed once.
    unsafe { result::comm_destroy(comm).unwrap() };
}

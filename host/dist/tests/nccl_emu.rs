//! The emulated NCCL (tools/cuda-emu) driven directly by two plain processes (this test and a
//! child of it, no MPI): the element types and reductions the `Collective` trait does not use
//! (f16 rounding after each addition, integer max and wrapping products, f64 min, i64 average),
//! and a peer that exits, which fails the other's call naming it instead of waiting forever.
//! Runs only on the emulation (real NCCL would wait for the dead peer); skipped elsewhere.

#![cfg(feature = "nccl")]

use cudarc::driver::{CudaContext, DevicePtrMut};
use cudarc::nccl::{result, sys};
use std::process::Command;

/// Set in the child's environment to the unique id, as hex.
const CHILD_ENV: &str = "ANNEAL_NCCL_EXIT_CHILD";
/// Set in the child's environment to the unique id, as hex: the child runs `reductions`.
const OPS_ENV: &str = "ANNEAL_NCCL_OPS_CHILD";

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

fn id_from_hex(hex: &str) -> sys::ncclUniqueId {
    let mut internal = [0 as std::ffi::c_char; 128];
    for (i, b) in internal.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap() as std::ffi::c_char;
    }
    sys::ncclUniqueId { internal }
}

fn id_to_hex(id: &sys::ncclUniqueId) -> String {
    id.internal
        .iter()
        .map(|&b| format!("{:02x}", b as u8))
        .collect()
}

/// Rank 1: joins, then exits without taking part in anything.
#[test]
fn peer_child() {
    let Ok(hex) = std::env::var(CHILD_ENV) else {
        return;
    };
    let _comm = join(id_from_hex(&hex), 1);
    std::process::exit(0);
}

/// All-reduces `values` (this rank's) of type `t` with `op` in place on the device.
fn all_reduce<T: cudarc::driver::DeviceRepr + Copy + Default>(
    comm: sys::ncclComm_t,
    values: &[T],
    t: sys::ncclDataType_t,
    op: sys::ncclRedOp_t,
) -> Vec<T> {
    let stream = CudaContext::new(0).unwrap().default_stream();
    let mut buf = stream.clone_htod(values).unwrap();
    {
        let (p, _p) = buf.device_ptr_mut(&stream);
        let ptr = p as usize as *mut std::ffi::c_void;
        let s = stream.cu_stream() as sys::cudaStream_t;
        // SAFETY: `values.len()` elements of `t` on the communicator's device, in place.
        unsafe { result::all_reduce(ptr, ptr, values.len(), t, op, comm, s) }.unwrap();
    }
    stream.clone_dtoh(&buf).unwrap()
}

/// Both ranks: each reduction checked against the values worked out by hand.
fn reductions(comm: sys::ncclComm_t, rank: usize) {
    use sys::ncclDataType_t as T;
    use sys::ncclRedOp_t as Op;
    // f16, rounded after the addition: 1.5 + 0.25, 65504 + 65504 (to infinity),
    // 1024 + 1 (exact), 2048 + 1 (a tie, to even: 2048).
    let h: [[u16; 4]; 2] = [
        [0x3e00, 0x7bff, 0x6400, 0x6800],
        [0x3400, 0x7bff, 0x3c00, 0x3c00],
    ];
    let got = all_reduce(comm, &h[rank], T::ncclFloat16, Op::ncclSum);
    assert_eq!(got, [0x3f00, 0x7c00, 0x6401, 0x6800], "f16 sum");
    let i: [[i32; 3]; 2] = [[-3, 7, i32::MIN], [2, -9, 0]];
    assert_eq!(
        all_reduce(comm, &i[rank], T::ncclInt32, Op::ncclMax),
        [2, 7, 0],
        "i32 max"
    );
    let b: [[u8; 2]; 2] = [[16, 3], [16, 5]];
    assert_eq!(
        all_reduce(comm, &b[rank], T::ncclUint8, Op::ncclProd),
        [0, 15],
        "u8 product wraps"
    );
    let d: [[f64; 2]; 2] = [[0.5, -1e300], [0.25, 1.0]];
    assert_eq!(
        all_reduce(comm, &d[rank], T::ncclFloat64, Op::ncclMin),
        [0.25, -1e300],
        "f64 min"
    );
    let l: [[i64; 2]; 2] = [[10, 1 << 40], [20, 1 << 40]];
    assert_eq!(
        all_reduce(comm, &l[rank], T::ncclInt64, Op::ncclAvg),
        [15, 1 << 40],
        "i64 avg"
    );
}

/// Rank 1 of `element_types_and_reductions`.
#[test]
fn ops_child() {
    let Ok(hex) = std::env::var(OPS_ENV) else {
        return;
    };
    let comm = join(id_from_hex(&hex), 1);
    reductions(comm, 1);
    // SAFETY: destroyed once.
    unsafe { result::comm_destroy(comm).unwrap() };
}

#[test]
fn element_types_and_reductions() {
    if std::env::var_os(CHILD_ENV).is_some() || std::env::var_os(OPS_ENV).is_some() || !emulated() {
        return;
    }
    let id = result::get_uniqueid().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "ops_child", "--nocapture"])
        .env(OPS_ENV, id_to_hex(&id))
        .spawn()
        .unwrap();
    let comm = join(id, 0);
    reductions(comm, 0);
    // SAFETY: destroyed once.
    unsafe { result::comm_destroy(comm).unwrap() };
    assert!(child.wait().unwrap().success(), "rank 1's checks");
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

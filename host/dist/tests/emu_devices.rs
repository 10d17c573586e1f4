//! The CUDA emulation's several devices (tools/cuda-emu), which NCCL ranks of one machine rely
//! on (`cuda:{local rank}`): each device has its own context and memory, and a kernel on one
//! device refuses another device's memory as it refuses a host pointer. Runs only on the
//! emulation (on a GPU that would be a sticky fault); skipped elsewhere.

use cudarc::driver::{CudaContext, CudaSlice, LaunchConfig, PushKernelArg};
use std::process::Command;

const FILL: &str = r#"
extern "C" __global__ void fill(float* p, float v, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] = v;
}
"#;

/// Set in a child's environment: `device_count_child` reports the count there.
const CHILD_ENV: &str = "ANNEAL_EMU_DEVICES_CHILD";

fn emulated() -> bool {
    // SAFETY: only tries to open the library by name.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        assert!(
            std::env::var("ANNEAL_REQUIRE_CUDA").as_deref() != Ok("1"),
            "ANNEAL_REQUIRE_CUDA=1 but there is no CUDA driver library"
        );
        println!("SKIP: no CUDA driver library here");
        return false;
    }
    let name = CudaContext::new(0).and_then(|c| c.name());
    let yes = name.as_deref().is_ok_and(|n| n.contains("emulation"));
    if !yes {
        println!("SKIP: the CUDA driver is not the emulation ({name:?})");
    }
    yes
}

#[test]
fn a_kernel_refuses_memory_of_another_device() {
    if std::env::var_os(CHILD_ENV).is_some() || !emulated() {
        return;
    }
    assert!(
        CudaContext::device_count().unwrap() >= 2,
        "two devices by default"
    );
    let ptx = cudarc::nvrtc::compile_ptx(FILL).unwrap();
    let (c0, c1) = (CudaContext::new(0).unwrap(), CudaContext::new(1).unwrap());
    assert_eq!((c0.ordinal(), c1.ordinal()), (0, 1));
    let (s0, s1) = (c0.default_stream(), c1.default_stream());
    let f0 = c0
        .load_module(ptx.clone())
        .unwrap()
        .load_function("fill")
        .unwrap();
    let f1 = c1.load_module(ptx).unwrap().load_function("fill").unwrap();
    let mut on0: CudaSlice<f32> = s0.alloc_zeros(8).unwrap();
    let cfg = LaunchConfig::for_num_elems(8);
    let n = 8i32;
    // SAFETY: fill writes n floats of a buffer of n.
    unsafe {
        s0.launch_builder(&f0)
            .arg(&mut on0)
            .arg(&2.5f32)
            .arg(&n)
            .launch(cfg)
    }
    .unwrap();
    assert_eq!(s0.clone_dtoh(&on0).unwrap(), vec![2.5f32; 8]);
    // The same buffer for a kernel on device 1: refused, the memory untouched.
    // SAFETY: the emulation checks every pointer argument before the kernel runs.
    let err = unsafe {
        s1.launch_builder(&f1)
            .arg(&mut on0)
            .arg(&7.0f32)
            .arg(&n)
            .launch(cfg)
    };
    assert!(
        err.is_err(),
        "device 0's memory used by a kernel on device 1"
    );
    assert_eq!(s0.clone_dtoh(&on0).unwrap(), vec![2.5f32; 8]);
    // Device 1's own memory is fine.
    let mut on1: CudaSlice<f32> = s1.alloc_zeros(8).unwrap();
    // SAFETY: as above.
    unsafe {
        s1.launch_builder(&f1)
            .arg(&mut on1)
            .arg(&7.0f32)
            .arg(&n)
            .launch(cfg)
    }
    .unwrap();
    assert_eq!(s1.clone_dtoh(&on1).unwrap(), vec![7.0f32; 8]);
}

/// Runs on its own under `CHILD_ENV` (a no-op in a plain `cargo test`).
#[test]
fn device_count_child() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    match CudaContext::device_count() {
        Ok(n) => println!("devices: {n}"),
        Err(e) => println!("device count failed: {e}"),
    }
}

fn child_with(devices: &str) -> (String, String) {
    let exe = std::env::current_exe().unwrap();
    let out = Command::new(exe)
        .args(["--exact", "device_count_child", "--nocapture"])
        .env(CHILD_ENV, "1")
        .env("ANNEAL_CUDA_EMU_DEVICES", devices)
        .output()
        .unwrap();
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_device_count_comes_from_the_environment() {
    if std::env::var_os(CHILD_ENV).is_some() || !emulated() {
        return;
    }
    let (out, _) = child_with("3");
    assert!(out.contains("devices: 3"), "{out}");
    let (out, err) = child_with("lots");
    assert!(out.contains("device count failed"), "{out}");
    assert!(err.contains("ANNEAL_CUDA_EMU_DEVICES = \"lots\""), "{err}");
}

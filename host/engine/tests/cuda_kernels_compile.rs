//! Compiles every CUDA kernel source with NVRTC to PTX for sm_80 (A100) and sm_90 (H100/H200),
//! and assembles the PTX with `ptxas` where it is found, so a syntax, type or register error
//! fails without a GPU. Needs only libnvrtc (and ptxas): `scripts/setup-cuda-tools.sh` installs
//! both from PyPI, and `scripts/cuda-tools-env.sh` puts them on the paths. Without them the test
//! prints SKIP with the reason, unless `ANNEAL_REQUIRE_CUDA_TOOLS=1` (set by scripts/test.sh,
//! so CI really compiles), where their absence fails.
#![cfg(feature = "cuda")]

use anneal_engine::cuda::kernels::{compile_ptx, KERNELS};
use std::path::PathBuf;
use std::process::Command;

const ARCHS: [&str; 2] = ["sm_80", "sm_90"];

fn required() -> bool {
    std::env::var("ANNEAL_REQUIRE_CUDA_TOOLS").is_ok_and(|v| v == "1")
}

/// `ptxas` from `ANNEAL_PTXAS`, else from `PATH`.
fn ptxas() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("ANNEAL_PTXAS") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("ptxas"))
        .find(|p| p.is_file())
}

#[test]
fn every_kernel_compiles_to_ptx_and_assembles() {
    if !anneal_engine::cuda::nvrtc_present() {
        let why = "NVRTC (libnvrtc.so) not found; run scripts/setup-cuda-tools.sh and \
                   `source scripts/cuda-tools-env.sh`";
        assert!(!required(), "ANNEAL_REQUIRE_CUDA_TOOLS=1 but {why}");
        println!("SKIP cuda_kernels_compile: {why}");
        return;
    }
    let ptxas = ptxas();
    if ptxas.is_none() {
        assert!(
            !required(),
            "ANNEAL_REQUIRE_CUDA_TOOLS=1 but ptxas was not found"
        );
        println!("ptxas not found (ANNEAL_PTXAS or PATH): PTX is compiled but not assembled");
    }
    let dir = std::env::temp_dir().join(format!("anneal-ptx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let mut failures = Vec::new();
    for k in KERNELS {
        for arch in ARCHS {
            let ptx = match compile_ptx(k, arch) {
                Ok(p) => p,
                Err(e) => {
                    failures.push(e.to_string());
                    continue;
                }
            };
            assert!(
                ptx.contains(".entry"),
                "{} for {arch}: no kernel entry in the PTX",
                k.name
            );
            let Some(ptxas) = &ptxas else { continue };
            let src = dir.join(format!("{}_{arch}.ptx", k.name));
            std::fs::write(&src, &ptx).expect("write ptx");
            let out = Command::new(ptxas)
                .arg(format!("-arch={arch}"))
                .arg("-Werror")
                .arg(&src)
                .arg("-o")
                .arg(dir.join(format!("{}_{arch}.cubin", k.name)))
                .output()
                .expect("ptxas runs");
            if !out.status.success() {
                failures.push(format!(
                    "ptxas {} for {arch}: {}",
                    k.name,
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
        }
        println!("compiled {} for {ARCHS:?}", k.name);
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        failures.is_empty(),
        "kernels failed to build:\n{}",
        failures.join("\n")
    );
}

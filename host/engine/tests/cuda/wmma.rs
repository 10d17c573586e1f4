//! The tensor-core (wmma) product against the CPU (part of the `cuda_ops` test binary): bf16
//! operands, f32 accumulation, within 1e-5 of the largest value of an f32 product over k in
//! order of the same bf16 values, with `b` row-major and column-major. Under the CUDA
//! emulation this runs the wmma fragments and cp.async pipeline of tools/cuda-emu/include/.

use super::*;
use anneal_engine::cuda::wmma::{matmul_bf16, BLayout};

/// Values rounded to bf16 (on the CPU), `shape` row-major.
fn bf16_rand(shape: &[usize], seed: u64) -> Tensor {
    rand(shape, seed).to_dtype(DType::BF16).expect("bf16")
}

/// `a [m, k] · b [k, n]` in f32 on the CPU, k in order, from the operands' bf16 values.
fn reference(a: &Tensor, b: &Tensor) -> Tensor {
    let (m, k, n) = (a.shape()[0], a.shape()[1], b.shape()[1]);
    let (av, bv) = (a.to_vec_f32(), b.to_vec_f32());
    let mut c = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut s = 0f32;
            for kk in 0..k {
                s += av[i * k + kk] * bv[kk * n + j];
            }
            c[i * n + j] = s;
        }
    }
    Tensor::from_vec(c, &[m, n]).expect("sized")
}

#[test]
fn wmma_matmul_matches_an_f32_product_of_the_same_bf16_values() {
    if !gpu_or_skip("wmma_matmul_matches_an_f32_product_of_the_same_bf16_values") {
        return;
    }
    // One tile; tiles past m or n in a block (48 × 80); several k slices (208 = 13 · 16).
    for (i, (m, n, k)) in [(16, 16, 16), (48, 80, 64), (64, 32, 48), (96, 112, 208)]
        .into_iter()
        .enumerate()
    {
        let seed = 300 + 2 * i as u64;
        let (a, b) = (bf16_rand(&[m, k], seed), bf16_rand(&[k, n], seed + 1));
        let want = reference(&a, &b);
        let what = format!("wmma {m}x{k} · {k}x{n}");
        let got = matmul_bf16(&gpu(&a), &gpu(&b), BLayout::RowMajor).expect("row-major b");
        assert_eq!(got.dtype(), DType::F32, "{what}: f32 out");
        close(&format!("{what} (b row-major)"), &got, &want, 1e-5);
        let bt = b.transpose(0, 1).expect("view").contiguous().expect("copy");
        let got = matmul_bf16(&gpu(&a), &gpu(&bt), BLayout::ColMajor).expect("column-major b");
        close(&format!("{what} (b column-major)"), &got, &want, 1e-5);
    }
}

#[test]
fn wmma_matmul_takes_views_and_refuses_what_it_cannot_hold() {
    if !gpu_or_skip("wmma_matmul_takes_views_and_refuses_what_it_cannot_hold") {
        return;
    }
    let (m, n, k) = (32, 48, 32);
    let (a, b) = (bf16_rand(&[m, k], 320), bf16_rand(&[k, n], 321));
    let want = reference(&a, &b);
    // A contiguous view 8 elements (16 bytes) into its storage is not 32-byte aligned, and a
    // transposed view is not contiguous: both are copied, not misread.
    let flat = bf16_rand(&[8 + m * k], 322);
    let shifted = gpu(&flat)
        .narrow(0, 8, m * k)
        .expect("view")
        .reshape(&[m, k])
        .expect("view");
    let a_shifted = flat
        .narrow(0, 8, m * k)
        .expect("view")
        .reshape(&[m, k])
        .expect("view");
    close(
        "wmma with an unaligned a",
        &matmul_bf16(&shifted, &gpu(&b), BLayout::RowMajor).expect("shifted a"),
        &reference(&a_shifted, &b),
        1e-5,
    );
    let b_view = gpu(&b.transpose(0, 1).expect("view").contiguous().expect("copy"))
        .transpose(0, 1)
        .expect("view");
    close(
        "wmma with a transposed view as b",
        &matmul_bf16(&gpu(&a), &b_view, BLayout::RowMajor).expect("strided b"),
        &want,
        1e-5,
    );
    let err = |r: anneal_engine::Result<Tensor>| r.expect_err("refused").to_string();
    let odd = gpu(&bf16_rand(&[24, 32], 323));
    assert!(
        err(matmul_bf16(&odd, &gpu(&b), BLayout::RowMajor)).contains("multiples of 16"),
        "a dim that is not a multiple of 16"
    );
    let f32_a = gpu(&rand(&[m, k], 324));
    assert!(
        err(matmul_bf16(&f32_a, &gpu(&b), BLayout::RowMajor)).contains("bf16"),
        "f32 operands"
    );
    assert!(
        err(matmul_bf16(&gpu(&a), &gpu(&b), BLayout::ColMajor)).contains("multiples of 16"),
        "b [k, n] passed as column-major [n, k] with n != k"
    );
}

/// Kernels that break the rule that a warp-collective call is made by every lane of a full warp
/// with the same arguments, by [`misuse_child`]'s case name, and what the emulation must say.
const MISUSE: [(&str, u32, &str); 4] = [
    (
        "diverged",
        32,
        "lane 16 of the warp is at a warp shuffle meanwhile",
    ),
    ("partial", 48, "only 16 lanes of warp 1 are running"),
    ("pointers", 32, "every lane of the warp must pass the same"),
    (
        "deadlock",
        64,
        "thread 0 waits at wmma::load_matrix_sync, thread 16 at __syncthreads",
    ),
];

const MISUSE_SRC: &str = r#"
#include <mma.h>
using namespace nvcuda;
typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> A;
extern "C" __global__ void diverged(const __nv_bfloat16* a, float* out) {
    A f;
    if (threadIdx.x % 32 < 16) wmma::load_matrix_sync(f, a, 16);
    else out[threadIdx.x] = __shfl_sync(0xffffffffu, 1.0f, 0);
}
extern "C" __global__ void partial(const __nv_bfloat16* a, float* out) {
    A f;
    wmma::load_matrix_sync(f, a, 16);
}
extern "C" __global__ void pointers(const __nv_bfloat16* a, float* out) {
    A f;
    wmma::load_matrix_sync(f, a + (threadIdx.x == 5 ? 16 : 0), 16);
}
extern "C" __global__ void deadlock(const __nv_bfloat16* a, float* out) {
    A f;
    if (threadIdx.x < 16) wmma::load_matrix_sync(f, a, 16);
    else __syncthreads();
}
"#;

/// Under the CUDA emulation, a kernel that misuses the wmma API fails its launch with a message
/// naming the lanes, as a diverged barrier does (on a GPU it is undefined: this test skips).
/// Each case runs in a child process, since a failed launch leaves the device's error sticky.
#[test]
fn wmma_misuse_fails_the_kernel_under_emulation() {
    let test = "wmma_misuse_fails_the_kernel_under_emulation";
    if !gpu_or_skip(test) {
        return;
    }
    let info = anneal_engine::cuda::probe(0).expect("probed");
    if !info.name.contains("emulation") {
        println!(
            "SKIP {test}: {} is a GPU, where misuse is undefined",
            info.name
        );
        return;
    }
    let exe = std::env::current_exe().expect("test binary");
    for (case, _, says) in MISUSE {
        let out = std::process::Command::new(&exe)
            .args(["--exact", "wmma::misuse_child", "--ignored", "--nocapture"])
            .env("ANNEAL_WMMA_MISUSE", case)
            .output()
            .expect("runs the child");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!out.status.success(), "{case}: the launch passed:\n{text}");
        assert!(
            text.contains(&format!("kernel {case}: block (0, 0, 0)")) && text.contains(says),
            "{case}: expected the kernel's error to say {says:?}:\n{text}"
        );
    }
}

/// The child of [`wmma_misuse_fails_the_kernel_under_emulation`]: launches the case named by
/// `ANNEAL_WMMA_MISUSE` and expects it to succeed (so the child fails when the emulation
/// reports the misuse). Without the variable it does nothing.
#[test]
#[ignore = "run by wmma_misuse_fails_the_kernel_under_emulation in a child process"]
fn misuse_child() {
    use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
    let Ok(case) = std::env::var("ANNEAL_WMMA_MISUSE") else {
        return;
    };
    let (name, threads, _) = MISUSE
        .into_iter()
        .find(|(n, _, _)| *n == case)
        .expect("a known case");
    let ctx = CudaContext::new(0).expect("context");
    let ptx = cudarc::nvrtc::compile_ptx(MISUSE_SRC).expect("compiles");
    let module = ctx.load_module(ptx).expect("module");
    let f = module.load_function(name).expect("kernel");
    let stream = ctx.new_stream().expect("stream");
    let a = stream.alloc_zeros::<u16>(1024).expect("a");
    let out = stream.alloc_zeros::<f32>(64).expect("out");
    let mut b = stream.launch_builder(&f);
    b.arg(&a).arg(&out);
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: both buffers are live device memory larger than the kernels index.
    unsafe { b.launch(cfg) }.expect("launch queued");
    stream.synchronize().expect("the kernel ran");
}

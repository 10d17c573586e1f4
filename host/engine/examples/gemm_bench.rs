//! Matrix products at the debug Llama's training shapes: Anneal's `matmul` (the packed
//! AVX-512 kernel where the CPU has it) against the `gemm` crate called directly, alternating
//! in one process. Reports GFLOP/s by wall time and by CPU time (the process's on-CPU time, so
//! the figure holds up on a busy machine; run it single-threaded for that).
//!
//!   RAYON_NUM_THREADS=1 cargo run --release -p anneal-engine --example gemm_bench [filter]
//!
//! Output: one tab-separated line per row: `name  flop  anneal_s  gemm_s  anneal_cpu_s  gemm_cpu_s`.

use anneal_engine::rng::RngKey;
use anneal_engine::{DType, Tensor};
use std::time::Instant;

fn randn(shape: &[usize], name: &str) -> Tensor {
    Tensor::rand_normal(shape, 0.0, 1.0, &RngKey::new(7, name), 0, DType::F32).expect("valid shape")
}

/// Nanoseconds all threads of this process have run (from /proc; 0 where unavailable).
fn cpu_ns() -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    dir.flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// `c = a @ b` through the `gemm` crate (strided operands read in place, as before).
#[allow(clippy::too_many_arguments)]
fn gemm_crate(
    a: &[f32],
    (ars, acs): (usize, usize),
    b: &[f32],
    (brs, bcs): (usize, usize),
    c: &mut [f32],
    m: usize,
    k: usize,
    n: usize,
) {
    let threads = rayon::current_num_threads();
    let par = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the operands are dense m×k and k×n matrices with the given strides.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            acs as isize,
            ars as isize,
            b.as_ptr(),
            bcs as isize,
            brs as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
}

fn main() -> anneal_engine::Result<()> {
    let reps: usize = std::env::var("BENCH_REPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let only = std::env::args().nth(1);
    // (m, k, n, a transposed, b transposed): C = A·B as the training step runs them.
    let rows = [
        (2048, 256, 1024, false, true),
        (2048, 1024, 256, false, true),
        (2048, 256, 8192, false, true),
        (2048, 1024, 256, false, false),
        (2048, 256, 1024, false, false),
        (2048, 8192, 256, false, false),
        (256, 2048, 1024, true, false),
        (1024, 2048, 256, true, false),
        (256, 2048, 8192, true, false),
        (1024, 2048, 256, false, true),
    ];
    for (m, k, n, at, bt) in rows {
        let name = format!(
            "{m}x{k}x{n} a={} b={}",
            if at { "t" } else { "n" },
            if bt { "t" } else { "n" }
        );
        if only.as_deref().is_some_and(|o| !name.contains(o)) {
            continue;
        }
        let a = if at {
            randn(&[k, m], "a").transpose(0, 1)?
        } else {
            randn(&[m, k], "a")
        };
        let b = if bt {
            randn(&[n, k], "b").transpose(0, 1)?
        } else {
            randn(&[k, n], "b")
        };
        let av = a.contiguous()?.to_vec_f32();
        let bv = b.contiguous()?.to_vec_f32();
        let (ad, astr) = if at {
            (a.transpose(0, 1)?.to_vec_f32(), (1, m))
        } else {
            (av, (k, 1))
        };
        let (bd, bstr) = if bt {
            (b.transpose(0, 1)?.to_vec_f32(), (1, k))
        } else {
            (bv, (n, 1))
        };
        let mut c = vec![0f32; m * n];
        let flop = 2.0 * (m * k * n) as f64;
        let (mut ta, mut tg, mut ca, mut cg) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for rep in 0..reps + 2 {
            let (c0, t0) = (cpu_ns(), Instant::now());
            std::hint::black_box(a.matmul(&b)?);
            let (c1, t1) = (cpu_ns(), Instant::now());
            gemm_crate(&ad, astr, &bd, bstr, &mut c, m, k, n);
            std::hint::black_box(&c);
            let (c2, t2) = (cpu_ns(), Instant::now());
            if rep >= 2 {
                ta.push((t1 - t0).as_secs_f64());
                tg.push((t2 - t1).as_secs_f64());
                ca.push((c1 - c0) as f64 / 1e9);
                cg.push((c2 - c1) as f64 / 1e9);
            }
        }
        let med = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        println!(
            "{name}\t{flop}\t{}\t{}\t{}\t{}",
            med(ta),
            med(tg),
            med(ca),
            med(cg)
        );
    }
    Ok(())
}

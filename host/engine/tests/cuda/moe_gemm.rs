//! The one-launch grouped expert GEMM with device-resident counts (`cuda::moe_gemm`, part of the
//! `cuda_ops` test binary) against the CPU: the forward (w[e] and w[e]ᵀ) and the weight
//! gradient, f32 within 1e-5 and bf16 within 2e-2 of the largest value, on the tensor-core and
//! the SIMT kernels; K and M off and on multiples of 16, an empty expert, uneven groups, counts
//! summing short of N (zeros beyond), groups running past N or negative (cut, no fault: the
//! emulator checks every access), more experts than a block has threads; every product twice,
//! bit for bit.

use super::*;
use anneal_engine::cuda::moe_gemm::{
    grouped_matmul_weight_grad_with, grouped_matmul_with, Kernels,
};

/// The kernel families to try for a dtype: f32 has only the SIMT kernels.
fn kernels_for(dtype: DType) -> &'static [Kernels] {
    if dtype == DType::BF16 {
        &[Kernels::Auto, Kernels::Simt]
    } else {
        &[Kernels::Auto]
    }
}

/// Values in [-2, 2) of `shape`, rounded to `dtype` on the CPU.
fn rand_as(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
    rand(shape, seed).to_dtype(dtype).expect("cast")
}

/// `counts` as an i64 tensor on the GPU.
fn dev_counts(c: &[i64]) -> Tensor {
    gpu(&Tensor::from_slice(c, &[c.len()]).expect("counts"))
}

/// The row groups the kernels use: (expert, first row, rows), negative counts 0, cut at `n`.
fn groups(counts: &[i64], n: usize) -> Vec<(usize, usize, usize)> {
    let mut start = 0usize;
    counts
        .iter()
        .enumerate()
        .map(|(e, &c)| {
            let (s, f) = (start.min(n), (start + c.max(0) as usize).min(n));
            start += c.max(0) as usize;
            (e, s, f - s)
        })
        .collect()
}

/// The forward on the host: f32 sums in k order of the operands' values, zeros past the groups.
fn reference(x: &Tensor, w: &Tensor, counts: &[i64], nt: bool) -> Tensor {
    let (n, k) = (x.shape()[0], x.shape()[1]);
    let m = if nt { w.shape()[1] } else { w.shape()[2] };
    let (xv, wv) = (x.to_vec_f32(), w.to_vec_f32());
    let mut out = vec![0f32; n * m];
    for (e, s, len) in groups(counts, n) {
        let we = &wv[e * k * m..(e + 1) * k * m];
        for r in s..s + len {
            for j in 0..m {
                out[r * m + j] = (0..k)
                    .map(|i| xv[r * k + i] * if nt { we[j * k + i] } else { we[i * m + j] })
                    .sum();
            }
        }
    }
    Tensor::from_vec(out, &[n, m]).expect("sized")
}

/// The weight gradient on the host: f32 sums over each group's rows in order.
fn reference_grad(x: &Tensor, g: &Tensor, counts: &[i64]) -> Tensor {
    let (n, k, m) = (x.shape()[0], x.shape()[1], g.shape()[1]);
    let (xv, gv) = (x.to_vec_f32(), g.to_vec_f32());
    let mut out = vec![0f32; counts.len() * k * m];
    for (e, s, len) in groups(counts, n) {
        for i in 0..k {
            for j in 0..m {
                out[(e * k + i) * m + j] =
                    (s..s + len).map(|r| xv[r * k + i] * gv[r * m + j]).sum();
            }
        }
    }
    Tensor::from_vec(out, &[counts.len(), k, m]).expect("sized")
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec_f32().iter().map(|v| v.to_bits()).collect()
}

/// `f()` run twice, asserting the same bits, in `dtype`; leaves junk in the memory pool first,
/// so rows the kernel failed to write would show.
fn twice(what: &str, dtype: DType, f: impl Fn() -> Tensor) -> Tensor {
    drop(gpu(&Tensor::full(&[64, 64], 7.0, DType::F32)));
    let (a, b) = (f(), f());
    assert_eq!(a.dtype(), dtype, "{what}: dtype");
    assert!(bits(&a) == bits(&b), "{what}: two runs differ");
    a
}

fn tol(dtype: DType) -> f32 {
    if dtype == DType::BF16 {
        2e-2
    } else {
        1e-5
    }
}

#[test]
fn moe_gemm_forward_matches_the_cpu_backend() {
    if !gpu_or_skip("moe_gemm_forward_matches_the_cpu_backend") {
        return;
    }
    // Uneven groups with an empty expert, summing to N = 31.
    let counts = [5usize, 0, 17, 9];
    let c64: Vec<i64> = counts.iter().map(|&c| c as i64).collect();
    let n = 31;
    for dtype in [DType::F32, DType::BF16] {
        for (i, (k, m)) in [(40usize, 24usize), (64, 48)].into_iter().enumerate() {
            let seed = 500 + 10 * i as u64 + (dtype == DType::BF16) as u64 * 100;
            let x = rand_as(&[n, k], seed, dtype);
            let w = rand_as(&[4, k, m], seed + 1, dtype);
            let wt = rand_as(&[4, m, k], seed + 2, dtype);
            let want = x.grouped_matmul(&w, &counts).expect("cpu nn");
            let want_t = x.grouped_matmul_nt(&wt, &counts).expect("cpu nt");
            for &kern in kernels_for(dtype) {
                let what = format!("{dtype} {kern:?} K={k} M={m}");
                let got = twice(&what, dtype, || {
                    grouped_matmul_with(&gpu(&x), &gpu(&w), &dev_counts(&c64), false, kern)
                        .expect("nn")
                });
                close(&format!("{what} nn"), &got, &want, tol(dtype));
                let got = twice(&what, dtype, || {
                    grouped_matmul_with(&gpu(&x), &gpu(&wt), &dev_counts(&c64), true, kern)
                        .expect("nt")
                });
                close(&format!("{what} nt"), &got, &want_t, tol(dtype));
            }
        }
    }
}

#[test]
fn moe_gemm_forward_makes_any_counts_safe() {
    if !gpu_or_skip("moe_gemm_forward_makes_any_counts_safe") {
        return;
    }
    let (k, m) = (40, 24);
    // (N, counts): short of N (rows 20.. zero); a negative count and a group past N (cut at
    // 24, the last group empty); no rows at all; one expert holding more rows than a tile.
    let cases: [(usize, &[i64]); 4] = [
        (40, &[7, 0, 10, 3]),
        (24, &[10, -3, 30, 5]),
        (16, &[0, 0, 0, 0]),
        (70, &[1, 66, 0, 2]),
    ];
    for dtype in [DType::F32, DType::BF16] {
        for (ci, &(n, counts)) in cases.iter().enumerate() {
            let seed = 600 + 10 * ci as u64;
            let x = rand_as(&[n, k], seed, dtype);
            let w = rand_as(&[4, k, m], seed + 1, dtype);
            let wt = rand_as(&[4, m, k], seed + 2, dtype);
            for &kern in kernels_for(dtype) {
                for nt in [false, true] {
                    let what = format!("{dtype} {kern:?} N={n} counts {counts:?} nt={nt}");
                    let wb = if nt { &wt } else { &w };
                    let got = twice(&what, dtype, || {
                        grouped_matmul_with(&gpu(&x), &gpu(wb), &dev_counts(counts), nt, kern)
                            .expect("product")
                    });
                    close(&what, &got, &reference(&x, wb, counts, nt), tol(dtype));
                }
            }
        }
    }
    // i32 counts are taken too (converted on the device).
    let (x, w) = (rand(&[40, k], 650), rand(&[4, k, m], 651));
    let c32 = gpu(&Tensor::from_slice(&[7i32, 0, 10, 3], &[4]).expect("i32"));
    let got = grouped_matmul_with(&gpu(&x), &gpu(&w), &c32, false, Kernels::Auto).expect("i32");
    close(
        "i32 counts",
        &got,
        &reference(&x, &w, &[7, 0, 10, 3], false),
        1e-5,
    );
}

#[test]
fn moe_gemm_weight_grad_matches_the_cpu() {
    if !gpu_or_skip("moe_gemm_weight_grad_matches_the_cpu") {
        return;
    }
    // (N, counts, K, M): uneven with an empty expert; a negative count, a group cut at N and an
    // empty last group; multiples of 16 with more rows than one staging step.
    let cases: [(usize, &[i64], usize, usize); 3] = [
        (31, &[5, 0, 17, 9], 40, 24),
        (24, &[10, -2, 30, 4], 40, 24),
        (47, &[3, 40, 0, 4], 64, 48),
    ];
    for dtype in [DType::F32, DType::BF16] {
        for (ci, &(n, counts, k, m)) in cases.iter().enumerate() {
            let seed = 700 + 10 * ci as u64;
            let (x, g) = (
                rand_as(&[n, k], seed, dtype),
                rand_as(&[n, m], seed + 1, dtype),
            );
            let want = reference_grad(&x, &g, counts);
            for &kern in kernels_for(dtype) {
                let what = format!("weight grad {dtype} {kern:?} N={n} counts {counts:?}");
                let got = twice(&what, dtype, || {
                    grouped_matmul_weight_grad_with(&gpu(&x), &gpu(&g), &dev_counts(counts), kern)
                        .expect("weight grad")
                });
                close(&what, &got, &want, tol(dtype));
                // An empty group's gradient is exactly zero.
                let v = got.to_vec_f32();
                for (e, _, len) in groups(counts, n) {
                    if len == 0 {
                        let block = &v[e * k * m..(e + 1) * k * m];
                        assert!(block.iter().all(|&z| z == 0.0), "{what}: expert {e}");
                    }
                }
            }
        }
    }
    // The CPU backend's gradient agrees on counts it accepts (through autograd: dL/dw of
    // sum(grouped_matmul(x, w) · g) is the grouped x_eᵀ · g_e).
    let counts = [5usize, 0, 17, 9];
    let (x, g) = (rand(&[31, 40], 750), rand(&[31, 24], 751));
    let w = rand(&[4, 40, 24], 752).requires_grad_();
    let y = x.grouped_matmul(&w, &counts).expect("cpu");
    y.mul(&g)
        .expect("mul")
        .sum_all()
        .expect("sum")
        .backward()
        .expect("backward");
    let want = w.grad().expect("grad");
    let c64 = dev_counts(&[5, 0, 17, 9]);
    let got =
        grouped_matmul_weight_grad_with(&gpu(&x), &gpu(&g), &c64, Kernels::Auto).expect("grad");
    close("weight grad vs the CPU backend", &got, &want, 1e-5);
}

#[test]
fn moe_gemm_takes_more_experts_than_threads() {
    if !gpu_or_skip("moe_gemm_takes_more_experts_than_threads") {
        return;
    }
    // 300 experts: each thread of the tile search owns 2 (SIMT) or 3 (wmma) of them; the rows
    // sit in experts on both sides of those chunks' boundaries and at the last expert.
    let (e, n, k, m) = (300usize, 48usize, 16usize, 16usize);
    let mut counts = vec![0i64; e];
    for (i, c) in [(0, 3), (2, 5), (3, 4), (149, 9), (257, 20), (299, 7)] {
        counts[i] = c;
    }
    for dtype in [DType::F32, DType::BF16] {
        let x = rand_as(&[n, k], 800, dtype);
        let w = rand_as(&[e, k, m], 801, dtype);
        let g = rand_as(&[n, m], 802, dtype);
        for &kern in kernels_for(dtype) {
            let what = format!("{e} experts {dtype} {kern:?}");
            let got = twice(&what, dtype, || {
                grouped_matmul_with(&gpu(&x), &gpu(&w), &dev_counts(&counts), false, kern)
                    .expect("product")
            });
            close(&what, &got, &reference(&x, &w, &counts, false), tol(dtype));
            let got = twice(&what, dtype, || {
                grouped_matmul_weight_grad_with(&gpu(&x), &gpu(&g), &dev_counts(&counts), kern)
                    .expect("weight grad")
            });
            close(
                &format!("{what} weight grad"),
                &got,
                &reference_grad(&x, &g, &counts),
                tol(dtype),
            );
        }
    }
}

//! Matrix products on every path (the packed AVX-512 kernel where the CPU has it, `gemm`
//! otherwise): values against an f64 reference at edge sizes and every transpose, bitwise
//! identity for 1 and 2 threads, and rows that do not depend on the rest of the batch.

mod common;

use anneal_engine::{SimdLevel, Tensor};
use common::{assert_thread_invariant, randn};

/// `a [m, k]` (or its transpose's view) for the given layout.
fn operand(rows: usize, cols: usize, transposed: bool, name: &str) -> Tensor {
    if transposed {
        randn(&[cols, rows], name).transpose(0, 1).unwrap()
    } else {
        randn(&[rows, cols], name)
    }
}

fn reference(a: &Tensor, b: &Tensor) -> Vec<f64> {
    let (m, k, n) = (a.shape()[0], a.shape()[1], b.shape()[1]);
    let (av, bv) = (
        a.contiguous().unwrap().to_vec_f32(),
        b.contiguous().unwrap().to_vec_f32(),
    );
    let mut c = vec![0f64; m * n];
    for i in 0..m {
        for p in 0..k {
            let x = av[i * k + p] as f64;
            for j in 0..n {
                c[i * n + j] += x * bv[p * n + j] as f64;
            }
        }
    }
    c
}

#[test]
fn products_match_an_f64_reference_at_edge_sizes_and_transposes() {
    // Sizes around the micro-tile (12 × 32) and depth block (256) boundaries.
    let sizes = [
        (1, 1, 1),
        (3, 5, 7),
        (4, 9, 31),
        (12, 256, 32),
        (13, 257, 33),
        (25, 513, 65),
        (100, 300, 70),
        (97, 40, 300),
    ];
    for (m, k, n) in sizes {
        for (at, bt) in [(false, false), (false, true), (true, false), (true, true)] {
            let a = operand(m, k, at, &format!("a{m}-{k}"));
            let b = operand(k, n, bt, &format!("b{k}-{n}"));
            let got = a.matmul(&b).unwrap().to_vec_f32();
            let want = reference(&a, &b);
            for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                let tol = 1e-5 * (k as f64).sqrt() * (1.0 + w.abs());
                assert!(
                    (g as f64 - w).abs() <= tol,
                    "{m}x{k}x{n} a_t={at} b_t={bt} [{i}]: {g} vs {w}"
                );
            }
        }
    }
    // Batched, with a broadcast operand.
    let a = randn(&[3, 14, 40], "ba");
    let b = randn(&[40, 35], "bb");
    let got = a
        .matmul(&b.unsqueeze(0).unwrap().expand(&[3, 40, 35]).unwrap())
        .unwrap();
    for i in 0..3 {
        let ai = a.narrow(0, i, 1).unwrap().reshape(&[14, 40]).unwrap();
        let want = reference(&ai, &b);
        let gi = got.narrow(0, i, 1).unwrap().to_vec_f32();
        for (&g, &w) in gi.iter().zip(&want) {
            assert!(
                (g as f64 - w).abs() <= 1e-4 * (1.0 + w.abs()),
                "batch {i}: {g} vs {w}"
            );
        }
    }
}

#[test]
fn products_are_bitwise_identical_for_1_and_2_threads() {
    assert_thread_invariant("matmul", || {
        let mut out = Vec::new();
        for (m, k, n, at, bt) in [
            (300, 600, 600, false, true),
            (300, 600, 600, true, false),
            (2048, 64, 96, false, false),
            (5, 700, 50, false, true),
        ] {
            let a = operand(m, k, at, "ta");
            let b = operand(k, n, bt, "tb");
            out.push(a.matmul(&b).unwrap());
        }
        out
    });
}

#[test]
fn on_the_packed_kernel_a_row_does_not_depend_on_the_batch() {
    if anneal_engine::simd_level() != SimdLevel::Avx512 {
        eprintln!("skipped: the packed kernel needs AVX-512 (gemm picks paths by size)");
        return;
    }
    for bt in [false, true] {
        let a = randn(&[300, 520], "ra");
        let b = operand(520, 77, bt, "rb");
        let full = a.matmul(&b).unwrap();
        for (start, len) in [(0, 4), (37, 8), (290, 10), (11, 200)] {
            let part = a.narrow(0, start, len).unwrap().matmul(&b).unwrap();
            let want = full.narrow(0, start, len).unwrap();
            let bits = |t: &Tensor| {
                t.to_vec_f32()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect::<Vec<_>>()
            };
            assert!(
                bits(&part) == bits(&want),
                "rows {start}..{} differ when computed alone (b_t={bt})",
                start + len
            );
        }
    }
}

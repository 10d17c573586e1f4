//! bf16 mixed precision: the bf16 × bf16 → f32-accumulated product (AVX512-BF16 where the CPU
//! has it, conversion + f32 elsewhere) against an f64 reference, thread-count invariance, and
//! autocast: f32 parameters get f32 gradients, activations between products are bf16, and a
//! recomputed region replays the same precision.

mod common;

use anneal_engine::autocast::set_autocast;
use anneal_engine::autograd::{checkpoint, RegionFn};
use anneal_engine::{DType, Tensor};
use common::{assert_thread_invariant, randn};
use std::sync::Arc;

fn bf(t: Tensor) -> Tensor {
    t.to_dtype(DType::BF16).unwrap()
}

fn operand(rows: usize, cols: usize, transposed: bool, name: &str) -> Tensor {
    if transposed {
        bf(randn(&[cols, rows], name)).transpose(0, 1).unwrap()
    } else {
        bf(randn(&[rows, cols], name))
    }
}

#[test]
fn bf16_products_match_an_f64_reference() {
    for (m, k, n) in [
        (4, 1, 3),
        (12, 2, 32),
        (13, 7, 33),
        (30, 513, 70),
        (100, 1030, 40),
    ] {
        for (at, bt) in [(false, false), (false, true), (true, false), (true, true)] {
            let a = operand(m, k, at, "a");
            let b = operand(k, n, bt, "b");
            let got = a.matmul(&b).unwrap();
            assert_eq!(got.dtype(), DType::BF16);
            let (av, bv) = (
                a.contiguous().unwrap().to_vec_f32(),
                b.contiguous().unwrap().to_vec_f32(),
            );
            for (idx, g) in got.to_vec_f32().into_iter().enumerate() {
                let (i, j) = (idx / n, idx % n);
                let want: f64 = (0..k)
                    .map(|p| av[i * k + p] as f64 * bv[p * n + j] as f64)
                    .sum();
                // f32 sums of exact products, then one rounding to bf16 (2^-8 relative).
                let tol = 4e-3 * want.abs() + 1e-5 * (k as f64).sqrt() * 4.0;
                assert!(
                    (g as f64 - want).abs() <= tol,
                    "{m}x{k}x{n} a_t={at} b_t={bt} [{i},{j}]: {g} vs {want}"
                );
            }
        }
    }
}

#[test]
fn bf16_products_are_thread_count_invariant() {
    assert_thread_invariant("bf16 matmul", || {
        vec![
            operand(300, 1100, false, "ta")
                .matmul(&operand(1100, 90, true, "tb"))
                .unwrap(),
            operand(64, 300, true, "tc")
                .matmul(&operand(300, 600, false, "td"))
                .unwrap(),
        ]
    });
}

/// A two-layer MLP on f32 parameters: `sum(silu(x·w1ᵀ)·w2ᵀ)`.
fn mlp(x: &Tensor, w1: &Tensor, w2: &Tensor) -> Tensor {
    let h = x
        .matmul(&w1.transpose(0, 1).unwrap())
        .unwrap()
        .silu()
        .unwrap();
    h.matmul(&w2.transpose(0, 1).unwrap()).unwrap()
}

#[test]
fn autocast_runs_products_in_bf16_and_keeps_f32_gradients() {
    let x = randn(&[2, 24, 64], "x");
    let w1 = randn(&[96, 64], "w1")
        .mul_scalar(0.1)
        .unwrap()
        .requires_grad_();
    let w2 = randn(&[32, 96], "w2")
        .mul_scalar(0.1)
        .unwrap()
        .requires_grad_();
    let y32 = mlp(&x, &w1, &w2);
    y32.sum_all().unwrap().backward().unwrap();
    let (g1, g2) = (
        w1.grad().unwrap().to_vec_f32(),
        w2.grad().unwrap().to_vec_f32(),
    );
    w1.zero_grad();
    w2.zero_grad();
    let y = {
        let _amp = set_autocast(Some(DType::BF16));
        mlp(&x, &w1, &w2)
    };
    assert_eq!(y.dtype(), DType::BF16, "products return bf16");
    y.to_dtype(DType::F32)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    for (w, want) in [(&w1, &g1), (&w2, &g2)] {
        let g = w.grad().unwrap();
        assert_eq!(g.dtype(), DType::F32, "master weights get f32 gradients");
        assert!(g.is_contiguous());
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (a, b) in g.to_vec_f32().iter().zip(want) {
            assert!((a - b).abs() <= 3e-2 * scale, "{a} vs f32 {b}");
        }
    }
    // Outside the region nothing is cast.
    assert_eq!(mlp(&x, &w1, &w2).dtype(), DType::F32);
}

#[test]
fn a_recomputed_region_replays_autocast() {
    let x = randn(&[16, 64], "x").requires_grad_();
    let w1 = randn(&[96, 64], "w1")
        .mul_scalar(0.1)
        .unwrap()
        .requires_grad_();
    let w2 = randn(&[32, 96], "w2")
        .mul_scalar(0.1)
        .unwrap()
        .requires_grad_();
    let run = |recompute: bool| {
        w1.zero_grad();
        w2.zero_grad();
        x.zero_grad();
        let y = {
            let _amp = set_autocast(Some(DType::BF16));
            if recompute {
                let (a, b) = (w1.clone(), w2.clone());
                let f: RegionFn = Arc::new(move |xs: &[Tensor]| Ok(mlp(&xs[0], &a, &b)));
                checkpoint(std::slice::from_ref(&x), f).unwrap()
            } else {
                mlp(&x, &w1, &w2)
            }
        };
        assert_eq!(y.dtype(), DType::BF16);
        y.to_dtype(DType::F32)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        [x.grad(), w1.grad(), w2.grad()].map(|g| g.unwrap().to_vec_f32())
    };
    assert!(
        run(true) == run(false),
        "recompute gives the same bf16 gradients"
    );
}

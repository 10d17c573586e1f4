//! Engine micro-benchmark: matrix products at transformer shapes (forward and both backward
//! products) and fused attention forward+backward. Prints one tab-separated line per row:
//! `name  flop  median_seconds`; `bench/engine_bench.sh` pairs it with PyTorch's figures.
//!
//! Run: `RAYON_NUM_THREADS=2 cargo run --release --example engine_bench`.

use anneal_engine::ops::{scaled_dot_product_attention, AttentionParams};
use anneal_engine::rng::RngKey;
use anneal_engine::{DType, Tensor};
use std::time::Instant;

fn randn(shape: &[usize], name: &str) -> Tensor {
    Tensor::rand_normal(shape, 0.0, 1.0, &RngKey::new(7, name), 0, DType::F32).expect("valid shape")
}

/// Median seconds of `reps` runs after `warmup` runs.
fn time(warmup: usize, reps: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..warmup {
        f();
    }
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn main() -> anneal_engine::Result<()> {
    let reps: usize = std::env::var("BENCH_REPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(15);
    let only = std::env::args().nth(1);
    let want = |name: &str| only.as_deref().is_none_or(|o| name.contains(o));
    for (m, k, n) in [(2048, 256, 1024), (2048, 1024, 256), (2048, 256, 8192)] {
        let flop = 2.0 * (m * k * n) as f64;
        let a = randn(&[m, k], "a");
        let b = randn(&[k, n], "b");
        let dc = randn(&[m, n], "dc");
        let bt = b.transpose(0, 1)?;
        let at = a.transpose(0, 1)?;
        let rows: [(String, &Tensor, &Tensor); 3] = [
            (format!("matmul {m}x{k}x{n} C=A·B"), &a, &b),
            (format!("matmul {m}x{k}x{n} dA=dC·Bᵀ"), &dc, &bt),
            (format!("matmul {m}x{k}x{n} dB=Aᵀ·dC"), &at, &dc),
        ];
        for (name, x, y) in rows {
            if !want(&name) {
                continue;
            }
            let s = time(3, reps, || {
                std::hint::black_box(x.matmul(y).expect("shapes fit"));
            });
            println!("{name}\t{flop}\t{s}");
        }
    }
    let (b, h, t, d) = (8, 4, 256, 64);
    let name = format!("attention B{b} H{h} T{t} D{d} causal fwd+bwd");
    if want(&name) {
        // Causal: half the score matrix; backward does 2.5x the forward's products.
        let flop = 3.5 * 4.0 * (b * h * t * t * d) as f64 / 2.0;
        let (q, k, v) = (
            randn(&[b, h, t, d], "q"),
            randn(&[b, h, t, d], "k"),
            randn(&[b, h, t, d], "v"),
        );
        let go = randn(&[b, h, t, d], "go");
        let p = AttentionParams::causal();
        let s = time(3, reps, || {
            let (q, k, v) = (
                q.detach().requires_grad_(),
                k.detach().requires_grad_(),
                v.detach().requires_grad_(),
            );
            let out = scaled_dot_product_attention(&q, &k, &v, &p).expect("shapes fit");
            out.backward_with(go.clone()).expect("backward runs");
            std::hint::black_box((q.grad(), k.grad(), v.grad()));
        });
        println!("{name}\t{flop}\t{s}");
        let s = time(3, reps, || {
            std::hint::black_box(scaled_dot_product_attention(&q, &k, &v, &p).expect("fits"));
        });
        println!(
            "attention B{b} H{h} T{t} D{d} causal fwd\t{}\t{s}",
            flop / 3.5
        );
    }
    Ok(())
}

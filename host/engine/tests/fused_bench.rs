//! Rough throughput of the fused ops (ignored by default; run with
//! `cargo test -p anneal-engine --release --test fused_bench -- --ignored --nocapture`).

mod common;

use anneal_engine::ops::{
    cross_entropy, rope_tables, CrossEntropy, RopeLayout, RopeSpec, RopeStyle,
};
use anneal_engine::{DType, Tensor};
use common::randn;
use std::time::Instant;

/// Best-of-5 milliseconds of `f`.
fn time(f: impl Fn()) -> f64 {
    f();
    (0..5)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e3
        })
        .fold(f64::INFINITY, f64::min)
}

fn report(name: &str, ms: f64, bytes: usize) {
    println!(
        "{name:<28} {ms:8.2} ms  {:6.2} GB/s",
        bytes as f64 / ms / 1e6
    );
}

#[test]
#[ignore]
fn fused_throughput() {
    let (rows, d) = (16384, 1024);
    let x = randn(&[rows, d], "bx");
    let w = randn(&[d], "bw");
    let g = randn(&[rows, d], "bg");
    let nb = rows * d * 4;
    report("exp (reference)", time(|| drop(x.exp().unwrap())), 2 * nb);
    report(
        "sum_dims (reference)",
        time(|| drop(x.sum_dims(&[-1], false).unwrap())),
        nb,
    );
    report("softmax fwd", time(|| drop(x.softmax(-1).unwrap())), 2 * nb);
    let xl = x.detach().requires_grad_();
    report(
        "softmax fwd+bwd",
        time(|| {
            xl.zero_grad();
            xl.softmax(-1).unwrap().backward_with(g.clone()).unwrap();
        }),
        5 * nb,
    );
    report(
        "rms_norm fwd",
        time(|| drop(x.rms_norm(Some(&w), 1e-5).unwrap())),
        2 * nb,
    );
    let wl = w.detach().requires_grad_();
    report(
        "rms_norm fwd+bwd",
        time(|| {
            xl.zero_grad();
            wl.zero_grad();
            xl.rms_norm(Some(&wl), 1e-5)
                .unwrap()
                .backward_with(g.clone())
                .unwrap();
        }),
        5 * nb,
    );
    report(
        "layer_norm fwd",
        time(|| drop(x.layer_norm(Some(&w), Some(&w), 1e-5).unwrap())),
        2 * nb,
    );
    let x4 = x.reshape(&[4, 16, 2048, 128]).unwrap();
    let (c, s) = rope_tables(&Tensor::arange(2048, DType::I64), 128, 1e4, None).unwrap();
    for style in [RopeStyle::Interleaved, RopeStyle::HalfSplit] {
        let spec = RopeSpec {
            style,
            layout: RopeLayout::Bhtd,
        };
        report(
            &format!("rope fwd {style:?}"),
            time(|| drop(x4.rope(&c, &s, spec).unwrap())),
            2 * nb,
        );
    }
    let ids: Vec<i64> = (0..16384).map(|i| (i * 7919 % 32000) as i64).collect();
    let ids = Tensor::from_vec(ids, &[16384]).unwrap();
    let emb = randn(&[32000, 1024], "bemb").requires_grad_();
    report(
        "embedding fwd",
        time(|| drop(emb.embedding(&ids).unwrap())),
        2 * nb,
    );
    report(
        "embedding fwd+bwd",
        time(|| {
            emb.zero_grad();
            emb.embedding(&ids)
                .unwrap()
                .backward_with(g.clone())
                .unwrap();
        }),
        4 * nb + 32000 * 1024 * 4,
    );
    let (n, v) = (2048, 32000);
    let logits = randn(&[n, v], "bl");
    let tg: Vec<i64> = (0..n).map(|i| (i * 31 % v) as i64).collect();
    let tg = Tensor::from_vec(tg, &[n]).unwrap();
    let lb = n * v * 4;
    let opts = CrossEntropy::default();
    report(
        "cross_entropy fwd",
        time(|| drop(cross_entropy(&logits, &tg, &opts).unwrap())),
        lb,
    );
    let ll = logits.detach().requires_grad_();
    report(
        "cross_entropy fwd+bwd",
        time(|| {
            ll.zero_grad();
            cross_entropy(&ll, &tg, &opts).unwrap().backward().unwrap();
        }),
        3 * lb,
    );
    let l16 = logits.to_dtype(DType::BF16).unwrap().requires_grad_();
    report(
        "cross_entropy bf16 fwd+bwd",
        time(|| {
            l16.zero_grad();
            cross_entropy(&l16, &tg, &opts).unwrap().backward().unwrap();
        }),
        3 * lb / 2,
    );
}

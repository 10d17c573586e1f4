//! Ring attention between real MPI ranks: this test binary starts itself under `mpiexec -n 2`
//! and `-n 3`, where every rank holds its causal load-balanced chunks of one sequence, runs
//! ring attention over the world communicator (`RankRing`) forward and backward, and checks its
//! rows of the output and of the q, k and v gradients against attention over the whole sequence
//! computed locally.

use anneal_dist::launch::run_self_on_ranks;
use anneal_engine::ops::{ring_attention, scaled_dot_product_attention, AttentionParams};
use anneal_engine::rng::RngKey;
use anneal_engine::{DType, Tensor};
use anneal_train::RankRing;

const RANK_ENV: &str = "ANNEAL_RING_RANK_CHECKS";

fn run_ranks(n: usize) {
    run_self_on_ranks(n, RANK_ENV, "rank_checks", "ring attention checked");
}

#[test]
fn ring_attention_on_2_ranks() {
    run_ranks(2);
}

#[test]
fn ring_attention_on_3_ranks() {
    run_ranks(3);
}

fn randn(shape: &[usize], name: &str) -> Tensor {
    Tensor::rand_normal(shape, 0.0, 1.0, &RngKey::new(7, name), 0, DType::F32).unwrap()
}

/// Rows `pos` of `x [B, H, T, D]`.
fn rows(x: &Tensor, pos: &[i64]) -> Tensor {
    x.index_select(2, &Tensor::from_vec(pos.to_vec(), &[pos.len()]).unwrap())
        .unwrap()
}

fn assert_close(name: &str, got: &Tensor, want: &Tensor) {
    let (g, w) = (got.to_vec_f32(), want.to_vec_f32());
    assert_eq!(g.len(), w.len(), "{name}");
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 + 1e-5 * b.abs(),
            "{name}[{i}]: {a} vs {b}"
        );
    }
}

/// Runs on each rank under `mpiexec` (a no-op in a plain `cargo test`).
#[test]
fn rank_checks() {
    if std::env::var_os(RANK_ENV).is_none() {
        return;
    }
    let world = anneal_dist::init().unwrap();
    let (r, n) = (world.rank(), world.size());
    let (b, hq, hkv, t, d) = (1, 4, 2, 8 * n, 8);
    let leaf = |x: &Tensor| x.detach().requires_grad_();
    let (q, k, v) = (
        leaf(&randn(&[b, hq, t, d], "q")),
        leaf(&randn(&[b, hkv, t, d], "k")),
        leaf(&randn(&[b, hkv, t, d], "v")),
    );
    let go = randn(&[b, hq, t, d], "go");
    let params = AttentionParams {
        sliding_window: Some(5),
        ..AttentionParams::causal()
    };
    let full = scaled_dot_product_attention(&q, &k, &v, &params).unwrap();
    full.backward_with(go.clone()).unwrap();

    // Chunk r and its mirror 2n − 1 − r of 2n chunks.
    let c = (t / (2 * n)) as i64;
    let (r64, n64) = (r as i64, n as i64);
    let pos: Vec<i64> = (r64 * c..(r64 + 1) * c)
        .chain((2 * n64 - 1 - r64) * c..(2 * n64 - r64) * c)
        .collect();
    let (lq, lk, lv) = (
        leaf(&rows(&q, &pos)),
        leaf(&rows(&k, &pos)),
        leaf(&rows(&v, &pos)),
    );
    let p = Tensor::from_vec(pos.clone(), &[pos.len()]).unwrap();
    let local = AttentionParams {
        q_pos: Some(p.clone()),
        k_pos: Some(p),
        ..params
    };
    let (_active, ring) = RankRing::activate(world);
    let out = ring_attention(&lq, &lk, &lv, &local, ring).unwrap();
    out.backward_with(rows(&go, &pos)).unwrap();
    assert_close("out", &out, &rows(&full, &pos));
    assert_close("dq", &lq.grad().unwrap(), &rows(&q.grad().unwrap(), &pos));
    assert_close("dk", &lk.grad().unwrap(), &rows(&k.grad().unwrap(), &pos));
    assert_close("dv", &lv.grad().unwrap(), &rows(&v.grad().unwrap(), &pos));
    println!("rank {r}/{n}: ring attention checked");
}

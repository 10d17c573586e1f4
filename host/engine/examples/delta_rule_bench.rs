//! One Gated DeltaNet mixer (`ops::gated_delta_rule`: l2-normalized q and k, per-head decay,
//! chunked forward and backward), timed per iteration. Prints one JSON object:
//! `{"seconds": [..], "forward": [..], "kernels": ".."}`
//! (`forward`: the forward part of each iteration); `bench/delta_rule_vs_pytorch.sh` runs it next to
//! transformers' `torch_chunk_gated_delta_rule`.
//!
//! With `--decode N`, instead times N single-token decode steps after a `--seq` prompt through
//! `DeltaRuleCache`, with the recurrence and in batch-invariant mode (chunked over the tokens
//! since the last 64-aligned state): `{"recurrent": s/step, "invariant": s/step}`.
//!
//! Run: `RAYON_NUM_THREADS=2 cargo run --release --example delta_rule_bench -- \
//!   --seq 2048 --k-heads 16 --v-heads 16 --head-dim 128 --iters 5`

use anneal_engine::invariant::set_batch_invariant;
use anneal_engine::ops::{gated_delta_rule, DeltaRuleCache, DeltaRuleParams};
use anneal_engine::rng::RngKey;
use anneal_engine::{DType, Tensor};
use std::time::Instant;

fn rand(shape: &[usize], lo: f32, hi: f32, name: &str) -> anneal_engine::Result<Tensor> {
    Tensor::rand_uniform(shape, lo, hi, &RngKey::new(5, name), 0, DType::F32)
}

fn randn(shape: &[usize], name: &str) -> anneal_engine::Result<Tensor> {
    Tensor::rand_normal(shape, 0.0, 1.0, &RngKey::new(5, name), 0, DType::F32)
}

/// `--name value` from the command line, or `default`.
fn arg(name: &str, default: usize) -> Result<usize, String> {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == name) {
        None => Ok(default),
        Some(i) => args
            .get(i + 1)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("{name} needs a positive integer")),
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let t = arg("--seq", 2048)?;
    let b = arg("--batch", 1)?;
    let hk = arg("--k-heads", 16)?;
    let hv = arg("--v-heads", 16)?;
    let d = arg("--head-dim", 128)?;
    let iters = arg("--iters", 5)?;
    let inputs = [
        randn(&[b, t, hk, d], "q")?,
        randn(&[b, t, hk, d], "k")?,
        randn(&[b, t, hv, d], "v")?,
        rand(&[b, t, hv], -0.5, 0.0, "g")?,
        rand(&[b, t, hv], 0.0, 1.0, "beta")?,
    ];
    let grad = randn(&[b, t, hv, d], "grad")?;
    let params = DeltaRuleParams {
        scale: None,
        qk_l2norm: true,
    };
    let decode = arg("--decode", 0)?;
    if decode > 0 {
        return decode_steps(&inputs, &params, (b, hk, hv, d), decode);
    }
    let (mut seconds, mut forward) = (Vec::with_capacity(iters), Vec::with_capacity(iters));
    for _ in 0..iters {
        let start = Instant::now();
        let x: Vec<Tensor> = inputs.iter().map(|t| t.detach().requires_grad_()).collect();
        let r = gated_delta_rule(&x[0], &x[1], &x[2], &x[3], &x[4], None, &params)?;
        forward.push(start.elapsed().as_secs_f64());
        r.out.backward_with(grad.clone())?;
        seconds.push(start.elapsed().as_secs_f64());
        for t in &x {
            if t.grad().is_none() {
                return Err("an input got no gradient".into());
            }
        }
    }
    let kernels = if anneal_engine::simd_level() == anneal_engine::SimdLevel::Avx512 {
        "packed avx512"
    } else {
        "gemm crate"
    };
    println!("{{\"seconds\": {seconds:?}, \"forward\": {forward:?}, \"kernels\": \"{kernels}\"}}");
    Ok(())
}

/// Seconds per single-token step after a prompt of the inputs' length, through the cache.
fn decode_steps(
    inputs: &[Tensor; 5],
    params: &DeltaRuleParams,
    (b, hk, hv, d): (usize, usize, usize, usize),
    steps: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut per_step = Vec::new();
    for invariant in [false, true] {
        let _mode = set_batch_invariant(invariant);
        let mut cache = DeltaRuleCache::zeros(b, hv, d, d, *params)?;
        let [q, k, v, g, beta] = inputs;
        cache.step(q, k, v, g, beta)?;
        let one = |name: &str, h: usize, i: usize| -> anneal_engine::Result<Tensor> {
            randn(&[b, 1, h, d], &format!("{name}{i}"))
        };
        let start = Instant::now();
        for i in 0..steps {
            let g1 = rand(&[b, 1, hv], -0.5, 0.0, &format!("g{i}"))?;
            let b1 = rand(&[b, 1, hv], 0.0, 1.0, &format!("b{i}"))?;
            cache.step(
                &one("q", hk, i)?,
                &one("k", hk, i)?,
                &one("v", hv, i)?,
                &g1,
                &b1,
            )?;
        }
        per_step.push(start.elapsed().as_secs_f64() / steps as f64);
    }
    println!(
        "{{\"recurrent\": {}, \"invariant\": {}}}",
        per_step[0], per_step[1]
    );
    Ok(())
}

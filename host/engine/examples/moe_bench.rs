//! One dropless MoE feed-forward layer (`ops::moe_ffn`: softmax top-k router with
//! renormalised weights, grouped SwiGLU experts, weighted combine), forward + backward, timed
//! per iteration. Prints one JSON object: `{"seconds": [..], "counts": [..], ...}`;
//! `bench/moe_vs_pytorch.sh` runs it next to PyTorch.
//!
//! With `--profile`, a per-kernel table of the iterations after the first goes to stderr.
//!
//! Run: `RAYON_NUM_THREADS=2 cargo run --release --example moe_bench -- \
//!   --tokens 4096 --hidden 512 --experts 16 --topk 2 --ffn 1024 --iters 10`

use anneal_engine::ops::{moe_ffn, MoeSpec, MoeWeights, RouterScore, RouterSpec};
use anneal_engine::rng::RngKey;
use anneal_engine::{DType, Tensor};
use std::time::Instant;

fn randn(shape: &[usize], std: f32, name: &str) -> anneal_engine::Result<Tensor> {
    Tensor::rand_normal(shape, 0.0, std, &RngKey::new(11, name), 0, DType::F32)
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
    let n = arg("--tokens", 4096)?;
    let d = arg("--hidden", 512)?;
    let e = arg("--experts", 16)?;
    let k = arg("--topk", 2)?;
    let f = arg("--ffn", 1024)?;
    let iters = arg("--iters", 10)?;
    let x = randn(&[n, d], 1.0, "x")?;
    let std_in = 1.0 / (d as f32).sqrt();
    let weights = [
        randn(&[d, e], std_in, "router")?,
        randn(&[e, d, f], std_in, "gate")?,
        randn(&[e, d, f], std_in, "up")?,
        randn(&[e, f, d], 1.0 / (f as f32).sqrt(), "down")?,
    ];
    let g = randn(&[n, d], 1.0, "grad")?;
    let spec = MoeSpec::new(RouterSpec {
        num_experts: e,
        top_k: k,
        score: RouterScore::Softmax,
        renormalize: true,
        route_scale: 1.0,
        groups: None,
    });
    let profile = std::env::args().any(|a| a == "--profile");
    if profile {
        anneal_engine::profile::configure(anneal_engine::profile::Window {
            skip: 1,
            steps: iters.saturating_sub(1) as u64,
        });
    }
    let mut seconds = Vec::with_capacity(iters);
    let mut counts = Vec::new();
    for i in 0..iters {
        let _step = anneal_engine::profile::step(i as u64);
        let start = Instant::now();
        let xl = x.detach().requires_grad_();
        let wl: Vec<Tensor> = weights
            .iter()
            .map(|w| w.detach().requires_grad_())
            .collect();
        let w = MoeWeights::new(&wl[0], &wl[1], &wl[2], &wl[3]);
        let out = {
            let _p = anneal_engine::profile::phase("forward");
            moe_ffn(&xl, &w, &spec)?
        };
        {
            let _p = anneal_engine::profile::phase("backward");
            out.out.backward_with(g.clone())?;
        }
        std::hint::black_box((xl.grad(), wl[1].grad()));
        seconds.push(start.elapsed().as_secs_f64());
        counts = out.counts.to_vec::<i64>();
    }
    if let Some(p) = anneal_engine::profile::finish() {
        eprintln!("{}", p.table());
    }
    let list = |v: Vec<String>| v.join(", ");
    println!(
        "{{\"seconds\": [{}], \"counts\": [{}], \"threads\": {}, \"kernels\": \"{}\"}}",
        list(seconds.iter().map(|s| format!("{s:.6}")).collect()),
        list(counts.iter().map(|c| c.to_string()).collect()),
        anneal_engine::num_threads(),
        anneal_engine::matmul_kernels()
    );
    Ok(())
}

//! The engine's side of bench/gpu_check.sh's speed table (issue 41), as ignored tests of the
//! `cuda_ops` binary: bf16 causal attention forward + backward and a DeepSeek-V3-like MoE layer
//! forward + backward through the public ops on `cuda:0`, each printing one machine-readable line
//! that the script sets beside PyTorch's (bench/gpu_speed_torch.py) on the same shapes and FLOP
//! counts:
//!
//! ```text
//! cuda_ops --ignored --nocapture attention_speed moe_speed
//! attention bf16 causal seq=4096 heads=16 dim=128: fwd+bwd 3.21 ms, 171.2 TFLOP/s (fwd 1.00 ms, 137.4 TFLOP/s)
//! moe bf16 tokens=8192 experts=64 topk=8 hidden=7168 ffn=2048: fwd+bwd 61.00 ms, 283.0 TFLOP/s (fwd 20.00 ms, 288.0 TFLOP/s)
//! ```
//! Shapes come from the environment so that the same tests rehearse on the emulated GPU with
//! tiny ones (`ANNEAL_BENCH_SEQS=64 ANNEAL_BENCH_TOKENS=64 ANNEAL_BENCH_HEADS=2
//! ANNEAL_BENCH_HEAD_DIM=32 ANNEAL_BENCH_HIDDEN=64 ANNEAL_BENCH_FFN=32 ANNEAL_BENCH_EXPERTS=8
//! ANNEAL_BENCH_TOPK=2`); the defaults are the GPU's. Each measurement runs once to warm up
//! (NVRTC compiles, the allocator's first blocks), once more to size the timed loop to about a
//! second (`ANNEAL_BENCH_ITERS` fixes it), then that many iterations between two device
//! synchronizations.

use super::*;
use anneal_engine::ops::{moe_ffn, AttentionParams, MoeSpec, MoeWeights, RouterScore, RouterSpec};
use rayon::prelude::*;
use std::time::Instant;

/// `name` from the environment, or `default`.
fn env_usize(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a whole number")),
        Err(_) => default,
    }
}

/// A comma-separated list of whole numbers from the environment, or `default`.
fn env_list(name: &str, default: &str) -> Vec<usize> {
    let v = std::env::var(name).unwrap_or_else(|_| default.to_string());
    v.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| {
            s.trim()
                .parse()
                .unwrap_or_else(|_| panic!("{name}={v:?}: {s:?} is not a whole number"))
        })
        .collect()
}

/// A bf16 tensor on the GPU of uniform values in [-scale, scale), hashed from `(seed, index)`
/// in parallel (the MoE's expert stacks are billions of values).
fn device_bf16(shape: &[usize], seed: u64, scale: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let mut v = vec![half::bf16::ZERO; n];
    v.par_chunks_mut(1 << 16).enumerate().for_each(|(c, out)| {
        for (j, x) in out.iter_mut().enumerate() {
            // splitmix64 of the element's index, offset by the seed.
            let mut z = (seed << 40)
                .wrapping_add(((c << 16) + j) as u64)
                .wrapping_mul(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            let u = (z >> 40) as f32 / (1u64 << 24) as f32;
            *x = half::bf16::from_f32((u * 2.0 - 1.0) * scale);
        }
    });
    Tensor::from_vec(v, shape)
        .expect("sized")
        .to_device(GPU)
        .expect("copy to the GPU")
}

/// Seconds per call of `f` on the GPU: one warm-up call, one call to size the loop to about a
/// second (between 2 and 20 calls; `ANNEAL_BENCH_ITERS` sets the count), then the timed loop
/// between two synchronizations. Returns the seconds per call and the count.
fn time_on_gpu(mut f: impl FnMut()) -> (f64, usize) {
    let dev = anneal_engine::cuda::gpu(0).expect("gpu");
    f();
    dev.synchronize().expect("sync");
    let t = Instant::now();
    f();
    dev.synchronize().expect("sync");
    let one = t.elapsed().as_secs_f64();
    let iters = match std::env::var("ANNEAL_BENCH_ITERS") {
        Ok(_) => env_usize("ANNEAL_BENCH_ITERS", 1).max(1),
        Err(_) => ((1.0 / one.max(1e-6)) as usize).clamp(2, 20),
    };
    let t = Instant::now();
    for _ in 0..iters {
        f();
    }
    dev.synchronize().expect("sync");
    (t.elapsed().as_secs_f64() / iters as f64, iters)
}

/// bf16 causal attention, forward + backward (autograd through the public op, as a training
/// step runs it), batch 1, `ANNEAL_BENCH_HEADS` heads (16) of `ANNEAL_BENCH_HEAD_DIM` (128),
/// at each length of `ANNEAL_BENCH_SEQS` (4096, 8192, 16384). FLOPs as FlashAttention counts
/// them: forward `4·B·H·T²·D`, halved for the causal mask; backward 2.5 times the forward.
#[test]
#[ignore = "a benchmark: run by bench/gpu_check.sh on a GPU"]
fn attention_speed() {
    if !gpu_or_skip("attention_speed") {
        return;
    }
    let (b, h) = (1usize, env_usize("ANNEAL_BENCH_HEADS", 16));
    let d = env_usize("ANNEAL_BENCH_HEAD_DIM", 128);
    let params = AttentionParams::causal();
    for (i, t) in env_list("ANNEAL_BENCH_SEQS", "4096,8192,16384")
        .into_iter()
        .enumerate()
    {
        let seed = 10 * i as u64;
        let shape = [b, h, t, d];
        let q = device_bf16(&shape, seed, 1.0).requires_grad_();
        let k = device_bf16(&shape, seed + 1, 1.0).requires_grad_();
        let v = device_bf16(&shape, seed + 2, 1.0).requires_grad_();
        let g = device_bf16(&shape, seed + 3, 1.0);
        let (fwd, _) = time_on_gpu(|| {
            let _no_grad = anneal_engine::autograd::no_grad();
            q.attention(&k, &v, &params).expect("attention");
        });
        let (step, iters) = time_on_gpu(|| {
            for x in [&q, &k, &v] {
                x.zero_grad();
            }
            let out = q.attention(&k, &v, &params).expect("attention");
            out.backward_with(g.clone()).expect("attention backward");
        });
        let grad = q.grad().expect("q has a gradient");
        assert_eq!(grad.shape(), &shape, "dq");
        let flops_fwd = 4.0 * (b * h * d) as f64 * (t as f64).powi(2) / 2.0;
        println!(
            "attention bf16 causal seq={t} heads={h} dim={d}: fwd+bwd {:.3} ms, {:.1} TFLOP/s (fwd {:.3} ms, {:.1} TFLOP/s; {iters} iterations)",
            step * 1e3,
            3.5 * flops_fwd / step / 1e12,
            fwd * 1e3,
            flops_fwd / fwd / 1e12,
        );
    }
}

/// A DeepSeek-V3-like MoE layer, forward + backward through `moe_ffn` in bf16: 64 experts
/// (V3's 256 over 4 expert-parallel ranks), sigmoid router with the top 8 renormalised and
/// scaled by 2.5, SwiGLU experts of hidden 7168 and width 2048, 8192 tokens (each of
/// `ANNEAL_BENCH_EXPERTS`, `_TOPK`, `_HIDDEN`, `_FFN`, `_TOKENS` overrides its number). The
/// router is f32 (as `moe_ffn` computes it). FLOPs are the experts' three products,
/// `2·tokens·topk·hidden·ffn` each forward, the backward twice the forward (the router's
/// `tokens·hidden·experts` are left out, on both sides).
#[test]
#[ignore = "a benchmark: run by bench/gpu_check.sh on a GPU"]
fn moe_speed() {
    if !gpu_or_skip("moe_speed") {
        return;
    }
    let n = env_usize("ANNEAL_BENCH_TOKENS", 8192);
    let e = env_usize("ANNEAL_BENCH_EXPERTS", 64);
    let k = env_usize("ANNEAL_BENCH_TOPK", 8);
    let d = env_usize("ANNEAL_BENCH_HIDDEN", 7168);
    let f = env_usize("ANNEAL_BENCH_FFN", 2048);
    let x = device_bf16(&[n, d], 50, 1.0).requires_grad_();
    let router = device_bf16(&[d, e], 51, 1.0 / (d as f32).sqrt())
        .to_dtype(DType::F32)
        .expect("f32 router")
        .requires_grad_();
    let gate = device_bf16(&[e, d, f], 52, 1.0 / (d as f32).sqrt()).requires_grad_();
    let up = device_bf16(&[e, d, f], 53, 1.0 / (d as f32).sqrt()).requires_grad_();
    let down = device_bf16(&[e, f, d], 54, 1.0 / (f as f32).sqrt()).requires_grad_();
    let g = device_bf16(&[n, d], 55, 1.0);
    let spec = MoeSpec::new(RouterSpec {
        num_experts: e,
        top_k: k,
        score: RouterScore::Sigmoid,
        renormalize: true,
        route_scale: 2.5,
        groups: None,
    });
    let w = MoeWeights::new(&router, &gate, &up, &down);
    let mut counts: Vec<usize> = Vec::new();
    let (fwd, _) = time_on_gpu(|| {
        let _no_grad = anneal_engine::autograd::no_grad();
        let out = moe_ffn(&x, &w, &spec).expect("moe_ffn");
        counts = out
            .counts
            .to_vec::<i64>()
            .into_iter()
            .map(|c| c as usize)
            .collect();
    });
    let (step, iters) = time_on_gpu(|| {
        for p in [&x, &router, &gate, &up, &down] {
            p.zero_grad();
        }
        let y = moe_ffn(&x, &w, &spec).expect("moe_ffn");
        y.out.backward_with(g.clone()).expect("moe backward");
    });
    assert_eq!(
        counts.iter().sum::<usize>(),
        n * k,
        "every token routed k times"
    );
    assert_eq!(gate.grad().expect("gate grad").shape(), &[e, d, f]);
    let (lo, hi) = (
        counts.iter().min().copied().unwrap_or(0),
        counts.iter().max().copied().unwrap_or(0),
    );
    let flops_fwd = 3.0 * 2.0 * (n * k) as f64 * (d * f) as f64;
    println!(
        "moe bf16 tokens={n} experts={e} topk={k} hidden={d} ffn={f}: fwd+bwd {:.3} ms, {:.1} TFLOP/s (fwd {:.3} ms, {:.1} TFLOP/s; rows per expert {lo}..{hi}; {iters} iterations)",
        step * 1e3,
        3.0 * flops_fwd / step / 1e12,
        fwd * 1e3,
        flops_fwd / fwd / 1e12,
    );
}

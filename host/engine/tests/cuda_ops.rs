//! Every CUDA op against the CPU backend on the same inputs. Needs a GPU with the driver,
//! cuBLAS and NVRTC, or the CPU's emulation of one (tools/cuda-emu, run by scripts/test.sh);
//! elsewhere each test prints SKIP with what is missing and passes, unless
//! `ANNEAL_REQUIRE_CUDA=1` makes a missing device a failure.
#![cfg(feature = "cuda")]

use anneal_engine::{DType, Device, Tensor};

const GPU: Device = Device::Cuda(0);

/// `true` when CUDA device 0 can run ops; else prints why not.
fn gpu_or_skip(test: &str) -> bool {
    match anneal_engine::cuda::probe(0) {
        Ok(_) => true,
        Err(why) => {
            assert!(
                std::env::var("ANNEAL_REQUIRE_CUDA").as_deref() != Ok("1"),
                "ANNEAL_REQUIRE_CUDA=1 but {why}"
            );
            println!("SKIP {test}: {why}");
            false
        }
    }
}

/// Deterministic pseudo-random values in [-scale, scale).
fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

fn rand(shape: &[usize], seed: u64) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_slice(&values(n, seed, 2.0), shape).expect("sized")
}

fn gpu(t: &Tensor) -> Tensor {
    t.to_device(GPU).expect("copy to the GPU")
}

/// Asserts `got` (any device) matches `want` (CPU) within `tol` relative to the largest value.
fn close(what: &str, got: &Tensor, want: &Tensor, tol: f32) {
    assert_eq!(got.shape(), want.shape(), "{what}: shapes");
    let (g, w) = (got.to_vec_f32(), want.to_vec_f32());
    let scale = w.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert!(
            (a - b).abs() <= tol * scale,
            "{what}[{i}]: cuda {a} vs cpu {b}"
        );
    }
}

#[test]
fn copies_round_trip_exactly() {
    if !gpu_or_skip("copies_round_trip_exactly") {
        return;
    }
    let x = rand(&[3, 5, 7], 1);
    let back = gpu(&x).to_device(Device::Cpu).expect("back");
    assert_eq!(back.to_vec_f32(), x.to_vec_f32());
    let xt = x.transpose(0, 2).expect("view");
    close(
        "strided copy",
        &gpu(&x)
            .transpose(0, 2)
            .expect("view")
            .contiguous()
            .expect("copy"),
        &xt,
        0.0,
    );
    // Large enough for the pinned, double-buffered staging path (several 8 MiB chunks and a
    // partial last one).
    let big = Tensor::from_vec(values(5_300_001, 11, 3.0), &[5_300_001]).expect("big");
    let back = gpu(&big).to_device(Device::Cpu).expect("back");
    assert!(
        back.to_vec_f32() == big.to_vec_f32(),
        "a staged round trip changed values"
    );
    let b = x.to_dtype(DType::BF16).expect("bf16");
    close(
        "cast to bf16",
        &gpu(&x).to_dtype(DType::BF16).expect("cast"),
        &b,
        0.0,
    );
}

#[test]
fn elementwise_ops_match_the_cpu() {
    if !gpu_or_skip("elementwise_ops_match_the_cpu") {
        return;
    }
    let (a, b) = (rand(&[64, 33], 2), rand(&[64, 33], 3));
    let (ga, gb) = (gpu(&a), gpu(&b));
    close(
        "add",
        &ga.add(&gb).expect("add"),
        &a.add(&b).expect("add"),
        1e-6,
    );
    close(
        "mul",
        &ga.mul(&gb).expect("mul"),
        &a.mul(&b).expect("mul"),
        1e-6,
    );
    close("exp", &ga.exp().expect("exp"), &a.exp().expect("exp"), 1e-5);
    close(
        "silu",
        &ga.silu().expect("silu"),
        &a.silu().expect("silu"),
        1e-5,
    );
    close(
        "tanh",
        &ga.tanh().expect("tanh"),
        &a.tanh().expect("tanh"),
        1e-5,
    );
    let row = rand(&[1, 33], 4);
    close(
        "broadcast add",
        &ga.add(&gpu(&row)).expect("add"),
        &a.add(&row).expect("add"),
        1e-6,
    );
    // Comparison masks are computed on the device (and stay there), equal to the CPU's; ties
    // come from comparing a tensor with itself broadcast against a row of it.
    let tie = a.narrow(0, 5, 1).expect("row");
    for (name, got, want) in [
        ("ge", ga.ge(&gpu(&row)), a.ge(&row)),
        ("le", ga.le(&gb), a.le(&b)),
        ("eq", ga.eq_mask(&gpu(&tie)), a.eq_mask(&tie)),
    ] {
        let got = got.expect(name);
        assert_eq!(got.device(), GPU, "{name} stays on the GPU");
        close(name, &got, &want.expect(name), 0.0);
    }
    // clamp's gradient masks on the device too.
    let x = ga.detach().requires_grad_();
    x.clamp(-0.25, 0.5)
        .expect("clamp")
        .sum_all()
        .expect("sum")
        .backward()
        .expect("backward");
    let want: Vec<f32> = a
        .to_vec_f32()
        .iter()
        .map(|&v| f32::from(u8::from((-0.25..=0.5).contains(&v))))
        .collect();
    assert_eq!(x.grad().expect("grad").to_vec_f32(), want);
}

#[test]
fn reductions_match_the_cpu() {
    if !gpu_or_skip("reductions_match_the_cpu") {
        return;
    }
    let x = rand(&[16, 300, 5], 5);
    let g = gpu(&x);
    for dim in 0..3 {
        let d = dim as isize;
        close(
            "sum",
            &g.sum_dims(&[d], true).expect("sum"),
            &x.sum_dims(&[d], true).expect("sum"),
            1e-5,
        );
        close(
            "max",
            &g.max_dim(d, true).expect("max"),
            &x.max_dim(d, true).expect("max"),
            0.0,
        );
    }
}

#[test]
fn matmul_matches_the_cpu() {
    if !gpu_or_skip("matmul_matches_the_cpu") {
        return;
    }
    let (a, b) = (rand(&[2, 65, 130], 6), rand(&[2, 130, 47], 7));
    close(
        "matmul f32",
        &gpu(&a).matmul(&gpu(&b)).expect("matmul"),
        &a.matmul(&b).expect("matmul"),
        1e-5,
    );
    let (ab, bb) = (
        a.to_dtype(DType::BF16).expect("bf16"),
        b.to_dtype(DType::BF16).expect("bf16"),
    );
    close(
        "matmul bf16",
        &gpu(&ab).matmul(&gpu(&bb)).expect("matmul"),
        &ab.matmul(&bb).expect("matmul"),
        2e-2,
    );
}

#[test]
fn fused_ops_match_the_cpu() {
    if !gpu_or_skip("fused_ops_match_the_cpu") {
        return;
    }
    let x = rand(&[8, 1000], 8);
    close(
        "softmax",
        &gpu(&x).softmax(-1).expect("softmax"),
        &x.softmax(-1).expect("softmax"),
        1e-5,
    );
    let w = rand(&[1000], 9);
    close(
        "rms_norm",
        &gpu(&x).rms_norm(Some(&gpu(&w)), 1e-5).expect("rms_norm"),
        &x.rms_norm(Some(&w), 1e-5).expect("rms_norm"),
        1e-5,
    );
    let targets = Tensor::from_slice(&[1i64, 5, 999, 0, 7, 3, 2, 10], &[8]).expect("targets");
    close(
        "cross_entropy",
        &gpu(&x)
            .cross_entropy(&gpu(&targets), &Default::default())
            .expect("ce"),
        &x.cross_entropy(&targets, &Default::default()).expect("ce"),
        1e-5,
    );
}

#[test]
fn a_case_without_a_cuda_kernel_is_an_error_naming_it() {
    if !gpu_or_skip("a_case_without_a_cuda_kernel_is_an_error_naming_it") {
        return;
    }
    use anneal_engine::ops::{RopeLayout, RopeSpec, RopeStyle};
    // An odd head dim has no rotary pairs the CUDA kernel handles.
    let (x, cs) = (gpu(&rand(&[1, 1, 2, 3], 10)), gpu(&rand(&[2, 1], 11)));
    let spec = RopeSpec {
        style: RopeStyle::HalfSplit,
        layout: RopeLayout::Bhtd,
    };
    let err = anneal_engine::backend::fused_backend_for(GPU)
        .expect("cuda")
        .rope(&x, &cs, &cs, spec, false)
        .expect_err("no CUDA kernel for an odd head dim");
    assert!(err.to_string().contains("rope"), "{err}");
}

/// Index, selection, dropout, LayerNorm and MoE kernels.
#[path = "cuda/index_moe.rs"]
mod index_moe;

/// Batch-invariant mode: products and attention rows as in a decode step.
#[path = "cuda/invariant.rs"]
mod invariant;

/// The tiled attention kernel.
#[path = "cuda/attention_tiled.rs"]
mod attention_tiled;

/// What a training step needs beyond single ops: autograd on GPU tensors, writes into GPU
/// views, host constants beside GPU operands, checkpoint bytes.
#[path = "cuda/training.rs"]
mod training;

/// The tensor-core (wmma) product against the CPU, b row- and column-major.
#[path = "cuda/wmma.rs"]
mod wmma;

/// The tensor-core attention forward (bf16).
#[path = "cuda/attention_wmma.rs"]
mod attention_wmma;

/// The one-launch grouped expert GEMM with counts on the device, forward and weight gradient.
#[path = "cuda/moe_gemm.rs"]
mod moe_gemm;

/// The gated delta rule's kernels: forward, backward and decode.
#[path = "cuda/delta_rule.rs"]
mod delta_rule;

/// Gathered sparse attention (DeepSeek-V4's CSA/HCA): forward and gradients against the CPU op.
#[path = "cuda/gathered.rs"]
mod gathered;

/// The engine's side of bench/gpu_check.sh's speed table: attention and MoE fwd+bwd (ignored).
#[path = "cuda/bench.rs"]
mod bench;

/// The CPU and CUDA kernels behind the fused ops, called directly (their backwards included).
mod kernels {
    use super::*;
    use anneal_engine::backend::{
        backend_for, fused_backend_for, fusion_backend_for, optim_backend_for,
    };
    use anneal_engine::ops::{AdamW, AdamWTensors, ReduceOp, RopeLayout, RopeSpec, RopeStyle};

    #[test]
    fn backward_kernels_match_the_cpu() {
        if !gpu_or_skip("backward_kernels_match_the_cpu") {
            return;
        }
        let (cpu, cuda) = (
            fused_backend_for(Device::Cpu).expect("cpu"),
            fused_backend_for(GPU).expect("cuda"),
        );
        let (x, g, w) = (rand(&[6, 300], 20), rand(&[6, 300], 21), rand(&[300], 22));
        let (y_c, _) = (cpu.softmax(&x, 1, false).expect("cpu"), ());
        let y_g = cuda.softmax(&gpu(&x), 1, false).expect("cuda");
        close("softmax", &y_g, &y_c, 1e-5);
        for log in [false, true] {
            let y = cpu.softmax(&x, 1, log).expect("cpu");
            close(
                "softmax_backward",
                &cuda
                    .softmax_backward(&gpu(&y), &gpu(&g), 1, log)
                    .expect("cuda"),
                &cpu.softmax_backward(&y, &g, 1, log).expect("cpu"),
                1e-5,
            );
        }
        // Over a dim that is not the last (scores over keys held in dim -2).
        let (x3, g3) = (rand(&[3, 7, 5], 23), rand(&[3, 7, 5], 24));
        for log in [false, true] {
            let y = cpu.softmax(&x3, 1, log).expect("cpu");
            close(
                "softmax over dim 1",
                &cuda.softmax(&gpu(&x3), 1, log).expect("cuda"),
                &y,
                1e-5,
            );
            close(
                "softmax_backward over dim 1",
                &cuda
                    .softmax_backward(&gpu(&y), &gpu(&g3), 1, log)
                    .expect("cuda"),
                &cpu.softmax_backward(&y, &g3, 1, log).expect("cpu"),
                1e-5,
            );
        }
        let (o_c, r_c) = cpu.rms_norm(&x, Some(&w), 1e-6).expect("cpu");
        let (o_g, r_g) = cuda.rms_norm(&gpu(&x), Some(&gpu(&w)), 1e-6).expect("cuda");
        close("rms_norm", &o_g, &o_c, 1e-5);
        close("rms_norm rstd", &r_g, &r_c, 1e-5);
        let (dx_c, dw_c) = cpu
            .rms_norm_backward(&x, Some(&w), &r_c, &g, true)
            .expect("cpu");
        let (dx_g, dw_g) = cuda
            .rms_norm_backward(&gpu(&x), Some(&gpu(&w)), &r_g, &gpu(&g), true)
            .expect("cuda");
        close("rms_norm dx", &dx_g, &dx_c, 1e-5);
        close("rms_norm dw", &dw_g.expect("dw"), &dw_c.expect("dw"), 1e-5);

        let targets = Tensor::from_slice(&[3i64, -100, 299, 0, 7, 150], &[6]).expect("targets");
        let (l_c, z_c) = cpu
            .cross_entropy(&x, &targets, Some(-100), 0.1)
            .expect("cpu");
        let (l_g, z_g) = cuda
            .cross_entropy(&gpu(&x), &gpu(&targets), Some(-100), 0.1)
            .expect("cuda");
        close("cross_entropy", &l_g, &l_c, 1e-5);
        let scale = Tensor::from_slice(&[0.2f32, 0.0, 0.2, 0.2, 0.2, 0.2], &[6]).expect("scale");
        close(
            "cross_entropy_backward",
            &cuda
                .cross_entropy_backward(
                    &gpu(&x),
                    &gpu(&targets),
                    &z_g,
                    &gpu(&scale),
                    Some(-100),
                    0.1,
                )
                .expect("cuda"),
            &cpu.cross_entropy_backward(&x, &targets, &z_c, &scale, Some(-100), 0.1)
                .expect("cpu"),
            1e-5,
        );
    }

    #[test]
    fn rope_embedding_swiglu_and_adamw_match_the_cpu() {
        if !gpu_or_skip("rope_embedding_swiglu_and_adamw_match_the_cpu") {
            return;
        }
        let (cpu, cuda) = (
            fused_backend_for(Device::Cpu).expect("cpu"),
            fused_backend_for(GPU).expect("cuda"),
        );
        let x = rand(&[2, 3, 5, 16], 30);
        let (cos, sin) = (rand(&[5, 6], 31), rand(&[5, 6], 32));
        for style in [RopeStyle::Interleaved, RopeStyle::HalfSplit] {
            for layout in [RopeLayout::Bhtd, RopeLayout::Bthd] {
                for inverse in [false, true] {
                    let spec = RopeSpec { style, layout };
                    close(
                        "rope",
                        &cuda
                            .rope(&gpu(&x), &gpu(&cos), &gpu(&sin), spec, inverse)
                            .expect("cuda"),
                        &cpu.rope(&x, &cos, &sin, spec, inverse).expect("cpu"),
                        1e-6,
                    );
                }
            }
        }
        let table = rand(&[50, 24], 33);
        let ids = Tensor::from_slice(&[3i64, 7, 3, 49, 0, 3, 7, 11], &[2, 4]).expect("ids");
        close(
            "embedding",
            &cuda.embedding(&gpu(&table), &gpu(&ids)).expect("cuda"),
            &cpu.embedding(&table, &ids).expect("cpu"),
            0.0,
        );
        let g = rand(&[2, 4, 24], 34);
        close(
            "embedding_backward",
            &cuda
                .embedding_backward(&gpu(&ids), &gpu(&g), 50, DType::F32)
                .expect("cuda"),
            &cpu.embedding_backward(&ids, &g, 50, DType::F32)
                .expect("cpu"),
            1e-6,
        );
        let (fc, fg) = (
            fusion_backend_for(Device::Cpu).expect("cpu"),
            fusion_backend_for(GPU).expect("cuda"),
        );
        let (a, b, d) = (rand(&[7, 33], 35), rand(&[7, 33], 36), rand(&[7, 33], 37));
        close(
            "swiglu",
            &fg.swiglu(&gpu(&a), &gpu(&b)).expect("cuda"),
            &fc.swiglu(&a, &b).expect("cpu"),
            1e-5,
        );
        let (ga, gb) = fg
            .swiglu_backward(&gpu(&a), &gpu(&b), &gpu(&d))
            .expect("cuda");
        let (ca, cb) = fc.swiglu_backward(&a, &b, &d).expect("cpu");
        close("swiglu d gate", &ga, &ca, 1e-5);
        close("swiglu d up", &gb, &cb, 1e-5);

        // AdamW over two tensors of different sizes, in place on both devices.
        let hp = AdamW {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            step: 3,
        };
        let shapes = [vec![40_000usize], vec![3, 7]];
        let mk = |s: &[usize], seed| rand(s, seed);
        let cpu_t: Vec<[Tensor; 4]> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let v = mk(s, 40 + i as u64).abs().expect("abs");
                [
                    mk(s, 50 + i as u64),
                    mk(s, 60 + i as u64),
                    mk(s, 70 + i as u64),
                    v,
                ]
            })
            .collect();
        let gpu_t: Vec<[Tensor; 4]> = cpu_t.iter().map(|ts| ts.clone().map(|t| gpu(&t))).collect();
        let groups = |ts: &[[Tensor; 4]]| -> Vec<[Tensor; 4]> { ts.to_vec() };
        let run = |ts: &[[Tensor; 4]], dev: Device| {
            let gs: Vec<AdamWTensors<'_>> = ts
                .iter()
                .map(|[p, g, m, v]| AdamWTensors {
                    param: p,
                    grad: g,
                    exp_avg: m,
                    exp_avg_sq: v,
                })
                .collect();
            optim_backend_for(dev)
                .expect("backend")
                .adamw(&gs, &hp)
                .expect("adamw");
        };
        run(&groups(&cpu_t), Device::Cpu);
        run(&groups(&gpu_t), GPU);
        for (c, g) in cpu_t.iter().zip(&gpu_t) {
            for k in [0, 2, 3] {
                close("adamw", &g[k], &c[k], 1e-5);
            }
        }
        let _ = (backend_for(GPU).expect("cuda"), ReduceOp::Sum);
    }

    #[test]
    fn attention_forward_and_backward_match_the_cpu() {
        if !gpu_or_skip("attention_forward_and_backward_match_the_cpu") {
            return;
        }
        use anneal_engine::ops::AttentionSpec;
        let (cpu, cuda) = (
            backend_for(Device::Cpu).expect("cpu"),
            backend_for(GPU).expect("cuda"),
        );
        let (b, hq, hkv, t, d) = (2, 4, 2, 37, 16);
        let (q, k, v) = (
            rand(&[b, hq, t, d], 100),
            rand(&[b, hkv, t, d], 101),
            rand(&[b, hkv, t, d], 102),
        );
        let g = rand(&[b, hq, t, d], 103);
        let sinks = rand(&[hq], 104);
        let pos: Vec<i64> = (0..t as i64).collect();
        let specs = [
            (false, None, None, false),
            (true, None, None, false),
            (true, Some(8), None, true),
            (true, None, Some(5.0), true),
        ];
        for (causal, window, softcap, with_sinks) in specs {
            let spec = AttentionSpec {
                scale: 0.25,
                causal,
                window,
                softcap,
                q_pos: pos.clone(),
                k_pos: pos.clone(),
            };
            let what = format!("attention causal={causal} window={window:?} softcap={softcap:?} sinks={with_sinks}");
            let sk = with_sinks.then_some(&sinks);
            let sg = sk.map(gpu);
            let (o_c, l_c) = cpu.attention(&q, &k, &v, sk, &spec).expect("cpu");
            let (o_g, l_g) = cuda
                .attention(&gpu(&q), &gpu(&k), &gpu(&v), sg.as_ref(), &spec)
                .expect("cuda");
            close(&format!("{what}: out"), &o_g, &o_c, 1e-5);
            close(&format!("{what}: lse"), &l_g, &l_c, 1e-5);
            let gc = cpu
                .attention_backward(&q, &k, &v, sk, &o_c, &l_c, &g, &spec)
                .expect("cpu");
            let gg = cuda
                .attention_backward(
                    &gpu(&q),
                    &gpu(&k),
                    &gpu(&v),
                    sg.as_ref(),
                    &o_g,
                    &l_g,
                    &gpu(&g),
                    &spec,
                )
                .expect("cuda");
            close(&format!("{what}: dq"), &gg.q, &gc.q, 1e-4);
            close(&format!("{what}: dk"), &gg.k, &gc.k, 1e-4);
            close(&format!("{what}: dv"), &gg.v, &gc.v, 1e-4);
            if with_sinks {
                close(
                    &format!("{what}: dsinks"),
                    &gg.sinks.expect("ds"),
                    &gc.sinks.expect("ds"),
                    1e-4,
                );
            }
        }
    }

    #[test]
    fn results_are_bitwise_reproducible() {
        if !gpu_or_skip("results_are_bitwise_reproducible") {
            return;
        }
        let cuda = backend_for(GPU).expect("cuda");
        let x = gpu(&rand(&[64, 4096], 80));
        let w = gpu(&rand(&[4096, 512], 81));
        let once = || -> Vec<u32> {
            let y = cuda.matmul(&x, &w).expect("matmul");
            let s = cuda.reduce(ReduceOp::Sum, &y, 0).expect("sum");
            let r = cuda.reduce(ReduceOp::Sum, &x, 1).expect("sum");
            let mut bits: Vec<u32> = s.to_vec_f32().iter().map(|v| v.to_bits()).collect();
            bits.extend(r.to_vec_f32().iter().map(|v| v.to_bits()));
            bits
        };
        assert_eq!(once(), once(), "two runs of the same ops differ");
    }

    /// bf16 GEMM throughput through the engine (cuBLAS, 8192³), for bench/gpu_check.sh:
    /// `cuda_ops --ignored --nocapture gemm_tflops`.
    #[test]
    #[ignore = "a benchmark: run by bench/gpu_check.sh on a GPU"]
    fn gemm_tflops() {
        if !gpu_or_skip("gemm_tflops") {
            return;
        }
        let n = 8192usize;
        let cuda = backend_for(GPU).expect("cuda");
        let dev = anneal_engine::cuda::gpu(0).expect("gpu");
        for dtype in [DType::BF16, DType::F32] {
            let a = gpu(&Tensor::from_vec(values(n * n, 90, 1.0), &[n, n]).expect("a"))
                .to_dtype(dtype)
                .expect("cast");
            let b = gpu(&Tensor::from_vec(values(n * n, 91, 1.0), &[n, n]).expect("b"))
                .to_dtype(dtype)
                .expect("cast");
            for _ in 0..3 {
                cuda.matmul(&a, &b).expect("warm-up");
            }
            dev.synchronize().expect("sync");
            let iters = 20;
            let t = std::time::Instant::now();
            for _ in 0..iters {
                cuda.matmul(&a, &b).expect("matmul");
            }
            dev.synchronize().expect("sync");
            let s = t.elapsed().as_secs_f64() / iters as f64;
            let tflops = 2.0 * (n as f64).powi(3) / s / 1e12;
            println!(
                "GEMM {dtype} {n}^3 engine (cuBLAS): {tflops:.1} TFLOP/s ({:.3} ms)",
                s * 1e3
            );
        }
        let m = dev.memory_stats();
        println!(
            "device allocator: allocated {} MiB, reserved {} MiB, peak {} MiB, {} mallocs, {} reuses",
            m.allocated >> 20,
            m.reserved >> 20,
            m.peak >> 20,
            m.mallocs,
            m.reuses
        );
    }
}

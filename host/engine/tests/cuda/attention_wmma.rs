//! The tensor-core attention (kernels/flash_wmma.cu, bf16), forward and backward, against the CPU
//! backend on the same bf16 inputs and against the tiled kernel it replaces (part of the
//! `cuda_ops` test binary). Tolerances: the output within 1e-2 of the largest value (bf16
//! outputs, and P rounded to bf16 before P·V), the logsumexp within 1e-5 (f32 from f32 scores),
//! the gradients within 2e-2 (P and dS rounded to bf16 for their products).

use super::*;
use anneal_engine::backend::backend_for;
use anneal_engine::cuda::attention::{
    backward_with, forward_kernel_for, forward_with, AttentionKernel,
};
use anneal_engine::ops::AttentionSpec;

fn bf16(shape: &[usize], seed: u64) -> Tensor {
    rand(shape, seed).to_dtype(DType::BF16).expect("bf16")
}

fn spec(
    causal: bool,
    window: Option<usize>,
    softcap: Option<f32>,
    tq: usize,
    tk: usize,
) -> AttentionSpec {
    AttentionSpec {
        scale: 0.2,
        causal,
        window,
        softcap,
        // Queries at the end of the keys, as in decoding with a cache.
        q_pos: ((tk - tq) as i64..tk as i64).collect(),
        k_pos: (0..tk as i64).collect(),
    }
}

#[test]
fn tensor_core_attention_matches_the_cpu_and_the_tiled_kernel_in_bf16() {
    if !gpu_or_skip("tensor_core_attention_matches_the_cpu_and_the_tiled_kernel_in_bf16") {
        return;
    }
    let cpu = backend_for(Device::Cpu).expect("cpu");
    // Partial query and key tiles (70 = 64 + 6 rows, 100 = 3 · 32 + 4 keys), GQA 4:2, and
    // D ≠ Dv; every mask / cap / sink combination.
    let (b, hq, hkv, tq, tk) = (2, 4, 2, 70, 100);
    for (i, (d, dv)) in [(32, 48), (64, 64)].into_iter().enumerate() {
        let seed = 400 + 10 * i as u64;
        let (q, k, v) = (
            bf16(&[b, hq, tq, d], seed),
            bf16(&[b, hkv, tk, d], seed + 1),
            bf16(&[b, hkv, tk, dv], seed + 2),
        );
        let sinks = rand(&[hq], seed + 3);
        let (gq, gk, gv) = (gpu(&q), gpu(&k), gpu(&v));
        for (causal, window, softcap, with_sinks) in [
            (false, None, None, false),
            (true, None, None, false),
            (true, Some(9), None, true),
            (true, None, Some(5.0), true),
        ] {
            let spec = spec(causal, window, softcap, tq, tk);
            let what = format!(
                "tensor-core d={d} dv={dv} causal={causal} window={window:?} softcap={softcap:?} sinks={with_sinks}"
            );
            let sk = with_sinks.then_some(&sinks);
            let sg = sk.map(gpu);
            let (o_c, l_c) = cpu.attention(&q, &k, &v, sk, &spec).expect("cpu");
            let (o_w, l_w) = forward_with(
                AttentionKernel::TensorCore,
                &gq,
                &gk,
                &gv,
                sg.as_ref(),
                &spec,
            )
            .expect("tensor-core");
            let (o_t, l_t) =
                forward_with(AttentionKernel::Tiled, &gq, &gk, &gv, sg.as_ref(), &spec)
                    .expect("tiled");
            assert_eq!(o_w.dtype(), DType::BF16, "{what}: out dtype");
            close(&format!("{what}: out vs cpu"), &o_w, &o_c, 1e-2);
            close(&format!("{what}: lse vs cpu"), &l_w, &l_c, 1e-5);
            close(&format!("{what}: out vs tiled"), &o_w, &o_t, 1e-2);
            close(&format!("{what}: lse vs tiled"), &l_w, &l_t, 1e-5);
        }
    }
}

#[test]
fn tensor_core_attention_backward_matches_the_cpu_and_the_tiled_kernel() {
    if !gpu_or_skip("tensor_core_attention_backward_matches_the_cpu_and_the_tiled_kernel") {
        return;
    }
    let cpu = backend_for(Device::Cpu).expect("cpu");
    // Partial tiles of both kernels (70 queries: 2 · 32 + 6; 100 keys: 64 + 36), GQA 4:2 (the
    // dk/dv kernel sums a key head's two query heads), D ≠ Dv, every mask / cap / sink.
    let (b, hq, hkv, tq, tk) = (2, 4, 2, 70, 100);
    for (i, (d, dv)) in [(32, 48), (64, 16)].into_iter().enumerate() {
        let seed = 500 + 10 * i as u64;
        let (q, k, v) = (
            bf16(&[b, hq, tq, d], seed),
            bf16(&[b, hkv, tk, d], seed + 1),
            bf16(&[b, hkv, tk, dv], seed + 2),
        );
        let grad = bf16(&[b, hq, tq, dv], seed + 4);
        let sinks = rand(&[hq], seed + 3);
        let (gq, gk, gv, gg) = (gpu(&q), gpu(&k), gpu(&v), gpu(&grad));
        for (causal, window, softcap, with_sinks) in [
            (false, None, None, false),
            (true, None, None, false),
            (true, Some(9), None, true),
            (true, None, Some(5.0), true),
        ] {
            let spec = spec(causal, window, softcap, tq, tk);
            let what = format!(
                "tensor-core backward d={d} dv={dv} causal={causal} window={window:?} softcap={softcap:?} sinks={with_sinks}"
            );
            let sk = with_sinks.then_some(&sinks);
            let sg = sk.map(gpu);
            // One forward's output and logsumexp for every backward.
            let (o, l) = cpu.attention(&q, &k, &v, sk, &spec).expect("cpu");
            let (go, gl) = (gpu(&o), gpu(&l));
            let want = cpu
                .attention_backward(&q, &k, &v, sk, &o, &l, &grad, &spec)
                .expect("cpu");
            let run = |kernel| {
                backward_with(kernel, &gq, &gk, &gv, sg.as_ref(), &go, &gl, &gg, &spec)
                    .expect("cuda backward")
            };
            let (wmma, tiled) = (
                run(AttentionKernel::TensorCore),
                run(AttentionKernel::Tiled),
            );
            for (name, w, c, t) in [
                ("dq", &wmma.q, &want.q, &tiled.q),
                ("dk", &wmma.k, &want.k, &tiled.k),
                ("dv", &wmma.v, &want.v, &tiled.v),
            ] {
                close(&format!("{what}: {name} vs cpu"), w, c, 2e-2);
                close(&format!("{what}: {name} vs tiled"), w, t, 2e-2);
            }
            if with_sinks {
                let (ws, cs) = (wmma.sinks.expect("sinks"), want.sinks.expect("sinks"));
                close(&format!("{what}: dsinks vs cpu"), &ws, &cs, 1e-4);
            }
        }
    }
}

#[test]
fn long_bf16_attention_runs_on_tensor_cores_and_refuses_what_they_cannot_hold() {
    let test = "long_bf16_attention_runs_on_tensor_cores_and_refuses_what_they_cannot_hold";
    if !gpu_or_skip(test) {
        return;
    }
    let arch = anneal_engine::cuda::gpu(0).expect("gpu").arch.clone();
    let (b, hq, hkv, t, d) = (1, 2, 1, 1024, 32);
    if forward_kernel_for(DType::BF16, &arch, t, d, d) != AttentionKernel::TensorCore {
        println!("SKIP {test}: {arch} has no bf16 tensor cores");
        return;
    }
    // The backend's own dispatch at the tiled kernel's length: causal, bf16.
    let (q, k, v) = (
        bf16(&[b, hq, t, d], 420),
        bf16(&[b, hkv, t, d], 421),
        bf16(&[b, hkv, t, d], 422),
    );
    let spec = spec(true, None, None, t, t);
    let (o_c, l_c) = backend_for(Device::Cpu)
        .expect("cpu")
        .attention(&q, &k, &v, None, &spec)
        .expect("cpu");
    let (o_g, l_g) = backend_for(GPU)
        .expect("cuda")
        .attention(&gpu(&q), &gpu(&k), &gpu(&v), None, &spec)
        .expect("cuda");
    close("long causal bf16: out", &o_g, &o_c, 1e-2);
    close("long causal bf16: lse", &l_g, &l_c, 1e-5);
    // Its backward too (the dispatch picks the tensor-core kernels for it as for the forward).
    let grad = bf16(&[b, hq, t, d], 428);
    let want = backend_for(Device::Cpu)
        .expect("cpu")
        .attention_backward(&q, &k, &v, None, &o_c, &l_c, &grad, &spec)
        .expect("cpu backward");
    let got = backend_for(GPU)
        .expect("cuda")
        .attention_backward(
            &gpu(&q),
            &gpu(&k),
            &gpu(&v),
            None,
            &gpu(&o_c),
            &gpu(&l_c),
            &gpu(&grad),
            &spec,
        )
        .expect("cuda backward");
    close("long causal bf16: dq", &got.q, &want.q, 2e-2);
    close("long causal bf16: dk", &got.k, &want.k, 2e-2);
    close("long causal bf16: dv", &got.v, &want.v, 2e-2);
    // A query view 8 elements (16 bytes) into its storage is copied to an aligned one.
    let small = spec_for(4);
    let (kq, vq) = (bf16(&[1, 1, 4, 16], 425), bf16(&[1, 1, 4, 16], 426));
    let flat = bf16(&[8 + 64], 427);
    let q_view = |t: &Tensor| {
        t.narrow(0, 8, 64)
            .expect("view")
            .reshape(&[1, 1, 4, 16])
            .expect("view")
    };
    let (o_c, _) = backend_for(Device::Cpu)
        .expect("cpu")
        .attention(&q_view(&flat), &kq, &vq, None, &small)
        .expect("cpu");
    let (o_w, _) = forward_with(
        AttentionKernel::TensorCore,
        &q_view(&gpu(&flat)),
        &gpu(&kq),
        &gpu(&vq),
        None,
        &small,
    )
    .expect("shifted q");
    close("tensor-core with an unaligned q", &o_w, &o_c, 1e-2);
    // f32 operands or head dims off the fragments' grid are the tiled kernel's.
    let f32_q = gpu(&rand(&[1, 1, 4, 16], 423));
    let err = forward_with(
        AttentionKernel::TensorCore,
        &f32_q,
        &f32_q,
        &f32_q,
        None,
        &small,
    )
    .expect_err("f32 refused")
    .to_string();
    assert!(err.contains("bf16"), "{err}");
    let odd = gpu(&bf16(&[1, 1, 4, 24], 424));
    let err = forward_with(AttentionKernel::TensorCore, &odd, &odd, &odd, None, &small)
        .expect_err("head dim 24 refused")
        .to_string();
    assert!(err.contains("multiples of 16"), "{err}");
}

fn spec_for(t: usize) -> AttentionSpec {
    spec(true, None, None, t, t)
}

//! The tiled (FlashAttention-style) CUDA attention kernel against the CPU backend and against the
//! exact CUDA kernel it replaces on long sequences (part of the `cuda_ops` test binary).
//! Tolerances: outputs and logsumexp 1e-5 of the largest value (online softmax rescales in
//! another order), gradients 1e-4 (as for the exact kernel).

use super::*;
use anneal_engine::backend::backend_for;
use anneal_engine::cuda::attention::{backward_with, forward_with, kernel_for, AttentionKernel};
use anneal_engine::ops::AttentionSpec;

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
fn tiled_attention_matches_the_cpu_and_the_exact_kernel() {
    if !gpu_or_skip("tiled_attention_matches_the_cpu_and_the_exact_kernel") {
        return;
    }
    let cpu = backend_for(Device::Cpu).expect("cpu");
    // Lengths that leave partial tiles, GQA 4:2, and every mask / cap / sink combination.
    let (b, hq, hkv, tq, tk, d) = (2, 4, 2, 37, 53, 24);
    let (q, k, v) = (
        rand(&[b, hq, tq, d], 200),
        rand(&[b, hkv, tk, d], 201),
        rand(&[b, hkv, tk, d], 202),
    );
    let g = rand(&[b, hq, tq, d], 203);
    let sinks = rand(&[hq], 204);
    for (causal, window, softcap, with_sinks) in [
        (false, None, None, false),
        (true, None, None, false),
        (true, Some(9), None, true),
        (true, None, Some(5.0), true),
    ] {
        let spec = spec(causal, window, softcap, tq, tk);
        let what = format!(
            "tiled causal={causal} window={window:?} softcap={softcap:?} sinks={with_sinks}"
        );
        let sk = with_sinks.then_some(&sinks);
        let sg = sk.map(gpu);
        let (gq, gk, gv, gg) = (gpu(&q), gpu(&k), gpu(&v), gpu(&g));
        let (o_c, l_c) = cpu.attention(&q, &k, &v, sk, &spec).expect("cpu");
        let (o_t, l_t) =
            forward_with(AttentionKernel::Tiled, &gq, &gk, &gv, sg.as_ref(), &spec).expect("tiled");
        let (o_e, l_e) =
            forward_with(AttentionKernel::Exact, &gq, &gk, &gv, sg.as_ref(), &spec).expect("exact");
        close(&format!("{what}: out vs cpu"), &o_t, &o_c, 1e-5);
        close(&format!("{what}: lse vs cpu"), &l_t, &l_c, 1e-5);
        close(&format!("{what}: out vs exact"), &o_t, &o_e, 1e-5);
        close(&format!("{what}: lse vs exact"), &l_t, &l_e, 1e-5);
        let gc = cpu
            .attention_backward(&q, &k, &v, sk, &o_c, &l_c, &g, &spec)
            .expect("cpu");
        let gt = backward_with(
            AttentionKernel::Tiled,
            &gq,
            &gk,
            &gv,
            sg.as_ref(),
            &o_t,
            &l_t,
            &gg,
            &spec,
        )
        .expect("tiled");
        close(&format!("{what}: dq"), &gt.q, &gc.q, 1e-4);
        close(&format!("{what}: dk"), &gt.k, &gc.k, 1e-4);
        close(&format!("{what}: dv"), &gt.v, &gc.v, 1e-4);
        if with_sinks {
            close(
                &format!("{what}: dsinks"),
                &gt.sinks.expect("ds"),
                &gc.sinks.expect("ds"),
                1e-4,
            );
        }
    }
}

#[test]
fn long_keys_past_the_exact_kernel_run_tiled() {
    if !gpu_or_skip("long_keys_past_the_exact_kernel_run_tiled") {
        return;
    }
    let (cpu, cuda) = (
        backend_for(Device::Cpu).expect("cpu"),
        backend_for(GPU).expect("cuda"),
    );
    // 20 000 keys: more scores than one row fits in shared memory, so only the tiled kernel
    // can run it (the exact one refuses); bf16 inputs as in training.
    let (tq, tk, d) = (8, 20_000, 64);
    assert_eq!(kernel_for(tk, d, d), AttentionKernel::Tiled);
    let (q, k, v) = (
        rand(&[1, 2, tq, d], 210),
        rand(&[1, 1, tk, d], 211),
        rand(&[1, 1, tk, d], 212),
    );
    let spec = spec(true, None, None, tq, tk);
    let (gq, gk, gv) = (gpu(&q), gpu(&k), gpu(&v));
    assert!(
        forward_with(AttentionKernel::Exact, &gq, &gk, &gv, None, &spec).is_err(),
        "the exact kernel holds a row of 20 000 scores"
    );
    let (o_c, l_c) = cpu.attention(&q, &k, &v, None, &spec).expect("cpu");
    let (o_g, l_g) = cuda.attention(&gq, &gk, &gv, None, &spec).expect("cuda");
    close("long attention out", &o_g, &o_c, 1e-5);
    close("long attention lse", &l_g, &l_c, 1e-5);
    let g = rand(&[1, 2, tq, d], 213);
    let gc = cpu
        .attention_backward(&q, &k, &v, None, &o_c, &l_c, &g, &spec)
        .expect("cpu");
    let gg = cuda
        .attention_backward(&gq, &gk, &gv, None, &o_g, &l_g, &gpu(&g), &spec)
        .expect("cuda");
    close("long attention dq", &gg.q, &gc.q, 1e-4);
    close("long attention dk", &gg.k, &gc.k, 1e-4);
    close("long attention dv", &gg.v, &gc.v, 1e-4);
    // bf16: the tiled kernel against the CPU on the same bf16 inputs (one bf16 rounding of the
    // output apart).
    let to = |t: &Tensor| t.to_dtype(DType::BF16).expect("bf16");
    let (qb, kb, vb) = (to(&q), to(&k), to(&v));
    let (o_c, _) = cpu.attention(&qb, &kb, &vb, None, &spec).expect("cpu");
    let (o_g, _) = cuda
        .attention(&gpu(&qb), &gpu(&kb), &gpu(&vb), None, &spec)
        .expect("cuda");
    close("long attention bf16 out", &o_g, &o_c, 1e-2);
}

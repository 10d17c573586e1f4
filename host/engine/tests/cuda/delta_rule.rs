//! The gated delta rule's kernels (kernels/delta_rule.cu) against the CPU backend: outputs, final
//! states and every input's gradient, for per-head decay with grouped key heads and per-channel
//! decay (KDA), sequences across the 64-token checkpoints, with and without an initial state,
//! value dims that leave threads of the last warp idle; and decode, the recurrence from a
//! cached state, continues the whole sequence's forward bit for bit.

use super::*;
use anneal_engine::ops::{gated_delta_rule, gated_delta_rule_recurrent, DeltaRuleParams};

/// `[q, k, v, g, beta, state?]` on the CPU.
fn inputs(
    (b, t, hk, hv, dk, dv): (usize, usize, usize, usize, usize, usize),
    per_channel: bool,
    with_state: bool,
    seed: u64,
) -> Vec<Tensor> {
    let scaled = |shape: &[usize], seed: u64, s: f32| {
        let n = shape.iter().product();
        Tensor::from_slice(&values(n, seed, s), shape).expect("sized")
    };
    let g_shape = if per_channel {
        vec![b, t, hv, dk]
    } else {
        vec![b, t, hv]
    };
    // Decays in (-0.5, 0): log factors; β in [0, 1).
    let g = scaled(&g_shape, seed + 3, 0.25)
        .affine(1.0, -0.25)
        .expect("g");
    let beta = scaled(&[b, t, hv], seed + 4, 0.5)
        .affine(1.0, 0.5)
        .expect("beta");
    let mut x = vec![
        scaled(&[b, t, hk, dk], seed, 1.0),
        scaled(&[b, t, hk, dk], seed + 1, 0.5),
        scaled(&[b, t, hv, dv], seed + 2, 1.0),
        g,
        beta,
    ];
    if with_state {
        x.push(scaled(&[b, hv, dk, dv], seed + 5, 0.5));
    }
    x
}

/// Output, final state and the gradients of a fixed weighting of both, on `device`.
fn run(x: &[Tensor], device: Device) -> Vec<Tensor> {
    let x: Vec<Tensor> = x
        .iter()
        .map(|t| t.to_device(device).expect("to device").requires_grad_())
        .collect();
    let p = DeltaRuleParams {
        scale: None,
        qk_l2norm: false,
    };
    let r = gated_delta_rule(&x[0], &x[1], &x[2], &x[3], &x[4], x.get(5), &p).expect("forward");
    let w_out = Tensor::from_slice(&values(r.out.numel(), 77, 1.0), r.out.shape())
        .expect("w")
        .to_device(device)
        .expect("w");
    let w_state = Tensor::from_slice(
        &values(r.final_state.numel(), 78, 1.0),
        r.final_state.shape(),
    )
    .expect("w")
    .to_device(device)
    .expect("w");
    let loss = r
        .out
        .mul(&w_out)
        .expect("mul")
        .sum_all()
        .expect("sum")
        .add(
            &r.final_state
                .mul(&w_state)
                .expect("mul")
                .sum_all()
                .expect("sum"),
        )
        .expect("add");
    loss.backward().expect("backward");
    let mut got = vec![r.out.detach(), r.final_state.detach()];
    got.extend(x.iter().map(|t| t.grad().expect("a gradient")));
    got
}

#[test]
fn the_delta_rule_kernels_match_the_cpu() {
    if !gpu_or_skip("the_delta_rule_kernels_match_the_cpu") {
        return;
    }
    let names = ["out", "state", "dq", "dk", "dv", "dg", "dbeta", "dstate"];
    for (what, sizes, per_channel, with_state) in [
        (
            "gdn, grouped heads, 2 chunks",
            (1, 70, 1, 2, 16, 24),
            false,
            true,
        ),
        (
            "kda, per-channel decay, 3 chunks",
            (2, 150, 2, 2, 12, 8),
            true,
            false,
        ),
        (
            "gdn, key dim 40, one short chunk, 4 blocks",
            (2, 9, 1, 2, 40, 33),
            false,
            true,
        ),
    ] {
        let x = inputs(sizes, per_channel, with_state, 40);
        let (want, got) = (run(&x, Device::Cpu), run(&x, GPU));
        for ((name, g), w) in names.iter().zip(&got).zip(&want) {
            assert_eq!(g.device(), GPU, "{what}: {name} stays on the GPU");
            close(&format!("{what}: {name}"), g, w, 2e-5);
        }
    }
}

#[test]
fn delta_rule_decode_continues_the_forward_bit_for_bit() {
    if !gpu_or_skip("delta_rule_decode_continues_the_forward_bit_for_bit") {
        return;
    }
    let (t, cut) = (80, 67);
    let x: Vec<Tensor> = inputs((1, t, 1, 2, 16, 8), true, false, 50)
        .iter()
        .map(gpu)
        .collect();
    let p = DeltaRuleParams {
        scale: None,
        qk_l2norm: false,
    };
    let whole = gated_delta_rule(&x[0], &x[1], &x[2], &x[3], &x[4], None, &p).expect("whole");
    let part = |i: usize, a: usize, n: usize| x[i].narrow(1, a, n).expect("narrow");
    let head = gated_delta_rule(
        &part(0, 0, cut),
        &part(1, 0, cut),
        &part(2, 0, cut),
        &part(3, 0, cut),
        &part(4, 0, cut),
        None,
        &p,
    )
    .expect("prefill");
    let mut state = head.final_state;
    let mut outs = vec![head.out];
    for s in cut..t {
        let step = gated_delta_rule_recurrent(
            &part(0, s, 1),
            &part(1, s, 1),
            &part(2, s, 1),
            &part(3, s, 1),
            &part(4, s, 1),
            &state,
            &p,
        )
        .expect("decode step");
        state = step.final_state;
        outs.push(step.out);
    }
    let decoded = anneal_engine::ops::cat(&outs, 1).expect("cat");
    assert_eq!(
        decoded.to_vec_f32(),
        whole.out.to_vec_f32(),
        "decode equals the whole forward"
    );
    assert_eq!(state.to_vec_f32(), whole.final_state.to_vec_f32());
}

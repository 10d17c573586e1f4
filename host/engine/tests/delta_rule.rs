//! The gated delta rule: chunked gradients against finite differences (both decay kinds,
//! grouped heads, sequences that are not a multiple of the chunk, with and without an initial
//! state), the chunked form against the recurrence, and determinism across thread counts.

mod common;

use anneal_engine::ops::{
    cat, gated_delta_rule, gated_delta_rule_recurrent, DeltaRuleOutput, DeltaRuleParams,
};
use anneal_engine::{Result, Tensor};
use common::{assert_close, assert_thread_invariant, check_grad_tol, rand, randn};

/// Inputs of one case: `[q, k, v, g, beta]` and maybe an initial state.
struct Case {
    inputs: Vec<Tensor>,
    params: DeltaRuleParams,
}

#[allow(clippy::too_many_arguments)]
fn case(
    name: &str,
    (b, t, hk, hv, dk, dv): (usize, usize, usize, usize, usize, usize),
    per_channel: bool,
    g_lo: f32,
    with_state: bool,
    l2norm: bool,
) -> Case {
    let q = randn(&[b, t, hk, dk], &format!("{name}-q"));
    let k = randn(&[b, t, hk, dk], &format!("{name}-k"))
        .mul_scalar(if l2norm { 1.0 } else { 0.5 })
        .unwrap();
    let v = randn(&[b, t, hv, dv], &format!("{name}-v"));
    let g_shape: Vec<usize> = if per_channel {
        vec![b, t, hv, dk]
    } else {
        vec![b, t, hv]
    };
    let g = rand(&g_shape, g_lo, 0.0, &format!("{name}-g"));
    let beta = rand(&[b, t, hv], 0.0, 1.0, &format!("{name}-beta"));
    let mut inputs = vec![q, k, v, g, beta];
    if with_state {
        inputs.push(randn(&[b, hv, dk, dv], &format!("{name}-s0")));
    }
    Case {
        inputs,
        params: DeltaRuleParams {
            scale: None,
            qk_l2norm: l2norm,
        },
    }
}

fn run(x: &[Tensor], p: &DeltaRuleParams) -> Result<DeltaRuleOutput> {
    gated_delta_rule(&x[0], &x[1], &x[2], &x[3], &x[4], x.get(5), p)
}

/// Output and final state flattened into one tensor, so one check covers both gradients.
fn both(x: &[Tensor], p: &DeltaRuleParams) -> Result<Tensor> {
    let r = run(x, p)?;
    cat(
        &[
            r.out.reshape(&[r.out.numel()])?,
            r.final_state.reshape(&[r.final_state.numel()])?,
        ],
        0,
    )
}

fn check(name: &str, c: &Case) {
    check_grad_tol(name, &c.inputs, &[], 3e-3, 3e-2, 3e-3, |x| {
        both(x, &c.params)
    });
}

#[test]
fn gdn_gradients_match_finite_differences() {
    // Two chunks (70 = 64 + 6), two value heads per key head, an initial state.
    let c = case("gdn", (1, 70, 1, 2, 4, 3), false, -0.4, true, false);
    check("gdn", &c);
}

#[test]
fn gdn_gradients_without_state_and_with_l2norm() {
    let c = case("gdn-n", (2, 5, 2, 2, 3, 2), false, -1.0, false, true);
    check("gdn-n", &c);
}

#[test]
fn kda_gradients_match_finite_differences() {
    // Decay per key channel, T not a multiple of the chunk, no initial state.
    let c = case("kda", (1, 67, 2, 2, 4, 3), true, -0.5, false, true);
    check("kda", &c);
}

#[test]
fn kda_gradients_with_state_and_grouped_heads() {
    let c = case("kda-s", (1, 9, 1, 3, 3, 2), true, -0.5, true, false);
    check("kda-s", &c);
}

#[test]
fn kda_strong_decay_uses_pairwise_path() {
    // Decays of up to -4 per token sum past the factoring limit inside a chunk: those rows are
    // computed pair by pair (values checked against the recurrence, gradients by differences).
    let c = case("kda-far", (1, 66, 1, 1, 3, 2), true, -4.0, true, false);
    chunked_matches_recurrent(&c, 1e-5);
    check("kda-far", &c);
}

fn chunked_matches_recurrent(c: &Case, tol: f32) {
    let x = &c.inputs;
    let chunked = run(x, &c.params).unwrap();
    let s0 = x.get(5).cloned().unwrap_or_else(|| {
        let (b, hv, dk, dv) = (
            x[2].shape()[0],
            x[2].shape()[2],
            x[0].shape()[3],
            x[2].shape()[3],
        );
        Tensor::zeros(&[b, hv, dk, dv], anneal_engine::DType::F32)
    });
    let rec =
        gated_delta_rule_recurrent(&x[0], &x[1], &x[2], &x[3], &x[4], &s0, &c.params).unwrap();
    assert_close(
        "out",
        &chunked.out.to_vec_f32(),
        &rec.out.to_vec_f32(),
        tol,
        tol,
    );
    assert_close(
        "state",
        &chunked.final_state.to_vec_f32(),
        &rec.final_state.to_vec_f32(),
        tol,
        tol,
    );
}

#[test]
fn chunked_matches_recurrence() {
    for (name, per_channel, state) in [("r-gdn", false, true), ("r-kda", true, false)] {
        let c = case(name, (2, 150, 2, 4, 16, 8), per_channel, -0.3, state, true);
        chunked_matches_recurrent(&c, 2e-5);
    }
}

#[test]
fn results_do_not_depend_on_thread_count() {
    let c = case("threads", (1, 130, 2, 4, 16, 16), false, -0.2, true, true);
    assert_thread_invariant("delta_rule", || {
        let x: Vec<Tensor> = c
            .inputs
            .iter()
            .map(|t| t.detach().requires_grad_())
            .collect();
        let r = run(&x, &c.params).unwrap();
        r.out
            .sum_all()
            .unwrap()
            .add(&r.final_state.sum_all().unwrap())
            .unwrap()
            .backward()
            .unwrap();
        let mut out = vec![r.out, r.final_state];
        out.extend(x.iter().map(|t| t.grad().unwrap()));
        out
    });
}

#[test]
fn bad_shapes_are_refused() {
    let c = case("bad", (1, 4, 2, 4, 3, 2), false, -0.3, false, false);
    let x = &c.inputs;
    let g_wrong = Tensor::zeros(&[1, 4, 3], anneal_engine::DType::F32);
    let err = gated_delta_rule(&x[0], &x[1], &x[2], &g_wrong, &x[4], None, &c.params)
        .unwrap_err()
        .to_string();
    assert!(err.contains("g must be"), "{err}");
    let v_wrong = Tensor::zeros(&[1, 4, 3, 2], anneal_engine::DType::F32);
    assert!(gated_delta_rule(&x[0], &x[1], &v_wrong, &x[3], &x[4], None, &c.params).is_err());
}

#[test]
fn empty_sequence_returns_the_initial_state() {
    let c = case("empty", (1, 0, 1, 2, 3, 2), false, -0.3, true, false);
    let r = run(&c.inputs, &c.params).unwrap();
    assert_eq!(r.out.shape(), [1, 0, 2, 2]);
    assert_eq!(r.final_state.to_vec_f32(), c.inputs[5].to_vec_f32());
}

#[test]
fn bf16_inputs_compute_in_f32_and_return_their_dtype() {
    use anneal_engine::DType;
    let c = case("bf16", (1, 70, 1, 2, 8, 4), false, -0.3, true, true);
    let x16: Vec<Tensor> = c.inputs[..5]
        .iter()
        .map(|t| t.to_dtype(DType::BF16).unwrap().requires_grad_())
        .collect();
    let r16 =
        gated_delta_rule(&x16[0], &x16[1], &x16[2], &x16[3], &x16[4], None, &c.params).unwrap();
    assert_eq!(r16.out.dtype(), DType::BF16);
    assert_eq!(r16.final_state.dtype(), DType::F32);
    r16.out
        .to_dtype(DType::F32)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    for t in &x16 {
        assert_eq!(t.grad().unwrap().dtype(), DType::BF16);
    }
    // The same values in f32 give the same result up to the output's bf16 rounding.
    let x32: Vec<Tensor> = x16
        .iter()
        .map(|t| t.to_dtype(DType::F32).unwrap())
        .collect();
    let r32 =
        gated_delta_rule(&x32[0], &x32[1], &x32[2], &x32[3], &x32[4], None, &c.params).unwrap();
    assert_close(
        "bf16 out",
        &r16.out.to_vec_f32(),
        &r32.out.to_vec_f32(),
        1e-2,
        1e-2,
    );
    assert_eq!(r16.final_state.to_vec_f32(), r32.final_state.to_vec_f32());
}

//! Decoding with the delta rule's cache: in batch-invariant mode a prompt followed by steps of
//! one or a few tokens gives the very bits of one chunked forward over the whole sequence (what
//! the RL trainer's logprob pass computes); outside it the recurrence agrees to rounding.

mod common;

use anneal_engine::invariant::set_batch_invariant;
use anneal_engine::ops::{cat, gated_delta_rule, DeltaRuleCache, DeltaRuleParams};
use anneal_engine::Tensor;
use common::{assert_close, rand, randn};

struct Seq {
    x: [Tensor; 5],
    s0: Tensor,
    params: DeltaRuleParams,
}

fn seq(name: &str, t: usize, per_channel: bool) -> Seq {
    let (b, hk, hv, dk, dv) = (2, 2, 4, 16, 8);
    let g_shape: Vec<usize> = if per_channel {
        vec![b, t, hv, dk]
    } else {
        vec![b, t, hv]
    };
    Seq {
        x: [
            randn(&[b, t, hk, dk], &format!("{name}-q")),
            randn(&[b, t, hk, dk], &format!("{name}-k")),
            randn(&[b, t, hv, dv], &format!("{name}-v")),
            rand(&g_shape, -0.3, 0.0, &format!("{name}-g")),
            rand(&[b, t, hv], 0.0, 1.0, &format!("{name}-beta")),
        ],
        s0: randn(&[b, hv, dk, dv], &format!("{name}-s0")),
        params: DeltaRuleParams {
            scale: None,
            qk_l2norm: true,
        },
    }
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec_f32().iter().map(|v| v.to_bits()).collect()
}

/// Feeds the sequence to a cache in pieces of the given sizes; returns the outputs joined.
fn decode(s: &Seq, cache: &mut DeltaRuleCache, from: usize, pieces: &[usize]) -> Tensor {
    let mut outs = Vec::new();
    let mut at = from;
    for &n in pieces {
        let p: Vec<Tensor> = s.x.iter().map(|t| t.narrow(1, at, n).unwrap()).collect();
        outs.push(cache.step(&p[0], &p[1], &p[2], &p[3], &p[4]).unwrap());
        at += n;
    }
    cat(&outs, 1).unwrap()
}

/// A prompt of 37 tokens, single steps across the 64 boundary, a step of 5, singles across
/// 128: 150 tokens in all.
fn pieces() -> Vec<usize> {
    let mut p = vec![37];
    p.extend(std::iter::repeat_n(1, 63));
    p.push(5);
    p.extend(std::iter::repeat_n(1, 45));
    p
}

fn full(s: &Seq) -> (Tensor, Tensor) {
    let [q, k, v, g, b] = &s.x;
    let r = gated_delta_rule(q, k, v, g, b, Some(&s.s0), &s.params).unwrap();
    (r.out, r.final_state)
}

#[test]
fn invariant_decode_equals_full_forward_bitwise() {
    let _inv = set_batch_invariant(true);
    for (name, per_channel) in [("dec-gdn", false), ("dec-kda", true)] {
        let s = seq(name, 150, per_channel);
        let (out, state) = full(&s);
        let mut cache = DeltaRuleCache::new(&s.s0, s.params).unwrap();
        let got = decode(&s, &mut cache, 0, &pieces());
        assert_eq!(got.shape(), out.shape());
        assert!(
            bits(&got) == bits(&out),
            "{name}: decoded outputs differ from the forward"
        );
        assert!(bits(cache.state()) == bits(&state), "{name}: states differ");
        assert_eq!(cache.len(), 150);
    }
}

#[test]
fn plain_decode_agrees_and_keeps_the_anchor_for_invariant_steps() {
    let s = seq("dec-mixed", 150, false);
    let (out_plain, state_plain) = full(&s);
    let mut cache = DeltaRuleCache::new(&s.s0, s.params).unwrap();
    // Plain steps run the recurrence: equal to rounding.
    let head = decode(&s, &mut cache, 0, &[10, 60, 1, 1, 1, 27]);
    let want = out_plain.narrow(1, 0, 100).unwrap();
    assert_close("plain", &head.to_vec_f32(), &want.to_vec_f32(), 1e-4, 1e-4);
    // Switching to batch-invariant mode mid-sequence: the anchor the plain steps kept brings
    // the remaining outputs to the forward's exact bits.
    let _inv = set_batch_invariant(true);
    let (out, state) = full(&s);
    let tail = decode(&s, &mut cache, 100, &[1, 1, 30, 18]);
    assert!(bits(&tail) == bits(&out.narrow(1, 100, 50).unwrap()));
    assert!(bits(cache.state()) == bits(&state));
    assert_close(
        "state",
        &state.to_vec_f32(),
        &state_plain.to_vec_f32(),
        1e-4,
        1e-4,
    );
}

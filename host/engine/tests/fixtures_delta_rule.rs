//! The gated delta rule against transformers' PyTorch references (regenerate with
//! `tests/reference/make_fixtures.py delta_rule`): Qwen3.5's `torch_chunk_gated_delta_rule`
//! (per-head decay, grouped value heads) and Kimi Linear's `chunk_kimi_delta_attention`
//! (per-channel decay). Output, final state and every input gradient within 1e-5.

mod common;

use anneal_engine::io::load_safetensors;
use anneal_engine::ops::{gated_delta_rule, DeltaRuleParams};
use anneal_engine::Tensor;
use common::assert_close;
use std::collections::BTreeMap;

fn fixtures() -> BTreeMap<String, Tensor> {
    load_safetensors(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/delta_rule.safetensors"
    ))
    .unwrap()
}

fn check_case(name: &str, l2norm: bool) {
    let f = fixtures();
    let get = |k: &str| f.get(&format!("{name}.{k}")).cloned();
    let leaves: Vec<Tensor> = ["q", "k", "v", "g", "beta"]
        .iter()
        .map(|k| get(k).unwrap().requires_grad_())
        .collect();
    let s0 = get("s0").map(|s| s.requires_grad_());
    let params = DeltaRuleParams {
        scale: None,
        qk_l2norm: l2norm,
    };
    let r = gated_delta_rule(
        &leaves[0],
        &leaves[1],
        &leaves[2],
        &leaves[3],
        &leaves[4],
        s0.as_ref(),
        &params,
    )
    .unwrap();
    let close = |what: &str, got: &Tensor| {
        let want = get(what).unwrap();
        assert_eq!(got.shape(), want.shape(), "{name}.{what} shape");
        assert_close(
            &format!("{name}.{what}"),
            &got.to_vec_f32(),
            &want.to_vec_f32(),
            1e-5,
            1e-5,
        );
    };
    close("out", &r.out);
    close("state", &r.final_state);
    let loss = r
        .out
        .mul(&get("proj").unwrap())
        .unwrap()
        .sum_all()
        .unwrap()
        .add(
            &r.final_state
                .mul(&get("sproj").unwrap())
                .unwrap()
                .sum_all()
                .unwrap(),
        )
        .unwrap();
    loss.backward().unwrap();
    for (leaf, k) in leaves.iter().zip(["q", "k", "v", "g", "beta"]) {
        close(&format!("d{k}"), &leaf.grad().unwrap());
    }
    if let Some(s0) = &s0 {
        close("ds0", &s0.grad().unwrap());
    }
}

#[test]
fn gdn_matches_transformers() {
    check_case("gdn", true);
}

#[test]
fn gdn_without_state_or_norm_matches_transformers() {
    check_case("gdn_plain", false);
}

#[test]
fn kda_matches_transformers() {
    check_case("kda", true);
}

//! The MoE host ops, called as a plugin calls them (the SDK's `Tensor` methods through the host's
//! op table), checked against the engine ops they stand for: values, the auxiliary loss and
//! statistics, and gradients.

use anneal_engine::ops::{
    moe_ffn, ExpertActivation, ExpertLayout, MoeSpec, MoeWeights, RouterSpec, SharedExpert,
};
use anneal_engine::Tensor;
use anneal_plugin_api::sdk::{self, Host, MoeFfnOpts, Router};
use anneal_runtime::plugins::host::HostSession;
use std::collections::HashMap;

const N: usize = 6;
const D: usize = 8;
const E: usize = 4;
const F: usize = 16;
const FS: usize = 12;

/// Deterministic values in about [-0.5, 0.5), different for each `seed`.
fn filled(seed: u32, shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| ((i as f32 * 0.7548 + seed as f32 * 0.5698).sin() * 43758.547).fract() - 0.5)
        .collect();
    Tensor::from_vec(v, shape).unwrap()
}

/// The layer's tensors by name, `[.., out, in]` (Hugging Face's layout), each a fresh leaf.
fn weights() -> HashMap<String, Tensor> {
    [
        ("x", vec![N, D]),
        ("router", vec![E, D]),
        ("router_bias", vec![E]),
        ("balance_bias", vec![E]),
        ("gate", vec![E, F, D]),
        ("up", vec![E, F, D]),
        ("down", vec![E, D, F]),
        ("gate_bias", vec![E, F]),
        ("up_bias", vec![E, F]),
        ("down_bias", vec![E, D]),
        ("shared_gate", vec![FS, D]),
        ("shared_up", vec![FS, D]),
        ("shared_down", vec![D, FS]),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, (name, shape))| {
        let t = filled(i as u32 + 1, &shape);
        let t = if name == "balance_bias" {
            t
        } else {
            t.requires_grad_()
        };
        (name.to_string(), t)
    })
    .collect()
}

fn router() -> Router {
    Router {
        renormalize: true,
        route_scale: 1.5,
        ..Router::new(E, 2)
    }
}

/// Gives a tensor the plugin side made back to the host.
fn back(s: &HostSession, t: sdk::Tensor<'_>) -> Tensor {
    s.take(t.into_handle()).unwrap()
}

fn grads(w: &HashMap<String, Tensor>, names: &[&str]) -> Vec<Vec<f32>> {
    names
        .iter()
        .map(|n| w[*n].grad().expect("a gradient").to_vec_f32())
        .collect()
}

#[test]
fn moe_ffn_through_the_host_matches_the_engine_with_its_loss_statistics_and_gradients() {
    let trained = [
        "x",
        "router",
        "router_bias",
        "gate",
        "down",
        "up_bias",
        "shared_up",
    ];
    // Through the SDK and the host's op table, with every option on.
    let w1 = weights();
    let s = HostSession::new(w1.clone());
    let vt = s.vtable();
    let host = Host::new(&vt);
    let p = |n: &str| host.param(n).unwrap();
    let (x, rb, bb, gb, ub, db) = (
        p("x"),
        p("router_bias"),
        p("balance_bias"),
        p("gate_bias"),
        p("up_bias"),
        p("down_bias"),
    );
    let (sg, su, sd) = (p("shared_gate"), p("shared_up"), p("shared_down"));
    let opts = MoeFfnOpts {
        aux_loss_coef: 0.01,
        out_in: true,
        clamped_swiglu: Some((1.702, 0.3)),
        router_bias: Some(&rb),
        balance_bias: Some(&bb),
        gate_bias: Some(&gb),
        up_bias: Some(&ub),
        down_bias: Some(&db),
        shared: Some([&sg, &su, &sd]),
        ..MoeFfnOpts::new(router())
    };
    let got = x
        .moe_ffn(&p("router"), &p("gate"), &p("up"), &p("down"), &opts)
        .unwrap();
    let aux = back(&s, got.aux_loss.expect("an auxiliary loss"));
    let tokens = back(&s, got.tokens_per_expert).to_vec_f32();
    let imbalance = back(&s, got.imbalance).item().unwrap();
    let entropy = back(&s, got.entropy).item().unwrap();
    let out = back(&s, got.out);
    out.sum_all()
        .unwrap()
        .add(&aux)
        .unwrap()
        .backward()
        .unwrap();

    // The engine op on the same values.
    let w2 = weights();
    let spec = MoeSpec {
        router: RouterSpec {
            renormalize: true,
            route_scale: 1.5,
            ..RouterSpec::new(E, 2)
        },
        aux_loss_coef: 0.01,
        activation: ExpertActivation::ClampedSwiGlu {
            alpha: 1.702,
            limit: 0.3,
        },
    };
    let mw = MoeWeights {
        router_bias: Some(&w2["router_bias"]),
        balance_bias: Some(&w2["balance_bias"]),
        gate_bias: Some(&w2["gate_bias"]),
        up_bias: Some(&w2["up_bias"]),
        down_bias: Some(&w2["down_bias"]),
        shared: Some(SharedExpert {
            gate: &w2["shared_gate"],
            up: &w2["shared_up"],
            down: &w2["shared_down"],
        }),
        layout: ExpertLayout::OutIn,
        ..MoeWeights::new(&w2["router"], &w2["gate"], &w2["up"], &w2["down"])
    };
    let want = moe_ffn(&w2["x"], &mw, &spec).unwrap();
    let want_aux = want.aux_loss.clone().unwrap();
    want.out
        .sum_all()
        .unwrap()
        .add(&want_aux)
        .unwrap()
        .backward()
        .unwrap();

    assert_eq!(out.shape(), &[N, D]);
    assert_eq!(out.to_vec_f32(), want.out.to_vec_f32());
    assert_eq!(aux.item().unwrap(), want_aux.item().unwrap());
    assert!(aux.item().unwrap() > 0.0);
    assert_eq!(tokens, want.stats.tokens_per_expert.to_vec_f32());
    assert_eq!(tokens.iter().sum::<f32>(), (N * 2) as f32);
    assert_eq!(imbalance, want.stats.imbalance.item().unwrap());
    assert_eq!(entropy, want.stats.entropy.item().unwrap());
    // Gradients reach the input, the router (through the weights and the aux loss), the
    // experts, their biases and the shared expert, exactly as through the engine op.
    let (g1, g2) = (grads(&w1, &trained), grads(&w2, &trained));
    assert_eq!(g1, g2);
    for (name, g) in trained.iter().zip(&g1) {
        assert!(g.iter().any(|v| *v != 0.0), "no gradient reached {name}");
    }
    assert!(
        w1["balance_bias"].grad().is_none(),
        "the balancing bias is not trained"
    );
}

#[test]
fn the_moe_parts_through_the_host_compose_into_the_layer() {
    let w1 = weights();
    let s = HostSession::new(w1.clone());
    let vt = s.vtable();
    let host = Host::new(&vt);
    let p = |n: &str| host.param(n).unwrap();
    let x = p("x");
    let r = router();
    // The layer in one op (no biases, SwiGLU, `[out, in]` weights)...
    let opts = MoeFfnOpts {
        out_in: true,
        ..MoeFfnOpts::new(r)
    };
    let whole = x
        .moe_ffn(&p("router"), &p("gate"), &p("up"), &p("down"), &opts)
        .unwrap();
    assert!(whole.aux_loss.is_none(), "no coefficient, no loss");
    let whole = back(&s, whole.out).to_vec_f32();
    // ...and from its parts: router, dispatch, grouped products, combine.
    let logits = x
        .reshape(&[1, N as i64, D as i64])
        .unwrap()
        .matmul(&p("router").transpose(0, 1).unwrap())
        .unwrap()
        .reshape(&[N as i64, E as i64])
        .unwrap();
    let (weights, experts, scores) = logits.moe_route(None, &r).unwrap();
    assert_eq!(scores.shape().unwrap(), [N, E]);
    assert_eq!(experts.shape().unwrap(), [N, 2]);
    let counts = host.sort_by_expert(&experts, E).unwrap()[3].clone();
    let xs = x.moe_dispatch(&experts, E).unwrap();
    let h = xs
        .grouped_matmul_nt(&p("gate"), &counts)
        .unwrap()
        .swiglu(&xs.grouped_matmul_nt(&p("up"), &counts).unwrap())
        .unwrap();
    let y = h.grouped_matmul_nt(&p("down"), &counts).unwrap();
    let out = y.moe_combine(&weights, &experts, E).unwrap();
    let parts = back(&s, out);
    for (a, b) in parts.to_vec_f32().iter().zip(&whole) {
        assert!((a - b).abs() <= 1e-6, "{a} vs {b}");
    }
    parts.sum_all().unwrap().backward().unwrap();
    for name in ["x", "router", "gate", "up", "down"] {
        let g = w1[name].grad().expect("a gradient").to_vec_f32();
        assert!(g.iter().any(|v| *v != 0.0), "no gradient reached {name}");
    }
}

#[test]
fn bad_moe_attributes_are_refused_by_name() {
    let w = weights();
    let s = HostSession::new(w);
    let vt = s.vtable();
    let host = Host::new(&vt);
    let p = |n: &str| host.param(n).unwrap();
    let too_many = MoeFfnOpts::new(Router::new(E, E + 1));
    let err = p("x")
        .moe_ffn(&p("router"), &p("gate"), &p("up"), &p("down"), &too_many)
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains("top_k = 5") && err.contains("num_experts = 4"),
        "{err}"
    );
    let in_out = MoeFfnOpts::new(router());
    // Wrong layout: `[out, in]` weights read as `[in, out]` are refused, naming the weight.
    let err = p("x")
        .moe_ffn(&p("router"), &p("gate"), &p("up"), &p("down"), &in_out)
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains("moe_ffn") && err.contains("router must have shape"),
        "{err}"
    );
}

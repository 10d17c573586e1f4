//! The MoE layer: routers, dispatch/combine, the composite `moe_ffn`, load balancing and router
//! statistics, against PyTorch fixtures, finite differences and across thread counts.

mod common;

use anneal_engine::io::load_safetensors;
use anneal_engine::ops::{
    load_balancing_loss, moe_ffn, route, sort_by_expert, update_router_bias, ExpertActivation,
    ExpertLayout, ExpertLoad, MoeSpec, MoeWeights, RouterScore, RouterSpec, RouterStats,
    SharedExpert,
};
use anneal_engine::{DType, Tensor};
use common::*;
use std::collections::{BTreeMap, HashMap};

fn fixtures() -> BTreeMap<String, Tensor> {
    load_safetensors(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/moe.safetensors"
    ))
    .unwrap()
}

fn spec(e: usize, k: usize, score: RouterScore, renormalize: bool, scale: f32) -> RouterSpec {
    RouterSpec {
        num_experts: e,
        top_k: k,
        score,
        renormalize,
        route_scale: scale,
        groups: None,
    }
}

#[test]
fn routers_match_pytorch_with_grads() {
    let f = fixtures();
    for (name, score, renorm, scale) in [
        ("softmax", RouterScore::Softmax, true, 1.5),
        ("sigmoid", RouterScore::Sigmoid, true, 2.5),
        ("plain", RouterScore::Softmax, false, 1.0),
    ] {
        let p = |s: &str| f[&format!("router_{name}.{s}")].clone();
        let logits = p("logits").requires_grad_();
        let r = route(&logits, Some(&p("bias")), &spec(6, 2, score, renorm, scale)).unwrap();
        assert_eq!(
            r.experts.to_vec::<i64>(),
            p("experts").to_vec::<i64>(),
            "{name}"
        );
        let w = r.weights.to_vec_f32();
        assert_close(name, &w, &p("weights").to_vec_f32(), 1e-6, 1e-6);
        r.weights.backward_with(p("grad")).unwrap();
        let g = logits.grad().unwrap().to_vec_f32();
        assert_close(name, &g, &p("grad_logits").to_vec_f32(), 1e-5, 1e-6);
    }
}

#[test]
fn router_grads_match_finite_differences() {
    for (score, renorm, scale) in [
        (RouterScore::Softmax, true, 1.0),
        (RouterScore::Softmax, false, 2.0),
        (RouterScore::Sigmoid, true, 1.5),
        (RouterScore::Sigmoid, false, 1.0),
    ] {
        let logits = randn(&[7, 5], "logits");
        let bias = randn(&[5], "bias").mul_scalar(0.2).unwrap();
        let s = spec(5, 2, score, renorm, scale);
        check_grad_tol("route", &[logits], &[], 1e-3, 2e-2, 1e-3, |t| {
            Ok(route(&t[0], Some(&bias), &s)?.weights)
        });
    }
}

#[test]
fn router_bias_steers_the_choice_but_not_the_weights() {
    let logits = randn(&[9, 4], "logits");
    let scores = logits.softmax(-1).unwrap().to_vec_f32();
    // A large bias on expert 3 makes every token pick it first.
    let bias = Tensor::from_slice(&[0.0f32, 0.0, 0.0, 10.0], &[4]).unwrap();
    let r = route(
        &logits,
        Some(&bias),
        &spec(4, 2, RouterScore::Softmax, false, 1.0),
    )
    .unwrap();
    let (ids, w) = (r.experts.to_vec::<i64>(), r.weights.to_vec_f32());
    for t in 0..9 {
        assert_eq!(ids[t * 2], 3);
        // The weight is the unbiased score of the chosen expert.
        for j in 0..2 {
            assert_eq!(w[t * 2 + j], scores[t * 4 + ids[t * 2 + j] as usize]);
        }
    }
}

#[test]
fn router_rejects_more_experts_per_token_than_experts() {
    let logits = randn(&[3, 4], "logits");
    let msg = route(&logits, None, &spec(4, 5, RouterScore::Softmax, true, 1.0))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("top_k = 5") && msg.contains("num_experts = 4"),
        "{msg}"
    );
    let msg = route(&logits, None, &spec(3, 2, RouterScore::Softmax, true, 1.0))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("[tokens, num_experts = 3]"), "{msg}");
}

/// The fixture layer's weights.
struct Layer {
    t: HashMap<String, Tensor>,
}

impl Layer {
    fn from_fixture(f: &BTreeMap<String, Tensor>) -> Layer {
        let mut t = HashMap::new();
        for name in [
            "x",
            "router",
            "gate",
            "up",
            "down",
            "shared_gate",
            "shared_up",
            "shared_down",
        ] {
            t.insert(
                name.to_string(),
                f[&format!("layer.{name}")].detach().requires_grad_(),
            );
        }
        t.insert("bias".into(), f["layer.bias"].detach());
        Layer { t }
    }

    fn weights(&self) -> MoeWeights<'_> {
        MoeWeights {
            balance_bias: Some(&self.t["bias"]),
            shared: Some(SharedExpert {
                gate: &self.t["shared_gate"],
                up: &self.t["shared_up"],
                down: &self.t["shared_down"],
            }),
            ..MoeWeights::new(
                &self.t["router"],
                &self.t["gate"],
                &self.t["up"],
                &self.t["down"],
            )
        }
    }
}

fn layer_spec(coef: f32) -> MoeSpec {
    MoeSpec {
        aux_loss_coef: coef,
        ..MoeSpec::new(spec(4, 2, RouterScore::Softmax, true, 1.0))
    }
}

#[test]
fn moe_ffn_matches_pytorch_loop_over_experts_with_grads() {
    let f = fixtures();
    let l = Layer::from_fixture(&f);
    let m = moe_ffn(&l.t["x"], &l.weights(), &layer_spec(0.01)).unwrap();
    assert_eq!(m.out.shape(), &[2, 12, 8]);
    assert_close(
        "out",
        &m.out.to_vec_f32(),
        &f["layer.out"].to_vec_f32(),
        1e-5,
        1e-5,
    );
    let want_counts: Vec<usize> = f["layer.counts"]
        .to_vec::<i64>()
        .iter()
        .map(|&c| c as usize)
        .collect();
    assert_eq!(counts_of(&m.counts), want_counts);
    let aux = m.aux_loss.clone().unwrap();
    assert_close(
        "aux",
        &aux.to_vec_f32(),
        &f["layer.aux_loss"].to_vec_f32(),
        1e-6,
        1e-7,
    );
    let loss = m
        .out
        .reshape(&[24, 8])
        .unwrap()
        .mul(&f["layer.grad_out"])
        .unwrap()
        .sum_all()
        .unwrap()
        .add(&aux)
        .unwrap();
    loss.backward().unwrap();
    for name in [
        "x",
        "router",
        "gate",
        "up",
        "down",
        "shared_gate",
        "shared_up",
        "shared_down",
    ] {
        let got = l.t[name].grad().unwrap().to_vec_f32();
        assert_close(
            name,
            &got,
            &f[&format!("layer.grad_{name}")].to_vec_f32(),
            1e-4,
            1e-5,
        );
    }
}

#[test]
fn moe_ffn_with_gpt_oss_biases_and_clamped_swiglu_matches_pytorch() {
    let f = fixtures();
    let p = |s: &str| f[&format!("gptoss.{s}")].detach().requires_grad_();
    let names = [
        "x",
        "router",
        "router_bias",
        "gate",
        "up",
        "down",
        "gate_bias",
        "up_bias",
        "down_bias",
    ];
    let t: Vec<Tensor> = names.iter().map(|n| p(n)).collect();
    let w = MoeWeights {
        router_bias: Some(&t[2]),
        gate_bias: Some(&t[6]),
        up_bias: Some(&t[7]),
        down_bias: Some(&t[8]),
        ..MoeWeights::new(&t[1], &t[3], &t[4], &t[5])
    };
    let s = MoeSpec {
        activation: ExpertActivation::ClampedSwiGlu {
            alpha: 1.702,
            limit: 1.0,
        },
        ..MoeSpec::new(spec(4, 2, RouterScore::Softmax, true, 1.0))
    };
    let m = moe_ffn(&t[0], &w, &s).unwrap();
    assert_close(
        "out",
        &m.out.to_vec_f32(),
        &f["gptoss.out"].to_vec_f32(),
        1e-5,
        1e-5,
    );
    m.out.backward_with(f["gptoss.grad_out"].clone()).unwrap();
    for (name, leaf) in names.iter().zip(&t) {
        let want = f[&format!("gptoss.grad_{name}")].to_vec_f32();
        assert_close(name, &leaf.grad().unwrap().to_vec_f32(), &want, 1e-4, 1e-5);
    }
}

#[test]
fn moe_ffn_biases_and_clamped_activation_match_finite_differences() {
    let (n, d, e, f) = (8, 5, 3, 4);
    let inputs = [
        randn(&[n, d], "x"),
        randn(&[d, e], "router"),
        randn(&[e], "router_bias"),
        randn(&[e, d, f], "gate").mul_scalar(0.5).unwrap(),
        randn(&[e, d, f], "up").mul_scalar(0.5).unwrap(),
        randn(&[e, f, d], "down").mul_scalar(0.5).unwrap(),
        randn(&[e, f], "gb"),
        randn(&[e, f], "ub"),
        randn(&[e, d], "db"),
    ];
    // A limit no value reaches: the kinks of the clamps stay out of the differences.
    let s = MoeSpec {
        activation: ExpertActivation::ClampedSwiGlu {
            alpha: 1.702,
            limit: 100.0,
        },
        ..MoeSpec::new(spec(e, 2, RouterScore::Softmax, true, 1.0))
    };
    check_grad_tol("moe_ffn_biases", &inputs, &[], 1e-3, 2e-2, 2e-3, |t| {
        let w = MoeWeights {
            router_bias: Some(&t[2]),
            gate_bias: Some(&t[6]),
            up_bias: Some(&t[7]),
            down_bias: Some(&t[8]),
            ..MoeWeights::new(&t[1], &t[3], &t[4], &t[5])
        };
        Ok(moe_ffn(&t[0], &w, &s)?.out)
    });
}

#[test]
fn moe_ffn_takes_linear_layout_weights() {
    // The fixture layer with every matrix stored [out, in] gives the same output and the
    // transposed gradients.
    let f = fixtures();
    let l = Layer::from_fixture(&f);
    let t = |name: &str| {
        let m = &l.t[name];
        m.transpose(-1, -2)
            .unwrap()
            .contiguous()
            .unwrap()
            .requires_grad_()
    };
    let names = [
        "router",
        "gate",
        "up",
        "down",
        "shared_gate",
        "shared_up",
        "shared_down",
    ];
    let m: Vec<Tensor> = names.iter().map(|n| t(n)).collect();
    let w = MoeWeights {
        balance_bias: Some(&l.t["bias"]),
        shared: Some(SharedExpert {
            gate: &m[4],
            up: &m[5],
            down: &m[6],
        }),
        layout: ExpertLayout::OutIn,
        ..MoeWeights::new(&m[0], &m[1], &m[2], &m[3])
    };
    let m_out = moe_ffn(&l.t["x"], &w, &layer_spec(0.01)).unwrap();
    let out = m_out.out;
    assert_close(
        "out",
        &out.to_vec_f32(),
        &f["layer.out"].to_vec_f32(),
        1e-5,
        1e-5,
    );
    let loss = out
        .reshape(&[24, 8])
        .unwrap()
        .mul(&f["layer.grad_out"])
        .unwrap()
        .sum_all()
        .unwrap()
        .add(&m_out.aux_loss.unwrap())
        .unwrap();
    loss.backward().unwrap();
    for (name, leaf) in names.iter().zip(&m) {
        let got = leaf.grad().unwrap().transpose(-1, -2).unwrap().to_vec_f32();
        let want = f[&format!("layer.grad_{name}")].to_vec_f32();
        assert_close(name, &got, &want, 1e-4, 1e-5);
    }
    let msg = moe_ffn(&l.t["x"], &l.weights(), &layer_spec(0.0))
        .and_then(|_| {
            moe_ffn(
                &l.t["x"],
                &MoeWeights {
                    layout: ExpertLayout::OutIn,
                    ..l.weights()
                },
                &layer_spec(0.0),
            )
        })
        .unwrap_err()
        .to_string();
    assert!(msg.contains("router must have shape [4, 8]"), "{msg}");
}

#[test]
fn moe_ffn_grads_match_finite_differences() {
    let (n, d, e, f, fs) = (10, 6, 4, 5, 3);
    let inputs = [
        randn(&[n, d], "x"),
        randn(&[d, e], "router"),
        randn(&[e, d, f], "gate").mul_scalar(0.5).unwrap(),
        randn(&[e, d, f], "up").mul_scalar(0.5).unwrap(),
        randn(&[e, f, d], "down").mul_scalar(0.5).unwrap(),
        randn(&[d, fs], "sg").mul_scalar(0.5).unwrap(),
        randn(&[d, fs], "su").mul_scalar(0.5).unwrap(),
        randn(&[fs, d], "sd").mul_scalar(0.5).unwrap(),
    ];
    for score in [RouterScore::Softmax, RouterScore::Sigmoid] {
        let s = MoeSpec {
            aux_loss_coef: 0.1,
            ..MoeSpec::new(spec(e, 2, score, true, 1.0))
        };
        check_grad_tol("moe_ffn", &inputs, &[], 1e-3, 2e-2, 2e-3, |t| {
            let w = MoeWeights {
                shared: Some(SharedExpert {
                    gate: &t[5],
                    up: &t[6],
                    down: &t[7],
                }),
                ..MoeWeights::new(&t[1], &t[2], &t[3], &t[4])
            };
            let m = moe_ffn(&t[0], &w, &s)?;
            // The aux loss rides along on every element so its gradient is checked too.
            m.out.add(&m.aux_loss.expect("coefficient is set"))
        });
    }
}

#[test]
fn moe_ffn_is_bitwise_identical_for_1_and_2_threads() {
    let (n, d, e, f) = (300, 64, 6, 96);
    let x = randn(&[n, d], "x");
    let ws = [
        randn(&[d, e], "router"),
        randn(&[e, d, f], "gate"),
        randn(&[e, d, f], "up"),
        randn(&[e, f, d], "down"),
    ];
    let g = randn(&[n, d], "g");
    assert_thread_invariant("moe_ffn", || {
        let xl = x.detach().requires_grad_();
        let wl: Vec<Tensor> = ws.iter().map(|w| w.detach().requires_grad_()).collect();
        let w = MoeWeights::new(&wl[0], &wl[1], &wl[2], &wl[3]);
        let m = moe_ffn(
            &xl,
            &w,
            &MoeSpec {
                aux_loss_coef: 0.01,
                ..MoeSpec::new(spec(e, 2, RouterScore::Softmax, true, 1.0))
            },
        )
        .unwrap();
        let aux = m.aux_loss.unwrap();
        let loss = m.out.mul(&g).unwrap().sum_all().unwrap().add(&aux).unwrap();
        loss.backward().unwrap();
        let mut out = vec![m.out, loss, xl.grad().unwrap()];
        out.extend(wl.iter().map(|w| w.grad().unwrap()));
        out
    });
}

#[test]
fn moe_ffn_rejects_misshapen_weights() {
    let f = fixtures();
    let l = Layer::from_fixture(&f);
    let bad = randn(&[4, 8, 7], "bad");
    let w = MoeWeights {
        up: &bad,
        ..l.weights()
    };
    let msg = moe_ffn(&l.t["x"], &w, &layer_spec(0.0))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("up must have shape [4, 8, 6], got [4, 8, 7]"),
        "{msg}"
    );
}

#[test]
fn dispatch_and_combine_round_trip_in_token_order() {
    // 5 tokens, top-2 over 3 experts.
    let ids = Tensor::from_slice(&[2i64, 0, 0, 1, 2, 1, 0, 2, 1, 0], &[5, 2]).unwrap();
    let r = sort_by_expert(&ids, 3).unwrap();
    let x = randn(&[5, 4], "x");
    let xs = x.moe_dispatch(&r).unwrap();
    assert_eq!(
        xs.to_vec_f32(),
        x.index_select(0, &r.token).unwrap().to_vec_f32()
    );
    // Weights of 1 and 0 for the two choices: combine gives the tokens back.
    let w = Tensor::from_slice(&[1.0f32, 0.0].repeat(5), &[5, 2]).unwrap();
    assert_eq!(xs.moe_combine(&w, &r).unwrap().to_vec_f32(), x.to_vec_f32());
    let w = randn(&[5, 2], "w");
    let y = randn(&[10, 4], "y");
    check_grad("moe_dispatch", &[x.clone()], &[], |t| t[0].moe_dispatch(&r));
    check_grad("moe_combine", &[y, w], &[], |t| t[0].moe_combine(&t[1], &r));
    // A routing for more tokens than x has is an error, not an out-of-bounds read: by its
    // size, or (when the sizes fit) by its indices.
    for rows in [3, 2] {
        let msg = x
            .narrow(0, 0, rows)
            .unwrap()
            .moe_dispatch(&r)
            .unwrap_err()
            .to_string();
        let want = match rows {
            3 => "moe_dispatch: x must be [tokens, hidden]",
            _ => "moe_dispatch: index 3 out of range for size 2",
        };
        assert!(msg.contains(want), "{msg}");
    }
    // bf16 rows stay bf16.
    let xb = x.to_dtype(DType::BF16).unwrap();
    assert_eq!(xb.moe_dispatch(&r).unwrap().dtype(), DType::BF16);
}

#[test]
fn bias_update_matches_pytorch_and_sums_micro_batches() {
    let f = fixtures();
    let counts: Vec<u64> = f["bias_update.counts"]
        .to_vec::<i64>()
        .iter()
        .map(|&c| c as u64)
        .collect();
    let bias = f["bias_update.bias"].detach().contiguous().unwrap();
    // The step's counts arrive in two micro-batches.
    let mut load = ExpertLoad::new(6);
    let half: Vec<usize> = counts.iter().map(|&c| c as usize / 2).collect();
    let rest: Vec<usize> = counts
        .iter()
        .zip(&half)
        .map(|(&c, &h)| c as usize - h)
        .collect();
    load.add(&half).unwrap();
    load.add(&rest).unwrap();
    assert_eq!(load.counts(), counts.as_slice());
    assert_eq!(load.imbalance(), 10.0 / 4.0);
    load.apply_bias_update(&bias, 1e-3).unwrap();
    assert_close(
        "bias",
        &bias.to_vec_f32(),
        &f["bias_update.out"].to_vec_f32(),
        0.0,
        1e-9,
    );
    assert!(
        load.counts().iter().all(|&c| c == 0),
        "a new step starts empty"
    );
    assert!(load.add(&[1, 2]).is_err());
    // The update keeps the bias's mean and favours the under-loaded experts.
    let b = Tensor::zeros(&[4], DType::F32);
    update_router_bias(&b, &[6, 0, 3, 3], 0.5).unwrap();
    assert_eq!(b.to_vec_f32(), vec![-0.5, 0.5, 0.0, 0.0]);
    // Centring: with one expert over and two under, the step still sums to zero.
    let b = Tensor::zeros(&[3], DType::F32);
    update_router_bias(&b, &[9, 0, 3], 0.5).unwrap();
    let got = b.to_vec_f32();
    assert!(
        got[1] == got[2] && got[0] < 0.0 && got.iter().sum::<f32>().abs() < 1e-6,
        "{got:?}"
    );
}

#[test]
fn aux_loss_is_k_when_even_and_has_gradients() {
    // Uniform scores and even counts: E · Σ (k/E)(1/E) = k.
    let scores = Tensor::full(&[8, 4], 0.25, DType::F32);
    let l = load_balancing_loss(&scores, &[4, 4, 4, 4], RouterScore::Softmax).unwrap();
    assert!((l.item().unwrap() - 2.0).abs() < 1e-6);
    let s = randn(&[6, 4], "s").softmax(-1).unwrap();
    check_grad("aux_loss", &[s], &[], |t| {
        load_balancing_loss(&t[0], &[5, 1, 0, 6], RouterScore::Softmax)
    });
    let s = randn(&[6, 4], "s").sigmoid().unwrap();
    check_grad("aux_loss_sigmoid", &[s], &[], |t| {
        load_balancing_loss(&t[0], &[5, 1, 0, 6], RouterScore::Sigmoid)
    });
}

#[test]
fn router_stats_report_load_and_entropy() {
    let scores = Tensor::full(&[5, 4], 0.25, DType::F32);
    let st = RouterStats::new(&scores, &[1, 2, 3, 4], RouterScore::Softmax).unwrap();
    assert_eq!(st.tokens_per_expert.to_vec_f32(), vec![1.0, 2.0, 3.0, 4.0]);
    assert!((st.imbalance.item().unwrap() - 4.0 / 2.5).abs() < 1e-6);
    assert!((st.entropy.item().unwrap() - 4f32.ln()).abs() < 1e-5);
    let certain = Tensor::from_slice(&[1.0f32, 0.0, 0.0, 1.0], &[2, 2]).unwrap();
    let st = RouterStats::new(&certain, &[1, 1], RouterScore::Softmax).unwrap();
    assert_eq!(
        (st.entropy.item().unwrap(), st.imbalance.item().unwrap()),
        (0.0, 1.0)
    );
}

#[test]
fn moe_ffn_on_an_empty_batch_is_empty() {
    let (d, e, f) = (4, 3, 5);
    let ws = [
        randn(&[d, e], "router"),
        randn(&[e, d, f], "gate"),
        randn(&[e, d, f], "up"),
        randn(&[e, f, d], "down"),
    ];
    let x = Tensor::zeros(&[2, 0, d], DType::F32).requires_grad_();
    let spec = MoeSpec {
        aux_loss_coef: 0.01,
        ..MoeSpec::new(spec(e, 2, RouterScore::Softmax, true, 1.0))
    };
    let m = moe_ffn(&x, &MoeWeights::new(&ws[0], &ws[1], &ws[2], &ws[3]), &spec).unwrap();
    assert_eq!(m.out.shape(), &[2, 0, d]);
    assert_eq!(counts_of(&m.counts), vec![0; e]);
    assert_eq!(m.aux_loss.unwrap().item().unwrap(), 0.0);
    assert_eq!(
        (
            m.stats.imbalance.item().unwrap(),
            m.stats.entropy.item().unwrap()
        ),
        (0.0, 0.0)
    );
}

#[test]
fn moe_ffn_rows_do_not_depend_on_the_batch_in_batch_invariant_mode() {
    // A decode step (one token) must give the bits the same token gets inside a full forward.
    // On the packed kernels (AVX-512, AVX2) each expert's rows are computed independently of
    // how many rows the expert has; elsewhere the grouped product is not batch-invariant.
    if !anneal_engine::matmul_kernels().starts_with("f32: packed") {
        return;
    }
    let _inv = anneal_engine::invariant::set_batch_invariant(true);
    let (n, d, e, f, fs) = (70, 288, 6, 48, 24);
    let x = randn(&[n, d], "x");
    let ws = [
        randn(&[d, e], "router"),
        randn(&[e, d, f], "gate"),
        randn(&[e, d, f], "up"),
        randn(&[e, f, d], "down"),
        randn(&[d, fs], "sg"),
        randn(&[d, fs], "su"),
        randn(&[fs, d], "sd"),
    ];
    let w = MoeWeights {
        shared: Some(SharedExpert {
            gate: &ws[4],
            up: &ws[5],
            down: &ws[6],
        }),
        ..MoeWeights::new(&ws[0], &ws[1], &ws[2], &ws[3])
    };
    let s = MoeSpec::new(spec(e, 2, RouterScore::Softmax, true, 1.0));
    let bits = |t: &Tensor| -> Vec<u32> { t.to_vec_f32().iter().map(|v| v.to_bits()).collect() };
    let full = moe_ffn(&x, &w, &s).unwrap().out;
    for r in [0, 1, 33, 69] {
        let one = moe_ffn(&x.narrow(0, r, 1).unwrap(), &w, &s).unwrap().out;
        assert!(
            bits(&one) == bits(&full.narrow(0, r, 1).unwrap()),
            "row {r}"
        );
    }
}

#[test]
fn the_router_stays_f32_under_autocast() {
    let (n, d, e, f) = (64, 48, 8, 32);
    let x = randn(&[n, d], "x");
    let scaled = |shape: &[usize], name: &str, fan_in: usize| {
        randn(shape, name)
            .mul_scalar(1.0 / (fan_in as f32).sqrt())
            .unwrap()
    };
    let ws = [
        randn(&[d, e], "router"),
        scaled(&[e, d, f], "gate", d),
        scaled(&[e, d, f], "up", d),
        scaled(&[e, f, d], "down", f),
    ];
    let w = MoeWeights::new(&ws[0], &ws[1], &ws[2], &ws[3]);
    let s = MoeSpec::new(spec(e, 2, RouterScore::Softmax, true, 1.0));
    let plain = moe_ffn(&x, &w, &s).unwrap();
    let amp = {
        let _amp = anneal_engine::autocast::set_autocast(Some(DType::BF16));
        moe_ffn(&x, &w, &s).unwrap()
    };
    // Same choices and the same f32 scores; the experts themselves ran in bf16.
    assert_eq!(counts_of(&amp.counts), counts_of(&plain.counts));
    assert_eq!(
        amp.stats.entropy.item().unwrap().to_bits(),
        plain.stats.entropy.item().unwrap().to_bits()
    );
    let (a, p) = (amp.out.to_vec_f32(), plain.out.to_vec_f32());
    let scale = p.iter().fold(0f32, |m, v| m.max(v.abs()));
    let err = a
        .iter()
        .zip(&p)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        err < 2e-2 * scale,
        "bf16 experts off by {err} at scale {scale}"
    );
}

/// A layer's per-expert counts as `usize`.
fn counts_of(t: &Tensor) -> Vec<usize> {
    t.to_vec::<i64>().into_iter().map(|c| c as usize).collect()
}

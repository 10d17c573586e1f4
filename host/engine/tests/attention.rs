//! Scaled dot-product attention: PyTorch fixtures (values and gradients), finite differences,
//! KV-cache decode against full causal attention, thread-count determinism, errors.

mod common;

use anneal_engine::io::load_safetensors;
use anneal_engine::ops::{scaled_dot_product_attention as sdpa, AttentionParams};
use anneal_engine::{DType, Error, Tensor};
use common::*;
use std::collections::BTreeMap;

fn fixtures() -> BTreeMap<String, Tensor> {
    load_safetensors(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/attention.safetensors"
    ))
    .unwrap()
}

/// The options of each fixture case (mirrors CASES in tests/reference/fixtures_attention.py).
fn case_params(name: &str, f: &BTreeMap<String, Tensor>) -> AttentionParams {
    let mut p = AttentionParams::default();
    match name {
        "causal" | "long" | "decode" => p.causal = true,
        "gqa" => {}
        "window" => {
            p.causal = true;
            p.sliding_window = Some(7);
        }
        "softcap" => {
            p.causal = true;
            p.softcap = Some(2.0);
            p.scale = Some(0.7);
        }
        "sinks" => {
            p.causal = true;
            p.sinks = Some(f["sinks.sinks"].clone());
        }
        "positions" => {
            p.sliding_window = Some(30);
            p.q_pos = Some(f["positions.q_pos"].clone());
            p.k_pos = Some(f["positions.k_pos"].clone());
        }
        _ => unreachable!("unknown case {name}"),
    }
    p
}

const CASES: [&str; 8] = [
    "causal",
    "long",
    "gqa",
    "window",
    "softcap",
    "sinks",
    "decode",
    "positions",
];

#[test]
fn attention_matches_pytorch_values_and_grads() {
    let f = fixtures();
    for name in CASES {
        let x = |k: &str| f[&format!("{name}.{k}")].clone();
        let mut p = case_params(name, &f);
        let (q, k, v) = (
            x("q").requires_grad_(),
            x("k").requires_grad_(),
            x("v").requires_grad_(),
        );
        let sinks = p.sinks.take().map(|s| s.requires_grad_());
        p.sinks = sinks.clone();
        let out = sdpa(&q, &k, &v, &p).unwrap();
        assert_eq!(out.shape(), x("out").shape(), "{name} shape");
        assert_close(
            &format!("{name}.out"),
            &out.to_vec_f32(),
            &x("out").to_vec_f32(),
            1e-4,
            1e-5,
        );
        out.backward_with(x("go")).unwrap();
        for (key, t) in [("dq", &q), ("dk", &k), ("dv", &v)] {
            assert_close(
                &format!("{name}.{key}"),
                &t.grad().unwrap().to_vec_f32(),
                &x(key).to_vec_f32(),
                1e-3,
                1e-4,
            );
        }
        if let Some(s) = &sinks {
            assert_close(
                &format!("{name}.dsinks"),
                &s.grad().unwrap().to_vec_f32(),
                &x("dsinks").to_vec_f32(),
                1e-3,
                1e-4,
            );
        }
    }
}

#[test]
fn attention_matches_torch_sdpa_causal() {
    let f = fixtures();
    let out = sdpa(
        &f["sdpa.q"],
        &f["sdpa.k"],
        &f["sdpa.v"],
        &AttentionParams::causal(),
    )
    .unwrap();
    assert_close(
        "sdpa",
        &out.to_vec_f32(),
        &f["sdpa.out"].to_vec_f32(),
        1e-4,
        1e-5,
    );
}

fn qkv(b: usize, hq: usize, hkv: usize, tq: usize, tk: usize, d: usize, dv: usize) -> [Tensor; 3] {
    [
        randn(&[b, hq, tq, d], "q"),
        randn(&[b, hkv, tk, d], "k"),
        randn(&[b, hkv, tk, dv], "v"),
    ]
}

#[test]
fn attention_grads_match_finite_differences() {
    let positions = |v: &[i64]| Tensor::from_slice(v, &[v.len()]).unwrap();
    type Case = (&'static str, [usize; 7], AttentionParams);
    let cases: Vec<Case> = vec![
        ("plain", [1, 2, 2, 5, 6, 4, 3], AttentionParams::default()),
        ("causal", [2, 2, 2, 6, 6, 4, 4], AttentionParams::causal()),
        ("gqa", [1, 4, 2, 5, 5, 4, 4], AttentionParams::causal()),
        (
            "window",
            [1, 2, 1, 7, 7, 4, 4],
            AttentionParams {
                sliding_window: Some(3),
                ..AttentionParams::causal()
            },
        ),
        (
            "softcap",
            [1, 2, 2, 5, 5, 4, 4],
            AttentionParams {
                softcap: Some(1.5),
                scale: Some(1.3),
                ..AttentionParams::causal()
            },
        ),
        (
            "decode",
            [1, 2, 1, 1, 6, 4, 4],
            AttentionParams {
                q_pos: Some(positions(&[4])),
                k_pos: Some(positions(&[0, 1, 2, 3, 4, 5])),
                ..AttentionParams::causal()
            },
        ),
        ("tq_lt_tk", [1, 2, 2, 3, 7, 4, 5], AttentionParams::causal()),
        // Eight (batch, kv head) pairs: the backward's grouped schedule.
        ("grouped", [4, 4, 2, 5, 6, 4, 4], AttentionParams::causal()),
        (
            "grouped_window_softcap",
            [2, 8, 4, 6, 6, 4, 3],
            AttentionParams {
                sliding_window: Some(2),
                softcap: Some(2.0),
                ..AttentionParams::causal()
            },
        ),
    ];
    for (name, [b, hq, hkv, tq, tk, d, dv], p) in cases {
        let [q, k, v] = qkv(b, hq, hkv, tq, tk, d, dv);
        check_grad(name, &[q, k, v], &[], |t| sdpa(&t[0], &t[1], &t[2], &p));
    }
    // Sinks get a gradient too (with GQA and causal masking).
    let [q, k, v] = qkv(1, 4, 2, 5, 5, 4, 4);
    let sinks = randn(&[4], "sinks");
    check_grad("sinks", &[q, k, v, sinks], &[], |t| {
        let p = AttentionParams {
            sinks: Some(t[3].clone()),
            ..AttentionParams::causal()
        };
        sdpa(&t[0], &t[1], &t[2], &p)
    });
}

#[test]
fn decode_with_kv_cache_equals_rows_of_full_causal_attention() {
    let [q, k, v] = qkv(2, 4, 2, 130, 130, 16, 16);
    let full = sdpa(&q, &k, &v, &AttentionParams::causal()).unwrap();
    for t in [0usize, 63, 64, 100, 129] {
        let q_t = q.narrow(2, t, 1).unwrap();
        let (k_t, v_t) = (
            k.narrow(2, 0, t + 1).unwrap(),
            v.narrow(2, 0, t + 1).unwrap(),
        );
        // Default positions put the single query last, at position t.
        let step = sdpa(&q_t, &k_t, &v_t, &AttentionParams::causal()).unwrap();
        let want = full.narrow(2, t, 1).unwrap();
        assert_close(
            &format!("decode t={t}"),
            &step.to_vec_f32(),
            &want.to_vec_f32(),
            1e-5,
            1e-6,
        );
        // Explicit positions against a longer (partly unwritten) cache give the same row.
        let p = AttentionParams {
            q_pos: Some(Tensor::from_slice(&[t as i64], &[1]).unwrap()),
            ..AttentionParams::causal()
        };
        let with_pos = sdpa(&q_t, &k, &v, &p).unwrap();
        assert_close(
            &format!("decode pos t={t}"),
            &with_pos.to_vec_f32(),
            &want.to_vec_f32(),
            1e-5,
            1e-6,
        );
    }
}

#[test]
fn attention_is_thread_invariant() {
    // Both backward schedules: split (2 × 2 kv heads) and grouped (8 × 1).
    for (b, hkv) in [(2, 2), (8, 1)] {
        thread_invariant_case(b, hkv);
    }
}

fn thread_invariant_case(b: usize, hkv: usize) {
    let [q, k, v] = qkv(b, 4, hkv, 150, 150, 16, 16);
    let sinks = randn(&[4], "sinks");
    let go = randn(&[b, 4, 150, 16], "go");
    for p in [
        AttentionParams::causal(),
        AttentionParams {
            sliding_window: Some(40),
            softcap: Some(5.0),
            sinks: Some(sinks.clone()),
            ..AttentionParams::causal()
        },
    ] {
        assert_thread_invariant("attention", || {
            let (q, k, v) = (
                q.detach().requires_grad_(),
                k.detach().requires_grad_(),
                v.detach().requires_grad_(),
            );
            let out = sdpa(&q, &k, &v, &p).unwrap();
            out.backward_with(go.clone()).unwrap();
            vec![out, q.grad().unwrap(), k.grad().unwrap(), v.grad().unwrap()]
        });
    }
}

#[test]
fn attention_half_precision_returns_input_dtype() {
    let [q, k, v] = qkv(1, 2, 2, 70, 70, 8, 8);
    let want = sdpa(&q, &k, &v, &AttentionParams::causal()).unwrap();
    for dt in [DType::BF16, DType::F16] {
        let c = |t: &Tensor| t.to_dtype(dt).unwrap().requires_grad_();
        let (qh, kh, vh) = (c(&q), c(&k), c(&v));
        let out = sdpa(&qh, &kh, &vh, &AttentionParams::causal()).unwrap();
        assert_eq!(out.dtype(), dt);
        assert_close("half", &out.to_vec_f32(), &want.to_vec_f32(), 3e-2, 3e-2);
        out.sum_all().unwrap().backward().unwrap();
        assert_eq!(qh.grad().unwrap().dtype(), dt);
        assert_eq!(kh.grad().unwrap().dtype(), dt);
    }
}

#[test]
fn fully_masked_rows_are_zero_and_sinks_alone_give_zero() {
    // Queries placed before every key see nothing.
    let [q, k, v] = qkv(1, 2, 2, 2, 4, 4, 4);
    let p = AttentionParams {
        q_pos: Some(Tensor::from_slice(&[-5i64, -1], &[2]).unwrap()),
        ..AttentionParams::causal()
    };
    let out = sdpa(&q, &k, &v, &p).unwrap();
    assert!(out.to_vec_f32().iter().all(|&x| x == 0.0));
    let p = AttentionParams {
        sinks: Some(randn(&[2], "sinks")),
        ..p
    };
    let out = sdpa(&q, &k, &v, &p).unwrap();
    assert!(out.to_vec_f32().iter().all(|&x| x == 0.0));
}

#[test]
fn attention_rejects_bad_shapes_and_options() {
    let [q, k, v] = qkv(1, 4, 2, 5, 5, 8, 8);
    let p = AttentionParams::default();
    // Hq not a multiple of Hkv.
    let k3 = randn(&[1, 3, 5, 8], "k3");
    let v3 = randn(&[1, 3, 5, 8], "v3");
    assert!(matches!(
        sdpa(&q, &k3, &v3, &p),
        Err(Error::ShapeMismatch {
            op: "attention",
            ..
        })
    ));
    // Head dims differ between q and k.
    let k6 = randn(&[1, 2, 5, 6], "k6");
    let e = sdpa(&q, &k6, &v, &p).unwrap_err();
    assert!(e.to_string().contains("[1, 4, 5, 8]") && e.to_string().contains("[1, 2, 5, 6]"));
    // k and v disagree on length.
    let v4 = randn(&[1, 2, 4, 8], "v4");
    assert!(matches!(
        sdpa(&q, &k, &v4, &p),
        Err(Error::ShapeMismatch { .. })
    ));
    // Batch mismatch and wrong rank.
    let k2 = randn(&[2, 2, 5, 8], "k2");
    assert!(sdpa(&q, &k2, &v, &p).is_err());
    assert!(sdpa(&randn(&[4, 5, 8], "q3"), &k, &v, &p).is_err());
    // Bad options.
    for bad in [
        AttentionParams {
            sinks: Some(randn(&[3], "s")),
            ..AttentionParams::default()
        },
        AttentionParams {
            softcap: Some(0.0),
            ..AttentionParams::default()
        },
        AttentionParams {
            sliding_window: Some(0),
            ..AttentionParams::default()
        },
        AttentionParams {
            q_pos: Some(Tensor::arange(4, DType::I64)),
            ..AttentionParams::default()
        },
        AttentionParams {
            k_pos: Some(Tensor::arange(5, DType::F32)),
            ..AttentionParams::default()
        },
    ] {
        let e = sdpa(&q, &k, &v, &bad).unwrap_err();
        assert!(e.to_string().starts_with("attention"), "{e}");
    }
    // Integer inputs.
    let qi = q.to_dtype(DType::I32).unwrap();
    assert!(matches!(sdpa(&qi, &k, &v, &p), Err(Error::DType { .. })));
}

#[test]
fn attention_reads_strided_views() {
    // q, k, v as [B, T, H, D] tensors viewed as [B, H, T, D] (the usual projection layout).
    let (q, k, v) = (
        randn(&[2, 70, 4, 8], "q"),
        randn(&[2, 70, 2, 8], "k"),
        randn(&[2, 70, 2, 8], "v"),
    );
    let t = |x: &Tensor| x.transpose(1, 2).unwrap();
    let got = sdpa(&t(&q), &t(&k), &t(&v), &AttentionParams::causal()).unwrap();
    let c = |x: &Tensor| t(x).contiguous().unwrap();
    let want = sdpa(&c(&q), &c(&k), &c(&v), &AttentionParams::causal()).unwrap();
    assert_eq!(got.to_vec_f32(), want.to_vec_f32());
}

#[test]
fn attention_handles_empty_sequences() {
    for (tq, tk) in [(0usize, 5usize), (3, 0), (0, 0)] {
        let [q, k, v] = qkv(1, 2, 1, tq, tk, 4, 4);
        let (q, k, v) = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_());
        let out = sdpa(&q, &k, &v, &AttentionParams::causal()).unwrap();
        assert_eq!(out.shape(), [1, 2, tq, 4]);
        assert!(out.to_vec_f32().iter().all(|&x| x == 0.0));
        out.sum_all().unwrap().backward().unwrap();
        assert_eq!(k.grad().unwrap().shape(), [1, 1, tk, 4]);
    }
}

//! Fused transformer ops: finite-difference gradients, thread-count determinism, edge cases and
//! error messages. (Values against PyTorch live in `fixtures_fused.rs`.)

mod common;

use anneal_engine::ops::{
    cross_entropy, rope_tables, CrossEntropy, Llama3Scaling, Reduction, RopeLayout, RopeSpec,
    RopeStyle,
};
use anneal_engine::{DType, Error, Tensor};
use common::*;

fn ids(v: &[i64], shape: &[usize]) -> Tensor {
    Tensor::from_slice(v, shape).unwrap()
}

#[test]
fn softmax_grads() {
    let x = randn(&[3, 4, 5], "sm");
    for dim in [-1isize, 0, 1] {
        check_grad("softmax", std::slice::from_ref(&x), &[], |t| {
            t[0].softmax(dim)
        });
        check_grad("log_softmax", std::slice::from_ref(&x), &[], |t| {
            t[0].log_softmax(dim)
        });
    }
    // A strided (transposed) input takes the same path after a gather.
    check_grad("softmax_t", std::slice::from_ref(&x), &[], |t| {
        t[0].transpose(0, 2)?.softmax(-1)
    });
}

#[test]
fn softmax_rows_sum_to_one_and_handle_extremes() {
    let x = Tensor::from_slice(&[1000.0f32, 0.0, -1000.0, f32::NEG_INFINITY], &[1, 4]).unwrap();
    let y = x.softmax(-1).unwrap().to_vec_f32();
    assert_eq!(y, vec![1.0, 0.0, 0.0, 0.0]);
    let l = x.log_softmax(-1).unwrap().to_vec_f32();
    assert_eq!(l[0], 0.0);
    assert_eq!(l[3], f32::NEG_INFINITY);
    let s = randn(&[7, 300], "rows")
        .softmax(-1)
        .unwrap()
        .sum_dims(&[-1], false)
        .unwrap();
    assert_close("row sums", &s.to_vec_f32(), &[1.0; 7], 1e-6, 1e-6);
}

#[test]
fn norm_grads() {
    let x = randn(&[3, 2, 7], "nx");
    let w = rand(&[7], 0.5, 1.5, "nw");
    let b = randn(&[7], "nb");
    check_grad("rms_norm", &[x.clone(), w.clone()], &[], |t| {
        t[0].rms_norm(Some(&t[1]), 1e-5)
    });
    check_grad("rms_norm_nw", std::slice::from_ref(&x), &[], |t| {
        t[0].rms_norm(None, 1e-5)
    });
    check_grad("layer_norm", &[x.clone(), w.clone(), b.clone()], &[], |t| {
        t[0].layer_norm(Some(&t[1]), Some(&t[2]), 1e-5)
    });
    check_grad("layer_norm_w", &[x.clone(), w.clone()], &[], |t| {
        t[0].layer_norm(Some(&t[1]), None, 1e-5)
    });
    check_grad("layer_norm_b", &[x.clone(), b.clone()], &[], |t| {
        t[0].layer_norm(None, Some(&t[1]), 1e-5)
    });
    // Weight without grad: only x differentiates.
    check_grad("rms_norm_const_w", &[x.clone(), w.clone()], &[1], |t| {
        t[0].rms_norm(Some(&t[1]), 1e-5)
    });
}

#[test]
fn norms_keep_dtype() {
    let x = randn(&[4, 8], "bx").to_dtype(DType::BF16).unwrap();
    let w = Tensor::ones(&[8], DType::BF16);
    assert_eq!(x.rms_norm(Some(&w), 1e-5).unwrap().dtype(), DType::BF16);
    let xl = x.detach().requires_grad_();
    let wl = w.detach().requires_grad_();
    xl.layer_norm(Some(&wl), None, 1e-5)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(wl.grad().unwrap().dtype(), DType::BF16);
    assert_eq!(xl.grad().unwrap().dtype(), DType::BF16);
}

fn tables(t: usize, rot: usize) -> (Tensor, Tensor) {
    let pos = Tensor::arange(t, DType::I64);
    rope_tables(&pos, rot, 10000.0, None).unwrap()
}

#[test]
fn rope_grads_every_style_and_layout() {
    for layout in [RopeLayout::Bhtd, RopeLayout::Bthd] {
        for style in [RopeStyle::Interleaved, RopeStyle::HalfSplit] {
            for rot in [8, 4] {
                let (c, s) = tables(5, rot);
                let spec = RopeSpec { style, layout };
                let x = randn(&[2, 3, 5, 8], "rx");
                let x = if layout == RopeLayout::Bthd {
                    randn(&[2, 5, 3, 8], "rx")
                } else {
                    x
                };
                check_grad("rope", &[x], &[], |t| t[0].rope(&c, &s, spec));
            }
        }
    }
}

#[test]
fn rope_per_sequence_tables_and_identity() {
    // [B, T] positions give [B, T, R] tables; batch 1 rows equal those of its own positions.
    let pos = ids(&[0, 1, 2, 7, 8, 9], &[2, 3]);
    let (c, s) = rope_tables(&pos, 4, 10000.0, None).unwrap();
    assert_eq!(c.shape(), &[2, 3, 2]);
    let x = randn(&[2, 2, 3, 6], "rb");
    let spec = RopeSpec {
        style: RopeStyle::HalfSplit,
        layout: RopeLayout::Bhtd,
    };
    let y = x.rope(&c, &s, spec).unwrap();
    let (c1, s1) = rope_tables(&ids(&[7, 8, 9], &[3]), 4, 10000.0, None).unwrap();
    let y1 = x.narrow(0, 1, 1).unwrap().rope(&c1, &s1, spec).unwrap();
    assert_eq!(y.narrow(0, 1, 1).unwrap().to_vec_f32(), y1.to_vec_f32());
    // Position 0 is the identity; partial rotary leaves the tail untouched.
    let (c0, s0) = rope_tables(&ids(&[0, 0, 0], &[3]), 4, 10000.0, None).unwrap();
    assert_eq!(x.rope(&c0, &s0, spec).unwrap().to_vec_f32(), x.to_vec_f32());
    let tail = |t: &Tensor| t.narrow(-1, 4, 2).unwrap().to_vec_f32();
    assert_eq!(tail(&y), tail(&x));
    check_grad("rope_batched", &[x], &[], |t| t[0].rope(&c, &s, spec));
}

#[test]
fn llama3_scaling_keeps_high_and_scales_low_frequencies() {
    let sc = Llama3Scaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };
    let plain = anneal_engine::ops::rope_inv_freq(128, 500000.0, None);
    let scaled = anneal_engine::ops::rope_inv_freq(128, 500000.0, Some(sc.into()));
    assert_eq!(plain[0], scaled[0]);
    assert!((scaled[63] - plain[63] / 8.0).abs() < 1e-18);
    assert!(scaled
        .iter()
        .zip(&plain)
        .all(|(s, p)| s <= p && *s >= p / 8.0));
}

#[test]
fn yarn_scaling_matches_transformers() {
    use anneal_engine::ops::{rope_inv_freq, YarnScaling};
    // transformers 5.24 `_compute_yarn_parameters` for head_dim 16, theta 150000, factor 32,
    // beta 32/1, original context 64, truncate off and on.
    let want = |second: f64| {
        [
            1.0,
            second,
            0.0015879147686064243,
            0.0003579445765353739,
            8.068715396802872e-05,
            1.818833698052913e-05,
            4.099978468730114e-06,
            9.242089618055616e-07,
        ]
    };
    for (truncate, second) in [(false, 0.08524909615516663), (true, 0.11623115837574005)] {
        let y = YarnScaling {
            factor: 32.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            original_max_position_embeddings: 64,
            truncate,
            attention_factor: None,
            mscale: None,
            mscale_all_dim: None,
        };
        let got = rope_inv_freq(16, 150000.0, Some(y.into()));
        for (g, w) in got.iter().zip(want(second)) {
            assert!((g - w).abs() <= 1e-6 * w, "truncate {truncate}: {g} vs {w}");
        }
        assert!((y.attention_factor() - 1.3465735902799727).abs() < 1e-12);
        // The tables carry the attention factor.
        let pos = Tensor::from_vec(vec![0i64, 3], &[2]).unwrap();
        let (c, _) = rope_tables(&pos, 16, 150000.0, Some(y.into())).unwrap();
        assert!((c.to_vec_f32()[0] as f64 - 1.3465735902799727).abs() < 1e-6);
    }
    // DeepSeek-V3 derives the factor from mscale / mscale_all_dim (equal: a factor of 1).
    let ds = YarnScaling {
        factor: 40.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
        original_max_position_embeddings: 4096,
        truncate: true,
        attention_factor: None,
        mscale: Some(1.0),
        mscale_all_dim: Some(1.0),
    };
    assert_eq!(ds.attention_factor(), 1.0);
}

#[test]
fn embedding_grads() {
    let w = randn(&[6, 5], "ew");
    let idx = ids(&[1, 4, 1, 0, 5, 1], &[2, 3]);
    check_grad("embedding", &[w], &[], |t| t[0].embedding(&idx));
}

#[test]
fn cross_entropy_grads_every_option() {
    let x = randn(&[6, 9], "cx").mul_scalar(2.0).unwrap();
    let t = ids(&[3, -100, 8, 0, 5, -100], &[6]);
    for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
        for eps in [0.0, 0.15] {
            let opts = CrossEntropy {
                reduction,
                label_smoothing: eps,
                ..Default::default()
            };
            check_grad("cross_entropy", &[x.clone()], &[], |l| {
                cross_entropy(&l[0], &t, &opts)
            });
        }
    }
    // Leading dims are flattened: [B, T, V] logits with [B, T] targets.
    let x3 = randn(&[2, 3, 9], "cx3");
    let t3 = ids(&[3, 7, 8, 0, 5, 1], &[2, 3]);
    let none = CrossEntropy {
        reduction: Reduction::None,
        ..Default::default()
    };
    assert_eq!(cross_entropy(&x3, &t3, &none).unwrap().shape(), &[2, 3]);
    check_grad("cross_entropy_3d", &[x3], &[], |l| {
        cross_entropy(&l[0], &t3, &CrossEntropy::default())
    });
}

#[test]
fn cross_entropy_all_ignored_is_zero_with_zero_grads() {
    let x = randn(&[3, 4], "ci").requires_grad_();
    let t = ids(&[-1, -1, -1], &[3]);
    let opts = CrossEntropy {
        ignore_index: Some(-1),
        ..Default::default()
    };
    let loss = cross_entropy(&x, &t, &opts).unwrap();
    assert_eq!(loss.item().unwrap(), 0.0);
    loss.backward().unwrap();
    assert!(x.grad().unwrap().to_vec_f32().iter().all(|&g| g == 0.0));
}

#[test]
fn fused_ops_are_thread_invariant() {
    // Sizes span several parallel tasks (and several weight-gradient blocks).
    let x = randn(&[2000, 64], "tx");
    let w = rand(&[64], 0.5, 1.5, "tw");
    let b = randn(&[64], "tb");
    let g = randn(&[2000, 64], "tg");
    assert_thread_invariant("norms", || {
        let (xl, wl, bl) = (
            x.detach().requires_grad_(),
            w.detach().requires_grad_(),
            b.detach().requires_grad_(),
        );
        let y1 = xl.rms_norm(Some(&wl), 1e-5).unwrap();
        let y2 = xl.layer_norm(Some(&wl), Some(&bl), 1e-5).unwrap();
        y1.add(&y2)
            .unwrap()
            .mul(&g)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        vec![
            y1,
            y2,
            xl.grad().unwrap(),
            wl.grad().unwrap(),
            bl.grad().unwrap(),
        ]
    });
    assert_thread_invariant("softmax", || {
        let xl = x.detach().requires_grad_();
        let (a, c) = (xl.softmax(-1).unwrap(), xl.log_softmax(0).unwrap());
        a.add(&c)
            .unwrap()
            .mul(&g)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        vec![a, c, xl.grad().unwrap()]
    });
    let (cos, sin) = tables(250, 64);
    assert_thread_invariant("rope", || {
        let xl = x
            .reshape(&[2, 4, 250, 64])
            .unwrap()
            .detach()
            .requires_grad_();
        let spec = RopeSpec {
            style: RopeStyle::Interleaved,
            layout: RopeLayout::Bhtd,
        };
        let y = xl.rope(&cos, &sin, spec).unwrap();
        y.mul(&g.reshape(&[2, 4, 250, 64]).unwrap())
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        vec![y, xl.grad().unwrap()]
    });
    let idv: Vec<i64> = (0..4000).map(|i| (i * 7919 % 300) as i64).collect();
    let idx = ids(&idv, &[4000]);
    let emb = randn(&[300, 32], "temb");
    let ge = randn(&[4000, 32], "tge");
    assert_thread_invariant("embedding", || {
        let wl = emb.detach().requires_grad_();
        let y = wl.embedding(&idx).unwrap();
        y.mul(&ge).unwrap().sum_all().unwrap().backward().unwrap();
        vec![y, wl.grad().unwrap()]
    });
    let tg: Vec<i64> = (0..2000)
        .map(|i| if i % 9 == 0 { -100 } else { i % 64 })
        .collect();
    let tg = ids(&tg, &[2000]);
    assert_thread_invariant("cross_entropy", || {
        let xl = x.detach().requires_grad_();
        let opts = CrossEntropy {
            label_smoothing: 0.1,
            ..Default::default()
        };
        let l = cross_entropy(&xl, &tg, &opts).unwrap();
        l.backward().unwrap();
        vec![l, xl.grad().unwrap()]
    });
}

fn err_text(r: anneal_engine::Result<Tensor>) -> String {
    r.expect_err("expected an error").to_string()
}

#[test]
fn errors_name_the_op_and_the_problem() {
    let x = randn(&[2, 3], "e");
    assert!(err_text(x.softmax(2)).contains("softmax"));
    let bad_w = randn(&[4], "w4");
    let e = err_text(x.rms_norm(Some(&bad_w), 1e-5));
    assert!(
        e.contains("rms_norm") && e.contains("[2, 3]") && e.contains("[4]"),
        "{e}"
    );
    assert!(err_text(x.layer_norm(None, Some(&bad_w), 1e-5)).contains("layer_norm"));

    let w = randn(&[5, 3], "ew");
    let e = x_err(w.embedding(&ids(&[0, 5], &[2])));
    assert!(
        matches!(
            e,
            Error::IndexOutOfRange {
                op: "embedding",
                index: 5,
                size: 5
            }
        ),
        "{e}"
    );
    assert!(matches!(
        x_err(w.embedding(&ids(&[-1], &[1]))),
        Error::IndexOutOfRange { .. }
    ));
    assert!(matches!(x_err(w.embedding(&x)), Error::DType { .. }));

    let logits = randn(&[2, 4], "el");
    let e = x_err(cross_entropy(
        &logits,
        &ids(&[1, 4], &[2]),
        &CrossEntropy::default(),
    ));
    assert!(
        matches!(
            e,
            Error::IndexOutOfRange {
                op: "cross_entropy",
                index: 4,
                size: 4
            }
        ),
        "{e}"
    );
    let e = err_text(cross_entropy(
        &logits,
        &ids(&[1, 2, 3], &[3]),
        &CrossEntropy::default(),
    ));
    assert!(
        e.contains("cross_entropy") && e.contains("[2, 4]") && e.contains("[3]"),
        "{e}"
    );
    let smooth = CrossEntropy {
        label_smoothing: 1.5,
        ..Default::default()
    };
    assert!(
        err_text(cross_entropy(&logits, &ids(&[1, 2], &[2]), &smooth)).contains("label_smoothing")
    );

    let (c, s) = tables(5, 8);
    let spec = RopeSpec {
        style: RopeStyle::HalfSplit,
        layout: RopeLayout::Bhtd,
    };
    let e = err_text(randn(&[1, 2, 4, 8], "r").rope(&c, &s, spec));
    assert!(
        e.contains("rope") && e.contains("[1, 2, 4, 8]") && e.contains("[5, 4]"),
        "{e}"
    );
    assert!(err_text(randn(&[2, 5, 6], "r3").rope(&c, &s, spec)).contains("rank 4"));
    let e = err_text(randn(&[1, 2, 5, 6], "r6").rope(&c, &s, spec));
    assert!(e.contains("rope"), "rot_dim 8 > head_dim 6: {e}");
    assert!(rope_tables(&Tensor::arange(3, DType::I64), 7, 1e4, None).is_err());
    assert!(rope_tables(&randn(&[3], "p"), 8, 1e4, None).is_err());
}

fn x_err(r: anneal_engine::Result<Tensor>) -> Error {
    r.expect_err("expected an error")
}

#[test]
fn views_and_half_dtypes_go_through_the_same_kernels() {
    // Embedding from an offset view and from a transposed (strided) weight.
    let big = randn(&[8, 5], "vw");
    let idx = ids(&[0, 3, 3, 1], &[4]);
    let view = big.narrow(0, 2, 4).unwrap();
    let want = view
        .contiguous()
        .unwrap()
        .embedding(&idx)
        .unwrap()
        .to_vec_f32();
    assert_eq!(view.embedding(&idx).unwrap().to_vec_f32(), want);
    let wt = randn(&[5, 8], "vt").transpose(0, 1).unwrap();
    let want = wt
        .contiguous()
        .unwrap()
        .embedding(&idx)
        .unwrap()
        .to_vec_f32();
    assert_eq!(wt.embedding(&idx).unwrap().to_vec_f32(), want);
    // bf16 rope and softmax keep their dtype and agree with f32 to bf16 precision.
    let x = randn(&[1, 2, 5, 8], "hx");
    let xb = x.to_dtype(DType::BF16).unwrap();
    let (c, s) = tables(5, 8);
    let spec = RopeSpec {
        style: RopeStyle::Interleaved,
        layout: RopeLayout::Bhtd,
    };
    let yb = xb.rope(&c, &s, spec).unwrap();
    assert_eq!(yb.dtype(), DType::BF16);
    let y = xb.to_dtype(DType::F32).unwrap().rope(&c, &s, spec).unwrap();
    assert_close("bf16 rope", &yb.to_vec_f32(), &y.to_vec_f32(), 1e-2, 1e-2);
    assert_eq!(xb.softmax(1).unwrap().dtype(), DType::BF16);
    // A 0-d tensor is a one-element row.
    assert_eq!(
        Tensor::scalar(3.0).softmax(-1).unwrap().item().unwrap(),
        1.0
    );
}

#[test]
fn softmax_over_a_leading_dim_with_wide_strips() {
    // inner = 600 spans several column strips; compare with the last-dim path on a transpose.
    let x = randn(&[4, 600], "wide");
    for log in [false, true] {
        let f = |t: &Tensor, d: isize| if log { t.log_softmax(d) } else { t.softmax(d) };
        let got = f(&x, 0).unwrap();
        let want = f(&x.transpose(0, 1).unwrap(), -1)
            .unwrap()
            .transpose(0, 1)
            .unwrap();
        assert_close("strips", &got.to_vec_f32(), &want.to_vec_f32(), 1e-6, 1e-6);
        check_grad("softmax_strips", std::slice::from_ref(&x), &[], |t| {
            f(&t[0], 0)
        });
    }
    assert_thread_invariant("softmax_strips", || {
        let xl = x.detach().requires_grad_();
        let y = xl.softmax(0).unwrap();
        y.mul(&x).unwrap().sum_all().unwrap().backward().unwrap();
        vec![y, xl.grad().unwrap()]
    });
}

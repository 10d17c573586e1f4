//! Fused transformer ops against PyTorch fixtures (regenerate with
//! `tests/reference/make_fixtures.py fused`): outputs and input gradients of `sum(out * proj)`.

mod common;

use anneal_engine::io::load_safetensors;
use anneal_engine::ops::{
    cross_entropy, rope_tables, CrossEntropy, Llama3Scaling, Reduction, RopeLayout, RopeSpec,
    RopeStyle,
};
use anneal_engine::{DType, Tensor};
use common::assert_close;
use std::collections::BTreeMap;

fn fixtures() -> BTreeMap<String, Tensor> {
    load_safetensors(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/fused.safetensors"
    ))
    .unwrap()
}

/// Compares `got` with fixture `key` (same shape, close values).
fn check(f: &BTreeMap<String, Tensor>, key: &str, got: &Tensor, tol: f32) {
    let want = &f[key];
    assert_eq!(got.shape(), want.shape(), "{key} shape");
    assert_close(key, &got.to_vec_f32(), &want.to_vec_f32(), tol, tol);
}

/// Runs `op` on leaves, checks the output against `{key}.out` and each leaf's gradient of
/// `sum(out * {key}.proj)` against `{key}.{grad_names[i]}`.
fn check_op(
    f: &BTreeMap<String, Tensor>,
    key: &str,
    inputs: &[&Tensor],
    grad_names: &[&str],
    op: impl Fn(&[Tensor]) -> Tensor,
) {
    let leaves: Vec<Tensor> = inputs.iter().map(|t| t.detach().requires_grad_()).collect();
    let out = op(&leaves);
    check(f, &format!("{key}.out"), &out, 1e-5);
    out.mul(&f[&format!("{key}.proj")])
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    for (leaf, g) in leaves.iter().zip(grad_names) {
        check(f, &format!("{key}.{g}"), &leaf.grad().unwrap(), 2e-5);
    }
}

#[test]
fn softmax_and_log_softmax_match_pytorch() {
    let f = fixtures();
    for dim in [-1isize, 1] {
        let k = format!("softmax.d{dim}");
        check_op(&f, &k, &[&f[&format!("{k}.x")]], &["gx"], |t| {
            t[0].softmax(dim).unwrap()
        });
        let k = format!("log_softmax.d{dim}");
        check_op(&f, &k, &[&f[&format!("{k}.x")]], &["gx"], |t| {
            t[0].log_softmax(dim).unwrap()
        });
    }
}

#[test]
fn norms_match_pytorch() {
    let f = fixtures();
    check_op(&f, "rms", &[&f["rms.x"], &f["rms.w"]], &["gx", "gw"], |t| {
        t[0].rms_norm(Some(&t[1]), 1e-5).unwrap()
    });
    check(
        &f,
        "rms_nw.out",
        &f["rms.x"].rms_norm(None, 1e-6).unwrap(),
        1e-5,
    );
    check_op(
        &f,
        "ln",
        &[&f["rms.x"], &f["rms.w"], &f["ln.b"]],
        &["gx", "gw", "gb"],
        |t| t[0].layer_norm(Some(&t[1]), Some(&t[2]), 1e-5).unwrap(),
    );
    check(
        &f,
        "ln_nw.out",
        &f["rms.x"].layer_norm(None, None, 1e-5).unwrap(),
        1e-5,
    );
}

#[test]
fn rope_tables_match_reference_formula() {
    let f = fixtures();
    let pos = &f["rope.pos"];
    let llama3 = Llama3Scaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 16,
    };
    for (k, rot, theta, sc) in [
        ("plain", 16, 10000.0, None),
        ("partial", 8, 500.0, None),
        ("llama3", 16, 500000.0, Some(llama3.into())),
    ] {
        let (c, s) = rope_tables(pos, rot, theta, sc).unwrap();
        check(&f, &format!("rope.{k}.cos"), &c, 1e-6);
        check(&f, &format!("rope.{k}.sin"), &s, 1e-6);
    }
    // Hugging Face computes in f32; the f64 tables agree to f32 angle rounding.
    let (c, _) = rope_tables(pos, 16, 500000.0, Some(llama3.into())).unwrap();
    check(&f, "rope.llama3.cos_f32", &c, 1e-4);
}

#[test]
fn rope_matches_pytorch_in_both_layouts() {
    let f = fixtures();
    for k in ["plain", "partial", "llama3"] {
        let (c, s) = (&f[&format!("rope.{k}.cos")], &f[&format!("rope.{k}.sin")]);
        for (name, style) in [
            ("inter", RopeStyle::Interleaved),
            ("half", RopeStyle::HalfSplit),
        ] {
            let key = format!("rope.{k}.{name}");
            let bhtd = RopeSpec {
                style,
                layout: RopeLayout::Bhtd,
            };
            check_op(&f, &key, &[&f["rope.x"]], &["gx"], |t| {
                t[0].rope(c, s, bhtd).unwrap()
            });
            // The same values through the [B, T, H, D] layout.
            let bthd = RopeSpec {
                style,
                layout: RopeLayout::Bthd,
            };
            let x_bthd = f["rope.x"].transpose(1, 2).unwrap().contiguous().unwrap();
            let out = x_bthd.rope(c, s, bthd).unwrap().transpose(1, 2).unwrap();
            check(&f, &format!("{key}.out"), &out, 1e-5);
        }
    }
}

#[test]
fn embedding_matches_pytorch() {
    let f = fixtures();
    check_op(&f, "emb", &[&f["emb.w"]], &["gw"], |t| {
        t[0].embedding(&f["emb.ids"]).unwrap()
    });
    // i32 ids give the same rows.
    let ids32 = f["emb.ids"].to_dtype(DType::I32).unwrap();
    check(&f, "emb.out", &f["emb.w"].embedding(&ids32).unwrap(), 0.0);
}

#[test]
fn cross_entropy_matches_pytorch() {
    let f = fixtures();
    let (x, t) = (&f["ce.x"], &f["ce.t"]);
    for (k, reduction, eps) in [
        ("mean", Reduction::Mean, 0.0),
        ("smooth", Reduction::Mean, 0.1),
        ("sum", Reduction::Sum, 0.0),
        ("none", Reduction::None, 0.2),
    ] {
        let opts = CrossEntropy {
            reduction,
            label_smoothing: eps,
            ..Default::default()
        };
        check_op(&f, &format!("ce.{k}"), &[x], &["gx"], |l| {
            cross_entropy(&l[0], t, &opts).unwrap()
        });
    }
    let xl = f["ce_long.x"].detach().requires_grad_();
    let loss = xl
        .cross_entropy(&f["ce_long.t"], &CrossEntropy::default())
        .unwrap();
    check(&f, "ce_long.out", &loss, 1e-5);
    loss.backward().unwrap();
    check(&f, "ce_long.gx", &xl.grad().unwrap(), 1e-6);
}

#[test]
fn cross_entropy_accepts_bf16_logits() {
    let f = fixtures();
    let x16 = f["ce.x"]
        .to_dtype(DType::BF16)
        .unwrap()
        .detach()
        .requires_grad_();
    // The reference: the same bf16 values, upcast to f32.
    let x32 = x16.to_dtype(DType::F32).unwrap().detach().requires_grad_();
    let opts = CrossEntropy::default();
    let (a, b) = (
        cross_entropy(&x16, &f["ce.t"], &opts).unwrap(),
        cross_entropy(&x32, &f["ce.t"], &opts).unwrap(),
    );
    assert_eq!(a.dtype(), DType::F32);
    assert_close("bf16 loss", &a.to_vec_f32(), &b.to_vec_f32(), 1e-6, 1e-6);
    a.backward().unwrap();
    b.backward().unwrap();
    let g16 = x16.grad().unwrap();
    assert_eq!(g16.dtype(), DType::BF16);
    assert_close(
        "bf16 grad",
        &g16.to_vec_f32(),
        &x32.grad().unwrap().to_vec_f32(),
        1e-2,
        1e-4,
    );
}

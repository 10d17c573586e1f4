//! SwiGLU: equal bit for bit to `silu(gate) * up` composed from ops (values and gradients),
//! gradients against finite differences, thread-count invariance, bf16 inputs, shape errors.

mod common;

use anneal_engine::{DType, Tensor};
use common::{assert_thread_invariant, check_grad, randn};

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec_f32().iter().map(|v| v.to_bits()).collect()
}

#[test]
fn swiglu_equals_the_composed_ops_bitwise() {
    for shape in [&[7][..], &[3, 40_000], &[2, 5, 33]] {
        let grad = randn(shape, "dy");
        let run = |fused: bool| {
            let g = randn(shape, "gate").requires_grad_();
            let u = randn(shape, "up").requires_grad_();
            let y = if fused {
                g.swiglu(&u).unwrap()
            } else {
                g.silu().unwrap().mul(&u).unwrap()
            };
            y.backward_with(grad.clone()).unwrap();
            (bits(&y), bits(&g.grad().unwrap()), bits(&u.grad().unwrap()))
        };
        assert!(run(true) == run(false), "shape {shape:?}");
    }
}

#[test]
fn swiglu_gradients_match_finite_differences() {
    check_grad(
        "swiglu",
        &[randn(&[4, 9], "g"), randn(&[4, 9], "u")],
        &[],
        |t| t[0].swiglu(&t[1]),
    );
}

#[test]
fn swiglu_is_thread_count_invariant_and_keeps_bf16() {
    assert_thread_invariant("swiglu", || {
        let g = randn(&[64, 1000], "g").requires_grad_();
        let u = randn(&[64, 1000], "u").requires_grad_();
        let y = g.swiglu(&u).unwrap();
        y.backward_with(randn(&[64, 1000], "dy")).unwrap();
        vec![y, g.grad().unwrap(), u.grad().unwrap()]
    });
    let g = randn(&[3, 8], "g").to_dtype(DType::BF16).unwrap();
    let u = randn(&[3, 8], "u").to_dtype(DType::BF16).unwrap();
    let y = g.swiglu(&u).unwrap();
    assert_eq!(y.dtype(), DType::BF16);
    // Computed in f32 and rounded to bf16 once (the composed ops would round twice).
    let f32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    let want = f32(&g)
        .silu()
        .unwrap()
        .mul(&f32(&u))
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    assert_eq!(y.to_vec_f32(), want.to_vec_f32());
}

#[test]
fn swiglu_names_mismatched_shapes() {
    let e = randn(&[2, 3], "g")
        .swiglu(&randn(&[3, 2], "u"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("swiglu") && e.contains("[2, 3]") && e.contains("[3, 2]"),
        "{e}"
    );
    let ids = Tensor::from_slice(&[1i64, 2], &[2]).unwrap();
    assert!(ids.swiglu(&ids).is_err());
}

//! Shared test helpers: finite-difference gradient checks and thread-count determinism.
#![allow(dead_code)]

use anneal_engine::rng::RngKey;
use anneal_engine::{autograd, DType, Result, Tensor};

/// Random normal f32 tensor from a named stream.
pub fn randn(shape: &[usize], name: &str) -> Tensor {
    Tensor::rand_normal(shape, 0.0, 1.0, &RngKey::new(1234, name), 0, DType::F32).unwrap()
}

/// Random uniform f32 tensor in [lo, hi).
pub fn rand(shape: &[usize], lo: f32, hi: f32, name: &str) -> Tensor {
    Tensor::rand_uniform(shape, lo, hi, &RngKey::new(99, name), 0, DType::F32).unwrap()
}

fn set_elem(t: &Tensor, i: usize, v: f32) -> Tensor {
    let mut data = t.to_vec_f32();
    data[i] = v;
    Tensor::from_vec(data, t.shape()).unwrap()
}

/// Checks the gradients of `f` at `inputs` against central finite differences of
/// `sum(f(x) * w)` for a fixed random `w`. Inputs listed in `skip` (e.g. integer indices) are not
/// differentiated. At most `max_elems` elements per input are probed.
pub fn check_grad(
    name: &str,
    inputs: &[Tensor],
    skip: &[usize],
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
) {
    check_grad_tol(name, inputs, skip, 1e-2, 2e-2, 2e-3, f)
}

/// [`check_grad`] with explicit step and tolerances.
pub fn check_grad_tol(
    name: &str,
    inputs: &[Tensor],
    skip: &[usize],
    eps: f32,
    rtol: f32,
    atol: f32,
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
) {
    let leaves: Vec<Tensor> = inputs
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if skip.contains(&i) {
                t.detach()
            } else {
                t.detach().requires_grad_()
            }
        })
        .collect();
    let out = f(&leaves).unwrap_or_else(|e| panic!("{name}: forward failed: {e}"));
    let w = randn(out.shape(), &format!("{name}-proj"));
    let loss = out
        .to_dtype(DType::F32)
        .unwrap()
        .mul(&w)
        .unwrap()
        .sum_all()
        .unwrap();
    loss.backward()
        .unwrap_or_else(|e| panic!("{name}: backward failed: {e}"));
    let objective = |xs: &[Tensor]| -> f64 {
        let _g = autograd::no_grad();
        let o = f(xs).unwrap().to_vec_f32();
        o.iter()
            .zip(w.to_vec_f32())
            .map(|(&a, b)| a as f64 * b as f64)
            .sum()
    };
    for (i, leaf) in leaves.iter().enumerate() {
        if skip.contains(&i) {
            continue;
        }
        let analytic = leaf
            .grad()
            .unwrap_or_else(|| panic!("{name}: input {i} got no gradient"))
            .to_vec_f32();
        assert_eq!(
            analytic.len(),
            leaf.numel(),
            "{name}: gradient {i} has the wrong size"
        );
        let n = leaf.numel();
        let step = (n / 48).max(1);
        for j in (0..n).step_by(step) {
            let x = leaf.to_vec_f32()[j];
            let mut xs: Vec<Tensor> = leaves.iter().map(|t| t.detach()).collect();
            xs[i] = set_elem(&leaf.detach(), j, x + eps);
            let plus = objective(&xs);
            xs[i] = set_elem(&leaf.detach(), j, x - eps);
            let minus = objective(&xs);
            let numeric = ((plus - minus) / (2.0 * eps as f64)) as f32;
            let a = analytic[j];
            assert!(
                (a - numeric).abs() <= atol + rtol * a.abs().max(numeric.abs()),
                "{name}: d/d input{i}[{j}]: analytic {a} vs numeric {numeric}"
            );
        }
    }
}

/// Runs `f` on a 1-thread and a 2-thread pool and asserts bitwise-identical outputs.
pub fn assert_thread_invariant(name: &str, f: impl Fn() -> Vec<Tensor> + Sync) {
    let run = |threads: usize| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(|| {
                f().iter()
                    .map(|t| {
                        t.to_vec_f32()
                            .iter()
                            .map(|v| v.to_bits())
                            .collect::<Vec<u32>>()
                    })
                    .collect::<Vec<_>>()
            })
    };
    let (one, two) = (run(1), run(2));
    assert_eq!(one.len(), two.len());
    for (k, (a, b)) in one.iter().zip(&two).enumerate() {
        assert!(a == b, "{name}: output {k} differs between 1 and 2 threads");
    }
}

/// Asserts two float slices are close.
pub fn assert_close(name: &str, got: &[f32], want: &[f32], rtol: f32, atol: f32) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= atol + rtol * w.abs() || (g.is_nan() && w.is_nan()) || g == w,
            "{name}[{i}]: got {g}, want {w}"
        );
    }
}

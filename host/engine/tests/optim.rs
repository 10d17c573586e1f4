//! The fused multi-tensor AdamW: equal to the same update composed from elementwise ops,
//! bitwise identical for 1 and 2 threads, and clear errors for tensors it cannot update.

mod common;

use anneal_engine::ops::{adamw_step, AdamW, AdamWTensors};
use anneal_engine::{DType, Tensor};
use common::{assert_thread_invariant, randn};

/// Parameter sizes: odd, below and above the kernel's chunk size, and a matrix.
const SHAPES: [&[usize]; 4] = [&[7], &[3, 33], &[40_000], &[128, 257]];

fn hp(step: u64) -> AdamW {
    AdamW {
        lr: 3e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        step,
    }
}

/// The AdamW plugin's former update, one elementwise op at a time.
fn reference(p: &Tensor, g: &Tensor, m: &Tensor, v: &Tensor, hp: &AdamW) -> [Tensor; 3] {
    let (b1, b2) = (hp.beta1 as f32, hp.beta2 as f32);
    let m_new = m
        .mul_scalar(b1)
        .unwrap()
        .add(&g.mul_scalar((1.0 - hp.beta1) as f32).unwrap())
        .unwrap();
    let v_new = v
        .mul_scalar(b2)
        .unwrap()
        .add(
            &g.mul(g)
                .unwrap()
                .mul_scalar((1.0 - hp.beta2) as f32)
                .unwrap(),
        )
        .unwrap();
    let t = hp.step as i32;
    let (bc1, bc2) = (1.0 - hp.beta1.powi(t), 1.0 - hp.beta2.powi(t));
    let denom = v_new
        .mul_scalar((1.0 / bc2) as f32)
        .unwrap()
        .sqrt()
        .unwrap()
        .add_scalar(hp.eps as f32)
        .unwrap();
    let update = m_new
        .mul_scalar((1.0 / bc1) as f32)
        .unwrap()
        .div(&denom)
        .unwrap();
    let p_new = p
        .mul_scalar((1.0 - hp.lr * hp.weight_decay) as f32)
        .unwrap()
        .sub(&update.mul_scalar(hp.lr as f32).unwrap())
        .unwrap();
    [p_new, m_new, v_new]
}

struct State {
    p: Vec<Tensor>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
}

fn fresh() -> State {
    let p = SHAPES
        .iter()
        .enumerate()
        .map(|(i, s)| randn(s, &format!("p{i}")))
        .collect();
    let zeros = || {
        SHAPES
            .iter()
            .map(|s| Tensor::zeros(s, DType::F32))
            .collect()
    };
    State {
        p,
        m: zeros(),
        v: zeros(),
    }
}

fn grads(step: u64) -> Vec<Tensor> {
    SHAPES
        .iter()
        .enumerate()
        .map(|(i, s)| randn(s, &format!("g{i}-{step}")))
        .collect()
}

fn fused_steps(s: &State, steps: u64) {
    for step in 1..=steps {
        let g = grads(step);
        let groups: Vec<AdamWTensors> = (0..SHAPES.len())
            .map(|i| AdamWTensors {
                param: &s.p[i],
                grad: &g[i],
                exp_avg: &s.m[i],
                exp_avg_sq: &s.v[i],
            })
            .collect();
        adamw_step(&groups, &hp(step)).unwrap();
    }
}

#[test]
fn fused_adamw_equals_the_composed_update() {
    let fused = fresh();
    fused_steps(&fused, 3);
    let r = fresh();
    let (mut p, mut m, mut v) = (r.p, r.m, r.v);
    for step in 1..=3 {
        let g = grads(step);
        for i in 0..SHAPES.len() {
            [p[i], m[i], v[i]] = reference(&p[i], &g[i], &m[i], &v[i], &hp(step));
        }
    }
    for i in 0..SHAPES.len() {
        for (name, got, want) in [
            ("param", &fused.p[i], &p[i]),
            ("exp_avg", &fused.m[i], &m[i]),
            ("exp_avg_sq", &fused.v[i], &v[i]),
        ] {
            // `==` on values: the composed form may turn a -0.0 into +0.0, nothing else.
            assert!(
                got.to_vec_f32() == want.to_vec_f32(),
                "{name} {i} differs from the composed update"
            );
        }
    }
}

#[test]
fn fused_adamw_is_thread_count_invariant() {
    assert_thread_invariant("adamw", || {
        let s = fresh();
        fused_steps(&s, 2);
        s.p.into_iter().chain(s.m).chain(s.v).collect()
    });
}

#[test]
fn fused_adamw_rejects_what_it_cannot_update() {
    let p = randn(&[4, 4], "p");
    let g = randn(&[4, 4], "g");
    let (m, v) = (
        Tensor::zeros(&[4, 4], DType::F32),
        Tensor::zeros(&[4, 4], DType::F32),
    );
    let one = |param: &Tensor, grad: &Tensor, m: &Tensor, v: &Tensor| {
        adamw_step(
            &[AdamWTensors {
                param,
                grad,
                exp_avg: m,
                exp_avg_sq: v,
            }],
            &hp(1),
        )
        .unwrap_err()
        .to_string()
    };
    let e = one(&p, &g.to_dtype(DType::BF16).unwrap(), &m, &v);
    assert!(e.contains("adamw") && e.contains("bf16"), "{e}");
    let e = one(&p, &randn(&[4, 5], "g2"), &m, &v);
    assert!(e.contains("adamw") && e.contains("[4, 5]"), "{e}");
    let e = one(&p, &g, &m, &m);
    assert!(e.contains("share storage"), "{e}");
    let e = one(&p.transpose(0, 1).unwrap(), &g, &m, &v);
    assert!(e.contains("contiguous"), "{e}");
    // A strided gradient is fine (read through a copy).
    let gt = g.transpose(0, 1).unwrap();
    adamw_step(
        &[AdamWTensors {
            param: &p,
            grad: &gt,
            exp_avg: &m,
            exp_avg_sq: &v,
        }],
        &hp(1),
    )
    .unwrap();
}

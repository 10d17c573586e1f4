//! Elementwise, reduction, matmul and view ops: values, gradients, determinism, errors.

mod common;

use anneal_engine::{autograd, DType, Tensor};
use common::*;

#[test]
fn unary_grads_match_finite_differences() {
    let x = randn(&[3, 5], "x");
    let pos = rand(&[3, 5], 0.5, 2.0, "pos");
    for (name, input) in [
        ("neg", &x),
        ("exp", &x),
        ("tanh", &x),
        ("sigmoid", &x),
        ("silu", &x),
        ("gelu", &x),
        ("gelu_erf", &x),
        ("relu", &x),
        ("softplus", &x),
        ("abs", &x),
        ("sin", &x),
        ("cos", &x),
        ("log", &pos),
        ("sqrt", &pos),
        ("rsqrt", &pos),
    ] {
        check_grad(name, &[input.clone()], &[], |t| {
            let x = &t[0];
            match name {
                "neg" => x.neg(),
                "exp" => x.exp(),
                "tanh" => x.tanh(),
                "sigmoid" => x.sigmoid(),
                "silu" => x.silu(),
                "gelu" => x.gelu(),
                "gelu_erf" => x.gelu_erf(),
                "relu" => x.relu(),
                "softplus" => x.softplus(),
                "abs" => x.abs(),
                "sin" => x.sin(),
                "cos" => x.cos(),
                "log" => x.log(),
                "sqrt" => x.sqrt(),
                "rsqrt" => x.rsqrt(),
                _ => unreachable!(),
            }
        });
    }
}

#[test]
fn unary_values() {
    let x = Tensor::from_slice(&[-2.0f32, -0.5, 0.0, 0.7, 3.0], &[5]).unwrap();
    let v = x.to_vec_f32();
    let check = |name: &str, got: Tensor, f: fn(f32) -> f32| {
        let want: Vec<f32> = v.iter().map(|&a| f(a)).collect();
        assert_close(name, &got.to_vec_f32(), &want, 1e-6, 1e-7);
    };
    check("exp", x.exp().unwrap(), f32::exp);
    check("sigmoid", x.sigmoid().unwrap(), |a| {
        1.0 / (1.0 + (-a).exp())
    });
    check("silu", x.silu().unwrap(), |a| a / (1.0 + (-a).exp()));
    check("softplus", x.softplus().unwrap(), |a| (1.0 + a.exp()).ln());
    check("gelu", x.gelu().unwrap(), |a| {
        0.5 * a * (1.0 + (0.797_884_6 * (a + 0.044715 * a * a * a)).tanh())
    });
}

#[test]
fn binary_broadcast_grads() {
    let a = randn(&[2, 3, 4], "a");
    let b = randn(&[3, 1], "b");
    let pos = rand(&[4], 0.5, 2.0, "pos");
    check_grad("add", &[a.clone(), b.clone()], &[], |t| t[0].add(&t[1]));
    check_grad("sub", &[a.clone(), b.clone()], &[], |t| t[0].sub(&t[1]));
    check_grad("mul", &[a.clone(), b.clone()], &[], |t| t[0].mul(&t[1]));
    check_grad("div", &[a.clone(), pos.clone()], &[], |t| t[0].div(&t[1]));
    check_grad("maximum", &[a.clone(), b.clone()], &[], |t| {
        t[0].maximum(&t[1])
    });
    check_grad("minimum", &[a.clone(), b.clone()], &[], |t| {
        t[0].minimum(&t[1])
    });
    check_grad("scalar", &[a.clone()], &[], |t| t[0].affine(-1.5, 0.25));
    check_grad("pow", &[pos.clone()], &[], |t| t[0].powf(2.5));
    check_grad("clamp", &[a.clone()], &[], |t| t[0].clamp(-0.5, 0.5));
}

#[test]
fn binary_values_with_strided_and_broadcast_operands() {
    let a = Tensor::from_slice(&(0..6).map(|i| i as f32).collect::<Vec<_>>(), &[2, 3]).unwrap();
    let b = Tensor::from_slice(&[10.0f32, 20.0], &[2, 1]).unwrap();
    let s = a
        .transpose(0, 1)
        .unwrap()
        .add(&b.transpose(0, 1).unwrap())
        .unwrap();
    assert_eq!(s.shape(), &[3, 2]);
    assert_eq!(s.to_vec_f32(), vec![10.0, 23.0, 11.0, 24.0, 12.0, 25.0]);
}

#[test]
fn reductions_and_grads() {
    let x = randn(&[3, 4, 5], "x");
    check_grad("sum", &[x.clone()], &[], |t| t[0].sum_dims(&[1], false));
    check_grad("sum2", &[x.clone()], &[], |t| t[0].sum_dims(&[0, 2], true));
    check_grad("mean", &[x.clone()], &[], |t| t[0].mean_dims(&[-1], false));
    check_grad("max", &[x.clone()], &[], |t| t[0].max_dim(1, false));
    check_grad("min", &[x.clone()], &[], |t| t[0].min_dim(-1, true));
    check_grad("var", &[x.clone()], &[], |t| t[0].var_dims(&[2], 1, false));
    let v = Tensor::from_slice(&[1.0f32, 5.0, 3.0, 5.0, -1.0, 0.0], &[2, 3]).unwrap();
    assert_eq!(v.argmax(1, false).unwrap().to_vec::<i64>(), vec![1, 0]);
    assert_eq!(v.argmin(0, false).unwrap().to_vec::<i64>(), vec![0, 1, 1]);
    assert_eq!(v.sum_all().unwrap().item().unwrap(), 13.0);
    let var = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[4])
        .unwrap()
        .var_dims(&[0], 1, false)
        .unwrap();
    assert!((var.item().unwrap() - 5.0 / 3.0).abs() < 1e-6);
}

#[test]
fn matmul_values_grads_and_layouts() {
    let a = randn(&[2, 3, 4], "a");
    let b = randn(&[2, 4, 5], "b");
    let w = randn(&[4, 5], "w");
    check_grad("bmm", &[a.clone(), b.clone()], &[], |t| t[0].matmul(&t[1]));
    check_grad("linear", &[a.clone(), w.clone()], &[], |t| {
        t[0].matmul(&t[1])
    });
    check_grad("bcast", &[randn(&[3, 4], "a2"), b.clone()], &[], |t| {
        t[0].matmul(&t[1])
    });
    // A transposed operand read in place gives the product of the materialized transpose.
    let wt = randn(&[5, 4], "wt");
    let p1 = a.matmul(&wt.transpose(0, 1).unwrap()).unwrap().to_vec_f32();
    let p2 = a
        .matmul(&wt.transpose(0, 1).unwrap().contiguous().unwrap())
        .unwrap()
        .to_vec_f32();
    assert_close("transposed rhs", &p1, &p2, 1e-5, 1e-6);
    // Against a naive product.
    let (av, wv) = (a.to_vec_f32(), w.to_vec_f32());
    let got = a.matmul(&w).unwrap().to_vec_f32();
    for r in 0..6 {
        for c in 0..5 {
            let want: f32 = (0..4).map(|k| av[r * 4 + k] * wv[k * 5 + c]).sum();
            assert!((got[r * 5 + c] - want).abs() < 1e-5);
        }
    }
}

#[test]
fn views_share_storage_and_backprop() {
    let x = randn(&[2, 3, 4], "x");
    let p = x.permute(&[2, 0, 1]).unwrap();
    assert!(p.shares_storage_with(&x) && !p.is_contiguous());
    let n = x.narrow(1, 1, 2).unwrap();
    assert!(n.shares_storage_with(&x));
    check_grad("permute", &[x.clone()], &[], |t| {
        t[0].permute(&[2, 0, 1])?.reshape(&[4, 6])
    });
    check_grad("narrow", &[x.clone()], &[], |t| t[0].narrow(1, 1, 2));
    check_grad("expand", &[randn(&[3, 1], "e")], &[], |t| {
        t[0].expand(&[2, 3, 4])
    });
    check_grad("unsqueeze", &[x.clone()], &[], |t| {
        t[0].unsqueeze(1)?.squeeze(1)
    });
    let c = p.contiguous().unwrap();
    assert!(c.is_contiguous() && !c.shares_storage_with(&x));
    assert_eq!(c.to_vec_f32(), p.to_vec_f32());
}

#[test]
fn dtypes_cast_and_compute_in_f32() {
    let x = Tensor::from_slice(&[1.5f32, -2.25, 3.0], &[3]).unwrap();
    for dt in [DType::BF16, DType::F16, DType::I32, DType::I64] {
        let y = x.to_dtype(dt).unwrap();
        assert_eq!(y.dtype(), dt);
        let back = y.to_dtype(DType::F32).unwrap().to_vec_f32();
        if dt.is_float() {
            assert_eq!(back, vec![1.5, -2.25, 3.0]);
        } else {
            assert_eq!(back, vec![1.0, -2.0, 3.0]);
        }
    }
    let h = x.to_dtype(DType::BF16).unwrap();
    let e = h.exp().unwrap();
    assert_eq!(e.dtype(), DType::BF16);
    assert_eq!(
        e.to_vec_f32(),
        x.exp().unwrap().to_dtype(DType::BF16).unwrap().to_vec_f32()
    );
}

#[test]
fn gradient_accumulates_across_backward_calls_and_hooks_fire_once_final() {
    use std::sync::{Arc, Mutex};
    let w = randn(&[3], "w").requires_grad_();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s2 = seen.clone();
    w.register_grad_hook(Box::new(move |g| s2.lock().unwrap().push(g.to_vec_f32())))
        .unwrap();
    // w is used twice in one graph: the hook fires once, after both contributions.
    let y = w
        .mul_scalar(2.0)
        .unwrap()
        .add(&w.mul_scalar(3.0).unwrap())
        .unwrap()
        .sum_all()
        .unwrap();
    y.backward().unwrap();
    assert_eq!(seen.lock().unwrap().clone(), vec![vec![5.0; 3]]);
    let y = w.mul_scalar(2.0).unwrap().sum_all().unwrap();
    y.backward().unwrap();
    assert_eq!(w.grad().unwrap().to_vec_f32(), vec![7.0; 3]);
    assert!(
        y.backward().is_err(),
        "second backward through freed graph must fail cleanly"
    );
    w.zero_grad();
    assert!(w.grad().is_none());
}

#[test]
fn no_grad_and_detach_record_nothing() {
    let w = randn(&[3], "w").requires_grad_();
    {
        let _g = autograd::no_grad();
        assert!(!w.exp().unwrap().requires_grad());
    }
    assert!(w.exp().unwrap().requires_grad());
    assert!(!w.detach().exp().unwrap().requires_grad());
}

#[test]
fn checkpoint_recomputes_to_same_gradients() {
    use std::sync::Arc;
    let w = randn(&[4, 4], "w");
    let x = randn(&[2, 4], "x");
    let run = |ckpt: bool| {
        let w = w.detach().requires_grad_();
        let x = x.detach().requires_grad_();
        let w2 = w.clone();
        let f: autograd::checkpoint::RegionFn =
            Arc::new(move |t: &[Tensor]| t[0].matmul(&w2)?.silu()?.matmul(&w2));
        let y = if ckpt {
            autograd::checkpoint(&[x.clone()], f).unwrap()
        } else {
            f(&[x.clone()]).unwrap()
        };
        y.sum_all().unwrap().backward().unwrap();
        (
            w.grad().unwrap().to_vec_f32(),
            x.grad().unwrap().to_vec_f32(),
        )
    };
    assert_eq!(run(true), run(false));
}

#[test]
fn ops_are_bitwise_identical_across_thread_counts() {
    let a = randn(&[64, 96, 33], "a");
    let w = randn(&[33, 200], "w");
    let big = randn(&[300_000], "big");
    assert_thread_invariant("core", || {
        vec![
            a.matmul(&w).unwrap(),
            a.silu().unwrap(),
            a.sum_dims(&[1], false).unwrap(),
            big.sum_all().unwrap(),
            a.transpose(0, 2).unwrap().contiguous().unwrap(),
        ]
    });
    let x = randn(&[512, 512], "x");
    let y = randn(&[512, 512], "y");
    assert_thread_invariant("large matmul", || vec![x.matmul(&y).unwrap()]);
}

#[test]
fn shape_errors_name_the_op_and_shapes() {
    let a = Tensor::zeros(&[2, 3], DType::F32);
    let b = Tensor::zeros(&[4, 5], DType::F32);
    let e = a.matmul(&b).unwrap_err().to_string();
    assert!(
        e.contains("matmul") && e.contains("[2, 3]") && e.contains("[4, 5]"),
        "{e}"
    );
    let e = a.add(&b).unwrap_err().to_string();
    assert!(
        e.contains("add") && e.contains("[2, 3]") && e.contains("[4, 5]"),
        "{e}"
    );
    let e = a.reshape(&[7]).unwrap_err().to_string();
    assert!(e.contains("reshape"), "{e}");
    let e = a.transpose(0, 5).unwrap_err().to_string();
    assert!(e.contains("transpose") && e.contains("5"), "{e}");
}

#[test]
fn sum_of_squares_is_exact_in_f64_and_thread_invariant() {
    let x = Tensor::from_vec(vec![3.0f32, -4.0, 0.5], &[3]).unwrap();
    assert_eq!(x.sum_of_squares(), 25.25);
    let big = randn(&[300, 1000], "sumsq");
    let want: f64 = big.to_vec_f32().iter().map(|&v| v as f64 * v as f64).sum();
    let got = big.sum_of_squares();
    assert!((got - want).abs() < 1e-9 * want, "{got} vs {want}");
    assert_thread_invariant("sum_of_squares", || {
        vec![Tensor::scalar(big.sum_of_squares() as f32)]
    });
    // A strided view reads the viewed elements only.
    let t = big.transpose(0, 1).unwrap();
    assert_eq!(
        t.sum_of_squares().to_bits(),
        t.contiguous().unwrap().sum_of_squares().to_bits()
    );
}

#[test]
fn to_bytes_is_a_row_major_copy() {
    let a = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]).unwrap();
    let want: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    assert_eq!(a.to_bytes(), want);
    let t = a.transpose(0, 1).unwrap();
    let want_t: Vec<u8> = [1.0f32, 4.0, 2.0, 5.0, 3.0, 6.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    assert_eq!(t.to_bytes(), want_t);
    assert_eq!(a.narrow(0, 1, 1).unwrap().to_bytes(), want[12..]);
    let h = a.to_dtype(DType::BF16).unwrap();
    assert_eq!(h.to_bytes().len(), 12);
}

#[test]
fn contiguous_copies_rows_of_permuted_views() {
    let (b, t, h, d) = (2, 3, 4, 16);
    let data: Vec<f32> = (0..b * t * h * d).map(|i| i as f32).collect();
    let x = Tensor::from_vec(data.clone(), &[b, t, h, d]).unwrap();
    let y = x
        .transpose(1, 2)
        .unwrap()
        .contiguous()
        .unwrap()
        .to_vec_f32();
    for bi in 0..b {
        for hi in 0..h {
            for ti in 0..t {
                for di in 0..d {
                    let got = y[((bi * h + hi) * t + ti) * d + di];
                    assert_eq!(got, data[((bi * t + ti) * h + hi) * d + di]);
                }
            }
        }
    }
    let n = x
        .narrow(3, 4, 8)
        .unwrap()
        .contiguous()
        .unwrap()
        .to_vec_f32();
    assert_eq!(&n[..8], &data[4..12]);
    assert_eq!(&n[8..16], &data[d + 4..d + 12]);
}

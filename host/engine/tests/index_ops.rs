//! Indexing and shape ops: values against PyTorch, gradients against finite differences,
//! determinism across thread counts, and errors.

mod common;

use anneal_engine::io::load_safetensors;
use anneal_engine::ops::{cat, stack, where_};
use anneal_engine::{DType, Error, Tensor};
use common::*;

fn fixtures() -> std::collections::BTreeMap<String, Tensor> {
    load_safetensors(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/index.safetensors"
    ))
    .unwrap()
}

fn check(name: &str, got: &Tensor, want: &Tensor) {
    assert_eq!(got.shape(), want.shape(), "{name} shape");
    assert_close(name, &got.to_vec_f32(), &want.to_vec_f32(), 1e-5, 1e-6);
}

/// Indices in `0..hi` (i64) drawn from a named stream.
fn rand_idx(shape: &[usize], hi: usize, name: &str) -> Tensor {
    rand(shape, 0.0, hi as f32 - 1e-3, name)
        .to_dtype(DType::I64)
        .unwrap()
}

/// Distinct values at least 0.25 apart (so finite differences never reorder top-k).
fn spaced(shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|i| ((i * 37) % n) as f32 * 0.25 - 2.0).collect();
    Tensor::from_vec(v, shape).unwrap()
}

#[test]
fn index_ops_match_pytorch() {
    let f = fixtures();
    let (v, i) = f["topk.x"].topk(3, 1, true, true).unwrap();
    check("topk.values", &v, &f["topk.values"]);
    assert_eq!(i.dtype(), DType::I64);
    assert_eq!(i.to_vec::<i64>(), f["topk.indices"].to_vec::<i64>());
    let (v, i) = f["topk_min.x"].topk(2, 0, false, true).unwrap();
    check("topk_min.values", &v, &f["topk_min.values"]);
    assert_eq!(i.to_vec::<i64>(), f["topk_min.indices"].to_vec::<i64>());

    for name in ["gather", "gather_small"] {
        let got = f[&format!("{name}.x")]
            .gather(1, &f[&format!("{name}.idx")])
            .unwrap();
        check(name, &got, &f[&format!("{name}.out")]);
    }
    for (name, dim) in [("scatter_add", 0), ("scatter_add1", 2)] {
        let x = &f[&format!("{name}.x")];
        let got = x
            .scatter_add(dim, &f[&format!("{name}.idx")], &f[&format!("{name}.src")])
            .unwrap();
        check(name, &got, &f[&format!("{name}.out")]);
    }
    let x = &f["index_select.x"];
    check(
        "index_select0",
        &x.index_select(0, &f["index_select.idx0"]).unwrap(),
        &f["index_select.out0"],
    );
    assert_eq!(f["index_select.idx2"].dtype(), DType::I32);
    check(
        "index_select2",
        &x.index_select(2, &f["index_select.idx2"]).unwrap(),
        &f["index_select.out2"],
    );
    check(
        "where",
        &where_(&f["where.cond"], &f["where.a"], &f["where.b"]).unwrap(),
        &f["where.out"],
    );
    check(
        "masked_fill",
        &f["masked_fill.x"]
            .masked_fill(&f["masked_fill.mask"], -1.5)
            .unwrap(),
        &f["masked_fill.out"],
    );
    let (a, b, c) = (&f["cat.a"], &f["cat.b"], &f["cat.c"]);
    check(
        "cat",
        &cat(&[a.clone(), b.clone(), c.clone()], 1).unwrap(),
        &f["cat.out"],
    );
    let parts = [
        a.clone(),
        a.mul_scalar(2.0).unwrap(),
        a.add_scalar(-1.0).unwrap(),
    ];
    check("stack", &stack(&parts, 1).unwrap(), &f["stack.out"]);
}

#[test]
fn topk_ties_take_lower_index_first_and_unsorted_is_index_order() {
    let x = Tensor::from_slice(&[1.0f32, 3.0, 3.0, 0.0, 3.0, f32::NAN], &[6]).unwrap();
    let (v, i) = x.topk(3, 0, true, true).unwrap();
    assert_eq!(i.to_vec::<i64>(), vec![5, 1, 2]);
    assert!(v.to_vec_f32()[0].is_nan());
    let (_, i) = x.topk(4, 0, false, true).unwrap();
    assert_eq!(i.to_vec::<i64>(), vec![3, 0, 1, 2]);
    let (v, i) = x.topk(3, 0, false, false).unwrap();
    assert_eq!(i.to_vec::<i64>(), vec![0, 1, 3]);
    assert_eq!(v.to_vec_f32(), vec![1.0, 3.0, 0.0]);
    // bf16 values keep their dtype.
    let (v, _) = x
        .to_dtype(DType::BF16)
        .unwrap()
        .topk(1, 0, false, true)
        .unwrap();
    assert_eq!(v.dtype(), DType::BF16);
}

#[test]
fn index_grads_match_finite_differences() {
    let x = randn(&[3, 5, 4], "x");
    check_grad("topk", &[spaced(&[4, 10])], &[], |t| {
        Ok(t[0].topk(3, 1, true, true)?.0)
    });
    check_grad("topk_min_dim0", &[spaced(&[6, 5])], &[], |t| {
        Ok(t[0].topk(2, 0, false, false)?.0)
    });
    let idx = rand_idx(&[3, 7, 4], 5, "gidx");
    check_grad("gather", &[x.clone(), idx.clone()], &[1], |t| {
        t[0].gather(1, &t[1])
    });
    let small = rand_idx(&[2, 3, 2], 4, "gsmall");
    check_grad("gather_small_dim2", &[x.clone(), small], &[1], |t| {
        t[0].gather(2, &t[1])
    });
    let sidx = rand_idx(&[3, 3, 4], 5, "sidx");
    let src = randn(&[3, 4, 4], "src");
    check_grad("scatter_add", &[x.clone(), sidx, src], &[1], |t| {
        t[0].scatter_add(1, &t[1], &t[2])
    });
    let i0 = Tensor::from_slice(&[2i64, 0, 2, 1], &[4]).unwrap();
    check_grad("index_select", &[x.clone(), i0.clone()], &[1], |t| {
        t[0].index_select(1, &t[1])
    });
    let add_src = randn(&[3, 4, 4], "add_src");
    check_grad("index_add", &[x.clone(), i0, add_src], &[1], |t| {
        t[0].index_add(1, &t[1], &t[2])
    });
}

#[test]
fn where_and_masked_fill_grads() {
    let cond = Tensor::from_slice(&[1i64, 0, 3], &[3, 1]).unwrap();
    let (a, b) = (randn(&[3, 4], "a"), randn(&[4], "b"));
    check_grad("where", &[a.clone(), b], &[], |t| {
        where_(&cond, &t[0], &t[1])
    });
    let mask = Tensor::from_slice(&[0.0f32, 1.0, 0.0, 1.0], &[4]).unwrap();
    check_grad("masked_fill", &[a], &[], |t| t[0].masked_fill(&mask, 7.0));
}

#[test]
fn cat_stack_split_chunk_grads() {
    let (a, b) = (randn(&[2, 3], "a"), randn(&[2, 5], "b"));
    check_grad("cat", &[a.clone(), b.clone()], &[], |t| {
        cat(&[t[0].clone(), t[1].clone(), t[0].clone()], 1)
    });
    let c = randn(&[2, 3], "c");
    check_grad("stack", &[a.clone(), c], &[], |t| {
        stack(&[t[0].clone(), t[1].clone()], 2)
    });
    check_grad("split", &[b.clone()], &[], |t| {
        let mut p = t[0].split(2, 1)?;
        assert_eq!(p.len(), 3);
        assert_eq!(p[2].shape(), &[2, 1]);
        p.reverse();
        cat(&p, 1)
    });
    check_grad("split_with_sizes", &[b.clone()], &[], |t| {
        let p = t[0].split_with_sizes(&[1, 4], 1)?;
        p[1].mul_scalar(3.0)?.sum_dims(&[1], true)?.add(&p[0])
    });
    let chunks = b.chunk(2, 1).unwrap();
    assert_eq!(
        chunks.iter().map(|t| t.shape()[1]).collect::<Vec<_>>(),
        vec![3, 2]
    );
    assert_eq!(b.chunk(3, 0).unwrap().len(), 2);
    check_grad("chunk", &[b], &[], |t| {
        let p = t[0].chunk(2, 1)?;
        cat(&[p[1].clone(), p[0].exp()?], 1)
    });
}

#[test]
fn index_ops_are_thread_invariant() {
    let x = randn(&[64, 300], "big");
    let idx0 = rand_idx(&[200, 300], 64, "i0");
    let src0 = randn(&[200, 300], "s0");
    let idx1 = rand_idx(&[64, 900], 300, "i1");
    let src1 = randn(&[64, 900], "s1");
    let rows = rand_idx(&[500], 64, "rows");
    let cond = rand(&[64, 1], 0.0, 1.0, "cond")
        .ge(&Tensor::scalar(0.5))
        .unwrap();
    assert_thread_invariant("index ops", || {
        vec![
            x.scatter_add(0, &idx0, &src0).unwrap(),
            x.scatter_add(1, &idx1, &src1).unwrap(),
            x.gather(1, &idx1).unwrap(),
            x.index_select(0, &rows).unwrap(),
            Tensor::zeros(&[64, 300], DType::F32)
                .index_add(0, &rows, &x.index_select(0, &rows).unwrap())
                .unwrap(),
            x.topk(17, 1, true, true).unwrap().0,
            x.topk(5, 0, false, true).unwrap().1,
            where_(&cond, &x, &x.neg().unwrap()).unwrap(),
            cat(&[x.clone(), x.clone()], 0).unwrap(),
        ]
    });
}

#[test]
fn index_errors_name_the_op() {
    let x = randn(&[3, 4], "x");
    let oob = Tensor::from_slice(&[0i64, 4], &[1, 2]).unwrap();
    let err = x.gather(1, &oob).unwrap_err();
    assert!(
        matches!(
            err,
            Error::IndexOutOfRange {
                op: "gather",
                index: 4,
                size: 4
            }
        ),
        "{err}"
    );
    let neg = Tensor::from_slice(&[-1i64], &[1]).unwrap();
    assert!(matches!(
        x.index_select(0, &neg).unwrap_err(),
        Error::IndexOutOfRange {
            op: "index_select",
            index: -1,
            ..
        }
    ));
    let src = randn(&[1, 2], "src");
    let idx = Tensor::from_slice(&[0i64, 3], &[1, 2]).unwrap();
    assert!(matches!(
        x.scatter_add(0, &idx, &src).unwrap_err(),
        Error::IndexOutOfRange {
            op: "scatter_add",
            index: 3,
            size: 3
        }
    ));
    let too_big = Tensor::zeros(&[2, 5], DType::I64);
    assert!(matches!(
        x.gather(0, &too_big).unwrap_err(),
        Error::ShapeMismatch { op: "gather", .. }
    ));
    assert!(matches!(
        x.scatter_add(0, &Tensor::zeros(&[2, 3], DType::I64), &src)
            .unwrap_err(),
        Error::ShapeMismatch {
            op: "scatter_add",
            ..
        }
    ));
    assert!(matches!(
        x.gather(1, &Tensor::zeros(&[3, 1], DType::F32))
            .unwrap_err(),
        Error::DType { op: "gather", .. }
    ));
    assert!(x
        .index_select(0, &Tensor::zeros(&[1, 1], DType::I64))
        .is_err());
    let msg = x.topk(5, 1, true, true).unwrap_err().to_string();
    assert!(msg.contains("topk") && msg.contains("k = 5"), "{msg}");
    assert!(matches!(
        cat(&[x.clone(), randn(&[2, 4], "y")], 1).unwrap_err(),
        Error::ShapeMismatch { op: "cat", .. }
    ));
    assert!(cat(&[], 0).is_err());
    assert!(matches!(
        stack(&[x.clone(), randn(&[4, 3], "z")], 0).unwrap_err(),
        Error::ShapeMismatch { op: "stack", .. }
    ));
    let msg = x.split_with_sizes(&[1, 1], 0).unwrap_err().to_string();
    assert!(msg.contains("split") && msg.contains("sum to 2"), "{msg}");
    assert!(where_(&Tensor::zeros(&[2], DType::I64), &x, &x).is_err());
    assert!(matches!(
        x.masked_fill(&Tensor::zeros(&[2, 3, 4], DType::I64), 0.0)
            .unwrap_err(),
        Error::ShapeMismatch {
            op: "masked_fill",
            ..
        }
    ));
}

#[test]
fn copies_keep_dtype_and_handle_strided_inputs() {
    // i64 values beyond f32's exact range survive index_select, gather and cat bit for bit.
    let big = (1i64 << 40) + 1;
    let ids = Tensor::from_slice(&[big, 2, 3, big + 2], &[2, 2]).unwrap();
    let rows = Tensor::from_slice(&[1i64, 0, 1], &[3]).unwrap();
    let sel = ids.index_select(0, &rows).unwrap();
    assert_eq!(sel.dtype(), DType::I64);
    assert_eq!(sel.to_vec::<i64>(), vec![3, big + 2, big, 2, 3, big + 2]);
    let pick = Tensor::from_slice(&[1i64, 0], &[2, 1]).unwrap();
    assert_eq!(ids.gather(1, &pick).unwrap().to_vec::<i64>(), vec![2, 3]);
    let joined = cat(&[ids.clone(), ids.transpose(0, 1).unwrap()], 1).unwrap();
    assert_eq!(
        joined.to_vec::<i64>(),
        vec![big, 2, big, 3, 3, big + 2, 2, big + 2]
    );
    // A strided float input (a transpose) concatenates like its contiguous copy.
    let x = randn(&[4, 3], "x");
    let xt = x.transpose(0, 1).unwrap();
    let a = cat(&[xt.clone(), randn(&[3, 2], "y")], 1).unwrap();
    let b = cat(&[xt.contiguous().unwrap(), randn(&[3, 2], "y")], 1).unwrap();
    assert_eq!(a.to_vec_f32(), b.to_vec_f32());
    let s = stack(&[x.clone(), x.clone()], 0).unwrap();
    assert_eq!(s.shape(), &[2, 4, 3]);
    assert_eq!(&s.to_vec_f32()[12..], &x.to_vec_f32()[..]);
}

#[test]
fn topk_scan_and_select_paths_agree_with_a_stable_sort() {
    // Few distinct values: many ties, resolved lower index first on both kernel paths
    // (small k scans with a buffer, large k uses a partial selection).
    let n = 200;
    let x = rand(&[3, n], 0.0, 5.0, "ties")
        .to_dtype(DType::I64)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let v = x.to_vec_f32();
    for largest in [true, false] {
        for k in [1, 3, 25, 150, n] {
            let (vals, idx) = x.topk(k, 1, largest, true).unwrap();
            for r in 0..3 {
                let line = &v[r * n..(r + 1) * n];
                let mut want: Vec<usize> = (0..n).collect();
                want.sort_by(|&a, &b| {
                    let o = line[a].partial_cmp(&line[b]).unwrap();
                    (if largest { o.reverse() } else { o }).then(a.cmp(&b))
                });
                let got: Vec<usize> = idx.to_vec::<i64>()[r * k..(r + 1) * k]
                    .iter()
                    .map(|&i| i as usize)
                    .collect();
                assert_eq!(got, want[..k].to_vec(), "k {k} largest {largest} row {r}");
                let gv = &vals.to_vec_f32()[r * k..(r + 1) * k];
                assert!(gv.iter().zip(&want).all(|(&a, &i)| a == line[i]));
            }
        }
    }
}

#[test]
fn where_reads_strided_broadcast_and_scalar_operands() {
    let a = randn(&[5, 4], "a");
    let at = a.transpose(0, 1).unwrap(); // strided [4, 5]
    let b = randn(&[5], "b").to_dtype(DType::BF16).unwrap();
    let cond = Tensor::from_slice(&[1.0f32, 0.0, 2.0, 0.0], &[4, 1])
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let got = where_(&cond, &at, &b).unwrap();
    assert_eq!(got.dtype(), DType::F32);
    let (av, bv) = (at.contiguous().unwrap().to_vec_f32(), b.to_vec_f32());
    let want: Vec<f32> = (0..20)
        .map(|i| if (i / 5) % 2 == 0 { av[i] } else { bv[i % 5] })
        .collect();
    assert_eq!(got.to_vec_f32(), want);
    let s = where_(
        &Tensor::scalar(0.0),
        &Tensor::scalar(1.0),
        &Tensor::scalar(2.0),
    )
    .unwrap();
    assert_eq!((s.shape().len(), s.item().unwrap()), (0, 2.0));
    let empty = where_(
        &Tensor::zeros(&[0, 3], DType::I64),
        &a.narrow(0, 0, 0).unwrap().narrow(1, 0, 3).unwrap(),
        &Tensor::scalar(1.0),
    )
    .unwrap();
    assert_eq!(empty.shape(), &[0, 3]);
}

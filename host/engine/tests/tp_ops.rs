//! The tensor-parallel ops against their unsplit forms: two threads play the two ranks of a
//! group whose collectives meet in shared memory (rank-order sums, as the MPI group's), each
//! holding its slice of the weights; outputs and gradients must match one thread computing
//! the whole.

use anneal_engine::ops::{
    cross_entropy, tp_copy, tp_embedding, tp_gather, tp_reduce, tp_scatter,
    vocab_parallel_cross_entropy, CrossEntropy, TensorParallelGroup, TpGroup,
};
use anneal_engine::{DType, Result, Tensor};
use std::sync::{Arc, Barrier, Mutex};

/// A group of threads: each collective posts this rank's values, waits for every rank, and
/// reads them all in rank order.
struct Threads {
    rank: usize,
    shared: Arc<(Barrier, Mutex<Vec<Vec<f32>>>)>,
}

impl Threads {
    fn exchange(&self, mine: &[f32]) -> Vec<Vec<f32>> {
        let (barrier, slots) = &*self.shared;
        slots.lock().unwrap()[self.rank] = mine.to_vec();
        barrier.wait();
        let all = slots.lock().unwrap().clone();
        barrier.wait();
        all
    }
}

impl TpGroup for Threads {
    fn ranks(&self) -> usize {
        self.shared.1.lock().unwrap().len()
    }
    fn rank(&self) -> usize {
        self.rank
    }
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        let all = self.exchange(buf);
        for (i, v) in buf.iter_mut().enumerate() {
            *v = all.iter().map(|r| r[i]).sum();
        }
        Ok(())
    }
    fn all_gather(&self, local: &[f32]) -> Result<Vec<f32>> {
        Ok(self.exchange(local).concat())
    }
    fn reduce_scatter_sum(&self, send: &[f32]) -> Result<Vec<f32>> {
        let all = self.exchange(send);
        let n = send.len() / all.len();
        Ok((self.rank * n..(self.rank + 1) * n)
            .map(|i| all.iter().map(|r| r[i]).sum())
            .collect())
    }
}

/// Runs `f(rank, group)` on two threads sharing one group; returns their results by rank.
fn on_two_ranks<T: Send + 'static>(
    f: impl Fn(usize, TensorParallelGroup) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let shared = Arc::new((Barrier::new(2), Mutex::new(vec![Vec::new(); 2])));
    let f = Arc::new(f);
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let (shared, f) = (shared.clone(), f.clone());
            std::thread::spawn(move || {
                let group = TensorParallelGroup {
                    group: Arc::new(Threads { rank, shared }),
                };
                f(rank, group)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| (((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 1000) as f32 / 500.0 - 1.0)
        .collect()
}

fn leaf(v: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_slice(v, shape).unwrap().requires_grad_()
}

fn assert_close(what: &str, want: &[f32], got: &[f32]) {
    assert_eq!(want.len(), got.len(), "{what}: lengths");
    for (i, (a, b)) in want.iter().zip(got).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * (1.0 + a.abs()),
            "{what}[{i}]: {b} vs {a}"
        );
    }
}

/// Rows `r` of a row-major `[rows, cols]` matrix.
fn rows_of(v: &[f32], cols: usize, r: std::ops::Range<usize>) -> Vec<f32> {
    v[r.start * cols..r.end * cols].to_vec()
}

/// Columns `c` of a row-major `[rows, cols]` matrix.
fn cols_of(v: &[f32], cols: usize, c: std::ops::Range<usize>) -> Vec<f32> {
    v.chunks(cols)
        .flat_map(|row| row[c.clone()].to_vec())
        .collect()
}

/// `((x · W1ᵀ) · W2ᵀ)` with W1 split by output rows (column split) and W2 by input columns (row
/// split), with and without sequence parallelism: the output and every gradient match.
#[test]
fn column_then_row_linear_matches_the_whole() {
    let (b, t, d, f) = (2, 4, 6, 8);
    let (xv, w1v, w2v) = (values(b * t * d, 1), values(f * d, 2), values(d * f, 3));
    let x = leaf(&xv, &[b, t, d]);
    let w1 = leaf(&w1v, &[f, d]);
    let w2 = leaf(&w2v, &[d, f]);
    let y = x
        .matmul(&w1.transpose(0, 1).unwrap())
        .unwrap()
        .matmul(&w2.transpose(0, 1).unwrap())
        .unwrap();
    y.mul(&y).unwrap().sum_all().unwrap().backward().unwrap();
    let want_y = y.to_vec_f32();
    let (gx, gw1, gw2) = (
        x.grad().unwrap().to_vec_f32(),
        w1.grad().unwrap().to_vec_f32(),
        w2.grad().unwrap().to_vec_f32(),
    );
    for sequence in [false, true] {
        let (xv, w1v, w2v) = (xv.clone(), w1v.clone(), w2v.clone());
        let got = on_two_ranks(move |rank, tp| {
            let half = f / 2;
            let w1 = leaf(
                &rows_of(&w1v, d, rank * half..(rank + 1) * half),
                &[half, d],
            );
            let w2 = leaf(
                &cols_of(&w2v, f, rank * half..(rank + 1) * half),
                &[d, half],
            );
            // Under SP each rank holds half the sequence of x.
            let x = if sequence {
                let th = t / 2;
                let mine: Vec<f32> = xv
                    .chunks(t * d)
                    .flat_map(|s| s[rank * th * d..(rank + 1) * th * d].to_vec())
                    .collect();
                leaf(&mine, &[b, th, d])
            } else {
                leaf(&xv, &[b, t, d])
            };
            let xin = if sequence {
                tp_gather(&x, 1, &tp).unwrap()
            } else {
                tp_copy(&x, &tp)
            };
            let partial = xin
                .matmul(&w1.transpose(0, 1).unwrap())
                .unwrap()
                .matmul(&w2.transpose(0, 1).unwrap())
                .unwrap();
            let y = if sequence {
                tp_scatter(&partial, 1, &tp).unwrap()
            } else {
                tp_reduce(&partial, &tp).unwrap()
            };
            y.mul(&y).unwrap().sum_all().unwrap().backward().unwrap();
            (
                y.to_vec_f32(),
                x.grad().unwrap().to_vec_f32(),
                w1.grad().unwrap().to_vec_f32(),
                w2.grad().unwrap().to_vec_f32(),
            )
        });
        let half = f / 2;
        for (rank, (y, x_grad, w1_grad, w2_grad)) in got.into_iter().enumerate() {
            let th = t / 2;
            let shard = |v: &[f32]| -> Vec<f32> {
                v.chunks(t * d)
                    .flat_map(|s| s[rank * th * d..(rank + 1) * th * d].to_vec())
                    .collect()
            };
            let (want_y, want_gx) = if sequence {
                (shard(&want_y), shard(&gx))
            } else {
                (want_y.clone(), gx.clone())
            };
            assert_close("y", &want_y, &y);
            assert_close("dx", &want_gx, &x_grad);
            assert_close(
                "dw1",
                &rows_of(&gw1, d, rank * half..(rank + 1) * half),
                &w1_grad,
            );
            assert_close(
                "dw2",
                &cols_of(&gw2, f, rank * half..(rank + 1) * half),
                &w2_grad,
            );
        }
    }
}

/// The vocabulary-split embedding and cross-entropy against the whole table and logits,
/// including an ignored target.
#[test]
fn vocab_parallel_embedding_and_loss_match_the_whole() {
    let (v, d, n) = (10, 3, 5);
    let (wv, lv) = (values(v * d, 4), values(n * v, 5));
    let ids: Vec<i64> = vec![0, 9, 4, 5, 7];
    let targets: Vec<i64> = vec![3, 5, -100, 9, 0];
    let w = leaf(&wv, &[v, d]);
    let logits = leaf(&lv, &[n, v]);
    let ids_t = Tensor::from_slice(&ids, &[n]).unwrap();
    let tg = Tensor::from_slice(&targets, &[n]).unwrap();
    let e = w.embedding(&ids_t).unwrap();
    let loss = cross_entropy(&logits, &tg, &CrossEntropy::default()).unwrap();
    e.mul(&e)
        .unwrap()
        .sum_all()
        .unwrap()
        .add(&loss)
        .unwrap()
        .backward()
        .unwrap();
    let (want_e, want_loss) = (e.to_vec_f32(), loss.to_vec_f32());
    let (gw, gl) = (
        w.grad().unwrap().to_vec_f32(),
        logits.grad().unwrap().to_vec_f32(),
    );
    let got = on_two_ranks(move |rank, tp| {
        let half = v / 2;
        let w = leaf(&rows_of(&wv, d, rank * half..(rank + 1) * half), &[half, d]);
        let logits = leaf(&cols_of(&lv, v, rank * half..(rank + 1) * half), &[n, half]);
        let ids_t = Tensor::from_slice(&ids, &[n]).unwrap();
        let tg = Tensor::from_slice(&targets, &[n]).unwrap();
        let e = tp_reduce(&tp_embedding(&w, &ids_t, &tp).unwrap(), &tp).unwrap();
        let loss = vocab_parallel_cross_entropy(&logits, &tg, Some(-100), &tp).unwrap();
        e.mul(&e)
            .unwrap()
            .sum_all()
            .unwrap()
            .add(&loss)
            .unwrap()
            .backward()
            .unwrap();
        (
            e.to_vec_f32(),
            loss.to_vec_f32(),
            w.grad().unwrap().to_vec_f32(),
            logits.grad().unwrap().to_vec_f32(),
        )
    });
    let half = v / 2;
    for (rank, (e, loss, w_grad, l_grad)) in got.into_iter().enumerate() {
        assert_eq!(
            e, want_e,
            "the lookup is exact: one rank contributes each row"
        );
        assert_close("loss", &want_loss, &loss);
        assert_close(
            "dw",
            &rows_of(&gw, d, rank * half..(rank + 1) * half),
            &w_grad,
        );
        assert_close(
            "dlogits",
            &cols_of(&gl, v, rank * half..(rank + 1) * half),
            &l_grad,
        );
    }
}

/// The tensor collectives' default bodies (what the CPU runs; a device group overrides them):
/// shapes along dim 0, sums in f32, the input's dtype kept.
#[test]
fn the_tensor_collectives_stage_by_default_keeping_the_dtype() {
    let got = on_two_ranks(|rank, tp| {
        let g = tp.group.as_ref();
        let base = (rank * 10) as f32;
        let x = Tensor::from_vec((0..6).map(|i| base + i as f32).collect(), &[2, 3])
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let sum = g.all_reduce_sum_tensor(&x).unwrap();
        let all = g.all_gather_tensor(&x).unwrap();
        let mine = g.reduce_scatter_sum_tensor(&x).unwrap();
        for t in [&sum, &all, &mine] {
            assert_eq!(t.dtype(), DType::BF16);
        }
        assert_eq!(
            (sum.shape(), all.shape(), mine.shape()),
            (&[2, 3][..], &[4, 3][..], &[1, 3][..])
        );
        (sum.to_vec_f32(), all.to_vec_f32(), mine.to_vec_f32())
    });
    for (rank, (sum, all, mine)) in got.into_iter().enumerate() {
        assert_eq!(sum, vec![10.0, 12.0, 14.0, 16.0, 18.0, 20.0]);
        assert_eq!(
            all,
            vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0]
        );
        let want = [vec![10.0, 12.0, 14.0], vec![16.0, 18.0, 20.0]];
        assert_eq!(mine, want[rank], "rank {rank}");
    }
}

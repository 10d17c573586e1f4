//! Context-parallel ring attention against attention over the whole sequence: outputs and the
//! gradients of q, k, v and sinks, with the sequence split in causal load-balanced chunks over
//! 2 and 3 ranks (threads here, each with its own autograd graph, passing blocks over
//! channels; between processes the trainer passes them over MPI).

mod common;

use anneal_engine::ops::{ring_attention, scaled_dot_product_attention as sdpa};
use anneal_engine::ops::{AttentionParams, KvRing};
use anneal_engine::{Result, Tensor};
use common::*;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};

/// A ring of threads: each rank sends to the next over a channel and receives from the previous.
struct ChannelRing {
    size: usize,
    next: Sender<Vec<Tensor>>,
    prev: Mutex<Receiver<Vec<Tensor>>>,
}

impl KvRing for ChannelRing {
    fn size(&self) -> usize {
        self.size
    }

    fn pass(&self, blocks: &[Tensor]) -> Result<Vec<Tensor>> {
        self.next.send(blocks.to_vec()).expect("next rank alive");
        Ok(self
            .prev
            .lock()
            .unwrap()
            .recv()
            .expect("previous rank alive"))
    }
}

fn rings(n: usize) -> Vec<Arc<dyn KvRing>> {
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..n).map(|_| channel()).unzip();
    let mut rxs: Vec<Option<Receiver<Vec<Tensor>>>> = rxs.into_iter().map(Some).collect();
    (0..n)
        .map(|r| {
            // Rank r sends on the channel rank r + 1 receives from.
            let ring = ChannelRing {
                size: n,
                next: txs[(r + 1) % n].clone(),
                prev: Mutex::new(rxs[r].take().unwrap()),
            };
            Arc::new(ring) as Arc<dyn KvRing>
        })
        .collect()
}

/// The positions rank `r` of `n` holds in a sequence of `t`: chunk `r` and chunk `2n − 1 − r`
/// of `2n` equal chunks (causal load balancing).
fn balanced(r: usize, n: usize, t: usize) -> Vec<usize> {
    let c = t / (2 * n);
    (r * c..(r + 1) * c)
        .chain((2 * n - 1 - r) * c..(2 * n - r) * c)
        .collect()
}

/// `x [B, H, T, D]` at the positions `pos` along dim 2.
fn rows(x: &Tensor, pos: &[usize]) -> Tensor {
    let idx = Tensor::from_vec(pos.iter().map(|&p| p as i64).collect(), &[pos.len()]).unwrap();
    x.index_select(2, &idx).unwrap()
}

fn close(name: &str, got: &Tensor, want: &Tensor) {
    assert_eq!(got.shape(), want.shape(), "{name}");
    assert_close(name, &got.to_vec_f32(), &want.to_vec_f32(), 1e-5, 1e-5);
}

fn check(n: usize, base: AttentionParams, with_sinks: bool) {
    let (b, hq, hkv, t, d) = (2, 4, 2, 12 * n, 8);
    let (q, k, v) = (
        randn(&[b, hq, t, d], "q"),
        randn(&[b, hkv, t, d], "k"),
        randn(&[b, hkv, t, d], "v"),
    );
    let go = randn(&[b, hq, t, d], "go");
    let sinks = with_sinks.then(|| randn(&[hq], "sinks"));
    // The whole sequence in one call.
    let leaf = |x: &Tensor| x.detach().requires_grad_();
    let (fq, fk, fv) = (leaf(&q), leaf(&k), leaf(&v));
    let fs = sinks.as_ref().map(leaf);
    let full = sdpa(
        &fq,
        &fk,
        &fv,
        &AttentionParams {
            sinks: fs.clone(),
            ..base.clone()
        },
    )
    .unwrap();
    full.backward_with(go.clone()).unwrap();

    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = rings(n)
            .into_iter()
            .enumerate()
            .map(|(r, ring)| {
                let (q, k, v, go, sinks, base) = (&q, &k, &v, &go, &sinks, &base);
                s.spawn(move || {
                    let pos = balanced(r, n, t);
                    let (lq, lk, lv) = (
                        leaf(&rows(q, &pos)),
                        leaf(&rows(k, &pos)),
                        leaf(&rows(v, &pos)),
                    );
                    let ls = sinks.as_ref().map(leaf);
                    let p = Tensor::from_vec(pos.iter().map(|&x| x as i64).collect(), &[pos.len()])
                        .unwrap();
                    let params = AttentionParams {
                        sinks: ls.clone(),
                        q_pos: Some(p.clone()),
                        k_pos: Some(p),
                        ..base.clone()
                    };
                    let out = ring_attention(&lq, &lk, &lv, &params, ring).unwrap();
                    out.backward_with(rows(go, &pos)).unwrap();
                    let grads = [lq.grad(), lk.grad(), lv.grad()].map(Option::unwrap);
                    (pos, out, grads, ls.and_then(|s| s.grad()))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut dsinks = vec![0f32; hq];
    for (r, (pos, out, [dq, dk, dv], ds)) in results.into_iter().enumerate() {
        close(&format!("rank {r} out"), &out, &rows(&full, &pos));
        close(
            &format!("rank {r} dq"),
            &dq,
            &rows(&fq.grad().unwrap(), &pos),
        );
        close(
            &format!("rank {r} dk"),
            &dk,
            &rows(&fk.grad().unwrap(), &pos),
        );
        close(
            &format!("rank {r} dv"),
            &dv,
            &rows(&fv.grad().unwrap(), &pos),
        );
        if let Some(ds) = ds {
            for (a, b) in dsinks.iter_mut().zip(ds.to_vec_f32()) {
                *a += b;
            }
        }
    }
    if let Some(fs) = fs {
        // Every rank's sink gradient covers its own query rows: their sum is the whole one.
        assert_close(
            "dsinks",
            &dsinks,
            &fs.grad().unwrap().to_vec_f32(),
            1e-5,
            1e-5,
        );
    }
}

#[test]
fn ring_attention_equals_causal_attention_over_the_whole_sequence() {
    for n in [1, 2, 3] {
        check(n, AttentionParams::causal(), false);
    }
}

#[test]
fn ring_attention_keeps_windows_softcaps_and_sinks() {
    let windowed = AttentionParams {
        sliding_window: Some(7),
        softcap: Some(4.0),
        ..AttentionParams::causal()
    };
    check(2, windowed.clone(), true);
    check(3, windowed, false);
    check(2, AttentionParams::causal(), true);
    // Non-causal (an encoder): every block is seen by every query.
    check(2, AttentionParams::default(), false);
}

#[test]
fn ring_attention_needs_positions() {
    let ring = rings(1).pop().unwrap();
    let x = randn(&[1, 2, 4, 8], "x");
    let err = ring_attention(&x, &x, &x, &AttentionParams::causal(), ring)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("q_pos and k_pos"), "{err}");
}

/// Batch-invariant mode gathers the keys and values whole (all-gather context parallelism):
/// every rank's output rows are the whole forward's bit for bit, whatever the chunk sizes
/// against the invariant kernels' 64-row tiles; the gradients are the whole ones' (each
/// rank's key/value gradient the sum of every rank's queries' shares, so close, not equal).
#[test]
fn batch_invariant_ring_attention_gathers_and_equals_the_whole_rows_bitwise() {
    use anneal_engine::invariant::set_batch_invariant;
    for (n, c, base) in [
        (2, 40, AttentionParams::causal()),
        (3, 5, AttentionParams::causal()),
        (
            2,
            6,
            AttentionParams {
                sliding_window: Some(7),
                softcap: Some(4.0),
                ..AttentionParams::causal()
            },
        ),
    ] {
        let (b, hq, hkv, t, d) = (2, 4, 2, 2 * n * c, 8);
        let (q, k, v) = (
            randn(&[b, hq, t, d], "q"),
            randn(&[b, hkv, t, d], "k"),
            randn(&[b, hkv, t, d], "v"),
        );
        let go = randn(&[b, hq, t, d], "go");
        let leaf = |x: &Tensor| x.detach().requires_grad_();
        let (fq, fk, fv) = (leaf(&q), leaf(&k), leaf(&v));
        let all = Tensor::from_vec((0..t as i64).collect(), &[t]).unwrap();
        let whole = AttentionParams {
            q_pos: Some(all.clone()),
            k_pos: Some(all),
            ..base.clone()
        };
        let full = {
            let _inv = set_batch_invariant(true);
            sdpa(&fq, &fk, &fv, &whole).unwrap()
        };
        full.backward_with(go.clone()).unwrap();
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = rings(n)
                .into_iter()
                .enumerate()
                .map(|(r, ring)| {
                    let (q, k, v, go, base) = (&q, &k, &v, &go, &base);
                    s.spawn(move || {
                        let _inv = set_batch_invariant(true);
                        let pos = balanced(r, n, t);
                        let (lq, lk, lv) = (
                            leaf(&rows(q, &pos)),
                            leaf(&rows(k, &pos)),
                            leaf(&rows(v, &pos)),
                        );
                        let p =
                            Tensor::from_vec(pos.iter().map(|&x| x as i64).collect(), &[pos.len()])
                                .unwrap();
                        let params = AttentionParams {
                            q_pos: Some(p.clone()),
                            k_pos: Some(p),
                            ..base.clone()
                        };
                        let out = ring_attention(&lq, &lk, &lv, &params, ring).unwrap();
                        out.backward_with(rows(go, &pos)).unwrap();
                        let grads = [lq.grad(), lk.grad(), lv.grad()].map(Option::unwrap);
                        (pos, out, grads)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, (pos, out, [dq, dk, dv])) in results.into_iter().enumerate() {
            let want = rows(&full, &pos).to_vec_f32();
            let got = out.to_vec_f32();
            assert_eq!(got.len(), want.len());
            for (i, (a, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    w.to_bits(),
                    "n {n} rank {r} out[{i}]: {a} vs {w}"
                );
            }
            close(
                &format!("rank {r} dq"),
                &dq,
                &rows(&fq.grad().unwrap(), &pos),
            );
            close(
                &format!("rank {r} dk"),
                &dk,
                &rows(&fk.grad().unwrap(), &pos),
            );
            close(
                &format!("rank {r} dv"),
                &dv,
                &rows(&fv.grad().unwrap(), &pos),
            );
        }
    }
}

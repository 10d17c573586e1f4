//! Context parallelism through the model runner: with a ring in `ForwardOpts`, each rank (a
//! thread here, passing key/value blocks over channels; processes over MPI in the trainer) runs
//! the plugin's forward on its causal load-balanced part of the sequence at its global
//! positions, and its logits are the whole sequence's rows at those positions; the parameters'
//! gradients summed over the ranks are the whole sequence's, with and without recomputed blocks
//! (ring attention runs again inside the recompute). Dense, grouped-query with sinks and a
//! sliding window (gpt-oss), mixture of experts and MLA models. Ops that run along the whole
//! sequence from its start (linear attention's recurrence, a KV cache) are refused, naming
//! `parallelism.cp`.

mod common;

use anneal_engine::ops::KvRing;
use anneal_engine::{Result, Tensor};
use anneal_runtime::plugins::{ForwardOpts, KvCache, Params, PluginModel};
use common::{fixture, model_for};
use std::collections::HashMap;
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
            let ring = ChannelRing {
                size: n,
                next: txs[(r + 1) % n].clone(),
                prev: Mutex::new(rxs[r].take().unwrap()),
            };
            Arc::new(ring) as Arc<dyn KvRing>
        })
        .collect()
}

/// Rank `r` of `n`: chunk `r` and chunk `2n − 1 − r` of `2n`.
fn balanced(r: usize, n: usize, t: usize) -> Vec<usize> {
    let c = t / (2 * n);
    (r * c..(r + 1) * c)
        .chain((2 * n - 1 - r) * c..(2 * n - r) * c)
        .collect()
}

fn index(pos: &[usize]) -> Tensor {
    Tensor::from_vec(pos.iter().map(|&p| p as i64).collect(), &[pos.len()]).unwrap()
}

/// Fresh leaves of `values` (each rank accumulates its own gradients).
fn leaves(values: &HashMap<String, Tensor>) -> Params {
    Arc::new(
        values
            .iter()
            .map(|(n, t)| (n.clone(), t.detach().requires_grad_()))
            .collect(),
    )
}

/// Logits `[B, T, V]` at `pos` and the backward of `Σ logits ∘ w[:, pos]`.
fn forward_backward(
    model: &PluginModel,
    params: &Params,
    tokens: &Tensor,
    pos: &[usize],
    w: &Tensor,
    opts: &ForwardOpts,
) -> Tensor {
    let idx = index(pos);
    let tokens = tokens.index_select(1, &idx).unwrap();
    let logits = model.forward(params, &tokens, &idx, opts).unwrap();
    let w = w.index_select(1, &idx).unwrap();
    logits
        .mul(&w)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    logits.detach()
}

fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}");
    let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    let d = got
        .iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(d <= 2e-5 * scale, "{what}: {d} of {scale}");
}

#[test]
fn ranks_of_a_ring_give_the_whole_sequences_logits_and_gradients() {
    for name in [
        "tiny_llama",
        "tiny_gpt_oss",
        "tiny_qwen3_moe",
        "tiny_deepseek_v3_plain_q",
    ] {
        let dir = fixture(name);
        let (model, values) = model_for(&dir);
        let exp = anneal_engine::io::load_safetensors(dir.join("expected.safetensors")).unwrap();
        for n in [2usize, 3] {
            // A length the 2n chunks divide.
            let t = exp["tokens"].shape()[1] / (2 * n) * (2 * n);
            let tokens = exp["tokens"].narrow(1, 0, t).unwrap();
            let all: Vec<usize> = (0..t).collect();
            for recompute in [0usize, 1] {
                let what = format!("{name}, cp {n}, recompute every {recompute}");
                eprintln!("{what}");
                let opts = ForwardOpts {
                    training: true,
                    recompute_every: recompute,
                    ..Default::default()
                };
                let whole = leaves(&values);
                let probe = model.forward(&whole, &tokens, &index(&all), &opts).unwrap();
                let w = Tensor::rand_normal(
                    probe.shape(),
                    0.0,
                    1.0,
                    &anneal_engine::rng::RngKey::new(3, "w"),
                    0,
                    anneal_engine::DType::F32,
                )
                .unwrap();
                drop(probe);
                let want = forward_backward(&model, &whole, &tokens, &all, &w, &opts);

                let ranks: Vec<(Vec<usize>, Params, Tensor)> = std::thread::scope(|s| {
                    let handles: Vec<_> = rings(n)
                        .into_iter()
                        .enumerate()
                        .map(|(r, ring)| {
                            let (model, values, tokens, w) = (&model, &values, &tokens, &w);
                            let opts = ForwardOpts {
                                ring: Some(ring),
                                ..opts.clone()
                            };
                            s.spawn(move || {
                                let pos = balanced(r, n, t);
                                let params = leaves(values);
                                let logits =
                                    forward_backward(model, &params, tokens, &pos, w, &opts);
                                (pos, params, logits)
                            })
                        })
                        .collect();
                    handles.into_iter().map(|h| h.join().unwrap()).collect()
                });
                for (pos, _, logits) in &ranks {
                    let rows = want.index_select(1, &index(pos)).unwrap();
                    assert_close(
                        &format!("{what}: logits"),
                        &logits.to_vec_f32(),
                        &rows.to_vec_f32(),
                    );
                }
                for (pname, p) in whole.iter() {
                    let parts: Vec<Vec<f32>> = ranks
                        .iter()
                        .filter_map(|(_, params, _)| params[pname].grad().map(|g| g.to_vec_f32()))
                        .collect();
                    let Some(g) = p.grad() else {
                        assert!(parts.is_empty(), "{what}: {pname} has no gradient whole");
                        continue;
                    };
                    let mut sum = vec![0f32; g.numel()];
                    for part in &parts {
                        for (s, v) in sum.iter_mut().zip(part) {
                            *s += v;
                        }
                    }
                    assert_close(&format!("{what}: grad {pname}"), &sum, &g.to_vec_f32());
                }
            }
        }
    }
}

#[test]
fn what_runs_along_the_whole_sequence_is_refused_under_a_ring() {
    // Gated DeltaNet's recurrence (Qwen3.5) reads the sequence from its first token.
    let dir = fixture("tiny_qwen3_5");
    let (model, values) = model_for(&dir);
    let exp = anneal_engine::io::load_safetensors(dir.join("expected.safetensors")).unwrap();
    let tokens = exp["tokens"].narrow(1, 0, 4).unwrap();
    let ring = rings(1).remove(0);
    let opts = ForwardOpts {
        training: true,
        ring: Some(ring.clone()),
        ..Default::default()
    };
    let err = model
        .forward(&values, &tokens, &index(&[0, 1, 2, 3]), &opts)
        .map(|_| ())
        .expect_err("refused")
        .to_string();
    assert!(
        err.contains("parallelism.cp") && err.contains("whole sequence"),
        "{err}"
    );

    // Decoding with a KV cache is generation's, which does not split the sequence.
    let dir = fixture("tiny_llama");
    let (model, values) = model_for(&dir);
    let opts = ForwardOpts {
        cache: Some(Arc::new(KvCache::new())),
        ring: Some(ring),
        ..Default::default()
    };
    let err = model
        .forward(&values, &tokens, &index(&[0, 1, 2, 3]), &opts)
        .map(|_| ())
        .expect_err("refused")
        .to_string();
    assert!(
        err.contains("KV cache") && err.contains("parallelism.cp"),
        "{err}"
    );
}

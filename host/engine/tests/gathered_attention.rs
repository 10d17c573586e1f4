//! Gathered sparse attention (DeepSeek-V4's CSA/HCA) against the masked formulation it
//! replaces (a full score row over every window key and block, the invisible ones masked, a
//! sink column): values and gradients, finite differences, batch and thread invariance, errors.

mod common;

use anneal_engine::ops::{cat, gathered_attention, GatheredAttentionParams};
use anneal_engine::{DType, Tensor};
use common::*;

/// One case: shapes, window, rate and the query/key positions and selection.
struct Case {
    name: &'static str,
    b: usize,
    h: usize,
    d: usize,
    /// Query positions per batch row.
    q_pos: Vec<Vec<i64>>,
    /// Window key positions per batch row.
    k_pos: Vec<Vec<i64>>,
    n_blocks: usize,
    window: usize,
    rate: usize,
    /// `k` choices per query, or every complete block.
    topk: Option<usize>,
    sinks: bool,
}

impl Case {
    fn t(&self) -> usize {
        self.q_pos[0].len()
    }
    fn s(&self) -> usize {
        self.k_pos[0].len()
    }
    /// A selection with repeats, out-of-range, negative and not-yet-complete entries.
    fn selected(&self) -> Option<Vec<i64>> {
        let k = self.topk?;
        let n = self.n_blocks as i64;
        let m = self.b * self.t() * k;
        Some(
            (0..m as i64)
                .map(|i| (i * 7 + i / 3) % (n + 3) - 1)
                .collect(),
        )
    }
    fn params(&self, blocks: Option<Tensor>, sinks: Option<Tensor>) -> GatheredAttentionParams {
        let rows = |v: &[Vec<i64>]| {
            Tensor::from_vec(v.concat(), &[v.len(), v[0].len()]).expect("positions")
        };
        GatheredAttentionParams {
            q_pos: rows(&self.q_pos),
            k_pos: rows(&self.k_pos),
            blocks,
            selected: self.selected().map(|s| {
                Tensor::from_vec(s, &[self.b, self.t(), self.topk.unwrap_or(0)]).expect("sel")
            }),
            sinks,
            window: self.window,
            compress_rate: self.rate,
            scale: None,
        }
    }
    /// The additive mask `[B, 1, T, S + N]` of the masked formulation.
    fn mask(&self) -> Tensor {
        let (t, s, n) = (self.t(), self.s(), self.n_blocks);
        let sel = self.selected();
        let mut out = vec![f32::NEG_INFINITY; self.b * t * (s + n)];
        for b in 0..self.b {
            for i in 0..t {
                let qp = self.q_pos[b][i];
                let row = &mut out[(b * t + i) * (s + n)..][..s + n];
                for (j, &kp) in self.k_pos[b].iter().enumerate() {
                    if kp <= qp && qp - kp < self.window as i64 {
                        row[j] = 0.0;
                    }
                }
                for w in 0..n {
                    let complete = (w as i64) < (qp + 1) / self.rate as i64;
                    let named = match (&sel, self.topk) {
                        (Some(v), Some(k)) => v[(b * t + i) * k..][..k].contains(&(w as i64)),
                        _ => true,
                    };
                    if complete && named {
                        row[s + w] = 0.0;
                    }
                }
            }
        }
        Tensor::from_vec(out, &[self.b, 1, t, s + n]).expect("mask")
    }
}

/// `softmax([q·kᵀ/√D + mask, sink]) · [k; 0]` over the window keys then the blocks.
fn masked(c: &Case, q: &Tensor, keys: &Tensor, blocks: &Tensor, sinks: &Tensor) -> Tensor {
    let (b, h, t, d) = (c.b, c.h, c.t(), c.d);
    let all = if c.n_blocks > 0 {
        cat(&[keys.clone(), blocks.clone()], 1).unwrap()
    } else {
        keys.clone()
    };
    let w = all.shape()[1];
    let scores = q
        .reshape(&[b, h * t, d])
        .unwrap()
        .matmul(&all.transpose(1, 2).unwrap())
        .unwrap()
        .reshape(&[b, h, t, w])
        .unwrap()
        .mul_scalar(1.0 / (d as f32).sqrt())
        .unwrap()
        .add(&c.mask())
        .unwrap();
    let logits = if c.sinks {
        let col = Tensor::zeros(&[b, h, t, 1], DType::F32)
            .add(&sinks.reshape(&[1, h, 1, 1]).unwrap())
            .unwrap();
        cat(&[scores, col], 3).unwrap()
    } else {
        scores
    };
    logits
        .softmax(3)
        .unwrap()
        .narrow(3, 0, w)
        .unwrap()
        .reshape(&[b, h * t, w])
        .unwrap()
        .matmul(&all)
        .unwrap()
        .reshape(&[b, h, t, d])
        .unwrap()
}

fn gathered(c: &Case, q: &Tensor, keys: &Tensor, blocks: &Tensor, sinks: &Tensor) -> Tensor {
    let blocks = (c.n_blocks > 0).then(|| blocks.clone());
    let sinks = c.sinks.then(|| sinks.clone());
    gathered_attention(q, keys, &c.params(blocks, sinks)).unwrap()
}

fn inputs(c: &Case) -> [Tensor; 4] {
    let n = c.name;
    [
        randn(&[c.b, c.h, c.t(), c.d], &format!("{n}-q")),
        randn(&[c.b, c.s(), c.d], &format!("{n}-k")),
        randn(&[c.b, c.n_blocks.max(1), c.d], &format!("{n}-c")),
        randn(&[c.h], &format!("{n}-sinks")),
    ]
}

fn seq(n: usize) -> Vec<i64> {
    (0..n as i64).collect()
}

fn cases() -> Vec<Case> {
    let plain = |name, b, t: usize, window, rate, topk| Case {
        name,
        b,
        h: 3,
        d: 12,
        q_pos: vec![seq(t); b],
        k_pos: vec![seq(t); b],
        n_blocks: t / rate,
        window,
        rate,
        topk,
        sinks: true,
    };
    vec![
        // HCA: every complete block; 13 tokens are not a multiple of the block.
        plain("hca", 2, 13, 5, 4, None),
        // CSA: the indexer's choice (with repeats and invalid entries), 19 tokens, blocks of 3.
        plain("csa", 2, 19, 4, 3, Some(3)),
        // A window longer than the sequence.
        plain("long-window", 1, 10, 100, 2, Some(2)),
        // k larger than the blocks there are.
        plain("k-over-blocks", 1, 11, 3, 4, Some(8)),
        Case {
            sinks: false,
            ..plain("no-sinks", 1, 9, 3, 2, Some(2))
        },
        Case {
            n_blocks: 0,
            ..plain("no-blocks", 1, 7, 3, 4, None)
        },
        // A decode step: two queries late in the sequence over a cached window whose first
        // keys have left it, rows at their own positions.
        Case {
            name: "decode",
            b: 2,
            h: 2,
            d: 8,
            q_pos: vec![vec![21, 22], vec![30, 31]],
            k_pos: vec![(16..23).collect(), (25..32).collect()],
            n_blocks: 5,
            window: 6,
            rate: 4,
            topk: Some(3),
            sinks: true,
        },
    ]
}

#[test]
fn gathered_attention_matches_the_masked_formulation_values_and_gradients() {
    for c in cases() {
        let [q, k, blocks, sinks] = inputs(&c);
        let go = randn(&[c.b, c.h, c.t(), c.d], &format!("{}-go", c.name));
        let run = |f: fn(&Case, &Tensor, &Tensor, &Tensor, &Tensor) -> Tensor| {
            let leaves: Vec<Tensor> = [&q, &k, &blocks, &sinks]
                .iter()
                .map(|t| t.detach().requires_grad_())
                .collect();
            let out = f(&c, &leaves[0], &leaves[1], &leaves[2], &leaves[3]);
            out.backward_with(go.clone()).unwrap();
            let grad = |t: &Tensor| t.grad().map(|g| g.to_vec_f32());
            (
                out.to_vec_f32(),
                leaves.iter().map(grad).collect::<Vec<_>>(),
            )
        };
        let (want, want_grads) = run(masked);
        let (got, got_grads) = run(gathered);
        assert_close(&format!("{}.out", c.name), &got, &want, 1e-5, 1e-5);
        let used = [true, true, c.n_blocks > 0, c.sinks];
        for (i, what) in ["dq", "dkeys", "dblocks", "dsinks"].iter().enumerate() {
            if !used[i] {
                continue;
            }
            let (g, w) = (got_grads[i].as_ref(), want_grads[i].as_ref());
            let name = format!("{}.{what}", c.name);
            assert_close(
                &name,
                g.expect("gathered grad"),
                w.expect("masked grad"),
                1e-5,
                1e-5,
            );
        }
        // No key is left out of the gradient: the blocks nobody sees get zeros, not nothing.
        assert_eq!(got_grads[1].as_ref().map(Vec::len), Some(k.numel()));
    }
}

#[test]
fn gathered_attention_gradients_match_finite_differences() {
    for c in cases() {
        let [q, k, blocks, sinks] = inputs(&c);
        let name = format!("fd-{}", c.name);
        let mut skip = Vec::new();
        if c.n_blocks == 0 {
            skip.push(2);
        }
        if !c.sinks {
            skip.push(3);
        }
        check_grad_tol(
            &name,
            &[q, k, blocks, sinks],
            &skip,
            1e-2,
            2e-2,
            2e-3,
            |x| Ok(gathered(&c, &x[0], &x[1], &x[2], &x[3])),
        );
    }
}

#[test]
fn a_query_row_does_not_depend_on_the_batch_or_the_other_queries() {
    let c = &cases()[1];
    let [q, k, blocks, sinks] = inputs(c);
    let full = gathered(c, &q, &k, &blocks, &sinks).to_vec_f32();
    // Row 1 alone, and within it query 11 alone (its selection row with it).
    let t = c.t();
    let one = Case {
        name: "csa",
        b: 1,
        q_pos: vec![vec![11]],
        k_pos: vec![c.k_pos[1].clone()],
        ..cases().remove(1)
    };
    let sel = c.selected().unwrap();
    let k_sel = c.topk.unwrap();
    let row_sel = sel[(t + 11) * k_sel..][..k_sel].to_vec();
    let mut p = one.params(Some(blocks.narrow(0, 1, 1).unwrap()), Some(sinks.clone()));
    p.selected = Some(Tensor::from_vec(row_sel, &[1, 1, k_sel]).unwrap());
    let q1 = q.narrow(0, 1, 1).unwrap().narrow(2, 11, 1).unwrap();
    let alone = gathered_attention(&q1, &k.narrow(0, 1, 1).unwrap(), &p)
        .unwrap()
        .to_vec_f32();
    for h in 0..c.h {
        for j in 0..c.d {
            let want = full[((c.h + h) * t + 11) * c.d + j];
            assert_eq!(
                alone[h * c.d + j].to_bits(),
                want.to_bits(),
                "head {h} dim {j}"
            );
        }
    }
}

#[test]
fn gathered_attention_is_thread_invariant_forward_and_backward() {
    // Long enough that the backward splits its queries over several tasks.
    let c = Case {
        name: "threads",
        b: 1,
        h: 2,
        d: 16,
        q_pos: vec![seq(2100)],
        k_pos: vec![seq(2100)],
        n_blocks: 2100 / 4,
        window: 64,
        rate: 4,
        topk: Some(16),
        sinks: true,
    };
    let [q, k, blocks, sinks] = inputs(&c);
    assert_thread_invariant("gathered_attention", || {
        let leaves: Vec<Tensor> = [&q, &k, &blocks, &sinks]
            .iter()
            .map(|t| t.detach().requires_grad_())
            .collect();
        let out = gathered(&c, &leaves[0], &leaves[1], &leaves[2], &leaves[3]);
        out.sum_all().unwrap().backward().unwrap();
        let mut v = vec![out];
        v.extend(leaves.iter().map(|t| t.grad().unwrap()));
        v
    });
}

#[test]
fn bad_shapes_are_errors() {
    let c = &cases()[0];
    let [q, k, blocks, sinks] = inputs(c);
    let p = c.params(Some(blocks.clone()), Some(sinks));
    let err = |r: anneal_engine::Result<Tensor>| r.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err(gathered_attention(&q, &q, &p)).contains("keys"));
    let bad = GatheredAttentionParams {
        sinks: Some(randn(&[7], "s")),
        ..p.clone()
    };
    assert!(err(gathered_attention(&q, &k, &bad)).contains("sinks"));
    let bad = GatheredAttentionParams {
        window: 0,
        ..p.clone()
    };
    assert!(err(gathered_attention(&q, &k, &bad)).contains("window"));
    let bad = GatheredAttentionParams {
        q_pos: Tensor::from_vec(seq(3), &[3]).unwrap(),
        ..p
    };
    assert!(err(gathered_attention(&q, &k, &bad)).contains("q_pos"));
}

//! Expert parallelism inside `moe_ffn_ep`: two "ranks" (threads, exchanging over channels)
//! each hold half of the experts and their own tokens; each rank's output is the one-process
//! layer's on its tokens with all the experts, and its experts' gradients are the sum of the
//! one-process gradients over both ranks' tokens (forward and backward exchanges checked).
//! With a tensor-parallel group as well (`moe_ffn_tp_ep`, four threads: two data ranks × two
//! tp ranks) each rank holds its width half of its expert half, and the same holds.

mod common;

use anneal_engine::ops::{
    moe_ffn, moe_ffn_ep, moe_ffn_tp_ep, ExpertExchange, ExpertParallel, MoeSpec, MoeTensorParallel,
    MoeWeights, RouterScore, RouterSpec, RowsInFlight, TensorParallelGroup, TpGroup,
};
use anneal_engine::{Result, Tensor};
use common::*;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Barrier, Mutex};

enum Msg {
    Counts(Vec<i64>),
    Rows(Vec<f32>),
}

/// One rank's end of an in-process expert group: a channel to and from every rank.
struct Threads {
    rank: usize,
    to: Vec<Mutex<Sender<Msg>>>,
    from: Vec<Mutex<Receiver<Msg>>>,
}

struct Done(Vec<f32>);

impl RowsInFlight for Done {
    fn wait(self: Box<Self>) -> Result<Vec<f32>> {
        Ok(self.0)
    }
}

impl ExpertExchange for Threads {
    fn ranks(&self) -> usize {
        self.to.len()
    }
    fn rank(&self) -> usize {
        self.rank
    }
    fn all_to_all(&self, send: &[i64]) -> Result<Vec<i64>> {
        let n = send.len() / self.ranks();
        for (r, to) in self.to.iter().enumerate() {
            let block = send[r * n..(r + 1) * n].to_vec();
            to.lock().unwrap().send(Msg::Counts(block)).unwrap();
        }
        let mut out = Vec::new();
        for from in &self.from {
            match from.lock().unwrap().recv().unwrap() {
                Msg::Counts(c) => out.extend(c),
                Msg::Rows(_) => panic!("rows where counts were expected"),
            }
        }
        Ok(out)
    }
    fn start(
        &self,
        send: Vec<f32>,
        send_counts: &[usize],
        recv_counts: &[usize],
    ) -> Result<Box<dyn RowsInFlight>> {
        let mut at = 0;
        for (to, &n) in self.to.iter().zip(send_counts) {
            let part = send[at..at + n].to_vec();
            to.lock().unwrap().send(Msg::Rows(part)).unwrap();
            at += n;
        }
        let mut out = Vec::new();
        for (from, &n) in self.from.iter().zip(recv_counts) {
            match from.lock().unwrap().recv().unwrap() {
                Msg::Rows(r) => {
                    assert_eq!(r.len(), n);
                    out.extend(r)
                }
                Msg::Counts(_) => panic!("counts where rows were expected"),
            }
        }
        Ok(Box::new(Done(out)))
    }
}

fn group(p: usize) -> Vec<Threads> {
    let mut senders: Vec<Vec<Option<Sender<Msg>>>> = (0..p).map(|_| vec![None; p]).collect();
    let mut receivers: Vec<Vec<Option<Receiver<Msg>>>> =
        (0..p).map(|_| (0..p).map(|_| None).collect()).collect();
    for (src, row) in senders.iter_mut().enumerate() {
        for (dst, slot) in row.iter_mut().enumerate() {
            let (tx, rx) = channel();
            *slot = Some(tx);
            receivers[dst][src] = Some(rx);
        }
    }
    senders
        .into_iter()
        .zip(receivers)
        .enumerate()
        .map(|(rank, (to, from))| Threads {
            rank,
            to: to.into_iter().map(|s| Mutex::new(s.unwrap())).collect(),
            from: from.into_iter().map(|r| Mutex::new(r.unwrap())).collect(),
        })
        .collect()
}

const E: usize = 4;
const D: usize = 8;
const F: usize = 6;
const N: usize = 9;

fn spec() -> MoeSpec {
    MoeSpec::new(RouterSpec {
        num_experts: E,
        top_k: 2,
        score: RouterScore::Softmax,
        renormalize: true,
        route_scale: 1.0,
        groups: None,
    })
}

/// Output and gradients (x, router, gate, up, down) of rank `rank`'s tokens, with experts
/// `experts` of the stacks (all of them without `ep`).
fn run(rank: usize, ep: Option<ExpertParallel>) -> Vec<Vec<f32>> {
    let x = randn(&[N, D], &format!("x{rank}")).requires_grad_();
    let router = randn(&[D, E], "router").requires_grad_();
    let (lo, n) = match &ep {
        Some(p) => (
            p.exchange.rank() * E / p.exchange.ranks(),
            E / p.exchange.ranks(),
        ),
        None => (0, E),
    };
    let stack = |name: &str, shape: &[usize]| -> Tensor {
        let full = randn(shape, name).mul_scalar(0.3).unwrap();
        full.narrow(0, lo, n)
            .unwrap()
            .contiguous()
            .unwrap()
            .requires_grad_()
    };
    let (gate, up, down) = (
        stack("gate", &[E, D, F]),
        stack("up", &[E, D, F]),
        stack("down", &[E, F, D]),
    );
    let w = MoeWeights::new(&router, &gate, &up, &down);
    let out = moe_ffn_ep(&x, &w, &spec(), ep.as_ref()).unwrap().out;
    out.backward_with(randn(&[N, D], &format!("g{rank}")))
        .unwrap();
    let g = |t: &Tensor| t.grad().unwrap().to_vec_f32();
    vec![
        out.to_vec_f32(),
        g(&x),
        g(&router),
        g(&gate),
        g(&up),
        g(&down),
    ]
}

#[test]
fn two_expert_ranks_compute_the_one_process_layer() {
    let handles: Vec<_> = group(2)
        .into_iter()
        .map(|t| {
            std::thread::spawn(move || {
                let rank = t.rank;
                let ep = ExpertParallel {
                    exchange: Arc::new(t),
                };
                run(rank, Some(ep))
            })
        })
        .collect();
    let got: Vec<Vec<Vec<f32>>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let want: Vec<Vec<Vec<f32>>> = (0..2).map(|r| run(r, None)).collect();
    for r in 0..2 {
        // Outputs, x and router gradients: this rank's tokens alone.
        for (k, name) in [(0, "out"), (1, "dx"), (2, "drouter")] {
            assert_close(
                &format!("rank {r} {name}"),
                &got[r][k],
                &want[r][k],
                1e-5,
                1e-6,
            );
        }
        // Expert gradients: both ranks' tokens, for this rank's half of the experts.
        for (k, name) in [(3, "dgate"), (4, "dup"), (5, "ddown")] {
            let half = want[0][k].len() / 2;
            let sum: Vec<f32> = (r * half..(r + 1) * half)
                .map(|i| want[0][k][i] + want[1][k][i])
                .collect();
            assert_close(&format!("rank {r} {name}"), &got[r][k], &sum, 1e-5, 1e-6);
        }
    }
    // The plain layer is the same function.
    let plain = {
        let x = randn(&[N, D], "x0");
        let router = randn(&[D, E], "router");
        let s = |name: &str, shape: &[usize]| randn(shape, name).mul_scalar(0.3).unwrap();
        let (gate, up, down) = (
            s("gate", &[E, D, F]),
            s("up", &[E, D, F]),
            s("down", &[E, F, D]),
        );
        moe_ffn(&x, &MoeWeights::new(&router, &gate, &up, &down), &spec())
            .unwrap()
            .out
            .to_vec_f32()
    };
    assert_eq!(plain, want[0][0]);
}

/// One rank of an in-process tensor-parallel group: each collective posts this rank's values,
/// waits for every rank and reads them all in rank order (rank-order sums, as MPI's).
struct TpThreads {
    rank: usize,
    shared: Arc<Posts>,
}

/// What a tensor-parallel group's threads meet at: a barrier and each rank's posted values.
type Posts = (Barrier, Mutex<Vec<Vec<f32>>>);

impl TpThreads {
    fn exchange(&self, mine: &[f32]) -> Vec<Vec<f32>> {
        let (barrier, slots) = &*self.shared;
        slots.lock().unwrap()[self.rank] = mine.to_vec();
        barrier.wait();
        let all = slots.lock().unwrap().clone();
        barrier.wait();
        all
    }
}

impl TpGroup for TpThreads {
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

/// Elements `[experts, :, width]` of a `[E, D, F]` stack (`width_dim` 2) or `[E, F, D]` (1).
fn cut(
    v: &[f32],
    shape: [usize; 3],
    experts: std::ops::Range<usize>,
    width_dim: usize,
    width: std::ops::Range<usize>,
) -> Vec<f32> {
    let mut out = Vec::new();
    for e in experts {
        for i in 0..shape[1] {
            for j in 0..shape[2] {
                let w = if width_dim == 1 { i } else { j };
                if width.contains(&w) {
                    out.push(v[(e * shape[1] + i) * shape[2] + j]);
                }
            }
        }
    }
    out
}

/// Data rank `s`'s output and gradients (x, router, gate, up, down) on tp rank `t` of 2, with
/// its expert half (by `ep`) of every expert's width half.
fn run_tp_ep(s: usize, t: usize, ep: ExpertParallel, tp: TensorParallelGroup) -> Vec<Vec<f32>> {
    let x = randn(&[N, D], &format!("x{s}")).requires_grad_();
    let router = randn(&[D, E], "router").requires_grad_();
    let (lo, n) = (ep.exchange.rank() * E / 2, E / 2);
    let stack = |name: &str, shape: &[usize], width_dim: usize| -> Tensor {
        let full = randn(shape, name).mul_scalar(0.3).unwrap();
        let half = shape[width_dim] / 2;
        full.narrow(0, lo, n)
            .unwrap()
            .narrow(width_dim as isize, t * half, half)
            .unwrap()
            .contiguous()
            .unwrap()
            .requires_grad_()
    };
    let (gate, up, down) = (
        stack("gate", &[E, D, F], 2),
        stack("up", &[E, D, F], 2),
        stack("down", &[E, F, D], 1),
    );
    let w = MoeWeights::new(&router, &gate, &up, &down);
    let tp = MoeTensorParallel {
        group: tp,
        sequence_dim: None,
    };
    let out = moe_ffn_tp_ep(&x, &w, &spec(), &tp, Some(&ep)).unwrap().out;
    out.backward_with(randn(&[N, D], &format!("g{s}"))).unwrap();
    let g = |t: &Tensor| t.grad().unwrap().to_vec_f32();
    vec![
        out.to_vec_f32(),
        g(&x),
        g(&router),
        g(&gate),
        g(&up),
        g(&down),
    ]
}

#[test]
fn experts_split_by_expert_and_width_compute_the_one_process_layer() {
    // Expert groups by tp coordinate (the data ranks of one tp rank), tp groups by data rank.
    let mut ep: Vec<Vec<Option<Threads>>> = (0..2)
        .map(|_| group(2).into_iter().map(Some).collect())
        .collect();
    let tp: Vec<Arc<Posts>> = (0..2)
        .map(|_| Arc::new((Barrier::new(2), Mutex::new(vec![Vec::new(); 2]))))
        .collect();
    let mut handles = Vec::new();
    for s in 0..2 {
        for t in 0..2 {
            let exchange = ep[t][s].take().unwrap();
            let shared = tp[s].clone();
            handles.push(std::thread::spawn(move || {
                let ep = ExpertParallel {
                    exchange: Arc::new(exchange),
                };
                let tp = TensorParallelGroup {
                    group: Arc::new(TpThreads { rank: t, shared }),
                };
                run_tp_ep(s, t, ep, tp)
            }));
        }
    }
    // By data rank, then tp rank.
    let got: Vec<Vec<Vec<f32>>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let want: Vec<Vec<Vec<f32>>> = (0..2).map(|r| run(r, None)).collect();
    for s in 0..2 {
        let (a, b) = (&got[2 * s], &got[2 * s + 1]);
        // The tp ranks of a data rank end with the same output and router / input gradients.
        for k in 0..3 {
            assert_eq!(
                a[k], b[k],
                "data rank {s}: value {k} differs between tp ranks"
            );
        }
        for (k, name) in [(0, "out"), (1, "dx"), (2, "drouter")] {
            assert_close(&format!("rank {s} {name}"), &a[k], &want[s][k], 1e-5, 1e-6);
        }
        // Expert gradients: both data ranks' tokens, for this rank's experts and width.
        for t in 0..2 {
            let mine = &got[2 * s + t];
            for (k, name, shape, width_dim) in [
                (3, "dgate", [E, D, F], 2),
                (4, "dup", [E, D, F], 2),
                (5, "ddown", [E, F, D], 1),
            ] {
                let part = |v: &[f32]| {
                    cut(
                        v,
                        shape,
                        s * E / 2..(s + 1) * E / 2,
                        width_dim,
                        t * F / 2..(t + 1) * F / 2,
                    )
                };
                let sum: Vec<f32> = part(&want[0][k])
                    .iter()
                    .zip(part(&want[1][k]))
                    .map(|(a, b)| a + b)
                    .collect();
                assert_close(
                    &format!("rank ({s}, {t}) {name}"),
                    &mine[k],
                    &sum,
                    1e-5,
                    1e-6,
                );
            }
        }
    }
}

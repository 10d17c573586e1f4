//! Expert parallelism inside `moe_ffn_ep`: two "ranks" (threads, exchanging over channels)
//! each hold half of the experts and their own tokens; each rank's output is the one-process
//! layer's on its tokens with all the experts, and its experts' gradients are the sum of the
//! one-process gradients over both ranks' tokens (forward and backward exchanges checked).

mod common;

use anneal_engine::ops::{
    moe_ffn, moe_ffn_ep, ExpertExchange, ExpertParallel, MoeSpec, MoeWeights, RouterScore,
    RouterSpec, RowsInFlight,
};
use anneal_engine::{Result, Tensor};
use common::*;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};

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

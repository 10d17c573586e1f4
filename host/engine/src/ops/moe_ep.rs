//! Expert parallelism inside the MoE layer: the experts are split over the `P` ranks of an
//! expert group (rank `r` holds experts `[r·E/P, (r+1)·E/P)`), and the token rows travel to them:
//!
//! ```text
//! xs      rows in (global) expert order, as moe_dispatch left them: the rows for rank r are
//!         one contiguous run (its experts are consecutive)
//! counts  all_to_all of the per-expert row counts (so each rank knows what it will receive)
//! recv    all_to_all_v of the rows          [source rank][local expert] order
//! ys      local grouped GEMM over the rows regrouped as [local expert][source rank]
//! back    the reverse all_to_all_v          rows back in xs's order, for the combine
//! ```
//! The backward runs the transposed exchanges (each exchange's gradient is the exchange with
//! send and receive counts swapped). A row's arithmetic is the same wherever it is computed,
//! and the combine (a fixed-order weighted sum per token) stays on the token's rank.
//!
//! Overlap: the rows are split in two halves, each exchanged on its own; both halves' sends
//! start at once, so the second half's all-to-all runs while the first half's experts compute,
//! and the first half's return runs while the second half's experts compute.
//!
//! The engine knows nothing of processes: the exchange is an [`ExpertExchange`] that whoever
//! runs the job installs (the trainer, through the model runner's stage hook). Every rank of
//! the group must run the same MoE layers in the same order, forward and backward, since each
//! exchange is a collective.

use crate::autograd::record;
use crate::error::{invalid, Result};
use crate::Tensor;
use std::sync::Arc;

/// A variable all-to-all in flight.
pub trait RowsInFlight {
    /// Blocks until it completes; returns what arrived, packed in source-rank order.
    fn wait(self: Box<Self>) -> Result<Vec<f32>>;
}

/// The collectives of an expert group, as the MoE layer needs them. Every rank of the group
/// calls them in the same order.
pub trait ExpertExchange: Send + Sync {
    /// Ranks in the expert group (the expert-parallel degree).
    fn ranks(&self) -> usize;

    /// This rank's place in the group: it holds experts `[rank·E/ranks, (rank+1)·E/ranks)`.
    fn rank(&self) -> usize;

    /// Sends block `r` of `send` (`send.len() / ranks` values each) to rank `r`; returns the
    /// blocks received, in rank order.
    fn all_to_all(&self, send: &[i64]) -> Result<Vec<i64>>;

    /// Starts sending `send_counts[r]` consecutive values of `send` to rank `r` while
    /// receiving `recv_counts[r]` from each rank `r`.
    fn start(
        &self,
        send: Vec<f32>,
        send_counts: &[usize],
        recv_counts: &[usize],
    ) -> Result<Box<dyn RowsInFlight>>;

    /// Starts sending `send_rows[r]` consecutive rows of `x [S, width]` to rank `r` while
    /// receiving `recv_rows[r]` rows from each rank `r`; what arrives is `[Σ recv_rows, width]`
    /// in `x`'s dtype on `x`'s device, packed in source-rank order. The default stages the rows
    /// through host memory over [`ExpertExchange::start`] ([`staged_start_rows`]); an exchange
    /// that moves device buffers (NCCL) overrides it, with the same bits (rows are copied, never
    /// summed).
    fn start_rows(
        &self,
        x: &Tensor,
        send_rows: &[usize],
        recv_rows: &[usize],
    ) -> Result<Box<dyn TensorInFlight>> {
        staged_start_rows(self, x, send_rows, recv_rows)
    }
}

/// Rows of a tensor exchange in flight ([`ExpertExchange::start_rows`]).
pub trait TensorInFlight {
    /// Blocks until it completes; returns the rows that arrived.
    fn wait(self: Box<Self>) -> Result<Tensor>;
}

/// [`ExpertExchange::start_rows`] through host memory: the rows copied out as f32, exchanged
/// by [`ExpertExchange::start`], rebuilt in `x`'s dtype on its device when waited for.
pub fn staged_start_rows<E: ExpertExchange + ?Sized>(
    ex: &E,
    x: &Tensor,
    send_rows: &[usize],
    recv_rows: &[usize],
) -> Result<Box<dyn TensorInFlight>> {
    let width = x.shape().get(1).copied().unwrap_or(0);
    let scale = |v: &[usize]| v.iter().map(|&r| r * width).collect::<Vec<_>>();
    let pending = ex.start(
        crate::staged::to_host(x),
        &scale(send_rows),
        &scale(recv_rows),
    )?;
    Ok(Box::new(StagedRows {
        pending,
        rows: recv_rows.iter().sum(),
        width,
        dtype: x.dtype(),
        device: x.device(),
    }))
}

/// A staged exchange's host buffer in flight, and how to rebuild what arrives.
struct StagedRows {
    pending: Box<dyn RowsInFlight>,
    rows: usize,
    width: usize,
    dtype: crate::DType,
    device: crate::Device,
}

impl TensorInFlight for StagedRows {
    fn wait(self: Box<Self>) -> Result<Tensor> {
        let got = self.pending.wait()?;
        if got.len() != self.rows * self.width {
            return Err(invalid(
                "moe_exchange",
                format!(
                    "received {} values, expected {} rows of {}",
                    got.len(),
                    self.rows,
                    self.width
                ),
            ));
        }
        crate::staged::from_host(got, &[self.rows, self.width], self.dtype, self.device)
    }
}

/// The expert-parallel context of one MoE layer call.
#[derive(Clone)]
pub struct ExpertParallel {
    /// The expert group's exchange.
    pub exchange: Arc<dyn ExpertExchange>,
}

impl std::fmt::Debug for ExpertParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ExpertParallel(rank {} of {})",
            self.exchange.rank(),
            self.exchange.ranks()
        )
    }
}

/// Row counts of one exchange, per peer rank.
#[derive(Clone)]
struct Counts {
    send: Vec<usize>,
    recv: Vec<usize>,
}

/// One half's rows on their way.
struct InFlight {
    pending: Box<dyn TensorInFlight>,
    /// What was sent (recorded as the exchange's input for autograd).
    input: Tensor,
    rows: Counts,
    width: usize,
}

/// Starts sending the rows of `x [S, width]` (`rows.send[r]` to rank `r`).
fn start(ex: &Arc<dyn ExpertExchange>, x: &Tensor, rows: Counts) -> Result<InFlight> {
    let width = x.shape().get(1).copied().unwrap_or(0);
    let pending = ex.start_rows(x, &rows.send, &rows.recv)?;
    Ok(InFlight {
        pending,
        input: x.clone(),
        rows,
        width,
    })
}

impl InFlight {
    /// The received rows `[Σ recv, width]`, differentiable: the gradient goes back to the
    /// senders by the reverse exchange.
    fn finish(self, ex: &Arc<dyn ExpertExchange>) -> Result<Tensor> {
        const OP: &str = "moe_exchange";
        let n: usize = self.rows.recv.iter().sum();
        let out = self.pending.wait()?;
        if out.shape() != [n, self.width] {
            return Err(invalid(
                OP,
                format!(
                    "received rows of shape {:?}, expected {n} rows of {}",
                    out.shape(),
                    self.width
                ),
            ));
        }
        let (ex, rows, width) = (ex.clone(), self.rows, self.width);
        Ok(record(OP, out, &[&self.input], move || {
            move |g: &Tensor| {
                // The transposed exchange: what came from rank r goes back to it.
                let dx = ex.start_rows(g, &rows.recv, &rows.send)?.wait()?;
                let n: usize = rows.send.iter().sum();
                if dx.shape() != [n, width] {
                    return Err(invalid(
                        OP,
                        format!("gradient rows {:?}, expected [{n}, {width}]", dx.shape()),
                    ));
                }
                Ok(vec![Some(dx)])
            }
        }))
    }
}

/// The rows of `xs [S, D]` (in global expert order, `counts` per expert) run through the
/// experts of their owners: `experts(rows, local_counts)` computes this rank's experts over
/// rows grouped by local expert. Returns the outputs `[S, D']` in `xs`'s row order.
pub(crate) fn run_experts(
    ep: &ExpertParallel,
    xs: &Tensor,
    counts: &[usize],
    experts: &dyn Fn(&Tensor, &[usize]) -> Result<Tensor>,
) -> Result<Tensor> {
    const OP: &str = "moe_ffn (expert parallel)";
    let ex = &ep.exchange;
    let (p, e) = (ex.ranks(), counts.len());
    if p == 0 || !e.is_multiple_of(p) {
        return Err(invalid(
            OP,
            format!("{e} experts do not split evenly over {p} expert-parallel ranks"),
        ));
    }
    let el = e / p;
    // Two halves of the rows (each still in expert order), exchanged on their own.
    let total: usize = counts.iter().sum();
    let mut left = total / 2;
    let mut halves = [vec![0usize; e], vec![0usize; e]];
    for (j, &c) in counts.iter().enumerate() {
        let first = c.min(left);
        left -= first;
        halves[0][j] = first;
        halves[1][j] = c - first;
    }
    // Counts first: every rank learns, per half and per local expert, what each rank sends.
    let mut send = Vec::with_capacity(2 * e);
    for r in 0..p {
        for h in &halves {
            send.extend(h[r * el..(r + 1) * el].iter().map(|&c| c as i64));
        }
    }
    let got = ex.all_to_all(&send)?;
    if got.len() != 2 * e || got.iter().any(|&c| c < 0) {
        return Err(invalid(
            OP,
            format!("bad counts from the exchange: {got:?}"),
        ));
    }
    // recv[h][s][j]: rows of local expert j that rank s sends in half h.
    let recv: Vec<Vec<Vec<usize>>> = (0..2)
        .map(|h| {
            (0..p)
                .map(|s| {
                    let at = s * 2 * el + h * el;
                    got[at..at + el].iter().map(|&c| c as usize).collect()
                })
                .collect()
        })
        .collect();
    let mut flights = Vec::with_capacity(2);
    let mut at = 0;
    for (h, half) in halves.iter().enumerate() {
        let n: usize = half.iter().sum();
        let rows = Counts {
            send: (0..p)
                .map(|r| half[r * el..(r + 1) * el].iter().sum())
                .collect(),
            recv: recv[h].iter().map(|v| v.iter().sum()).collect(),
        };
        flights.push(start(ex, &xs.narrow(0, at, n)?, rows)?);
        at += n;
    }
    let mut returns = Vec::with_capacity(2);
    for (h, flight) in flights.into_iter().enumerate() {
        let rows = flight.rows.clone();
        let got = flight.finish(ex)?;
        // Source-major to expert-major, so each local expert's rows are contiguous.
        let mut offset = vec![vec![0usize; el]; p];
        let mut o = 0;
        for (s, per) in recv[h].iter().enumerate() {
            for (j, &c) in per.iter().enumerate() {
                offset[s][j] = o;
                o += c;
            }
        }
        let mut perm = Vec::with_capacity(o);
        let mut local = vec![0usize; el];
        for (j, l) in local.iter_mut().enumerate() {
            for s in 0..p {
                perm.extend((offset[s][j]..offset[s][j] + recv[h][s][j]).map(|i| i as i64));
                *l += recv[h][s][j];
            }
        }
        let mut inverse = vec![0i64; perm.len()];
        for (k, &i) in perm.iter().enumerate() {
            inverse[i as usize] = k as i64;
        }
        let perm = crate::staged::place(Tensor::from_vec(perm, &[o])?, got.device())?;
        let grouped = got.index_select(0, &perm)?;
        // With no rows, the output still hangs off the received rows, so this rank records
        // (and in backward runs) the same exchanges as the others.
        let y = if o == 0 {
            grouped.mul_scalar(0.0)?
        } else {
            experts(&grouped, &local)?
        };
        let inverse = crate::staged::place(Tensor::from_vec(inverse, &[o])?, y.device())?;
        let y = y.index_select(0, &inverse)?;
        let back = Counts {
            send: rows.recv,
            recv: rows.send,
        };
        returns.push(start(ex, &y, back)?);
    }
    let outs = returns
        .into_iter()
        .map(|f| f.finish(ex))
        .collect::<Result<Vec<_>>>()?;
    crate::ops::cat(&outs, 0)
}

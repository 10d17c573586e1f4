//! Sharded saves (FSDP / HSDP): every shard rank writes its own rows into its own shard file of
//! the step's temporary directory, on a background thread; the ranks' [`Piece`]s (tensor
//! slices, files and checksums) reach rank 0 over MPI later, on the training thread (MPI is
//! initialised "funneled": only that thread may call it), and rank 0 writes `manifest.json` and
//! publishes the step by renaming the directory, as a whole save does.
//!
//! The pieces are collected at the first step end at which every rank's writer has finished
//! (one 4-byte all-reduce per step while a save is pending, inside the shard group that already
//! synchronises every step), or at once before the next save and at the end of the run. So the
//! training thread never waits for another rank's disk, and a save is published one step after
//! its writes end rather than an interval later.

use super::writer::{prune, publish, tmp_dir, write_piece, Piece, SaveReport, Snapshot};
use super::CheckpointError;
use anneal_dist::{Collective, DistError};
use std::path::PathBuf;
use std::thread::JoinHandle;
use std::time::Instant;

/// The message tag of the pieces sent to rank 0.
const PIECE_TAG: u16 = 0x5ce;

/// What a writer thread hands back: its piece (or why not) and the snapshot's buffers.
type WriteOutcome = (RankPiece, Vec<Vec<u8>>);

/// One rank's save that rank 0 has not published yet.
struct Pending {
    step: u64,
    tmp: PathBuf,
    write: Write,
}

enum Write {
    Background(JoinHandle<WriteOutcome>),
    Done(RankPiece),
}

/// Saves one shard rank's part of each checkpoint under one folder; rank 0 of the shard group
/// publishes. Every rank of the group must call [`ShardedCheckpointer::save`],
/// [`ShardedCheckpointer::publish_when_written`] and [`ShardedCheckpointer::wait`] at the same
/// points (they are collective over the group).
pub struct ShardedCheckpointer {
    root: PathBuf,
    keep: usize,
    background: bool,
    /// Shared by every rank of the job, so that all write into the same temporary directory.
    tag: String,
    pending: Option<Pending>,
    last_saved: Option<u64>,
    spare: Vec<Vec<u8>>,
}

impl ShardedCheckpointer {
    /// Saves into `root`, keeping the newest `keep` (rank 0 prunes); `background` writes on a
    /// thread; `tag` (the same on every rank) names the temporary directories.
    pub fn new(root: PathBuf, keep: usize, background: bool, tag: String) -> Self {
        ShardedCheckpointer {
            root,
            keep: keep.max(1),
            background,
            tag,
            pending: None,
            last_saved: None,
            spare: Vec::new(),
        }
    }

    /// The step of the newest save started.
    pub fn last_saved(&self) -> Option<u64> {
        self.last_saved
    }

    /// Publishes the previous save (waiting for it; its failure is returned), then builds this
    /// rank's snapshot with `capture` and starts writing it as shard `comm.rank()` of
    /// `comm.size()`; shard 0 also writes the train state. Collective over `comm`.
    pub fn save(
        &mut self,
        comm: &dyn Collective,
        capture: impl FnOnce(Vec<Vec<u8>>) -> Snapshot,
    ) -> Result<SaveReport, CheckpointError> {
        let started = Instant::now();
        self.publish(comm, true)?;
        let waited_s = started.elapsed().as_secs_f64();
        let snap = capture(std::mem::take(&mut self.spare));
        let step = snap.state.step;
        self.last_saved = Some(step);
        let tmp = tmp_dir(&self.root, step, &self.tag);
        let (rank, world) = (comm.rank(), comm.size());
        let dir = tmp.clone();
        let job = move || {
            let result =
                write_piece(&dir, &snap, rank, world, rank == 0).map_err(|e| e.to_string());
            (result, snap.tensors.into_iter().map(|t| t.bytes).collect())
        };
        let write = if self.background {
            Write::Background(std::thread::spawn(job))
        } else {
            let (result, buffers) = job();
            self.spare = buffers;
            Write::Done(result)
        };
        self.pending = Some(Pending { step, tmp, write });
        Ok(SaveReport {
            waited_s,
            blocked_s: started.elapsed().as_secs_f64(),
            previous_failed: None,
        })
    }

    /// At a step end: publishes the pending save if every rank's writer has finished. Returns
    /// the published directory (on rank 0). Collective over `comm`.
    pub fn publish_when_written(
        &mut self,
        comm: &dyn Collective,
    ) -> Result<Option<PathBuf>, CheckpointError> {
        self.publish(comm, false)
    }

    /// Waits for the pending save and publishes it. Collective over `comm`.
    pub fn wait(&mut self, comm: &dyn Collective) -> Result<Option<PathBuf>, CheckpointError> {
        self.publish(comm, true)
    }

    /// Publishes the pending save when every rank's write is done (or, with `force`, after
    /// waiting for it). A save that failed on any rank is [`CheckpointError::SaveFailed`] on
    /// every rank of the group.
    fn publish(
        &mut self,
        comm: &dyn Collective,
        force: bool,
    ) -> Result<Option<PathBuf>, CheckpointError> {
        // Every rank of the group saved at the same steps, so all have one pending or none.
        let Some(pending) = self.pending.take() else {
            return Ok(None);
        };
        if !force {
            let done = match &pending.write {
                Write::Background(h) => h.is_finished(),
                Write::Done(_) => true,
            };
            let mut ready = [f32::from(u8::from(done))];
            comm.all_reduce_sum(&mut ready)
                .map_err(dist_err(pending.step))?;
            if (ready[0] as usize) < comm.size() {
                self.pending = Some(pending);
                return Ok(None);
            }
        }
        let result = match pending.write {
            Write::Background(h) => match h.join() {
                Ok((result, buffers)) => {
                    self.spare = buffers;
                    result
                }
                Err(_) => Err("the checkpoint writer thread panicked".into()),
            },
            Write::Done(result) => result,
        };
        let gathered = gather_pieces(comm, &result).map_err(dist_err(pending.step))?;
        let published = match gathered {
            // Rank 0: every rank's piece, in rank order.
            Some(all) => all
                .into_iter()
                .enumerate()
                .map(|(r, p)| p.map_err(|e| format!("rank {r}: {e}")))
                .collect::<Result<Vec<_>, _>>()
                .and_then(|pieces| {
                    publish(&self.root, &pending.tmp, pending.step, comm.size(), pieces)
                        .and_then(|dir| prune(&self.root, self.keep).map(|()| dir))
                        .map_err(|e| e.to_string())
                })
                .map(Some),
            None => result.map(|_| None),
        };
        // Every rank learns whether rank 0 published, so they fail together.
        let mut flag = [u8::from(published.is_err())];
        comm.broadcast(&mut flag, 0)
            .map_err(dist_err(pending.step))?;
        let failed = |reason| CheckpointError::SaveFailed {
            step: pending.step,
            reason,
        };
        match (published, flag[0]) {
            (Err(e), _) => Err(failed(e)),
            (Ok(_), 1) => Err(failed(
                "rank 0 could not publish it (its log says why)".into(),
            )),
            (Ok(dir), _) => Ok(dir),
        }
    }
}

/// A rank's piece, or why it has none.
type RankPiece = Result<Piece, String>;

/// Sends every rank's piece (JSON) to rank 0, which gets them all in rank order; the others get
/// `None`.
fn gather_pieces(
    comm: &dyn Collective,
    mine: &RankPiece,
) -> Result<Option<Vec<RankPiece>>, DistError> {
    let bytes = serde_json::to_vec(mine).expect("a piece serializes");
    if comm.rank() != 0 {
        let len = [bytes.len() as i64];
        comm.send((&len[..]).into(), 0, PIECE_TAG)?;
        comm.send((&bytes[..]).into(), 0, PIECE_TAG)?;
        return Ok(None);
    }
    let mut all = vec![serde_json::from_slice(&bytes).expect("our own piece parses")];
    for r in 1..comm.size() {
        let mut len = [0i64];
        comm.recv((&mut len[..]).into(), r, PIECE_TAG)?;
        let mut buf = vec![0u8; usize::try_from(len[0]).unwrap_or(0)];
        comm.recv((&mut buf[..]).into(), r, PIECE_TAG)?;
        all.push(
            serde_json::from_slice(&buf)
                .map_err(|e| format!("the piece of rank {r} does not parse: {e}"))
                .and_then(|p| p),
        );
    }
    Ok(Some(all))
}

/// A collective that failed while step `step` was being published fails that save (a runtime
/// failure, not the user's).
fn dist_err(step: u64) -> impl FnOnce(DistError) -> CheckpointError {
    move |e| CheckpointError::SaveFailed {
        step,
        reason: format!("collecting the ranks' shards: {e}"),
    }
}

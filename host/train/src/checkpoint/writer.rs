//! Writing checkpoints: a host-memory snapshot taken on the training thread, written and
//! published atomically by a background thread, at most one save in flight.

use super::format::{
    shard_name, FileEntry, Manifest, TensorEntry, TrainState, FORMAT_VERSION, MANIFEST, TRAIN_STATE,
};
use super::{io_err, sha256_file, CheckpointError};
use anneal_engine::{DType, Tensor};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::Instant;

/// One tensor's bytes, copied out of the live tensor: the whole tensor, or (under FSDP) the
/// dim-0 rows of it this rank holds.
pub struct SnapTensor {
    /// Global name (`model/...` or `optim/...`).
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape of the piece.
    pub shape: Vec<usize>,
    /// Shape of the whole tensor (`shape` unless the piece is a slice of rows).
    pub global_shape: Vec<usize>,
    /// The first row of the whole tensor the piece holds (0 for a whole tensor).
    pub row_start: usize,
    /// Row-major little-endian data.
    pub bytes: Vec<u8>,
}

impl SnapTensor {
    /// The `[start, end)` range of each dim of the whole tensor the piece covers: rows on
    /// dim 0, everything on the others.
    fn slice(&self) -> Vec<[usize; 2]> {
        self.global_shape
            .iter()
            .enumerate()
            .map(|(d, &n)| match (d, self.shape.first()) {
                (0, Some(&rows)) => [self.row_start, self.row_start + rows],
                _ => [0, n],
            })
            .collect()
    }
}

/// A tensor to snapshot: its global name, the live tensor (whole or this rank's rows), and for
/// a piece the whole tensor's shape and the first row it holds.
pub type PieceRef<'a> = (String, &'a Tensor, Option<(Vec<usize>, usize)>);

/// Everything a checkpoint will hold, in host memory, independent of further training.
pub struct Snapshot {
    /// Non-tensor state.
    pub state: TrainState,
    /// The tensors.
    pub tensors: Vec<SnapTensor>,
}

impl Snapshot {
    /// Copies `tensors` (one memcpy each, in parallel) next to `state`. `spare` buffers (from
    /// [`Checkpointer::save`]) are reused in order, so repeated snapshots of the same tensors
    /// touch no fresh memory.
    pub fn capture<'a>(
        state: TrainState,
        tensors: impl IntoIterator<Item = (String, &'a Tensor)>,
        spare: Vec<Vec<u8>>,
    ) -> Self {
        Self::capture_pieces(state, tensors.into_iter().map(|(n, t)| (n, t, None)), spare)
    }

    /// [`Snapshot::capture`] of tensors that may be pieces (dim-0 rows) of larger ones: what
    /// one FSDP rank saves of its shards.
    pub fn capture_pieces<'a>(
        state: TrainState,
        tensors: impl IntoIterator<Item = PieceRef<'a>>,
        spare: Vec<Vec<u8>>,
    ) -> Self {
        use rayon::prelude::*;
        let list: Vec<PieceRef<'a>> = tensors.into_iter().collect();
        let mut buffers = spare;
        buffers.resize_with(list.len().max(buffers.len()), Vec::new);
        buffers.truncate(list.len());
        let tensors = list
            .into_par_iter()
            .zip(buffers)
            .map(|((name, t, piece), mut bytes)| {
                t.copy_bytes_into(&mut bytes);
                let (global_shape, row_start) = piece.unwrap_or_else(|| (t.shape().to_vec(), 0));
                SnapTensor {
                    name,
                    dtype: t.dtype(),
                    shape: t.shape().to_vec(),
                    global_shape,
                    row_start,
                    bytes,
                }
            })
            .collect();
        Snapshot { state, tensors }
    }
}

fn st_dtype(d: DType) -> safetensors::Dtype {
    match d {
        DType::F32 => safetensors::Dtype::F32,
        DType::BF16 => safetensors::Dtype::BF16,
        DType::F16 => safetensors::Dtype::F16,
        DType::I32 => safetensors::Dtype::I32,
        DType::I64 => safetensors::Dtype::I64,
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    anneal_data::hex(&Sha256::digest(bytes))
}

/// Where the data of the safetensors file at `path` starts, and its header.
fn read_header(path: &Path) -> Result<(u64, safetensors::tensor::Metadata), CheckpointError> {
    let mut f = File::open(path).map_err(io_err(path))?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len).map_err(io_err(path))?;
    let n = u64::from_le_bytes(len);
    let mut header = vec![0u8; usize::try_from(n).unwrap_or(usize::MAX).min(1 << 30)];
    f.read_exact(&mut header).map_err(io_err(path))?;
    let meta = serde_json::from_slice(&header).map_err(|e| CheckpointError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
    })?;
    Ok((8 + n, meta))
}

/// Writes `bytes` to `path` and fsyncs it.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let mut f = File::create(path).map_err(io_err(path))?;
    f.write_all(bytes).map_err(io_err(path))?;
    f.sync_all().map_err(io_err(path))
}

/// Makes a directory's entries (new files, renames) durable.
fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err(dir))
}

/// What one rank wrote into a step's temporary directory: its tensor pieces and its files
/// with their checksums. Rank 0 collects every rank's into the manifest.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Piece {
    /// The tensor pieces of this rank's shard.
    pub tensors: Vec<TensorEntry>,
    /// The files this rank wrote (its shard; rank 0 also `train_state.json`).
    pub files: Vec<FileEntry>,
}

/// The temporary directory a save of `step` goes into before it is published; `tag` tells
/// saves apart (every rank of one save uses the same one).
pub fn tmp_dir(root: &Path, step: u64, tag: &str) -> PathBuf {
    root.join(format!("step-{step}.tmp-{tag}"))
}

/// A tag for [`tmp_dir`] unique to this process and moment.
pub fn fresh_tag() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{}-{nanos}", std::process::id())
}

/// Writes `snap`'s tensors as shard `rank` of `world` into `tmp` (created if needed), and the
/// train state too when `with_state`; every file is fsynced. Returns what the manifest needs.
pub fn write_piece(
    tmp: &Path,
    snap: &Snapshot,
    rank: usize,
    world: usize,
    with_state: bool,
) -> Result<Piece, CheckpointError> {
    std::fs::create_dir_all(tmp).map_err(io_err(tmp))?;
    let shard = shard_name(rank, world);
    let views = snap
        .tensors
        .iter()
        .map(|t| {
            safetensors::tensor::TensorView::new(st_dtype(t.dtype), t.shape.clone(), &t.bytes)
                .map(|v| (t.name.clone(), v))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| CheckpointError::Mismatch(format!("checkpoint tensor: {e}")))?;
    // Streamed to the file, so writing needs no second copy of the snapshot in memory.
    let path = tmp.join(&shard);
    safetensors::serialize_to_file(views, None, &path)
        .map_err(|e| CheckpointError::Mismatch(format!("checkpoint shard: {e}")))?;
    File::open(&path)
        .and_then(|f| f.sync_all())
        .map_err(io_err(&path))?;
    let (data_start, meta) = read_header(&path)?;
    let mut tensors = Vec::with_capacity(snap.tensors.len());
    for t in &snap.tensors {
        let info = meta
            .info(&t.name)
            .expect("every serialized tensor is in the header");
        tensors.push(TensorEntry {
            name: t.name.clone(),
            dtype: t.dtype.name().to_string(),
            global_shape: t.global_shape.clone(),
            slice: t.slice(),
            shard: shard.clone(),
            byte_range: [
                data_start + info.data_offsets.0 as u64,
                data_start + info.data_offsets.1 as u64,
            ],
        });
    }
    fault_injection_pause();
    let (bytes, sha256) = sha256_file(&path).map_err(io_err(&path))?;
    let mut files = vec![FileEntry {
        name: shard,
        bytes,
        sha256,
    }];
    if with_state {
        let state = serde_json::to_vec_pretty(&snap.state).expect("train state serializes");
        write_synced(&tmp.join(TRAIN_STATE), &state)?;
        files.push(FileEntry {
            name: TRAIN_STATE.into(),
            bytes: state.len() as u64,
            sha256: sha256_hex(&state),
        });
    }
    Ok(Piece { tensors, files })
}

/// Publishes the save in `tmp` as `<root>/step-<step>/`: writes `manifest.json` from every
/// rank's [`Piece`] (in rank order; `world` shards), fsyncs, and renames the directory into
/// place, so `step-<N>` exists only when complete. Returns the published path.
pub fn publish(
    root: &Path,
    tmp: &Path,
    step: u64,
    world: usize,
    pieces: Vec<Piece>,
) -> Result<PathBuf, CheckpointError> {
    let (mut tensors, mut files) = (Vec::new(), Vec::new());
    for p in pieces {
        tensors.extend(p.tensors);
        files.extend(p.files);
    }
    let manifest = Manifest {
        format_version: FORMAT_VERSION,
        step,
        world_size: world,
        tensors,
        files,
    };
    let text = serde_json::to_vec_pretty(&manifest).expect("manifest serializes");
    write_synced(&tmp.join(MANIFEST), &text)?;
    sync_dir(tmp)?;

    let dst = root.join(format!("step-{step}"));
    if dst.exists() {
        // The same step saved again (a stop right after a resume): the new copy replaces it.
        std::fs::remove_dir_all(&dst).map_err(io_err(&dst))?;
    }
    std::fs::rename(tmp, &dst).map_err(io_err(&dst))?;
    sync_dir(root)?;
    Ok(dst)
}

/// Writes `snap` whole (one shard) as `<root>/step-<N>/` and returns that path: everything
/// goes into a temporary directory first, is fsynced, and is renamed into place.
pub fn write_checkpoint(root: &Path, snap: &Snapshot) -> Result<PathBuf, CheckpointError> {
    let step = snap.state.step;
    std::fs::create_dir_all(root).map_err(io_err(root))?;
    let tmp = tmp_dir(root, step, &fresh_tag());
    let piece = write_piece(&tmp, snap, 0, 1, true)?;
    publish(root, &tmp, step, 1, vec![piece])
}

/// Tests that kill a run in the middle of a save set `ANNEAL_TEST_CHECKPOINT_PAUSE_MS` to widen
/// the window between a shard being written and the manifest (every rank's writer pauses right
/// after its shard).
fn fault_injection_pause() {
    if let Some(ms) = std::env::var("ANNEAL_TEST_CHECKPOINT_PAUSE_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

/// Removes complete checkpoints beyond the newest `keep` (only ever after a newer one exists).
pub(crate) fn prune(root: &Path, keep: usize) -> Result<(), CheckpointError> {
    for (_, dir) in super::list_steps(root).into_iter().skip(keep) {
        std::fs::remove_dir_all(&dir).map_err(io_err(&dir))?;
    }
    Ok(())
}

/// How one save went, as seen by the training loop.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SaveReport {
    /// Seconds spent waiting for the previous save to finish.
    pub waited_s: f64,
    /// Seconds the caller was blocked in total (waiting + writing when synchronous).
    pub blocked_s: f64,
    /// The error of the previous background save, if it failed.
    pub previous_failed: Option<String>,
}

/// What the writer thread hands back: where it published (or why not) and the snapshot's
/// buffers for reuse.
type WriteOutcome = (Result<PathBuf, CheckpointError>, Vec<Vec<u8>>);

/// Saves checkpoints under one folder, in the background or inline, one at a time.
pub struct Checkpointer {
    root: PathBuf,
    keep: usize,
    background: bool,
    inflight: Option<JoinHandle<WriteOutcome>>,
    last_saved: Option<u64>,
    /// Buffers of the last written snapshot, reused by the next capture.
    spare: Vec<Vec<u8>>,
}

impl Checkpointer {
    /// Saves into `root`, keeping the newest `keep`; `background` writes on a thread.
    pub fn new(root: PathBuf, keep: usize, background: bool) -> Self {
        Checkpointer {
            root,
            keep: keep.max(1),
            background,
            inflight: None,
            last_saved: None,
            spare: Vec::new(),
        }
    }

    /// The step of the newest save started by this checkpointer.
    pub fn last_saved(&self) -> Option<u64> {
        self.last_saved
    }

    /// Waits for the save in flight; returns its error message if it failed.
    pub fn wait(&mut self) -> Option<String> {
        let handle = self.inflight.take()?;
        match handle.join() {
            Ok((result, buffers)) => {
                self.spare = buffers;
                result.err().map(|e| e.to_string())
            }
            Err(_) => Some("the checkpoint writer thread panicked".into()),
        }
    }

    /// Waits for the previous save, builds the snapshot with `capture` (which gets the previous
    /// snapshot's buffers to reuse) and starts writing it, on a thread when in the background.
    /// Inline errors are returned; background ones are reported by the next save or
    /// [`Checkpointer::wait`].
    pub fn save(
        &mut self,
        capture: impl FnOnce(Vec<Vec<u8>>) -> Snapshot,
    ) -> Result<SaveReport, CheckpointError> {
        let started = Instant::now();
        let previous_failed = self.wait();
        let waited_s = started.elapsed().as_secs_f64();
        let snap = capture(std::mem::take(&mut self.spare));
        self.last_saved = Some(snap.state.step);
        let (root, keep) = (self.root.clone(), self.keep);
        let job = move || {
            let result =
                write_checkpoint(&root, &snap).and_then(|dir| prune(&root, keep).map(|()| dir));
            let buffers = snap.tensors.into_iter().map(|t| t.bytes).collect();
            (result, buffers)
        };
        if self.background {
            self.inflight = Some(std::thread::spawn(job));
        } else {
            let (result, buffers) = job();
            self.spare = buffers;
            result?;
        }
        Ok(SaveReport {
            waited_s,
            blocked_s: started.elapsed().as_secs_f64(),
            previous_failed,
        })
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        // Never leave a half-written save behind a normal exit.
        let _ = self.wait();
    }
}

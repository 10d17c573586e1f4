//! Checkpoints: `<run_dir>/checkpoints/step-<N>/` with per-rank safetensors shards, a
//! `manifest.json` (format version, every tensor's global name, shape, dtype, shard and byte
//! offsets, a SHA-256 per file) and `train_state.json` (step, seed, data-loader position,
//! learning rate, the resolved config; for RL runs the prompt cursor).
//!
//! Saving is asynchronous: the step copies tensors into a host-memory [`Snapshot`] and returns;
//! a background writer writes into `step-<N>.tmp-*`, fsyncs, and publishes by renaming the
//! directory. Under FSDP every shard rank writes its own rows as its own shard and rank 0
//! publishes once it has every rank's piece ([`ShardedCheckpointer`]). Loading verifies
//! checksums, falls back to older checkpoints, and reads for each tensor just the rows the
//! resuming rank needs from whichever shards hold them, so any world size or layout resumes
//! any checkpoint.

mod export;
mod format;
mod model;
mod reader;
mod sharded;
mod writer;

pub use export::{export_hf, export_peft};
pub use format::{FileEntry, Manifest, RlState, TensorEntry, TrainState, FORMAT_VERSION};
pub use model::{load_model, CheckpointModel};
pub use reader::{
    list_steps, load_dir, load_dir_with, load_latest, load_latest_with, remove_stale_tmp, Contents,
    Loaded,
};
pub use sharded::ShardedCheckpointer;
pub use writer::{
    fresh_tag, publish, tmp_dir, write_checkpoint, write_piece, Checkpointer, Piece, PieceRef,
    SaveReport, SnapTensor, Snapshot,
};

use std::path::PathBuf;

/// Why a checkpoint could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A checkpoint directory is incomplete or damaged.
    #[error("{}: {reason}", dir.display())]
    Corrupt {
        /// The step directory.
        dir: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// Checkpoints exist but none could be loaded.
    #[error("no usable checkpoint in {} ({reasons}); set checkpoint.allow_fresh_start = true to start over", root.display())]
    NoneUsable {
        /// The checkpoints folder.
        root: PathBuf,
        /// Why each candidate was skipped.
        reasons: String,
    },
    /// `checkpoint.load_step` names a step that has no checkpoint.
    #[error("checkpoint.load_step = {step}: no checkpoint step-{step} in {}", root.display())]
    NoSuchStep {
        /// The requested step.
        step: u64,
        /// The checkpoints folder.
        root: PathBuf,
    },
    /// The checkpoint does not fit the model or optimizer being trained.
    #[error("{0}")]
    Mismatch(String),
    /// An export would replace a file that is already there.
    #[error("{} exists; pass --force to overwrite it", .0.display())]
    WouldOverwrite(PathBuf),
    /// Writing the checkpoint of a step failed; the run stops rather than go on unsaved.
    #[error("saving step {step} failed: {reason}")]
    SaveFailed {
        /// The step whose save failed.
        step: u64,
        /// Why.
        reason: String,
    },
}

/// The size and hex SHA-256 of the file at `path`, read in chunks (never whole in memory).
pub(crate) fn sha256_file(path: &std::path::Path) -> std::io::Result<(u64, String)> {
    use sha2::{Digest, Sha256};
    use std::io::Read;
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        total += n as u64;
        hasher.update(&buf[..n]);
    }
    Ok((total, anneal_data::hex(&hasher.finalize())))
}

pub(crate) fn io_err(
    path: &std::path::Path,
) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

#[cfg(test)]
mod tests;

//! Finding, verifying and loading checkpoints, falling back past damaged ones.

use super::format::{Manifest, TrainState, FORMAT_VERSION, MANIFEST, TRAIN_STATE};
use super::CheckpointError;
use anneal_engine::Tensor;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A verified checkpoint in memory.
pub struct Loaded {
    /// The step directory it came from.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
    /// Its train state.
    pub state: TrainState,
    /// Every tensor by global name.
    pub tensors: BTreeMap<String, Tensor>,
}

/// Published checkpoint directories (`step-<N>`, never `*.tmp-*`), newest first.
pub fn list_steps(root: &Path) -> Vec<(u64, PathBuf)> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let mut steps: Vec<(u64, PathBuf)> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let step = name.strip_prefix("step-")?.parse::<u64>().ok()?;
            e.path().is_dir().then(|| (step, e.path()))
        })
        .collect();
    steps.sort_by_key(|s| std::cmp::Reverse(s.0));
    steps
}

/// Removes `step-*.tmp-*` directories left by a writer that died mid-save; returns their names.
/// Call only when no save of this run is in flight.
pub fn remove_stale_tmp(root: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            (name.starts_with("step-") && name.contains(".tmp-"))
                .then(|| std::fs::remove_dir_all(e.path()).ok().map(|_| name))
                .flatten()
        })
        .collect()
}

fn corrupt(dir: &Path, reason: impl Into<String>) -> CheckpointError {
    CheckpointError::Corrupt {
        dir: dir.to_path_buf(),
        reason: reason.into(),
    }
}

/// Reads a step directory, checking the format version, every file's size and SHA-256, and
/// that the shards hold every tensor the manifest lists with its shape and dtype.
pub fn load_dir(dir: &Path) -> Result<Loaded, CheckpointError> {
    let manifest_path = dir.join(MANIFEST);
    let text = std::fs::read(&manifest_path)
        .map_err(|e| corrupt(dir, format!("cannot read {MANIFEST}: {e}")))?;
    let version: serde_json::Value = serde_json::from_slice(&text)
        .map_err(|e| corrupt(dir, format!("{MANIFEST} is not valid JSON ({e})")))?;
    match version.get("format_version").and_then(|v| v.as_u64()) {
        Some(v) if v == FORMAT_VERSION as u64 => {}
        Some(v) => {
            return Err(corrupt(
                dir,
                format!("format version {v} is not the supported version {FORMAT_VERSION}"),
            ))
        }
        None => return Err(corrupt(dir, format!("{MANIFEST} has no format_version"))),
    }
    let manifest: Manifest =
        serde_json::from_value(version).map_err(|e| corrupt(dir, format!("{MANIFEST}: {e}")))?;
    let mut contents = BTreeMap::new();
    for f in &manifest.files {
        let path = dir.join(&f.name);
        let bytes = std::fs::read(&path)
            .map_err(|e| corrupt(dir, format!("missing file {} ({e})", f.name)))?;
        if bytes.len() as u64 != f.bytes {
            return Err(corrupt(
                dir,
                format!(
                    "{} has {} bytes, the manifest says {}",
                    f.name,
                    bytes.len(),
                    f.bytes
                ),
            ));
        }
        let sum: String = Sha256::digest(&bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        if sum != f.sha256 {
            return Err(corrupt(dir, format!("checksum mismatch in {}", f.name)));
        }
        contents.insert(f.name.clone(), bytes);
    }
    let state_bytes = contents
        .get(TRAIN_STATE)
        .ok_or_else(|| corrupt(dir, format!("the manifest does not list {TRAIN_STATE}")))?;
    let state: TrainState = serde_json::from_slice(state_bytes)
        .map_err(|e| corrupt(dir, format!("{TRAIN_STATE}: {e}")))?;
    if state.step != manifest.step {
        return Err(corrupt(
            dir,
            "train state and manifest disagree on the step",
        ));
    }
    let mut tensors = BTreeMap::new();
    for entry in &manifest.tensors {
        if !tensors.contains_key(&entry.shard) {
            let bytes = contents.get(&entry.shard).ok_or_else(|| {
                corrupt(
                    dir,
                    format!("shard {} is not listed with a checksum", entry.shard),
                )
            })?;
            let path = dir.join(&entry.shard);
            let loaded = anneal_engine::io::load_safetensors_bytes(&path, bytes)
                .map_err(|e| corrupt(dir, e.to_string()))?;
            tensors.insert(entry.shard.clone(), loaded);
        }
    }
    let mut out = BTreeMap::new();
    for entry in &manifest.tensors {
        let t = tensors[&entry.shard].get(&entry.name).ok_or_else(|| {
            corrupt(
                dir,
                format!("tensor {} missing from {}", entry.name, entry.shard),
            )
        })?;
        if t.shape() != entry.global_shape.as_slice() || t.dtype().name() != entry.dtype {
            return Err(corrupt(
                dir,
                format!("tensor {} does not match the manifest", entry.name),
            ));
        }
        out.insert(entry.name.clone(), t.clone());
    }
    Ok(Loaded {
        dir: dir.to_path_buf(),
        manifest,
        state,
        tensors: out,
    })
}

/// The newest usable checkpoint under `root` (or the one of `load_step`). Damaged candidates are
/// skipped with a `warn` naming the problem. `Ok(None)`: there are no checkpoints at all.
pub fn load_latest(
    root: &Path,
    load_step: Option<u64>,
    warn: &dyn Fn(&str),
) -> Result<Option<Loaded>, CheckpointError> {
    let steps = list_steps(root);
    if let Some(want) = load_step {
        let (_, dir) =
            steps
                .iter()
                .find(|(s, _)| *s == want)
                .ok_or_else(|| CheckpointError::NoSuchStep {
                    step: want,
                    root: root.to_path_buf(),
                })?;
        return load_dir(dir).map(Some);
    }
    if steps.is_empty() {
        return Ok(None);
    }
    let mut reasons = Vec::new();
    for (_, dir) in &steps {
        match load_dir(dir) {
            Ok(l) => return Ok(Some(l)),
            Err(e) => {
                warn(&format!("checkpoint skipped: {e}"));
                reasons.push(e.to_string());
            }
        }
    }
    Err(CheckpointError::NoneUsable {
        root: root.to_path_buf(),
        reasons: reasons.join("; "),
    })
}

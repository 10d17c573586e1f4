//! Finding, verifying and loading checkpoints, falling back past damaged ones.

use super::format::{
    FileEntry, Manifest, TensorEntry, TrainState, FORMAT_VERSION, MANIFEST, TRAIN_STATE,
};
use super::{sha256_file, CheckpointError};
use anneal_engine::{DType, Storage, Tensor};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::ops::Range;
use std::path::{Path, PathBuf};

/// How much of a checkpoint [`load_dir_with`] reads up front.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Contents {
    /// Every file verified; every tensor assembled whole in [`Loaded::tensors`].
    All,
    /// Every file verified (streamed, not kept); tensors are read from disk when asked for,
    /// just the rows asked for ([`Loaded::rows`]).
    OnDemand,
    /// [`Contents::OnDemand`] without verifying the files again: for the ranks that follow a
    /// checkpoint rank 0 has verified.
    Trusted,
}

/// A verified checkpoint.
pub struct Loaded {
    /// The step directory it came from.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
    /// Its train state.
    pub state: TrainState,
    /// Every tensor by global name, whole ([`Contents::All`]); empty when loaded on demand.
    pub tensors: BTreeMap<String, Tensor>,
}

impl Loaded {
    /// The global names of the checkpoint's tensors.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        let mut seen = std::collections::BTreeSet::new();
        self.manifest
            .tensors
            .iter()
            .map(|e| e.name.as_str())
            .filter(move |n| seen.insert(*n))
    }

    /// The shape and dtype of the whole tensor `name`, if the checkpoint has it.
    pub fn describe(&self, name: &str) -> Option<(&[usize], &str)> {
        self.manifest
            .tensors
            .iter()
            .find(|e| e.name == name)
            .map(|e| (e.global_shape.as_slice(), e.dtype.as_str()))
    }

    /// The whole tensor `name`.
    pub fn tensor(&self, name: &str) -> Result<Tensor, CheckpointError> {
        if let Some(t) = self.tensors.get(name) {
            return Ok(t.clone());
        }
        let rows = self
            .describe(name)
            .map(|(shape, _)| shape.first().copied().unwrap_or(1))
            .ok_or_else(|| corrupt(&self.dir, format!("no tensor {name}")))?;
        read_rows(&self.dir, &self.manifest, name, 0..rows)
    }

    /// Rows `rows` of dim 0 of the tensor `name` (a scalar has one row), read from the shards
    /// that hold them: what one FSDP rank keeps of it.
    pub fn rows(&self, name: &str, rows: Range<usize>) -> Result<Tensor, CheckpointError> {
        match self.tensors.get(name) {
            Some(t) if t.shape().is_empty() => Ok(t.clone()),
            Some(t) => {
                // A copy: the rows must not keep the whole tensor's storage alive.
                let fail = |e: anneal_engine::Error| corrupt(&self.dir, format!("{name}: {e}"));
                let view = t.narrow(0, rows.start, rows.len()).map_err(fail)?;
                Tensor::from_storage(
                    Storage::from_bytes(view.dtype(), &view.to_bytes()),
                    view.shape(),
                )
                .map_err(fail)
            }
            None => read_rows(&self.dir, &self.manifest, name, rows),
        }
    }
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
/// that the pieces of every tensor fit it and tile it exactly; assembles every tensor whole.
pub fn load_dir(dir: &Path) -> Result<Loaded, CheckpointError> {
    load_dir_with(dir, Contents::All)
}

/// [`load_dir`], reading as much as `contents` says.
pub fn load_dir_with(dir: &Path, contents: Contents) -> Result<Loaded, CheckpointError> {
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
    if contents != Contents::Trusted {
        for f in &manifest.files {
            verify_file(dir, f)?;
        }
    }
    if !manifest.files.iter().any(|f| f.name == TRAIN_STATE) {
        return Err(corrupt(
            dir,
            format!("the manifest does not list {TRAIN_STATE}"),
        ));
    }
    let state_bytes = std::fs::read(dir.join(TRAIN_STATE))
        .map_err(|e| corrupt(dir, format!("missing file {TRAIN_STATE} ({e})")))?;
    let state: TrainState = serde_json::from_slice(&state_bytes)
        .map_err(|e| corrupt(dir, format!("{TRAIN_STATE}: {e}")))?;
    if state.step != manifest.step {
        return Err(corrupt(
            dir,
            "train state and manifest disagree on the step",
        ));
    }
    check_pieces(dir, &manifest)?;
    let mut loaded = Loaded {
        dir: dir.to_path_buf(),
        manifest,
        state,
        tensors: BTreeMap::new(),
    };
    if contents == Contents::All {
        let names: Vec<String> = loaded.names().map(str::to_string).collect();
        for name in names {
            let t = loaded.tensor(&name)?;
            loaded.tensors.insert(name, t);
        }
    }
    Ok(loaded)
}

/// Checks one file's size and SHA-256, streaming it.
fn verify_file(dir: &Path, f: &FileEntry) -> Result<(), CheckpointError> {
    let (total, sum) = sha256_file(&dir.join(&f.name)).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => corrupt(dir, format!("missing file {} ({e})", f.name)),
        _ => corrupt(dir, format!("cannot read {} ({e})", f.name)),
    })?;
    if total != f.bytes {
        return Err(corrupt(
            dir,
            format!(
                "{} has {total} bytes, the manifest says {}",
                f.name, f.bytes
            ),
        ));
    }
    if sum != f.sha256 {
        return Err(corrupt(dir, format!("checksum mismatch in {}", f.name)));
    }
    Ok(())
}

/// Rows of a shape (a scalar has one) and elements per row.
fn rows_and_len(shape: &[usize]) -> (usize, usize) {
    (
        shape.first().copied().unwrap_or(1),
        shape.iter().skip(1).product(),
    )
}

/// Every piece lies in a listed shard, within its size, with as many bytes as its slice holds,
/// cuts only dim 0, and the pieces of each tensor tile its rows exactly.
fn check_pieces(dir: &Path, manifest: &Manifest) -> Result<(), CheckpointError> {
    let mut by_name: BTreeMap<&str, Vec<&TensorEntry>> = BTreeMap::new();
    for e in &manifest.tensors {
        let bad = |why: String| corrupt(dir, format!("tensor {} in {}: {why}", e.name, e.shard));
        let file = manifest
            .files
            .iter()
            .find(|f| f.name == e.shard)
            .ok_or_else(|| {
                corrupt(
                    dir,
                    format!("shard {} is not listed with a checksum", e.shard),
                )
            })?;
        let dtype = DType::parse(&e.dtype).ok_or_else(|| bad(format!("dtype {}", e.dtype)))?;
        let full_dims = e.slice.len() == e.global_shape.len().max(1)
            && e.slice
                .iter()
                .zip(&e.global_shape)
                .skip(1)
                .all(|(s, &n)| *s == [0, n]);
        let (rows, row_len) = rows_and_len(&e.global_shape);
        let [start, end] = *e.slice.first().unwrap_or(&[0, 1]);
        if !(full_dims || e.global_shape.is_empty()) || start > end || end > rows {
            return Err(bad(format!(
                "slice {:?} does not fit shape {:?} (only dim 0 may be cut)",
                e.slice, e.global_shape
            )));
        }
        let want = ((end - start) * row_len * dtype.size_in_bytes()) as u64;
        let [a, b] = e.byte_range;
        if a > b || b - a != want || b > file.bytes {
            return Err(bad(format!(
                "bytes {a}..{b} do not hold {want} bytes within the {} of the file",
                file.bytes
            )));
        }
        by_name.entry(&e.name).or_default().push(e);
    }
    for (name, mut pieces) in by_name {
        pieces.sort_by_key(|e| e.slice.first().map_or(0, |s| s[0]));
        let first = pieces[0];
        let (rows, _) = rows_and_len(&first.global_shape);
        let mut at = 0;
        for e in &pieces {
            let [start, end] = *e.slice.first().unwrap_or(&[0, 1]);
            if e.global_shape != first.global_shape || e.dtype != first.dtype || start != at {
                return Err(corrupt(
                    dir,
                    format!("the pieces of tensor {name} do not fit together"),
                ));
            }
            at = end;
        }
        if at != rows {
            return Err(corrupt(
                dir,
                format!("the pieces of tensor {name} cover rows 0..{at} of {rows}"),
            ));
        }
    }
    Ok(())
}

/// Rows `rows` of the tensor `name`, read (by byte range) from the shards whose pieces hold
/// them. The manifest passed [`check_pieces`].
fn read_rows(
    dir: &Path,
    manifest: &Manifest,
    name: &str,
    rows: Range<usize>,
) -> Result<Tensor, CheckpointError> {
    let pieces: Vec<&TensorEntry> = manifest.tensors.iter().filter(|e| e.name == name).collect();
    let first = pieces
        .first()
        .ok_or_else(|| corrupt(dir, format!("no tensor {name}")))?;
    let dtype = DType::parse(&first.dtype)
        .ok_or_else(|| corrupt(dir, format!("tensor {name}: dtype {}", first.dtype)))?;
    let shape = &first.global_shape;
    let (total, row_len) = rows_and_len(shape);
    if rows.start > rows.end || rows.end > total {
        return Err(corrupt(
            dir,
            format!("tensor {name} has {total} rows, not {rows:?}"),
        ));
    }
    let row_bytes = row_len * dtype.size_in_bytes();
    let mut out = vec![0u8; rows.len() * row_bytes];
    for e in pieces {
        let [start, end] = *e.slice.first().unwrap_or(&[0, 1]);
        let (lo, hi) = (start.max(rows.start), end.min(rows.end));
        if lo >= hi {
            continue;
        }
        let path = dir.join(&e.shard);
        let mut file = File::open(&path)
            .map_err(|err| corrupt(dir, format!("missing file {} ({err})", e.shard)))?;
        let offset = e.byte_range[0] + ((lo - start) * row_bytes) as u64;
        let dst = &mut out[(lo - rows.start) * row_bytes..(hi - rows.start) * row_bytes];
        file.seek(SeekFrom::Start(offset))
            .and_then(|_| file.read_exact(dst))
            .map_err(|err| corrupt(dir, format!("cannot read {name} from {} ({err})", e.shard)))?;
    }
    let mut piece_shape = shape.clone();
    if let Some(d0) = piece_shape.first_mut() {
        *d0 = rows.len();
    }
    Tensor::from_storage(Storage::from_bytes(dtype, &out), &piece_shape)
        .map_err(|e| corrupt(dir, format!("tensor {name}: {e}")))
}

/// The newest usable checkpoint under `root` (or the one of `load_step`). Damaged candidates are
/// skipped with a `warn` naming the problem. `Ok(None)`: there are no checkpoints at all.
pub fn load_latest(
    root: &Path,
    load_step: Option<u64>,
    warn: &dyn Fn(&str),
) -> Result<Option<Loaded>, CheckpointError> {
    load_latest_with(root, load_step, warn, Contents::All)
}

/// [`load_latest`], reading as much as `contents` says.
pub fn load_latest_with(
    root: &Path,
    load_step: Option<u64>,
    warn: &dyn Fn(&str),
    contents: Contents,
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
        return load_dir_with(dir, contents).map(Some);
    }
    if steps.is_empty() {
        return Ok(None);
    }
    let mut reasons = Vec::new();
    for (_, dir) in &steps {
        match load_dir_with(dir, contents) {
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

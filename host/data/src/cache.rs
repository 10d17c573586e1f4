//! Cache keys and atomic cache writes shared by the tokenizer and the dataset caches.

use std::fs;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::{DataError, Result};

/// A SHA-256 cache key over length-prefixed fields, so `("ab", "c")` and `("a", "bc")` differ.
pub(crate) struct CacheKey(Sha256);

impl CacheKey {
    /// A key for one kind of cached artefact; `kind` keeps keys of different caches apart.
    pub(crate) fn new(kind: &str) -> Self {
        let mut key = CacheKey(Sha256::new());
        key.bytes(kind.as_bytes());
        key
    }

    /// Adds one field.
    pub(crate) fn bytes(&mut self, data: &[u8]) -> &mut Self {
        self.0.update((data.len() as u64).to_le_bytes());
        self.0.update(data);
        self
    }

    /// Adds one integer field.
    pub(crate) fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }

    /// Adds the paths (as given) and the full contents of each file.
    pub(crate) fn files(&mut self, files: &[PathBuf]) -> Result<&mut Self> {
        self.u64(files.len() as u64);
        for f in files {
            self.bytes(f.to_string_lossy().as_bytes());
            let data = fs::read(f).map_err(|e| DataError::io(f, e))?;
            self.bytes(&Sha256::digest(&data));
        }
        Ok(self)
    }

    /// The first 16 bytes of the digest as 32 hex digits.
    pub(crate) fn hex(&self) -> String {
        hex(&self.0.clone().finalize()[..16])
    }
}

/// `bytes` as lowercase hex digits, two per byte (how digests are written everywhere).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Hex SHA-256 of `data` (all 32 bytes).
pub(crate) fn sha256_hex(data: &[u8]) -> String {
    hex(&Sha256::digest(data))
}

/// Bytes of each end of a file that a fingerprint reads instead of the whole file.
pub(crate) const EDGE_BYTES: u64 = 64 << 10;

/// The first and the last [`EDGE_BYTES`] of the `len` bytes of `file` from `start` (all of
/// them, twice, when shorter): what fingerprints of large files read.
pub(crate) fn edges(file: &fs::File, start: u64, len: u64) -> std::io::Result<[Vec<u8>; 2]> {
    use std::os::unix::fs::FileExt;
    let edge = len.min(EDGE_BYTES);
    let read = |from: u64| {
        let mut buf = vec![0u8; edge as usize];
        file.read_exact_at(&mut buf, start + from).map(|()| buf)
    };
    Ok([read(0)?, read(len - edge)?])
}

/// Writes `data` to `path` through a temporary file in the same folder and a rename, so a reader
/// never sees a half-written cache file (also when two processes fill the same cache).
pub(crate) fn write_atomic(path: &Path, data: &[u8]) -> Result<()> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).map_err(|e| DataError::io(dir, e))?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    fs::write(&tmp, data).map_err(|e| DataError::io(&tmp, e))?;
    fs::rename(&tmp, path).map_err(|e| DataError::io(path, e))
}

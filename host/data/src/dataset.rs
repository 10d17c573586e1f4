//! The corpus as token ids, split into a training stream and a held-out validation stream.

use std::fs;
use std::path::{Path, PathBuf};

use rayon::prelude::*;

use crate::cache::{write_atomic, CacheKey};
use crate::corpus::read_documents;
use crate::tokenizer::TextTokenizer;
use crate::{DataError, Result};

/// Token streams for training and validation; each document in either ends with `eos_id`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenDataset {
    /// The training stream.
    pub train: Vec<u32>,
    /// The held-out validation stream (empty when `val_fraction` is 0 or every document is tiny).
    pub val: Vec<u32>,
    /// The end-of-document id.
    pub eos_id: u32,
}

impl TokenDataset {
    /// Encodes every document of `files` (see [`read_documents`]; in parallel, the result does not
    /// depend on the thread count) and splits each one: a document of `n` tokens gives its last
    /// `k = floor(n * val_fraction)` tokens to validation and the first `n - k` to training, each
    /// part followed by EOS (a part with `k = 0` adds nothing to validation). Splitting every
    /// document, rather than holding out whole documents, keeps the validation set drawn from the
    /// whole corpus even when it has few, long documents (37 plays), and no text is in both
    /// streams. Streams keep the file and document order.
    ///
    /// The two streams are cached in `cache_dir` as `tokens-<hash>.train.u32` and
    /// `tokens-<hash>.val.u32` (little-endian u32), the hash covering the tokenizer's JSON, the
    /// file paths and contents, `text_field` and `val_fraction`, and read back by later calls.
    pub fn build(
        files: &[PathBuf],
        text_field: &str,
        tok: &TextTokenizer,
        val_fraction: f64,
        cache_dir: &Path,
    ) -> Result<Self> {
        if !(0.0..1.0).contains(&val_fraction) {
            return Err(DataError::InvalidArgument {
                name: "val_fraction",
                message: format!("{val_fraction} is not in [0, 1)"),
            });
        }
        let eos_id = tok.eos_id();
        let mut key = CacheKey::new("anneal-data token streams v1");
        key.bytes(tok.to_json()?.as_bytes())
            .u64(eos_id.into())
            .bytes(text_field.as_bytes());
        key.files(files)?.u64(val_fraction.to_bits());
        let hex = key.hex();
        let train_path = cache_dir.join(format!("tokens-{hex}.train.u32"));
        let val_path = cache_dir.join(format!("tokens-{hex}.val.u32"));
        let limit = tok.vocab_size();
        if let (Some(train), Some(val)) = (read_ids(&train_path, limit), read_ids(&val_path, limit))
        {
            return Ok(TokenDataset { train, val, eos_id });
        }

        let docs = read_documents(files, text_field)?;
        let encoded: Vec<Vec<u32>> = docs
            .par_iter()
            .map(|d| tok.encode(d))
            .collect::<Result<_>>()?;
        let (train, val) = split_documents(&encoded, eos_id, val_fraction);
        // Validation first: a train file without its val file is never taken for a hit.
        write_atomic(&val_path, &to_le_bytes(&val))?;
        write_atomic(&train_path, &to_le_bytes(&train))?;
        Ok(TokenDataset { train, val, eos_id })
    }
}

impl TokenDataset {
    /// Hex SHA-256 of the training stream (little-endian u32 ids): it changes with the corpus,
    /// the tokenizer, `text_field` and `val_fraction`, which is what checkpoints record to refuse
    /// resuming on other data.
    pub fn train_sha256(&self) -> String {
        crate::cache::sha256_hex(&to_le_bytes(&self.train))
    }
}

/// Splits each encoded document into a training head and a validation tail, as documented on
/// [`TokenDataset::build`].
fn split_documents(docs: &[Vec<u32>], eos_id: u32, val_fraction: f64) -> (Vec<u32>, Vec<u32>) {
    let total: usize = docs.iter().map(Vec::len).sum();
    let mut train = Vec::with_capacity(total + docs.len());
    let mut val = Vec::with_capacity((total as f64 * val_fraction) as usize + docs.len());
    for doc in docs {
        // floor(n * f) < n for f < 1, so every document keeps a training head.
        let k = (doc.len() as f64 * val_fraction).floor() as usize;
        let (head, tail) = doc.split_at(doc.len() - k);
        train.extend_from_slice(head);
        train.push(eos_id);
        if !tail.is_empty() {
            val.extend_from_slice(tail);
            val.push(eos_id);
        }
    }
    (train, val)
}

fn to_le_bytes(ids: &[u32]) -> Vec<u8> {
    ids.iter().flat_map(|id| id.to_le_bytes()).collect()
}

/// A cached stream, or `None` when it is missing or damaged (length not a multiple of 4, an id
/// at or above `limit`), in which case the caller rebuilds it.
fn read_ids(path: &Path, limit: usize) -> Option<Vec<u32>> {
    let bytes = fs::read(path).ok()?;
    if bytes.len() % 4 != 0 {
        return None;
    }
    let ids: Vec<u32> = bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("chunks_exact(4) gives 4 bytes")))
        .collect();
    ids.iter().all(|&id| (id as usize) < limit).then_some(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_takes_the_floor_of_each_documents_tail() {
        let docs = vec![
            (10..20).collect::<Vec<u32>>(),
            vec![30, 31, 32],
            (40..44).collect(),
        ];
        let (train, val) = split_documents(&docs, 0, 0.25);
        // 10 tokens → 2 held out; 3 → 0; 4 → 1.
        assert_eq!(
            train,
            [10, 11, 12, 13, 14, 15, 16, 17, 0, 30, 31, 32, 0, 40, 41, 42, 0]
        );
        assert_eq!(val, [18, 19, 0, 43, 0]);
    }

    #[test]
    fn zero_fraction_keeps_everything_for_training() {
        let docs = vec![vec![5, 6], vec![7]];
        let (train, val) = split_documents(&docs, 9, 0.0);
        assert_eq!(train, [5, 6, 9, 7, 9]);
        assert!(val.is_empty());
    }

    #[test]
    fn damaged_cache_files_read_as_missing() {
        let dir = std::env::temp_dir().join(format!("anneal-data-readids-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let p = dir.join("x.u32");
        fs::write(&p, to_le_bytes(&[1, 2, 3])).unwrap();
        assert_eq!(read_ids(&p, 4), Some(vec![1, 2, 3]));
        assert_eq!(read_ids(&p, 3), None, "id 3 is out of a 3-token vocabulary");
        fs::write(&p, [1u8, 0, 0]).unwrap();
        assert_eq!(read_ids(&p, 4), None, "3 bytes are not a whole id");
        assert_eq!(read_ids(&dir.join("missing.u32"), 4), None);
        fs::remove_dir_all(&dir).unwrap();
    }
}

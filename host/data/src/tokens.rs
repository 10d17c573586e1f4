//! Pre-tokenized corpora, read in place: nanoGPT's `.bin` (raw little-endian u16 ids, or u32),
//! llm.c's shards (a 256-int header naming the id width and count, then the ids) and Megatron's
//! indexed datasets (`X.bin` ids beside an `X.idx` index naming their dtype and sequences).
//!
//! The files are never loaded whole: a window's ids are read with a positioned read when the
//! loader wants it, so memory stays flat whatever the corpus size (the page cache keeps what is
//! hot; unlike a memory map, it does not count toward the process's resident memory), and each
//! id is checked against the vocabulary as it is read.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::{DataError, Result};

/// llm.c's shard header: 256 little-endian i32, the first three the magic, the version (1: u16
/// ids, 2: u32 ids) and the id count.
const LLMC_MAGIC: i32 = 20240520;
const LLMC_HEADER: u64 = 256 * 4;
/// Megatron's `.idx` files start with these 9 bytes, then version 1 (u64).
const MEGATRON_MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";

/// How one id is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Width {
    /// `u8`.
    U8,
    /// `i8`.
    I8,
    /// `u16` (nanoGPT, llm.c version 1, Megatron for vocabularies under 65,500).
    U16,
    /// `i16`.
    I16,
    /// `u32` (llm.c version 2).
    U32,
    /// `i32` (Megatron for larger vocabularies).
    I32,
    /// `i64`.
    I64,
}

impl Width {
    fn bytes(self) -> usize {
        match self {
            Width::U8 | Width::I8 => 1,
            Width::U16 | Width::I16 => 2,
            Width::U32 | Width::I32 => 4,
            Width::I64 => 8,
        }
    }

    /// The id at the start of `b` (`self.bytes()` long), negative ids as `None`.
    fn id(self, b: &[u8]) -> Option<u64> {
        let signed = |v: i64| u64::try_from(v).ok();
        match self {
            Width::U8 => Some(u64::from(b[0])),
            Width::I8 => signed(i64::from(b[0] as i8)),
            Width::U16 => Some(u64::from(u16::from_le_bytes([b[0], b[1]]))),
            Width::I16 => signed(i64::from(i16::from_le_bytes([b[0], b[1]]))),
            Width::U32 => Some(u64::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
            Width::I32 => signed(i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
            Width::I64 => signed(i64::from_le_bytes(b[..8].try_into().ok()?)),
        }
    }

    /// Megatron's dtype code (`megatron.core.datasets.indexed_dataset.DType`); float codes
    /// hold no token ids.
    fn megatron(code: u8) -> Option<Width> {
        Some(match code {
            1 => Width::U8,
            2 => Width::I8,
            3 => Width::I16,
            4 => Width::I32,
            5 => Width::I64,
            8 => Width::U16,
            _ => return None,
        })
    }
}

/// One file of ids: where they start and how many there are.
#[derive(Debug)]
struct Shard {
    path: PathBuf,
    file: File,
    /// Byte offset of the first id.
    offset: u64,
    /// Ids in the file.
    tokens: u64,
    width: Width,
    /// What kind of file it was read as (for messages).
    kind: &'static str,
}

/// A stream of token ids over one or more files, in order, read on demand.
#[derive(Debug)]
pub struct TokenFiles {
    shards: Vec<Shard>,
    /// The stream position of each shard's first id.
    starts: Vec<u64>,
    total: u64,
    vocab: u64,
}

impl TokenFiles {
    /// Opens `files` (each a nanoGPT / llm.c `.bin`, or a Megatron `.bin` with its `.idx`
    /// beside) as one stream; raw `.bin` files without a header hold `raw` ids. Ids at or
    /// above `vocab` are an error when read.
    pub fn open(files: &[PathBuf], raw: Width, vocab: usize) -> Result<Self> {
        let mut shards = Vec::with_capacity(files.len());
        for f in files {
            shards.push(open_shard(f, raw)?);
        }
        let mut starts = Vec::with_capacity(shards.len());
        let mut total = 0u64;
        for s in &shards {
            starts.push(total);
            total += s.tokens;
        }
        Ok(TokenFiles {
            shards,
            starts,
            total,
            vocab: vocab as u64,
        })
    }

    /// Ids in the stream.
    pub fn len(&self) -> u64 {
        self.total
    }

    /// Whether the stream holds no id.
    pub fn is_empty(&self) -> bool {
        self.total == 0
    }

    /// Appends the `n` ids from stream position `at` to `out`.
    pub fn read(&self, at: u64, n: usize, out: &mut Vec<u32>) -> Result<()> {
        let end = at + n as u64;
        if end > self.total {
            return Err(DataError::InvalidArgument {
                name: "token range",
                message: format!("{at}..{end} is past the stream's {} ids", self.total),
            });
        }
        let mut pos = at;
        let mut buf = Vec::new();
        while pos < end {
            let i = self.starts.partition_point(|&s| s <= pos) - 1;
            let s = &self.shards[i];
            let local = pos - self.starts[i];
            let take = (end - pos).min(s.tokens - local);
            let w = s.width.bytes();
            buf.resize(take as usize * w, 0);
            s.file
                .read_exact_at(&mut buf, s.offset + local * w as u64)
                .map_err(|e| DataError::io(&s.path, e))?;
            for (j, b) in buf.chunks_exact(w).enumerate() {
                match s.width.id(b).filter(|&id| id < self.vocab) {
                    Some(id) => out.push(id as u32),
                    None => {
                        return Err(DataError::BadToken {
                            path: s.path.clone(),
                            index: local + j as u64,
                            id: s.width.id(b).map_or(-1, |v| v as i64),
                            vocab: self.vocab,
                        })
                    }
                }
            }
            pos += take;
        }
        Ok(())
    }

    /// Hex SHA-256 identifying the files as trained on without reading them whole: each file's
    /// name, kind, id width and count, and its first and last 64 KiB.
    pub fn fingerprint(&self) -> Result<String> {
        let mut h = Sha256::new();
        for s in &self.shards {
            let name = s.path.file_name().unwrap_or_default().to_string_lossy();
            h.update((name.len() as u64).to_le_bytes());
            h.update(name.as_bytes());
            h.update(s.kind.as_bytes());
            h.update([s.width.bytes() as u8]);
            h.update(s.tokens.to_le_bytes());
            let bytes = s.tokens * s.width.bytes() as u64;
            let edges = crate::cache::edges(&s.file, s.offset, bytes)
                .map_err(|e| DataError::io(&s.path, e))?;
            for edge in edges {
                h.update(&edge);
            }
        }
        Ok(crate::hex(&h.finalize()))
    }

    /// What the files are, for a log line: `3 nanoGPT .bin file(s), 1.2M ids`.
    pub fn describe(&self) -> String {
        let kind = self.shards.first().map_or("no", |s| s.kind);
        format!("{} {kind} file(s), {} ids", self.shards.len(), self.total)
    }
}

/// A contiguous part of a [`TokenFiles`] stream (the training or the held-out part).
#[derive(Clone, Debug)]
pub struct TokenRange {
    files: Arc<TokenFiles>,
    start: u64,
    len: u64,
}

impl TokenRange {
    /// The whole of `files`.
    pub fn all(files: Arc<TokenFiles>) -> Self {
        let len = files.len();
        TokenRange {
            files,
            start: 0,
            len,
        }
    }

    /// Splits off the last `fraction` of the ids (`floor(len · fraction)` of them) as a second
    /// range.
    pub fn split_tail(self, fraction: f64) -> (TokenRange, TokenRange) {
        let tail = (self.len as f64 * fraction).floor() as u64;
        let head = TokenRange {
            len: self.len - tail,
            ..self.clone()
        };
        let rest = TokenRange {
            start: self.start + head.len,
            len: tail,
            ..self
        };
        (head, rest)
    }

    /// Ids in the range.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the range holds no id.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends the `n` ids from position `at` of the range to `out`.
    pub fn read(&self, at: u64, n: usize, out: &mut Vec<u32>) -> Result<()> {
        if at + n as u64 > self.len {
            return Err(DataError::InvalidArgument {
                name: "token range",
                message: format!("{at}+{n} is past the range's {} ids", self.len),
            });
        }
        self.files.read(self.start + at, n, out)
    }

    /// The first `n` ids of the range (fewer when it is shorter), in memory.
    pub fn head(&self, n: u64) -> Result<Vec<u32>> {
        let n = n.min(self.len) as usize;
        let mut out = Vec::with_capacity(n);
        self.read(0, n, &mut out)?;
        Ok(out)
    }

    /// The files' fingerprint with the range.
    pub fn fingerprint(&self) -> Result<String> {
        let mut h = Sha256::new();
        h.update(self.files.fingerprint()?.as_bytes());
        h.update(self.start.to_le_bytes());
        h.update(self.len.to_le_bytes());
        Ok(crate::hex(&h.finalize()))
    }
}

/// The token files at `path`, split into training and held-out files:
/// - a `.bin` file (with its Megatron `.idx` beside it, if any), a Megatron `.idx`, or a
///   Megatron prefix (`X` for `X.bin` + `X.idx`): that file, nothing held out;
/// - a folder: its `.bin` files (not recursively), sorted by name; those whose name says `val`
///   (nanoGPT's `val.bin`, llm.c's `*_val_*.bin`) are held out.
pub fn discover_token_files(path: &Path) -> Result<(Vec<PathBuf>, Vec<PathBuf>)> {
    if path.is_dir() {
        let mut files: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(|e| DataError::io(path, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file() && ext(p, "bin"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(DataError::Empty {
                path: path.to_path_buf(),
                what: "no .bin token files in this folder".into(),
            });
        }
        let held = |p: &PathBuf| {
            let stem = p.file_stem().unwrap_or_default().to_string_lossy();
            stem == "val" || stem.contains("_val") || stem.starts_with("val_")
        };
        let (val, train): (Vec<_>, Vec<_>) = files.into_iter().partition(held);
        if train.is_empty() {
            return Err(DataError::Empty {
                path: path.to_path_buf(),
                what: "only held-out (val) .bin files in this folder".into(),
            });
        }
        return Ok((train, val));
    }
    if ext(path, "idx") {
        return Ok((vec![path.with_extension("bin")], Vec::new()));
    }
    if ext(path, "bin") {
        return Ok((vec![path.to_path_buf()], Vec::new()));
    }
    let bin = PathBuf::from(format!("{}.bin", path.display()));
    if bin.is_file() {
        return Ok((vec![bin], Vec::new()));
    }
    Err(DataError::UnsupportedFile {
        path: path.to_path_buf(),
    })
}

/// Whether `p`'s extension is `e`, in any case.
fn ext(p: &Path, e: &str) -> bool {
    p.extension().is_some_and(|x| x.eq_ignore_ascii_case(e))
}

/// Whether `path` names token files ([`discover_token_files`] would find some): a `.bin` or
/// `.idx` file, a Megatron prefix, or a folder holding `.bin` files.
pub fn looks_like_tokens(path: &Path) -> bool {
    if path.is_dir() {
        return std::fs::read_dir(path).is_ok_and(|d| {
            d.filter_map(|e| e.ok())
                .any(|e| e.path().is_file() && ext(&e.path(), "bin"))
        });
    }
    ext(path, "bin")
        || ext(path, "idx")
        || PathBuf::from(format!("{}.idx", path.display())).is_file()
}

fn open_shard(path: &Path, raw: Width) -> Result<Shard> {
    let file = File::open(path).map_err(|e| DataError::io(path, e))?;
    let bytes = file.metadata().map_err(|e| DataError::io(path, e))?.len();
    let bad = |message: String| DataError::BadTokenFile {
        path: path.to_path_buf(),
        message,
    };
    let idx = path.with_extension("idx");
    if idx.is_file() {
        let (width, tokens) = read_megatron_index(&idx)?;
        let want = tokens * width.bytes() as u64;
        if bytes != want {
            return Err(bad(format!(
                "{bytes} bytes, but its index {} counts {tokens} ids of {} bytes ({want} bytes)",
                idx.display(),
                width.bytes()
            )));
        }
        return Ok(Shard {
            path: path.to_path_buf(),
            file,
            offset: 0,
            tokens,
            width,
            kind: "Megatron .bin/.idx",
        });
    }
    let mut head = [0u8; 12];
    if bytes >= LLMC_HEADER && file.read_exact_at(&mut head, 0).is_ok() {
        let int =
            |i: usize| i32::from_le_bytes(head[i * 4..i * 4 + 4].try_into().unwrap_or_default());
        if int(0) == LLMC_MAGIC {
            let width = match int(1) {
                1 => Width::U16,
                2 => Width::U32,
                v => {
                    return Err(bad(format!(
                        "llm.c shard version {v} (known: 1 for u16 ids, 2 for u32)"
                    )))
                }
            };
            let tokens = u64::try_from(int(2))
                .map_err(|_| bad(format!("llm.c header counts {} ids", int(2))))?;
            let want = LLMC_HEADER + tokens * width.bytes() as u64;
            if bytes != want {
                return Err(bad(format!(
                    "{bytes} bytes, but its llm.c header counts {tokens} ids ({want} bytes with the header)"
                )));
            }
            return Ok(Shard {
                path: path.to_path_buf(),
                file,
                offset: LLMC_HEADER,
                tokens,
                width,
                kind: "llm.c .bin",
            });
        }
    }
    let w = raw.bytes() as u64;
    if bytes % w != 0 {
        return Err(bad(format!(
            "{bytes} bytes is not a whole number of {w}-byte ids (data.token_dtype)"
        )));
    }
    Ok(Shard {
        path: path.to_path_buf(),
        file,
        offset: 0,
        tokens: bytes / w,
        width: raw,
        kind: "nanoGPT .bin",
    })
}

/// A Megatron index's id width and its sequences' total length: the header, version 1, the
/// dtype code, the sequence and document counts, then the sequences' lengths (i32 each).
fn read_megatron_index(idx: &Path) -> Result<(Width, u64)> {
    let data = std::fs::read(idx).map_err(|e| DataError::io(idx, e))?;
    let bad = |message: String| DataError::BadTokenFile {
        path: idx.to_path_buf(),
        message,
    };
    if data.len() < 34 || &data[..9] != MEGATRON_MAGIC {
        return Err(bad("not a Megatron index (no MMIDIDX header)".into()));
    }
    let u64_at = |i: usize| u64::from_le_bytes(data[i..i + 8].try_into().unwrap_or_default());
    let version = u64_at(9);
    if version != 1 {
        return Err(bad(format!("index version {version} (known: 1)")));
    }
    let code = data[17];
    let width = Width::megatron(code)
        .ok_or_else(|| bad(format!("dtype code {code} holds no token ids")))?;
    let sequences = u64_at(18) as usize;
    let sizes_end = 34 + sequences * 4;
    if data.len() < sizes_end {
        return Err(bad(format!("index of {sequences} sequences is cut short")));
    }
    let mut tokens = 0u64;
    for c in data[34..sizes_end].chunks_exact(4) {
        let n = i32::from_le_bytes(c.try_into().unwrap_or_default());
        tokens += u64::try_from(n).map_err(|_| bad(format!("a sequence of {n} ids")))?;
    }
    Ok((width, tokens))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("anneal-tokens-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// A Megatron `.bin`/`.idx` pair of u16 ids, one sequence per document.
    pub(crate) fn write_megatron(prefix: &Path, docs: &[Vec<u16>]) {
        let bin: Vec<u8> = docs
            .iter()
            .flatten()
            .flat_map(|t| t.to_le_bytes())
            .collect();
        std::fs::write(prefix.with_extension("bin"), bin).unwrap();
        let mut idx = MEGATRON_MAGIC.to_vec();
        idx.extend(1u64.to_le_bytes());
        idx.push(8);
        idx.extend((docs.len() as u64).to_le_bytes());
        idx.extend((docs.len() as u64 + 1).to_le_bytes());
        for d in docs {
            idx.extend((d.len() as i32).to_le_bytes());
        }
        let mut at = 0i64;
        for d in docs {
            idx.extend(at.to_le_bytes());
            at += 2 * d.len() as i64;
        }
        for i in 0..=docs.len() as i64 {
            idx.extend(i.to_le_bytes());
        }
        std::fs::write(prefix.with_extension("idx"), idx).unwrap();
    }

    #[test]
    fn the_three_layouts_read_the_same_ids() {
        let d = dir("layouts");
        let ids: Vec<u16> = (0..1000).map(|i| (i * 7 % 300) as u16).collect();
        let raw: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
        std::fs::write(d.join("nano.bin"), &raw).unwrap();
        let mut llmc = vec![0u8; LLMC_HEADER as usize];
        llmc[..4].copy_from_slice(&LLMC_MAGIC.to_le_bytes());
        llmc[4..8].copy_from_slice(&1i32.to_le_bytes());
        llmc[8..12].copy_from_slice(&1000i32.to_le_bytes());
        llmc.extend(&raw);
        std::fs::write(d.join("llmc.bin"), &llmc).unwrap();
        write_megatron(&d.join("mega"), &[ids[..400].to_vec(), ids[400..].to_vec()]);
        let want: Vec<u32> = ids[250..750].iter().map(|&t| u32::from(t)).collect();
        for name in ["nano.bin", "llmc.bin", "mega.idx"] {
            let (train, _) = discover_token_files(&d.join(name)).unwrap();
            let f = TokenFiles::open(&train, Width::U16, 300).unwrap();
            assert_eq!(f.len(), 1000, "{name}");
            let mut got = Vec::new();
            f.read(250, 500, &mut got).unwrap();
            assert_eq!(got, want, "{name}");
        }
        // Two shards read as one stream, across the boundary.
        let f =
            TokenFiles::open(&[d.join("nano.bin"), d.join("llmc.bin")], Width::U16, 300).unwrap();
        let mut got = Vec::new();
        f.read(990, 20, &mut got).unwrap();
        let tail: Vec<u32> = ids[990..]
            .iter()
            .chain(&ids[..10])
            .map(|&t| u32::from(t))
            .collect();
        assert_eq!(got, tail);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn bad_files_and_ids_are_named() {
        let d = dir("bad");
        std::fs::write(d.join("odd.bin"), [1u8, 2, 3]).unwrap();
        let e = TokenFiles::open(&[d.join("odd.bin")], Width::U16, 10).unwrap_err();
        assert!(
            e.to_string().contains("odd.bin") && e.to_string().contains("whole number"),
            "{e}"
        );
        std::fs::write(d.join("big.bin"), [1u8, 0, 50, 0]).unwrap();
        let f = TokenFiles::open(&[d.join("big.bin")], Width::U16, 10).unwrap();
        let e = f.read(0, 2, &mut Vec::new()).unwrap_err().to_string();
        assert!(
            e.contains("big.bin") && e.contains("id 50") && e.contains("index 1"),
            "{e}"
        );
        write_megatron(&d.join("m"), &[vec![1, 2, 3]]);
        std::fs::write(d.join("m.bin"), [1u8, 0]).unwrap();
        let e = TokenFiles::open(&[d.join("m.bin")], Width::U16, 10).unwrap_err();
        assert!(e.to_string().contains("counts 3 ids"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_folder_holds_out_its_val_files_and_a_range_splits_its_tail() {
        let d = dir("folder");
        for name in [
            "train.bin",
            "val.bin",
            "fineweb_val_000000.bin",
            "fineweb_train_000001.bin",
        ] {
            std::fs::write(d.join(name), [1u8, 0, 2, 0]).unwrap();
        }
        let (train, val) = discover_token_files(&d).unwrap();
        let names = |v: &[PathBuf]| -> Vec<String> {
            v.iter()
                .map(|p| p.file_name().unwrap().to_string_lossy().into())
                .collect()
        };
        assert_eq!(names(&train), ["fineweb_train_000001.bin", "train.bin"]);
        assert_eq!(names(&val), ["fineweb_val_000000.bin", "val.bin"]);
        assert!(looks_like_tokens(&d));
        let f = Arc::new(TokenFiles::open(&train, Width::U16, 10).unwrap());
        let (head, tail) = TokenRange::all(f).split_tail(0.3);
        assert_eq!((head.len(), tail.len()), (3, 1));
        assert_eq!(tail.head(10).unwrap(), [2]);
        std::fs::remove_dir_all(&d).unwrap();
    }
}

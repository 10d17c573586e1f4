//! Text corpora larger than memory, tokenized as training goes: a background thread reads the
//! documents, tokenizes them on its own threads and keeps a bounded queue of blocks of windows
//! ahead of the trainer; memory stays constant whatever the corpus size, and a saved place lets
//! a resumed run continue bit for bit.
//!
//! The stream is the corpus' documents in an epoch's file order (a seeded permutation of the
//! files, or their sorted order without `shuffle`), each followed by EOS. A plain-text file is
//! read in pieces ending at a line end ([`PIECE_BYTES`] or more), with EOS after its last piece
//! only, so a file of any size is never in memory whole. The stream is cut into blocks of
//! `block_windows` windows of `seq_len + 1` tokens (consecutive windows share a token, as in
//! [`crate::PackedLoader`]); each block's windows are served in a permutation drawn from
//! `(seed, epoch, block)` (in order without `shuffle`). So windows are shuffled within blocks
//! and files across epochs: what a buffer shuffle gives, with an order that depends on nothing
//! but the corpus, the tokenizer and the seed, never on threads or timing.
//!
//! A block's place (the document holding its first token and how many of that document's
//! tokens come before) is what a checkpoint records; a resumed run tokenizes that block again
//! and skips the windows already served.
//!
//! Validation: the first documents of the corpus, in file order, give the tail `val_fraction`
//! of their tokens to the held-out stream, as [`crate::TokenDataset`] splits every document,
//! until it holds the tokens evaluation reads ([`held_out`]); later documents train whole.

mod documents;

use documents::{Doc, Documents};
use std::collections::VecDeque;
use std::fs::File;
use std::path::PathBuf;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::cache::CacheKey;
use crate::loader::{mix, permutation, Batch, LoaderState};
use crate::tokenizer::TextTokenizer;
use crate::{DataError, Result};

/// A plain-text file is read in pieces of at least this many bytes, ending at a line end.
pub const PIECE_BYTES: usize = 1 << 20;
/// Text read and tokenized at once by the background thread (in parallel over its documents).
const READ_BYTES: usize = 4 << 20;
/// Blocks tokenized ahead of the trainer.
const QUEUE_BLOCKS: usize = 2;

/// A document's place in the corpus: its file (index in the sorted file list) and where it
/// starts in that file (a byte offset; a row for Parquet and Arrow files).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DocPos {
    /// Index of the file in the corpus' sorted file list.
    pub file: u32,
    /// Byte offset of the document (row index in a columnar file).
    pub offset: u64,
}

/// Where a block of the stream starts: the document holding its first token, and how many of
/// that document's tokens come before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamPlace {
    /// The document.
    pub doc: DocPos,
    /// Tokens of the document before the block.
    pub skip: u64,
    /// Windows per block of the stream the place was taken in (a resumed run must cut the
    /// same blocks).
    pub block_windows: u64,
}

/// What a [`StreamingLoader`] streams, and how.
#[derive(Clone, Debug)]
pub struct StreamSpec {
    /// The corpus files, sorted ([`crate::discover_files`]).
    pub files: Vec<PathBuf>,
    /// The field holding a record's text.
    pub text_field: String,
    /// Tokens per window's inputs.
    pub seq_len: usize,
    /// Seeds the file and window orders.
    pub seed: u64,
    /// Shuffle files per epoch and windows per block (else stream order).
    pub shuffle: bool,
    /// Windows per block: the span over which windows are shuffled.
    pub block_windows: usize,
    /// Tokenizer threads (at least 1).
    pub threads: usize,
    /// The held-out split ([`held_out`]): documents before `until` train on their heads only.
    pub held_out: Option<HeldOut>,
}

/// Which documents gave their tails to validation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HeldOut {
    /// Documents before this place (in file order).
    pub until: DocPos,
    /// The fraction of each one's tokens held out.
    pub fraction: f64,
}

/// A document's tokens for training and for validation: with `fraction`, its last
/// `floor(n * fraction)` tokens go to validation (followed by EOS), the rest to training
/// (followed by EOS when it ends a document or lost its tail).
fn split(mut ids: Vec<u32>, ends: bool, fraction: f64, eos: u32) -> (Vec<u32>, Vec<u32>) {
    let k = (ids.len() as f64 * fraction).floor() as usize;
    let mut tail = ids.split_off(ids.len() - k);
    if ends || !tail.is_empty() {
        ids.push(eos);
    }
    if !tail.is_empty() {
        tail.push(eos);
    }
    (ids, tail)
}

/// A place that does not fit the corpus (a checkpoint of other data, or other settings).
pub(super) fn bad_place(message: String) -> DataError {
    DataError::InvalidArgument {
        name: "stream place",
        message: format!("{message} (the checkpoint was taken on other data)"),
    }
}

/// The order files are read in during `epoch`.
fn file_order(spec: &StreamSpec, epoch: u64) -> Vec<u32> {
    match spec.shuffle {
        // Distinct from the window orders' seeds, which also mix the block.
        true => permutation(spec.files.len(), spec.seed ^ mix(epoch) ^ mix(u64::MAX)),
        false => (0..spec.files.len() as u32).collect(),
    }
}

/// The order a block's `windows` are served in.
fn window_order(spec: &StreamSpec, epoch: u64, block: u64, windows: usize) -> Vec<u32> {
    match spec.shuffle {
        true => permutation(windows, spec.seed ^ mix(epoch) ^ mix(block)),
        false => (0..windows as u32).collect(),
    }
}

/// A block of the stream: its windows' tokens (`windows * seq_len + 1`).
struct Block {
    epoch: u64,
    index: u64,
    start: StreamPlace,
    tokens: Vec<u32>,
    windows: usize,
    /// Where the next block starts; `None` when this one ends the epoch.
    next: Option<StreamPlace>,
}

/// The background side: reads and tokenizes documents and cuts them into blocks.
struct Producer<'a> {
    spec: &'a StreamSpec,
    tok: &'a TextTokenizer,
    pool: Option<&'a rayon::ThreadPool>,
    docs: Documents<'a>,
    /// Tokenized documents not yet fully taken, and how many of the front one's tokens are.
    pending: VecDeque<(DocPos, Vec<u32>)>,
    skip: usize,
}

impl<'a> Producer<'a> {
    /// Where the next token comes from; `None` at the end of the epoch.
    fn place(&mut self) -> Result<Option<StreamPlace>> {
        if !self.front()? {
            return Ok(None);
        }
        Ok(self.pending.front().map(|(doc, _)| StreamPlace {
            doc: *doc,
            skip: self.skip as u64,
            block_windows: self.spec.block_windows as u64,
        }))
    }

    /// Makes sure the front document has a token at `skip`; false at the end of the epoch.
    fn front(&mut self) -> Result<bool> {
        loop {
            match self.pending.front().map(|(_, ids)| ids.len()) {
                Some(len) if self.skip < len => return Ok(true),
                Some(_) => {
                    self.pending.pop_front();
                    self.skip = 0;
                }
                None if !self.refill()? => return Ok(false),
                None => {}
            }
        }
    }

    /// Reads and tokenizes the next documents (about [`READ_BYTES`] of text); false when there
    /// are none left.
    fn refill(&mut self) -> Result<bool> {
        let mut docs = Vec::new();
        let mut bytes = 0;
        while bytes < READ_BYTES {
            let Some(d) = self.docs.next()? else { break };
            bytes += d.text.len();
            docs.push(d);
        }
        if docs.is_empty() {
            return Ok(false);
        }
        let encode = |d: &Doc| self.tok.encode(&d.text);
        let ids: Vec<Vec<u32>> = match self.pool {
            Some(pool) => pool.install(|| docs.par_iter().map(encode).collect::<Result<_>>())?,
            None => docs.iter().map(encode).collect::<Result<_>>()?,
        };
        let eos = self.tok.eos_id();
        for (d, ids) in docs.iter().zip(ids) {
            let fraction = match self.spec.held_out {
                Some(h) if d.pos < h.until => h.fraction,
                _ => 0.0,
            };
            let (train, _) = split(ids, d.ends, fraction, eos);
            if !train.is_empty() {
                self.pending.push_back((d.pos, train));
            }
        }
        Ok(true)
    }

    /// The next block of `epoch`, numbered `index`; `None` when the epoch has no whole window
    /// left.
    fn block(&mut self, epoch: u64, index: u64) -> Result<Option<Block>> {
        let Some(start) = self.place()? else {
            return Ok(None);
        };
        let want = self.spec.block_windows * self.spec.seq_len;
        let mut tokens = Vec::with_capacity(want + 1);
        while tokens.len() < want && self.front()? {
            let (_, ids) = self.pending.front().expect("front() found a token");
            let n = (want - tokens.len()).min(ids.len() - self.skip);
            tokens.extend_from_slice(&ids[self.skip..self.skip + n]);
            self.skip += n;
        }
        // The last window's last target is the next block's first token.
        let next = self.place()?;
        if next.is_some() {
            let (_, ids) = self.pending.front().expect("place() found a token");
            tokens.push(ids[self.skip]);
        }
        let windows = tokens.len().saturating_sub(1) / self.spec.seq_len;
        if windows == 0 {
            return Ok(None);
        }
        Ok(Some(Block {
            epoch,
            index,
            start,
            tokens,
            windows,
            next,
        }))
    }
}

/// Streams blocks from (`epoch`, block `index` starting at `start`) on, epoch after epoch,
/// until the receiver is gone or an error (sent) stops it.
fn produce(
    spec: &StreamSpec,
    tok: &TextTokenizer,
    (mut epoch, mut index, mut start): (u64, u64, Option<StreamPlace>),
    tx: &SyncSender<Result<Block>>,
) -> Result<()> {
    let pool = match spec.threads > 1 {
        true => Some(
            rayon::ThreadPoolBuilder::new()
                .num_threads(spec.threads)
                .thread_name(|i| format!("anneal-tokenize-{i}"))
                .build()
                .map_err(|e| DataError::InvalidArgument {
                    name: "stream_threads",
                    message: e.to_string(),
                })?,
        ),
        false => None,
    };
    loop {
        let mut p = Producer {
            spec,
            tok,
            pool: pool.as_ref(),
            docs: Documents::new(&spec.files, &spec.text_field, file_order(spec, epoch)),
            pending: VecDeque::new(),
            skip: 0,
        };
        if let Some(s) = start.take() {
            p.docs.seek(s.doc)?;
            p.skip = usize::try_from(s.skip).unwrap_or(usize::MAX);
            // The place's document must still hold the tokens skipped.
            if !p.front()? || p.pending.front().map(|(d, _)| *d) != Some(s.doc) {
                return Err(bad_place(format!(
                    "no token {} in document {:?}",
                    s.skip, s.doc
                )));
            }
        }
        loop {
            match p.block(epoch, index)? {
                Some(b) => {
                    let last = b.next.is_none();
                    if tx.send(Ok(b)).is_err() {
                        return Ok(());
                    }
                    if last {
                        break;
                    }
                    index += 1;
                }
                None if index == 0 => {
                    return Err(DataError::StreamTooShort {
                        tokens: 0,
                        needed: spec.seq_len + 1,
                    })
                }
                None => break,
            }
        }
        epoch += 1;
        index = 0;
    }
}

/// Training windows of a text corpus tokenized in the background as they are wanted (see the
/// module docs): the streaming counterpart of [`crate::PackedLoader`].
pub struct StreamingLoader {
    spec: Arc<StreamSpec>,
    tok: Arc<TextTokenizer>,
    rx: Option<Receiver<Result<Block>>>,
    block: Option<Block>,
    order: Vec<u32>,
    taken: usize,
    /// Where the background thread starts when there is none: epoch, windows served in it,
    /// and the place of the block holding the next one.
    resume: (u64, u64, Option<StreamPlace>),
    waited: Duration,
}

impl StreamingLoader {
    /// A loader at the start of epoch 0; waits for the first block, so a corpus without one
    /// window (or a file that fails at once) is an error here.
    pub fn new(spec: StreamSpec, tok: TextTokenizer) -> Result<Self> {
        if spec.seq_len == 0 || spec.block_windows == 0 || spec.files.is_empty() {
            return Err(DataError::InvalidArgument {
                name: "stream",
                message: "needs files, a seq_len and block_windows of at least 1".into(),
            });
        }
        let mut l = StreamingLoader {
            spec: Arc::new(spec),
            tok: Arc::new(tok),
            rx: None,
            block: None,
            order: Vec::new(),
            taken: 0,
            resume: (0, 0, None),
            waited: Duration::ZERO,
        };
        l.fetch()?;
        Ok(l)
    }

    /// Rows `keep` of the next `batch` windows: the loader moves past all of them, copying
    /// only those (a data-parallel rank's share; every rank tokenizes the whole stream).
    pub fn next_rows(&mut self, batch: usize, keep: std::ops::Range<usize>) -> Result<Batch> {
        let seq = self.spec.seq_len;
        let mut out = Batch::with_capacity(keep.len(), seq);
        for row in 0..batch {
            let at = self.next_window()?;
            if keep.contains(&row) {
                let b = self.block.as_ref().expect("next_window() holds a block");
                out.push_window(&b.tokens[at..at + seq + 1]);
            }
        }
        Ok(out)
    }

    /// The next `batch` windows.
    pub fn next_batch(&mut self, batch: usize) -> Result<Batch> {
        self.next_rows(batch, 0..batch)
    }

    /// The offset in the current block of the next window's first token.
    fn next_window(&mut self) -> Result<usize> {
        loop {
            if let Some(b) = &self.block {
                if self.taken < b.windows {
                    self.taken += 1;
                    return Ok(self.order[self.taken - 1] as usize * self.spec.seq_len);
                }
            }
            self.fetch()?;
        }
    }

    /// Takes the next block from the background thread (starting one at `resume` if none
    /// runs), timing the wait.
    fn fetch(&mut self) -> Result<()> {
        let mut skip = 0;
        let restarted = self.rx.is_none();
        if restarted {
            let (epoch, cursor, start) = self.resume;
            let k = self.spec.block_windows as u64;
            skip = (cursor % k) as usize;
            let (tx, rx) = sync_channel(QUEUE_BLOCKS);
            let (spec, tok) = (self.spec.clone(), self.tok.clone());
            std::thread::Builder::new()
                .name("anneal-stream".into())
                .spawn(move || {
                    if let Err(e) = produce(&spec, &tok, (epoch, cursor / k, start), &tx) {
                        let _ = tx.send(Err(e));
                    }
                })
                .map_err(|e| DataError::io("stream thread", e))?;
            self.rx = Some(rx);
        }
        let waiting = Instant::now();
        let got = self.rx.as_ref().expect("started above").recv();
        // The first block after a (re)start is the start-up's, not a wait in training.
        if !restarted {
            self.waited += waiting.elapsed();
        }
        let block = match got {
            Ok(Ok(b)) => b,
            Ok(Err(e)) => {
                self.rx = None;
                return Err(e);
            }
            Err(_) => {
                self.rx = None;
                return Err(DataError::InvalidArgument {
                    name: "stream",
                    message: "the tokenizing thread stopped".into(),
                });
            }
        };
        if skip > block.windows {
            self.rx = None;
            return Err(bad_place(format!(
                "window {skip} of a block of {}",
                block.windows
            )));
        }
        self.order = window_order(&self.spec, block.epoch, block.index, block.windows);
        self.taken = skip;
        self.block = Some(block);
        Ok(())
    }

    /// Where the loader stands now.
    pub fn state(&self) -> LoaderState {
        let k = self.spec.block_windows as u64;
        let (epoch, cursor, stream) = match &self.block {
            Some(b) if self.taken < b.windows => {
                (b.epoch, b.index * k + self.taken as u64, Some(b.start))
            }
            Some(b) => match b.next {
                Some(next) => (b.epoch, (b.index + 1) * k, Some(next)),
                None => (b.epoch + 1, 0, None),
            },
            None => self.resume,
        };
        LoaderState {
            epoch,
            cursor,
            mixture: None,
            stream,
        }
    }

    /// Moves the loader to `s`, as taken by [`StreamingLoader::state`] of a loader over the
    /// same corpus, tokenizer and settings; the background thread restarts there.
    pub fn restore(&mut self, s: &LoaderState) -> Result<()> {
        if let Some(p) = &s.stream {
            if p.block_windows != self.spec.block_windows as u64 {
                return Err(bad_place(format!(
                    "blocks of {} windows, not {}",
                    p.block_windows, self.spec.block_windows
                )));
            }
        }
        self.rx = None;
        self.block = None;
        self.resume = (s.epoch, s.cursor, s.stream);
        self.fetch()
    }

    /// Time spent waiting on tokenization since the loader was made, the first block's
    /// start-up aside: next to zero when the background threads keep ahead of the trainer.
    pub fn waited(&self) -> Duration {
        self.waited
    }
}

/// The held-out stream of a streamed corpus: the first documents in file order give the tail
/// `fraction` of their tokens (each tail followed by EOS) until it holds `need` tokens. Returns
/// it with the place of the first document that trains whole.
pub fn held_out(
    files: &[PathBuf],
    text_field: &str,
    tok: &TextTokenizer,
    fraction: f64,
    need: usize,
) -> Result<(Vec<u32>, HeldOut)> {
    let mut docs = Documents::new(files, text_field, (0..files.len() as u32).collect());
    let mut val = Vec::new();
    let until = loop {
        let Some(d) = docs.next()? else {
            break DocPos {
                file: u32::MAX,
                offset: 0,
            };
        };
        if val.len() >= need {
            break d.pos;
        }
        let (_, tail) = split(tok.encode(&d.text)?, d.ends, fraction, tok.eos_id());
        val.extend(tail);
    };
    Ok((val, HeldOut { until, fraction }))
}

/// The first documents of `files` in file order, about `max_bytes` of text: what a tokenizer
/// trained for a streamed corpus learns from.
pub fn sample_documents(
    files: &[PathBuf],
    text_field: &str,
    max_bytes: usize,
) -> Result<Vec<String>> {
    let mut docs = Documents::new(files, text_field, (0..files.len() as u32).collect());
    let (mut out, mut bytes) = (Vec::new(), 0);
    while bytes < max_bytes {
        let Some(d) = docs.next()? else { break };
        bytes += d.text.len();
        out.push(d.text);
    }
    if out.is_empty() {
        return Err(DataError::Empty {
            path: files.first().cloned().unwrap_or_default(),
            what: "no non-empty documents in the corpus".into(),
        });
    }
    Ok(out)
}

/// Identifies a streamed corpus as trained on, without reading it whole: the tokenizer, the
/// text field, the held-out split, and each file's name, size and first and last 64 KiB.
pub fn fingerprint(spec: &StreamSpec, tok: &TextTokenizer) -> Result<String> {
    let mut key = CacheKey::new("anneal-data text stream v1");
    key.bytes(tok.to_json()?.as_bytes())
        .bytes(spec.text_field.as_bytes());
    if let Some(h) = spec.held_out {
        key.u64(h.until.file.into())
            .u64(h.until.offset)
            .u64(h.fraction.to_bits());
    }
    for f in &spec.files {
        let name = f.file_name().unwrap_or_default().to_string_lossy();
        let file = File::open(f).map_err(|e| DataError::io(f, e))?;
        let len = file.metadata().map_err(|e| DataError::io(f, e))?.len();
        key.bytes(name.as_bytes()).u64(len);
        for edge in crate::cache::edges(&file, 0, len).map_err(|e| DataError::io(f, e))? {
            key.bytes(&edge);
        }
    }
    Ok(key.hex())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_split_document_keeps_its_head_and_ends_both_parts() {
        assert_eq!(
            split(vec![1, 2, 3, 4], true, 0.5, 9),
            (vec![1, 2, 9], vec![3, 4, 9])
        );
        assert_eq!(split(vec![1, 2, 3], false, 0.0, 9), (vec![1, 2, 3], vec![]));
        assert_eq!(
            split(vec![1, 2, 3], true, 0.0, 9),
            (vec![1, 2, 3, 9], vec![])
        );
        // A piece that lost its tail ends with EOS although its file goes on.
        assert_eq!(
            split(vec![1, 2, 3, 4], false, 0.25, 9),
            (vec![1, 2, 3, 9], vec![4, 9])
        );
    }
}

//! Packs a token stream into fixed-length windows and serves them in a seeded, resumable order.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::tokens::TokenRange;
use crate::{DataError, Result};

/// Where a [`PackedLoader`] stands: the epoch, and how many windows of it were served. Saved in
/// checkpoints; [`PackedLoader::restore`] continues exactly where it was taken.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderState {
    /// Completed epochs.
    pub epoch: u64,
    /// Windows already served in this epoch, always below the windows per epoch.
    pub cursor: u64,
    /// A mixture of sources: each source's state and the rows drawn (`epoch` and `cursor` are
    /// then unused). Absent from the saved state of a single source.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mixture: Option<Box<crate::mixture::MixtureState>>,
    /// A streamed corpus: where the block holding window `cursor` starts. Absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<crate::stream::StreamPlace>,
}

/// A batch of rows, row-major `[batch, seq_len]`: row `r` of `targets` is row `r` of `inputs`
/// shifted left by one token (the next token at every position), or
/// [`IGNORE_INDEX`](crate::loader::IGNORE_INDEX) where no loss is taken (chat data outside the
/// assistant's replies, padding).
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// Input ids, `batch * seq_len` of them.
    pub inputs: Vec<i64>,
    /// Target ids, `batch * seq_len` of them.
    pub targets: Vec<i64>,
    /// Rows.
    pub batch: usize,
    /// Tokens per row.
    pub seq_len: usize,
    /// The rows' images, row after row, each in placeholder order (empty for text).
    pub images: Vec<crate::image::ProcessedImage>,
    /// How many of `images` each row holds (empty when no row has any).
    pub row_images: Vec<usize>,
    /// Each token's position in its document, `batch * seq_len` of them, when rows pack several
    /// documents (positions restart at 0 where a document starts, and attention stays within
    /// each run of consecutive positions); empty when every row is one sequence at `0..seq_len`.
    pub positions: Vec<i64>,
}

/// The target of a position that takes no loss (PyTorch's `ignore_index` default).
pub const IGNORE_INDEX: i64 = -100;

impl Batch {
    pub(crate) fn with_capacity(rows: usize, seq_len: usize) -> Self {
        Batch {
            inputs: Vec::with_capacity(rows * seq_len),
            targets: Vec::with_capacity(rows * seq_len),
            batch: 0,
            seq_len,
            images: Vec::new(),
            row_images: Vec::new(),
            positions: Vec::new(),
        }
    }

    /// Appends the window `w` (`seq_len + 1` tokens) as one row.
    pub(crate) fn push_window(&mut self, w: &[u32]) {
        debug_assert_eq!(w.len(), self.seq_len + 1);
        self.inputs
            .extend(w[..self.seq_len].iter().map(|&t| i64::from(t)));
        self.targets.extend(w[1..].iter().map(|&t| i64::from(t)));
        self.batch += 1;
    }

    /// Rows `from..to` of this batch, with their images.
    pub fn rows(&self, from: usize, to: usize) -> Batch {
        let (a, b) = (from * self.seq_len, to * self.seq_len);
        let (images, row_images) = if self.row_images.is_empty() {
            (Vec::new(), Vec::new())
        } else {
            let first: usize = self.row_images[..from].iter().sum();
            let n: usize = self.row_images[from..to].iter().sum();
            (
                self.images[first..first + n].to_vec(),
                self.row_images[from..to].to_vec(),
            )
        };
        Batch {
            inputs: self.inputs[a..b].to_vec(),
            targets: self.targets[a..b].to_vec(),
            batch: to - from,
            seq_len: self.seq_len,
            images,
            row_images,
            positions: match self.positions.is_empty() {
                true => Vec::new(),
                false => self.positions[a..b].to_vec(),
            },
        }
    }

    /// Target positions that take a loss.
    pub fn trained_tokens(&self) -> usize {
        self.targets.iter().filter(|&&t| t != IGNORE_INDEX).count()
    }
}

/// A seeded, resumable visiting order over `items` things (windows, conversations): each
/// epoch visits each exactly once, in the order of a Fisher–Yates permutation drawn from a
/// splitmix64 generator seeded by `(seed, epoch)` (or in order without `shuffle`).
#[derive(Clone, Debug)]
pub(crate) struct EpochOrder {
    items: usize,
    seed: u64,
    shuffle: bool,
    epoch: u64,
    cursor: u64,
    /// The order of `epoch`.
    order: Vec<u32>,
}

impl EpochOrder {
    /// The order at epoch 0, cursor 0; `items` must be at least 1 and fit a u32.
    pub(crate) fn new(items: usize, seed: u64, shuffle: bool, what: &'static str) -> Result<Self> {
        if u32::try_from(items).is_err() {
            return Err(DataError::InvalidArgument {
                name: what,
                message: format!("{items} per epoch is more than a u32 can index"),
            });
        }
        let mut o = EpochOrder {
            items,
            seed,
            shuffle,
            epoch: 0,
            cursor: 0,
            order: Vec::new(),
        };
        o.order = o.epoch_order(0);
        Ok(o)
    }

    /// The item [`EpochOrder::next`] will return, without taking it.
    pub(crate) fn peek(&self) -> usize {
        self.order[self.cursor as usize] as usize
    }

    /// The next item; when the epoch runs out the next one's order starts.
    pub(crate) fn next(&mut self) -> usize {
        let item = self.order[self.cursor as usize] as usize;
        self.cursor += 1;
        if self.cursor as usize == self.items {
            self.epoch += 1;
            self.cursor = 0;
            self.order = self.epoch_order(self.epoch);
        }
        item
    }

    pub(crate) fn state(&self) -> LoaderState {
        LoaderState {
            epoch: self.epoch,
            cursor: self.cursor,
            mixture: None,
            stream: None,
        }
    }

    pub(crate) fn restore(&mut self, s: &LoaderState) -> Result<()> {
        if s.cursor >= self.items as u64 {
            return Err(DataError::BadLoaderState {
                cursor: s.cursor,
                windows: self.items,
            });
        }
        if s.epoch != self.epoch {
            self.order = self.epoch_order(s.epoch);
        }
        self.epoch = s.epoch;
        self.cursor = s.cursor;
        Ok(())
    }

    fn epoch_order(&self, epoch: u64) -> Vec<u32> {
        match self.shuffle {
            true => permutation(self.items, self.seed ^ mix(epoch)),
            false => (0..self.items as u32).collect(),
        }
    }
}

/// A Fisher–Yates permutation of `0..n` drawn from a splitmix64 generator seeded by `seed`.
pub(crate) fn permutation(n: usize, seed: u64) -> Vec<u32> {
    let mut order: Vec<u32> = (0..n as u32).collect();
    let mut rng = SplitMix64::new(seed);
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    order
}

/// `v` scrambled (splitmix64's first output from `v`), to combine with a seed.
pub(crate) fn mix(v: u64) -> u64 {
    SplitMix64::new(v).next_u64()
}

/// Training windows over a token stream whose documents are already separated by EOS.
///
/// Window `i` is the stream slice `[i * seq_len, i * seq_len + seq_len + 1)`: consecutive windows
/// share one token, so every token of the stream but the last partial window's is a target
/// exactly once per epoch. Each epoch visits every window exactly once, in the order of a
/// Fisher–Yates permutation drawn from a splitmix64 generator seeded by `(seed, epoch)` (or in
/// stream order without `shuffle`); the order depends on nothing else.
#[derive(Clone, Debug)]
pub struct PackedLoader {
    tokens: TokenStream,
    seq_len: usize,
    windows: usize,
    order: EpochOrder,
}

impl PackedLoader {
    /// A loader at epoch 0, cursor 0. Errors when `seq_len` is 0 or the stream is shorter than
    /// one window (`seq_len + 1` tokens).
    pub fn new(
        tokens: impl Into<TokenStream>,
        seq_len: usize,
        seed: u64,
        shuffle: bool,
    ) -> Result<Self> {
        let tokens = tokens.into();
        if seq_len == 0 {
            return Err(DataError::InvalidArgument {
                name: "seq_len",
                message: "must be at least 1".into(),
            });
        }
        let windows = window_count(tokens.len(), seq_len);
        if windows == 0 {
            return Err(DataError::StreamTooShort {
                tokens: tokens.len(),
                needed: seq_len + 1,
            });
        }
        Ok(PackedLoader {
            tokens,
            seq_len,
            windows,
            order: EpochOrder::new(windows, seed, shuffle, "seq_len")?,
        })
    }

    /// The next `batch` windows; when an epoch runs out mid-batch the rest comes from the next
    /// epoch's order. Fails only when token files cannot be read (or hold an id outside the
    /// vocabulary).
    pub fn next_batch(&mut self, batch: usize) -> Result<Batch> {
        self.next_rows(batch, 0..batch)
    }

    /// Rows `keep` of the next `batch` windows: the loader moves past all of them but reads
    /// only those (a data-parallel rank's share).
    pub fn next_rows(&mut self, batch: usize, keep: std::ops::Range<usize>) -> Result<Batch> {
        let mut out = Batch::with_capacity(keep.len(), self.seq_len);
        let mut window = Vec::with_capacity(self.seq_len + 1);
        for row in 0..batch {
            let start = self.order.next() * self.seq_len;
            if keep.contains(&row) {
                window.clear();
                self.tokens.read(start, self.seq_len + 1, &mut window)?;
                out.push_window(&window);
            }
        }
        Ok(out)
    }

    /// Where the loader stands now.
    pub fn state(&self) -> LoaderState {
        self.order.state()
    }

    /// Moves the loader to `s`, as taken by [`PackedLoader::state`] of a loader over the same
    /// tokens, `seq_len`, seed and `shuffle`. Errors when the cursor is not below
    /// [`PackedLoader::windows_per_epoch`].
    pub fn restore(&mut self, s: &LoaderState) -> Result<()> {
        self.order.restore(s)
    }

    /// Tokens per window's inputs.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// Windows in one epoch: `(tokens - 1) / seq_len`.
    pub fn windows_per_epoch(&self) -> usize {
        self.windows
    }

    /// All windows of `tokens` in stream order, `batch` rows at a time (the last batch may have
    /// fewer rows), at most `max_batches` batches; for validation. Empty when the stream is
    /// shorter than one window or `seq_len` or `batch` is 0.
    pub fn eval_batches(
        tokens: &[u32],
        seq_len: usize,
        batch: usize,
        max_batches: usize,
    ) -> Vec<Batch> {
        if seq_len == 0 || batch == 0 {
            return Vec::new();
        }
        let windows = window_count(tokens.len(), seq_len);
        (0..windows)
            .collect::<Vec<_>>()
            .chunks(batch)
            .take(max_batches)
            .map(|rows| {
                let mut b = Batch::with_capacity(rows.len(), seq_len);
                for &w in rows {
                    b.push_window(&tokens[w * seq_len..w * seq_len + seq_len + 1]);
                }
                b
            })
            .collect()
    }
}

/// The ids a [`PackedLoader`] cuts windows from.
#[derive(Clone, Debug)]
pub enum TokenStream {
    /// Ids in memory (a corpus tokenized at start).
    Memory(Arc<[u32]>),
    /// Ids read from token files as windows are wanted.
    Files(TokenRange),
}

impl TokenStream {
    fn len(&self) -> usize {
        match self {
            TokenStream::Memory(t) => t.len(),
            TokenStream::Files(r) => usize::try_from(r.len()).unwrap_or(usize::MAX),
        }
    }

    /// Appends the `n` ids from `at` to `out`.
    fn read(&self, at: usize, n: usize, out: &mut Vec<u32>) -> Result<()> {
        match self {
            TokenStream::Memory(t) => {
                out.extend_from_slice(&t[at..at + n]);
                Ok(())
            }
            TokenStream::Files(r) => r.read(at as u64, n, out),
        }
    }
}

impl From<Arc<[u32]>> for TokenStream {
    fn from(t: Arc<[u32]>) -> Self {
        TokenStream::Memory(t)
    }
}

impl From<Vec<u32>> for TokenStream {
    fn from(t: Vec<u32>) -> Self {
        TokenStream::Memory(t.into())
    }
}

impl From<TokenRange> for TokenStream {
    fn from(r: TokenRange) -> Self {
        TokenStream::Files(r)
    }
}

fn window_count(tokens: usize, seq_len: usize) -> usize {
    tokens.saturating_sub(1) / seq_len
}

/// splitmix64 (Steele, Lea & Flood 2014): tiny, fast, and the same sequence on every platform and
/// Rust version, which std's hashers do not promise.
struct SplitMix64(u64);

impl SplitMix64 {
    fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `[0, n)` by multiply-shift (bias below 2^-32 for any `n` used here).
    fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix64_matches_the_reference_sequence() {
        // First outputs for seed 1234567 from the reference C implementation.
        let mut r = SplitMix64::new(1234567);
        assert_eq!(r.next_u64(), 6457827717110365317);
        assert_eq!(r.next_u64(), 3203168211198807973);
        assert_eq!(r.next_u64(), 9817491932198370423);
    }

    #[test]
    fn below_stays_in_range() {
        let mut r = SplitMix64::new(7);
        for n in 1..200 {
            assert!(r.below(n) < n);
        }
    }

    #[test]
    fn window_count_leaves_room_for_the_last_target() {
        assert_eq!(window_count(0, 4), 0);
        assert_eq!(window_count(4, 4), 0);
        assert_eq!(window_count(5, 4), 1);
        assert_eq!(window_count(9, 4), 2);
        assert_eq!(window_count(12, 4), 2);
    }
}

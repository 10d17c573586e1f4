//! Training data for Anneal: local text corpora, byte-level BPE tokenizers, a tokenized
//! train/validation split with an on-disk cache, and a deterministic, resumable loader that packs
//! the token stream into fixed-length windows.
//!
//! The path of the data in one training run:
//! [`discover_files`] → [`TextTokenizer::load_or_train`] → [`TokenDataset::build`] →
//! [`PackedLoader::new`] on `train` → [`PackedLoader::next_batch`] each step, and
//! [`PackedLoader::eval_batches`] on `val`.
//!
//! Pre-tokenized corpora (nanoGPT / llm.c `.bin`, Megatron `.bin` + `.idx`) are read in
//! place by [`tokens::TokenFiles`] and served by the same [`PackedLoader`].
//!
//! Chat data (conversations with the loss on the assistant's replies, and their images) takes
//! [`chat::read_conversations`] → [`chat::encode::ChatEncoder`] → [`ChatLoader`].
//! Images for vision-language models are read and preprocessed by [`image`], audio clips for
//! audio-language models (WAV files) by [`audio`].

pub mod audio;
mod cache;
pub mod chat;
pub mod corpus;
pub mod dataset;
pub mod image;
pub mod loader;
pub mod mixture;
pub mod preference;
pub mod records;
pub mod stream;
pub mod tokenizer;
pub mod tokens;

use std::path::PathBuf;

pub use cache::hex;
pub use chat::loader::ChatLoader;
pub use corpus::{check_files, discover_files, read_documents};
pub use dataset::TokenDataset;
pub use loader::IGNORE_INDEX;
pub use loader::{Batch, LoaderState, PackedLoader, TokenStream};
pub use mixture::{MixtureLoader, MixtureState};
pub use preference::PairLoader;
pub use stream::{StreamSpec, StreamingLoader};
pub use tokenizer::{DecodeStream, TextTokenizer};

/// Everything that can go wrong while reading, tokenizing or loading training data. Each message
/// is one line naming the file (and line or key) involved.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A file or folder could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A file has an extension this crate does not read.
    #[error("{}: unsupported file type (expected .txt, .md, .jsonl, .parquet or .arrow)", path.display())]
    UnsupportedFile {
        /// The file.
        path: PathBuf,
    },
    /// A path or folder yielded no usable files or documents.
    #[error("{}: {what}", path.display())]
    Empty {
        /// The path given.
        path: PathBuf,
        /// What was missing.
        what: String,
    },
    /// A JSONL line is not a JSON object, or its text field is missing or not a string.
    #[error("{}:{line}: {message}", path.display())]
    BadJsonLine {
        /// The JSONL file.
        path: PathBuf,
        /// The 1-based line number.
        line: usize,
        /// What is wrong with the line.
        message: String,
    },
    /// The `tokenizers` library failed on a tokenizer file, while training or while encoding.
    #[error("tokenizer {context}: {message}")]
    Tokenizer {
        /// Which tokenizer or operation (usually the file).
        context: String,
        /// The library's message.
        message: String,
    },
    /// A tokenizer has none of the known end-of-text tokens.
    #[error("{}: no end-of-text token (looked for {tried})", path.display())]
    NoEos {
        /// The tokenizer file.
        path: PathBuf,
        /// The tokens looked for.
        tried: String,
    },
    /// An argument is out of range (vocabulary size, validation fraction, sequence length).
    #[error("invalid {name}: {message}")]
    InvalidArgument {
        /// The argument's name.
        name: &'static str,
        /// Why the value is rejected.
        message: String,
    },
    /// The token stream is too short to make a single training window.
    #[error(
        "token stream of {tokens} tokens is shorter than one window of seq_len + 1 = {needed}"
    )]
    StreamTooShort {
        /// Tokens in the stream.
        tokens: usize,
        /// Tokens one window needs.
        needed: usize,
    },
    /// A conversation of chat data cannot be used (`origin` is `file:line`).
    #[error("{origin}: {message}")]
    Chat {
        /// Where the conversation is.
        origin: String,
        /// What is wrong.
        message: String,
    },
    /// An image could not be read or processed.
    #[error(transparent)]
    Image(#[from] image::ImageError),
    /// A Parquet or Arrow file (or a saved dataset's metadata) cannot be read.
    #[error("{}: {message}", path.display())]
    BadRecordFile {
        /// The file.
        path: PathBuf,
        /// What is wrong (the reader's message).
        message: String,
    },
    /// A token file is not in a layout this crate reads, or contradicts its own header.
    #[error("{}: {message}", path.display())]
    BadTokenFile {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A token file holds an id outside the tokenizer's vocabulary (negative ids show as -1).
    #[error("{}: id {id} at index {index} is outside the tokenizer's {vocab} tokens (another tokenizer made these files?)", path.display())]
    BadToken {
        /// The file.
        path: PathBuf,
        /// The id's index in the file.
        index: u64,
        /// The id.
        id: i64,
        /// The tokenizer's vocabulary size.
        vocab: u64,
    },
    /// A saved loader state does not fit this loader.
    #[error("loader state cursor {cursor} is out of range: an epoch has {windows} windows")]
    BadLoaderState {
        /// The cursor in the saved state.
        cursor: u64,
        /// Windows per epoch of this loader.
        windows: usize,
    },
}

/// The result type of this crate.
pub type Result<T> = std::result::Result<T, DataError>;

impl DataError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        DataError::Io {
            path: path.into(),
            source,
        }
    }
}

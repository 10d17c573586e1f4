//! The trainer's data: text documents packed into windows, or chat conversations one per row,
//! the loss on the assistant's replies, with a vision model's images. Built once at start;
//! served a batch at a time.

use crate::TrainError;
use anneal_config::JobConfig;
use anneal_data::{Batch, ChatLoader, LoaderState, PackedLoader, TextTokenizer, TokenDataset};
use anneal_plugin_api::spec::ModelSpec;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// Where the training batches come from.
pub(crate) enum Loader {
    /// Windows of the packed token stream.
    Packed(PackedLoader),
    /// Conversations, one per row.
    Chat(ChatLoader),
    /// Windows of several sources at their weights.
    Mixture(anneal_data::MixtureLoader),
    /// Windows of a text corpus tokenized in the background as training goes.
    Stream(anneal_data::StreamingLoader),
    /// Preference pairs, two rows each.
    Pairs(anneal_data::PairLoader),
}

impl Loader {
    /// The rows `keep` of the next `rows` rows (the others are passed over, unread where the
    /// loader reads from files).
    pub(crate) fn next_rows(
        &mut self,
        rows: usize,
        keep: std::ops::Range<usize>,
    ) -> Result<Batch, TrainError> {
        match self {
            Loader::Packed(l) => Ok(l.next_rows(rows, keep)?),
            // Conversations are in memory; packing needs every row's lengths anyway.
            Loader::Chat(l) => Ok(kept(l.next_batch(rows)?, rows, keep)),
            Loader::Mixture(l) => Ok(l.next_rows(rows, keep)?),
            Loader::Stream(l) => Ok(l.next_rows(rows, keep)?),
            // Whole pairs: a rank keeps whole micro-batches or an even share of their rows.
            Loader::Pairs(l) => Ok(kept(l.next_batch(rows)?, rows, keep)),
        }
    }

    /// Where it stands (saved in checkpoints).
    pub(crate) fn state(&self) -> LoaderState {
        match self {
            Loader::Packed(l) => l.state(),
            Loader::Chat(l) => l.state(),
            Loader::Stream(l) => l.state(),
            Loader::Pairs(l) => l.state(),
            Loader::Mixture(l) => {
                let state = l.state();
                LoaderState {
                    epoch: 0,
                    cursor: state.drawn,
                    mixture: Some(Box::new(state)),
                    stream: None,
                }
            }
        }
    }

    /// Continues from a saved state.
    pub(crate) fn restore(&mut self, s: &LoaderState) -> Result<(), TrainError> {
        match self {
            Loader::Packed(l) => l.restore(s)?,
            Loader::Chat(l) => l.restore(s)?,
            Loader::Stream(l) => l.restore(s)?,
            Loader::Pairs(l) => l.restore(s)?,
            Loader::Mixture(l) => {
                match &s.mixture {
                    Some(m) => l.restore(m)?,
                    None => return Err(TrainError::Config(
                        "config: `data.sources`: the checkpoint was taken without a mixture of \
                         sources"
                            .into(),
                    )),
                }
            }
        }
        Ok(())
    }
}

/// Rows `keep` of `b`, a batch of `rows` rows read whole (not cut when it keeps them all).
fn kept(b: Batch, rows: usize, keep: std::ops::Range<usize>) -> Batch {
    match keep == (0..rows) {
        true => b,
        false => b.rows(keep.start, keep.end),
    }
}

/// What a chat run records beside its `tokenizer.json`, so an export renders chats and reads
/// images as the run did: `tokenizer_config.json` (the chat template and end-of-turn token)
/// and, for a vision model, `preprocessor_config.json`.
#[derive(Clone, Debug, Default)]
pub struct RunFiles {
    /// File name → contents.
    pub files: Vec<(String, String)>,
}

/// Everything the trainer reads data through.
pub(super) struct TrainData {
    pub tokenizer: TextTokenizer,
    pub tokenizer_path: PathBuf,
    pub loader: Loader,
    pub val_batches: Vec<Batch>,
    /// Hex SHA-256 of the training data as trained on (checkpoints refuse other data).
    pub data_sha256: String,
    pub run_files: RunFiles,
    /// Whether held-out batches are conversations, whose replies give an accuracy.
    pub chat: bool,
}

/// Builds the data of `cfg` from `files` for a model of `spec`; `note` gets progress lines.
pub(super) fn build(
    cfg: &JobConfig,
    files: &[PathBuf],
    spec: &ModelSpec,
    note: &dyn Fn(&str),
) -> Result<TrainData, TrainError> {
    use crate::preflight::DataKind;
    if !cfg.data.sources.is_empty() {
        return build_mixture(cfg, files, note);
    }
    match crate::preflight::data_kind(cfg, files) {
        DataKind::Chat | DataKind::Preference => {
            super::chat_data::build_chat(cfg, files, spec, note)
        }
        DataKind::Text => build_text(cfg, files, note),
        DataKind::Tokens => build_tokens(cfg, note),
    }
}

/// Token files read in place: training windows from the training files, held-out windows from
/// the `val` files, or when there are none from the tail `data.val_fraction` of the stream.
fn build_tokens(cfg: &JobConfig, note: &dyn Fn(&str)) -> Result<TrainData, TrainError> {
    let tokenizer_path = PathBuf::from(&cfg.data.tokenizer);
    let tokenizer = TextTokenizer::from_file(&tokenizer_path)?;
    let (train, val) = token_source(cfg, &tokenizer, note)?;
    note(&format!(
        "data: tokenizer {} (vocab {})",
        tokenizer_path.display(),
        tokenizer.vocab_size()
    ));
    let data_sha256 = train.fingerprint()?;
    windows(cfg, (tokenizer, tokenizer_path), train, &val, data_sha256)
}

/// The token files of `data.path`: the training range, and the held-out ids evaluation reads
/// (read once).
fn token_source(
    cfg: &JobConfig,
    tokenizer: &TextTokenizer,
    note: &dyn Fn(&str),
) -> Result<(anneal_data::tokens::TokenRange, Vec<u32>), TrainError> {
    use anneal_data::tokens::{discover_token_files, TokenFiles, TokenRange};
    let (d, t) = (&cfg.data, &cfg.training);
    let (train_files, val_files) = discover_token_files(Path::new(&d.path))?;
    let raw = crate::preflight::raw_width(d.token_dtype);
    let open = |files: &[PathBuf]| -> Result<Arc<TokenFiles>, TrainError> {
        Ok(Arc::new(TokenFiles::open(
            files,
            raw,
            tokenizer.vocab_size(),
        )?))
    };
    let files = open(&train_files)?;
    let what = files.describe();
    let (train, val) = match val_files.is_empty() {
        true => TokenRange::all(files).split_tail(d.val_fraction),
        false => (TokenRange::all(files), TokenRange::all(open(&val_files)?)),
    };
    note(&format!(
        "data: {what} under {} read in place, {} train / {} held-out ids",
        d.path,
        train.len(),
        val.len()
    ));
    let wanted = (cfg.metrics.eval_batches * t.micro_batch_size * t.seq_len + 1) as u64;
    Ok((train, val.head(wanted)?))
}

/// A mixture of text and token sources (`[[data.sources]]`): one tokenizer (a file, or trained
/// on every text source), each source its own loader (seeded apart), rows drawn at the
/// sources' weights; held-out batches from every source in turn.
fn build_mixture(
    cfg: &JobConfig,
    text_files: &[PathBuf],
    note: &dyn Fn(&str),
) -> Result<TrainData, TrainError> {
    use crate::preflight::{data_kind, source_config, DataKind};
    use anneal_data::MixtureLoader;
    use sha2::{Digest, Sha256};
    let (d, t) = (&cfg.data, &cfg.training);
    let cache_dir = PathBuf::from(&d.cache_dir);
    let (tokenizer, tokenizer_path) = TextTokenizer::load_or_train(
        &d.tokenizer,
        text_files,
        &d.text_field,
        d.vocab_size,
        &cache_dir,
    )?;
    let n = d.sources.len();
    let mut loaders = Vec::with_capacity(n);
    let mut val_batches = Vec::new();
    let mut digest = Sha256::new();
    for (i, source) in d.sources.iter().enumerate() {
        let one = source_config(cfg, i);
        let seed = t.seed.wrapping_add(i as u64);
        let files = crate::preflight::data(&one)?;
        let (loader, val, sha) = match data_kind(&one, &files) {
            DataKind::Tokens => {
                let (train, val) = token_source(&one, &tokenizer, note)?;
                let sha = train.fingerprint()?;
                (
                    PackedLoader::new(train, t.seq_len, seed, d.shuffle)?,
                    val,
                    sha,
                )
            }
            _ => {
                let ds = TokenDataset::build(
                    &files,
                    &d.text_field,
                    &tokenizer,
                    d.val_fraction,
                    &cache_dir,
                )?;
                let sha = ds.train_sha256();
                note(&format!(
                    "data: source {i} ({}): {} train / {} held-out tokens",
                    source.path,
                    ds.train.len(),
                    ds.val.len()
                ));
                (
                    PackedLoader::new(ds.train, t.seq_len, seed, d.shuffle)?,
                    ds.val,
                    sha,
                )
            }
        };
        digest.update(sha.as_bytes());
        digest.update(source.weight.to_le_bytes());
        loaders.push(loader);
        if cfg.metrics.eval_freq > 0 && val.len() > t.seq_len {
            let per = cfg.metrics.eval_batches.div_ceil(n).max(1);
            val_batches.extend(PackedLoader::eval_batches(
                &val,
                t.seq_len,
                t.micro_batch_size,
                per,
            ));
        }
    }
    let weights: Vec<f64> = d.sources.iter().map(|s| s.weight).collect();
    let loader = MixtureLoader::new(loaders, &weights)
        .map_err(|e| TrainError::from(e).at("data.sources"))?;
    note(&format!(
        "data: a mixture of {n} sources at weights {weights:?}, tokenizer {} (vocab {})",
        tokenizer_path.display(),
        tokenizer.vocab_size()
    ));
    Ok(TrainData {
        tokenizer,
        tokenizer_path,
        loader: Loader::Mixture(loader),
        val_batches,
        data_sha256: anneal_data::hex(&digest.finalize()),
        run_files: RunFiles {
            files: beside_tokenizer(d, &["tokenizer_config.json", GENERATION_CONFIG]),
        },
        chat: false,
    })
}

/// A run on windows of a token stream (`train`), evaluated on windows of `val`.
fn windows(
    cfg: &JobConfig,
    tokenizer: (TextTokenizer, PathBuf),
    train: impl Into<anneal_data::TokenStream>,
    val: &[u32],
    data_sha256: String,
) -> Result<TrainData, TrainError> {
    let (d, t) = (&cfg.data, &cfg.training);
    let loader = PackedLoader::new(train, t.seq_len, t.seed, d.shuffle)?;
    Ok(text_run(
        cfg,
        tokenizer,
        Loader::Packed(loader),
        val,
        data_sha256,
    ))
}

/// A run on windows of text served by `loader`, evaluated on windows of `val`.
fn text_run(
    cfg: &JobConfig,
    (tokenizer, tokenizer_path): (TextTokenizer, PathBuf),
    loader: Loader,
    val: &[u32],
    data_sha256: String,
) -> TrainData {
    let t = &cfg.training;
    let val_batches = match cfg.metrics.eval_freq > 0 && val.len() > t.seq_len {
        true => {
            PackedLoader::eval_batches(val, t.seq_len, t.micro_batch_size, cfg.metrics.eval_batches)
        }
        false => Vec::new(),
    };
    TrainData {
        tokenizer,
        tokenizer_path,
        loader,
        val_batches,
        data_sha256,
        // A text run renders no chats, but its export should, as the tokenizer's folder does.
        run_files: RunFiles {
            files: beside_tokenizer(&cfg.data, &["tokenizer_config.json", GENERATION_CONFIG]),
        },
        chat: false,
    }
}

/// The bytes of `files` (those that can be read).
fn corpus_bytes(files: &[PathBuf]) -> u64 {
    files
        .iter()
        .filter_map(|f| std::fs::metadata(f).ok())
        .map(|m| m.len())
        .sum()
}

/// A text corpus above this many bytes gets a note pointing to `data.streaming`.
const LARGE_CORPUS: u64 = 2_000_000_000;

/// Windows per block of a streamed corpus: the span its windows are shuffled over.
const STREAM_BLOCK_WINDOWS: usize = 1024;
/// Text a tokenizer trained for a streamed corpus learns from (its first documents).
const STREAM_TOKENIZER_SAMPLE: usize = 64 << 20;

/// Text streamed ([`anneal_data::stream`]): read and tokenized in background threads as
/// training goes, with constant memory.
fn build_stream(
    cfg: &JobConfig,
    files: &[PathBuf],
    note: &dyn Fn(&str),
) -> Result<TrainData, TrainError> {
    use anneal_data::stream::{fingerprint, held_out, sample_documents, StreamSpec};
    let (d, t, m) = (&cfg.data, &cfg.training, &cfg.metrics);
    let started = Instant::now();
    let sample = match d.tokenizer.as_str() {
        "train" => sample_documents(files, &d.text_field, STREAM_TOKENIZER_SAMPLE)?,
        _ => Vec::new(),
    };
    let cache_dir = Path::new(&d.cache_dir);
    let (tokenizer, tokenizer_path) =
        TextTokenizer::load_or_train_texts(&d.tokenizer, &sample, d.vocab_size, cache_dir)?;
    drop(sample);
    // The held-out windows evaluation reads, from the first documents.
    let need = m.eval_batches * t.micro_batch_size * t.seq_len + 1;
    let (val, split) = match m.eval_freq > 0 && d.val_fraction > 0.0 {
        true => {
            let (val, split) = held_out(files, &d.text_field, &tokenizer, d.val_fraction, need)?;
            (val, Some(split))
        }
        false => (Vec::new(), None),
    };
    let threads = match d.stream_threads {
        0 => std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1)),
        n => n,
    };
    let spec = StreamSpec {
        files: files.to_vec(),
        text_field: d.text_field.clone(),
        seq_len: t.seq_len,
        seed: t.seed,
        shuffle: d.shuffle,
        block_windows: STREAM_BLOCK_WINDOWS,
        threads,
        held_out: split,
    };
    let data_sha256 = fingerprint(&spec, &tokenizer)?;
    let loader = anneal_data::StreamingLoader::new(spec, tokenizer.clone())?;
    let bytes = corpus_bytes(files);
    note(&format!(
        "data: streaming {} files ({:.1} MB) on {threads} tokenizer thread(s); tokenizer {} \
         (vocab {}), {} held-out tokens, first block ready in {:.1}s",
        files.len(),
        bytes as f64 / 1e6,
        tokenizer_path.display(),
        tokenizer.vocab_size(),
        val.len(),
        started.elapsed().as_secs_f64()
    ));
    Ok(text_run(
        cfg,
        (tokenizer, tokenizer_path),
        Loader::Stream(loader),
        &val,
        data_sha256,
    ))
}

fn build_text(
    cfg: &JobConfig,
    files: &[PathBuf],
    note: &dyn Fn(&str),
) -> Result<TrainData, TrainError> {
    let d = &cfg.data;
    if d.streaming {
        return build_stream(cfg, files, note);
    }
    let bytes = corpus_bytes(files);
    if bytes > LARGE_CORPUS {
        note(&format!(
            "data: the corpus is {:.1} GB, to be tokenized in memory; data.streaming = true \
             reads it with constant memory",
            bytes as f64 / 1e9
        ));
    }
    let cache_dir = PathBuf::from(&d.cache_dir);
    let started = Instant::now();
    let (tokenizer, tokenizer_path) =
        TextTokenizer::load_or_train(&d.tokenizer, files, &d.text_field, d.vocab_size, &cache_dir)?;
    let dataset =
        TokenDataset::build(files, &d.text_field, &tokenizer, d.val_fraction, &cache_dir)?;
    note(&format!(
        "data: tokenizer {} (vocab {}), {} train / {} held-out tokens ({:.1}s)",
        tokenizer_path.display(),
        tokenizer.vocab_size(),
        dataset.train.len(),
        dataset.val.len(),
        started.elapsed().as_secs_f64()
    ));
    let data_sha256 = dataset.train_sha256();
    let tokenizer = (tokenizer, tokenizer_path);
    windows(cfg, tokenizer, dataset.train, &dataset.val, data_sha256)
}

/// The generation settings of a Hugging Face directory (`max_new_tokens`, sampling, EOS ids).
pub(super) const GENERATION_CONFIG: &str = "generation_config.json";

/// The files called `names` beside a loaded tokenizer (`data.tokenizer`: a Hugging Face
/// directory's, say), by name, for the run to record and its exports to carry; none for a
/// tokenizer trained here.
pub(super) fn beside_tokenizer(d: &anneal_config::Data, names: &[&str]) -> Vec<(String, String)> {
    if d.tokenizer == "train" {
        return Vec::new();
    }
    let dir = Path::new(&d.tokenizer).parent().unwrap_or(Path::new("."));
    names
        .iter()
        .filter_map(|name| {
            let text = std::fs::read_to_string(dir.join(name)).ok()?;
            Some((name.to_string(), text))
        })
        .collect()
}

//! The trainer's data: text documents packed into windows, or chat conversations one per row,
//! the loss on the assistant's replies, with a vision model's images. Built once at start;
//! served a batch at a time.

use crate::TrainError;
use anneal_config::JobConfig;
use anneal_data::chat::encode::{ChatEncoder, EncodedChat, VisionTokens};
use anneal_data::chat::loader::RowShape;
use anneal_data::chat::template::{ChatTemplate, CHATML};
use anneal_data::image::{ImageProcessor, ProcessorConfig};
use anneal_data::{Batch, ChatLoader, LoaderState, PackedLoader, TextTokenizer, TokenDataset};
use anneal_plugin_api::spec::ModelSpec;
use serde_json::Value;
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
            Loader::Chat(l) => {
                let b = l.next_batch(rows)?;
                Ok(match keep == (0..rows) {
                    true => b,
                    false => b.rows(keep.start, keep.end),
                })
            }
            Loader::Mixture(l) => Ok(l.next_rows(rows, keep)?),
            Loader::Stream(l) => Ok(l.next_rows(rows, keep)?),
        }
    }

    /// Where it stands (saved in checkpoints).
    pub(crate) fn state(&self) -> LoaderState {
        match self {
            Loader::Packed(l) => l.state(),
            Loader::Chat(l) => l.state(),
            Loader::Stream(l) => l.state(),
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
        DataKind::Chat => build_chat(cfg, files, spec, note),
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
const GENERATION_CONFIG: &str = "generation_config.json";

/// The files called `names` beside a loaded tokenizer (`data.tokenizer`: a Hugging Face
/// directory's, say), by name, for the run to record and its exports to carry; none for a
/// tokenizer trained here.
fn beside_tokenizer(d: &anneal_config::Data, names: &[&str]) -> Vec<(String, String)> {
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

fn build_chat(
    cfg: &JobConfig,
    files: &[PathBuf],
    spec: &ModelSpec,
    note: &dyn Fn(&str),
) -> Result<TrainData, TrainError> {
    let (d, t) = (&cfg.data, &cfg.training);
    let started = Instant::now();
    let conversations = anneal_data::chat::read_conversations(files)?;
    let trained_here = d.tokenizer == "train";
    // A loaded tokenizer's chat template and `tokenizer_config.json` sit beside it.
    let tokenizer_dir = Path::new(&d.tokenizer).parent().unwrap_or(Path::new("."));
    let loaded_config: Value = match trained_here {
        true => Value::Null,
        false => std::fs::read_to_string(tokenizer_dir.join("tokenizer_config.json"))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or(Value::Null),
    };
    // `data.chat_template` replaces the tokenizer's own (or the built-in one).
    let custom = match d.chat_template.as_str() {
        "" => None,
        path => Some(std::fs::read_to_string(path).map_err(|e| {
            TrainError::Config(format!("config: `data.chat_template`: {path}: {e}"))
        })?),
    };
    let eos = match trained_here {
        true => Some("<|im_end|>".to_string()),
        false => anneal_data::chat::template::special_token(loaded_config.get("eos_token")),
    };
    let template = match (&custom, trained_here) {
        (Some(source), _) => ChatTemplate::new(Some(source.clone()), None, eos),
        (None, true) => ChatTemplate::new(Some(CHATML.into()), None, eos),
        (None, false) => ChatTemplate::load(tokenizer_dir),
    };
    let template = template.map_err(|e| TrainError::Config(format!("data: {e}")))?;
    // A tokenizer trained here learns from the conversations as rendered, so the template's
    // own words (roles) become tokens too.
    let texts: Vec<String> = match trained_here {
        true => conversations
            .iter()
            .map(|c| {
                let never = std::sync::atomic::AtomicBool::new(false);
                template.render_request(&c.messages, c.tools.as_ref(), false, &never)
            })
            .collect::<Result<_, _>>()
            .map_err(|e| TrainError::Config(format!("data: {e}")))?,
        false => Vec::new(),
    };
    let (tokenizer, tokenizer_path) = TextTokenizer::load_or_train_chat(
        &d.tokenizer,
        &texts,
        d.vocab_size,
        Path::new(&d.cache_dir),
    )?;
    let mut tokenizer_config = match trained_here {
        true => serde_json::json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": CHATML,
            "eos_token": "<|im_end|>",
            "pad_token": anneal_data::tokenizer::TRAINED_EOS,
        }),
        false => loaded_config,
    };
    if let Some(source) = custom {
        if !tokenizer_config.is_object() {
            tokenizer_config = serde_json::json!({});
        }
        tokenizer_config["chat_template"] = Value::String(source);
    }
    let vision = vision_of(cfg, spec, &tokenizer)?;
    let images = conversations.iter().map(|c| c.images.len()).sum::<usize>();
    if images > 0 {
        refuse_image_layouts(cfg)?;
        if d.pack {
            return Err(TrainError::Config(
                "config: `data.pack` = true: conversations with images are not packed yet \
                 (their placeholders' positions are per row); drop data.pack"
                    .into(),
            ));
        }
    }
    let encoder = ChatEncoder {
        template: &template,
        tokenizer: &tokenizer,
        vision: vision.as_ref(),
    };
    let encoded = encoder.encode_all(&conversations)?;
    let shape = RowShape {
        seq_len: t.seq_len,
        pad_id: tokenizer.eos_id(),
        processor: vision.as_ref().map(|v| v.processor.clone()),
        pack: d.pack,
    };
    let (kept, idle): (Vec<EncodedChat>, Vec<EncodedChat>) =
        encoded.into_iter().partition(|e| shape.trains_on(e));
    let cut = kept.iter().filter(|e| shape.cuts(e)).count();
    let (train, val) = split_held_out(kept, d.val_fraction);
    note(&format!(
        "data: tokenizer {} (vocab {}), {} train / {} held-out conversations, {images} images ({:.1}s)",
        tokenizer_path.display(),
        tokenizer.vocab_size(),
        train.len(),
        val.len(),
        started.elapsed().as_secs_f64()
    ));
    if cut > 0 || !idle.is_empty() {
        note(&format!(
            "data: {cut} conversation(s) cut to seq_len {}; {} skipped with no assistant token within it",
            t.seq_len,
            idle.len()
        ));
    }
    let data_sha256 = digest(&train);
    let val_batches = match cfg.metrics.eval_freq > 0 && !val.is_empty() {
        true => {
            ChatLoader::eval_batches(&val, &shape, t.micro_batch_size, cfg.metrics.eval_batches)?
        }
        false => Vec::new(),
    };
    let loader = ChatLoader::new(train.into(), shape, t.seed, d.shuffle)?;
    let mut run_files = RunFiles::default();
    if !tokenizer_config.is_null() {
        run_files.files.push((
            "tokenizer_config.json".into(),
            serde_json::to_string_pretty(&tokenizer_config).unwrap_or_default(),
        ));
    }
    run_files
        .files
        .extend(beside_tokenizer(d, &[GENERATION_CONFIG]));
    if let Some(v) = &vision {
        run_files.files.push((
            "preprocessor_config.json".into(),
            serde_json::to_string_pretty(&v.processor.config().to_json()).unwrap_or_default(),
        ));
    }
    Ok(TrainData {
        tokenizer,
        tokenizer_path,
        loader: Loader::Chat(loader),
        val_batches,
        data_sha256,
        run_files,
        chat: true,
    })
}

/// The vision input of a model whose Hugging Face config names an `image_token_id` and a
/// `vision_config`: that token (which must be the tokenizer's), and the processor of
/// `checkpoint.init_from_hf`'s `preprocessor_config.json`, else Qwen3-VL's at the model's patch
/// sizes with `data.image_min_pixels` / `image_max_pixels`. `None` for a text-only model.
fn vision_of(
    cfg: &JobConfig,
    spec: &ModelSpec,
    tokenizer: &TextTokenizer,
) -> Result<Option<VisionTokens>, TrainError> {
    let Some(hf) = spec.hf.as_ref().map(|h| &h.config) else {
        return Ok(None);
    };
    let (Some(image_token), Some(vc)) = (
        hf.get("image_token_id").and_then(Value::as_u64),
        hf.get("vision_config"),
    ) else {
        return Ok(None);
    };
    let image_token = u32::try_from(image_token)
        .map_err(|_| TrainError::Config(format!("model: image_token_id {image_token}")))?;
    if tokenizer.id_to_token(image_token).is_none() {
        return Err(TrainError::Config(format!(
            "data: the model's image placeholder is token {image_token}, which the tokenizer \
             (vocabulary {}) does not have",
            tokenizer.vocab_size()
        )));
    }
    let from_dir = cfg
        .checkpoint
        .init_from_hf
        .as_ref()
        .map(|dir| Path::new(dir).join("preprocessor_config.json"))
        .filter(|p| p.is_file());
    let config = match from_dir {
        Some(p) => ProcessorConfig::from_file(&p).map_err(anneal_data::DataError::from)?,
        None => {
            let size = |key: &str, default: usize| {
                vc.get(key)
                    .and_then(Value::as_u64)
                    .map_or(default, |v| v as usize)
            };
            ProcessorConfig {
                patch_size: size("patch_size", 16),
                temporal_patch_size: size("temporal_patch_size", 2),
                merge_size: size("spatial_merge_size", 2),
                min_pixels: cfg.data.image_min_pixels,
                max_pixels: cfg.data.image_max_pixels,
                image_mean: [0.5; 3],
                image_std: [0.5; 3],
                ..ProcessorConfig::default()
            }
        }
    };
    Ok(Some(VisionTokens {
        image_token,
        processor: ImageProcessor::new(config),
    }))
}

/// Images reach the model through the forward's options, which the pipeline, context and
/// tensor-parallel paths do not carry yet.
fn refuse_image_layouts(cfg: &JobConfig) -> Result<(), TrainError> {
    let p = &cfg.parallelism;
    for (key, n) in [("pp", p.pp), ("cp", p.cp), ("tp", p.tp)] {
        if n > 1 {
            return Err(TrainError::Config(format!(
                "config: `parallelism.{key}` = {n}: training on images runs single-process, \
                 under DDP or under FSDP; not yet with {key} > 1"
            )));
        }
    }
    Ok(())
}

/// Conversations held out for validation: with fraction `f`, conversation `i` is held out when
/// `floor((i + 1) f) > floor(i f)`, spread evenly over the data.
fn split_held_out(docs: Vec<EncodedChat>, f: f64) -> (Vec<EncodedChat>, Vec<EncodedChat>) {
    let mut train = Vec::with_capacity(docs.len());
    let mut val = Vec::new();
    for (i, d) in docs.into_iter().enumerate() {
        let held = ((i + 1) as f64 * f).floor() > (i as f64 * f).floor();
        match held {
            true => val.push(d),
            false => train.push(d),
        }
    }
    (train, val)
}

/// SHA-256 of the conversations as trained on: tokens, loss flags and image paths.
fn digest(docs: &[EncodedChat]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for d in docs {
        h.update((d.tokens.len() as u64).to_le_bytes());
        for (&t, &on) in d.tokens.iter().zip(&d.trained) {
            h.update(t.to_le_bytes());
            h.update([u8::from(on)]);
        }
        for p in &d.images {
            let p = p.to_string_lossy();
            h.update((p.len() as u64).to_le_bytes());
            h.update(p.as_bytes());
        }
    }
    format!("{:x}", h.finalize())
}

/// Of one held-out batch's logits `[rows · seq_len, V]` (f32 on the host), the conversations
/// whose every trained target is the arg-max (a reply greedy decoding writes exactly), and the
/// conversations that have a trained target. A conversation is a row, or in packed rows a run
/// of consecutive positions.
pub(super) fn exact_replies(logits: &[f32], b: &Batch) -> (usize, usize) {
    let v = logits.len() / b.targets.len().max(1);
    let mut right = 0;
    let mut seen = 0;
    for (start, len) in conversations(b) {
        let targets = &b.targets[start..start + len];
        if targets
            .iter()
            .all(|&t| t == anneal_data::loader::IGNORE_INDEX)
        {
            continue;
        }
        seen += 1;
        let ok = targets.iter().enumerate().all(|(j, &t)| {
            if t == anneal_data::loader::IGNORE_INDEX {
                return true;
            }
            let at = (start + j) * v;
            let row = &logits[at..at + v];
            let best = row
                .iter()
                .enumerate()
                .fold((0usize, f32::NEG_INFINITY), |m, (k, &x)| {
                    if x > m.1 {
                        (k, x)
                    } else {
                        m
                    }
                })
                .0;
            best as i64 == t
        });
        right += usize::from(ok);
    }
    (right, seen)
}

/// The conversations of `b` as (first token, tokens): its rows, or when rows are packed each
/// run of consecutive positions within a row.
fn conversations(b: &Batch) -> Vec<(usize, usize)> {
    let t = b.seq_len;
    let mut out = Vec::new();
    for r in 0..b.batch {
        let mut start = r * t;
        for i in r * t + 1..=(r + 1) * t {
            let ends = i == (r + 1) * t
                || (!b.positions.is_empty() && b.positions[i] != b.positions[i - 1] + 1);
            if ends {
                out.push((start, i - start));
                start = i;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_out_conversations_are_spread_evenly() {
        let docs: Vec<EncodedChat> = (0..10)
            .map(|i| EncodedChat {
                tokens: vec![i],
                trained: vec![false],
                images: vec![],
                image_spans: vec![],
            })
            .collect();
        let (train, val) = split_held_out(docs, 0.2);
        let ids: Vec<u32> = val.iter().map(|d| d.tokens[0]).collect();
        assert_eq!(ids, [4, 9]);
        assert_eq!(train.len(), 8);
    }

    #[test]
    fn a_reply_counts_when_every_trained_target_is_the_arg_max() {
        let b = Batch {
            inputs: vec![0; 4],
            targets: vec![-100, 1, -100, 0],
            batch: 2,
            seq_len: 2,
            images: vec![],
            row_images: vec![],
            positions: vec![],
        };
        // Row 0 predicts 1 at its trained position (right); row 1 predicts 1, wants 0 (wrong).
        let logits = [0.0, 0.0, 0.1, 0.9, 0.0, 0.0, 0.2, 0.8];
        assert_eq!(exact_replies(&logits, &b), (1, 2));
        // Packed: one row of two conversations (positions restart), each counted alone.
        let packed = Batch {
            batch: 1,
            seq_len: 4,
            positions: vec![0, 1, 0, 1],
            ..b
        };
        assert_eq!(exact_replies(&logits, &packed), (1, 2));
    }
}

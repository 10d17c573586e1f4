//! The trainer's chat data: conversations rendered with the model's chat template (the loss on
//! the assistant's replies, images for vision models, packing) and preference pairs (two rows
//! each); and the held-out replies' exact-match count.

use super::data::{beside_tokenizer, Loader, RunFiles, TrainData, GENERATION_CONFIG};
use crate::TrainError;
use anneal_config::JobConfig;
use anneal_data::chat::encode::{ChatEncoder, EncodedChat, VisionTokens};
use anneal_data::chat::loader::RowShape;
use anneal_data::chat::template::{ChatTemplate, CHATML};
use anneal_data::image::{ImageProcessor, ProcessorConfig};
use anneal_data::{Batch, ChatLoader, TextTokenizer};
use anneal_plugin_api::spec::ModelSpec;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Chat data (`data.format = "chat"`) or preference pairs: rendered with the model's chat
/// template and tokenized, one conversation per row (or packed) or two rows per pair.
pub(super) fn build_chat(
    cfg: &JobConfig,
    files: &[PathBuf],
    spec: &ModelSpec,
    note: &dyn Fn(&str),
) -> Result<TrainData, TrainError> {
    let (d, t) = (&cfg.data, &cfg.training);
    let started = Instant::now();
    // Preference pairs are rendered and tokenized as two rows each.
    let pairs = crate::preflight::data_kind(cfg, files) == crate::preflight::DataKind::Preference;
    let (conversations, pair_list) = match pairs {
        true => (Vec::new(), anneal_data::preference::read_pairs(files)?),
        false => (anneal_data::chat::read_conversations(files)?, Vec::new()),
    };
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
        true if pairs => anneal_data::preference::texts(&pair_list),
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
    let shape = RowShape {
        seq_len: t.seq_len,
        pad_id: tokenizer.eos_id(),
        processor: vision.as_ref().map(|v| v.processor.clone()),
        pack: d.pack,
    };
    let (loader, val_batches, data_sha256) = match pairs {
        true => pair_data(cfg, &pair_list, &encoder, shape, note, started)?,
        false => {
            let source = (conversations.as_slice(), tokenizer_path.as_path(), images);
            conversation_data(cfg, source, &encoder, shape, note, started)?
        }
    };
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
        loader,
        val_batches,
        data_sha256,
        run_files,
        chat: !pairs,
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
fn split_held_out<T>(docs: Vec<T>, f: f64) -> (Vec<T>, Vec<T>) {
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

/// Conversations as the trainer reads them: one per row (or packed), the held-out share
/// split off; `source` is the conversations, the tokenizer's path and their image count.
fn conversation_data(
    cfg: &JobConfig,
    (conversations, tokenizer_path, images): (&[anneal_data::chat::Conversation], &Path, usize),
    encoder: &ChatEncoder<'_>,
    shape: RowShape,
    note: &dyn Fn(&str),
    started: Instant,
) -> Result<(Loader, Vec<Batch>, String), TrainError> {
    let (d, t) = (&cfg.data, &cfg.training);
    let tokenizer = encoder.tokenizer;
    let encoded = encoder.encode_all(conversations)?;
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
    Ok((Loader::Chat(loader), val_batches, data_sha256))
}

/// Preference pairs as the trainer reads them: two rows each (chosen, rejected), whole pairs
/// held out; a pair whose completions do not both start within a row is left out.
fn pair_data(
    cfg: &JobConfig,
    pairs: &[anneal_data::preference::Pair],
    encoder: &ChatEncoder<'_>,
    shape: RowShape,
    note: &dyn Fn(&str),
    started: Instant,
) -> Result<(Loader, Vec<Batch>, String), TrainError> {
    let (d, t) = (&cfg.data, &cfg.training);
    let rows = anneal_data::preference::encode_pairs(pairs, encoder.tokenizer, encoder)?;
    let (mut whole, mut skipped) = (Vec::with_capacity(pairs.len()), 0);
    let mut it = rows.into_iter();
    while let (Some(c), Some(r)) = (it.next(), it.next()) {
        match shape.trains_on(&c) && shape.trains_on(&r) {
            true => whole.push([c, r]),
            false => skipped += 1,
        }
    }
    let (train, val) = split_held_out(whole, d.val_fraction);
    let flat = |v: Vec<[EncodedChat; 2]>| -> Vec<EncodedChat> { v.into_iter().flatten().collect() };
    let (train, val) = (flat(train), flat(val));
    note(&format!(
        "data: {} train / {} held-out preference pairs, {skipped} skipped with a completion \
         past seq_len {} ({:.1}s)",
        train.len() / 2,
        val.len() / 2,
        t.seq_len,
        started.elapsed().as_secs_f64()
    ));
    let data_sha256 = digest(&train);
    let val_batches = match cfg.metrics.eval_freq > 0 && !val.is_empty() {
        true => {
            ChatLoader::eval_batches(&val, &shape, t.micro_batch_size, cfg.metrics.eval_batches)?
        }
        false => Vec::new(),
    };
    let loader = anneal_data::PairLoader::new(train.into(), shape, t.seed, d.shuffle)?;
    Ok((Loader::Pairs(loader), val_batches, data_sha256))
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

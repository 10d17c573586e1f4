//! Text ⇄ token ids through a Hugging Face `tokenizer.json`, or a byte-level BPE trained here.

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};

use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer, TokenizerBuilder, TokenizerImpl};

use crate::cache::{write_atomic, CacheKey};
use crate::corpus::read_documents;
use crate::{DataError, Result};

/// Where a token came from in its text: `(start, end)` byte offsets.
pub type ByteRange = (usize, usize);

/// The end-of-text token of tokenizers trained here (id 0).
pub const TRAINED_EOS: &str = "<|endoftext|>";

/// End-of-text tokens looked for, in order, in a loaded tokenizer.
const EOS_CANDIDATES: [&str; 4] = ["<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"];

/// The JSONL field read when a tokenizer is trained on `.jsonl` files.
const DEFAULT_TEXT_FIELD: &str = "text";

/// A tokenizer plus the id that ends each document in the training stream.
///
/// Encoding adds no special tokens (no BOS from a template post-processor); a literal special
/// token in the text, such as `<|endoftext|>`, still encodes as that token.
#[derive(Clone, Debug)]
pub struct TextTokenizer {
    inner: Tokenizer,
    eos_id: u32,
    vocab_size: usize,
    /// Whether the decoder is byte-level (GPT-2 style: each byte of text is one character of a
    /// token), so a token's bytes can be read from its string.
    byte_level: bool,
    /// Where it came from, for error messages.
    origin: String,
}

impl TextTokenizer {
    /// Loads any Hugging Face `tokenizer.json`. The end-of-text token is the first of
    /// `<|endoftext|>`, `</s>`, `<|end_of_text|>`, `<eos>` in the vocabulary, else the `eos_token`
    /// of a `tokenizer_config.json` next to the file; a tokenizer with none of them is an error.
    pub fn from_file(path: &Path) -> Result<Self> {
        let origin = path.display().to_string();
        let inner = Tokenizer::from_file(path).map_err(|e| tok_err(&origin, e))?;
        let config_eos = config_eos(path);
        let eos_id = EOS_CANDIDATES
            .iter()
            .copied()
            .chain(config_eos.as_deref())
            .find_map(|t| inner.token_to_id(t))
            .ok_or_else(|| DataError::NoEos {
                path: path.to_path_buf(),
                tried: EOS_CANDIDATES.join(", ") + ", tokenizer_config.json's eos_token",
            })?;
        Ok(Self::wrap(inner, eos_id, origin))
    }

    /// Trains a byte-level BPE (GPT-2 style: ByteLevel pre-tokenizer without a prefix space, ByteLevel
    /// decoder, all 256 bytes in the base alphabet, so any text encodes) with `<|endoftext|>` as
    /// id 0 and end-of-text token. `vocab_size` counts the 256 bytes and the special token, so it
    /// must be at least 257; the result may be smaller when the corpus runs out of merges.
    /// JSONL files are read through their `"text"` field. The result depends only on the
    /// documents and `vocab_size`, not on the thread count.
    pub fn train_bpe(files: &[PathBuf], vocab_size: usize) -> Result<Self> {
        Self::train_bpe_with_field(files, DEFAULT_TEXT_FIELD, vocab_size)
    }

    /// [`TextTokenizer::train_bpe`] reading JSONL files through their field `text_field` (the
    /// one the dataset is built from, `data.text_field`).
    pub fn train_bpe_with_field(
        files: &[PathBuf],
        text_field: &str,
        vocab_size: usize,
    ) -> Result<Self> {
        let docs = read_documents(files, text_field)?;
        Self::train_bpe_on_texts(&docs, vocab_size)
    }

    /// [`TextTokenizer::train_bpe`] on documents already in memory.
    pub fn train_bpe_on_texts(docs: &[String], vocab_size: usize) -> Result<Self> {
        Self::train_bpe_with_specials(docs, vocab_size, &[])
    }

    /// [`TextTokenizer::train_bpe_on_texts`] with more special tokens, numbered from 1 in the
    /// order given (after `<|endoftext|>`, id 0), so their ids do not depend on the corpus.
    pub fn train_bpe_with_specials(
        docs: &[String],
        vocab_size: usize,
        specials: &[&str],
    ) -> Result<Self> {
        let alphabet: HashSet<char> = ByteLevel::alphabet().into_iter().collect();
        let min = alphabet.len() + 1 + specials.len();
        if vocab_size < min {
            return Err(DataError::InvalidArgument {
                name: "vocab_size",
                message: format!(
                    "{vocab_size} is below {min} (256 bytes + {TRAINED_EOS} + {} more special tokens)",
                    specials.len()
                ),
            });
        }
        let specials: Vec<AddedToken> = std::iter::once(TRAINED_EOS)
            .chain(specials.iter().copied())
            .map(|t| AddedToken::from(t, true))
            .collect();
        let mut trainer = BpeTrainerBuilder::new()
            .show_progress(false)
            .vocab_size(vocab_size)
            .min_frequency(0)
            .special_tokens(specials)
            .initial_alphabet(alphabet)
            .build();
        let byte_level = ByteLevel::new(false, true, true);
        let mut tk: TokenizerImpl<BPE, NormalizerWrapper, ByteLevel, ByteLevel, ByteLevel> =
            TokenizerBuilder::new()
                .with_model(BPE::default())
                .with_normalizer(None)
                .with_pre_tokenizer(Some(byte_level))
                .with_post_processor(None)
                .with_decoder(Some(byte_level))
                .build()
                .map_err(|e| tok_err("training", e))?;
        tk.train(&mut trainer, docs.iter())
            .map_err(|e| tok_err("training", e))?;
        let inner = Tokenizer::from(tk);
        let eos_id = inner
            .token_to_id(TRAINED_EOS)
            .expect("the trainer adds its special tokens to the vocabulary");
        Ok(Self::wrap(inner, eos_id, "trained BPE".into()))
    }

    /// Loads (`spec` is a path to a `tokenizer.json`) or trains (`spec` is `"train"`) a tokenizer
    /// and returns it with the `tokenizer.json` it lives in. A trained tokenizer reads JSONL
    /// files through their field `text_field`, and is cached as `<cache_dir>/tokenizer-<hash>.json`,
    /// the hash covering the file paths, their contents, `text_field` and `vocab_size`, and
    /// reused by later calls with the same inputs.
    pub fn load_or_train(
        spec: &str,
        files: &[PathBuf],
        text_field: &str,
        vocab_size: usize,
        cache_dir: &Path,
    ) -> Result<(Self, PathBuf)> {
        let key = || {
            let mut key = CacheKey::new("anneal-data bpe tokenizer v2");
            key.files(files)?
                .bytes(text_field.as_bytes())
                .u64(vocab_size as u64);
            Ok(key)
        };
        Self::load_or(spec, cache_dir, key, || {
            Self::train_bpe_with_field(files, text_field, vocab_size)
        })
    }

    /// The `tokenizer.json` at `spec`; or for `"train"` the tokenizer cached in `cache_dir`
    /// under `key` (computed only then), else `train`'s, then cached. A cache file that no
    /// longer loads (say, truncated by a full disk) is retrained.
    fn load_or(
        spec: &str,
        cache_dir: &Path,
        key: impl FnOnce() -> Result<CacheKey>,
        train: impl FnOnce() -> Result<Self>,
    ) -> Result<(Self, PathBuf)> {
        if spec != "train" {
            let path = PathBuf::from(spec);
            return Ok((Self::from_file(&path)?, path));
        }
        let path = cache_dir.join(format!("tokenizer-{}.json", key()?.hex()));
        if let Ok(tok) = Self::from_file(&path) {
            return Ok((tok, path));
        }
        let tok = train()?;
        tok.save(&path)?;
        Ok((tok, path))
    }

    /// [`TextTokenizer::load_or_train`] for chat data: a trained tokenizer learns from `texts`
    /// (the conversations as the template renders them) and numbers
    /// [`crate::chat::template::CHATML_SPECIALS`] right after `<|endoftext|>`, so
    /// [`crate::chat::template::CHATML`] renders them as single tokens; it is cached under a
    /// hash of the texts and `vocab_size`.
    pub fn load_or_train_chat(
        spec: &str,
        texts: &[String],
        vocab_size: usize,
        cache_dir: &Path,
    ) -> Result<(Self, PathBuf)> {
        let specials = crate::chat::template::CHATML_SPECIALS;
        let kind = "anneal-data chat bpe tokenizer v1";
        Self::load_or_train_on(spec, kind, texts, &specials, vocab_size, cache_dir)
    }

    /// [`TextTokenizer::load_or_train`] on documents in memory (a sample of a streamed
    /// corpus): a trained tokenizer is cached under a hash of them and `vocab_size`.
    pub fn load_or_train_texts(
        spec: &str,
        texts: &[String],
        vocab_size: usize,
        cache_dir: &Path,
    ) -> Result<(Self, PathBuf)> {
        let kind = "anneal-data sampled bpe tokenizer v1";
        Self::load_or_train_on(spec, kind, texts, &[], vocab_size, cache_dir)
    }

    /// Loads `spec`, or trains on `texts` with `specials`, cached under `kind` and a hash of
    /// the texts, the specials and `vocab_size`.
    fn load_or_train_on(
        spec: &str,
        kind: &str,
        texts: &[String],
        specials: &[&str],
        vocab_size: usize,
        cache_dir: &Path,
    ) -> Result<(Self, PathBuf)> {
        let key = || {
            let mut key = CacheKey::new(kind);
            for t in texts {
                key.bytes(t.as_bytes());
            }
            for s in specials {
                key.bytes(s.as_bytes());
            }
            key.u64(vocab_size as u64);
            Ok(key)
        };
        Self::load_or(spec, cache_dir, key, || {
            Self::train_bpe_with_specials(texts, vocab_size, specials)
        })
    }

    /// The ids of `text` (without added special tokens) and the byte range of `text` each one
    /// came from.
    pub fn encode_with_offsets(&self, text: &str) -> Result<(Vec<u32>, Vec<ByteRange>)> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| tok_err(&self.origin, e))?;
        Ok((enc.get_ids().to_vec(), enc.get_offsets().to_vec()))
    }

    /// The id of a token's string (a special token such as `<|image_pad|>`), if it has one.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The string of token `id`, if it is in the vocabulary.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The ids of `text`, without added special tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| tok_err(&self.origin, e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The text of `ids`, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| tok_err(&self.origin, e))
    }

    /// Decodes ids as they arrive, special tokens included: each step hands out only the text
    /// the new id completes, without decoding everything again (`tokenizers`' `DecodeStream`).
    pub fn decode_stream(&self) -> DecodeStream<'_> {
        DecodeStream {
            inner: self.inner.decode_stream(false),
            origin: &self.origin,
        }
    }

    /// The bytes of text token `id` stands for, exactly, even when they are not whole UTF-8
    /// characters (a byte-level BPE's single bytes, a byte-fallback `<0xE2>`), where decoding
    /// it alone gives a replacement character. Empty for an id outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let text = self.inner.decode(&[id], false).unwrap_or_default();
        if !text.contains('\u{FFFD}') {
            return text.into_bytes();
        }
        let Some(token) = self.inner.id_to_token(id) else {
            return text.into_bytes();
        };
        if let Some(byte) = byte_fallback(&token) {
            return vec![byte];
        }
        if self.byte_level {
            if let Some(bytes) = byte_level_bytes(&token) {
                return bytes;
            }
        }
        text.into_bytes()
    }

    /// Number of ids, added tokens included: every id this tokenizer produces is below it.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The id that ends each document.
    pub fn eos_id(&self) -> u32 {
        self.eos_id
    }

    /// Writes the tokenizer as a `tokenizer.json` (through a temporary file and a rename).
    pub fn save(&self, path: &Path) -> Result<()> {
        write_atomic(path, self.to_json()?.as_bytes())
    }

    /// The `tokenizer.json` text; the same tokenizer always gives the same text.
    pub fn to_json(&self) -> Result<String> {
        self.inner
            .to_string(false)
            .map_err(|e| tok_err(&self.origin, e))
    }

    /// Hex SHA-256 of [`TextTokenizer::to_json`]: equal hashes mean the same tokenizer, whatever
    /// file it was read from. Checkpoints record it so a run never resumes with another one.
    pub fn sha256(&self) -> Result<String> {
        Ok(crate::cache::sha256_hex(self.to_json()?.as_bytes()))
    }

    fn wrap(inner: Tokenizer, eos_id: u32, origin: String) -> Self {
        let max_id = inner
            .get_vocab(true)
            .into_values()
            .max()
            .map_or(0, |m| m as usize + 1);
        let vocab_size = inner.get_vocab_size(true).max(max_id);
        let byte_level = match inner.get_decoder() {
            Some(DecoderWrapper::ByteLevel(_)) => true,
            Some(DecoderWrapper::Sequence(seq)) => seq
                .get_decoders()
                .iter()
                .any(|d| matches!(d, DecoderWrapper::ByteLevel(_))),
            _ => false,
        };
        TextTokenizer {
            inner,
            eos_id,
            vocab_size,
            byte_level,
            origin,
        }
    }
}

/// The byte of a byte-fallback token (`<0xE2>`), as SentencePiece-style vocabularies hold them.
fn byte_fallback(token: &str) -> Option<u8> {
    let hex = token.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok())?
}

/// The bytes behind a byte-level BPE token's string (GPT-2's `bytes_to_unicode`: printable
/// bytes stand for themselves, the other 68 for U+0100 onwards in byte order); `None` if a
/// character is not one of the 256.
fn byte_level_bytes(token: &str) -> Option<Vec<u8>> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let shifted: Vec<u8> = (0u8..=255).filter(|&b| !printable(u32::from(b))).collect();
    token
        .chars()
        .map(|c| {
            let c = u32::from(c);
            if c < 256 && printable(c) {
                u8::try_from(c).ok()
            } else {
                let i = usize::try_from(c.checked_sub(256)?).ok()?;
                shifted.get(i).copied()
            }
        })
        .collect()
}

/// Text as token ids arrive ([`TextTokenizer::decode_stream`]).
pub struct DecodeStream<'a> {
    inner: tokenizers::DecodeStream<
        'a,
        tokenizers::ModelWrapper,
        NormalizerWrapper,
        tokenizers::PreTokenizerWrapper,
        tokenizers::PostProcessorWrapper,
        DecoderWrapper,
    >,
    origin: &'a str,
}

impl DecodeStream<'_> {
    /// Adds `id`: the text it completes, or `None` while its bytes do not end a character yet.
    pub fn step(&mut self, id: u32) -> Result<Option<String>> {
        self.inner.step(id).map_err(|e| tok_err(self.origin, e))
    }
}

fn tok_err(context: &str, e: impl std::fmt::Display) -> DataError {
    DataError::Tokenizer {
        context: context.to_owned(),
        message: e.to_string(),
    }
}

/// The `eos_token` of a `tokenizer_config.json` beside `tokenizer_json`, if any (a string, or an
/// object with a `content` string).
fn config_eos(tokenizer_json: &Path) -> Option<String> {
    let config = tokenizer_json.parent()?.join("tokenizer_config.json");
    let value: serde_json::Value = serde_json::from_str(&fs::read_to_string(config).ok()?).ok()?;
    let eos = value.get("eos_token")?;
    eos.as_str()
        .or_else(|| eos.get("content")?.as_str())
        .map(str::to_owned)
}

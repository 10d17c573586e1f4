//! Training, saving, loading and caching tokenizers.

use std::fs;
use std::path::{Path, PathBuf};

use anneal_data::{DataError, TextTokenizer};

const CORPUS: &str = "\
The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs on.
To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer
the slings and arrows of outrageous fortune, or to take arms against a sea of troubles.
Now is the winter of our discontent made glorious summer by this sun of York.
All the world's a stage, and all the men and women merely players.
";

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    if let Some(parent) = p.parent() {
        fs::create_dir_all(parent).unwrap();
    }
    fs::write(&p, text).unwrap();
    p
}

fn corpus(dir: &Path) -> Vec<PathBuf> {
    vec![
        write(dir, "a.txt", &CORPUS.repeat(3)),
        write(
            dir,
            "b.jsonl",
            "{\"text\": \"the fox and the dog\"}\n{\"text\": \"the stage and the players\"}\n",
        ),
    ]
}

#[test]
fn trained_bpe_round_trips_text_and_uses_endoftext_as_eos() {
    let dir = tempfile::tempdir().unwrap();
    let tok = TextTokenizer::train_bpe(&corpus(dir.path()), 320).unwrap();
    assert_eq!(tok.eos_id(), 0);
    assert!(
        tok.vocab_size() <= 320,
        "vocab {} over the requested 320",
        tok.vocab_size()
    );
    assert!(tok.vocab_size() > 257, "no merges were learned");
    for text in [
        "The fox jumps over the dog.",
        "  leading spaces,\ttabs\nand\n\nnewlines  ",
        "unseen: héllo wörld — 日本語 🦊",
        "",
    ] {
        let ids = tok.encode(text).unwrap();
        assert!(ids.iter().all(|&id| (id as usize) < tok.vocab_size()));
        assert_eq!(tok.decode(&ids).unwrap(), text);
    }
    // Merges compress frequent words: "the" is fewer tokens than its 3 bytes.
    assert!(tok.encode(" the").unwrap().len() < 4);
    assert_eq!(tok.encode("<|endoftext|>").unwrap(), [0]);
    assert_eq!(tok.decode(&[0]).unwrap(), "<|endoftext|>");
}

#[test]
fn training_is_deterministic_across_runs_and_thread_counts() {
    let dir = tempfile::tempdir().unwrap();
    let files = corpus(dir.path());
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let four = rayon::ThreadPoolBuilder::new()
        .num_threads(4)
        .build()
        .unwrap();
    let a = one
        .install(|| TextTokenizer::train_bpe(&files, 300))
        .unwrap();
    let b = four
        .install(|| TextTokenizer::train_bpe(&files, 300))
        .unwrap();
    let c = TextTokenizer::train_bpe(&files, 300).unwrap();
    assert_eq!(a.to_json().unwrap(), b.to_json().unwrap());
    assert_eq!(a.to_json().unwrap(), c.to_json().unwrap());
}

#[test]
fn vocab_below_the_byte_alphabet_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let err = TextTokenizer::train_bpe(&corpus(dir.path()), 100).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::InvalidArgument {
                name: "vocab_size",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("257"), "{err}");
}

#[test]
fn saved_tokenizer_loads_back_with_the_same_ids() {
    let dir = tempfile::tempdir().unwrap();
    let tok = TextTokenizer::train_bpe(&corpus(dir.path()), 300).unwrap();
    let path = dir.path().join("out/tokenizer.json");
    tok.save(&path).unwrap();
    let back = TextTokenizer::from_file(&path).unwrap();
    assert_eq!(back.eos_id(), tok.eos_id());
    assert_eq!(back.vocab_size(), tok.vocab_size());
    let text = "Whether 'tis nobler to suffer the slings<|endoftext|>and arrows";
    assert_eq!(back.encode(text).unwrap(), tok.encode(text).unwrap());
}

#[test]
fn load_or_train_caches_by_inputs_and_reuses_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let files = corpus(dir.path());
    let cache = dir.path().join("cache");
    let (tok, path) = TextTokenizer::load_or_train("train", &files, "text", 300, &cache).unwrap();
    let name = path.file_name().unwrap().to_str().unwrap();
    assert!(
        name.starts_with("tokenizer-") && name.ends_with(".json"),
        "{name}"
    );
    assert_eq!(path.parent().unwrap(), cache);
    assert!(path.is_file());

    let (again, path2) =
        TextTokenizer::load_or_train("train", &files, "text", 300, &cache).unwrap();
    assert_eq!(path2, path);
    assert_eq!(again.encode(CORPUS).unwrap(), tok.encode(CORPUS).unwrap());

    // The second call reads the cache file rather than training: swap in a different tokenizer.
    let other = TextTokenizer::train_bpe(&files, 270).unwrap();
    other.save(&path).unwrap();
    let (reused, _) = TextTokenizer::load_or_train("train", &files, "text", 300, &cache).unwrap();
    assert_eq!(reused.vocab_size(), other.vocab_size());

    // Another vocab size or changed contents make another cache entry.
    let (_, p_vocab) = TextTokenizer::load_or_train("train", &files, "text", 290, &cache).unwrap();
    assert_ne!(p_vocab, path);
    fs::write(&files[1], "{\"text\": \"something else entirely\"}\n").unwrap();
    let (_, p_edit) = TextTokenizer::load_or_train("train", &files, "text", 300, &cache).unwrap();
    assert_ne!(p_edit, path);
    assert_ne!(p_edit, p_vocab);
}

#[test]
fn a_trained_tokenizer_reads_the_configured_text_field() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("notes.jsonl");
    fs::write(
        &data,
        "{\"body\": \"the quick brown fox\", \"text\": \"zzzz zzzz zzzz\"}\n{\"body\": \"jumps over the lazy dog\"}\n",
    )
    .unwrap();
    let files = vec![data];
    let cache = dir.path().join("cache");
    // Only `body` is in every line: reading `text` fails on the second, naming the field.
    let (tok, body) = TextTokenizer::load_or_train("train", &files, "body", 270, &cache).unwrap();
    let err = TextTokenizer::load_or_train("train", &files, "text", 270, &cache).unwrap_err();
    assert!(err.to_string().contains("text"), "{err}");
    // The merges come from the `body` documents; the field is part of the cache key.
    assert!(tok.encode("the quick").unwrap().len() < "the quick".len());
    let direct = TextTokenizer::train_bpe_with_field(&files, "body", 270).unwrap();
    assert_eq!(tok.to_json().unwrap(), direct.to_json().unwrap());
    fs::write(&files[0], "{\"body\": \"a\", \"text\": \"b\"}\n").unwrap();
    let (_, text) = TextTokenizer::load_or_train("train", &files, "text", 270, &cache).unwrap();
    let (_, body2) = TextTokenizer::load_or_train("train", &files, "body", 270, &cache).unwrap();
    assert_ne!(text, body2, "another field, another cache entry");
    assert_ne!(body, body2, "other contents, another cache entry");
}

#[test]
fn load_or_train_with_a_path_loads_that_file() {
    let dir = tempfile::tempdir().unwrap();
    let tok = TextTokenizer::train_bpe(&corpus(dir.path()), 300).unwrap();
    let path = dir.path().join("tokenizer.json");
    tok.save(&path).unwrap();
    let cache = dir.path().join("cache");
    let (loaded, used) =
        TextTokenizer::load_or_train(path.to_str().unwrap(), &[], "text", 0, &cache).unwrap();
    assert_eq!(used, path);
    assert_eq!(loaded.encode(CORPUS).unwrap(), tok.encode(CORPUS).unwrap());
    assert!(!cache.exists(), "loading a file must not write the cache");
}

/// A hand-written word-level tokenizer.json with no end-of-text token.
const WORD_LEVEL: &str = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
"normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,
"model":{"type":"WordLevel","vocab":{"a":0,"b":1,"[UNK]":2},"unk_token":"[UNK]"}}"#;

#[test]
fn eos_falls_back_to_tokenizer_config_and_is_required() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "tokenizer.json", WORD_LEVEL);
    let err = TextTokenizer::from_file(&path).unwrap_err();
    assert!(matches!(err, DataError::NoEos { .. }), "{err}");
    assert!(err.to_string().contains("tokenizer.json"), "{err}");

    write(dir.path(), "tokenizer_config.json", r#"{"eos_token": "b"}"#);
    let tok = TextTokenizer::from_file(&path).unwrap();
    assert_eq!(tok.eos_id(), 1);
    assert_eq!(tok.vocab_size(), 3);
    assert_eq!(tok.encode("b a zzz").unwrap(), [1, 0, 2]);

    write(
        dir.path(),
        "tokenizer_config.json",
        r#"{"eos_token": {"content": "a", "special": true}}"#,
    );
    assert_eq!(TextTokenizer::from_file(&path).unwrap().eos_id(), 0);
}

#[test]
fn unreadable_tokenizer_files_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.json");
    let err = TextTokenizer::from_file(&missing).unwrap_err();
    assert!(err.to_string().contains("nope.json"), "{err}");
    let bad = write(dir.path(), "bad.json", "{ not json");
    let err = TextTokenizer::from_file(&bad).unwrap_err();
    assert!(err.to_string().contains("bad.json"), "{err}");
}

#[test]
fn token_bytes_are_exact_for_tokens_that_split_a_character() {
    let dir = tempfile::tempdir().unwrap();
    let tok = TextTokenizer::train_bpe(&corpus(dir.path()), 320).unwrap();
    // "🦊" never occurs in the corpus: it encodes as its four single-byte tokens, which each
    // decode alone to a replacement character but keep their own byte.
    let ids = tok.encode("🦊").unwrap();
    assert_eq!(ids.len(), 4);
    assert_eq!(tok.decode(&ids[..1]).unwrap(), "\u{FFFD}");
    let bytes: Vec<u8> = ids.iter().flat_map(|&id| tok.token_bytes(id)).collect();
    assert_eq!(bytes, "🦊".as_bytes());
    let the: Vec<u8> = tok
        .encode(" the")
        .unwrap()
        .iter()
        .flat_map(|&id| tok.token_bytes(id))
        .collect();
    assert_eq!(the, b" the");
    // Every token's bytes differ from every other's: the 128 bytes that are not characters on
    // their own included.
    let all: std::collections::HashSet<Vec<u8>> = (0..tok.vocab_size() as u32)
        .map(|id| tok.token_bytes(id))
        .collect();
    assert_eq!(all.len(), tok.vocab_size());
    assert!(!all.contains(&Vec::new()));
    assert_eq!(tok.token_bytes(100_000), b"");
}

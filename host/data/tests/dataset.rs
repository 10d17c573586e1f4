//! Tokenizing the corpus, splitting it and caching the result.

use std::fs;
use std::path::{Path, PathBuf};

use anneal_data::{read_documents, DataError, TextTokenizer, TokenDataset};

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    fs::write(&p, text).unwrap();
    p
}

fn corpus(dir: &Path) -> Vec<PathBuf> {
    let play = "ROMEO. But soft, what light through yonder window breaks?\n\
                It is the east, and Juliet is the sun.\n"
        .repeat(8);
    let lines: String = (0..20)
        .map(|i| {
            format!(
                "{{\"text\": \"line {i}: the fox saw the {} dogs\"}}\n",
                i * 7
            )
        })
        .collect();
    vec![
        write(dir, "play.txt", &play),
        write(dir, "short.txt", "Hi."),
        write(dir, "lines.jsonl", &lines),
    ]
}

#[test]
fn split_holds_out_each_documents_tail_with_exact_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let files = corpus(dir.path());
    let tok = TextTokenizer::train_bpe(&files, 300).unwrap();
    let eos = tok.eos_id();
    let ds = TokenDataset::build(&files, "text", &tok, 0.1, &dir.path().join("cache")).unwrap();
    assert_eq!(ds.eos_id, eos);

    let docs = read_documents(&files, "text").unwrap();
    assert_eq!(docs.len(), 22);
    let (mut train, mut val) = (Vec::new(), Vec::new());
    for doc in &docs {
        let ids = tok.encode(doc).unwrap();
        let k = (ids.len() as f64 * 0.1).floor() as usize;
        train.extend_from_slice(&ids[..ids.len() - k]);
        train.push(eos);
        if k > 0 {
            val.extend_from_slice(&ids[ids.len() - k..]);
            val.push(eos);
        }
    }
    assert_eq!(ds.train, train);
    assert_eq!(ds.val, val);
    // The long play gives about a tenth of its tokens; the tiny documents give none.
    assert!(!ds.val.is_empty());
    let docs_in_train = ds.train.iter().filter(|&&t| t == eos).count();
    let docs_in_val = ds.val.iter().filter(|&&t| t == eos).count();
    assert_eq!(docs_in_train, 22);
    assert!(docs_in_val < 22 && docs_in_val > 0);
    // No overlap: stripping the EOS markers, train and val together are exactly the corpus once.
    let content: usize = docs.iter().map(|d| tok.encode(d).unwrap().len()).sum();
    assert_eq!(
        ds.train.len() - docs_in_train + ds.val.len() - docs_in_val,
        content
    );
}

#[test]
fn cached_streams_are_reused_and_keyed_by_inputs() {
    let dir = tempfile::tempdir().unwrap();
    let files = corpus(dir.path());
    let cache = dir.path().join("cache");
    let tok = TextTokenizer::train_bpe(&files, 300).unwrap();
    let first = TokenDataset::build(&files, "text", &tok, 0.1, &cache).unwrap();
    let mut cached: Vec<PathBuf> = fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    cached.sort();
    assert_eq!(cached.len(), 2, "{cached:?}");
    let train_file = cached
        .iter()
        .find(|p| p.to_str().unwrap().ends_with(".train.u32"))
        .unwrap();
    let bytes = fs::read(train_file).unwrap();
    assert_eq!(bytes.len(), first.train.len() * 4);
    assert_eq!(
        u32::from_le_bytes(bytes[..4].try_into().unwrap()),
        first.train[0]
    );

    let second = TokenDataset::build(&files, "text", &tok, 0.1, &cache).unwrap();
    assert_eq!(second, first);

    // A hit reads the files: a changed (still valid) train file comes back as is.
    fs::write(
        train_file,
        [1u32, 2, 3]
            .iter()
            .flat_map(|t| t.to_le_bytes())
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let third = TokenDataset::build(&files, "text", &tok, 0.1, &cache).unwrap();
    assert_eq!(third.train, [1, 2, 3]);
    assert_eq!(third.val, first.val);

    // Another split, another tokenizer or edited files miss the cache.
    let other = TokenDataset::build(&files, "text", &tok, 0.2, &cache).unwrap();
    assert_ne!(other.val, first.val);
    let tok2 = TextTokenizer::train_bpe(&files, 280).unwrap();
    let other_tok = TokenDataset::build(&files, "text", &tok2, 0.1, &cache).unwrap();
    assert!(
        other_tok.train.len() > first.train.len(),
        "fewer merges, more tokens"
    );
    fs::write(&files[1], "Hello there.").unwrap();
    let edited = TokenDataset::build(&files, "text", &tok, 0.1, &cache).unwrap();
    assert_ne!(edited.train, [1, 2, 3]);
    assert_eq!(fs::read_dir(&cache).unwrap().count(), 8);
}

#[test]
fn encoding_does_not_depend_on_the_thread_count() {
    let dir = tempfile::tempdir().unwrap();
    let files = corpus(dir.path());
    let tok = TextTokenizer::train_bpe(&files, 300).unwrap();
    let build = |threads: usize, cache: &str| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| TokenDataset::build(&files, "text", &tok, 0.05, &dir.path().join(cache)))
            .unwrap()
    };
    assert_eq!(build(1, "c1"), build(4, "c4"));
}

#[test]
fn val_fraction_must_be_below_one() {
    let dir = tempfile::tempdir().unwrap();
    let files = corpus(dir.path());
    let tok = TextTokenizer::train_bpe(&files, 300).unwrap();
    for f in [1.0, -0.1, f64::NAN] {
        let err = TokenDataset::build(&files, "text", &tok, f, dir.path()).unwrap_err();
        assert!(
            matches!(
                err,
                DataError::InvalidArgument {
                    name: "val_fraction",
                    ..
                }
            ),
            "{err}"
        );
    }
}

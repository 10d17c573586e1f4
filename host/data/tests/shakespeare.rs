//! The built-in corpus end to end, with timings. Needs `scripts/fetch-corpus.sh` first, so it is
//! ignored by default: `cargo test -p anneal-data --release --test shakespeare -- --ignored --nocapture`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anneal_data::{discover_files, read_documents, PackedLoader, TextTokenizer, TokenDataset};

#[test]
#[ignore = "needs data/shakespeare from scripts/fetch-corpus.sh; slow"]
fn bpe_8192_on_shakespeare() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data/shakespeare");
    let files = discover_files(&root).expect("run scripts/fetch-corpus.sh first");
    let bytes: u64 = files.iter().map(|f| f.metadata().unwrap().len()).sum();
    println!(
        "corpus: {} files, {bytes} bytes, {} threads",
        files.len(),
        rayon::current_num_threads()
    );
    let cache = tempfile::tempdir().unwrap();

    let t = Instant::now();
    let (tok, path) =
        TextTokenizer::load_or_train("train", &files, "text", 8192, cache.path()).unwrap();
    println!(
        "train BPE 8192: {:.2} s -> {}",
        t.elapsed().as_secs_f64(),
        path.display()
    );
    assert_eq!(tok.vocab_size(), 8192);

    let t = Instant::now();
    let ds = TokenDataset::build(&files, "text", &tok, 0.05, cache.path()).unwrap();
    let secs = t.elapsed().as_secs_f64();
    let tokens = ds.train.len() + ds.val.len();
    println!(
        "encode: {secs:.2} s, {tokens} tokens (train {}, val {}), {:.2} bytes/token, {:.1} MB/s",
        ds.train.len(),
        ds.val.len(),
        bytes as f64 / tokens as f64,
        bytes as f64 / secs / 1e6
    );
    assert!(
        bytes as f64 / tokens as f64 > 3.0,
        "an 8k BPE compresses English text"
    );

    let t = Instant::now();
    let (_, cached_path) =
        TextTokenizer::load_or_train("train", &files, "text", 8192, cache.path()).unwrap();
    let again = TokenDataset::build(&files, "text", &tok, 0.05, cache.path()).unwrap();
    println!(
        "cached tokenizer + streams: {:.2} s",
        t.elapsed().as_secs_f64()
    );
    assert_eq!(cached_path, path);
    assert_eq!(again, ds);

    let docs = read_documents(&files, "text").unwrap();
    assert_eq!(tok.decode(&tok.encode(&docs[0]).unwrap()).unwrap(), docs[0]);
    let loader = PackedLoader::new(Arc::from(ds.train), 256, 0, true).unwrap();
    println!(
        "seq_len 256: {} windows per epoch",
        loader.windows_per_epoch()
    );
}

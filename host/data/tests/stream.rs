//! The streamed text corpus: the same windows as the in-memory stream, each once per epoch,
//! a saved place that continues bit for bit, pieces of large files that lose no byte, and a
//! held-out split that keeps every token in one stream or the other.

use std::path::{Path, PathBuf};

use anneal_data::stream::{held_out, StreamSpec, PIECE_BYTES};
use anneal_data::{
    discover_files, Batch, LoaderState, PackedLoader, StreamingLoader, TextTokenizer, TokenDataset,
};

/// A corpus of JSON lines and text files with words in several scripts.
fn corpus(dir: &Path) -> Vec<PathBuf> {
    let words = [
        "river",
        "stone",
        "светлый",
        "雨",
        "lantern",
        "ödland",
        "quiet",
        "ember",
    ];
    let doc = |i: usize, n: usize| -> String {
        (0..n)
            .map(|j| words[(i * 7 + j * 3 + j / 5) % words.len()])
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut lines = String::new();
    for i in 0..40 {
        lines += &serde_json::json!({ "text": doc(i, 5 + i % 13) }).to_string();
        lines += "\n";
        if i % 9 == 0 {
            lines += "\n";
        }
    }
    std::fs::write(dir.join("a.jsonl"), lines).unwrap();
    for (i, name) in ["b.txt", "c.md", "d.txt"].iter().enumerate() {
        std::fs::write(dir.join(name), doc(100 + i, 60 + 25 * i)).unwrap();
    }
    discover_files(dir).unwrap()
}

fn tokenizer(files: &[PathBuf]) -> TextTokenizer {
    TextTokenizer::train_bpe(files, 300).unwrap()
}

fn spec(files: &[PathBuf], seq_len: usize, block_windows: usize, shuffle: bool) -> StreamSpec {
    StreamSpec {
        files: files.to_vec(),
        text_field: "text".into(),
        seq_len,
        seed: 17,
        shuffle,
        block_windows,
        threads: 2,
        held_out: None,
    }
}

/// Each row of `b` as its inputs plus the last target (the window).
fn windows(b: &Batch) -> Vec<Vec<i64>> {
    (0..b.batch)
        .map(|r| {
            let row = &b.inputs[r * b.seq_len..(r + 1) * b.seq_len];
            let mut w = row.to_vec();
            w.push(b.targets[(r + 1) * b.seq_len - 1]);
            w
        })
        .collect()
}

#[test]
fn in_order_the_stream_serves_the_in_memory_windows() {
    let dir = tempfile::tempdir().unwrap();
    let files = corpus(dir.path());
    let tok = tokenizer(&files);
    let cache = dir.path().join("cache");
    let memory = TokenDataset::build(&files, "text", &tok, 0.0, &cache).unwrap();
    let mut packed = PackedLoader::new(memory.train, 8, 17, false).unwrap();
    let per_epoch = packed.windows_per_epoch();
    let mut stream = StreamingLoader::new(spec(&files, 8, 5, false), tok).unwrap();
    // Two epochs, across blocks of 5 windows and a last partial one.
    for _ in 0..2 * per_epoch / 3 {
        assert_eq!(stream.next_batch(3).unwrap(), packed.next_batch(3).unwrap());
    }
}

#[test]
fn shuffled_each_epoch_serves_every_window_once_in_a_new_order() {
    let dir = tempfile::tempdir().unwrap();
    // One file, so the stream is the same every epoch (the order of files changes it).
    let files = corpus(dir.path())[..1].to_vec();
    let tok = tokenizer(&files);
    let train = TokenDataset::build(&files, "text", &tok, 0.0, &dir.path().join("c"))
        .unwrap()
        .train;
    let mut packed = PackedLoader::new(train, 8, 1, false).unwrap();
    let n = packed.windows_per_epoch();
    let mut all = windows(&packed.next_batch(n).unwrap());
    all.sort();
    let mut stream = StreamingLoader::new(spec(&files, 8, 4, true), tok).unwrap();
    let first = windows(&stream.next_batch(n).unwrap());
    let second = windows(&stream.next_batch(n).unwrap());
    assert_ne!(first, second, "a new epoch shuffles again");
    for mut epoch in [first, second] {
        epoch.sort();
        assert_eq!(epoch, all);
    }
}

#[test]
fn shuffled_files_change_order_per_epoch_and_keep_their_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let files = corpus(dir.path());
    let tok = tokenizer(&files);
    // Windows of one token: an epoch is the whole stream, in its file order.
    let mut stream = StreamingLoader::new(spec(&files, 1, 1 << 20, true), tok.clone()).unwrap();
    let mut epochs: Vec<Vec<i64>> = vec![Vec::new(); 3];
    for epoch in &mut epochs {
        loop {
            let b = stream.next_batch(1).unwrap();
            epoch.push(b.inputs[0]);
            if stream.state().cursor == 0 {
                break;
            }
        }
    }
    assert!(
        epochs[0] != epochs[1] || epochs[1] != epochs[2],
        "files reorder"
    );
    let train = TokenDataset::build(&files, "text", &tok, 0.0, &dir.path().join("c"))
        .unwrap()
        .train;
    let mut whole: Vec<i64> = train[..train.len() - 1].iter().map(|&t| t as i64).collect();
    whole.sort();
    for mut e in epochs {
        // Each epoch's stream is every document once, less the last target (always an EOS).
        e.sort();
        assert_eq!(e, whole);
    }
}

#[test]
fn a_restored_stream_continues_bit_for_bit_from_any_window() {
    let dir = tempfile::tempdir().unwrap();
    let files = corpus(dir.path());
    let tok = tokenizer(&files);
    let mut reference = StreamingLoader::new(spec(&files, 6, 4, true), tok.clone()).unwrap();
    let mut states = Vec::new();
    let mut rows = Vec::new();
    for _ in 0..400 {
        states.push(reference.state());
        rows.push(reference.next_batch(1).unwrap());
    }
    assert!(
        states.iter().any(|s| s.epoch >= 1),
        "the walk crosses an epoch"
    );
    let mut restored = StreamingLoader::new(spec(&files, 6, 4, true), tok).unwrap();
    for cut in (0..390).step_by(7) {
        // Through JSON, as a checkpoint stores it.
        let saved: LoaderState =
            serde_json::from_str(&serde_json::to_string(&states[cut]).unwrap()).unwrap();
        restored.restore(&saved).unwrap();
        for row in &rows[cut..cut + 10] {
            assert_eq!(&restored.next_batch(1).unwrap(), row, "from window {cut}");
        }
    }
}

#[test]
fn a_place_from_other_settings_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let files = corpus(dir.path());
    let tok = tokenizer(&files);
    let mut a = StreamingLoader::new(spec(&files, 6, 4, true), tok.clone()).unwrap();
    a.next_batch(9).unwrap();
    let state = a.state();
    let mut b = StreamingLoader::new(spec(&files, 6, 8, true), tok.clone()).unwrap();
    let e = b.restore(&state).unwrap_err().to_string();
    assert!(e.contains("blocks of 4 windows"), "{e}");
    let mut bad = state.clone();
    bad.stream.as_mut().unwrap().doc.file = 99;
    let e = a.restore(&bad).unwrap_err().to_string();
    assert!(e.contains("other data"), "{e}");
}

#[test]
fn a_large_text_file_streams_in_pieces_that_lose_no_byte() {
    let dir = tempfile::tempdir().unwrap();
    // 2.5 pieces: lines of mixed scripts, and a run with no line end longer than a piece's
    // limit, so a piece is cut inside it (at a character boundary).
    let mut text = String::new();
    let mut i = 0;
    while text.len() < PIECE_BYTES * 5 / 2 {
        text += ["ember glow 雨 ", "светлый river\n", "ödland, quiet\n"][i % 3];
        i += 1;
    }
    text += &"雨".repeat((5 << 20) / 3);
    text += "\nthe end";
    std::fs::write(dir.path().join("big.txt"), &text).unwrap();
    let files = discover_files(dir.path()).unwrap();
    let tok = TextTokenizer::train_bpe_on_texts(&[text[..20_000].to_string()], 300).unwrap();
    let seq = 4096;
    let mut stream = StreamingLoader::new(spec(&files, seq, 16, false), tok.clone()).unwrap();
    let mut bytes: Vec<u8> = Vec::new();
    loop {
        let w = windows(&stream.next_batch(1).unwrap()).remove(0);
        for &id in &w[..seq] {
            bytes.extend(tok.token_bytes(id as u32));
        }
        if stream.state().cursor == 0 {
            break;
        }
    }
    assert!(
        bytes.len() > text.len() * 9 / 10,
        "{} of {} bytes",
        bytes.len(),
        text.len()
    );
    assert!(
        bytes == text.as_bytes()[..bytes.len()],
        "the pieces concatenate to the file"
    );
}

#[test]
fn held_out_tails_and_training_heads_keep_every_token_once() {
    let dir = tempfile::tempdir().unwrap();
    let files = corpus(dir.path());
    let tok = tokenizer(&files);
    let (val, split) = held_out(&files, "text", &tok, 0.25, 40).unwrap();
    assert!(val.len() >= 40);
    assert!(
        split.until.file == 0,
        "the first file's documents fill 40 tokens"
    );
    let memory = TokenDataset::build(&files, "text", &tok, 0.0, &dir.path().join("c")).unwrap();
    let whole = memory.train.len();
    let mut s = spec(&files, 4, 1000, false);
    s.held_out = Some(split);
    let mut stream = StreamingLoader::new(s, tok.clone()).unwrap();
    // The training stream lost the tails (their EOS stays with each head).
    let eos_in_val = val.iter().filter(|&&t| t == tok.eos_id()).count();
    let train_len = whole - (val.len() - eos_in_val);
    let windows_per_epoch = (train_len - 1) / 4;
    let mut served = 0;
    while stream.state().epoch == 0 {
        stream.next_batch(1).unwrap();
        served += 1;
    }
    assert_eq!(served, windows_per_epoch);
}

//! Pre-tokenized data (`data.format = "tokens"`, guessed from `.bin` paths): nanoGPT's raw
//! `train.bin` / `val.bin`, llm.c's shards with their header and Megatron's `.bin` + `.idx`
//! pairs, holding the very ids the text path tokenizes, train on the same windows in the same
//! order: the same losses and held-out losses bit for bit, and a resumed run continues the same
//! curve. Ids outside the tokenizer and files that contradict their header are refused by name.

#[path = "dist_support.rs"]
mod dist_support;

use anneal_data::{discover_files, TextTokenizer, TokenDataset};
use anneal_tests::cli as common;

use common::{losses, ok, rows, Job};
use std::path::{Path, PathBuf};

fn val_losses(run: &Path) -> Vec<u64> {
    rows(run)
        .iter()
        .filter_map(|r| r["val_loss"].as_f64())
        .map(f64::to_bits)
        .collect()
}

fn u16_bytes(ids: &[u32]) -> Vec<u8> {
    ids.iter()
        .flat_map(|&t| u16::try_from(t).unwrap().to_le_bytes())
        .collect()
}

/// An llm.c shard: the 256-int header (magic, version 1 for u16 ids, the count), then the ids.
fn llmc(ids: &[u32]) -> Vec<u8> {
    let mut out = vec![0u8; 1024];
    out[..4].copy_from_slice(&20240520i32.to_le_bytes());
    out[4..8].copy_from_slice(&1i32.to_le_bytes());
    out[8..12].copy_from_slice(&(ids.len() as i32).to_le_bytes());
    out.extend(u16_bytes(ids));
    out
}

/// A Megatron pair `prefix.bin` / `prefix.idx` of u16 ids (dtype code 8), one sequence per
/// `doc`-id piece.
fn megatron(prefix: &Path, ids: &[u32], doc: usize) {
    std::fs::write(prefix.with_extension("bin"), u16_bytes(ids)).unwrap();
    let seqs: Vec<usize> = ids.chunks(doc).map(<[u32]>::len).collect();
    let mut idx = b"MMIDIDX\x00\x00".to_vec();
    idx.extend(1u64.to_le_bytes());
    idx.push(8);
    idx.extend((seqs.len() as u64).to_le_bytes());
    idx.extend((seqs.len() as u64 + 1).to_le_bytes());
    for &n in &seqs {
        idx.extend((n as i32).to_le_bytes());
    }
    let mut at = 0i64;
    for &n in &seqs {
        idx.extend(at.to_le_bytes());
        at += 2 * n as i64;
    }
    for i in 0..=seqs.len() as i64 {
        idx.extend(i.to_le_bytes());
    }
    std::fs::write(prefix.with_extension("idx"), idx).unwrap();
}

/// The tokenizer a one-step run of the job trains on its corpus, as `<dir>/tokenizer.json`.
fn trained_tokenizer(job: &Job) -> PathBuf {
    let (out, first) = job.train("tokenizer", &["training.steps=1", "metrics.eval_freq=0"]);
    ok(&out);
    let tok = job.dir.join("tokenizer.json");
    std::fs::copy(first.join("tokenizer.json"), &tok).unwrap();
    tok
}

fn folder(job: &Job, name: &str, files: &[(&str, Vec<u8>)]) -> PathBuf {
    let dir = job.dir.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    for (f, bytes) in files {
        std::fs::write(dir.join(f), bytes).unwrap();
    }
    dir
}

#[test]
fn token_files_train_as_the_text_they_were_made_from() {
    let job = Job::new("tokens");
    // A tokenizer trained on the corpus, then the text run every format must follow.
    let tok = trained_tokenizer(&job);
    let tokenizer = format!("data.tokenizer=\"{}\"", tok.display());
    let (out, text) = job.train("text", &[&tokenizer]);
    ok(&out);
    let (want, want_val) = (losses(&text), val_losses(&text));
    assert_eq!((want.len(), want_val.len()), (8, 2));

    // The same ids as the text run's streams (the tiny config holds out 10%).
    let files = discover_files(&job.dir.join("corpus")).unwrap();
    let t = TextTokenizer::from_file(&tok).unwrap();
    let ds = TokenDataset::build(&files, "text", &t, 0.1, &job.dir.join("ids-cache")).unwrap();
    let half = ds.train.len() / 2;
    let nano = folder(
        &job,
        "nanogpt",
        &[
            ("train.bin", u16_bytes(&ds.train)),
            ("val.bin", u16_bytes(&ds.val)),
        ],
    );
    let llmc = folder(
        &job,
        "llmc",
        &[
            ("tiny_train_000000.bin", llmc(&ds.train[..half])),
            ("tiny_train_000001.bin", llmc(&ds.train[half..])),
            ("tiny_val_000000.bin", llmc(&ds.val)),
        ],
    );
    let mega = folder(&job, "megatron", &[]);
    megatron(&mega.join("train"), &ds.train, 97);
    megatron(&mega.join("val"), &ds.val, 97);
    for (name, dir, format) in [
        ("nanogpt", &nano, "auto"),
        ("llmc", &llmc, "tokens"),
        ("megatron", &mega, "auto"),
    ] {
        let path = format!("data.path=\"{}\"", dir.display());
        let format = format!("data.format=\"{format}\"");
        let (out, run) = job.train(name, &[&tokenizer, &path, &format]);
        let log = ok(&out);
        assert!(log.contains("read in place"), "{name}: {log}");
        assert_eq!(losses(&run), want, "{name}: training losses");
        assert_eq!(val_losses(&run), want_val, "{name}: held-out losses");
    }

    // One Megatron prefix with no held-out files: the stream's tail is held out instead.
    megatron(&job.dir.join("single"), &ds.train, 50);
    let prefix = format!("data.path=\"{}\"", job.dir.join("single").display());
    let (out, run) = job.train("prefix", &[&tokenizer, &prefix, "training.steps=2"]);
    ok(&out);
    assert_eq!(losses(&run).len(), 2);
    // The held-out tail is evaluated at the end of the run.
    assert_eq!(val_losses(&run).len(), 1);

    // Resume: a run whose last checkpoint is step 4 (step 8's lost, as in a crash before it
    // was published) continues from there on the same curve, bit for bit.
    let path = format!("data.path=\"{}\"", nano.display());
    let set = [tokenizer.as_str(), path.as_str(), "checkpoint.interval=4"];
    let (out, run) = job.train("resumed", &set);
    ok(&out);
    std::fs::remove_dir_all(run.join("checkpoints/step-8")).unwrap();
    let (out, run) = job.train("resumed", &set);
    let log = ok(&out);
    assert!(
        log.contains("resuming from") && log.contains("(step 4)"),
        "{log}"
    );
    assert_eq!(losses(&run), want);
}

#[test]
fn token_files_refuse_what_they_cannot_train_on() {
    let job = Job::new("tokens-bad");
    let tok = format!("data.tokenizer=\"{}\"", trained_tokenizer(&job).display());
    // Without the tokenizer that made them.
    let ids: Vec<u32> = (0..4000).map(|i| i % 300).collect();
    let dir = folder(&job, "nano", &[("train.bin", u16_bytes(&ids))]);
    let path = format!("data.path=\"{}\"", dir.display());
    let out = job.train("untokenized", &[&path]).0;
    common::user_error(&out, &["`data.tokenizer`", "token files"]);
    // A file whose header contradicts its size.
    let mut cut = llmc(&ids);
    cut.truncate(cut.len() - 2);
    let bad = folder(&job, "cut", &[("a.bin", cut)]);
    let out = job
        .train("cut", &[&tok, &format!("data.path=\"{}\"", bad.display())])
        .0;
    common::user_error(
        &out,
        &["`data.path`", "a.bin", "llm.c header counts 4000 ids"],
    );
    // An id the tokenizer does not have (320 tokens) stops the run naming file and index.
    let mut big = ids.clone();
    big[1234] = 5000;
    let wide = folder(&job, "wide", &[("train.bin", u16_bytes(&big))]);
    let set = [
        tok.as_str(),
        &format!("data.path=\"{}\"", wide.display()),
        "data.shuffle=false",
        "training.steps=20",
    ];
    let (out, _) = job.train("wide", &set);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("train.bin") && err.contains("id 5000 at index 1234"),
        "{err}"
    );
}

fn columnar(name: &str) -> PathBuf {
    common::root()
        .join("host/data/tests/fixtures/columnar")
        .join(name)
}

#[test]
fn parquet_and_saved_datasets_train_as_their_json_lines() {
    // The same records as JSON lines, Parquet and a dataset saved by `datasets` (written by
    // host/data/tests/reference/make_columnar_fixtures.py): text documents, then
    // conversations (a DatasetDict's train split), each the same losses bit for bit.
    let job = Job::new("columnar");
    for (what, set) in [
        ("docs", ["training.seq_len=32"]),
        ("chat", ["training.seq_len=64"]),
    ] {
        let mut curves = Vec::new();
        for (file, format) in [
            (format!("{what}.jsonl"), "auto"),
            (format!("{what}.parquet"), "auto"),
            (format!("{what}.parquet"), "parquet"),
            (format!("{what}_hf"), "hf_dataset"),
            (format!("{what}_hf"), "auto"),
        ] {
            let path = format!("data.path=\"{}\"", columnar(&file).display());
            let fmt = format!("data.format=\"{format}\"");
            let run = format!("{what}-{format}-{}", file.replace('.', "-"));
            let (out, run) = job.train(&run, &[&path, &fmt, set[0]]);
            let log = ok(&out);
            assert_eq!(
                log.contains("conversations"),
                what == "chat",
                "{file}: {log}"
            );
            curves.push((file, format, losses(&run), val_losses(&run)));
        }
        let (first, rest) = curves.split_first().unwrap();
        assert_eq!(first.2.len(), 8);
        for c in rest {
            assert_eq!((&c.2, &c.3), (&first.2, &first.3), "{} as {}", c.0, c.1);
        }
    }
    // A container that is not what data.format says.
    let path = format!("data.path=\"{}\"", columnar("docs.jsonl").display());
    let out = job.train("wrong", &[&path, "data.format=\"parquet\""]).0;
    common::user_error(&out, &["`data.path`", "docs.jsonl is not a .parquet file"]);
    let path = format!("data.path=\"{}\"", columnar("").display());
    let out = job
        .train("notsaved", &[&path, "data.format=\"hf_dataset\""])
        .0;
    common::user_error(&out, &["`data.path`", "not a dataset saved by `datasets`"]);
}

#[test]
fn a_mixture_keeps_its_weights_over_a_thousand_steps_and_resumes_bit_for_bit() {
    // Text (the corpus, tokenized at start) and token files (the columnar fixture's documents
    // as nanoGPT ids) at 3 : 1, sharing a tokenizer trained on the corpus.
    let job = Job::new("mixture");
    let tok = trained_tokenizer(&job);
    let t = TextTokenizer::from_file(&tok).unwrap();
    let docs = vec![columnar("docs.jsonl")];
    let ds = TokenDataset::build(&docs, "text", &t, 0.0, &job.dir.join("ids-cache")).unwrap();
    let ids = folder(&job, "ids", &[("train.bin", u16_bytes(&ds.train))]);
    let mix = format!(
        "data.sources=[{{ path = \"{}\", weight = 3.0 }}, {{ path = \"{}\", weight = 1.0 }}]",
        job.dir.join("corpus").display(),
        ids.display()
    );
    let tokenizer = format!("data.tokenizer=\"{}\"", tok.display());
    let set = [
        mix.as_str(),
        tokenizer.as_str(),
        "training.steps=1000",
        "metrics.log_freq=100",
        "metrics.eval_freq=500",
        "checkpoint.interval=500",
    ];
    let (out, run) = job.train("mix", &set);
    let log = ok(&out);
    assert!(log.contains("a mixture of 2 sources"), "{log}");
    let all = rows(&run);
    for r in all.iter().filter(|r| r["loss"].is_number()) {
        let step = r["step"].as_u64().unwrap();
        let drawn: Vec<u64> = r["data_source_rows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        assert_eq!(drawn.iter().sum::<u64>(), 4 * step);
        let share = drawn[0] as f64 / (4 * step) as f64;
        assert!((share - 0.75).abs() <= 0.01, "step {step}: {drawn:?}");
    }
    assert_eq!(
        all.last().unwrap()["data_source_rows"],
        serde_json::json!([3000, 1000])
    );
    // Resumed from step 500, the second half follows the same curve, source by source.
    let want = losses(&run);
    std::fs::remove_dir_all(run.join("checkpoints/step-1000")).unwrap();
    let (out, run) = job.train("mix", &set);
    let log = ok(&out);
    assert!(log.contains("(step 500)"), "{log}");
    assert_eq!(losses(&run), want);
    // Two data-parallel ranks, each reading only its rows of every global batch (micro-batch
    // 2, a row split), walk the same mixture: step 1 is the same loss bit for bit, the rest
    // within DDP's rounding, and the same rows drawn from each source.
    let short = [
        mix.as_str(),
        tokenizer.as_str(),
        "training.steps=12",
        "training.micro_batch_size=2",
        "training.threads=1",
        "metrics.eval_freq=0",
    ];
    let (out, one) = job.train("mix-single", &short);
    ok(&out);
    let two = job.dir.join("mix-ddp");
    ok(&dist_support::mpiexec_train(2, &job, &two, &short));
    let (a, b) = (
        dist_support::loss_values(&one),
        dist_support::loss_values(&two),
    );
    assert_eq!((a.len(), b.len()), (12, 12));
    assert_eq!(a[0].to_bits(), b[0].to_bits());
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-5 * x.abs(), "{a:?} vs {b:?}");
    }
    assert_eq!(
        rows(&one).last().unwrap()["data_source_rows"],
        rows(&two).last().unwrap()["data_source_rows"]
    );
    // A chat source is refused by its key.
    let chat = format!(
        "data.sources=[{{ path = \"{}\", weight = 1.0 }}]",
        columnar("chat.jsonl").display()
    );
    let out = job.train("chat", &[&chat]).0;
    common::user_error(&out, &["`data.sources[0].path`", "conversations"]);
}

#[test]
fn a_streamed_corpus_trains_as_in_memory_and_resumes_bit_for_bit() {
    let job = Job::new("stream");
    let tok = trained_tokenizer(&job);
    let tokenizer = format!("data.tokenizer=\"{}\"", tok.display());
    // In order and with nothing held out, the streamed windows are the in-memory ones.
    let plain = [
        tokenizer.as_str(),
        "data.shuffle=false",
        "data.val_fraction=0.0",
    ];
    let (out, memory) = job.train("memory", &plain);
    ok(&out);
    let (out, streamed) = job.train("streamed", &[&plain[..], &["data.streaming=true"]].concat());
    let log = ok(&out);
    assert!(log.contains("data: streaming 4 files"), "{log}");
    assert_eq!(losses(&streamed), losses(&memory));
    let trained = rows(&streamed);
    let trained: Vec<_> = trained.iter().filter(|r| r["loss"].is_number()).collect();
    assert!(
        trained.iter().all(|r| r["data_wait_s"].as_f64().is_some()),
        "{trained:?}"
    );

    // The defaults: shuffled, a tokenizer trained on the stream's first documents, held-out
    // tokens from them; a run whose last checkpoint is step 4 continues the same curve.
    let set = ["data.streaming=true", "checkpoint.interval=4"];
    let (out, run) = job.train("resumed", &set);
    ok(&out);
    assert_eq!(val_losses(&run).len(), 2);
    let want = losses(&run);
    assert_eq!(want.len(), 8);
    std::fs::remove_dir_all(run.join("checkpoints/step-8")).unwrap();
    let (out, run) = job.train("resumed", &set);
    let log = ok(&out);
    assert!(log.contains("(step 4)"), "{log}");
    assert_eq!(losses(&run), want);

    // Two data-parallel ranks stream the same windows, each copying only its rows: step 1
    // bit for bit, the rest within DDP's rounding.
    let short = [
        "data.streaming=true",
        "training.steps=6",
        "training.micro_batch_size=2",
        "training.threads=1",
        "metrics.eval_freq=0",
    ];
    let (out, one) = job.train("stream-single", &short);
    ok(&out);
    let two = job.dir.join("stream-ddp");
    ok(&dist_support::mpiexec_train(2, &job, &two, &short));
    dist_support::assert_follows(&one, &two, 6);

    // What streaming does not read is refused by its key.
    let chat = format!("data.path=\"{}\"", columnar("chat.jsonl").display());
    let out = job.train("stream-chat", &["data.streaming=true", &chat]).0;
    common::user_error(&out, &["`data.streaming`", "chat"]);
    let mix = format!(
        "data.sources=[{{ path = \"{}\", weight = 1.0 }}]",
        job.dir.join("corpus").display()
    );
    let out = job.train("stream-mix", &["data.streaming=true", &mix]).0;
    common::user_error(&out, &["`data.streaming`", "data.sources"]);
}

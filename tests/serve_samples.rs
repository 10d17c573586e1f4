//! An RL run's samples over the API when `samples.jsonl` is large (~100 MB, written here into
//! the run dir of a real run of a real `anneal serve`): the newest page, a deep page, a step and
//! the filters answer correctly, ten requests at once too, while the server's peak memory stays
//! far below the file's size (reading the whole file per request held ~0.9 GB each). Rows the
//! run appends later (half a line first) and a file replaced by a shorter one (a resume dropping
//! rows past its checkpoint) are seen by the next request.

use anneal_tests::serve as serve_common;

use serde_json::{json, Value};
use serve_common::{temp_home, tiny_configs, Server};
use std::io::Write;
use std::path::Path;
use std::time::Duration;

/// Samples per step, and steps: 64 × 1200 samples of about 1.3 KB.
const PER_STEP: u64 = 64;
const STEPS: u64 = 1200;

/// One sample as `anneal rl` writes it (its fields, about 1 KB).
fn sample(step: u64, j: u64) -> Value {
    let reward = ((step * 7 + j) % 20) as f64 / 20.0 - 0.25;
    let correct = match j % 3 {
        0 => json!(false),
        1 => json!(true),
        _ => Value::Null,
    };
    let error = if (step + j).is_multiple_of(11) {
        json!("trap")
    } else {
        Value::Null
    };
    json!({
        "step": step, "version": step - 1, "prompt_index": step * PER_STEP + j, "sample": j,
        "prompt": format!("sort {step} {j} ="), "completion": "0123456789abcdef".repeat(56),
        "tokens": 896, "reward": reward, "correct": correct,
        "scores": [
            {"name": "position_match.wat", "weight": 1.0, "score": reward, "reward": reward,
             "correct": correct, "error": Value::Null, "message": Value::Null},
            {"name": "length_parity.wat", "weight": 0.5, "score": Value::Null, "reward": -1.0,
             "correct": Value::Null, "error": error, "message": Value::Null},
        ],
    })
}

/// What the filters should count over steps `1..=steps`.
#[derive(Default, Debug)]
struct Expected {
    total: u64,
    not_correct: u64,
    erroring: u64,
    /// Failed below a reward of 0.25 (not correct, or reward < 0.25) and erroring.
    low_erroring: u64,
}

/// Writes steps `1..=steps` to `path`; returns the counts and the file's size.
fn write_samples(path: &Path, steps: u64) -> (Expected, u64) {
    let mut out = std::io::BufWriter::new(std::fs::File::create(path).expect("create"));
    let mut e = Expected::default();
    for step in 1..=steps {
        for j in 0..PER_STEP {
            let s = sample(step, j);
            let not_correct = s["correct"] == false;
            let erroring = !s["scores"][1]["error"].is_null();
            e.total += 1;
            e.not_correct += u64::from(not_correct);
            e.erroring += u64::from(erroring);
            let low = not_correct || s["reward"].as_f64().is_some_and(|r| r < 0.25);
            e.low_erroring += u64::from(low && erroring);
            writeln!(out, "{s}").expect("write");
        }
    }
    out.flush().expect("flush");
    (e, std::fs::metadata(path).expect("size").len())
}

/// The server's peak resident memory so far (`VmHWM`), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM");
    kb * 1024
}

fn page(server: &Server, id: i64, query: &str) -> Value {
    let (code, page) = server.get(&format!("/api/runs/{id}/samples?{query}"));
    assert_eq!(code, 200, "{query}: {page}");
    page
}

/// The (step, sample) of each sample of a page.
fn keys(page: &Value) -> Vec<(u64, u64)> {
    page["samples"]
        .as_array()
        .expect("samples")
        .iter()
        .map(|s| {
            (
                s["step"].as_u64().expect("step"),
                s["sample"].as_u64().expect("j"),
            )
        })
        .collect()
}

#[test]
fn a_large_samples_file_pages_newest_first_in_bounded_memory() {
    let home = temp_home("samples");
    let configs = tiny_configs(&home);
    let server = Server::start(&home, &["--configs", configs.to_str().expect("utf-8")]);
    let (code, body) = server.post(
        "/api/runs",
        &json!({ "name": "big", "config_path": "configs/tiny.toml", "overrides": ["training.steps=1"] }),
    );
    assert_eq!(code, 201, "{body}");
    let id = body["id"].as_i64().expect("id");
    let run = server.wait_status(id, &["completed"], Duration::from_secs(180));
    let run_dir = Path::new(run["run_dir"].as_str().expect("run dir")).to_path_buf();
    let path = run_dir.join("samples.jsonl");
    let (expected, size) = write_samples(&path, STEPS);
    assert!(size > 90 << 20, "{size} bytes");
    let pid = server.child.id();
    let before = peak_rss(pid);

    // The newest page: the last step, in the order written.
    let newest = page(&server, id, "limit=50");
    assert_eq!(newest["total"], expected.total);
    assert_eq!(newest["counts"]["all"], expected.total);
    assert_eq!(newest["counts"]["failed"], expected.not_correct);
    assert_eq!(newest["counts"]["erroring"], expected.erroring);
    assert_eq!(
        newest["steps"].as_array().map(Vec::len),
        Some(STEPS as usize)
    );
    let want: Vec<_> = (0..50).map(|j| (STEPS, j)).collect();
    assert_eq!(keys(&newest), want);
    assert_eq!(
        newest["samples"][0],
        sample(STEPS, 0),
        "whole samples come back"
    );
    // A page across a step boundary, and the oldest page.
    let across = page(&server, id, "offset=60&limit=8");
    let want: Vec<_> = [(STEPS, 60), (STEPS, 61), (STEPS, 62), (STEPS, 63)]
        .into_iter()
        .chain((0..4).map(|j| (STEPS - 1, j)))
        .collect();
    assert_eq!(keys(&across), want);
    let oldest = page(
        &server,
        id,
        &format!("offset={}&limit=500", expected.total - 10),
    );
    let want: Vec<_> = (PER_STEP - 10..PER_STEP).map(|j| (1, j)).collect();
    assert_eq!(keys(&oldest), want);
    // A step; the filters over the whole file.
    let step = page(&server, id, "step=800&limit=500");
    assert_eq!(step["total"], PER_STEP);
    assert_eq!(
        keys(&step),
        (0..PER_STEP).map(|j| (800, j)).collect::<Vec<_>>()
    );
    let both = page(
        &server,
        id,
        "failed=true&threshold=0.25&erroring=true&limit=500",
    );
    assert_eq!(both["total"], expected.low_erroring);
    assert!(both["samples"]
        .as_array()
        .expect("samples")
        .iter()
        .all(|s| {
            let low = s["reward"].as_f64().is_some_and(|r| r < 0.25);
            (s["correct"] == false || low) && s["scores"][1]["error"] == "trap"
        }));

    // Ten at once, each a different deep page.
    std::thread::scope(|scope| {
        let asks: Vec<_> = (0..10u64)
            .map(|k| {
                let server = &server;
                scope.spawn(move || {
                    let offset = k * 7_000 + 5;
                    let got = page(server, id, &format!("offset={offset}&limit=500"));
                    let first = (STEPS - offset / PER_STEP, offset % PER_STEP);
                    (keys(&got).len(), keys(&got).first().copied(), first)
                })
            })
            .collect();
        for ask in asks {
            let (n, first, want) = ask.join().expect("a request");
            assert_eq!((n, first), (500, Some(want)));
        }
    });
    let grown = peak_rss(pid).saturating_sub(before);
    println!(
        "samples.jsonl: {} MiB; the server's peak memory grew by {} MiB",
        size >> 20,
        grown >> 20
    );
    assert!(
        grown < size / 4,
        "the server's peak memory grew by {grown} bytes reading a {size}-byte file"
    );

    // The run appends: half a line is not a sample yet; finished, it is the newest.
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .expect("append");
    let next = format!("{}\n", sample(STEPS + 1, 0));
    f.write_all(&next.as_bytes()[..100]).expect("write");
    assert_eq!(page(&server, id, "limit=1")["total"], expected.total);
    f.write_all(&next.as_bytes()[100..]).expect("write");
    let appended = page(&server, id, "limit=1");
    assert_eq!(appended["total"], expected.total + 1);
    assert_eq!(keys(&appended), [(STEPS + 1, 0)]);

    // A resume replaces the file by a shorter one: read again from its start.
    let tmp = run_dir.join("samples.jsonl.tmp");
    let (half, _) = write_samples(&tmp, STEPS / 2);
    std::fs::rename(&tmp, &path).expect("rename");
    let resumed = page(&server, id, "limit=1");
    assert_eq!(resumed["total"], half.total);
    assert_eq!(keys(&resumed), [(STEPS / 2, 0)]);
}

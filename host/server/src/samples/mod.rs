//! An RL run's `samples.jsonl` (written by `anneal rl`: step, prompt, completion, the combined
//! reward, `correct`, and each reward module's score and error): the samples view reads it
//! through filters, newest step first, a page at a time.
//!
//! A file of hundreds of megabytes is never read whole: the server keeps an index of each run's
//! file ([`index`]: per run of one step, its byte range and per-filter counts, plus the rewards a
//! threshold may count), brought up to date by reading only what was appended since the last
//! request; a page then reads just the lines of the steps it shows ([`lines`]). Memory follows
//! the number of steps and samples indexed (a few bytes each), never the file's size.

mod index;
mod lines;

pub use index::{is_erroring, is_failed, Filter};

use index::{sample_of, Index};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

/// The samples file in a run dir.
pub const SAMPLES_FILE: &str = "samples.jsonl";

/// The most samples one page may hold.
pub const MAX_LIMIT: usize = 500;

/// A page stops early (with at least one sample) once its lines add up to this many bytes, so
/// long completions cannot make a page large: the next page starts where it stopped.
pub const MAX_PAGE_BYTES: usize = 8 << 20;

/// Sample requests read at once; more wait their turn, so memory stays a few pages.
pub const MAX_READERS: usize = 4;

/// Runs whose index is kept; the least recently read is dropped beyond this.
const MAX_INDEXES: usize = 64;

/// Which samples to list, and which page of them.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Query {
    /// Only this step's samples.
    pub step: Option<u64>,
    /// Only failed samples: those a module called not correct, and (with `threshold`) those
    /// whose reward is below it.
    #[serde(default)]
    pub failed: bool,
    /// The reward below which a sample counts as failed.
    pub threshold: Option<f64>,
    /// Only samples where some reward module's call failed.
    #[serde(default)]
    pub erroring: bool,
    /// Samples to skip (after filtering).
    #[serde(default)]
    pub offset: usize,
    /// Samples per page (default 50, at most [`MAX_LIMIT`]).
    pub limit: Option<usize>,
}

/// How many samples of the chosen step(s) each filter keeps (before paging).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Counts {
    /// All samples.
    pub all: usize,
    /// Failed ones.
    pub failed: usize,
    /// Ones with a reward error.
    pub erroring: usize,
}

/// One page of samples.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Page {
    /// Samples matching the filters (all pages).
    pub total: usize,
    /// The first one on this page.
    pub offset: usize,
    /// The page size asked for (the page holds fewer at the end, or when its samples reach
    /// [`MAX_PAGE_BYTES`]).
    pub limit: usize,
    /// Every step the file has samples of, ascending (for a step picker).
    pub steps: Vec<u64>,
    /// Per-filter counts over the chosen step(s).
    pub counts: Counts,
    /// The page: newest step first, in the order the run wrote them within a step.
    pub samples: Vec<Map<String, Value>>,
}

/// The samples of every run the server was asked about: one index per run (see the module
/// docs), and a bound on how many requests read at once.
pub struct Samples {
    indexes: Mutex<HashMap<PathBuf, Entry>>,
    readers: tokio::sync::Semaphore,
    uses: std::sync::atomic::AtomicU64,
}

struct Entry {
    index: Arc<Mutex<Index>>,
    last_use: u64,
}

impl Default for Samples {
    fn default() -> Self {
        Samples {
            indexes: Mutex::new(HashMap::new()),
            readers: tokio::sync::Semaphore::new(MAX_READERS),
            uses: std::sync::atomic::AtomicU64::new(0),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // An index is rebuilt from the file whenever it looks wrong, so a poisoned one is still safe
    // to use.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Samples {
    /// Waits for a turn to read (at most [`MAX_READERS`] at once).
    pub async fn turn(&self) -> tokio::sync::SemaphorePermit<'_> {
        self.readers
            .acquire()
            .await
            .expect("the readers' semaphore is never closed")
    }

    fn index_of(&self, run_dir: &Path) -> Arc<Mutex<Index>> {
        let now = self.uses.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut indexes = lock(&self.indexes);
        if !indexes.contains_key(run_dir) && indexes.len() >= MAX_INDEXES {
            let oldest = indexes
                .iter()
                .min_by_key(|(_, e)| e.last_use)
                .map(|(p, _)| p.clone());
            if let Some(p) = oldest {
                indexes.remove(&p);
            }
        }
        let entry = indexes
            .entry(run_dir.to_path_buf())
            .or_insert_with(|| Entry {
                index: Arc::default(),
                last_use: now,
            });
        entry.last_use = now;
        Arc::clone(&entry.index)
    }

    /// Reads the page `query` asks for from `<run_dir>/samples.jsonl` (complete lines only: the
    /// run may be writing the last one). A run without the file has no samples.
    pub fn read(&self, run_dir: &Path, query: &Query) -> std::io::Result<Page> {
        let index = self.index_of(run_dir);
        let mut index = lock(&index);
        let limit = query.limit.unwrap_or(50).clamp(1, MAX_LIMIT);
        let mut page = Page {
            offset: query.offset,
            limit,
            ..Page::default()
        };
        let Some(file) = index.refresh(&run_dir.join(SAMPLES_FILE))? else {
            return Ok(page);
        };
        let filter = Filter {
            failed: query.failed,
            threshold: query.threshold,
            erroring: query.erroring,
        };
        let spans = index.spans();
        page.steps = spans
            .iter()
            .map(|s| s.step)
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        // Newest step first; stable, so a step's samples stay in the order the run wrote them.
        let mut chosen: Vec<_> = spans
            .iter()
            .filter(|s| query.step.is_none_or(|step| s.step == step))
            .collect();
        chosen.sort_by_key(|s| std::cmp::Reverse(s.step));
        let failed = Filter {
            failed: true,
            threshold: query.threshold,
            erroring: false,
        };
        let erroring = Filter {
            erroring: true,
            ..Filter::default()
        };
        for span in &chosen {
            page.counts.all += span.all;
            page.counts.failed += span.matching(&failed);
            page.counts.erroring += span.matching(&erroring);
            page.total += span.matching(&filter);
        }
        // Whole spans before the page are skipped by their counts; only the spans the page
        // shows are read.
        let mut skip = query.offset;
        let mut bytes = 0;
        for span in chosen {
            let matching = span.matching(&filter);
            if skip >= matching {
                skip -= matching;
                continue;
            }
            let mut lines = lines::Lines::new(&file, span.start, span.end, lines::MAX_LINE)?;
            while let Some(line) = lines.next_line()? {
                let Some((step, row)) = line.text.and_then(sample_of) else {
                    continue;
                };
                if step != span.step || !filter.keeps(&row) {
                    continue;
                }
                if skip > 0 {
                    skip -= 1;
                    continue;
                }
                bytes += line.end - line.start;
                page.samples.push(row);
                if page.samples.len() >= limit || bytes >= MAX_PAGE_BYTES as u64 {
                    return Ok(page);
                }
            }
        }
        Ok(page)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn row(step: u64, reward: f64, correct: Option<bool>, error: Option<&str>) -> String {
        let v = json!({
            "step": step, "prompt": "p", "completion": "c", "reward": reward, "correct": correct,
            "scores": [{"name": "a", "error": Value::Null}, {"name": "b", "error": error}],
        });
        format!("{v}\n")
    }

    /// A run dir whose samples file holds `text`.
    fn run_dir(name: &str, text: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("anneal-samples-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        std::fs::write(dir.join(SAMPLES_FILE), text).expect("write");
        dir
    }

    fn rows() -> String {
        [
            row(1, 1.0, Some(true), None),
            row(1, 0.0, Some(false), None),
            row(1, -1.0, None, Some("trap")),
            row(2, 0.5, Some(true), None),
            row(2, 0.2, None, None),
            row(2, -1.0, Some(false), Some("timeout")),
        ]
        .concat()
    }

    fn read(dir: &Path, query: &Query) -> Page {
        Samples::default().read(dir, query).expect("read")
    }

    #[test]
    fn filters_combine_and_the_threshold_widens_failed() {
        let dir = run_dir("filters", &rows());
        let q = |failed, erroring, threshold| Query {
            failed,
            erroring,
            threshold,
            ..Query::default()
        };
        let samples = Samples::default();
        let all = samples.read(&dir, &Query::default()).expect("read");
        assert_eq!(all.total, 6);
        assert_eq!(all.steps, [1, 2]);
        assert_eq!(
            all.counts,
            Counts {
                all: 6,
                failed: 2,
                erroring: 2
            }
        );
        // Newest step first, written order within a step.
        let order: Vec<f64> = all
            .samples
            .iter()
            .map(|r| r["reward"].as_f64().expect("reward"))
            .collect();
        assert_eq!(order, [0.5, 0.2, -1.0, 1.0, 0.0, -1.0]);
        let total = |query: Query| {
            let p = samples.read(&dir, &query).expect("read");
            assert_eq!(p.samples.len(), p.total, "{query:?}");
            assert!(p.samples.iter().all(|r| Filter {
                failed: query.failed,
                threshold: query.threshold,
                erroring: query.erroring
            }
            .keeps(r)));
            p.total
        };
        assert_eq!(total(q(true, false, None)), 2);
        // Below 0.3: the two not correct, the trap (-1) and the 0.2 without a verdict.
        assert_eq!(total(q(true, false, Some(0.3))), 4);
        assert_eq!(
            samples
                .read(&dir, &q(true, false, Some(0.3)))
                .expect("read")
                .counts
                .failed,
            4
        );
        assert_eq!(total(q(false, true, None)), 2);
        assert_eq!(total(q(true, true, None)), 1);
        // Failed below 0.3 and erroring: the timeout (not correct) and the trap (-1).
        assert_eq!(total(q(true, true, Some(0.3))), 2);
        let step1 = samples
            .read(
                &dir,
                &Query {
                    step: Some(1),
                    ..Query::default()
                },
            )
            .expect("read");
        assert_eq!(step1.total, 3);
        assert_eq!(step1.counts.erroring, 1);
        assert_eq!(step1.steps, [1, 2], "every step stays listed");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn pages_are_bounded_and_skip_whole_steps() {
        let many: String = (0..700).map(|i| row(i / 10, 0.0, None, None)).collect();
        let dir = run_dir("pages", &many);
        let p = read(
            &dir,
            &Query {
                limit: Some(10_000),
                ..Query::default()
            },
        );
        assert_eq!(
            (p.total, p.limit, p.samples.len()),
            (700, MAX_LIMIT, MAX_LIMIT)
        );
        let last = read(
            &dir,
            &Query {
                offset: 690,
                limit: Some(50),
                ..Query::default()
            },
        );
        assert_eq!(last.samples.len(), 10);
        assert_eq!(last.samples[0]["step"], 0);
        // A page starting inside a step, running into the next.
        let mid = read(
            &dir,
            &Query {
                offset: 15,
                limit: Some(10),
                ..Query::default()
            },
        );
        let steps: Vec<u64> = mid
            .samples
            .iter()
            .filter_map(|r| r["step"].as_u64())
            .collect();
        assert_eq!(steps, [68, 68, 68, 68, 68, 67, 67, 67, 67, 67]);
        assert!(read(
            &dir,
            &Query {
                offset: 700,
                ..Query::default()
            }
        )
        .samples
        .is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_page_of_large_samples_stops_at_its_byte_bound() {
        let big = "x".repeat(1 << 20);
        let text: String = (0..20)
            .map(|i| format!("{}\n", json!({"step": i, "completion": big})))
            .collect();
        let dir = run_dir("big", &text);
        let p = read(
            &dir,
            &Query {
                limit: Some(20),
                ..Query::default()
            },
        );
        assert_eq!(p.total, 20);
        assert_eq!(p.samples.len(), MAX_PAGE_BYTES >> 20);
        assert_eq!(p.samples[0]["step"], 19);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_missing_file_or_a_half_written_line_is_no_sample() {
        let dir = run_dir("half", "");
        std::fs::remove_file(dir.join(SAMPLES_FILE)).expect("remove");
        let samples = Samples::default();
        assert_eq!(
            samples.read(&dir, &Query::default()).expect("read").total,
            0
        );
        std::fs::write(
            dir.join(SAMPLES_FILE),
            "{\"step\":1,\"reward\":1}\nnot json\n[1]\n{\"step\":-1}\n{\"step\":2,\"rew",
        )
        .expect("write");
        let p = samples.read(&dir, &Query::default()).expect("read");
        assert_eq!(p.total, 1);
        assert_eq!(p.steps, [1]);
        // The run finishes the line: the same server sees it.
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(dir.join(SAMPLES_FILE))
            .expect("open");
        std::io::Write::write_all(&mut f, b"ard\":0}\n").expect("append");
        let p = samples.read(&dir, &Query::default()).expect("read");
        assert_eq!((p.total, p.steps.as_slice()), (2, [1, 2].as_slice()));
        assert_eq!(p.samples[0]["step"], 2);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

//! An RL run's `samples.jsonl` (written by `anneal rl`: step, prompt, completion, the combined
//! reward, `correct`, and each reward module's score and error): the samples view reads it
//! through filters, newest step first, a page at a time.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::BTreeSet;
use std::path::Path;

/// The samples file in a run dir.
pub const SAMPLES_FILE: &str = "samples.jsonl";

/// The most samples one page may hold.
pub const MAX_LIMIT: usize = 500;

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
    /// The page size.
    pub limit: usize,
    /// Every step the file has samples of, ascending (for a step picker).
    pub steps: Vec<u64>,
    /// Per-filter counts over the chosen step(s).
    pub counts: Counts,
    /// The page: newest step first, in the order the run wrote them within a step.
    pub samples: Vec<Map<String, Value>>,
}

/// Whether a sample failed: a module called it not correct, or its reward is below `threshold`.
pub fn is_failed(row: &Map<String, Value>, threshold: Option<f64>) -> bool {
    let not_correct = row.get("correct").and_then(Value::as_bool) == Some(false);
    let low = match (threshold, row.get("reward").and_then(Value::as_f64)) {
        (Some(t), Some(r)) => r < t,
        _ => false,
    };
    not_correct || low
}

/// Whether some reward module's call failed for this sample.
pub fn is_erroring(row: &Map<String, Value>) -> bool {
    row.get("scores")
        .and_then(Value::as_array)
        .is_some_and(|scores| scores.iter().any(|s| !s["error"].is_null()))
}

fn step_of(row: &Map<String, Value>) -> Option<u64> {
    row.get("step").and_then(Value::as_u64)
}

/// Reads `<run_dir>/samples.jsonl` (complete lines only: the run may be writing the last one)
/// and returns the page `query` asks for. A run without the file has no samples.
pub fn read(run_dir: &Path, query: &Query) -> Page {
    let text = std::fs::read_to_string(run_dir.join(SAMPLES_FILE)).unwrap_or_default();
    let complete = text.rfind('\n').map_or("", |end| &text[..=end]);
    let rows: Vec<Map<String, Value>> = complete
        .lines()
        .filter_map(|l| match serde_json::from_str::<Value>(l) {
            Ok(Value::Object(m)) if step_of(&m).is_some() => Some(m),
            _ => None,
        })
        .collect();
    page(rows, query)
}

/// Filters, orders and pages rows as [`read`] describes.
pub fn page(rows: Vec<Map<String, Value>>, query: &Query) -> Page {
    let steps: BTreeSet<u64> = rows.iter().filter_map(step_of).collect();
    let mut scoped: Vec<Map<String, Value>> = rows
        .into_iter()
        .filter(|r| query.step.is_none() || step_of(r) == query.step)
        .collect();
    let counts = Counts {
        all: scoped.len(),
        failed: scoped
            .iter()
            .filter(|r| is_failed(r, query.threshold))
            .count(),
        erroring: scoped.iter().filter(|r| is_erroring(r)).count(),
    };
    scoped.retain(|r| {
        (!query.failed || is_failed(r, query.threshold)) && (!query.erroring || is_erroring(r))
    });
    // Stable: within a step, the order the run wrote them (group by group).
    scoped.sort_by_key(|r| std::cmp::Reverse(step_of(r)));
    let limit = query.limit.unwrap_or(50).clamp(1, MAX_LIMIT);
    Page {
        total: scoped.len(),
        offset: query.offset,
        limit,
        steps: steps.into_iter().collect(),
        counts,
        samples: scoped.into_iter().skip(query.offset).take(limit).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn row(
        step: u64,
        reward: f64,
        correct: Option<bool>,
        error: Option<&str>,
    ) -> Map<String, Value> {
        let v = json!({
            "step": step, "prompt": "p", "completion": "c", "reward": reward, "correct": correct,
            "scores": [{"name": "a", "error": Value::Null}, {"name": "b", "error": error}],
        });
        v.as_object().cloned().expect("an object")
    }

    fn rows() -> Vec<Map<String, Value>> {
        vec![
            row(1, 1.0, Some(true), None),
            row(1, 0.0, Some(false), None),
            row(1, -1.0, None, Some("trap")),
            row(2, 0.5, Some(true), None),
            row(2, 0.2, None, None),
            row(2, -1.0, Some(false), Some("timeout")),
        ]
    }

    #[test]
    fn filters_combine_and_the_threshold_widens_failed() {
        let q = |failed, erroring, threshold| Query {
            failed,
            erroring,
            threshold,
            ..Query::default()
        };
        let all = page(rows(), &Query::default());
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
            .map(|r| r["reward"].as_f64().unwrap())
            .collect();
        assert_eq!(order, [0.5, 0.2, -1.0, 1.0, 0.0, -1.0]);
        assert_eq!(page(rows(), &q(true, false, None)).total, 2);
        // Below 0.3: the two not correct, the trap (-1) and the 0.2 without a verdict.
        assert_eq!(page(rows(), &q(true, false, Some(0.3))).total, 4);
        assert_eq!(page(rows(), &q(false, true, None)).total, 2);
        assert_eq!(page(rows(), &q(true, true, None)).total, 1);
        let step1 = page(
            rows(),
            &Query {
                step: Some(1),
                ..Query::default()
            },
        );
        assert_eq!(step1.total, 3);
        assert_eq!(step1.counts.erroring, 1);
        assert_eq!(step1.steps, [1, 2], "every step stays listed");
    }

    #[test]
    fn pages_are_bounded() {
        let many: Vec<_> = (0..700).map(|i| row(i / 10, 0.0, None, None)).collect();
        let p = page(
            many.clone(),
            &Query {
                limit: Some(10_000),
                ..Query::default()
            },
        );
        assert_eq!(
            (p.total, p.limit, p.samples.len()),
            (700, MAX_LIMIT, MAX_LIMIT)
        );
        let last = page(
            many,
            &Query {
                offset: 690,
                limit: Some(50),
                ..Query::default()
            },
        );
        assert_eq!(last.samples.len(), 10);
        assert_eq!(last.samples[0]["step"], 0);
    }

    #[test]
    fn a_missing_file_or_a_half_written_line_is_no_sample() {
        let dir = std::env::temp_dir().join(format!("anneal-samples-read-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        assert_eq!(read(&dir, &Query::default()).total, 0);
        std::fs::write(
            dir.join(SAMPLES_FILE),
            "{\"step\":1,\"reward\":1}\nnot json\n{\"step\":2,\"rew",
        )
        .expect("write");
        let p = read(&dir, &Query::default());
        assert_eq!(p.total, 1);
        assert_eq!(p.steps, [1]);
    }
}

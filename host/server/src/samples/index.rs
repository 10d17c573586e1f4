//! What the server remembers of a run's `samples.jsonl` between requests, so a page costs a few
//! lines of reading instead of the whole file: the file as runs of lines of one step ("spans":
//! byte range and per-filter counts) and, for the reward threshold, the rewards the threshold
//! could count. The file only grows while a run writes it (one step per write) and is replaced
//! whole when a resume drops rows past its checkpoint, so each request reads only what was
//! appended since the last one, and starts over when the file was replaced.

use super::lines::{Lines, MAX_LINE};
use serde_json::{Map, Value};
use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;

/// The bytes before the indexed end that must still be there for the index to stay valid.
const TAIL: u64 = 64;

/// A run of consecutive samples of one step (lines that are no sample may lie between them).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Span {
    /// The step.
    pub step: u64,
    /// Offset of its first sample's line.
    pub start: u64,
    /// Offset just past its last sample's line.
    pub end: u64,
    /// Samples in it.
    pub all: usize,
    /// Of which a module called not correct.
    pub not_correct: usize,
    /// Of which some module's call failed.
    pub erroring: usize,
    /// Of which both.
    pub not_correct_erroring: usize,
    /// The rewards of the samples not already failed by `correct: false`, ascending (what a
    /// threshold may add to the failed ones).
    rewards: Vec<f64>,
    /// The same, of the erroring ones.
    erroring_rewards: Vec<f64>,
}

/// Which samples a page lists.
#[derive(Clone, Copy, Debug, Default)]
pub struct Filter {
    /// Only failed ones (not correct, or with `threshold` a reward below it).
    pub failed: bool,
    /// The reward below which a sample counts as failed.
    pub threshold: Option<f64>,
    /// Only those where some module's call failed.
    pub erroring: bool,
}

/// Whether a sample failed: a module called it not correct, or its reward is below `threshold`.
pub fn is_failed(row: &Map<String, Value>, threshold: Option<f64>) -> bool {
    is_not_correct(row) || is_low(row, threshold)
}

fn is_not_correct(row: &Map<String, Value>) -> bool {
    row.get("correct").and_then(Value::as_bool) == Some(false)
}

fn is_low(row: &Map<String, Value>, threshold: Option<f64>) -> bool {
    match (threshold, row.get("reward").and_then(Value::as_f64)) {
        (Some(t), Some(r)) => r < t,
        _ => false,
    }
}

/// Whether some reward module's call failed for this sample.
pub fn is_erroring(row: &Map<String, Value>) -> bool {
    row.get("scores")
        .and_then(Value::as_array)
        .is_some_and(|scores| scores.iter().any(|s| !s["error"].is_null()))
}

/// A line as a sample: a JSON object with a whole, non-negative `step`.
pub fn sample_of(text: &[u8]) -> Option<(u64, Map<String, Value>)> {
    match serde_json::from_slice::<Value>(text) {
        Ok(Value::Object(m)) => m.get("step").and_then(Value::as_u64).map(|s| (s, m)),
        _ => None,
    }
}

impl Filter {
    /// Whether `row` passes.
    pub fn keeps(&self, row: &Map<String, Value>) -> bool {
        (!self.failed || is_failed(row, self.threshold)) && (!self.erroring || is_erroring(row))
    }
}

impl Span {
    /// How many of its samples `filter` keeps.
    pub fn matching(&self, filter: &Filter) -> usize {
        if !filter.failed {
            return if filter.erroring {
                self.erroring
            } else {
                self.all
            };
        }
        let (not_correct, rewards) = if filter.erroring {
            (self.not_correct_erroring, &self.erroring_rewards)
        } else {
            (self.not_correct, &self.rewards)
        };
        let low = filter
            .threshold
            .map_or(0, |t| rewards.partition_point(|r| *r < t));
        not_correct + low
    }

    fn add(&mut self, row: &Map<String, Value>) {
        let not_correct = is_not_correct(row);
        let erroring = is_erroring(row);
        self.all += 1;
        self.not_correct += usize::from(not_correct);
        self.erroring += usize::from(erroring);
        self.not_correct_erroring += usize::from(not_correct && erroring);
        if let (false, Some(r)) = (not_correct, row.get("reward").and_then(Value::as_f64)) {
            self.rewards.push(r);
            if erroring {
                self.erroring_rewards.push(r);
            }
        }
    }
}

/// The index of one run's samples file.
#[derive(Debug, Default)]
pub struct Index {
    /// The file indexed (device, inode): another one at the path is a rewrite.
    file: Option<(u64, u64)>,
    /// Offset just past the last complete line indexed.
    scanned: u64,
    /// The bytes just before `scanned`, as they were (a rewrite of the same length or longer
    /// changes them).
    tail: Vec<u8>,
    /// The spans in file order.
    spans: Vec<Span>,
}

impl Index {
    /// Brings the index up to date with the file at `path` and returns the file it describes
    /// (`None` when there is none); only lines appended since the last call are read, unless the
    /// file was replaced or shortened, when it is read again from the start.
    pub fn refresh(&mut self, path: &Path) -> std::io::Result<Option<File>> {
        let file = match File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                *self = Index::default();
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        let meta = file.metadata()?;
        let id = (meta.dev(), meta.ino());
        let len = meta.len();
        if self.file != Some(id) || len < self.scanned || !self.tail_matches(&file)? {
            *self = Index {
                file: Some(id),
                ..Index::default()
            };
        }
        let mut lines = Lines::new(&file, self.scanned, len, MAX_LINE)?;
        let first_touched = self.spans.len().saturating_sub(1);
        while let Some(line) = lines.next_line()? {
            self.scanned = line.end;
            let Some((step, row)) = line.text.and_then(sample_of) else {
                continue;
            };
            match self.spans.last_mut() {
                Some(span) if span.step == step => span.end = line.end,
                _ => self.spans.push(Span {
                    step,
                    start: line.start,
                    end: line.end,
                    ..Span::default()
                }),
            }
            if let Some(span) = self.spans.last_mut() {
                span.add(&row);
            }
        }
        for span in self.spans.iter_mut().skip(first_touched) {
            span.rewards.sort_by(f64::total_cmp);
            span.erroring_rewards.sort_by(f64::total_cmp);
        }
        let from = self.scanned.saturating_sub(TAIL);
        self.tail = vec![0; (self.scanned - from) as usize];
        file.read_exact_at(&mut self.tail, from)?;
        Ok(Some(file))
    }

    fn tail_matches(&self, file: &File) -> std::io::Result<bool> {
        let mut now = vec![0; self.tail.len()];
        let from = self.scanned - self.tail.len() as u64;
        match file.read_exact_at(&mut now, from) {
            Ok(()) => Ok(now == self.tail),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The spans, in file order.
    pub fn spans(&self) -> &[Span] {
        &self.spans
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn line(step: u64, reward: f64, correct: Option<bool>, error: Option<&str>) -> String {
        let v = serde_json::json!({
            "step": step, "reward": reward, "correct": correct,
            "scores": [{"name": "a", "error": error}],
        });
        format!("{v}\n")
    }

    #[test]
    fn the_index_grows_with_the_file_and_starts_over_when_it_is_replaced() {
        let dir = std::env::temp_dir().join(format!("anneal-samples-index-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("samples.jsonl");
        let mut index = Index::default();
        assert!(index.refresh(&path).expect("refresh").is_none());
        let first = line(1, 0.5, Some(false), None) + &line(1, 0.1, None, Some("trap"));
        std::fs::write(&path, &first).expect("write");
        index.refresh(&path).expect("refresh");
        assert_eq!(index.spans().len(), 1);
        // Half a line: not yet a sample; then finished, and a new step.
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .expect("open");
        let next = line(1, 0.9, Some(true), None) + &line(2, 0.2, None, None);
        f.write_all(&next.as_bytes()[..10]).expect("append");
        index.refresh(&path).expect("refresh");
        assert_eq!(index.spans()[0].all, 2);
        f.write_all(&next.as_bytes()[10..]).expect("append");
        index.refresh(&path).expect("refresh");
        let spans = index.spans();
        assert_eq!(spans.len(), 2);
        assert_eq!(
            (spans[0].all, spans[0].not_correct, spans[0].erroring),
            (3, 1, 1)
        );
        assert_eq!(spans[0].end, spans[1].start);
        let low = |t, erroring| Filter {
            failed: true,
            threshold: Some(t),
            erroring,
        };
        // Below 0.3: the not-correct one, and 0.1 (0.9 is correct and high).
        assert_eq!(spans[0].matching(&low(0.3, false)), 2);
        assert_eq!(spans[0].matching(&low(0.3, true)), 1);
        assert_eq!(spans[0].matching(&low(0.05, false)), 1);
        // A resume drops step 2 (the file is replaced by a shorter one).
        let tmp = dir.join("samples.jsonl.tmp");
        std::fs::write(&tmp, first.as_bytes()).expect("write");
        std::fs::rename(&tmp, &path).expect("rename");
        index.refresh(&path).expect("refresh");
        assert_eq!(index.spans().len(), 1);
        assert_eq!(index.spans()[0].all, 2);
        // Rewritten in place, longer, with other bytes: read again from the start.
        let other = line(7, 0.0, None, None).repeat(5);
        std::fs::write(&path, &other).expect("write");
        index.refresh(&path).expect("refresh");
        assert_eq!(index.spans().len(), 1);
        assert_eq!((index.spans()[0].step, index.spans()[0].all), (7, 5));
        std::fs::remove_file(&path).expect("remove");
        assert!(index.refresh(&path).expect("refresh").is_none());
        assert!(index.spans().is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }
}

//! Reading what a run writes into its directory: metric rows (`metrics.jsonl`), the log, and
//! checkpoint folders.
//!
//! Only regular files are read, and never through a symbolic link (not even a link inside the
//! run directory: a run's files are written by the trainer, so a link is something else's
//! doing and may point anywhere, say at `~/.ssh`); a FIFO or device is not opened either.

use serde::Serialize;
use serde_json::{Map, Value};
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

/// The metrics file the trainer appends to.
pub const METRICS_FILE: &str = "metrics.jsonl";

/// One metric row: a JSON object (`step`, `loss`, ... or `val_loss`).
pub type Row = Map<String, Value>;

fn row_step(row: &Row) -> Option<f64> {
    row.get("step").and_then(Value::as_f64)
}

/// Parses complete lines of JSONL text into rows; malformed lines are skipped (a trainer killed
/// mid-write leaves half a line).
fn parse_rows(text: &str) -> impl Iterator<Item = Row> + '_ {
    text.lines()
        .filter_map(|line| match serde_json::from_str::<Value>(line.trim()) {
            Ok(Value::Object(m)) => Some(m),
            _ => None,
        })
}

/// Opens `path` for reading if it is a regular file that is not a symbolic link, nor in a
/// folder that is one (`logs/` of a run, say); fails otherwise. Opening never blocks (on a
/// FIFO, say) and the check is on the descriptor opened, so nothing can swap the file in
/// between.
pub fn open_regular(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let refused = |what: &str| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{} is {what}, not a regular file", path.display()),
        )
    };
    if let Some(parent) = path.parent() {
        if std::fs::symlink_metadata(parent).is_ok_and(|m| m.file_type().is_symlink()) {
            return Err(refused("in a folder that is a symbolic link"));
        }
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => refused("a symbolic link"),
            _ => e,
        })?;
    if !file.metadata()?.is_file() {
        return Err(refused("a special file"));
    }
    Ok(file)
}

/// The whole of a regular file as text (see [`open_regular`]).
fn read_regular(path: &Path) -> std::io::Result<String> {
    let mut text = String::new();
    open_regular(path)?.read_to_string(&mut text)?;
    Ok(text)
}

/// The rows of `<run_dir>/metrics.jsonl` whose step is above `since` (all rows without it).
pub fn read_metrics(run_dir: &Path, since: Option<f64>) -> Vec<Row> {
    let Ok(text) = read_regular(&run_dir.join(METRICS_FILE)) else {
        return Vec::new();
    };
    // Only complete lines: the last one may still be being written.
    let complete = match text.rfind('\n') {
        Some(end) => &text[..=end],
        None => "",
    };
    parse_rows(complete)
        .filter(|r| match (since, row_step(r)) {
            (Some(s), Some(step)) => step > s,
            (Some(_), None) => false,
            (None, _) => true,
        })
        .collect()
}

/// Keeps at most `max` rows, evenly spaced, always including the last (for mini-curves).
pub fn downsample(rows: Vec<Row>, max: usize) -> Vec<Row> {
    if max == 0 || rows.len() <= max {
        return rows;
    }
    let n = rows.len();
    let mut keep = vec![false; n];
    for i in 0..max {
        keep[i * (n - 1) / (max - 1).max(1)] = true;
    }
    keep[n - 1] = true;
    rows.into_iter()
        .zip(keep)
        .filter_map(|(r, k)| k.then_some(r))
        .collect()
}

/// Keeps only the named fields of each row (and drops rows that have none of them but `step`).
pub fn select_fields(rows: Vec<Row>, fields: &[&str]) -> Vec<Row> {
    rows.into_iter()
        .filter_map(|r| {
            let kept: Row = r
                .into_iter()
                .filter(|(k, _)| k == "step" || fields.contains(&k.as_str()))
                .collect();
            (kept.len() > 1).then_some(kept)
        })
        .collect()
}

/// Follows a growing JSONL file: each `poll` returns the rows completed since the last one.
/// A file that shrank (rewritten) is read again from the start.
pub struct Tail {
    path: std::path::PathBuf,
    offset: u64,
    partial: Vec<u8>,
}

impl Tail {
    /// A tail at the start of `path` (which need not exist yet).
    pub fn new(path: std::path::PathBuf) -> Tail {
        Tail {
            path,
            offset: 0,
            partial: Vec::new(),
        }
    }

    /// The rows completed since the last call.
    pub fn poll(&mut self) -> Vec<Row> {
        let Ok(mut file) = open_regular(&self.path) else {
            return Vec::new();
        };
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        if len < self.offset {
            self.offset = 0;
            self.partial.clear();
        }
        if len == self.offset || file.seek(SeekFrom::Start(self.offset)).is_err() {
            return Vec::new();
        }
        let mut buf = Vec::new();
        if file.read_to_end(&mut buf).is_err() {
            return Vec::new();
        }
        self.offset += buf.len() as u64;
        self.partial.extend_from_slice(&buf);
        let Some(end) = self.partial.iter().rposition(|b| *b == b'\n') else {
            return Vec::new();
        };
        let complete: Vec<u8> = self.partial.drain(..=end).collect();
        parse_rows(&String::from_utf8_lossy(&complete)).collect()
    }
}

/// The last `max_bytes` of a regular file as text (starting at a line boundary when cut);
/// `None` for a symbolic link or anything but a regular file (see [`open_regular`]).
pub fn tail_text(path: &Path, max_bytes: u64) -> Option<String> {
    let mut file = open_regular(path).ok()?;
    let len = file.metadata().ok()?.len();
    let start = len.saturating_sub(max_bytes);
    file.seek(SeekFrom::Start(start)).ok()?;
    let mut buf = Vec::new();
    file.read_to_end(&mut buf).ok()?;
    let mut text = String::from_utf8_lossy(&buf).into_owned();
    if start > 0 {
        if let Some(nl) = text.find('\n') {
            text.drain(..=nl);
        }
    }
    Some(text)
}

/// Where rank `r` (≥ 1) of a multi-process run writes its log.
pub fn rank_log(run_dir: &Path, r: usize) -> std::path::PathBuf {
    run_dir.join("logs").join(format!("rank-{r}.log"))
}

/// The ranks with a log in `run_dir`: 0 (the run's own log) and every `logs/rank-<r>.log`
/// that is a regular file (not a symbolic link), sorted.
pub fn rank_logs(run_dir: &Path) -> Vec<usize> {
    let mut ranks = vec![0];
    let logs = run_dir.join("logs");
    // `logs` itself must be a folder, not a link to one.
    let real_dir = std::fs::symlink_metadata(&logs).is_ok_and(|m| m.is_dir());
    if let (true, Ok(rd)) = (real_dir, std::fs::read_dir(&logs)) {
        ranks.extend(rd.filter_map(|e| {
            let e = e.ok()?;
            // The entry's own type: a symbolic link is not followed.
            if !e.file_type().ok()?.is_file() {
                return None;
            }
            let name = e.file_name().into_string().ok()?;
            let r: usize = name
                .strip_prefix("rank-")?
                .strip_suffix(".log")?
                .parse()
                .ok()?;
            (r > 0).then_some(r)
        }));
    }
    ranks.sort_unstable();
    ranks.dedup();
    ranks
}

/// The last `n` lines of a log file.
pub fn tail_lines(path: &Path, n: usize) -> Vec<String> {
    // Lines are short; 256 bytes a line is a generous read budget, capped at 8 MiB.
    let budget = (n as u64).saturating_mul(256).clamp(64 * 1024, 8 << 20);
    let Some(text) = tail_text(path, budget) else {
        return Vec::new();
    };
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..]
        .iter()
        .map(|l| l.to_string())
        .collect()
}

/// One checkpoint folder of a run.
#[derive(Debug, Serialize)]
pub struct Checkpoint {
    /// The step it was taken after.
    pub step: u64,
    /// The folder name (`step-<N>`).
    pub name: String,
    /// Total size of its files in bytes.
    pub bytes: u64,
    /// Unix milliseconds of its last change.
    pub modified: Option<i64>,
    /// The files in it.
    pub files: Vec<String>,
}

/// The finished checkpoints under `<run_dir>/checkpoints/`, oldest first. Folders being
/// written (`*.tmp-*`) and anything not named `step-<N>` are ignored.
pub fn checkpoints(run_dir: &Path) -> Vec<Checkpoint> {
    let Ok(entries) = std::fs::read_dir(run_dir.join("checkpoints")) else {
        return Vec::new();
    };
    let mut out: Vec<Checkpoint> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().to_str()?.to_string();
            if name.contains(".tmp-") || !e.file_type().ok()?.is_dir() {
                return None;
            }
            let step: u64 = name.strip_prefix("step-")?.parse().ok()?;
            let mut bytes = 0;
            let mut files = Vec::new();
            for f in std::fs::read_dir(e.path()).ok()?.filter_map(Result::ok) {
                if let Ok(meta) = f.metadata() {
                    bytes += dir_size(&f.path(), &meta);
                    files.push(f.file_name().to_string_lossy().into_owned());
                }
            }
            files.sort();
            let modified = e
                .metadata()
                .ok()
                .and_then(|m| m.modified().ok())
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map(|d| d.as_millis() as i64);
            Some(Checkpoint {
                step,
                name,
                bytes,
                modified,
                files,
            })
        })
        .collect();
    out.sort_by_key(|c| c.step);
    out
}

fn dir_size(path: &Path, meta: &std::fs::Metadata) -> u64 {
    if meta.is_file() {
        return meta.len();
    }
    if !meta.is_dir() {
        return 0;
    }
    std::fs::read_dir(path)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .filter_map(|e| Some(dir_size(&e.path(), &e.metadata().ok()?)))
                .sum()
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn temp_dir(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("anneal-files-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("temp dir");
        d
    }

    #[test]
    fn tail_returns_only_complete_new_rows() {
        let dir = temp_dir("tail");
        let path = dir.join(METRICS_FILE);
        let mut tail = Tail::new(path.clone());
        assert!(tail.poll().is_empty());
        let mut f = std::fs::File::create(&path).expect("create");
        write!(f, "{{\"step\":1,\"loss\":2.0}}\n{{\"step\":2,").expect("write");
        let rows = tail.poll();
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0]["step"], 1);
        writeln!(f, "\"loss\":1.5}}").expect("write");
        let rows = tail.poll();
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0]["loss"], 1.5);
        assert!(tail.poll().is_empty());
        assert_eq!(read_metrics(&dir, Some(1.0)).len(), 1);
        assert_eq!(read_metrics(&dir, None).len(), 2);
    }

    #[test]
    fn only_regular_files_are_read_never_through_a_link() {
        let dir = temp_dir("links");
        let outside = temp_dir("links-outside");
        std::fs::write(outside.join("secret"), "secret-marker\n").expect("write");
        std::fs::create_dir_all(dir.join("logs")).expect("mkdir");
        std::fs::write(dir.join("logs/rank-1.log"), "rank one\n").expect("write");
        std::os::unix::fs::symlink(outside.join("secret"), dir.join("logs/rank-2.log"))
            .expect("symlink");
        std::os::unix::fs::symlink(outside.join("secret"), dir.join("run.log")).expect("symlink");
        assert_eq!(rank_logs(&dir), [0, 1]);
        assert_eq!(tail_lines(&dir.join("logs/rank-1.log"), 5), ["rank one"]);
        assert!(tail_lines(&dir.join("logs/rank-2.log"), 5).is_empty());
        assert!(tail_text(&dir.join("run.log"), 100).is_none());
        let err = open_regular(&dir.join("run.log")).expect_err("a link");
        assert!(err.to_string().contains("symbolic link"), "{err}");
        // A `logs` folder that is a link to another folder is not read either.
        let other = temp_dir("links-other");
        std::fs::create_dir_all(other.join("logs")).expect("mkdir");
        std::fs::write(other.join("logs/rank-3.log"), "x\n").expect("write");
        std::os::unix::fs::symlink(other.join("logs"), outside.join("logs")).expect("symlink");
        assert_eq!(rank_logs(&outside), [0]);
        assert!(tail_text(&outside.join("logs/rank-3.log"), 100).is_none());
        // Nor a FIFO (opening it would wait for a writer).
        let fifo = dir.join("metrics.jsonl");
        let c = std::ffi::CString::new(fifo.to_str().expect("utf-8")).expect("path");
        // SAFETY: mkfifo(3) on a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert!(read_metrics(&dir, None).is_empty());
        assert!(Tail::new(fifo).poll().is_empty());
    }

    #[test]
    fn downsample_keeps_ends_and_bound() {
        let rows: Vec<Row> = (0..1000)
            .map(|i| {
                let mut m = Row::new();
                m.insert("step".into(), i.into());
                m
            })
            .collect();
        let d = downsample(rows, 50);
        assert!(d.len() <= 51);
        assert_eq!(d[0]["step"], 0);
        assert_eq!(d[d.len() - 1]["step"], 999);
    }

    #[test]
    fn checkpoints_skip_temporary_and_foreign_folders() {
        let dir = temp_dir("ckpt");
        for name in ["step-10", "step-2", "step-30.tmp-77", "other"] {
            std::fs::create_dir_all(dir.join("checkpoints").join(name)).expect("mkdir");
        }
        std::fs::write(dir.join("checkpoints/step-10/model.safetensors"), [0u8; 16])
            .expect("write");
        let c = checkpoints(&dir);
        let steps: Vec<u64> = c.iter().map(|c| c.step).collect();
        assert_eq!(steps, [2, 10]);
        assert_eq!(c[1].bytes, 16);
        assert_eq!(c[1].files, ["model.safetensors"]);
    }
}

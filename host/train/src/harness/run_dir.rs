//! The run directory: held by one process at a time, and changed only by a run that was
//! allowed to start.

use crate::{io_err, TrainError};
use anneal_config::JobConfig;
use std::fs::{File, OpenOptions, TryLockError};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The lock file of a run directory; it holds the pid of the process that has the run.
pub const LOCK_FILE: &str = "run.lock";

/// A run directory this process holds. The lock is an OS file lock on [`LOCK_FILE`], so the
/// kernel drops it when the process ends, however it ends (`kill -9` leaves no stale lock).
///
/// A start that is refused before the run is recorded ([`RunDir::record`]) leaves nothing
/// behind it created: when the `RunDir` goes, the lock file and the folders `open` made (the
/// run dir, and `runs/` when it was missing) go too, if nothing else is in them. A folder that
/// existed before is never removed, nor anything in it but the lock file this process made.
#[derive(Debug)]
pub struct RunDir {
    path: PathBuf,
    /// Held for the lock; closing it releases the run.
    lock: Option<File>,
    /// The folders `open` created, outermost first.
    created: Vec<PathBuf>,
    /// Whether this process created the lock file.
    created_lock: bool,
    /// Set once the run is recorded: from then on everything stays.
    recorded: std::cell::Cell<bool>,
}

impl RunDir {
    /// Creates `path` if needed and takes its lock. A directory that a live process holds is
    /// [`TrainError::RunDirBusy`], naming that process.
    pub fn open(path: &Path) -> Result<RunDir, TrainError> {
        // The folders about to be made, so a refused start can take them back.
        let missing: Vec<PathBuf> = path
            .ancestors()
            .take_while(|p| !p.as_os_str().is_empty() && std::fs::symlink_metadata(p).is_err())
            .map(Path::to_path_buf)
            .collect();
        std::fs::create_dir_all(path).map_err(io_err(path))?;
        let lock_path = path.join(LOCK_FILE);
        let created_lock = std::fs::symlink_metadata(&lock_path).is_err();
        let mut dir = RunDir {
            path: path.to_path_buf(),
            lock: None,
            created: missing.into_iter().rev().collect(),
            created_lock,
            recorded: std::cell::Cell::new(false),
        };
        dir.lock = Some(take_lock(path, &lock_path)?);
        Ok(dir)
    }
}

/// Takes the lock of `lock_path` and writes this process's pid into it.
fn take_lock(path: &Path, lock_path: &Path) -> Result<File, TrainError> {
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(lock_path)
        .map_err(io_err(lock_path))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => {
            let pid = std::fs::read_to_string(lock_path)
                .ok()
                .and_then(|s| s.trim().parse().ok());
            return Err(TrainError::RunDirBusy {
                dir: path.to_path_buf(),
                pid,
            });
        }
        Err(TryLockError::Error(e)) => return Err(io_err(lock_path)(e)),
    }
    // Only the holder writes its pid, so a refused process can name it.
    file.set_len(0).map_err(io_err(lock_path))?;
    writeln!(file, "{}", std::process::id()).map_err(io_err(lock_path))?;
    Ok(file)
}

impl RunDir {
    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Records what this run trains with: `config.toml` (the resolved config) and a copy of
    /// the tokenizer as `tokenizer.json` (what `anneal checkpoint export` and a later
    /// `rl.init_from` find next to the checkpoints), and the files a chat run renders and
    /// reads images with (`files`: `tokenizer_config.json`, `preprocessor_config.json`,
    /// `generation_config.json`), which
    /// an export carries. Called only after a resume was accepted, so a refused start leaves
    /// the files of the run as they were.
    pub fn record(
        &self,
        cfg: &JobConfig,
        tokenizer: &Path,
        files: &crate::RunFiles,
    ) -> Result<(), TrainError> {
        self.recorded.set(true);
        let config_path = self.path.join("config.toml");
        std::fs::write(&config_path, cfg.to_toml()).map_err(io_err(&config_path))?;
        let copy = self.path.join("tokenizer.json");
        let same = match (tokenizer.canonicalize(), copy.canonicalize()) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        };
        if !same {
            // Through a temporary file, so a crash never leaves half a tokenizer.
            let tmp = self.path.join("tokenizer.json.tmp");
            std::fs::copy(tokenizer, &tmp).map_err(io_err(&tmp))?;
            std::fs::rename(&tmp, &copy).map_err(io_err(&copy))?;
        }
        for (name, text) in &files.files {
            let path = self.path.join(name);
            let tmp = self.path.join(format!("{name}.tmp"));
            std::fs::write(&tmp, text).map_err(io_err(&tmp))?;
            std::fs::rename(&tmp, &path).map_err(io_err(&path))?;
        }
        Ok(())
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        if self.recorded.get() {
            return;
        }
        // Unlocked before it goes, so no other process can hold a lock on a removed file.
        drop(self.lock.take());
        if self.created_lock {
            let _ = std::fs::remove_file(self.path.join(LOCK_FILE));
        }
        // Innermost first; `remove_dir` leaves a folder that holds anything (a rank's log, a
        // file another process put there).
        for dir in self.created.iter().rev() {
            if std::fs::remove_dir(dir).is_err() {
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("anneal-rundir-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn a_held_run_dir_is_refused_with_the_holders_pid_and_released_on_drop() {
        let dir = temp("held");
        let first = RunDir::open(&dir).expect("first holder");
        match RunDir::open(&dir) {
            Err(TrainError::RunDirBusy { pid, .. }) => assert_eq!(pid, Some(std::process::id())),
            other => panic!("expected RunDirBusy, got {other:?}"),
        }
        drop(first);
        RunDir::open(&dir).expect("free again once the holder is gone");
    }

    #[test]
    fn a_refused_start_takes_back_only_what_it_created() {
        let base = temp("cleanup");
        // A new run dir under a new runs/ folder: both go when the start is refused.
        let dir = base.join("runs").join("new-run");
        drop(RunDir::open(&dir).expect("open"));
        assert!(
            !base.join("runs").exists(),
            "runs/ was created by the start"
        );
        // runs/ existed: only the run dir goes.
        std::fs::create_dir_all(base.join("runs")).expect("mkdir");
        drop(RunDir::open(&dir).expect("open"));
        assert!(base.join("runs").is_dir() && !dir.exists());
        // A run dir that existed stays, with its files (the lock file made for the start goes;
        // one it had stays).
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join("notes.txt"), "mine").expect("write");
        drop(RunDir::open(&dir).expect("open"));
        assert!(dir.join("notes.txt").is_file() && !dir.join(LOCK_FILE).exists());
        std::fs::write(dir.join(LOCK_FILE), "").expect("write");
        drop(RunDir::open(&dir).expect("open"));
        assert!(dir.join("notes.txt").is_file() && dir.join(LOCK_FILE).is_file());
        std::fs::remove_dir_all(&dir).expect("clean");
        // A file put into a new run dir keeps it (the lock file goes).
        let run = RunDir::open(&dir).expect("open");
        std::fs::create_dir_all(dir.join("logs")).expect("mkdir");
        std::fs::write(dir.join("logs/rank-1.log"), "x").expect("write");
        drop(run);
        assert!(dir.join("logs/rank-1.log").is_file() && !dir.join(LOCK_FILE).exists());
        std::fs::remove_dir_all(&dir).expect("clean");
        // A recorded run keeps everything.
        let run = RunDir::open(&dir).expect("open");
        let tok = base.join("tok.json");
        std::fs::write(&tok, "{}").expect("write");
        run.record(&JobConfig::default(), &tok, &Default::default())
            .expect("record");
        drop(run);
        assert!(dir.join("config.toml").is_file() && dir.join(LOCK_FILE).is_file());
        let _ = std::fs::remove_dir_all(&base);
    }
}

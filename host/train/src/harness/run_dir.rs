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
#[derive(Debug)]
pub struct RunDir {
    path: PathBuf,
    /// Held for the lock; closing it releases the run.
    _lock: File,
}

impl RunDir {
    /// Creates `path` if needed and takes its lock. A directory that a live process holds is
    /// [`TrainError::RunDirBusy`], naming that process.
    pub fn open(path: &Path) -> Result<RunDir, TrainError> {
        std::fs::create_dir_all(path).map_err(io_err(path))?;
        let lock_path = path.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock_path)
            .map_err(io_err(&lock_path))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let pid = std::fs::read_to_string(&lock_path)
                    .ok()
                    .and_then(|s| s.trim().parse().ok());
                return Err(TrainError::RunDirBusy {
                    dir: path.to_path_buf(),
                    pid,
                });
            }
            Err(TryLockError::Error(e)) => return Err(io_err(&lock_path)(e)),
        }
        // Only the holder writes its pid, so a refused process can name it.
        file.set_len(0).map_err(io_err(&lock_path))?;
        writeln!(file, "{}", std::process::id()).map_err(io_err(&lock_path))?;
        Ok(RunDir {
            path: path.to_path_buf(),
            _lock: file,
        })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Records what this run trains with: `config.toml` (the resolved config) and a copy of
    /// the tokenizer as `tokenizer.json` (what `anneal checkpoint export` and a later
    /// `rl.init_from` find next to the checkpoints). Called only after a resume was accepted,
    /// so a refused start leaves the files of the run as they were.
    pub fn record(&self, cfg: &JobConfig, tokenizer: &Path) -> Result<(), TrainError> {
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
        Ok(())
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
}

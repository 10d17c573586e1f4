//! The run registry: one SQLite file under the server's home recording every run (and every
//! uploaded reward module). The registry is the source of truth for a run's status; run
//! directories hold what the run itself writes.

use rusqlite::{params, Connection, OptionalExtension, Row};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

/// Why the registry could not be opened or queried.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// SQLite refused (a corrupt file, a full disk, a locked database).
    #[error("registry {path}: {source}")]
    Sql {
        /// The database file.
        path: PathBuf,
        /// SQLite's error.
        source: rusqlite::Error,
    },
}

/// The life of a run. `queued` waits for a free slot, `running` has a live process, the other
/// three are final until the run is resumed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Waiting for a slot (`--max-running`).
    Queued,
    /// Its process is alive.
    Running,
    /// Its process finished the job and exited 0.
    Completed,
    /// Its process exited with an error, was killed, or vanished without an exit record.
    Failed,
    /// Stopped on request (the trainer saves a checkpoint first).
    Stopped,
}

impl Status {
    /// The name stored in the database and shown by the API.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Queued => "queued",
            Status::Running => "running",
            Status::Completed => "completed",
            Status::Failed => "failed",
            Status::Stopped => "stopped",
        }
    }

    fn parse(s: &str) -> Status {
        match s {
            "queued" => Status::Queued,
            "running" => Status::Running,
            "completed" => Status::Completed,
            "stopped" => Status::Stopped,
            // Only this code writes the column; anything else means a damaged row.
            _ => Status::Failed,
        }
    }

    /// Whether the run has (or is about to have) a process.
    pub fn is_active(self) -> bool {
        matches!(self, Status::Queued | Status::Running)
    }
}

/// One run as the registry records it.
#[derive(Clone, Debug, Serialize)]
pub struct Run {
    /// The run's id (never reused).
    pub id: i64,
    /// A display name.
    pub name: String,
    /// What the process runs: `train` or `rl`.
    pub kind: String,
    /// `configs/<file>` when started from a config file, `null` for inline TOML.
    pub config_path: Option<String>,
    /// The config text the run was started with.
    pub config: String,
    /// `key.path=value` overrides, in order.
    pub overrides: Vec<String>,
    /// Where it is in its life.
    pub status: Status,
    /// The supervisor process (the leader of the run's process group) while running.
    pub pid: Option<i64>,
    /// The run directory (config, metrics, logs, checkpoints).
    pub run_dir: String,
    /// Why the run ended, in one line (`null` while active or after a clean finish).
    pub exit_reason: Option<String>,
    /// The process's exit code, when it exited normally.
    pub exit_code: Option<i64>,
    /// Whether a stop was asked for in the current attempt.
    pub stop_requested: bool,
    /// How many times a process was started for it (1 + resumes).
    pub attempts: i64,
    /// Unix milliseconds.
    pub created_at: i64,
    /// Unix milliseconds of the latest start.
    pub started_at: Option<i64>,
    /// Unix milliseconds of the latest end.
    pub finished_at: Option<i64>,
}

/// A stored reward module.
#[derive(Clone, Debug, Serialize)]
pub struct Reward {
    /// Its id.
    pub id: i64,
    /// The uploaded file name.
    pub name: String,
    /// SHA-256 of the bytes (also the stored file's name).
    pub sha256: String,
    /// Size in bytes.
    pub size: i64,
    /// `core` or `component`.
    pub kind: String,
    /// Unix milliseconds.
    pub created_at: i64,
}

/// What a new run needs.
pub struct NewRun<'a> {
    /// Display name.
    pub name: &'a str,
    /// `train` or `rl`.
    pub kind: &'a str,
    /// `configs/<file>` or `None` for inline TOML.
    pub config_path: Option<&'a str>,
    /// The config text.
    pub config: &'a str,
    /// Overrides.
    pub overrides: &'a [String],
}

/// How a run ended, to be recorded.
pub struct Outcome {
    /// `completed`, `failed` or `stopped`.
    pub status: Status,
    /// The exit code, when there was one.
    pub exit_code: Option<i64>,
    /// One line, for `failed` (and informative for `stopped`).
    pub reason: Option<String>,
}

/// The registry: a SQLite connection behind a mutex (queries are tiny; one writer is plenty).
pub struct Registry {
    path: PathBuf,
    conn: Mutex<Connection>,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    kind TEXT NOT NULL,
    config_path TEXT,
    config TEXT NOT NULL,
    overrides TEXT NOT NULL,
    status TEXT NOT NULL,
    pid INTEGER,
    run_dir TEXT NOT NULL,
    exit_reason TEXT,
    exit_code INTEGER,
    stop_requested INTEGER NOT NULL DEFAULT 0,
    attempts INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL,
    started_at INTEGER,
    finished_at INTEGER
);
CREATE TABLE IF NOT EXISTS rewards (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    size INTEGER NOT NULL,
    kind TEXT NOT NULL,
    created_at INTEGER NOT NULL
);
";

const RUN_COLUMNS: &str = "id, name, kind, config_path, config, overrides, status, pid, run_dir, \
     exit_reason, exit_code, stop_requested, attempts, created_at, started_at, finished_at";

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

fn run_from_row(row: &Row<'_>) -> rusqlite::Result<Run> {
    let overrides: String = row.get(5)?;
    let status: String = row.get(6)?;
    Ok(Run {
        id: row.get(0)?,
        name: row.get(1)?,
        kind: row.get(2)?,
        config_path: row.get(3)?,
        config: row.get(4)?,
        overrides: serde_json::from_str(&overrides).unwrap_or_default(),
        status: Status::parse(&status),
        pid: row.get(7)?,
        run_dir: row.get(8)?,
        exit_reason: row.get(9)?,
        exit_code: row.get(10)?,
        stop_requested: row.get::<_, i64>(11)? != 0,
        attempts: row.get(12)?,
        created_at: row.get(13)?,
        started_at: row.get(14)?,
        finished_at: row.get(15)?,
    })
}

fn reward_from_row(row: &Row<'_>) -> rusqlite::Result<Reward> {
    Ok(Reward {
        id: row.get(0)?,
        name: row.get(1)?,
        sha256: row.get(2)?,
        size: row.get(3)?,
        kind: row.get(4)?,
        created_at: row.get(5)?,
    })
}

impl Registry {
    /// Opens (creating if needed) the registry at `path`.
    pub fn open(path: &Path) -> Result<Registry, RegistryError> {
        let err = |source| RegistryError::Sql {
            path: path.to_path_buf(),
            source,
        };
        let conn = Connection::open(path).map_err(err)?;
        // WAL keeps readers off the writer's back; a busy timeout rides out a second server
        // briefly opening the same file.
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(err)?;
        conn.busy_timeout(std::time::Duration::from_secs(5))
            .map_err(err)?;
        conn.execute_batch(SCHEMA).map_err(err)?;
        Ok(Registry {
            path: path.to_path_buf(),
            conn: Mutex::new(conn),
        })
    }

    fn conn(&self) -> MutexGuard<'_, Connection> {
        // A panic while holding the lock leaves a valid connection (SQLite statements are
        // atomic), so a poisoned lock is still usable.
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn err(&self, source: rusqlite::Error) -> RegistryError {
        RegistryError::Sql {
            path: self.path.clone(),
            source,
        }
    }

    /// Records a new queued run whose directory is `<runs_dir>/<id>`; returns it.
    pub fn create_run(&self, new: &NewRun<'_>, runs_dir: &Path) -> Result<Run, RegistryError> {
        let conn = self.conn();
        let overrides = serde_json::to_string(new.overrides).expect("strings serialize");
        conn.execute(
            "INSERT INTO runs (name, kind, config_path, config, overrides, status, run_dir, created_at)
             VALUES (?1, ?2, ?3, ?4, ?5, 'queued', '', ?6)",
            params![new.name, new.kind, new.config_path, new.config, overrides, now_ms()],
        )
        .map_err(|e| self.err(e))?;
        let id = conn.last_insert_rowid();
        let run_dir = runs_dir.join(id.to_string());
        conn.execute(
            "UPDATE runs SET run_dir = ?1 WHERE id = ?2",
            params![run_dir.to_string_lossy(), id],
        )
        .map_err(|e| self.err(e))?;
        drop(conn);
        self.run(id)?
            .ok_or_else(|| self.err(rusqlite::Error::QueryReturnedNoRows))
    }

    /// The run with this id.
    pub fn run(&self, id: i64) -> Result<Option<Run>, RegistryError> {
        self.conn()
            .query_row(
                &format!("SELECT {RUN_COLUMNS} FROM runs WHERE id = ?1"),
                [id],
                run_from_row,
            )
            .optional()
            .map_err(|e| self.err(e))
    }

    /// Every run, newest first.
    pub fn runs(&self) -> Result<Vec<Run>, RegistryError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(&format!("SELECT {RUN_COLUMNS} FROM runs ORDER BY id DESC"))
            .map_err(|e| self.err(e))?;
        let rows = stmt
            .query_map([], run_from_row)
            .map_err(|e| self.err(e))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.err(e));
        rows
    }

    /// Runs with this status, oldest first.
    pub fn runs_with_status(&self, status: Status) -> Result<Vec<Run>, RegistryError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(&format!(
                "SELECT {RUN_COLUMNS} FROM runs WHERE status = ?1 ORDER BY id"
            ))
            .map_err(|e| self.err(e))?;
        let rows = stmt
            .query_map([status.as_str()], run_from_row)
            .map_err(|e| self.err(e))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.err(e));
        rows
    }

    /// Marks a run running under the supervisor `pid` (a new attempt).
    pub fn mark_running(&self, id: i64, pid: i64) -> Result<(), RegistryError> {
        self.conn()
            .execute(
                "UPDATE runs SET status = 'running', pid = ?1, attempts = attempts + 1,
                 started_at = ?2, finished_at = NULL, exit_reason = NULL, exit_code = NULL
                 WHERE id = ?3",
                params![pid, now_ms(), id],
            )
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    /// Puts a finished run back in the queue (resume): a new attempt starts from its run dir.
    pub fn requeue(&self, id: i64) -> Result<(), RegistryError> {
        self.conn()
            .execute(
                "UPDATE runs SET status = 'queued', pid = NULL, stop_requested = 0,
                 exit_reason = NULL, exit_code = NULL, finished_at = NULL WHERE id = ?1",
                [id],
            )
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    /// Records that a stop was asked for.
    pub fn mark_stop_requested(&self, id: i64) -> Result<(), RegistryError> {
        self.conn()
            .execute("UPDATE runs SET stop_requested = 1 WHERE id = ?1", [id])
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    /// Records how a run ended; clears its pid.
    pub fn finish(&self, id: i64, outcome: &Outcome) -> Result<(), RegistryError> {
        self.conn()
            .execute(
                "UPDATE runs SET status = ?1, pid = NULL, exit_code = ?2, exit_reason = ?3,
                 finished_at = ?4 WHERE id = ?5",
                params![
                    outcome.status.as_str(),
                    outcome.exit_code,
                    outcome.reason,
                    now_ms(),
                    id
                ],
            )
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    /// Removes a run's record.
    pub fn delete_run(&self, id: i64) -> Result<(), RegistryError> {
        self.conn()
            .execute("DELETE FROM runs WHERE id = ?1", [id])
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    /// Records an uploaded reward module.
    pub fn add_reward(
        &self,
        name: &str,
        sha256: &str,
        size: i64,
        kind: &str,
    ) -> Result<Reward, RegistryError> {
        let conn = self.conn();
        conn.execute(
            "INSERT INTO rewards (name, sha256, size, kind, created_at) VALUES (?1, ?2, ?3, ?4, ?5)",
            params![name, sha256, size, kind, now_ms()],
        )
        .map_err(|e| self.err(e))?;
        let id = conn.last_insert_rowid();
        drop(conn);
        self.reward(id)?
            .ok_or_else(|| self.err(rusqlite::Error::QueryReturnedNoRows))
    }

    /// The reward module with this id.
    pub fn reward(&self, id: i64) -> Result<Option<Reward>, RegistryError> {
        self.conn()
            .query_row(
                "SELECT id, name, sha256, size, kind, created_at FROM rewards WHERE id = ?1",
                [id],
                reward_from_row,
            )
            .optional()
            .map_err(|e| self.err(e))
    }

    /// Every reward module, newest first.
    pub fn rewards(&self) -> Result<Vec<Reward>, RegistryError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(
                "SELECT id, name, sha256, size, kind, created_at FROM rewards ORDER BY id DESC",
            )
            .map_err(|e| self.err(e))?;
        let rows = stmt
            .query_map([], reward_from_row)
            .map_err(|e| self.err(e))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.err(e));
        rows
    }

    /// Removes a reward module's record; returns whether another record still uses its bytes.
    pub fn delete_reward(&self, id: i64, sha256: &str) -> Result<bool, RegistryError> {
        let conn = self.conn();
        conn.execute("DELETE FROM rewards WHERE id = ?1", [id])
            .map_err(|e| self.err(e))?;
        let others: i64 = conn
            .query_row(
                "SELECT COUNT(*) FROM rewards WHERE sha256 = ?1",
                [sha256],
                |r| r.get(0),
            )
            .map_err(|e| self.err(e))?;
        Ok(others > 0)
    }
}

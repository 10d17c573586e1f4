//! The run manager: starts queued runs when a slot is free, watches their processes, records how
//! they ended, stops and resumes them, and reconciles the registry with reality at startup.

use crate::process::{self, ExitRecord};
use crate::registry::{Outcome, Registry, RegistryError, Run, Status};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{broadcast, Notify};

/// A run's status changed (sent to event streams).
#[derive(Clone, Debug)]
pub struct StatusChange {
    /// The run.
    pub id: i64,
    /// Its new status.
    pub status: Status,
}

/// Why a run operation was refused.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// No such run.
    #[error("no run with id {0}")]
    NotFound(i64),
    /// The operation does not fit the run's status.
    #[error("{0}")]
    Conflict(String),
    /// The registry failed.
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// The file system or process table failed.
    #[error("{0}")]
    Io(String),
}

/// Where runs live and how their processes are started.
#[derive(Clone, Debug)]
pub struct Launch {
    /// The `anneal` binary (runs `supervise`, and `train` or `rl`).
    pub exe: PathBuf,
    /// The children's working directory (the project root: `configs/`, data caches).
    pub work_dir: PathBuf,
    /// `<home>/runs`: run directories are `<runs_dir>/<id>`.
    pub runs_dir: PathBuf,
    /// How many runs may have a process at once; the rest wait `queued`.
    pub max_running: usize,
}

/// Starts, watches, stops and resumes runs.
pub struct Manager {
    registry: Arc<Registry>,
    launch: Launch,
    events: broadcast::Sender<StatusChange>,
    wake: Notify,
    /// Runs whose supervisor is our child process (watched through `wait`); running runs not in
    /// this set were adopted from an earlier server and are watched by polling.
    own: Mutex<HashSet<i64>>,
}

impl Manager {
    /// A manager over `registry`; call [`Manager::start`] to reconcile and begin scheduling.
    pub fn new(registry: Arc<Registry>, launch: Launch) -> Arc<Manager> {
        let (events, _) = broadcast::channel(256);
        Arc::new(Manager {
            registry,
            launch,
            events,
            wake: Notify::new(),
            own: Mutex::new(HashSet::new()),
        })
    }

    /// Subscribes to status changes of every run.
    pub fn subscribe(&self) -> broadcast::Receiver<StatusChange> {
        self.events.subscribe()
    }

    /// Where runs are started.
    pub fn launch(&self) -> &Launch {
        &self.launch
    }

    fn announce(&self, id: i64, status: Status) {
        // No subscribers is fine.
        let _ = self.events.send(StatusChange { id, status });
    }

    /// Reconciles the registry with the process table (a run marked `running` whose process is
    /// gone gets its final status from its exit record), then keeps scheduling in the
    /// background.
    pub fn start(self: &Arc<Self>) -> Result<(), RunError> {
        for run in self.registry.runs_with_status(Status::Running)? {
            let alive = run
                .pid
                .is_some_and(|pid| process::supervisor_alive(pid, Path::new(&run.run_dir)));
            if !alive {
                self.finalize(&run, None)?;
            }
        }
        let me = Arc::clone(self);
        tokio::spawn(async move { me.schedule_loop().await });
        Ok(())
    }

    async fn schedule_loop(self: Arc<Self>) {
        loop {
            if let Err(e) = self.tick().await {
                eprintln!("anneal serve: scheduling: {e}");
            }
            let _ = tokio::time::timeout(Duration::from_secs(1), self.wake.notified()).await;
        }
    }

    /// One scheduling pass: finalize adopted runs whose process is gone, start queued runs while
    /// there are free slots.
    async fn tick(self: &Arc<Self>) -> Result<(), RunError> {
        let running = self.registry.runs_with_status(Status::Running)?;
        let mut active = 0;
        for run in &running {
            let own = self.own_lock().contains(&run.id);
            if own {
                active += 1;
                continue;
            }
            let alive = run
                .pid
                .is_some_and(|pid| process::supervisor_alive(pid, Path::new(&run.run_dir)));
            if alive {
                active += 1;
            } else {
                self.finalize(run, None)?;
            }
        }
        for run in self.registry.runs_with_status(Status::Queued)? {
            if active >= self.launch.max_running.max(1) {
                break;
            }
            if let Err(e) = self.spawn(&run) {
                self.registry.finish(
                    run.id,
                    &Outcome {
                        status: Status::Failed,
                        exit_code: None,
                        reason: Some(format!("cannot start: {e}")),
                    },
                )?;
                self.announce(run.id, Status::Failed);
                continue;
            }
            active += 1;
        }
        Ok(())
    }

    fn own_lock(&self) -> std::sync::MutexGuard<'_, HashSet<i64>> {
        self.own.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn spawn(self: &Arc<Self>, run: &Run) -> Result<(), RunError> {
        let run_dir = PathBuf::from(&run.run_dir);
        std::fs::create_dir_all(&run_dir)
            .map_err(|e| RunError::Io(format!("cannot create {}: {e}", run_dir.display())))?;
        // Always the text the run was created with (relative paths in configs are from the
        // working directory, not the file's folder, so the copy resolves the same way).
        let config_file = process::source_file(&run_dir);
        let kind = crate::config::Kind::parse(&run.kind);
        // The mesh the config asks for (it resolved when the run was created; a failure now
        // leaves one process, which reports the problem itself).
        let processes = match kind {
            crate::config::Kind::Train => {
                crate::config::resolve(&run.config, "config", &run.overrides)
                    .map_or(1, |cfg| crate::config::processes(&cfg))
            }
            crate::config::Kind::Rl => 1,
        };
        let mut child = process::run_command(
            &self.launch.exe,
            &self.launch.work_dir,
            &run_dir,
            kind,
            &config_file,
            &run.overrides,
            processes,
        )
        .spawn()
        .map_err(|e| RunError::Io(format!("cannot run {}: {e}", self.launch.exe.display())))?;
        let pid = child
            .id()
            .ok_or_else(|| RunError::Io("the supervisor exited at once".into()))?;
        self.own_lock().insert(run.id);
        self.registry.mark_running(run.id, i64::from(pid))?;
        self.announce(run.id, Status::Running);
        let me = Arc::clone(self);
        let id = run.id;
        tokio::spawn(async move {
            let status = child.wait().await.ok();
            // Finalize before leaving the own set, so the scheduler never sees the run as an
            // adopted one whose process vanished.
            let result = match me.registry.run(id) {
                Ok(Some(run)) if run.status == Status::Running => me.finalize(&run, status),
                Ok(_) => Ok(()),
                Err(e) => Err(e.into()),
            };
            me.own_lock().remove(&id);
            if let Err(e) = result {
                eprintln!("anneal serve: run {id}: {e}");
            }
            me.wake.notify_one();
        });
        Ok(())
    }

    /// Records the final status of a run whose process has ended, from its exit record (or, for
    /// our own child, its wait status when there is no record).
    fn finalize(
        &self,
        run: &Run,
        supervisor: Option<std::process::ExitStatus>,
    ) -> Result<(), RunError> {
        let run_dir = Path::new(&run.run_dir);
        let outcome = outcome_of(
            ExitRecord::read(run_dir).as_ref(),
            run.stop_requested,
            supervisor,
            || process::last_log_line(run_dir),
        );
        self.registry.finish(run.id, &outcome)?;
        self.announce(run.id, outcome.status);
        Ok(())
    }

    /// Asks a run to stop: a queued run is stopped at once; a running one gets SIGTERM (the
    /// trainer finishes its step and saves a checkpoint), or SIGKILL to its group with `force`.
    pub fn stop(&self, id: i64, force: bool) -> Result<Run, RunError> {
        let run = self.registry.run(id)?.ok_or(RunError::NotFound(id))?;
        match run.status {
            Status::Queued => {
                self.registry.finish(
                    id,
                    &Outcome {
                        status: Status::Stopped,
                        exit_code: None,
                        reason: Some("stopped before it started".into()),
                    },
                )?;
                self.announce(id, Status::Stopped);
            }
            Status::Running => {
                let pid = run
                    .pid
                    .ok_or_else(|| RunError::Io(format!("run {id} has no process id")))?;
                self.registry.mark_stop_requested(id)?;
                if process::supervisor_alive(pid, Path::new(&run.run_dir)) {
                    process::signal_stop(pid, force)
                        .map_err(|e| RunError::Io(format!("cannot signal run {id}: {e}")))?;
                }
                self.wake.notify_one();
            }
            other => {
                return Err(RunError::Conflict(format!(
                    "run {id} is {}, not running",
                    other.as_str()
                )))
            }
        }
        self.registry.run(id)?.ok_or(RunError::NotFound(id))
    }

    /// Starts a stopped or failed run again from its run directory (the trainer resumes from
    /// its newest checkpoint). A completed run trained all its steps and a resume takes no new
    /// settings, so it would only end again at once: refused.
    pub fn resume(&self, id: i64) -> Result<Run, RunError> {
        let run = self.registry.run(id)?.ok_or(RunError::NotFound(id))?;
        if run.status.is_active() {
            return Err(RunError::Conflict(format!(
                "run {id} is {}; stop it before resuming",
                run.status.as_str()
            )));
        }
        if run.status == Status::Completed {
            return Err(RunError::Conflict(format!(
                "run {id} is completed: it trained all its steps, so there is nothing to resume \
                 (start a new run to train further)"
            )));
        }
        self.registry.requeue(id)?;
        self.announce(id, Status::Queued);
        self.wake.notify_one();
        self.registry.run(id)?.ok_or(RunError::NotFound(id))
    }

    /// Queues a new run (already recorded in the registry).
    pub fn queued(&self, id: i64) {
        self.announce(id, Status::Queued);
        self.wake.notify_one();
    }

    /// Deletes a run that has no process: its record and its run directory.
    pub fn delete(&self, id: i64) -> Result<(), RunError> {
        let run = self.registry.run(id)?.ok_or(RunError::NotFound(id))?;
        if run.status.is_active() {
            return Err(RunError::Conflict(format!(
                "run {id} is {}; stop it before deleting",
                run.status.as_str()
            )));
        }
        self.registry.delete_run(id)?;
        let dir = PathBuf::from(&run.run_dir);
        // Only ever remove a directory the server created under its own runs folder.
        if dir.parent() == Some(self.launch.runs_dir.as_path()) && dir.exists() {
            std::fs::remove_dir_all(&dir)
                .map_err(|e| RunError::Io(format!("cannot remove {}: {e}", dir.display())))?;
        }
        Ok(())
    }
}

/// The final status of a run from what is known about its end.
fn outcome_of(
    record: Option<&ExitRecord>,
    stop_requested: bool,
    supervisor: Option<std::process::ExitStatus>,
    last_line: impl Fn() -> Option<String>,
) -> Outcome {
    let with_line = |what: String| match last_line() {
        Some(line) => format!("{what}: {line}"),
        None => what,
    };
    let Some(record) = record else {
        use std::os::unix::process::ExitStatusExt;
        let how = match supervisor.and_then(|s| s.signal()) {
            Some(sig) => format!("the run's process was killed by signal {sig}"),
            None => "the run's process ended without an exit record".to_string(),
        };
        return Outcome {
            status: if stop_requested && supervisor.is_some() {
                Status::Stopped
            } else {
                Status::Failed
            },
            exit_code: None,
            reason: Some(how),
        };
    };
    let stop = stop_requested || record.stop_requested;
    match (record.code, record.signal) {
        (Some(0), _) if stop => Outcome {
            status: Status::Stopped,
            exit_code: Some(0),
            reason: Some("stopped on request".into()),
        },
        (Some(0), _) => Outcome {
            status: Status::Completed,
            exit_code: Some(0),
            reason: None,
        },
        (Some(2), _) => Outcome {
            status: Status::Failed,
            exit_code: Some(2),
            reason: Some(with_line("invalid job (exit code 2)".into())),
        },
        (Some(code), _) => Outcome {
            status: Status::Failed,
            exit_code: Some(i64::from(code)),
            reason: Some(with_line(format!("exit code {code}"))),
        },
        (None, Some(sig)) if stop && (sig == libc::SIGTERM || sig == libc::SIGINT) => Outcome {
            status: Status::Stopped,
            exit_code: None,
            reason: Some(format!("stopped on request (signal {sig})")),
        },
        (None, sig) => Outcome {
            status: Status::Failed,
            exit_code: None,
            reason: Some(with_line(format!(
                "killed by signal {}",
                sig.map_or("?".to_string(), |s| s.to_string())
            ))),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(code: Option<i32>, signal: Option<i32>, stop: bool) -> ExitRecord {
        ExitRecord {
            code,
            signal,
            stop_requested: stop,
            finished_at: 0,
        }
    }

    #[test]
    fn exit_records_map_to_final_statuses() {
        let line = || Some("error: training.steps: must be positive".to_string());
        let o = outcome_of(Some(&record(Some(0), None, false)), false, None, line);
        assert_eq!(o.status, Status::Completed);
        let o = outcome_of(Some(&record(Some(0), None, true)), false, None, line);
        assert_eq!(o.status, Status::Stopped);
        let o = outcome_of(Some(&record(Some(0), None, false)), true, None, line);
        assert_eq!(o.status, Status::Stopped);
        let o = outcome_of(Some(&record(Some(2), None, false)), false, None, line);
        assert_eq!(o.status, Status::Failed);
        assert!(o
            .reason
            .as_deref()
            .is_some_and(|r| r.contains("training.steps")));
        let o = outcome_of(Some(&record(None, Some(9), true)), true, None, line);
        assert_eq!(o.status, Status::Failed);
        let o = outcome_of(Some(&record(None, Some(15), true)), false, None, line);
        assert_eq!(o.status, Status::Stopped);
        let o = outcome_of(None, false, None, line);
        assert_eq!(o.status, Status::Failed);
        assert!(o
            .reason
            .as_deref()
            .is_some_and(|r| r.contains("exit record")));
    }
}

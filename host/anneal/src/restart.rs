//! `[fault_tolerance]` in the `anneal train --nproc N` launcher: when a rank of the job dies,
//! MPICH's launcher ends every rank, and this one starts the job again on the same run
//! directory, where it resumes from the newest complete checkpoint, the way a person would
//! rerun the command. The whole job restarts, not the failed replica alone: MPI as installed
//! (MPICH 4.0 over UCX) has no dynamic processes, so a new process cannot join running ones,
//! and a rank waiting on a dead peer waits forever instead of getting an error, so the
//! survivors cannot carry on by themselves (docs/distributed.md, "Replica failure").

use anneal_config::FaultTolerance;

/// Set by the `--nproc` launcher in the environment of the job it starts, so a rank knows a
/// launcher that restarts it is there. (Not a config key: the config's environment layer
/// skips `ANNEAL_*` names that start with no section.)
pub(crate) const LAUNCHER_ENV: &str = "ANNEAL_NPROC_LAUNCHER";

/// The exit code of a user error (a bad config, a refused checkpoint): restarting would fail
/// the same way.
const USER_ERROR: u8 = 2;

/// What the launcher does once `mpiexec` has exited with `code`.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum After {
    /// Report `code` as the launcher's exit code.
    Exit(u8),
    /// Start the job again (restart number `n`, from 1).
    Restart(u32),
}

/// Decides whether a job that exited with `code` (0: success) is restarted: only when fault
/// tolerance is on, the job failed by something other than a user error, the user did not ask
/// it to stop (`stopped`: SIGINT or SIGTERM reached the launcher), and fewer than
/// `max_restarts` restarts were made so far (`restarts`).
pub(crate) fn after_exit(ft: &FaultTolerance, code: u8, stopped: bool, restarts: u32) -> After {
    let retry =
        ft.enabled && code != 0 && code != USER_ERROR && !stopped && restarts < ft.max_restarts;
    if retry {
        After::Restart(restarts + 1)
    } else {
        After::Exit(code)
    }
}

/// The line the launcher prints before restart `n`.
pub(crate) fn restart_note(
    ft: &FaultTolerance,
    code: u8,
    n: u32,
    run_dir: &std::path::Path,
) -> String {
    format!(
        "fault_tolerance: the job failed (exit code {code}); restarting every rank \
         (restart {n} of {}), resuming from the newest complete checkpoint in {}",
        ft.max_restarts,
        run_dir.display()
    )
}

/// The note a run with `fault_tolerance.enabled` prints when no `--nproc` launcher started it
/// (a plain `anneal train`, or `mpiexec` called by hand): nothing will restart it, which the
/// config alone would not tell.
pub(crate) fn unrestartable_note(ft: &FaultTolerance) -> Option<String> {
    (ft.enabled && std::env::var_os(LAUNCHER_ENV).is_none()).then(|| {
        "fault_tolerance.enabled: nothing restarts this job if it fails: only `anneal train \
         --nproc N` does (rerun the command to resume)"
            .to_string()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on(max_restarts: u32) -> FaultTolerance {
        FaultTolerance {
            enabled: true,
            max_restarts,
        }
    }

    #[test]
    fn only_a_failure_of_an_enabled_job_restarts_up_to_the_limit() {
        assert_eq!(after_exit(&on(2), 137, false, 0), After::Restart(1));
        assert_eq!(after_exit(&on(2), 1, false, 1), After::Restart(2));
        assert_eq!(after_exit(&on(2), 1, false, 2), After::Exit(1));
        assert_eq!(after_exit(&on(2), 0, false, 0), After::Exit(0));
        // A user error fails again; a stop the user asked for is not a failure.
        assert_eq!(after_exit(&on(2), USER_ERROR, false, 0), After::Exit(2));
        assert_eq!(after_exit(&on(2), 1, true, 0), After::Exit(1));
        assert_eq!(
            after_exit(&FaultTolerance::default(), 137, false, 0),
            After::Exit(137)
        );
    }
}

//! Building the `mpiexec` command line that starts N ranks on this machine: which MPI the
//! launcher belongs to decides the flags (Open MPI refuses more ranks than cores without
//! `--oversubscribe`, and refuses root without its two consent variables; MPICH's Hydra just
//! runs).

use std::path::{Path, PathBuf};
use std::process::Command;

/// Why `mpiexec` cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// No `mpiexec` on `PATH`.
    #[error("--nproc needs `mpiexec` on PATH (install MPICH: `apt-get install -y mpich libmpich-dev`, or run scripts/setup-mpi.sh)")]
    NotFound,
    /// The requested number of processes is 0.
    #[error("--nproc must be at least 1")]
    ZeroProcs,
}

/// The MPI implementation an `mpiexec` belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    /// MPICH (Hydra).
    Mpich,
    /// Open MPI (`mpirun`/ORTE or PRRTE).
    OpenMpi,
}

/// `mpiexec` on `PATH`, if any.
pub fn find_mpiexec() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join("mpiexec"))
        .find(|p| p.is_file())
}

/// Which MPI `mpiexec` belongs to, from its `--version` (Open MPI names itself; anything else
/// is treated as MPICH-like).
pub fn flavor(mpiexec: &Path) -> Flavor {
    let out = Command::new(mpiexec).arg("--version").output();
    match out {
        Ok(o) => {
            let text = String::from_utf8_lossy(&o.stdout).to_string()
                + &String::from_utf8_lossy(&o.stderr);
            if text.contains("Open MPI") || text.contains("OpenRTE") || text.contains("PRRTE") {
                Flavor::OpenMpi
            } else {
                Flavor::Mpich
            }
        }
        Err(_) => Flavor::Mpich,
    }
}

/// `mpiexec -n <nproc> <program>` with the flags this MPI needs on one machine, and each
/// `env` variable exported to every rank. The caller adds the program's arguments.
pub fn mpiexec_command(
    nproc: usize,
    program: &Path,
    env: &[(&str, String)],
) -> Result<Command, LaunchError> {
    if nproc == 0 {
        return Err(LaunchError::ZeroProcs);
    }
    let mpiexec = find_mpiexec().ok_or(LaunchError::NotFound)?;
    let mut cmd = Command::new(&mpiexec);
    match flavor(&mpiexec) {
        Flavor::OpenMpi => {
            // Ranks may outnumber cores (tests run 4 on 2); root needs explicit consent.
            cmd.arg("--oversubscribe");
            cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1");
            cmd.env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
            for (k, _) in env {
                cmd.arg("-x").arg(k);
            }
        }
        Flavor::Mpich => {
            // Hydra passes the whole environment on by default.
        }
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.arg("-n").arg(nproc.to_string()).arg(program);
    Ok(cmd)
}

/// Runs the test named `test` of the running test binary on `n` ranks under `mpiexec`, with
/// `env` set to `1` in their environment (the multi-rank tests gate their rank-side body on it),
/// and checks that it succeeded and that every rank printed `rank <r>/<n>: <done>`. Panics with
/// both output streams otherwise: for test binaries that launch themselves.
pub fn run_self_on_ranks(n: usize, env: &str, test: &str, done: &str) {
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut cmd = mpiexec_command(n, &exe, &[(env, "1".into())]).expect("mpiexec on PATH");
    cmd.args(["--exact", test, "--nocapture", "--test-threads=1"]);
    let out = cmd.output().expect("mpiexec runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "mpiexec -n {n} failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    for r in 0..n {
        assert!(
            stdout.contains(&format!("rank {r}/{n}: {done}")),
            "rank {r} of {n} did not finish:\n{stdout}\n{stderr}"
        );
    }
}

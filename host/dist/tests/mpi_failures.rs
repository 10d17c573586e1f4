//! How a failed job ends on real MPI ranks: this test binary starts itself under `mpiexec`,
//! where the rank-side tests fail on purpose and the launching tests check the launcher's exit
//! code and what each rank printed.

use anneal_dist::launch::mpiexec_command;
use anneal_dist::{led_by_rank0, DistError, JobFailure};
use std::process::Output;
use std::time::Duration;

/// Set in the ranks' environment: the rank-side tests only run under it.
const RANK_ENV: &str = "ANNEAL_DIST_FAILURE_CHECKS";

/// Runs the test `test` of this binary on `n` ranks under `mpiexec`.
fn run_on_ranks(n: usize, test: &str) -> Output {
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut cmd = mpiexec_command(n, &exe, &[(RANK_ENV, "1".into())]).expect("mpiexec on PATH");
    cmd.args(["--exact", test, "--nocapture", "--test-threads=1"]);
    cmd.output().expect("mpiexec runs")
}

#[test]
fn a_failure_every_rank_meets_ends_the_job_with_its_code() {
    let out = run_on_ranks(3, "ranks_fail_together");
    let stdout = String::from_utf8_lossy(&out.stdout);
    // Not the kill of a slower rank (which MPICH reports as 9) but the code they agreed on.
    assert_eq!(out.status.code(), Some(7), "stdout: {stdout}");
    for r in 0..3 {
        assert!(
            stdout.contains(&format!("rank {r}/3: agreed")),
            "rank {r} did not reach the end: {stdout}"
        );
    }
}

#[test]
fn a_failure_of_one_rank_alone_still_ends_the_job() {
    let out = run_on_ranks(2, "rank_fails_alone");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "stdout: {stdout}");
    assert!(stdout.contains("rank 0/2: alone"), "{stdout}");
    assert!(!stdout.contains("rank 1/2: released"), "{stdout}");
}

/// Rank 0 fails in work the others wait for; they learn it, arrive at different times and
/// agree on rank 0's code.
#[test]
fn ranks_fail_together() {
    if std::env::var_os(RANK_ENV).is_none() {
        return;
    }
    let world = anneal_dist::init().unwrap();
    let (r, n) = (world.rank(), world.size());
    let mine: Result<(), DistError> = match r {
        0 => Err(DistError::Backend("rank 0's own failure".into())),
        _ => Ok(()),
    };
    let shared = led_by_rank0(world.as_ref(), mine);
    let code = match (r, &shared) {
        (0, Err(DistError::Backend(_))) => 7,
        (_, Err(DistError::PeerFailed { rank: 0 })) => 0,
        _ => panic!("rank {r}: unexpected {shared:?}"),
    };
    // The last rank arrives first, rank 0 last: the early ones must wait, not be killed.
    std::thread::sleep(Duration::from_millis(300 * (n - 1 - r) as u64));
    let agreed = world.fail_together(code, &format!("{shared:?}"), Duration::from_secs(60));
    assert_eq!(
        agreed,
        Some(JobFailure {
            code: 7,
            same_message: false
        })
    );
    println!("rank {r}/{n}: agreed");
    anneal_dist::abort_job(7)
}

/// Rank 0 fails while rank 1 waits in a collective that never completes: rank 0 waits in vain
/// for agreement, then ends the job alone.
#[test]
fn rank_fails_alone() {
    if std::env::var_os(RANK_ENV).is_none() {
        return;
    }
    let world = anneal_dist::init().unwrap();
    let (r, n) = (world.rank(), world.size());
    if r == 0 {
        let agreed = world.fail_together(5, "alone", Duration::from_millis(500));
        assert_eq!(agreed, None);
        println!("rank {r}/{n}: alone");
        anneal_dist::abort_job(5)
    }
    world.barrier().unwrap();
    println!("rank {r}/{n}: released");
}

//! `anneal train --profile`: the per-op table and the Chrome trace land in the run dir, the
//! numbers of a profiled run are those of an unprofiled one, and a bad step count is a user
//! error.

use anneal_tests::cli as common;

use common::{anneal, losses, ok, Job};

#[test]
fn profile_writes_a_table_and_a_trace_without_changing_the_run() {
    let job = Job::new("profile");
    let (plain, plain_dir) = job.train("plain", &["training.steps=5"]);
    ok(&plain);
    let run_dir = job.dir.join("profiled");
    let out = anneal()
        .arg("train")
        .arg(job.config())
        .arg("--run-dir")
        .arg(&run_dir)
        .args(["--set", "training.steps=5", "--profile=2"])
        .output()
        .unwrap();
    ok(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("profile of 2 step(s)"), "{stderr}");
    assert_eq!(
        losses(&run_dir),
        losses(&plain_dir),
        "profiling changes no number"
    );

    let table = std::fs::read_to_string(run_dir.join("profile/table.txt")).unwrap();
    for needle in [
        "| matmul                       | forward",
        "| matmul                       | backward",
        "| optimizer",
        "| attention_backward",
        "matmul shapes",
        "served from the cache",
    ] {
        assert!(table.contains(needle), "no `{needle}` in\n{table}");
    }
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("profile/trace.json")).unwrap())
            .expect("the trace is JSON");
    let events = trace["traceEvents"].as_array().unwrap();
    let steps: Vec<_> = events.iter().filter(|e| e["cat"] == "step").collect();
    assert_eq!(steps.len(), 2, "steps 3 and 4 after two warm-up steps");
    assert!(events.iter().all(|e| e["ph"] == "X"));
    assert!(events
        .iter()
        .any(|e| e["name"] == "matmul" && e["args"]["detail"].is_string()));
}

#[test]
fn a_zero_step_profile_is_a_user_error() {
    let job = Job::new("profile-zero");
    let out = anneal()
        .arg("train")
        .arg(job.config())
        .arg("--run-dir")
        .arg(job.dir.join("run"))
        .arg("--profile=0")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("--profile"), "{stderr}");
}

//! `anneal env test` end to end: plays scripted episodes through a WAT environment, one JSON
//! line per event, and reports malformed input as one line with exit code 2.

use serde_json::Value;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

/// An environment that opens with `{"text":"echo"}` and answers each turn with the turn itself
/// as its step output (so a script chooses the outcome with a turn object).
const ECHO: &str = r#"(module
  (memory (export "memory") 1)
  (global $ptr (mut i32) (i32.const 16))
  (global $len (mut i32) (i32.const 15))
  (data (i32.const 16) "{\22text\22:\22echo\22}")
  (func (export "alloc") (param i32) (result i32) (i32.const 4096))
  (func (export "output_ptr") (result i32) (global.get $ptr))
  (func (export "output_len") (result i32) (global.get $len))
  (func (export "env_init") (param i32 i32) (result i32) (i32.const 0))
  (func (export "env_step") (param $p i32) (param $l i32) (result i32)
    (global.set $ptr (local.get $p)) (global.set $len (local.get $l)) (i32.const 0)))"#;

fn env_test(module: &Path, input: &str) -> std::process::Output {
    let mut child = Command::new(anneal_tests::cli::anneal_bin())
        .args(["env", "test"])
        .arg(module)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run anneal");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input.as_bytes())
        .expect("write stdin");
    child.wait_with_output().expect("wait")
}

fn module(label: &str) -> (tempdir::Dir, std::path::PathBuf) {
    let dir = tempdir::Dir::new(label);
    let path = dir.0.join("echo.wat");
    std::fs::write(&path, ECHO).expect("write the module");
    (dir, path)
}

/// A scratch folder removed on drop.
mod tempdir {
    pub struct Dir(pub std::path::PathBuf);
    impl Dir {
        pub fn new(label: &str) -> Dir {
            let name = format!("anneal-env-cli-{label}-{}", std::process::id());
            let p = std::env::temp_dir().join(name);
            std::fs::create_dir_all(&p).expect("temp dir");
            Dir(p)
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

#[test]
fn plays_scripted_episodes_one_json_line_per_event() {
    let (_dir, path) = module("play");
    let script = r#"{"task": {"n": 1}, "turns": ["plain text", {"observation": "bye", "reward": 1.5, "done": true}, "never sent"]}"#;
    let out = env_test(&path, &format!("{script}\n\n{script}\n"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<Value> = std::str::from_utf8(&out.stdout)
        .expect("utf-8")
        .lines()
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect();
    assert_eq!(lines.len(), 8, "{lines:?}"); // start, 2 steps, end; twice
    assert_eq!(lines[0]["event"], "start");
    assert_eq!(lines[0]["messages"][0]["content"], "echo");
    assert_eq!(lines[1]["event"], "step");
    assert_eq!(lines[1]["observation"], "");
    assert_eq!(lines[2]["observation"], "bye");
    assert_eq!(lines[2]["done"], true);
    assert_eq!(lines[3]["event"], "end");
    assert_eq!(lines[3]["return"], 1.5);
    assert_eq!(lines[3]["steps"], 2);
    assert_eq!(lines[7]["line"], 3);
    assert!(String::from_utf8_lossy(&out.stderr).contains("metrics: "));
}

#[test]
fn a_step_error_ends_the_episode_and_bad_lines_exit_2() {
    let (_dir, path) = module("errors");
    let out = env_test(&path, r#"{"task": {}, "turns": [{"reward": "high"}, "x"]}"#);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert_eq!(lines[1]["error"], "bad_output");
    assert_eq!(lines[2]["event"], "end");

    let out = env_test(&path, "{\"turns\": []}\n");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("expected {\"task\""), "{stderr}");
}

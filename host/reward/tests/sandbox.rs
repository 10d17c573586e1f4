//! End-to-end tests of the sandbox with small and malicious modules written as WAT.

use anneal_reward::{
    CallError, CallLimits, ErrorKind, Grants, LoadError, Sandbox, SandboxConfig, ScoreInput,
};
use serde_json::json;
use std::time::{Duration, Instant};

/// A well-behaved module: the score is the completion's length; details `{"len":1}`.
const GOOD: &str = r#"(module
  (memory (export "memory") 1)
  (global $bump (mut i32) (i32.const 1024))
  (func (export "alloc") (param $len i32) (result i32)
    (local $p i32)
    (local.set $p (global.get $bump))
    (global.set $bump (i32.add (global.get $bump) (local.get $len)))
    (local.get $p))
  (func (export "score") (param i32 i32 i32 i32 i32 i32) (result f64)
    (f64.convert_i32_u (local.get 3)))
  (data (i32.const 16) "{\"len\":1}")
  (func (export "details_ptr") (result i32) (i32.const 16))
  (func (export "details_len") (result i32) (i32.const 9))
  (func (export "anneal_reward_abi") (result i32) (i32.const 1)))"#;

/// The ABI boilerplate around a custom `score` body, with extra items (imports first) before it.
fn module_with(score_body: &str, extra: &str) -> String {
    format!(
        r#"(module
  {extra}
  (memory (export "memory") 1)
  (func (export "alloc") (param i32) (result i32) (i32.const 1024))
  (func (export "score") (param i32 i32 i32 i32 i32 i32) (result f64) {score_body}))"#
    )
}

fn sandbox(f: impl FnOnce(&mut SandboxConfig)) -> Sandbox {
    let mut config = SandboxConfig {
        fuel: 10_000_000,
        timeout: Duration::from_secs(5),
        memory_bytes: 16 << 20,
        ..SandboxConfig::default()
    };
    f(&mut config);
    Sandbox::new(config).expect("sandbox")
}

fn input(completion: &str) -> ScoreInput {
    ScoreInput {
        prompt: "What is 6*7?".into(),
        completion: completion.into(),
        metadata: json!({"answer": "42"}),
    }
}

fn error_of(sb: &Sandbox, wat: &str) -> CallError {
    let m = sb.load_bytes("test", wat.as_bytes()).expect("load");
    match sb.score(&m, &input("x")).result {
        Ok(s) => panic!("expected an error, got score {s}"),
        Err(e) => e,
    }
}

#[test]
fn good_module_scores_with_details_and_fuel() {
    let sb = sandbox(|_| {});
    let m = sb.load_bytes("good", GOOD.as_bytes()).expect("load");
    let out = sb.score(&m, &input("forty-two"));
    assert_eq!(out.result, Ok(9.0));
    assert_eq!(out.reward, 9.0);
    assert_eq!(out.details.expect("details")["len"], json!(1));
    assert!(out.fuel_used > 0);
    // Fuel is deterministic.
    assert_eq!(sb.score(&m, &input("forty-two")).fuel_used, out.fuel_used);
    assert_eq!(sb.metrics_snapshot().ok, 2);
}

#[test]
fn infinite_loop_runs_out_of_fuel() {
    let sb = sandbox(|c| c.fuel = 1_000_000);
    let e = error_of(&sb, &module_with("(loop (br 0)) (f64.const 0)", ""));
    assert_eq!(e.kind(), ErrorKind::FuelExhausted, "{e}");
}

#[test]
fn infinite_loop_with_huge_fuel_hits_the_epoch_deadline() {
    let sb = sandbox(|c| {
        c.fuel = u64::MAX / 2;
        c.timeout = Duration::from_millis(50);
    });
    let start = Instant::now();
    let e = error_of(&sb, &module_with("(loop (br 0)) (f64.const 0)", ""));
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn a_call_can_be_given_less_fuel_and_time_than_configured() {
    let sb = sandbox(|c| {
        c.fuel = u64::MAX / 2;
        c.timeout = Duration::from_secs(60);
    });
    let m = sb
        .load_bytes(
            "loop",
            module_with("(loop (br 0)) (f64.const 0)", "").as_bytes(),
        )
        .expect("load");
    let fuel = CallLimits {
        fuel: 100_000,
        timeout: Duration::from_secs(60),
    };
    let out = sb.score_within(&m, &input("x"), fuel);
    assert_eq!(out.result, Err(CallError::FuelExhausted { fuel: 100_000 }));
    assert_eq!(out.fuel_used, 100_000);
    let start = Instant::now();
    let time = CallLimits {
        fuel: u64::MAX / 2,
        timeout: Duration::from_millis(50),
    };
    let out = sb.score_within(&m, &input("x"), time);
    assert_eq!(out.result, Err(CallError::Timeout { timeout_ms: 50 }));
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    // Without limits of its own a call gets the configured ones.
    let good = sb.load_bytes("good", GOOD.as_bytes()).expect("load");
    assert_eq!(sb.score(&good, &input("abc")).result, Ok(3.0));
}

#[test]
fn memory_bomb_hits_the_memory_limit() {
    let sb = sandbox(|c| c.memory_bytes = 4 << 20);
    let body =
        "(loop (br_if 0 (i32.ne (memory.grow (i32.const 16)) (i32.const -1)))) (f64.const 0)";
    let e = error_of(&sb, &module_with(body, ""));
    assert_eq!(e.kind(), ErrorKind::MemoryLimit, "{e}");
    // A module whose initial memory is already over the limit fails the same way.
    let big = r#"(module (memory (export "memory") 1000)
      (func (export "alloc") (param i32) (result i32) (i32.const 0))
      (func (export "score") (param i32 i32 i32 i32 i32 i32) (result f64) (f64.const 1)))"#;
    let e = error_of(&sb, big);
    assert_eq!(e.kind(), ErrorKind::MemoryLimit, "{e}");
}

#[test]
fn table_bomb_hits_the_limit() {
    let sb = sandbox(|c| c.table_elements = 1000);
    let body = "(drop (table.grow $t (ref.null func) (i32.const 100000))) (f64.const 0)";
    let e = error_of(&sb, &module_with(body, "(table $t 0 funcref)"));
    assert_eq!(e.kind(), ErrorKind::MemoryLimit, "{e}");
}

#[test]
fn unreachable_is_a_trap_with_its_message() {
    let sb = sandbox(|_| {});
    let e = error_of(&sb, &module_with("unreachable", ""));
    assert_eq!(e.kind(), ErrorKind::Trap);
    assert!(e.message().contains("unreachable"), "{e}");
    let e = error_of(&sb, &module_with("(f64.load (i32.const 70000))", ""));
    assert!(e.message().contains("out of bounds"), "{e}");
}

#[test]
fn stack_overflow_is_a_trap() {
    let sb = sandbox(|c| c.fuel = u64::MAX / 2);
    let extra = "(func $rec (export \"rec\") (result f64) (call $rec))";
    let e = error_of(&sb, &module_with("(call $rec)", extra));
    assert_eq!(e.kind(), ErrorKind::Trap);
    assert!(e.message().contains("stack"), "{e}");
}

#[test]
fn nan_and_infinity_are_bad_output() {
    let sb = sandbox(|_| {});
    let e = error_of(&sb, &module_with("(f64.const nan)", ""));
    assert_eq!(e.kind(), ErrorKind::BadOutput, "{e}");
    let e = error_of(&sb, &module_with("(f64.const inf)", ""));
    assert_eq!(e.kind(), ErrorKind::BadOutput, "{e}");
}

#[test]
fn bad_details_are_bad_output() {
    let sb = sandbox(|_| {});
    let details = |text: &str, len: usize| {
        format!(
            r#"(data (i32.const 16) "{text}")
            (func (export "details_ptr") (result i32) (i32.const 16))
            (func (export "details_len") (result i32) (i32.const {len}))"#
        )
    };
    for extra in [
        details("not json", 8),
        details("[1,2]", 5),
        details("{}", 1_000_000),
    ] {
        let e = error_of(&sb, &module_with("(f64.const 1)", &extra));
        assert_eq!(e.kind(), ErrorKind::BadOutput, "{e}");
    }
}

#[test]
fn alloc_out_of_bounds_is_bad_output() {
    let sb = sandbox(|_| {});
    let wat = r#"(module (memory (export "memory") 1)
      (func (export "alloc") (param i32) (result i32) (i32.const 65535))
      (func (export "score") (param i32 i32 i32 i32 i32 i32) (result f64) (f64.const 1)))"#;
    let e = error_of(&sb, wat);
    assert_eq!(e.kind(), ErrorKind::BadOutput, "{e}");
}

#[test]
fn missing_exports_and_wrong_signatures_are_abi_mismatch() {
    let sb = sandbox(|_| {});
    let no_score = r#"(module (memory (export "memory") 1)
      (func (export "alloc") (param i32) (result i32) (i32.const 0)))"#;
    let e = error_of(&sb, no_score);
    assert_eq!(e.kind(), ErrorKind::AbiMismatch);
    assert!(e.message().contains("score"), "{e}");

    let wrong = r#"(module (memory (export "memory") 1)
      (func (export "alloc") (param i32) (result i32) (i32.const 0))
      (func (export "score") (param i32 i32) (result f32) (f32.const 1)))"#;
    let m = sb.load_bytes("wrong", wrong.as_bytes()).expect("load");
    assert!(m.abi_problem().is_some_and(|p| p.contains("signature")));
    assert_eq!(
        sb.score(&m, &input("x")).result.map_err(|e| e.kind()),
        Err(ErrorKind::AbiMismatch)
    );

    let no_memory = r#"(module
      (func (export "alloc") (param i32) (result i32) (i32.const 0))
      (func (export "score") (param i32 i32 i32 i32 i32 i32) (result f64) (f64.const 1)))"#;
    assert_eq!(error_of(&sb, no_memory).kind(), ErrorKind::AbiMismatch);

    let version = module_with(
        "(f64.const 1)",
        "(func (export \"anneal_reward_abi\") (result i32) (i32.const 2))",
    );
    assert_eq!(error_of(&sb, &version).kind(), ErrorKind::AbiMismatch);
}

#[test]
fn disallowed_import_fails_at_load_with_its_name() {
    let sb = sandbox(|_| {});
    let wat = module_with(
        "(f64.const 1)",
        "(import \"env\" \"now\" (func (result i64)))",
    );
    match sb.load_bytes("clock", wat.as_bytes()) {
        Err(LoadError::DisallowedImport { import, .. }) => assert_eq!(import, "env::now"),
        other => panic!("expected a disallowed import, got {other:?}"),
    }
    // WASI itself is refused when not granted.
    let no_wasi = sandbox(|c| {
        c.grants = Grants {
            wasi: false,
            ..Grants::default()
        }
    });
    let wat = module_with(
        "(f64.const 1)",
        "(import \"wasi_snapshot_preview1\" \"fd_write\" (func (param i32 i32 i32 i32) (result i32)))",
    );
    let err = no_wasi
        .load_bytes("wasi", wat.as_bytes())
        .expect_err("refused");
    assert!(
        err.to_string().contains("wasi_snapshot_preview1::fd_write"),
        "{err}"
    );
}

#[test]
fn wasi_is_deny_all_by_default() {
    // Reads the realtime clock (virtual, starting at 2000-01-01, unless granted) and tries to
    // open a file (no preopened directories: EBADF) and to read the environment (none).
    let extra = r#"
      (import "wasi_snapshot_preview1" "clock_time_get" (func $clock (param i32 i64 i32) (result i32)))
      (import "wasi_snapshot_preview1" "path_open"
        (func $open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
      (import "wasi_snapshot_preview1" "environ_sizes_get" (func $env (param i32 i32) (result i32)))
      (data (i32.const 200) "/etc/passwd")
      (func $now (export "clock") (result f64)
        (drop (call $clock (i32.const 0) (i64.const 1) (i32.const 104)))
        (f64.convert_i32_u (i64.eq (i64.load (i32.const 104)) (i64.const 946684800000000000))))"#;
    let body = r#"
      (drop (call $env (i32.const 300) (i32.const 304)))
      (f64.add
        (f64.add (call $now)
          (f64.mul (f64.const 1000) (f64.convert_i32_u (call $open (i32.const 3) (i32.const 0)
             (i32.const 200) (i32.const 11) (i32.const 0) (i64.const 1) (i64.const 1)
             (i32.const 0) (i32.const 400)))))
        (f64.convert_i32_u (i32.load (i32.const 300))))"#;
    let sb = sandbox(|_| {});
    let m = sb
        .load_bytes("wasi", module_with(body, extra).as_bytes())
        .expect("load");
    assert!(m.imports_wasi());
    let out = sb.score(&m, &input("x"));
    // clock at 2000-01-01 (1), path_open(fd 3) = EBADF (8) * 1000, environment count = 0.
    assert_eq!(out.result, Ok(8001.0));
    let granted = sandbox(|c| c.grants.clocks = true);
    let m = granted
        .load_bytes("wasi", module_with(body, extra).as_bytes())
        .expect("load");
    assert_eq!(granted.score(&m, &input("x")).result, Ok(8000.0));
}

#[test]
fn wasi_sleep_does_not_block_past_the_deadline() {
    // poll_oneoff with one relative clock subscription of one hour: returns at once.
    let extra = r#"
      (import "wasi_snapshot_preview1" "poll_oneoff" (func $poll (param i32 i32 i32 i32) (result i32)))
      (data (i32.const 1000) "\2a\00\00\00\00\00\00\00\00\00\00\00\00\00\00\00\01\00\00\00\00\00\00\00\00\10\a5\d4\e8\03\00\00\00\00\00\00\00\00\00\00\00\00\00\00\00\00\00\00")"#;
    let body = r#"
      (drop (call $poll (i32.const 1000) (i32.const 2000) (i32.const 1) (i32.const 3000)))
      (f64.convert_i32_u (i32.add (i32.load (i32.const 3000)) (i32.load (i32.const 2000))))"#;
    let sb = sandbox(|c| c.timeout = Duration::from_millis(200));
    let m = sb
        .load_bytes("sleep", module_with(body, extra).as_bytes())
        .expect("load");
    let start = Instant::now();
    let out = sb.score(&m, &input("x"));
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    // One event, with the subscription's userdata (42).
    assert_eq!(out.result, Ok(43.0));
}

#[test]
fn errors_get_the_error_reward_and_are_counted_per_kind() {
    let sb = sandbox(|c| {
        c.error_reward = -1.0;
        c.fuel = 100_000;
    });
    let trap = sb
        .load_bytes("trap", module_with("unreachable", "").as_bytes())
        .expect("load");
    let spin = sb
        .load_bytes(
            "spin",
            module_with("(loop (br 0)) (f64.const 0)", "").as_bytes(),
        )
        .expect("load");
    let good = sb.load_bytes("good", GOOD.as_bytes()).expect("load");
    assert_eq!(sb.score(&trap, &input("x")).reward, -1.0);
    assert_eq!(sb.score(&trap, &input("x")).reward, -1.0);
    assert_eq!(sb.score(&spin, &input("x")).reward, -1.0);
    assert_eq!(sb.score(&good, &input("abc")).reward, 3.0);
    let m = sb.metrics_snapshot();
    assert_eq!(m.calls, 4);
    assert_eq!(m.ok, 1);
    assert_eq!(m.errors_of(ErrorKind::Trap), 2);
    assert_eq!(m.errors_of(ErrorKind::FuelExhausted), 1);
    assert_eq!(m.total_errors(), 3);
    let json = serde_json::to_value(&m).expect("json");
    assert_eq!(json["errors"]["fuel_exhausted"], json!(1));
    assert_eq!(json["errors"]["timeout"], json!(0));
}

#[test]
fn one_failing_call_in_a_batch_does_not_affect_the_others() {
    let sb = sandbox(|c| {
        c.threads = 4;
        c.fuel = 1_000_000;
    });
    let good = sb.load_bytes("good", GOOD.as_bytes()).expect("load");
    let bad = sb
        .load_bytes(
            "spin",
            module_with("(loop (br 0)) (f64.const 0)", "").as_bytes(),
        )
        .expect("load");
    let inputs: Vec<ScoreInput> = (0..40).map(|i| input(&"x".repeat(i))).collect();
    let jobs: Vec<_> = inputs
        .iter()
        .enumerate()
        .map(|(i, inp)| (if i % 7 == 3 { &bad } else { &good }, inp))
        .collect();
    let outs = sb.score_jobs(&jobs);
    for (i, out) in outs.iter().enumerate() {
        if i % 7 == 3 {
            assert_eq!(
                out.result.as_ref().map_err(|e| e.kind()),
                Err(ErrorKind::FuelExhausted)
            );
        } else {
            assert_eq!(out.result, Ok(i as f64));
        }
    }
}

#[test]
fn training_style_batch_scores_in_parallel_in_order() {
    let sb = sandbox(|c| c.threads = 2);
    let good = sb.load_bytes("good", GOOD.as_bytes()).expect("load");
    let inputs: Vec<ScoreInput> = (0..512).map(|i| input(&"y".repeat(i % 50))).collect();
    let start = Instant::now();
    let outs = sb.score_batch(&good, &inputs);
    let elapsed = start.elapsed();
    assert_eq!(outs.len(), inputs.len());
    for (i, out) in outs.iter().enumerate() {
        assert_eq!(out.reward, (i % 50) as f64);
    }
    assert_eq!(sb.metrics_snapshot().ok, 512);
    eprintln!(
        "512 fresh-store calls on {} threads: {elapsed:?}",
        sb.threads()
    );
}

#[test]
fn modules_are_cached_in_memory_and_on_disk() {
    let dir = std::env::temp_dir().join(format!("anneal-reward-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let sb = sandbox(|c| c.cache_dir = Some(dir.clone()));
    let a = sb.load_bytes("a", GOOD.as_bytes()).expect("load");
    let b = sb.load_bytes("b", GOOD.as_bytes()).expect("load");
    assert_eq!(a.hash(), b.hash());
    let files: Vec<_> = std::fs::read_dir(&dir).expect("cache dir").collect();
    assert_eq!(files.len(), 1);
    // A second sandbox loads the precompiled file and scores the same.
    let sb2 = sandbox(|c| c.cache_dir = Some(dir.clone()));
    let c = sb2.load_bytes("c", GOOD.as_bytes()).expect("load");
    assert_eq!(sb2.score(&c, &input("abcd")).result, Ok(4.0));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn invalid_bytes_fail_at_load() {
    let sb = sandbox(|_| {});
    let err = sb
        .load_bytes("junk", b"\0asm\x01\0\0\0\x99")
        .expect_err("invalid");
    assert!(matches!(err, LoadError::Invalid { .. }), "{err}");
    let err = sb
        .load_bytes("text", b"(module (func")
        .expect_err("invalid");
    assert!(matches!(err, LoadError::Invalid { .. }), "{err}");
}

#[test]
fn a_module_over_the_size_limit_is_refused_naming_it() {
    let sb = sandbox(|c| c.max_module_bytes = 100);
    let big = GOOD.as_bytes();
    match sb.load_bytes("big.wat", big) {
        Err(e @ LoadError::TooLarge { .. }) => {
            let msg = e.to_string();
            assert!(
                msg.contains("big.wat") && msg.contains(&format!("{} bytes", big.len())),
                "{msg}"
            );
        }
        other => panic!("not refused for its size: {:?}", other.err()),
    }
    // A file is refused from its size, before it is read: 1 GiB that take no disk.
    let dir = std::env::temp_dir().join(format!("anneal-reward-size-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("huge.wasm");
    std::fs::File::create(&path)
        .and_then(|f| f.set_len(1 << 30))
        .expect("sparse file");
    let Err(err) = sandbox(|_| {}).load_file(&path) else {
        panic!("a 1 GiB module was loaded");
    };
    assert!(
        matches!(err, LoadError::TooLarge { bytes, max, .. } if bytes == 1 << 30 && max == 64 << 20),
        "{err}"
    );
    assert!(err.to_string().contains("huge.wasm"), "{err}");
    std::fs::remove_dir_all(&dir).expect("clean up");
}

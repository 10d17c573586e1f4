//! End-to-end tests of environment episodes with small and hostile modules written as WAT:
//! state across steps, budgets per step and per episode, refused outputs, and a sandbox that
//! keeps working after each failure.

use anneal_reward::{
    CallError, EnvMessage, EnvModule, Episode, EpisodeLimits, EpisodeStart, ErrorKind, ModuleKind,
    Sandbox, SandboxConfig, StepOutcome,
};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// Escapes `text` for a WAT string literal.
fn wat_str(text: &str) -> String {
    text.bytes().map(|b| format!("\\{b:02x}")).collect()
}

/// An environment module: `init` returns `init_json`; `env_step` has `step_body` (params `$p`
/// and `$l`, result i32 status; it may set `$out_ptr` / `$out_len`); `extra` items come first.
/// `alloc` always returns 4096 (one input buffer, reused by every call).
fn env_with(init_json: &str, step_body: &str, extra: &str) -> String {
    format!(
        r#"(module
  {extra}
  (memory (export "memory") 1)
  (global $out_ptr (mut i32) (i32.const 0))
  (global $out_len (mut i32) (i32.const 0))
  (global $steps (mut i32) (i32.const 0))
  (data (i32.const 16) "{init}")
  (func (export "alloc") (param i32) (result i32) (i32.const 4096))
  (func (export "output_ptr") (result i32) (global.get $out_ptr))
  (func (export "output_len") (result i32) (global.get $out_len))
  (func (export "anneal_env_abi") (result i32) (i32.const 1))
  (func (export "env_init") (param $p i32) (param $l i32) (result i32)
    (global.set $out_ptr (i32.const 16))
    (global.set $out_len (i32.const {init_len}))
    (i32.const 0))
  (func (export "env_step") (param $p i32) (param $l i32) (result i32) (local $i i32)
    {step_body}))"#,
        init = wat_str(init_json),
        init_len = init_json.len(),
    )
}

const INIT: &str = r#"{"messages":[{"role":"system","content":"count"},{"role":"user","content":"go"}],"tools":[{"type":"function","function":{"name":"tick","parameters":{}}}]}"#;

/// A counter: step n answers `{"observation":"n",...}`, with reward 1 and done at step 3. The
/// count lives in a global, so it shows that state persists across steps.
fn counter() -> String {
    let template = r#"{"observation":"0","reward":0,"done":false}"#;
    let digit = template.find('0').expect("digit");
    let reward = template.rfind('0').expect("reward");
    let done = template.find("false").expect("done");
    let body = format!(
        r#"(global.set $steps (i32.add (global.get $steps) (i32.const 1)))
    (i32.store8 (i32.const {d}) (i32.add (i32.const 48) (global.get $steps)))
    (if (i32.eq (global.get $steps) (i32.const 3))
      (then
        (i32.store8 (i32.const {r}) (i32.const 49))
        (i32.store8 (i32.const {t}) (i32.const 116))
        (i32.store (i32.const {t1}) (i32.const 0x20657572))))  ;; "true " over "false"
    (global.set $out_ptr (i32.const 1024))
    (global.set $out_len (i32.const {len}))
    (i32.const 0)"#,
        d = 1024 + digit,
        r = 1024 + reward,
        t = 1024 + done,
        t1 = 1024 + done + 1,
        len = template.len(),
    );
    env_with(
        INIT,
        &body,
        &format!(r#"(data (i32.const 1024) "{}")"#, wat_str(template)),
    )
}

/// Answers each turn with the turn itself (so a test chooses the step output).
fn echo() -> String {
    env_with(
        r#"{"text":"echo"}"#,
        "(global.set $out_ptr (local.get $p)) (global.set $out_len (local.get $l)) (i32.const 0)",
        "",
    )
}

/// A step that does `body` before answering `{}`.
fn step_doing(body: &str) -> String {
    env_with(
        r#"{"text":"x"}"#,
        &format!(
            "{body} (global.set $out_ptr (i32.const 2000)) (global.set $out_len (i32.const 2)) \
             (i32.const 0)"
        ),
        r#"(data (i32.const 2000) "{}")"#,
    )
}

fn sandbox() -> Sandbox {
    Sandbox::new(SandboxConfig {
        memory_bytes: 128 << 20,
        ..SandboxConfig::default()
    })
    .expect("sandbox")
}

fn limits() -> EpisodeLimits {
    EpisodeLimits {
        step_fuel: 10_000_000,
        step_timeout: Duration::from_secs(5),
        episode_fuel: 100_000_000,
        episode_timeout: Duration::from_secs(20),
        max_output_bytes: 64 << 10,
    }
}

fn load(sb: &Sandbox, wat: &str) -> EnvModule {
    sb.load_env_bytes("test-env", wat.as_bytes()).expect("load")
}

fn start(sb: &Sandbox, wat: &str, limits: EpisodeLimits) -> (Episode, EpisodeStart) {
    sb.start_episode(&load(sb, wat), &json!({"n": 1}), limits)
        .expect("start")
}

fn turn(text: &str) -> Value {
    anneal_data::chat::tools::parse_tool_calls(text).to_step_json(text)
}

/// Runs the counter's whole episode: the sandbox still works.
fn counter_episode_works(sb: &Sandbox) {
    let (mut ep, _) = start(sb, &counter(), limits());
    let outs: Vec<StepOutcome> = (0..3)
        .map(|_| ep.step(&turn("tick")).expect("step"))
        .collect();
    assert_eq!(outs[2].observation, "3");
    assert!(outs[2].done);
    ep.close();
}

/// The error of the first step of an episode of `wat`, and the episode.
fn first_step_error(sb: &Sandbox, wat: &str, limits: EpisodeLimits) -> (CallError, Episode) {
    let (mut ep, _) = start(sb, wat, limits);
    match ep.step(&turn("x")) {
        Ok(out) => panic!("expected an error, got {out:?}"),
        Err(e) => (e, ep),
    }
}

#[test]
fn a_multi_turn_episode_keeps_its_state() {
    let sb = sandbox();
    let module = load(&sb, &counter());
    assert_eq!(module.kind(), ModuleKind::Core);
    assert_eq!(module.abi_problem(), None);
    assert_eq!(module.name(), "test-env");
    assert_eq!(module.hash().len(), 64);
    let (mut ep, started) = sb
        .start_episode(&module, &json!({"question": "?"}), limits())
        .expect("start");
    assert_eq!(
        started.messages,
        vec![
            EnvMessage {
                role: "system".into(),
                content: "count".into()
            },
            EnvMessage {
                role: "user".into(),
                content: "go".into()
            },
        ]
    );
    assert_eq!(started.tools[0]["function"]["name"], "tick");
    let after_init = ep.fuel_used();
    assert!(after_init > 0);
    for n in 1..=3 {
        let out = ep.step(&turn("tick")).expect("step");
        assert_eq!(out.observation, n.to_string());
        assert_eq!(out.role, "tool");
        assert_eq!(out.reward, if n == 3 { 1.0 } else { 0.0 });
        assert_eq!(out.done, n == 3);
        assert_eq!(out.details, None);
    }
    assert_eq!(ep.steps(), 3);
    assert!(ep.fuel_used() > after_init);
    assert!(ep.is_over());
    // Done: a later step runs nothing and is not counted.
    let calls = sb.metrics_snapshot().calls;
    let e = ep.step(&turn("again")).expect_err("over");
    assert_eq!(e.kind(), ErrorKind::EpisodeOver);
    assert!(e.to_string().contains("done"), "{e}");
    assert_eq!(sb.metrics_snapshot().calls, calls);
    ep.close();
    let m = sb.metrics_snapshot();
    assert_eq!((m.calls, m.ok, m.total_errors()), (5, 5, 0)); // init, 3 steps, close (none exported)
                                                              // A second episode starts from a fresh instance.
    let (mut again, _) = sb
        .start_episode(&module, &json!({}), limits())
        .expect("start");
    assert_eq!(again.step(&turn("tick")).expect("step").observation, "1");
}

#[test]
fn the_turn_reaches_the_module_and_step_fields_are_read() {
    let sb = sandbox();
    let (mut ep, started) = start(&sb, &echo(), limits());
    // `{"text": ..}` becomes one user message; no tools.
    assert_eq!(started.messages.len(), 1);
    assert_eq!(started.messages[0].role, "user");
    assert_eq!(started.messages[0].content, "echo");
    assert!(started.tools.is_empty());
    let out = ep
        .step(
            &json!({"observation": "héllo", "role": "user", "reward": 0.25, "done": false,
                      "details": {"k": 1}}),
        )
        .expect("step");
    assert_eq!(out.observation, "héllo");
    assert_eq!(out.role, "user");
    assert_eq!(out.reward, 0.25);
    assert_eq!(out.details.expect("details")["k"], json!(1));
    // The turn the host builds is what the module gets (here echoed as a step output, with the
    // defaults for the fields it lacks).
    let out = ep.step(&turn("plain")).expect("step");
    assert_eq!(
        (out.observation.as_str(), out.reward, out.done),
        ("", 0.0, false)
    );
}

#[test]
fn bad_step_outputs_are_bad_output_and_end_the_episode() {
    let sb = sandbox();
    let cases = [
        (json!({"observation": 5}), "`observation` is not a string"),
        (json!({"reward": "1"}), "`reward` is not a number"),
        (json!({"done": 1}), "`done` is not true or false"),
        (json!({"details": [1]}), "`details` is not a JSON object"),
        (json!({"role": ""}), "role \"\" is empty"),
        (json!([1, 2]), "step output is not a JSON object"),
    ];
    for (output, want) in cases {
        let (mut ep, _) = start(&sb, &echo(), limits());
        let e = ep.step(&output).expect_err("bad");
        assert_eq!(e.kind(), ErrorKind::BadOutput, "{output}: {e}");
        assert!(e.to_string().contains(want), "{output}: {e}");
        let again = ep.step(&output).expect_err("over");
        assert_eq!(again.kind(), ErrorKind::EpisodeOver);
        assert!(again.to_string().contains("bad_output"), "{again}");
    }
    // Text the host could never send: an infinite reward is not valid JSON.
    let wat = env_with(
        r#"{"text":"x"}"#,
        "(global.set $out_ptr (i32.const 2000)) (global.set $out_len (i32.const 14)) (i32.const 0)",
        r#"(data (i32.const 2000) "{\"reward\":1e999}")"#,
    );
    let (e, _) = first_step_error(&sb, &wat, limits());
    assert_eq!(e.kind(), ErrorKind::BadOutput, "{e}");
    assert!(e.to_string().contains("not valid JSON"), "{e}");
    counter_episode_works(&sb);
}

#[test]
fn bad_init_outputs_fail_the_start() {
    let sb = sandbox();
    let cases = [
        (r#"{"messages":[]}"#, "no messages"),
        (r#"{"messages":[{"role":"user"}]}"#, "no string `content`"),
        (r#"{"text":"a","messages":[]}"#, "both"),
        (r#"{"tools":[]}"#, "neither"),
        (
            r#"{"text":"a","tools":[{"type":"function"}]}"#,
            "tools[0] has no `function`",
        ),
        (r#"{"text":"a","tools":{}}"#, "`tools` is not a list"),
        ("not json", "not valid JSON"),
    ];
    for (init, want) in cases {
        let m = load(&sb, &env_with(init, "(i32.const 0)", ""));
        let e = sb
            .start_episode(&m, &json!({}), limits())
            .expect_err("bad init");
        assert_eq!(e.kind(), ErrorKind::BadOutput, "{init}: {e}");
        assert!(e.to_string().contains(want), "{init}: {e}");
    }
    counter_episode_works(&sb);
}

#[test]
fn an_error_status_is_the_environments_error_with_its_message() {
    let sb = sandbox();
    let wat = env_with(
        r#"{"text":"x"}"#,
        "(global.set $out_ptr (i32.const 2000)) (global.set $out_len (i32.const 12)) (i32.const 1)",
        r#"(data (i32.const 2000) "unknown task")"#,
    );
    let (e, _) = first_step_error(&sb, &wat, limits());
    assert_eq!(
        e,
        CallError::Env {
            message: "unknown task".into()
        }
    );
    assert_eq!(e.kind(), ErrorKind::EnvError);
    assert_eq!(sb.metrics_snapshot().errors_of(ErrorKind::EnvError), 1);
}

#[test]
fn an_infinite_loop_in_step_runs_out_of_fuel_then_time() {
    let sb = sandbox();
    let looping = step_doing("(loop (br 0))");
    let (e, _) = first_step_error(&sb, &looping, limits());
    assert_eq!(e, CallError::FuelExhausted { fuel: 10_000_000 });
    // With fuel to spare, the step's deadline stops it.
    let slow = EpisodeLimits {
        step_fuel: u64::MAX / 4,
        episode_fuel: u64::MAX / 2,
        step_timeout: Duration::from_millis(100),
        ..limits()
    };
    let t = Instant::now();
    let (e, _) = first_step_error(&sb, &looping, slow);
    assert_eq!(e, CallError::Timeout { timeout_ms: 100 });
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    // An episode budget smaller than the step's deadline is the one named.
    let short = EpisodeLimits {
        episode_timeout: Duration::from_millis(50),
        ..slow
    };
    let (e, ep) = first_step_error(&sb, &looping, short);
    assert_eq!(e, CallError::EpisodeTimeout { timeout_ms: 50 });
    assert_eq!(e.kind(), ErrorKind::Timeout);
    assert!(ep.micros() >= 40_000, "{}", ep.micros());
    counter_episode_works(&sb);
}

#[test]
fn the_episode_fuel_budget_holds_across_steps() {
    let sb = sandbox();
    let busy = step_doing(
        "(loop (local.set $i (i32.add (local.get $i) (i32.const 1)))
           (br_if 0 (i32.lt_u (local.get $i) (i32.const 100000))))",
    );
    // Measure init and one step (fuel is deterministic).
    let (mut probe, _) = start(&sb, &busy, limits());
    let init = probe.fuel_used();
    probe.step(&turn("x")).expect("step");
    let step = probe.fuel_used() - init;
    assert!(step > 100_000, "{step}");
    let budget = init + 3 * step + step / 2;
    let (mut ep, _) = start(
        &sb,
        &busy,
        EpisodeLimits {
            episode_fuel: budget,
            ..limits()
        },
    );
    for _ in 0..3 {
        ep.step(&turn("x")).expect("within the budget");
    }
    let e = ep.step(&turn("x")).expect_err("over the budget");
    assert_eq!(e, CallError::EpisodeFuelExhausted { fuel: budget });
    assert_eq!(e.kind(), ErrorKind::FuelExhausted);
    assert!(e.to_string().contains("the episode used up"), "{e}");
    assert_eq!(ep.fuel_used(), budget);
    assert_eq!(ep.steps(), 4);
    // After the error every step is refused without running.
    let e = ep.step(&turn("x")).expect_err("over");
    assert_eq!(e.kind(), ErrorKind::EpisodeOver);
    assert!(e.to_string().contains("fuel_exhausted"), "{e}");
    assert_eq!(ep.steps(), 4);
    ep.close();
    counter_episode_works(&sb);
}

#[test]
fn a_memory_bomb_hits_the_memory_limit() {
    let sb = sandbox();
    let bomb = step_doing("(loop (br_if 0 (i32.ne (memory.grow (i32.const 16)) (i32.const -1))))");
    let (e, _) = first_step_error(&sb, &bomb, limits());
    assert_eq!(e.kind(), ErrorKind::MemoryLimit, "{e}");
    assert!(e.to_string().contains("limit 134217728 bytes"), "{e}");
    counter_episode_works(&sb);
}

#[test]
fn a_100_mb_observation_is_refused_from_its_length() {
    let sb = sandbox();
    // 1600 more pages (~105 MB) of zeros, the first 100 MB of which is the "output".
    let huge = env_with(
        r#"{"text":"x"}"#,
        "(drop (memory.grow (i32.const 1600)))
         (global.set $out_ptr (i32.const 65536))
         (global.set $out_len (i32.const 100000000))
         (i32.const 0)",
        "",
    );
    let t = Instant::now();
    let (e, _) = first_step_error(&sb, &huge, limits());
    assert_eq!(e.kind(), ErrorKind::BadOutput, "{e}");
    assert!(
        e.to_string()
            .contains("output of 100000000 bytes is over the limit of 65536 bytes"),
        "{e}"
    );
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    // An output pointing past memory is refused too.
    let outside = env_with(
        r#"{"text":"x"}"#,
        "(global.set $out_ptr (i32.const 65530)) (global.set $out_len (i32.const 100)) (i32.const 0)",
        "",
    );
    let (e, _) = first_step_error(&sb, &outside, limits());
    assert!(e.to_string().contains("out of bounds of memory"), "{e}");
    counter_episode_works(&sb);
}

#[test]
fn invalid_utf8_and_traps_end_the_episode() {
    let sb = sandbox();
    let latin1 = env_with(
        r#"{"text":"x"}"#,
        "(global.set $out_ptr (i32.const 2000)) (global.set $out_len (i32.const 4)) (i32.const 0)",
        r#"(data (i32.const 2000) "\22\ff\fe\22")"#,
    );
    let (e, _) = first_step_error(&sb, &latin1, limits());
    assert_eq!(e.kind(), ErrorKind::BadOutput);
    assert!(e.to_string().contains("output is not UTF-8"), "{e}");

    let (e, mut ep) = first_step_error(&sb, &step_doing("unreachable"), limits());
    assert_eq!(e.kind(), ErrorKind::Trap);
    assert!(
        e.message().contains("`unreachable` instruction executed"),
        "{e}"
    );
    let after = ep.step(&turn("x")).expect_err("over");
    assert_eq!(after.kind(), ErrorKind::EpisodeOver);
    assert!(after.to_string().contains("trap"), "{after}");
    ep.close(); // a failed instance is not entered again
    counter_episode_works(&sb);
    let m = sb.metrics_snapshot();
    assert_eq!(m.errors_of(ErrorKind::Trap), 1);
    assert_eq!(m.errors_of(ErrorKind::BadOutput), 1);
    assert_eq!(m.errors_of(ErrorKind::EpisodeOver), 0);
}

#[test]
fn a_trap_in_init_fails_the_start() {
    let sb = sandbox();
    let wat = r#"(module
  (memory (export "memory") 1)
  (func (export "alloc") (param i32) (result i32) (i32.const 4096))
  (func (export "output_ptr") (result i32) (i32.const 0))
  (func (export "output_len") (result i32) (i32.const 0))
  (func (export "env_init") (param i32 i32) (result i32) unreachable)
  (func (export "env_step") (param i32 i32) (result i32) (i32.const 0)))"#;
    let e = sb
        .start_episode(&load(&sb, wat), &json!({}), limits())
        .expect_err("trap");
    assert_eq!(e.kind(), ErrorKind::Trap);
}

#[test]
fn close_is_called_and_its_errors_are_counted() {
    let sb = sandbox();
    let closing = env_with(
        r#"{"text":"x"}"#,
        "(i32.const 0)",
        r#"(func (export "env_close") unreachable)"#,
    );
    let (ep, _) = start(&sb, &closing, limits());
    ep.close();
    let m = sb.metrics_snapshot();
    assert_eq!((m.calls, m.errors_of(ErrorKind::Trap)), (2, 1));
}

#[test]
fn missing_exports_are_abi_mismatch() {
    let sb = sandbox();
    let no_step = r#"(module
  (memory (export "memory") 1)
  (func (export "alloc") (param i32) (result i32) (i32.const 0))
  (func (export "output_ptr") (result i32) (i32.const 0))
  (func (export "output_len") (result i32) (i32.const 0))
  (func (export "env_init") (param i32 i32) (result i32) (i32.const 0)))"#;
    let m = load(&sb, no_step);
    assert_eq!(
        m.abi_problem(),
        Some("missing function export `env_step` (i32, i32) -> i32")
    );
    let e = sb.start_episode(&m, &json!({}), limits()).expect_err("abi");
    assert_eq!(e.kind(), ErrorKind::AbiMismatch);
    // A reward module is not an environment.
    let reward = r#"(module (memory (export "memory") 1)
  (func (export "alloc") (param i32) (result i32) (i32.const 0))
  (func (export "score") (param i32 i32 i32 i32 i32 i32) (result f64) (f64.const 1)))"#;
    assert!(load(&sb, reward).abi_problem().is_some());
    // The version export must say 1.
    let v2 = counter().replace(
        r#"(func (export "anneal_env_abi") (result i32) (i32.const 1))"#,
        r#"(func (export "anneal_env_abi") (result i32) (i32.const 2))"#,
    );
    let e = sb
        .start_episode(&load(&sb, &v2), &json!({}), limits())
        .expect_err("abi");
    assert!(e.to_string().contains("anneal_env_abi() returned 2"), "{e}");
}

#[test]
fn load_errors_name_an_environment_module() {
    let sb = sandbox();
    let e = sb
        .load_env_bytes("bad.wasm", b"\0asm garbage")
        .expect_err("invalid");
    assert!(
        e.to_string()
            .starts_with("invalid environment module bad.wasm"),
        "{e}"
    );
    let e = sb
        .load_env_file(std::path::Path::new("/nonexistent/env.wasm"))
        .expect_err("missing");
    assert!(
        e.to_string().starts_with("cannot read environment module"),
        "{e}"
    );
}

#[test]
fn episodes_are_send_and_outlive_their_sandbox() {
    fn is_send<T: Send>(_: &T) {}
    let sb = sandbox();
    let (mut ep, _) = start(&sb, &counter(), limits());
    is_send(&ep);
    drop(sb);
    let handle = std::thread::spawn(move || ep.step(&turn("tick")).map(|o| o.observation));
    assert_eq!(handle.join().expect("thread").expect("step"), "1");
}

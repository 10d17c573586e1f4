//! The example environments (`reward-wasm/envs`), built by `reward-wasm/build-envs.sh` (run by
//! `scripts/setup-reward.sh`): a scripted episode through each. A module that is not built
//! fails the test when `CI=true` and is skipped with a printed reason otherwise.

use anneal_reward::{
    CallError, EnvModule, Episode, EpisodeLimits, ErrorKind, Sandbox, SandboxConfig, StepOutcome,
};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

fn reward_wasm() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../reward-wasm")
}

/// One sandbox for all tests, with a disk cache so the Python component (~18 MB) compiles once
/// per checkout.
fn sandbox() -> &'static Sandbox {
    static SANDBOX: OnceLock<Sandbox> = OnceLock::new();
    SANDBOX.get_or_init(|| {
        Sandbox::new(SandboxConfig {
            cache_dir: Some(reward_wasm().join("out/.cache")),
            ..SandboxConfig::default()
        })
        .expect("sandbox")
    })
}

/// The default limits, with time for a Python component's instantiation on a busy machine.
fn limits() -> EpisodeLimits {
    EpisodeLimits {
        step_timeout: Duration::from_secs(20),
        episode_timeout: Duration::from_secs(60),
        ..EpisodeLimits::default()
    }
}

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// Loads `out/env_<name>.wasm` into `sb`, or explains why there is none (failing in CI).
fn module(sb: &Sandbox, name: &str) -> Option<EnvModule> {
    let path = reward_wasm().join(format!("out/env_{name}.wasm"));
    if !path.exists() {
        let msg = format!(
            "the {name} environment is not built ({} missing); run `bash scripts/setup-reward.sh` \
             (toolchains + build) or `reward-wasm/build-envs.sh {name}`",
            path.display()
        );
        if in_ci() {
            panic!("{msg}");
        }
        eprintln!("SKIPPED {name}: {msg}");
        return None;
    }
    let m = sb
        .load_env_file(&path)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(m.abi_problem(), None, "{name}");
    Some(m)
}

fn call(calls: &[(&str, Value)]) -> Value {
    let text: String = calls
        .iter()
        .map(|(name, args)| {
            format!(
                "<tool_call>{}</tool_call>",
                json!({"name": name, "arguments": args})
            )
        })
        .collect();
    turn(&format!("Let me use the tool.\n{text}"))
}

/// The turn a policy's `text` becomes, as the host parses it.
fn turn(text: &str) -> Value {
    anneal_data::chat::tools::parse_tool_calls(text).to_step_json(text)
}

fn step(name: &str, ep: &mut Episode, turn: &Value) -> StepOutcome {
    ep.step(turn)
        .unwrap_or_else(|e| panic!("{name}: step {turn}: {e}"))
}

fn observe(name: &str, ep: &mut Episode, calls: &[(&str, Value)]) -> String {
    let out = step(name, ep, &call(calls));
    assert_eq!(
        (out.role.as_str(), out.reward, out.done),
        ("tool", 0.0, false),
        "{name}"
    );
    out.observation
}

/// The scripted calculator episode every language's calculator must pass.
fn calculator(name: &str) {
    let sb = sandbox();
    let Some(m) = module(sb, name) else {
        return;
    };
    let task = json!({"question": "347*86=", "answer": "29842"});
    let (mut ep, start) = sb
        .start_episode(&m, &task, limits())
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(start.messages.len(), 1, "{name}");
    assert_eq!(start.messages[0].role, "user", "{name}");
    assert_eq!(start.messages[0].content, "347*86=", "{name}");
    assert_eq!(start.tools.len(), 1, "{name}");
    let tool = &start.tools[0];
    assert_eq!(tool["type"], "function", "{name}");
    assert_eq!(tool["function"]["name"], "calculator", "{name}");
    assert_eq!(
        tool["function"]["parameters"]["properties"]["expression"]["type"], "string",
        "{name}"
    );

    let calc = |e: &str| ("calculator", json!({ "expression": e }));
    assert_eq!(observe(name, &mut ep, &[calc("347*86")]), "29842", "{name}");
    assert_eq!(
        observe(name, &mut ep, &[calc("(2+3) * -4 - 7 / 2 % 2")]),
        "-21"
    );
    assert_eq!(
        observe(
            name,
            &mut ep,
            &[calc("170141183460469231731687303715884105727 + 1")]
        ),
        "error: overflow",
        "{name}"
    );
    assert_eq!(
        observe(name, &mut ep, &[calc("1/(2-2)")]),
        "error: division by zero",
        "{name}"
    );
    assert!(
        observe(name, &mut ep, &[calc("2+")]).starts_with("error: "),
        "{name}"
    );
    let unknown = observe(name, &mut ep, &[("search", json!({"q": "x"}))]);
    assert!(
        unknown.starts_with("error: unknown tool"),
        "{name}: {unknown}"
    );
    let bad_args = observe(name, &mut ep, &[("calculator", json!({"expr": "1"}))]);
    assert!(bad_args.starts_with("error: "), "{name}: {bad_args}");
    assert_eq!(
        observe(name, &mut ep, &[calc("2+3"), calc("2*3")]),
        "call_0: 5\ncall_1: 6",
        "{name}"
    );

    let out = step(name, &mut ep, &turn("So 347*86 = 29842."));
    assert_eq!((out.reward, out.done), (1.0, true), "{name}");
    assert_eq!(
        out.details.expect("details")["correct"],
        json!(true),
        "{name}"
    );
    assert_eq!(
        ep.step(&turn("again")).expect_err("done").kind(),
        ErrorKind::EpisodeOver
    );
    assert_eq!(ep.steps(), 9, "{name}");
    eprintln!(
        "{name}: 9 steps, {} fuel, {} µs in the module",
        ep.fuel_used(),
        ep.micros()
    );
    ep.close();

    // A wrong final answer, straight away; the answer may be a JSON number too.
    let task = json!({"question": "6*7=", "answer": 42});
    let (mut ep, _) = sb.start_episode(&m, &task, limits()).expect("start");
    let out = step(name, &mut ep, &turn("It is 41."));
    assert_eq!((out.reward, out.done), (0.0, true), "{name}");
    assert_eq!(
        out.details.expect("details")["correct"],
        json!(false),
        "{name}"
    );
    let (mut ep, _) = sb.start_episode(&m, &task, limits()).expect("start");
    let out = step(name, &mut ep, &turn("-42? no: 42"));
    assert_eq!(out.reward, 1.0, "{name}");

    // A task it cannot run is the environment's error.
    match sb.start_episode(&m, &json!({"answer": "1"}), limits()) {
        Err(CallError::Env { message }) => {
            assert!(message.contains("question"), "{name}: {message}")
        }
        Err(e) => panic!("{name}: expected env_error, got {e}"),
        Ok(_) => panic!("{name}: expected env_error, got a start"),
    }
}

/// A long episode of large turns under a small memory limit: each call's input and output
/// must be freed or reused, or the instance would grow past the limit.
fn long_episode(name: &str) {
    let sb = Sandbox::new(SandboxConfig {
        memory_bytes: 4 << 20,
        ..SandboxConfig::default()
    })
    .expect("sandbox");
    let Some(m) = module(&sb, name) else {
        return;
    };
    let task = json!({"question": "1+1=", "answer": "2"});
    let (mut ep, _) = sb
        .start_episode(&m, &task, limits())
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let padding = "x".repeat(8 << 10);
    let turn = turn(&format!(
        "{padding}<tool_call>{}</tool_call>",
        json!({"name": "calculator", "arguments": {"expression": "1+1"}})
    ));
    for i in 0..1000 {
        let out = ep
            .step(&turn)
            .unwrap_or_else(|e| panic!("{name}: step {i}: {e}"));
        assert_eq!(out.observation, "2", "{name}");
    }
    ep.close();
}

#[test]
fn calculator_rust() {
    calculator("calculator");
    long_episode("calculator");
}

#[test]
fn calculator_c() {
    calculator("calculator_c");
    long_episode("calculator_c");
}

#[test]
fn calculator_zig() {
    calculator("calculator_zig");
    long_episode("calculator_zig");
}

#[test]
fn calculator_python_component() {
    calculator("calculator_py");
}

#[test]
fn code() {
    let sb = sandbox();
    let Some(m) = module(sb, "code") else {
        return;
    };
    let task = json!({"question": "What is the sum of 1..100?", "answer": "5050"});
    let (mut ep, start) = sb.start_episode(&m, &task, limits()).expect("start");
    assert_eq!(start.messages[0].content, "What is the sum of 1..100?");
    assert_eq!(start.tools[0]["function"]["name"], "run");
    let run = |code: &str| ("run", json!({ "code": code }));
    let program = "i = 1; s = 0\nwhile i <= 100 { s = s + i; i = i + 1 }\nprint(s)";
    assert_eq!(observe("code", &mut ep, &[run(program)]), "5050\n");
    // The policy's infinite loop is an answer, not a trap; so is a flood of output.
    assert_eq!(
        observe("code", &mut ep, &[run("while true { }")]),
        "error: step limit reached (100000 steps)"
    );
    let flood = observe("code", &mut ep, &[run("while 1 { print(\"spam\") }")]);
    assert!(flood.contains("[output cut at 2048 bytes]"), "{flood}");
    assert!(flood.len() < 2200, "{}", flood.len());
    assert_eq!(
        observe("code", &mut ep, &[run("print(1/0)")]),
        "error: division by zero"
    );
    let out = step("code", &mut ep, &turn("The sum is 5050."));
    assert_eq!((out.reward, out.done), (1.0, true));
    assert_eq!(out.details.expect("details")["correct"], json!(true));
    eprintln!(
        "code: {} fuel, {} µs in the module",
        ep.fuel_used(),
        ep.micros()
    );
}

#[test]
fn retrieval() {
    let sb = sandbox();
    let Some(m) = module(sb, "retrieval") else {
        return;
    };
    // A person of the embedded corpus, the town they live in and its code.
    let corpus = std::fs::read_to_string(reward_wasm().join("envs/retrieval/corpus.tsv")).unwrap();
    let docs: Vec<(&str, &str)> = corpus.lines().filter_map(|l| l.split_once('\t')).collect();
    let quoted = |text: &str| text.split('"').nth(1).unwrap().to_string();
    let (person, lives) = *docs.iter().find(|(_, t)| t.contains(" lives in ")).unwrap();
    let town = quoted(lives);
    let (_, town_doc) = *docs.iter().find(|(title, _)| *title == town).unwrap();
    let code = quoted(town_doc);
    let question = format!("Code of the town where \"{person}\" lives?");
    let task = json!({"question": question, "answer": code});
    let (mut ep, start) = sb.start_episode(&m, &task, limits()).expect("start");
    assert_eq!(start.messages[0].content, question);
    assert_eq!(start.tools[0]["function"]["name"], "search");
    let search = |query: &str| ("search", json!({ "query": query }));
    // An exact title comes first, then the closest titles: four documents.
    let found = observe("retrieval", &mut ep, &[search(person)]);
    let lines: Vec<&str> = found.lines().collect();
    assert_eq!((lines.len(), lines[0]), (4, lives), "{found}");
    let found = observe("retrieval", &mut ep, &[search(&town.to_lowercase())]);
    assert_eq!(found.lines().next(), Some(town_doc), "{found}");
    // A misspelt name still finds the person, among neighbours; nothing alike finds nothing.
    let near = observe("retrieval", &mut ep, &[search(&format!("{person}x"))]);
    assert!(near.lines().any(|l| l == lives), "{near}");
    assert_eq!(
        observe("retrieval", &mut ep, &[search("#!?")]),
        "no results"
    );
    assert!(
        observe("retrieval", &mut ep, &[("lookup", json!({}))]).starts_with("error: unknown tool")
    );
    let out = step("retrieval", &mut ep, &turn(&format!("The code is {code}.")));
    assert_eq!((out.reward, out.done), (1.0, true));
    assert_eq!(out.details.expect("details")["correct"], json!(true));
}

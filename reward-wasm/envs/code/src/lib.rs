//! The code-execution environment (reward-wasm/ENVIRONMENTS.md): the task
//! `{"question": "...", "answer": "..."}` opens as one user message; the policy may call
//! `run(code)`, which runs a program in the small language of [`lang`] (a step limit, so an
//! infinite loop answers "step limit reached" instead of trapping, and output cut at 2 KiB);
//! a turn without tool calls is the final answer: reward 1 when its last integer equals the
//! answer, and the episode is done.

mod lang;

use anneal_reward_sdk::env::{answer_matches, Environment, Json, Start, Step, ToolCall, Turn};
use anneal_reward_sdk::export_environment;

struct Code {
    answer: String,
}

const DESCRIPTION: &str = "Runs a program and returns what it prints. The language: integers \
and strings, variables (x = 1), if cond { ... } else { ... }, while cond { ... }, print(a, b), \
len(s), str(x), int(s), + - * / %, == != < <= > >=, and, or, not. Statements end at a newline \
or `;`.";

const PARAMETERS: &str = r#"{"type":"object","properties":{"code":{"type":"string","description":"the program"}},"required":["code"]}"#;

impl Environment for Code {
    fn init(task: &Json) -> Result<(Self, Start), String> {
        let question = task
            .get("question")
            .and_then(Json::as_str)
            .ok_or("the task has no string `question`")?;
        let answer = task
            .get("answer")
            .and_then(Json::as_text)
            .ok_or("the task has no `answer`")?;
        let start = Start::text(question).with_tool("run", DESCRIPTION, PARAMETERS);
        Ok((
            Code {
                answer: answer.to_string(),
            },
            start,
        ))
    }

    fn step(&mut self, turn: &Turn) -> Result<Step, String> {
        if turn.tool_calls.is_empty() {
            if let Some(error) = &turn.error {
                return Ok(Step::observation(format!("error: {error}")));
            }
            let correct = answer_matches(&turn.content, &self.answer);
            return Ok(Step::done(if correct { 1.0 } else { 0.0 })
                .with_details(format!("{{\"correct\":{correct}}}")));
        }
        let results: Vec<String> = turn.tool_calls.iter().map(call).collect();
        let observation = match results.as_slice() {
            [one] => one.clone(),
            many => turn
                .tool_calls
                .iter()
                .zip(many)
                .map(|(c, r)| format!("{}: {r}", c.id))
                .collect::<Vec<_>>()
                .join("\n"),
        };
        Ok(Step::observation(observation))
    }
}

fn call(c: &ToolCall) -> String {
    if c.name != "run" {
        return format!("error: unknown tool `{}` (the tool is `run`)", c.name);
    }
    match c.arguments.get("code").and_then(Json::as_str) {
        Some(code) => lang::run(code),
        None => "error: run takes {\"code\": string}".into(),
    }
}

export_environment!(Code);

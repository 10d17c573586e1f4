//! The code-execution environment (reward-wasm/ENVIRONMENTS.md): the task
//! `{"question": "...", "answer": "..."}` opens as one user message; the policy may call
//! `run(code)`, which runs a program in the small language of [`lang`] (a step limit, so an
//! infinite loop answers "step limit reached" instead of trapping, and output cut at 2 KiB);
//! a turn without tool calls is the final answer: reward 1 when its last integer equals the
//! answer, and the episode is done.

mod lang;

use anneal_reward_sdk::env::{
    final_answer, question_and_answer, tool_results, Environment, Json, Start, Step, ToolCall, Turn,
};
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
        let (question, answer) = question_and_answer(task)?;
        let start = Start::text(question).with_tool("run", DESCRIPTION, PARAMETERS);
        Ok((Code { answer }, start))
    }

    fn step(&mut self, turn: &Turn) -> Result<Step, String> {
        if let Some(end) = final_answer(turn, &self.answer) {
            return Ok(end);
        }
        let results: Vec<String> = turn.tool_calls.iter().map(call).collect();
        Ok(Step::observation(tool_results(turn, &results)))
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

//! The calculator environment (reward-wasm/ENVIRONMENTS.md): the task
//! `{"question": "347*86=", "answer": "29842"}` opens as one user message with the question;
//! the policy may call `calculator(expression)` (integers, `+ - * / %`, parentheses, evaluated
//! exactly in i128: overflow and division by zero are error texts, `/` truncates toward
//! zero); a turn without tool calls is the final answer: reward 1 when its last integer equals
//! the answer, and the episode is done.

use anneal_reward_sdk::env::{
    final_answer, question_and_answer, tool_results, Environment, Json, Start, Step, ToolCall, Turn,
};
use anneal_reward_sdk::export_environment;

struct Calculator {
    answer: String,
}

const PARAMETERS: &str = r#"{"type":"object","properties":{"expression":{"type":"string","description":"an integer expression, e.g. (12+3)*4"}},"required":["expression"]}"#;

impl Environment for Calculator {
    fn init(task: &Json) -> Result<(Self, Start), String> {
        let (question, answer) = question_and_answer(task)?;
        let start = Start::text(question).with_tool(
            "calculator",
            "Evaluates an integer arithmetic expression exactly.",
            PARAMETERS,
        );
        Ok((Calculator { answer }, start))
    }

    fn step(&mut self, turn: &Turn) -> Result<Step, String> {
        if let Some(end) = final_answer(turn, &self.answer) {
            return Ok(end);
        }
        let results: Vec<String> = turn.tool_calls.iter().map(call).collect();
        Ok(Step::observation(tool_results(turn, &results)))
    }
}

/// The result of one tool call, or an error text.
fn call(c: &ToolCall) -> String {
    if c.name != "calculator" {
        return format!(
            "error: unknown tool `{}` (the tool is `calculator`)",
            c.name
        );
    }
    let Some(expression) = c.arguments.get("expression").and_then(Json::as_text) else {
        return "error: calculator takes {\"expression\": string}".into();
    };
    match evaluate(expression) {
        Ok(n) => n.to_string(),
        Err(e) => format!("error: {e}"),
    }
}

/// Evaluates an integer expression exactly.
pub fn evaluate(text: &str) -> Result<i128, String> {
    let mut p = Expr {
        b: text.as_bytes(),
        i: 0,
        depth: 0,
    };
    let v = p.sum()?;
    p.ws();
    if p.i < p.b.len() {
        return Err(format!("unexpected `{}` at {}", p.b[p.i] as char, p.i));
    }
    Ok(v)
}

struct Expr<'a> {
    b: &'a [u8],
    i: usize,
    depth: usize,
}

impl Expr<'_> {
    fn ws(&mut self) {
        while self.b.get(self.i).is_some_and(u8::is_ascii_whitespace) {
            self.i += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.ws();
        self.b.get(self.i).copied()
    }

    fn sum(&mut self) -> Result<i128, String> {
        let mut v = self.product()?;
        while let Some(op @ (b'+' | b'-')) = self.peek() {
            self.i += 1;
            let r = self.product()?;
            v = if op == b'+' {
                v.checked_add(r)
            } else {
                v.checked_sub(r)
            }
            .ok_or("overflow")?;
        }
        Ok(v)
    }

    fn product(&mut self) -> Result<i128, String> {
        let mut v = self.unary()?;
        while let Some(op @ (b'*' | b'/' | b'%')) = self.peek() {
            self.i += 1;
            let r = self.unary()?;
            if op != b'*' && r == 0 {
                return Err("division by zero".into());
            }
            v = match op {
                b'*' => v.checked_mul(r),
                b'/' => v.checked_div(r),
                _ => v.checked_rem(r),
            }
            .ok_or("overflow")?;
        }
        Ok(v)
    }

    fn unary(&mut self) -> Result<i128, String> {
        self.depth += 1;
        if self.depth > 200 {
            return Err("expression nested too deeply".into());
        }
        let v = match self.peek() {
            Some(b'-') => {
                self.i += 1;
                self.unary()?.checked_neg().ok_or("overflow")?
            }
            Some(b'+') => {
                self.i += 1;
                self.unary()?
            }
            Some(b'(') => {
                self.i += 1;
                let v = self.sum()?;
                if self.peek() != Some(b')') {
                    return Err(format!("expected `)` at {}", self.i));
                }
                self.i += 1;
                v
            }
            Some(c) if c.is_ascii_digit() => {
                let start = self.i;
                while self.b.get(self.i).is_some_and(u8::is_ascii_digit) {
                    self.i += 1;
                }
                let digits =
                    std::str::from_utf8(&self.b[start..self.i]).map_err(|e| e.to_string())?;
                digits.parse::<i128>().map_err(|_| "overflow".to_string())?
            }
            Some(c) => return Err(format!("unexpected `{}` at {}", c as char, self.i)),
            None => return Err("unexpected end of expression".into()),
        };
        self.depth -= 1;
        Ok(v)
    }
}

export_environment!(Calculator);

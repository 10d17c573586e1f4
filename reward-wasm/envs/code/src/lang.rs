//! A small interpreted language for the `run` tool: integers (i64, overflow is an error) and
//! strings, variables, `if` / `else`, `while`, `print`, arithmetic and comparisons.
//!
//! ```text
//! n = 10; total = 0
//! while n > 0 { total = total + n; n = n - 1 }
//! if total == 55 { print("sum", total) } else { print("wrong") }
//! ```
//! Statements end at a newline or `;`; blocks are `{ ... }`. Operators: `+` (integers, or
//! string concatenation when either side is a string), `- * / %`, `== != < <= > >=`, `and`,
//! `or`, `not`, unary `-`. Functions: `print(a, b, ...)` (space-separated, then a newline),
//! `len(s)`, `str(x)`, `int(s)`. `true` / `false` are 1 / 0; 0 and "" are false.
//! Every statement and expression node is one step; a program stops with an error after
//! [`MAX_STEPS`] steps, and its output is cut at [`MAX_OUTPUT`] bytes.

use std::collections::HashMap;

/// Steps a program may take.
pub const MAX_STEPS: u64 = 100_000;
/// Bytes of output kept.
pub const MAX_OUTPUT: usize = 2048;
/// The longest string a program may build.
const MAX_STRING: usize = 65536;
/// The deepest nesting of blocks and expressions.
const MAX_DEPTH: usize = 64;

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Int(i64),
    Str(String),
    Name(String),
    Op(&'static str),
    End, // newline or `;`
}

const OPS: [&str; 20] = [
    "==", "!=", "<=", ">=", "<", ">", "=", "+", "-", "*", "/", "%", "(", ")", "{", "}", ",", ";",
    "\n", "!",
];

fn lex(src: &str) -> Result<Vec<Tok>, String> {
    let b = src.as_bytes();
    let mut toks = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'#' {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b' ' || c == b'\t' || c == b'\r' {
            i += 1;
        } else if c.is_ascii_digit() {
            let start = i;
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
            let n = src[start..i]
                .parse()
                .map_err(|_| format!("integer {} is too large", &src[start..i]))?;
            toks.push(Tok::Int(n));
        } else if c.is_ascii_alphabetic() || c == b'_' {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            toks.push(Tok::Name(src[start..i].to_string()));
        } else if c == b'"' {
            let mut s = String::new();
            let mut chars = src[i + 1..].char_indices();
            loop {
                match chars.next() {
                    None => return Err("unterminated string".into()),
                    Some((k, '"')) => {
                        i += k + 2;
                        break;
                    }
                    Some((_, '\\')) => match chars.next() {
                        Some((_, 'n')) => s.push('\n'),
                        Some((_, 't')) => s.push('\t'),
                        Some((_, other)) => s.push(other),
                        None => return Err("unterminated string".into()),
                    },
                    Some((_, ch)) => s.push(ch),
                }
            }
            toks.push(Tok::Str(s));
        } else if let Some(op) = OPS.iter().find(|op| src[i..].starts_with(**op)) {
            i += op.len();
            toks.push(if *op == "\n" || *op == ";" {
                Tok::End
            } else {
                Tok::Op(op)
            });
        } else {
            let ch = src[i..].chars().next().unwrap_or('?');
            return Err(format!("unexpected character `{ch}`"));
        }
    }
    Ok(toks)
}

#[derive(Debug)]
enum Expr {
    Int(i64),
    Str(String),
    Var(String),
    Unary(&'static str, Box<Expr>),
    Binary(&'static str, Box<Expr>, Box<Expr>),
    Call(String, Vec<Expr>),
}

#[derive(Debug)]
enum Stmt {
    Assign(String, Expr),
    Expr(Expr),
    If(Expr, Vec<Stmt>, Vec<Stmt>),
    While(Expr, Vec<Stmt>),
}

struct Parser {
    toks: Vec<Tok>,
    i: usize,
    depth: usize,
}

impl Parser {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.i)
    }

    fn is_op(&self, op: &str) -> bool {
        matches!(self.peek(), Some(Tok::Op(o)) if *o == op)
    }

    fn is_word(&self, w: &str) -> bool {
        matches!(self.peek(), Some(Tok::Name(n)) if n == w)
    }

    fn expect(&mut self, op: &str) -> Result<(), String> {
        if self.is_op(op) {
            self.i += 1;
            Ok(())
        } else {
            Err(format!("expected `{op}`, found {}", self.found()))
        }
    }

    fn found(&self) -> String {
        match self.peek() {
            None => "the end of the program".into(),
            Some(Tok::End) => "the end of the line".into(),
            Some(Tok::Int(n)) => format!("`{n}`"),
            Some(Tok::Str(s)) => format!("{s:?}"),
            Some(Tok::Name(n)) => format!("`{n}`"),
            Some(Tok::Op(o)) => format!("`{o}`"),
        }
    }

    fn deeper(&mut self) -> Result<(), String> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err("the program is nested too deeply".into());
        }
        Ok(())
    }

    fn skip_ends(&mut self) {
        while self.peek() == Some(&Tok::End) {
            self.i += 1;
        }
    }

    /// Statements up to `}` (inside a block) or the end.
    fn block(&mut self, inner: bool) -> Result<Vec<Stmt>, String> {
        self.deeper()?;
        let mut stmts = Vec::new();
        loop {
            self.skip_ends();
            match self.peek() {
                None if inner => return Err("missing `}`".into()),
                None => break,
                Some(Tok::Op("}")) if inner => {
                    self.i += 1;
                    break;
                }
                _ => stmts.push(self.statement()?),
            }
        }
        self.depth -= 1;
        Ok(stmts)
    }

    fn braces(&mut self) -> Result<Vec<Stmt>, String> {
        self.expect("{")?;
        self.block(true)
    }

    fn statement(&mut self) -> Result<Stmt, String> {
        if self.is_word("if") {
            self.i += 1;
            let cond = self.expr()?;
            let then = self.braces()?;
            let otherwise = if self.is_word("else") {
                self.i += 1;
                if self.is_word("if") {
                    vec![self.statement()?]
                } else {
                    self.braces()?
                }
            } else {
                Vec::new()
            };
            return Ok(Stmt::If(cond, then, otherwise));
        }
        if self.is_word("while") {
            self.i += 1;
            let cond = self.expr()?;
            return Ok(Stmt::While(cond, self.braces()?));
        }
        if let (Some(Tok::Name(name)), Some(Tok::Op("="))) =
            (self.toks.get(self.i), self.toks.get(self.i + 1))
        {
            let name = name.clone();
            self.i += 2;
            return Ok(Stmt::Assign(name, self.expr()?));
        }
        let e = self.expr()?;
        match self.peek() {
            None | Some(Tok::End) | Some(Tok::Op("}")) => Ok(Stmt::Expr(e)),
            _ => Err(format!(
                "expected the end of the line, found {}",
                self.found()
            )),
        }
    }

    fn expr(&mut self) -> Result<Expr, String> {
        self.deeper()?;
        let e = self.binary(0)?;
        self.depth -= 1;
        Ok(e)
    }

    /// Binary operators by precedence level: or; and; comparisons; + -; * / %.
    fn binary(&mut self, level: usize) -> Result<Expr, String> {
        const LEVELS: [&[&str]; 5] = [
            &["or"],
            &["and"],
            &["==", "!=", "<=", ">=", "<", ">"],
            &["+", "-"],
            &["*", "/", "%"],
        ];
        if level == LEVELS.len() {
            return self.unary();
        }
        let mut left = self.binary(level + 1)?;
        loop {
            let op = LEVELS[level]
                .iter()
                .find(|op| self.is_op(op) || self.is_word(op));
            let Some(op) = op else { break };
            self.i += 1;
            let right = self.binary(level + 1)?;
            left = Expr::Binary(op, Box::new(left), Box::new(right));
        }
        Ok(left)
    }

    fn unary(&mut self) -> Result<Expr, String> {
        if self.is_op("-") || self.is_op("!") || self.is_word("not") {
            let op = if self.is_op("-") { "-" } else { "not" };
            self.i += 1;
            self.deeper()?;
            let e = self.unary()?;
            self.depth -= 1;
            return Ok(Expr::Unary(op, Box::new(e)));
        }
        let tok = self.peek().cloned();
        self.i += 1;
        match tok {
            Some(Tok::Int(n)) => Ok(Expr::Int(n)),
            Some(Tok::Str(s)) => Ok(Expr::Str(s)),
            Some(Tok::Name(n)) if n == "true" => Ok(Expr::Int(1)),
            Some(Tok::Name(n)) if n == "false" => Ok(Expr::Int(0)),
            Some(Tok::Name(n)) if self.is_op("(") => {
                self.i += 1;
                let mut args = Vec::new();
                while !self.is_op(")") {
                    args.push(self.expr()?);
                    if !self.is_op(")") {
                        self.expect(",")?;
                    }
                }
                self.i += 1;
                Ok(Expr::Call(n, args))
            }
            Some(Tok::Name(n)) => Ok(Expr::Var(n)),
            Some(Tok::Op("(")) => {
                let e = self.expr()?;
                self.expect(")")?;
                Ok(e)
            }
            _ => {
                self.i -= 1;
                Err(format!("expected a value, found {}", self.found()))
            }
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
enum Val {
    Int(i64),
    Str(String),
}

impl Val {
    fn text(&self) -> String {
        match self {
            Val::Int(n) => n.to_string(),
            Val::Str(s) => s.clone(),
        }
    }

    fn truthy(&self) -> bool {
        match self {
            Val::Int(n) => *n != 0,
            Val::Str(s) => !s.is_empty(),
        }
    }
}

struct Machine {
    vars: HashMap<String, Val>,
    out: String,
    cut: bool,
    steps: u64,
}

impl Machine {
    fn tick(&mut self) -> Result<(), String> {
        self.steps += 1;
        if self.steps > MAX_STEPS {
            return Err(format!("step limit reached ({MAX_STEPS} steps)"));
        }
        Ok(())
    }

    fn print(&mut self, text: &str) {
        let room = MAX_OUTPUT.saturating_sub(self.out.len());
        if text.len() <= room {
            self.out.push_str(text);
            return;
        }
        let mut end = room;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        self.out.push_str(&text[..end]);
        self.cut = true;
    }

    fn run(&mut self, stmts: &[Stmt]) -> Result<(), String> {
        for s in stmts {
            self.tick()?;
            match s {
                Stmt::Assign(name, e) => {
                    let v = self.eval(e)?;
                    self.vars.insert(name.clone(), v);
                }
                Stmt::Expr(e) => {
                    self.eval(e)?;
                }
                Stmt::If(cond, then, otherwise) => {
                    if self.eval(cond)?.truthy() {
                        self.run(then)?;
                    } else {
                        self.run(otherwise)?;
                    }
                }
                Stmt::While(cond, body) => {
                    while self.eval(cond)?.truthy() {
                        self.tick()?;
                        self.run(body)?;
                    }
                }
            }
        }
        Ok(())
    }

    fn eval(&mut self, e: &Expr) -> Result<Val, String> {
        self.tick()?;
        Ok(match e {
            Expr::Int(n) => Val::Int(*n),
            Expr::Str(s) => Val::Str(s.clone()),
            Expr::Var(name) => self
                .vars
                .get(name)
                .cloned()
                .ok_or_else(|| format!("`{name}` is not defined"))?,
            Expr::Unary(op, e) => match (*op, self.eval(e)?) {
                ("-", Val::Int(n)) => Val::Int(n.checked_neg().ok_or("overflow")?),
                ("-", Val::Str(_)) => return Err("cannot negate a string".into()),
                (_, v) => Val::Int(i64::from(!v.truthy())),
            },
            Expr::Binary(op, a, b) => {
                let a = self.eval(a)?;
                if *op == "and" && !a.truthy() || *op == "or" && a.truthy() {
                    return Ok(Val::Int(i64::from(a.truthy())));
                }
                let b = self.eval(b)?;
                binary(op, a, b)?
            }
            Expr::Call(name, args) => {
                let args = args
                    .iter()
                    .map(|a| self.eval(a))
                    .collect::<Result<Vec<_>, _>>()?;
                self.call(name, args)?
            }
        })
    }

    fn call(&mut self, name: &str, args: Vec<Val>) -> Result<Val, String> {
        let one = |args: &[Val]| match args {
            [v] => Ok(v.clone()),
            _ => Err(format!("{name}() takes one argument")),
        };
        match name {
            "print" => {
                let line: Vec<String> = args.iter().map(Val::text).collect();
                self.print(&line.join(" "));
                self.print("\n");
                Ok(Val::Int(0))
            }
            "len" => match one(&args)? {
                Val::Str(s) => Ok(Val::Int(s.chars().count() as i64)),
                Val::Int(_) => Err("len() takes a string".into()),
            },
            "str" => Ok(Val::Str(one(&args)?.text())),
            "int" => match one(&args)? {
                Val::Int(n) => Ok(Val::Int(n)),
                Val::Str(s) => s
                    .trim()
                    .parse()
                    .map(Val::Int)
                    .map_err(|_| format!("int(): {s:?} is not an integer")),
            },
            _ => Err(format!("unknown function `{name}`")),
        }
    }
}

fn binary(op: &str, a: Val, b: Val) -> Result<Val, String> {
    use Val::{Int, Str};
    let bool_val = |b: bool| Int(i64::from(b));
    Ok(match (op, a, b) {
        ("and" | "or", _, b) => bool_val(b.truthy()),
        ("+", Int(x), Int(y)) => Int(x.checked_add(y).ok_or("overflow")?),
        ("+", x, y) => {
            let s = x.text() + &y.text();
            if s.len() > MAX_STRING {
                return Err(format!("string longer than {MAX_STRING} bytes"));
            }
            Str(s)
        }
        ("-", Int(x), Int(y)) => Int(x.checked_sub(y).ok_or("overflow")?),
        ("*", Int(x), Int(y)) => Int(x.checked_mul(y).ok_or("overflow")?),
        ("/" | "%", Int(_), Int(0)) => return Err("division by zero".into()),
        ("/", Int(x), Int(y)) => Int(x.checked_div(y).ok_or("overflow")?),
        ("%", Int(x), Int(y)) => Int(x.checked_rem(y).ok_or("overflow")?),
        ("==", x, y) => bool_val(x == y),
        ("!=", x, y) => bool_val(x != y),
        (cmp, Int(x), Int(y)) => bool_val(compare(cmp, x.cmp(&y))),
        (cmp @ ("<" | "<=" | ">" | ">="), Str(x), Str(y)) => bool_val(compare(cmp, x.cmp(&y))),
        (op, x, y) => return Err(format!("cannot apply `{op}` to {x:?} and {y:?}")),
    })
}

fn compare(op: &str, o: std::cmp::Ordering) -> bool {
    match op {
        "<" => o.is_lt(),
        "<=" => o.is_le(),
        ">" => o.is_gt(),
        _ => o.is_ge(),
    }
}

/// Runs `src`: its output, then `error: ...` if it failed, then a note if the output was cut.
pub fn run(src: &str) -> String {
    let result = lex(src).and_then(|toks| {
        Parser {
            toks,
            i: 0,
            depth: 0,
        }
        .block(false)
    });
    let mut m = Machine {
        vars: HashMap::new(),
        out: String::new(),
        cut: false,
        steps: 0,
    };
    let result = result.and_then(|program| m.run(&program));
    let mut text = m.out;
    if m.cut {
        text.push_str(&format!("\n[output cut at {MAX_OUTPUT} bytes]"));
    }
    if let Err(e) = result {
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        text.push_str(&format!("error: {e}"));
    }
    if text.is_empty() {
        text.push_str("(no output)");
    }
    text
}

#[cfg(test)]
mod tests {
    use super::run;

    #[test]
    fn programs_run() {
        let sum = "n = 10; total = 0\nwhile n > 0 { total = total + n; n = n - 1 }\nprint(\"sum\", total)";
        assert_eq!(run(sum), "sum 55\n");
        let branches = "x = 7\nif x % 2 == 0 { print(\"even\") } else if x > 5 and not (x == 9) { print(\"odd big\") } else { print(\"odd\") }";
        assert_eq!(run(branches), "odd big\n");
        assert_eq!(
            run("s = \"ab\" + 3; print(s, len(s), int(\"41\") + 1, str(-2))"),
            "ab3 3 42 -2\n"
        );
        assert_eq!(run("# nothing"), "(no output)");
    }

    #[test]
    fn errors_are_text() {
        assert_eq!(
            run("while 1 { }"),
            "error: step limit reached (100000 steps)"
        );
        assert_eq!(run("print(1)\nprint(1/0)"), "1\nerror: division by zero");
        assert_eq!(run("print(9223372036854775807 + 1)"), "error: overflow");
        assert_eq!(run("print(y)"), "error: `y` is not defined");
        assert_eq!(run("if 1 { print(1)"), "error: missing `}`");
        assert_eq!(run("print(1 +)"), "error: expected a value, found `)`");
        assert!(run(&"(".repeat(500)).starts_with("error: the program is nested too deeply"));
        assert_eq!(
            run("s = \"x\"\nwhile 1 { s = s + s }"),
            "error: string longer than 65536 bytes"
        );
        let long = run("while 1 { print(\"0123456789\") }");
        assert!(
            long.contains("[output cut at 2048 bytes]\nerror: step limit reached"),
            "{long}"
        );
        assert!(long.len() < 2200);
    }
}

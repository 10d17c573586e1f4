//! Shared by the `anneal serve` tests: a real server process on a random loopback port with its
//! own home folder, and a minimal HTTP/1.1 client (no client crate needed for JSON calls).

use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The repository root.
pub fn repo() -> PathBuf {
    crate::cli::root()
}

/// A fresh temporary folder for one test.
pub fn temp_home(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("anneal-serve-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp home");
    dir
}

/// A running `anneal serve`.
pub struct Server {
    pub child: Child,
    pub addr: String,
    pub home: PathBuf,
    pub token: Option<String>,
    /// Dropping the server force-stops its active runs unless they are meant to outlive it.
    leave_runs: bool,
}

impl Server {
    /// Starts `anneal serve --addr 127.0.0.1:0 --home HOME` from the repository root (so
    /// `configs/` and `web/` are the repository's) with extra arguments.
    pub fn start(home: &Path, extra: &[&str]) -> Server {
        Server::start_on("127.0.0.1:0", home, extra)
    }

    /// [`Server::start`] listening on `addr` (a port of 0 picks a free one).
    pub fn start_on(addr: &str, home: &Path, extra: &[&str]) -> Server {
        let mut child = Command::new(crate::cli::anneal_bin())
            .args(["serve", "--addr", addr, "--home"])
            .arg(home)
            .args(extra)
            .current_dir(repo())
            .env_remove("ANNEAL_TOKEN")
            .env_remove("ANNEAL_HOME")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start anneal serve");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read the listening line");
        let addr = line
            .trim()
            .rsplit("http://")
            .next()
            .filter(|a| a.contains(':'))
            .unwrap_or_else(|| panic!("unexpected first line from anneal serve: {line:?}"))
            .to_string();
        let token = extra
            .iter()
            .position(|a| *a == "--token")
            .map(|i| extra[i + 1].to_string());
        Server {
            child,
            addr,
            home: home.to_path_buf(),
            token,
            leave_runs: false,
        }
    }

    /// The base URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Kills the server abruptly (SIGKILL), as a crash would; its runs keep going.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.leave_runs = true;
    }

    /// Sends SIGTERM and waits for the server to exit; panics unless it exits with success
    /// within `within` (a server that keeps running after SIGTERM is the failure).
    pub fn terminate_within(&mut self, within: Duration) {
        kill(i64::from(self.child.id()), 15);
        let start = Instant::now();
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("wait for anneal serve") {
                break status;
            }
            assert!(
                start.elapsed() <= within,
                "anneal serve still runs {within:?} after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        assert!(status.success(), "anneal serve exited with {status}");
    }

    /// One request; returns the status and the body parsed as JSON (`Null` when empty).
    pub fn call(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
        let bytes = body.map(|b| b.to_string().into_bytes());
        let (status, raw) = self.raw(method, path, bytes.as_deref(), "application/json");
        let value = if raw.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&raw).unwrap_or_else(|e| {
                panic!(
                    "{method} {path}: not JSON ({e}): {}",
                    String::from_utf8_lossy(&raw)
                )
            })
        };
        (status, value)
    }

    pub fn get(&self, path: &str) -> (u16, Value) {
        self.call("GET", path, None)
    }

    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.call("POST", path, Some(body))
    }

    /// One request with a raw body; returns the status and the raw body.
    pub fn raw(
        &self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
        content_type: &str,
    ) -> (u16, Vec<u8>) {
        let reply = self.send(method, path, &[("Content-Type", content_type)], body);
        (reply.status, reply.body)
    }

    /// One request with exactly these extra headers (a `Host` among them replaces the server's
    /// address; the token, when set, is sent as usual), read to the end.
    pub fn send(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
    ) -> Reply {
        let mut all = vec![("Connection", "close")];
        all.extend_from_slice(headers);
        let mut stream = self.open(method, path, &all, body);
        stream
            .set_read_timeout(Some(Duration::from_secs(120)))
            .expect("timeout");
        let mut response = Vec::new();
        let _ = stream.read_to_end(&mut response);
        parse_response(&response)
    }

    /// Sends a request (kept alive unless the headers say otherwise) and returns the connection
    /// without reading the answer: dropping it is a client that went away.
    pub fn open(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
    ) -> TcpStream {
        let mut stream = TcpStream::connect(&self.addr).expect("connect");
        let body = body.unwrap_or_default();
        let mut head = format!("{method} {path} HTTP/1.1\r\n");
        if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
            head.push_str(&format!("Host: {}\r\n", self.addr));
        }
        if let Some(t) = &self.token {
            head.push_str(&format!("Authorization: Bearer {t}\r\n"));
        }
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
        stream.write_all(head.as_bytes()).expect("send head");
        // The server may answer (413) before reading a large body; a broken pipe is fine then.
        let _ = stream.write_all(body);
        stream
    }

    /// Reads Server-Sent Events from `path` until `done` returns true for the events so far
    /// (event name, data) or the timeout passes.
    pub fn events_until(
        &self,
        path: &str,
        timeout: Duration,
        done: impl Fn(&[(String, Value)]) -> bool,
    ) -> Vec<(String, Value)> {
        let mut stream = TcpStream::connect(&self.addr).expect("connect");
        stream
            .set_read_timeout(Some(Duration::from_millis(500)))
            .expect("timeout");
        let head = format!(
            "GET {path} HTTP/1.1\r\nHost: {}\r\nAccept: text/event-stream\r\n\r\n",
            self.addr
        );
        stream.write_all(head.as_bytes()).expect("send");
        let start = Instant::now();
        let mut text = String::new();
        let mut events = Vec::new();
        let mut buf = [0u8; 8192];
        while start.elapsed() < timeout {
            match stream.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => text.push_str(&String::from_utf8_lossy(&buf[..n])),
                Err(_) => {}
            }
            // Chunk-size lines of the chunked encoding are not `event:`/`data:` lines, so
            // scanning lines is enough.
            events.clear();
            let mut name = String::new();
            for line in text.lines() {
                if let Some(n) = line.strip_prefix("event: ") {
                    name = n.to_string();
                } else if let Some(d) = line.strip_prefix("data: ") {
                    if let Ok(v) = serde_json::from_str(d) {
                        events.push((name.clone(), v));
                    }
                }
            }
            if done(&events) {
                break;
            }
        }
        events
    }

    /// Polls a run until its status is one of `wanted`; panics after `timeout` with the run and
    /// the tail of its log.
    pub fn wait_status(&self, id: i64, wanted: &[&str], timeout: Duration) -> Value {
        let start = Instant::now();
        loop {
            let (code, run) = self.get(&format!("/api/runs/{id}"));
            assert_eq!(code, 200, "{run}");
            if wanted.iter().any(|w| run["status"] == *w) {
                return run;
            }
            if start.elapsed() > timeout {
                let (_, logs) = self.get(&format!("/api/runs/{id}/logs?tail=30"));
                panic!("run {id} did not become {wanted:?} in {timeout:?}: {run}\nlog: {logs}");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Polls until the run has at least `n` metric rows with a loss.
    pub fn wait_rows(&self, id: i64, n: usize, timeout: Duration) -> Vec<Value> {
        let start = Instant::now();
        loop {
            let (_, rows) = self.get(&format!("/api/runs/{id}/metrics?fields=loss"));
            let rows = rows.as_array().cloned().unwrap_or_default();
            if rows.len() >= n {
                return rows;
            }
            if start.elapsed() > timeout {
                let (_, logs) = self.get(&format!("/api/runs/{id}/logs?tail=30"));
                panic!(
                    "run {id} has {} rows after {timeout:?}\nlog: {logs}",
                    rows.len()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // A failed test must not leave long training runs behind.
        if !self.leave_runs && matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.stop_active_runs();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Force-stops every queued or running run; never panics (it runs inside `drop`, maybe while
    /// a failed test unwinds).
    fn stop_active_runs(&self) -> Option<()> {
        let request = |method: &str, path: &str| -> Option<Vec<u8>> {
            let mut stream = TcpStream::connect(&self.addr).ok()?;
            stream
                .set_read_timeout(Some(Duration::from_secs(10)))
                .ok()?;
            let auth = self
                .token
                .as_ref()
                .map(|t| format!("Authorization: Bearer {t}\r\n"))
                .unwrap_or_default();
            let head = format!(
                "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n{auth}Content-Length: 0\r\n\r\n",
                self.addr
            );
            stream.write_all(head.as_bytes()).ok()?;
            let mut response = Vec::new();
            stream.read_to_end(&mut response).ok()?;
            let split = response.windows(4).position(|w| w == b"\r\n\r\n")?;
            Some(response[split + 4..].to_vec())
        };
        let runs: Value = serde_json::from_slice(&request("GET", "/api/runs")?).ok()?;
        for run in runs.as_array()? {
            if run["status"] == "running" || run["status"] == "queued" {
                request("POST", &format!("/api/runs/{}/stop?force=true", run["id"]));
            }
        }
        Some(())
    }
}

/// A response: the status, the head (status line and headers) and the body (dechunked).
pub struct Reply {
    pub status: u16,
    pub head: String,
    pub body: Vec<u8>,
}

impl Reply {
    /// The body as JSON; panics with the body when it is not.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "status {}: not JSON ({e}): {}",
                self.status,
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// A header's value (the first with this name, any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }
}

fn parse_response(response: &[u8]) -> Reply {
    let split = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no HTTP head in {:?}", String::from_utf8_lossy(response)));
    let head = String::from_utf8_lossy(&response[..split]).to_string();
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status code");
    let body = &response[split + 4..];
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    Reply {
        status,
        head,
        body: if chunked {
            dechunk(body)
        } else {
            body.to_vec()
        },
    }
}

fn dechunk(mut body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = body.windows(2).position(|w| w == b"\r\n") {
        let size =
            usize::from_str_radix(String::from_utf8_lossy(&body[..eol]).trim(), 16).unwrap_or(0);
        if size == 0 {
            break;
        }
        let start = eol + 2;
        out.extend_from_slice(&body[start..(start + size).min(body.len())]);
        body = &body[(start + size + 2).min(body.len())..];
    }
    out
}

/// Sends `signal` to `pid` (or to its process group when negative).
pub fn kill(pid: i64, signal: i32) {
    let status = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg("--")
        .arg(pid.to_string())
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{signal} {pid}");
}

/// The CPU time process `pid` has used so far (all its threads, user and system), in seconds.
pub fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("read /proc/PID/stat");
    // Fields after the command name (which may hold spaces) in parentheses: state is the 3rd
    // field of the line, utime and stime the 14th and 15th.
    let rest: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, r)| r.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = |i: usize| {
        rest.get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // Linux reports these in USER_HZ, which is 100 on every architecture it exposes.
    (ticks(11) + ticks(12)) / 100.0
}

/// Whether process `pid` exists (and is not a zombie).
pub fn alive(pid: i64) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rsplit_once(')')
                .is_some_and(|(_, r)| !r.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

/// A configs folder holding `tiny.toml`: a tiny Llama trained on a small corpus written next to
/// it (the same shape as the trainer's own end-to-end tests), so a run takes seconds.
pub fn tiny_configs(home: &Path) -> PathBuf {
    let dir = home.join("configs");
    let corpus = home.join("corpus");
    std::fs::create_dir_all(&dir).expect("configs dir");
    crate::cli::write_tiny_corpus(&corpus);
    let config = crate::cli::tiny_config_toml(&corpus, &home.join("data-cache"), 6, 3);
    std::fs::write(dir.join("tiny.toml"), config).expect("config");
    dir
}

/// Adds `rl_tiny.toml` to the configs folder `configs`: GRPO on the built-in digit-sorting task
/// for the tiny Llama of `tiny.toml` (the same shapes, so a tiny training run's checkpoint starts
/// it through `rl.init_from`, its tokenizer found next to the checkpoints). No reward modules
/// and no starting policy: a run picks them (uploaded modules, a checkpoint). Six steps of
/// 2 prompts x 4 samples, held-out accuracy every 2 steps, every sample written to
/// `samples.jsonl`.
pub fn add_rl_config(configs: &Path) {
    let config = r#"# RL on the tiny Llama of tiny.toml: pick reward modules and a starting checkpoint.
[job]
name = "rl_tiny"
[model]
plugin = "llama"
flavor = "debugmodel"
args = { dim = 32, n_layers = 2, n_heads = 2, n_kv_heads = 2, ffn_dim = 64, vocab_size = 320, max_seq_len = 64 }
[optimizer]
plugin = "adamw"
lr = 1e-2
[lr_scheduler]
warmup_steps = 0
decay = "constant"
[training]
steps = 6
seed = 5
[metrics]
log_freq = 1
progress_bar = false
[rl]
prepend_eos = true
group_size = 4
prompts_per_step = 2
max_new_tokens = 6
error_reward = -1.0
eval_freq = 2
eval_prompts = 8
samples_every = 1
samples_per_step = 8
"#;
    std::fs::write(configs.join("rl_tiny.toml"), config).expect("rl config");
}

/// A reward module (WebAssembly text, core ABI v1) whose score is 0.1 per completion byte; it
/// reports `correct` when the length is a multiple of 4 and traps when it is odd, so the
/// samples of an untrained policy mix correct, wrong and erroring ones.
pub const LENGTH_PARITY_WAT: &str = r#"(module
  (memory (export "memory") 1)
  (data (i32.const 16) "{\22correct\22:true}")
  (data (i32.const 48) "{\22correct\22:false}")
  (global $next (mut i32) (i32.const 1024))
  (global $dptr (mut i32) (i32.const 48))
  (global $dlen (mut i32) (i32.const 17))
  (func (export "alloc") (param $len i32) (result i32)
    (local $p i32)
    (local.set $p (global.get $next))
    (global.set $next (i32.add (global.get $next) (local.get $len)))
    (local.get $p))
  (func (export "score")
    (param $pp i32) (param $pl i32) (param $cp i32) (param $cl i32) (param $mp i32) (param $ml i32)
    (result f64)
    (if (i32.and (local.get $cl) (i32.const 1)) (then unreachable))
    (if (i32.eqz (i32.and (local.get $cl) (i32.const 3)))
      (then (global.set $dptr (i32.const 16)) (global.set $dlen (i32.const 16))))
    (f64.mul (f64.const 0.1) (f64.convert_i32_u (local.get $cl))))
  (func (export "details_ptr") (result i32) (global.get $dptr))
  (func (export "details_len") (result i32) (global.get $dlen))
  (func (export "anneal_reward_abi") (result i32) (i32.const 1)))
"#;

//! Write Anneal reward functions in Rust.
//!
//! Implement `fn(&Input) -> Reward` and export it with [`export_reward!`]; build the crate as a
//! `cdylib` for `wasm32-unknown-unknown`. The macro generates the ABI v1 exports (`alloc`,
//! `score`, `details_ptr`, `details_len`, `anneal_reward_abi`); the module imports nothing.
//!
//! ```ignore
//! use anneal_reward_sdk::{export_reward, Input, Reward};
//! fn length_reward(input: &Input) -> Reward {
//!     Reward::new(input.completion.len() as f64)
//! }
//! export_reward!(length_reward);
//! ```
//!
//! Multi-turn RL environments are written against [`env::Environment`] and exported with
//! [`export_environment!`] (see the [`env`] module).

pub mod env;
mod json;

use std::sync::atomic::{AtomicI32, Ordering};

/// What the host passes to one scoring call.
pub struct Input<'a> {
    /// The prompt, UTF-8.
    pub prompt: &'a str,
    /// The model's completion, UTF-8.
    pub completion: &'a str,
    /// A JSON object as text, e.g. `{"answer":"42"}`; see [`json_field`].
    pub metadata: &'a str,
}

/// What a reward function returns: the score and optional details to log.
pub struct Reward {
    /// The score. NaN or infinity is reported by the host as `bad_output`.
    pub score: f64,
    /// A JSON object as text with extra named values, e.g. `{"correct":true}`.
    pub details: Option<String>,
}

impl Reward {
    /// A score without details.
    pub fn new(score: f64) -> Self {
        Reward {
            score,
            details: None,
        }
    }

    /// Adds a JSON object of details.
    pub fn with_details(mut self, json_object: impl Into<String>) -> Self {
        self.details = Some(json_object.into());
        self
    }
}

/// A shallow look-up of a top-level field of a flat JSON object: the text of a string value
/// (without its quotes, escapes not decoded) or the raw text of any other scalar value.
/// Returns `None` when the key is absent. Enough for `{"answer": "42"}` without pulling a JSON
/// parser into the module; use `serde_json` if you need more.
pub fn json_field<'a>(json: &'a str, key: &str) -> Option<&'a str> {
    let quoted = format!("\"{key}\"");
    let b = json.as_bytes();
    let mut i = json.find(&quoted)? + quoted.len();
    let ws = |c: u8| matches!(c, b' ' | b'\t' | b'\n' | b'\r');
    while i < b.len() && ws(b[i]) {
        i += 1;
    }
    if b.get(i) != Some(&b':') {
        return None;
    }
    i += 1;
    while i < b.len() && ws(b[i]) {
        i += 1;
    }
    if b.get(i) == Some(&b'"') {
        let start = i + 1;
        let end = start + json[start..].find('"')?;
        return Some(&json[start..end]);
    }
    let start = i;
    while i < b.len() && !ws(b[i]) && !matches!(b[i], b',' | b'}' | b']') {
        i += 1;
    }
    (i > start).then(|| &json[start..i])
}

static DETAILS_PTR: AtomicI32 = AtomicI32::new(0);
static DETAILS_LEN: AtomicI32 = AtomicI32::new(0);

#[doc(hidden)]
pub fn __alloc(len: i32) -> i32 {
    let mut buf = Vec::<u8>::with_capacity(len.max(0) as usize);
    let ptr = buf.as_mut_ptr();
    // Each call runs in a fresh instance, so the buffer simply lives until the instance dies.
    std::mem::forget(buf);
    ptr as i32
}

/// # Safety
/// The pointers and lengths must describe memory the host wrote after `alloc`.
#[doc(hidden)]
pub unsafe fn __score(p: (i32, i32), c: (i32, i32), m: (i32, i32), f: fn(&Input) -> Reward) -> f64 {
    unsafe fn text<'a>((ptr, len): (i32, i32)) -> std::borrow::Cow<'a, str> {
        if len <= 0 {
            return std::borrow::Cow::Borrowed("");
        }
        let bytes = std::slice::from_raw_parts(ptr as usize as *const u8, len as usize);
        String::from_utf8_lossy(bytes)
    }
    let (prompt, completion, metadata) = (text(p), text(c), text(m));
    let reward = f(&Input {
        prompt: &prompt,
        completion: &completion,
        metadata: &metadata,
    });
    if let Some(details) = reward.details {
        let details: &'static str = Box::leak(details.into_boxed_str());
        DETAILS_PTR.store(details.as_ptr() as i32, Ordering::Relaxed);
        DETAILS_LEN.store(details.len() as i32, Ordering::Relaxed);
    }
    reward.score
}

#[doc(hidden)]
pub fn __details_ptr() -> i32 {
    DETAILS_PTR.load(Ordering::Relaxed)
}

#[doc(hidden)]
pub fn __details_len() -> i32 {
    DETAILS_LEN.load(Ordering::Relaxed)
}

/// Exports `$f: fn(&Input) -> Reward` under the core-module ABI v1.
#[macro_export]
macro_rules! export_reward {
    ($f:path) => {
        #[no_mangle]
        pub extern "C" fn alloc(len: i32) -> i32 {
            $crate::__alloc(len)
        }

        #[no_mangle]
        pub extern "C" fn score(pp: i32, pl: i32, cp: i32, cl: i32, mp: i32, ml: i32) -> f64 {
            // SAFETY: the host passes ranges it wrote into buffers from `alloc`.
            unsafe { $crate::__score((pp, pl), (cp, cl), (mp, ml), $f) }
        }

        #[no_mangle]
        pub extern "C" fn details_ptr() -> i32 {
            $crate::__details_ptr()
        }

        #[no_mangle]
        pub extern "C" fn details_len() -> i32 {
            $crate::__details_len()
        }

        #[no_mangle]
        pub extern "C" fn anneal_reward_abi() -> i32 {
            1
        }
    };
}

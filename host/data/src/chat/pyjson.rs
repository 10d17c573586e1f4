//! The `tojson` filter of chat templates, as transformers defines it: Python's
//! `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
//!
//! minijinja's own `tojson` escapes `<`, `>`, `&` and `'` for HTML (as Jinja's does), which
//! transformers turns off: a tool whose description says "the user's city" must reach the
//! model as the model was trained to read it. Keys keep their order (the `preserve_order`
//! feature), separators are `", "` and `": "` (`","` between items once indented), floats are
//! written as Python's `repr` writes them (`1.0`, `1e-05`, `1e+16`), and with
//! `ensure_ascii=True` every character outside printable ASCII is `\uXXXX` (surrogate pairs
//! beyond the BMP), as Python does.

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// How to write one value.
struct Style {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

/// The filter: `value | tojson(indent=.., separators=.., sort_keys=.., ensure_ascii=..)`.
pub fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.kind() == ValueKind::String => {
            Some(v.as_str().unwrap_or_default().to_string())
        }
        Some(v) => {
            let n = usize::try_from(v.clone()).map_err(|_| {
                Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: indent must be a count or a string, got {v}"),
                )
            })?;
            Some(" ".repeat(n))
        }
    };
    let (item_sep, key_sep) = match kwargs.get::<Option<Vec<String>>>("separators")? {
        Some(seps) => match seps.as_slice() {
            [item, key] => (item.clone(), key.clone()),
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: separators must be two strings (item, key)",
                ))
            }
        },
        // Python's defaults: no trailing space after items once lines are indented.
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let style = Style {
        indent,
        item_sep,
        key_sep,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write(&mut out, value, &style, 0)?;
    Ok(Value::from(out))
}

/// `value` as Python's `json.dumps` writes it with the default settings transformers uses.
pub fn dumps(value: &Value) -> Result<String, Error> {
    let style = Style {
        indent: None,
        item_sep: ", ".into(),
        key_sep: ": ".into(),
        sort_keys: false,
        ensure_ascii: false,
    };
    let mut out = String::new();
    write(&mut out, value, &style, 0)?;
    Ok(out)
}

fn newline(out: &mut String, style: &Style, depth: usize) {
    if let Some(indent) = &style.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(indent);
        }
    }
}

fn write(out: &mut String, value: &Value, style: &Style, depth: usize) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number if value.is_integer() => out.push_str(&value.to_string()),
        ValueKind::Number => out.push_str(&float(f64::try_from(value.clone())?)),
        ValueKind::String => string(out, value.as_str().unwrap_or_default(), style.ensure_ascii),
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if style.sort_keys {
                keys.sort();
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(out, style, depth + 1);
                // JSON keys are strings; Python writes other keys' text.
                let text = match key.as_str() {
                    Some(s) => s.to_string(),
                    None if key.is_none() => "null".into(),
                    None if key.kind() == ValueKind::Bool => {
                        (if key.is_true() { "true" } else { "false" }).into()
                    }
                    None => key.to_string(),
                };
                string(out, &text, style.ensure_ascii);
                out.push_str(&style.key_sep);
                write(out, &value.get_item(key)?, style, depth + 1)?;
            }
            newline(out, style, depth);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable | ValueKind::Bytes => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(out, style, depth + 1);
                write(out, item, style, depth + 1)?;
            }
            newline(out, style, depth);
            out.push(']');
        }
        ValueKind::Plain => string(out, &value.to_string(), style.ensure_ascii),
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot write a {} value", value.kind()),
            ))
        }
    }
    Ok(())
}

/// A float as Python's `repr`: the shortest digits that read back the same, in positional
/// notation from 1e-4 up to 1e16 (with `.0` when whole), otherwise `1.5e+16`, `1e-05`.
fn float(v: f64) -> String {
    if v.is_nan() {
        return "NaN".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    if v == 0.0 || (1e-4..1e16).contains(&v.abs()) {
        let s = format!("{v}");
        return if s.contains('.') { s } else { s + ".0" };
    }
    // Rust writes `1.5e16` / `1e-5`: Python adds the sign and at least two exponent digits.
    let s = format!("{v:e}");
    let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
    let (sign, digits) = match exp.strip_prefix('-') {
        Some(d) => ('-', d),
        None => ('+', exp),
    };
    format!("{mantissa}e{sign}{digits:0>2}")
}

/// A JSON string as Python writes it: `"`, `\`, and control characters escaped (`\n`, `\r`,
/// `\t`, `\b`, `\f`, else `\u00XX`); with `ensure_ascii`, everything outside ` `..`~` too.
fn string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !(' '..='~').contains(&c)) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from_json(text: &str) -> Value {
        serde_json::from_str(text).unwrap()
    }

    #[test]
    fn writes_what_python_json_dumps_writes() {
        // Expected strings from Python 3.11's json.dumps(x, ensure_ascii=False).
        let v = from_json(
            r#"{"type": "function", "function": {"name": "f", "description": "the user's <city> & \"zip\"\n", "n": [1, 2.5, 1.0, 1e-05, 1e+16, 0.0001, -3, true, null, {}, []], "é": "ü 🎉"}}"#,
        );
        assert_eq!(
            dumps(&v).unwrap(),
            r#"{"type": "function", "function": {"name": "f", "description": "the user's <city> & \"zip\"\n", "n": [1, 2.5, 1.0, 1e-05, 1e+16, 0.0001, -3, true, null, {}, []], "é": "ü 🎉"}}"#
        );
        // json.dumps({"b": [1, {"a": "é"}]}, indent=2, ensure_ascii=True, sort_keys=True)
        let env = minijinja::Environment::new();
        let mut env = env;
        env.add_filter("tojson", tojson);
        let out = env
            .render_str(
                "{{ x | tojson(indent=2, ensure_ascii=true, sort_keys=true) }}|{{ y | tojson(separators=[',', ':']) }}",
                minijinja::context! { x => from_json(r#"{"z": 0, "b": [1, {"a": "é🎉\u0001"}]}"#), y => from_json(r#"{"k": [1, 2]}"#) },
            )
            .unwrap();
        assert_eq!(
            out,
            "{\n  \"b\": [\n    1,\n    {\n      \"a\": \"\\u00e9\\ud83c\\udf89\\u0001\"\n    }\n  ],\n  \"z\": 0\n}|{\"k\":[1,2]}"
        );
    }
}

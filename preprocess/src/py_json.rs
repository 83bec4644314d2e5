//! Python `json.dumps` output for template values: the `tojson` filter Hugging Face installs.
//!
//! Hugging Face replaces Jinja's `tojson` with `json.dumps(x, ensure_ascii=False, indent=None,
//! separators=None, sort_keys=False)`, so tool schemas and tool-call arguments are printed with
//! `", "` / `": "` separators, raw non-ASCII text and Python's float formatting. The prompt's
//! tokens depend on every byte of that, so this module reproduces it exactly.

use std::fmt::Write;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};

/// Formatting options, mirroring `json.dumps` keyword arguments.
#[derive(Debug, Clone)]
pub(crate) struct DumpOptions {
    /// Escape every non-ASCII character as `\uXXXX`.
    pub(crate) ensure_ascii: bool,
    /// Indentation per level; `None` prints everything on one line.
    pub(crate) indent: Option<String>,
    /// Separator between items.
    pub(crate) item_separator: String,
    /// Separator between a key and its value.
    pub(crate) key_separator: String,
    /// Sort object keys.
    pub(crate) sort_keys: bool,
}

impl Default for DumpOptions {
    fn default() -> Self {
        Self {
            ensure_ascii: false,
            indent: None,
            item_separator: ", ".into(),
            key_separator: ": ".into(),
            sort_keys: false,
        }
    }
}

/// The `tojson` filter: `value|tojson(ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
pub(crate) fn tojson_filter(
    value: &Value,
    ensure_ascii: Option<Value>,
    indent: Option<Value>,
    kwargs: Kwargs,
) -> Result<Value, Error> {
    let ensure_ascii = match ensure_ascii {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("ensure_ascii")?,
    };
    let indent = match indent {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let separators: Option<Value> = kwargs.get("separators")?;
    let sort_keys: Option<Value> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;

    let mut opts = DumpOptions {
        ensure_ascii: ensure_ascii.is_some_and(|v| v.is_true()),
        sort_keys: sort_keys.is_some_and(|v| v.is_true()),
        ..DumpOptions::default()
    };
    match indent {
        None => {}
        Some(v) if v.is_none() => {}
        Some(v) => {
            opts.indent = Some(indent_string(&v)?);
            opts.item_separator = ",".into();
        }
    }
    if let Some(seps) = separators.filter(|v| !v.is_none()) {
        let item = seps.get_item_by_index(0)?;
        let key = seps.get_item_by_index(1)?;
        match (item.as_str(), key.as_str()) {
            (Some(item), Some(key)) => {
                opts.item_separator = item.to_owned();
                opts.key_separator = key.to_owned();
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson separators must be a pair of strings",
                ));
            }
        }
    }
    dumps(value, &opts).map(Value::from)
}

/// `json.dumps` indentation: an integer is that many spaces (negative is none), a string is used as is.
fn indent_string(v: &Value) -> Result<String, Error> {
    if let Some(s) = v.as_str() {
        return Ok(s.to_owned());
    }
    match i64::try_from(v.clone()) {
        Ok(n) => Ok(" ".repeat(usize::try_from(n).unwrap_or(0))),
        Err(_) => Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson indent must be an integer or a string",
        )),
    }
}

/// Serializes `value` exactly as Python's `json.dumps` would with `opts`.
pub(crate) fn dumps(value: &Value, opts: &DumpOptions) -> Result<String, Error> {
    let mut out = String::new();
    write_value(&mut out, value, opts, 0)?;
    Ok(out)
}

fn not_serializable(value: &Value) -> Error {
    Error::new(
        ErrorKind::InvalidOperation,
        format!("Object of type {} is not JSON serializable", value.kind()),
    )
}

fn write_value(
    out: &mut String,
    value: &Value,
    opts: &DumpOptions,
    depth: usize,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(out, value)?,
        ValueKind::String => {
            write_string(out, value.as_str().unwrap_or_default(), opts.ensure_ascii)
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_container(out, '[', ']', &items, opts, depth, |out, item, depth| {
                write_value(out, item, opts, depth)
            })?;
        }
        ValueKind::Map => {
            let mut pairs: Vec<(String, Value)> = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                pairs.push((key_string(&key)?, item));
            }
            if opts.sort_keys {
                pairs.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_container(
                out,
                '{',
                '}',
                &pairs,
                opts,
                depth,
                |out, (key, item), depth| {
                    write_string(out, key, opts.ensure_ascii);
                    out.push_str(&opts.key_separator);
                    write_value(out, item, opts, depth)
                },
            )?;
        }
        _ => return Err(not_serializable(value)),
    }
    Ok(())
}

fn write_container<T>(
    out: &mut String,
    open: char,
    close: char,
    items: &[T],
    opts: &DumpOptions,
    depth: usize,
    mut write_item: impl FnMut(&mut String, &T, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if items.is_empty() {
        out.push(close);
        return Ok(());
    }
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(&opts.item_separator);
        }
        if let Some(indent) = &opts.indent {
            out.push('\n');
            for _ in 0..=depth {
                out.push_str(indent);
            }
        }
        write_item(out, item, depth + 1)?;
    }
    if let Some(indent) = &opts.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(indent);
        }
    }
    out.push(close);
    Ok(())
}

/// Python converts `str`, `int`, `float`, `bool` and `None` keys to strings; anything else is an error.
fn key_string(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_owned()),
        ValueKind::None => Ok("null".into()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.into()),
        ValueKind::Number => {
            let mut s = String::new();
            write_number(&mut s, key)?;
            Ok(s)
        }
        _ => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!(
                "keys must be str, int, float, bool or None, not {}",
                key.kind()
            ),
        )),
    }
}

fn write_number(out: &mut String, value: &Value) -> Result<(), Error> {
    if value.is_integer() {
        // Display of an integer value is its decimal digits.
        let _ = write!(out, "{value}");
        return Ok(());
    }
    let f = f64::try_from(value.clone())?;
    out.push_str(&python_float_repr(f));
    Ok(())
}

/// Python's `float.__repr__` as `json.dumps` prints it (`NaN`, `Infinity` for non-finite values).
pub(crate) fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let sign = if f.is_sign_negative() { "-" } else { "" };
    // Rust's `{:e}` prints the shortest digits that round-trip, as Python's repr does.
    let sci = format!("{:e}", f.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let digits = digits.as_str();
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                format!("{sign}{digits}{}.0", "0".repeat(int_len - digits.len()))
            } else {
                format!("{sign}{}.{}", &digits[..int_len], &digits[int_len..])
            }
        } else {
            format!("{sign}0.{}{digits}", "0".repeat((-exp - 1) as usize))
        }
    } else {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let exp_sign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{first}{frac}e{exp_sign}{:02}", exp.abs())
    }
}

/// A JSON string literal as Python's encoder writes it.
pub(crate) fn write_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    let mut start = 0;
    for (i, c) in s.char_indices() {
        let escape: Option<&str> = match c {
            '"' => Some("\\\""),
            '\\' => Some("\\\\"),
            '\n' => Some("\\n"),
            '\r' => Some("\\r"),
            '\t' => Some("\\t"),
            '\u{8}' => Some("\\b"),
            '\u{c}' => Some("\\f"),
            _ => None,
        };
        let needs_hex = escape.is_none() && ((c as u32) < 0x20 || (ensure_ascii && !c.is_ascii()));
        if escape.is_none() && !needs_hex {
            continue;
        }
        out.push_str(&s[start..i]);
        start = i + c.len_utf8();
        if let Some(e) = escape {
            out.push_str(e);
        } else {
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                let _ = write!(out, "\\u{unit:04x}");
            }
        }
    }
    out.push_str(&s[start..]);
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(text: &str) -> Value {
        serde_json::from_str(text).unwrap()
    }

    #[test]
    fn python_separators_and_order() {
        let v = json(r#"{"b": 1, "a": [1, 2.5, null, true, "x"], "c": {}}"#);
        assert_eq!(
            dumps(&v, &DumpOptions::default()).unwrap(),
            r#"{"b": 1, "a": [1, 2.5, null, true, "x"], "c": {}}"#
        );
    }

    #[test]
    fn strings_keep_unicode_and_escape_controls() {
        let v = Value::from("Zürich \"q\" \\ \n\t\u{1}\u{7f} 👋");
        assert_eq!(
            dumps(&v, &DumpOptions::default()).unwrap(),
            "\"Zürich \\\"q\\\" \\\\ \\n\\t\\u0001\u{7f} 👋\""
        );
        let ascii = DumpOptions {
            ensure_ascii: true,
            ..DumpOptions::default()
        };
        assert_eq!(
            dumps(&Value::from("é👋"), &ascii).unwrap(),
            "\"\\u00e9\\ud83d\\udc4b\""
        );
    }

    #[test]
    fn floats_match_python_repr() {
        let cases = [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.0, "1.0"),
            (0.1, "0.1"),
            (100.0, "100.0"),
            (1.5e-7, "1.5e-07"),
            (0.0001, "0.0001"),
            (1e-5, "1e-05"),
            (1e16, "1e+16"),
            (123456789012345.6, "123456789012345.6"),
            (1.2345678901234568e17, "1.2345678901234568e+17"),
            (-2.5, "-2.5"),
            (f64::NAN, "NaN"),
            (f64::NEG_INFINITY, "-Infinity"),
        ];
        for (f, want) in cases {
            assert_eq!(python_float_repr(f), want, "{f}");
        }
    }

    #[test]
    fn json_numbers_keep_int_or_float() {
        let v = json(r#"[1, 1.0, 1e2, -5, 18446744073709551615]"#);
        assert_eq!(
            dumps(&v, &DumpOptions::default()).unwrap(),
            "[1, 1.0, 100.0, -5, 18446744073709551615]"
        );
    }

    #[test]
    fn indent_uses_python_layout() {
        let v = json(r#"{"a": [1, {"b": null}], "e": []}"#);
        let opts = DumpOptions {
            indent: Some("  ".into()),
            item_separator: ",".into(),
            ..DumpOptions::default()
        };
        assert_eq!(
            dumps(&v, &opts).unwrap(),
            "{\n  \"a\": [\n    1,\n    {\n      \"b\": null\n    }\n  ],\n  \"e\": []\n}"
        );
    }

    #[test]
    fn sort_keys_and_non_string_keys() {
        let v = Value::from_pairs([
            (Value::from(2), Value::from("x")),
            (Value::from(1), Value::from(true)),
        ]);
        let opts = DumpOptions {
            sort_keys: true,
            ..DumpOptions::default()
        };
        assert_eq!(dumps(&v, &opts).unwrap(), r#"{"1": true, "2": "x"}"#);
    }

    #[test]
    fn undefined_is_an_error() {
        assert!(dumps(&Value::UNDEFINED, &DumpOptions::default()).is_err());
    }
}

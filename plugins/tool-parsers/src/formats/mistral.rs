//! `mistral`: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]` (a JSON
//! array; Mistral 7B v0.3, Mistral Nemo, Small 3) and the newer
//! `[TOOL_CALLS]f[ARGS]{...}` (Mistral Small 3.2, Magistral, Devstral;
//! repeated for parallel calls; an optional `[CALL_ID]id` before `[ARGS]`
//! is skipped). An array element that is not a valid call is an invalid
//! call with its own text; a block that is not JSON is invalid up to the
//! next `[TOOL_CALLS]` or the end.

use super::{Attempt, Item, Tagged};
use crate::json::{self, Scan};
use crate::text::{could_become, find, skip_ws};
use crate::tools::Tools;

const TAG: &str = "[TOOL_CALLS]";
const ARGS: &str = "[ARGS]";
const CALL_ID: &str = "[CALL_ID]";

pub struct Mistral<'a> {
    pub tools: &'a Tools,
}

impl Tagged for Mistral<'_> {
    fn markers(&self) -> &'static [&'static str] {
        &[TAG]
    }

    fn attempt(&self, text: &str, m: usize, partial: bool) -> Attempt {
        let p = skip_ws(text, m + TAG.len());
        if p == text.len() {
            return self.failed(text, m, partial);
        }
        if text[p..].starts_with('[') {
            self.array(text, m, p, partial)
        } else {
            self.named(text, m, p, partial)
        }
    }
}

impl Mistral<'_> {
    /// Not a call: the block runs to the next tag, or the end.
    fn failed(&self, text: &str, m: usize, partial: bool) -> Attempt {
        match find(text, m + TAG.len(), TAG) {
            Some(next) => Attempt::Invalid(next),
            None if partial => Attempt::Incomplete,
            None => Attempt::Invalid(text.len()),
        }
    }

    /// `[{...}, {...}]` at `p`.
    fn array(&self, text: &str, m: usize, p: usize, partial: bool) -> Attempt {
        let end = match json::scan(text, p) {
            Scan::Complete(end) => end,
            Scan::Incomplete if partial => return Attempt::Incomplete,
            Scan::Incomplete | Scan::Malformed => return self.failed(text, m, partial),
        };
        let Some(spans) = elements(text, p, end) else {
            return self.failed(text, m, partial);
        };
        if spans.is_empty() {
            // `[TOOL_CALLS][]`: no call, but its text is not dropped.
            return Attempt::Invalid(end);
        }
        let items = spans
            .into_iter()
            .map(|(a, b)| match json::call_from_text(&text[a..b]) {
                Some((name, arguments)) if self.tools.allows(&name) => {
                    Item::Call { name, arguments }
                }
                _ => Item::Invalid(a, b),
            })
            .collect();
        Attempt::Parsed(items, end)
    }

    /// `name[ARGS]{...}` (or `name[CALL_ID]id[ARGS]{...}`) at `p`.
    fn named(&self, text: &str, m: usize, p: usize, partial: bool) -> Attempt {
        let name_len = text[p..]
            .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == '-' || c == '.'))
            .unwrap_or(text.len() - p);
        let mut q = p + name_len;
        if name_len == 0 {
            return self.failed(text, m, partial);
        }
        if text[q..].starts_with(CALL_ID) {
            q += CALL_ID.len();
            q += text[q..]
                .find(|c: char| !c.is_alphanumeric())
                .unwrap_or(text.len() - q);
        }
        let rest = &text[q..];
        if !rest.starts_with(ARGS) {
            if partial && (could_become(rest, ARGS) || could_become(rest, CALL_ID)) {
                return Attempt::Incomplete;
            }
            return self.failed(text, m, partial);
        }
        let a = skip_ws(text, q + ARGS.len());
        let end = match json::scan(text, a) {
            Scan::Complete(end) => end,
            Scan::Incomplete if partial => return Attempt::Incomplete,
            Scan::Incomplete | Scan::Malformed => return self.failed(text, m, partial),
        };
        let Some(arguments) = json::object_text(&text[a..end]) else {
            return self.failed(text, m, partial);
        };
        let name = text[p..p + name_len].to_string();
        if self.tools.allows(&name) {
            Attempt::Parsed(vec![Item::Call { name, arguments }], end)
        } else {
            Attempt::Invalid(end)
        }
    }
}

/// The spans of the elements of the (bracket-balanced) array `p..end`
/// (objects, arrays, or scalars such as `5`, `"x"`, `null`); `None` when
/// the array is not a comma-separated list of them.
fn elements(text: &str, p: usize, end: usize) -> Option<Vec<(usize, usize)>> {
    let mut spans = Vec::new();
    let mut q = skip_ws(text, p + 1);
    if text[q..].starts_with(']') {
        return Some(spans);
    }
    loop {
        let e = match text.as_bytes().get(q) {
            Some(b'{' | b'[') => match json::scan(&text[..end], q) {
                Scan::Complete(e) => e,
                _ => return None,
            },
            _ => scalar_end(&text[..end], q)?,
        };
        spans.push((q, e));
        q = skip_ws(text, e);
        match text[q..].chars().next() {
            Some(',') => q = skip_ws(text, q + 1),
            Some(']') if q + 1 == end => return Some(spans),
            _ => return None,
        }
    }
}

/// The end of the JSON scalar at `q` (a string, or a run of number/literal
/// chars); `None` when there is none.
fn scalar_end(text: &str, q: usize) -> Option<usize> {
    let b = text.as_bytes();
    if b.get(q) == Some(&b'"') {
        let mut escaped = false;
        for (i, &c) in b.iter().enumerate().skip(q + 1) {
            if escaped {
                escaped = false;
            } else if c == b'\\' {
                escaped = true;
            } else if c == b'"' {
                return Some(i + 1);
            }
        }
        return None;
    }
    let len = text[q..]
        .find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '+' | '.')))
        .unwrap_or(text.len() - q);
    (len > 0).then_some(q + len)
}

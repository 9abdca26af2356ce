//! `llama3-json` (Llama 3.1/3.2/3.3 JSON tool calling): a call object
//! `{"name": "f", "parameters": {...}}` (`arguments` accepted too), either
//! after `<|python_tag|>` (several separated by `;`) or as the whole output
//! (bare, checked in [`super::bare_json`]; it must name a declared tool).
//! After `<|python_tag|>`, what is not a JSON object (e.g. a built-in
//! tool's `brave_search.call(...)`) is an invalid call up to the next tag
//! or the end.

use super::{Attempt, Item, Tagged};
use crate::json::{self, Scan};
use crate::text::{find, skip_ws};
use crate::tools::Tools;

const TAG: &str = "<|python_tag|>";

pub struct PythonTag<'a> {
    pub tools: &'a Tools,
}

impl Tagged for PythonTag<'_> {
    fn markers(&self) -> &'static [&'static str] {
        &[TAG]
    }

    fn attempt(&self, text: &str, m: usize, partial: bool) -> Attempt {
        let mut items = Vec::new();
        let mut p = m + TAG.len();
        loop {
            p = skip_ws(text, p);
            // The first object's failure takes the tag with it.
            let start = if items.is_empty() { m } else { p };
            if p == text.len() {
                if partial {
                    return Attempt::Incomplete;
                }
                if items.is_empty() {
                    return Attempt::Invalid(text.len());
                }
                return Attempt::Parsed(items, p);
            }
            if !text[p..].starts_with('{') && !items.is_empty() {
                // `; text`: the list ended at the `;`.
                return Attempt::Parsed(items, p);
            }
            let end = match json::scan(text, p) {
                Scan::Complete(end) => end,
                Scan::Incomplete if partial => return Attempt::Incomplete,
                // Not a call: invalid up to the next tag or the end.
                Scan::Incomplete | Scan::Malformed => {
                    return match find(text, p, TAG) {
                        Some(next) => block(items, start, next),
                        None if partial => Attempt::Incomplete,
                        None => block(items, start, text.len()),
                    };
                }
            };
            match json::call_from_text(&text[p..end]) {
                Some((name, arguments)) if self.tools.allows(&name) => {
                    items.push(Item::Call { name, arguments })
                }
                _ => items.push(Item::Invalid(start, end)),
            }
            p = skip_ws(text, end);
            if p == text.len() && partial {
                // A `;` and another call may follow.
                return Attempt::Incomplete;
            }
            if text[p..].starts_with(';') {
                p += 1;
                continue;
            }
            return Attempt::Parsed(items, end);
        }
    }
}

/// The calls so far and an invalid rest `start..end`.
fn block(mut items: Vec<Item>, start: usize, end: usize) -> Attempt {
    if items.is_empty() {
        return Attempt::Invalid(end);
    }
    items.push(Item::Invalid(start, end));
    Attempt::Parsed(items, end)
}

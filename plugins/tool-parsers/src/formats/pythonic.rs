//! `pythonic` (Llama 3.2/4 "pythonic" tool calling, vLLM's `pythonic`):
//! `[f(a=1, b="x"), g()]` with Python literal arguments, either as the whole
//! output (bare; every call must name a declared tool, else it is text) or
//! wrapped in `<|python_start|>...<|python_end|>` (Llama 4), where text may
//! come before it and an undeclared name makes the whole wrapped block
//! (wrapper included) an invalid call with its original text. Inside the
//! wrapper a single call without brackets is accepted too.

use super::{failed_block, Attempt, Bare, Item, Tagged};
use crate::json;
use crate::pylit::{self, PyCall, Stop};
use crate::text::{could_become, skip_ws};
use crate::tools::Tools;

const START: &str = "<|python_start|>";
const END: &str = "<|python_end|>";

/// Whether the whole output is a bare call list.
pub fn bare(text: &str, partial: bool, tools: &Tools) -> Bare {
    let short = if partial {
        Bare::Undecided
    } else {
        Bare::NotBare
    };
    let p = skip_ws(text, 0);
    if p == text.len() {
        return short;
    }
    if !text[p..].starts_with('[') {
        return Bare::NotBare;
    }
    let (calls, end) = match pylit::call_list(text, p) {
        Ok(parsed) => parsed,
        Err(Stop::Short) => return short,
        Err(Stop::Bad) => return Bare::NotBare,
    };
    if calls.is_empty()
        || calls.iter().any(|c| !tools.declared(&c.name))
        || skip_ws(text, end) < text.len()
    {
        return Bare::NotBare;
    }
    if partial {
        return Bare::Undecided;
    }
    Bare::Calls(
        calls
            .into_iter()
            .map(|c| (c.name, json::ordered_object(c.args)))
            .collect(),
    )
}

pub struct PythonStart<'a> {
    pub tools: &'a Tools,
}

impl Tagged for PythonStart<'_> {
    fn markers(&self) -> &'static [&'static str] {
        &[START]
    }

    fn attempt(&self, text: &str, m: usize, partial: bool) -> Attempt {
        let failed = |from: usize| failed_block(text, m, from, END, &[START], START.len(), partial);
        let p = skip_ws(text, m + START.len());
        let parsed = if text[p..].starts_with('[') {
            pylit::call_list(text, p)
        } else {
            pylit::call(text, p).map(|c| {
                let end = c.end;
                (vec![c], end)
            })
        };
        let (calls, end) = match parsed {
            Ok(parsed) => parsed,
            Err(Stop::Short) if partial => return Attempt::Incomplete,
            Err(_) => return failed(m + START.len()),
        };
        let q = skip_ws(text, end);
        let rest = &text[q..];
        let block_end = if rest.starts_with(END) {
            q + END.len()
        } else if partial && could_become(rest, END) {
            return Attempt::Incomplete;
        } else if could_become(rest, END) {
            text.len()
        } else {
            end
        };
        // As for bare outputs, the block is decided as a whole: one
        // undeclared name makes the whole wrapped block (wrapper and
        // brackets included) one invalid call with its original text.
        if calls.iter().any(|c| !self.tools.allows(&c.name)) {
            return Attempt::Invalid(block_end);
        }
        let items = calls.into_iter().map(item).collect();
        Attempt::Parsed(items, block_end)
    }
}

fn item(c: PyCall) -> Item {
    Item::Call {
        name: c.name,
        arguments: json::ordered_object(c.args),
    }
}

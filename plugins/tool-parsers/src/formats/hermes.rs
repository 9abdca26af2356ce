//! `hermes` (Hermes 2 Pro, Qwen2.5, Qwen3): calls in
//! `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>` blocks,
//! one or several, with text around them. The bare-output forms (the whole
//! output one call object, or one in a ```` ```json ```` fence, naming a
//! declared tool) are checked in [`super::bare_json`].

use super::{failed_block, Attempt, Item, Tagged};
use crate::json::{self, Scan};
use crate::text::{could_become, skip_ws};
use crate::tools::Tools;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

pub struct Hermes<'a> {
    pub tools: &'a Tools,
}

impl Tagged for Hermes<'_> {
    fn markers(&self) -> &'static [&'static str] {
        &[OPEN]
    }

    fn attempt(&self, text: &str, m: usize, partial: bool) -> Attempt {
        let failed = |from: usize| failed_block(text, m, from, CLOSE, &[OPEN], OPEN.len(), partial);
        let p = skip_ws(text, m + OPEN.len());
        let end = match json::scan(text, p) {
            Scan::Complete(end) => end,
            // Cut short: wait; at the end, the block up to a close tag (an
            // unterminated string may have swallowed it) or to the end.
            Scan::Incomplete if partial => return Attempt::Incomplete,
            Scan::Incomplete | Scan::Malformed => return failed(m + OPEN.len()),
        };
        let Some((name, arguments)) = json::call_from_text(&text[p..end]) else {
            return failed(end);
        };
        // After the object: the close tag; or (leniently) the next call's
        // open tag, or the end of the output, when the close tag is missing.
        let q = skip_ws(text, end);
        let rest = &text[q..];
        let block_end = if rest.starts_with(CLOSE) {
            q + CLOSE.len()
        } else if rest.starts_with(OPEN) {
            q
        } else if could_become(rest, CLOSE) || could_become(rest, OPEN) {
            if partial {
                return Attempt::Incomplete;
            }
            text.len()
        } else {
            return failed(end);
        };
        if self.tools.allows(&name) {
            Attempt::Parsed(vec![Item::Call { name, arguments }], block_end)
        } else {
            Attempt::Invalid(block_end)
        }
    }
}

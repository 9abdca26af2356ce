//! `prompt-lookup`: prompt lookup decoding (Saxena 2023; vLLM's `ngram`
//! speculative method, llama.cpp's `ngram` lookup) as a drafter plugin.
//!
//! The session keeps the row's history and, for every n-gram length `n` in
//! `min_ngram..=max_ngram`, a table from each n-gram to the position right
//! after its latest occurrence that has a token following it. To draft, it
//! looks up the history's last `n` tokens, longest `n` first; on a hit it
//! proposes the (up to `k`) tokens that followed that occurrence. Updating
//! the tables costs `max_ngram - min_ngram + 1` inserts per history token
//! and a draft one lookup per `n`, so a long prompt costs nothing per step.
//!
//! Code edits and tool calls that repeat text already in the context (a
//! file rewritten with one change, a path) are drafted whole; free text
//! rarely matches, and then the host's adaptive draft length stops asking.
//!
//! Parameters (`plugin_params.prompt-lookup`): `max_ngram` (default 4),
//! `min_ngram` (default 2), both in 1..=16.

use std::collections::HashMap;

use mlxhost_plugin_sdk::v4::drafter::exports::mlxhost::plugin0_4_0::drafter::{
    self as api, DraftOptions,
};
use mlxhost_plugin_sdk::v4::drafter::mlxhost::plugin0_4_0::types::PluginError;

struct Plugin;

impl api::Guest for Plugin {
    type Session = Session;
}

struct Session {
    min_ngram: usize,
    max_ngram: usize,
    history: std::cell::RefCell<Lookup>,
}

/// The history and its n-gram tables.
struct Lookup {
    ids: Vec<u32>,
    /// `tables[n - min_ngram]`: n-gram -> the index of the token that
    /// followed its latest occurrence.
    tables: Vec<HashMap<Vec<u32>, usize>>,
    min_ngram: usize,
}

impl Lookup {
    /// Appends one token: every n-gram ending just before it now has a
    /// follower (this token), at this index.
    fn push(&mut self, id: u32) {
        let at = self.ids.len();
        for (i, table) in self.tables.iter_mut().enumerate() {
            let n = self.min_ngram + i;
            if at >= n {
                table.insert(self.ids[at - n..at].to_vec(), at);
            }
        }
        self.ids.push(id);
    }

    /// Up to `k` tokens that followed the latest earlier occurrence of the
    /// longest suffix found (longest `n` first).
    fn draft(&self, k: usize) -> Vec<u32> {
        let len = self.ids.len();
        for (i, table) in self.tables.iter().enumerate().rev() {
            let n = self.min_ngram + i;
            if len < n {
                continue;
            }
            if let Some(&follows) = table.get(&self.ids[len - n..]) {
                let end = (follows + k).min(len);
                return self.ids[follows..end].to_vec();
            }
        }
        Vec::new()
    }
}

fn error(message: String) -> PluginError {
    PluginError { message }
}

impl api::GuestSession for Session {
    fn create(options: DraftOptions) -> Result<api::Session, PluginError> {
        let mut max_ngram = 4usize;
        let mut min_ngram = 2usize;
        for (key, value) in mlxhost_plugin_sdk::numeric_params(&options.extra).map_err(error)? {
            let n = value as usize;
            if value.fract() != 0.0 || !(1..=16).contains(&n) {
                return Err(error(format!(
                    "`{key}` must be a whole number in 1..=16, got {value}"
                )));
            }
            match key.as_str() {
                "max_ngram" => max_ngram = n,
                "min_ngram" => min_ngram = n,
                other => {
                    return Err(error(format!(
                        "unknown parameter `{other}` (prompt-lookup takes `max_ngram`, `min_ngram`)"
                    )))
                }
            }
        }
        if min_ngram > max_ngram {
            return Err(error(format!(
                "`min_ngram` ({min_ngram}) is above `max_ngram` ({max_ngram})"
            )));
        }
        let lookup = Lookup {
            ids: Vec::new(),
            tables: (min_ngram..=max_ngram).map(|_| HashMap::new()).collect(),
            min_ngram,
        };
        Ok(api::Session::new(Session {
            min_ngram,
            max_ngram,
            history: std::cell::RefCell::new(lookup),
        }))
    }

    fn draft(&self, appended: Vec<u32>, k: u32) -> Result<Vec<u32>, PluginError> {
        debug_assert!(self.min_ngram <= self.max_ngram);
        let mut lookup = self.history.borrow_mut();
        for id in appended {
            lookup.push(id);
        }
        Ok(lookup.draft(k as usize))
    }
}

mlxhost_plugin_sdk::v4::drafter::export_drafter!(Plugin);

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup(ids: &[u32], min: usize, max: usize) -> Lookup {
        let mut l = Lookup {
            ids: Vec::new(),
            tables: (min..=max).map(|_| HashMap::new()).collect(),
            min_ngram: min,
        };
        for &id in ids {
            l.push(id);
        }
        l
    }

    #[test]
    fn drafts_what_followed_the_latest_occurrence_of_the_longest_suffix() {
        // ... 1 2 3 [4 5 6] ... 9 2 3 [7 8] ... 1 2 3 -> the 3-gram "1 2 3"
        // matched first (4 5 6), not the 2-gram "2 3"'s later 7 8.
        let l = lookup(&[1, 2, 3, 4, 5, 6, 9, 2, 3, 7, 8, 1, 2, 3], 2, 4);
        assert_eq!(l.draft(3), vec![4, 5, 6]);
        assert_eq!(l.draft(1), vec![4]);
        let l = lookup(&[1, 2, 3, 4, 5, 6, 9, 2, 3, 7, 8, 0, 2, 3], 2, 4);
        assert_eq!(l.draft(5), vec![7, 8, 0, 2, 3], "latest 2-gram match");
    }

    #[test]
    fn no_match_drafts_nothing_and_drafts_stop_at_the_history_end() {
        assert!(lookup(&[1, 2, 3, 4], 2, 3).draft(4).is_empty());
        let l = lookup(&[5, 6, 5, 6], 2, 2);
        assert_eq!(l.draft(8), vec![5, 6], "at most to the end of the history");
    }
}

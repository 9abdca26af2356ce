//! The constraint engine: one llguidance parser factory per model (the
//! token trie and its precomputed slices, built once) and one matcher per
//! row.

use llguidance::{api::ParserLimits, Matcher, ParserFactory};
use toktrie::{InferenceCapabilities, TokEnv, TokenId};

use crate::spec::{self, Grammar, Options};
use crate::tokens::TokenTable;

/// Per-model state, shared by every session.
pub struct Engine {
    factory: ParserFactory,
    /// The logits' width (the bitset covers it).
    vocab: usize,
}

impl Engine {
    /// Builds the trie and the factory from the host's token table (the
    /// costly part: done once per model). `extra` is accepted for future
    /// options and must be a JSON object.
    pub fn new(table: &TokenTable, extra: &str) -> Result<Self, String> {
        Options::parse(extra)?;
        let env: TokEnv = table.env().map_err(|e| e.0)?;
        let vocab = env.tok_trie().vocab_size();
        // No fast-forward tokens: llguidance computes them only for a
        // canonical tokenizer, and the guest tokenizes greedily over the trie.
        let mut factory = ParserFactory::new(
            &env,
            InferenceCapabilities::default(),
            &llguidance::earley::SlicedBiasComputer::general_slices(),
        )
        .map_err(|e| format!("building the token trie: {e}"))?;
        // Quiet: the guest has no stderr; errors come back as values.
        factory.quiet();
        *factory.limits_mut() = ParserLimits {
            // Errors say what failed, not the whole parser state.
            verbose_errors: false,
            ..ParserLimits::default()
        };
        Ok(Engine { factory, vocab })
    }

    /// Compiles `grammar` for one row. Errors: the message llguidance gives
    /// (an unsupported JSON Schema keyword is named there).
    pub fn session(&self, grammar: &Grammar, extra: &str) -> Result<Session, String> {
        let opts = Options::parse(extra)?;
        let top = spec::top_level(grammar, &opts)?;
        let parser = self.factory.create_parser(top).map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(Session {
            matcher,
            vocab: self.vocab,
            eos: self.factory.tok_env().tok_trie().eos_tokens().to_vec(),
        })
    }
}

/// One row's grammar state.
pub struct Session {
    matcher: Matcher,
    vocab: usize,
    eos: Vec<TokenId>,
}

impl Session {
    /// The allowed tokens as `ceil(V / 32)` words (bit `i % 32` of word
    /// `i / 32`). Once the grammar is complete only EOS ids are allowed.
    /// Errors: the matcher's error, or a dead end (nothing allowed).
    pub fn mask(&mut self) -> Result<Vec<u32>, String> {
        let set = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| e.to_string())?;
        if set.is_zero() {
            return Err("no token can continue the output (the grammar is at a dead end)".into());
        }
        let mut words = set.as_slice().to_vec();
        words.resize(self.vocab.div_ceil(32), 0);
        Ok(words)
    }

    /// Advances by the chosen token. Errors: the token does not fit the
    /// grammar.
    pub fn accept(&mut self, token: u32) -> Result<(), String> {
        // A complete grammar's matcher has stopped and takes no more
        // tokens; the EOS its mask allowed ends the row.
        if self.matcher.is_stopped() && self.eos.contains(&token) && !self.matcher.is_error() {
            return Ok(());
        }
        self.matcher
            .consume_token(token as TokenId)
            .map_err(|e| format!("token {token} does not fit the grammar: {e}"))
    }

    /// Whether the grammar is complete (only EOS may follow).
    pub fn is_stopped(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::tests::table;

    fn engine() -> (Engine, TokenTable) {
        let t = table();
        (Engine::new(&t, "{}").expect("engine"), t)
    }

    fn allowed(words: &[u32], id: u32) -> bool {
        words[(id / 32) as usize] & (1 << (id % 32)) != 0
    }

    /// Greedy over the mask: the lowest allowed id that is not EOS, until
    /// only EOS is allowed. Returns the text.
    fn walk(s: &mut Session, t: &TokenTable) -> String {
        walk_preferring(s, t, &[])
    }

    /// As [`walk`], taking the first allowed of `prefer` (bytes) first.
    fn walk_preferring(s: &mut Session, t: &TokenTable, prefer: &[u8]) -> String {
        let mut out = Vec::new();
        for _ in 0..200 {
            let m = s.mask().expect("mask");
            let eos = t.eos[0];
            let pick = prefer
                .iter()
                .map(|&b| b as u32)
                .find(|&i| allowed(&m, i))
                .or_else(|| (0..t.ends.len() as u32).find(|&i| i != eos && allowed(&m, i)));
            match pick {
                Some(id) => {
                    let start = if id == 0 {
                        0
                    } else {
                        t.ends[id as usize - 1] as usize
                    };
                    out.extend_from_slice(&t.bytes[start..t.ends[id as usize] as usize]);
                    s.accept(id).expect("accept");
                }
                None => {
                    assert!(allowed(&m, eos));
                    s.accept(eos).expect("eos");
                    break;
                }
            }
        }
        String::from_utf8(out).expect("utf8")
    }

    #[test]
    fn a_schema_mask_allows_only_what_fits_then_eos() {
        let (e, t) = engine();
        let schema = r#"{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": false}"#;
        let mut s = e
            .session(&Grammar::JsonSchema(schema.into()), "{}")
            .expect("session");
        let m = s.mask().expect("mask");
        assert_eq!(m.len(), t.ends.len().div_ceil(32));
        assert!(allowed(&m, b'{' as u32));
        assert!(!allowed(&m, b'x' as u32));
        assert!(!allowed(&m, t.eos[0]));
        let text = walk(&mut s, &t);
        let v: serde_json::Value = serde_json::from_str(&text).expect("json");
        assert!(v["ok"].is_boolean(), "{text}");
    }

    #[test]
    fn special_tokens_and_padding_are_never_allowed() {
        let (e, t) = engine();
        let mut s = e
            .session(&Grammar::Regex("[a-z<|>_]+".into()), "{}")
            .expect("session");
        let m = s.mask().expect("mask");
        let n = t.ends.len() as u32;
        assert!(allowed(&m, b'a' as u32));
        assert!(!allowed(&m, n - 3), "special token allowed");
        assert!(!allowed(&m, n - 1), "padding allowed");
    }

    #[test]
    fn choices_regexes_and_lark() {
        let (e, t) = engine();
        let mut s = e
            .session(&Grammar::Choice(vec!["yes".into(), "no.*".into()]), "{}")
            .expect("session");
        let text = walk(&mut s, &t);
        assert!(text == "yes" || text == "no.*", "{text}");
        let mut s = e
            .session(&Grammar::Regex("a[0-9]{3}".into()), "{}")
            .expect("rx");
        assert_eq!(walk(&mut s, &t), "a000");
        let lark = "start: \"x\" num\nnum: /[1-9]/";
        let mut s = e.session(&Grammar::Lark(lark.into()), "{}").expect("lark");
        assert_eq!(walk(&mut s, &t), "x1");
        let mut s = e.session(&Grammar::JsonObject, "{}").expect("object");
        let text = walk_preferring(&mut s, &t, b"}\"");
        assert!(serde_json::from_str::<serde_json::Value>(&text)
            .expect("json")
            .is_object());
    }

    #[test]
    fn rejected_grammars_and_tokens_are_errors() {
        let (e, _) = engine();
        let err = e
            .session(
                &Grammar::JsonSchema(r#"{"type": "object", "if": {}}"#.into()),
                "{}",
            )
            .err()
            .expect("unsupported keyword");
        assert!(err.contains("if"), "{err}");
        assert!(e
            .session(&Grammar::Lark("start: nope".into()), "{}")
            .is_err());
        assert!(e.session(&Grammar::Regex("(".into()), "{}").is_err());
        let mut s = e.session(&Grammar::Regex("ab".into()), "{}").expect("rx");
        assert!(s.accept(b'z' as u32).is_err());
    }
}

#[cfg(test)]
mod call_grammar_tests {
    use super::*;
    use crate::tokens::tests::table;

    /// The shape the host builds for `tool_choice` with strict tools: the
    /// rest of a call's prefix, the arguments' schema, then free text.
    #[test]
    fn a_call_grammar_constrains_the_arguments_then_frees_the_tail() {
        let t = table();
        let e = Engine::new(&t, "{}").expect("engine");
        let lark = "start: call_0 | call_1\n\
                    call_0: \"ab\\\", \\\"arguments\\\": \" args_0 tail\n\
                    call_1: \"cd\\\", \\\"arguments\\\": \" args_1 tail\n\
                    args_0: %json {\"type\": \"object\", \"properties\": {\"n\": {\"type\": \"integer\"}}, \"required\": [\"n\"], \"additionalProperties\": false}\n\
                    args_1: %json {\"type\": \"object\"}\n\
                    tail: /(?s:.*)/\n";
        let mut s = e
            .session(&Grammar::Lark(lark.into()), "{}")
            .expect("compiles");
        for b in b"ab\", \"arguments\": {\"n\": " {
            let m = s.mask().expect("mask");
            assert!(
                m[(*b as usize) / 32] & (1 << (*b % 32)) != 0,
                "{}",
                *b as char
            );
            s.accept(*b as u32).expect("fits");
        }
        let m = s.mask().expect("mask");
        assert!(m[(b'7' as usize) / 32] & (1 << (b'7' % 32)) != 0);
        assert!(
            m[(b'"' as usize) / 32] & (1 << (b'"' % 32)) == 0,
            "a string for an integer"
        );
        for b in b"7}}\n</tool_call> free" {
            s.accept(*b as u32).expect("fits");
        }
        let m = s.mask().expect("mask");
        assert!(
            m[(t.eos[0] / 32) as usize] & (1 << (t.eos[0] % 32)) != 0,
            "EOS after the tail"
        );
    }
}

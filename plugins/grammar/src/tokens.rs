//! The model's vocabulary as llguidance's token environment: a token trie
//! built once per model from the host's token table.

use std::sync::Arc;

use toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};

/// The host's token table (WIT `vocabulary.token-table`), natively.
#[derive(Debug, Clone, Default)]
pub struct TokenTable {
    /// Every token's bytes, concatenated in id order.
    pub bytes: Vec<u8>,
    /// Where token `i`'s bytes end in `bytes`.
    pub ends: Vec<u32>,
    /// EOS ids (the first is the primary one).
    pub eos: Vec<u32>,
    /// Special (control) token ids.
    pub special: Vec<u32>,
}

/// Why a table cannot become a trie.
#[derive(Debug)]
pub struct BadTable(pub String);

impl TokenTable {
    /// Each token's bytes; special tokens get toktrie's marker byte in
    /// front, so grammar text never produces them (llguidance's
    /// `docs/special_tokens.md`).
    fn words(&self) -> Result<Vec<Vec<u8>>, BadTable> {
        let mut words = Vec::with_capacity(self.ends.len());
        let mut start = 0usize;
        for (id, &end) in self.ends.iter().enumerate() {
            let end = end as usize;
            let word = self.bytes.get(start..end).ok_or_else(|| {
                BadTable(format!(
                    "token {id} ends at byte {end}, outside the table's {} bytes or before its start {start}",
                    self.bytes.len()
                ))
            })?;
            words.push(word.to_vec());
            start = end;
        }
        for &id in &self.special {
            if let Some(w) = words.get_mut(id as usize) {
                if !w.is_empty() {
                    w.insert(0, TokTrie::SPECIAL_TOKEN_MARKER);
                }
            }
        }
        Ok(words)
    }

    /// The token environment: the trie, with every EOS id ending the
    /// grammar. Tokenizing forced text (fast-forward tokens) is greedy over
    /// the trie, which is what llguidance does without the model's own
    /// tokenizer.
    pub fn env(&self) -> Result<TokEnv, BadTable> {
        let words = self.words()?;
        let vocab = words.len() as u32;
        let eos: Vec<u32> = self.eos.iter().copied().filter(|&e| e < vocab).collect();
        let Some(&primary) = eos.first() else {
            return Err(BadTable(
                "the model declares no EOS id inside its vocabulary; a grammar could never end"
                    .into(),
            ));
        };
        let info = TokRxInfo::new(vocab, primary);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
        Ok(Arc::new(ApproximateTokEnv::new(trie)))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A small vocabulary: every ASCII byte as a token, a few multi-byte
    /// tokens, a special token and EOS at the end, and one padding id.
    pub(crate) fn table() -> TokenTable {
        let mut words: Vec<Vec<u8>> = (0u8..128).map(|b| vec![b]).collect();
        for w in ["{\"", "\":", "true", "false", "null", "\"name", "ab"] {
            words.push(w.as_bytes().to_vec());
        }
        words.push(b"<|im_start|>".to_vec()); // special
        words.push(b"<|im_end|>".to_vec()); // EOS
        words.push(Vec::new()); // padding
        let n = words.len() as u32;
        let mut t = TokenTable {
            eos: vec![n - 2],
            special: vec![n - 3, n - 2],
            ..TokenTable::default()
        };
        for w in words {
            t.bytes.extend_from_slice(&w);
            t.ends.push(t.bytes.len() as u32);
        }
        t
    }

    #[test]
    fn a_table_becomes_a_trie_with_special_tokens_marked() {
        let t = table();
        let env = t.env().expect("env");
        let trie = env.tok_trie();
        assert_eq!(trie.vocab_size(), t.ends.len());
        assert_eq!(trie.eos_token(), t.eos[0]);
        assert_eq!(trie.token(b'a' as u32), b"a");
        assert_eq!(trie.token(t.special[0])[0], TokTrie::SPECIAL_TOKEN_MARKER);
    }

    #[test]
    fn bad_tables_are_errors_not_panics() {
        let mut t = table();
        t.ends[3] = u32::MAX;
        assert!(t.env().is_err());
        let mut t = table();
        t.eos = vec![u32::MAX];
        assert!(t.env().is_err());
    }
}

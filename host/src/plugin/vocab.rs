//! Host side of the `vocab` interface: the model's tokenizer, read-only,
//! for plugins that reason about text (DRY's sequence breakers).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use super::bindings::sampler::mlxhost::plugin::vocab::Host;
use super::tensors::PluginState;
use crate::model::TextTokenizer;

/// Longest text `token-sequences-for` accepts, bytes (llama.cpp cuts DRY
/// breakers to 40 bytes); host work cannot be interrupted by the epoch
/// deadline, so inputs are bounded instead.
pub const MAX_SEQUENCE_TEXT: usize = 40;
/// Longest text `encode` accepts from a plugin, bytes.
pub const MAX_ENCODE_TEXT: usize = 64 << 10;
/// Memoised `token-sequences-for` results kept at most (inputs come from
/// requests, so the memo must not grow without bound).
const MAX_MEMO: usize = 256;

/// (head token, tail tokens): one way a token can begin a text.
pub type TokenSequence = (u32, Vec<u32>);

/// The whole vocabulary in one table (WIT 0.3.0 `vocabulary.token-table`),
/// for constraint plugins that build a token trie.
#[derive(Debug, Clone, Default)]
pub struct TokenTable {
    /// Every token's bytes, concatenated in id order.
    pub bytes: Vec<u8>,
    /// Where token `i`'s bytes end in `bytes`; one entry per logit.
    pub ends: Vec<u32>,
    /// EOS ids, the model's order.
    pub eos: Vec<u32>,
    /// Special (control) token ids.
    pub special: Vec<u32>,
}

/// The ids of the usual end-of-turn / end-of-text tokens the tokenizer
/// has (`<|im_end|>`, `<|endoftext|>`, `</s>`, `<|eot_id|>`,
/// `<end_of_turn>`, `<eos>`), for callers with no model config to read EOS
/// from (`plugins check`).
pub fn likely_eos_ids(tokenizer: &TextTokenizer) -> Vec<u32> {
    [
        "<|im_end|>",
        "<|endoftext|>",
        "</s>",
        "<|eot_id|>",
        "<end_of_turn>",
        "<eos>",
    ]
    .iter()
    .filter_map(|t| tokenizer.token_to_id(t))
    .collect()
}

/// A tokenizer plus what plugins ask of it repeatedly, computed once.
pub struct VocabView {
    tokenizer: TextTokenizer,
    /// The model's EOS ids.
    eos: Vec<u32>,
    /// The width of the model's logits (0: the tokenizer's vocabulary).
    width: usize,
    /// Every token's bytes, by id (built on first use: ~V small vectors).
    pieces: OnceLock<Vec<Vec<u8>>>,
    /// [`VocabView::token_table`], built on first use.
    table: OnceLock<std::sync::Arc<TokenTable>>,
    /// `token-sequences-for` results by (text, max tail).
    sequences: Mutex<HashMap<(String, u32), Vec<TokenSequence>>>,
}

impl VocabView {
    /// Wraps `tokenizer`.
    pub fn new(tokenizer: TextTokenizer) -> Self {
        VocabView {
            tokenizer,
            eos: Vec::new(),
            width: 0,
            pieces: OnceLock::new(),
            table: OnceLock::new(),
            sequences: Mutex::new(HashMap::new()),
        }
    }

    /// Adds what the model declares beyond its tokenizer: its EOS ids and
    /// the width of its logits (which may exceed the tokenizer's
    /// vocabulary: Qwen2.5 pads 151,665 tokens to 151,936 logits).
    pub fn with_model(mut self, eos: Vec<u32>, logits_width: usize) -> Self {
        self.eos = eos;
        self.width = logits_width;
        self
    }

    /// Every token's bytes in one table, one entry per logit (padding ids
    /// have no bytes), with the EOS and special ids. Built once.
    pub fn token_table(&self) -> std::sync::Arc<TokenTable> {
        self.table
            .get_or_init(|| {
                let pieces = self.pieces();
                let width = self.width.max(pieces.len());
                let mut t = TokenTable {
                    eos: self.eos.clone(),
                    ..TokenTable::default()
                };
                t.ends.reserve(width);
                for id in 0..width {
                    if let Some(p) = pieces.get(id) {
                        t.bytes.extend_from_slice(p);
                    }
                    t.ends.push(t.bytes.len() as u32);
                }
                t.special = self
                    .tokenizer
                    .special_token_texts()
                    .iter()
                    .filter_map(|text| self.tokenizer.token_to_id(text))
                    .collect();
                t.special.sort_unstable();
                t.special.dedup();
                std::sync::Arc::new(t)
            })
            .clone()
    }

    fn pieces(&self) -> &[Vec<u8>] {
        self.pieces.get_or_init(|| {
            (0..self.tokenizer.vocab_size() as u32)
                .map(|id| self.tokenizer.token_bytes(id))
                .collect()
        })
    }

    /// llama.cpp's `get_overlapping_token_sequences` (src/llama-sampling.cpp,
    /// b6000-era): for every token, if its bytes contain `text` the token is
    /// a head with an empty tail; otherwise every position where the token's
    /// bytes end with a prefix of `text` gives the tokenization of the rest
    /// as a tail (cut to `max_tail` ids, duplicates dropped).
    ///
    /// Errors: the tokenizer failing on the rest of `text`.
    pub fn token_sequences_for(
        &self,
        text: &str,
        max_tail: u32,
    ) -> Result<Vec<(u32, Vec<u32>)>, String> {
        let key = (text.to_string(), max_tail);
        if let Some(hit) = self
            .sequences
            .lock()
            .ok()
            .and_then(|m| m.get(&key).cloned())
        {
            return Ok(hit);
        }
        let needle = text.as_bytes();
        let mut out: Vec<TokenSequence> = Vec::new();
        if let Some(&first) = needle.first() {
            for (id, word) in self.pieces().iter().enumerate() {
                let id = id as u32;
                if word.windows(needle.len()).any(|w| w == needle) {
                    out.push((id, Vec::new()));
                    continue;
                }
                for pos in (0..word.len()).filter(|&p| word[p] == first) {
                    // The word's tail from `pos` must be a prefix of `text`.
                    let overlap = word.len() - pos;
                    if overlap >= needle.len() || word[pos..] != needle[..overlap] {
                        continue;
                    }
                    let rest = String::from_utf8_lossy(&needle[overlap..]);
                    let mut tail = self.tokenizer.encode(&rest).map_err(|e| e.to_string())?;
                    tail.truncate(max_tail as usize);
                    if !out.iter().any(|(h, t)| *h == id && *t == tail) {
                        out.push((id, tail));
                    }
                }
            }
        }
        if let Ok(mut m) = self.sequences.lock() {
            if m.len() < MAX_MEMO {
                m.insert(key, out.clone());
            }
        }
        Ok(out)
    }
}

impl PluginState {
    pub(crate) fn vocab_view(&self) -> wasmtime::Result<&VocabView> {
        match &self.vocab {
            Some(v) => Ok(v),
            None => {
                wasmtime::bail!("vocab: no model vocabulary is available here (no model loaded)")
            }
        }
    }
}

impl Host for PluginState {
    fn encode(&mut self, text: String) -> wasmtime::Result<Vec<u32>> {
        if text.len() > MAX_ENCODE_TEXT {
            wasmtime::bail!(
                "vocab.encode: text is {} bytes; at most {MAX_ENCODE_TEXT}",
                text.len()
            );
        }
        Ok(self.vocab_view()?.tokenizer.encode(&text)?)
    }

    fn token_bytes(&mut self, id: u32) -> wasmtime::Result<Vec<u8>> {
        Ok(self
            .vocab_view()?
            .pieces()
            .get(id as usize)
            .cloned()
            .unwrap_or_default())
    }

    fn token_sequences_for(
        &mut self,
        text: String,
        max_tail: u32,
    ) -> wasmtime::Result<Vec<(u32, Vec<u32>)>> {
        self.vocab_view()?
            .token_sequences_for(&text, max_tail)
            .map_err(wasmtime::Error::msg)
    }
}

/// 0.2.0's `vocab` is 0.1.0's, unchanged: the same host functions.
impl super::bindings::v2::tool_parser::mlxhost::plugin::vocab::Host for PluginState {
    fn encode(&mut self, text: String) -> wasmtime::Result<Vec<u32>> {
        Host::encode(self, text)
    }

    fn token_bytes(&mut self, id: u32) -> wasmtime::Result<Vec<u8>> {
        Host::token_bytes(self, id)
    }

    fn token_sequences_for(
        &mut self,
        text: String,
        max_tail: u32,
    ) -> wasmtime::Result<Vec<(u32, Vec<u32>)>> {
        Host::token_sequences_for(self, text, max_tail)
    }
}

//! Text <-> token ids, with Hugging Face `tokenizers`.
//!
//! From a model directory's `tokenizer.json`, or rebuilt from GGUF metadata
//! (`tokenizer.ggml.*`) as a byte-level BPE: vocabulary and merges from the
//! file, the pre-tokenizer `tokenizer.ggml.pre` names (see
//! [`PRE_TOKENIZERS`]; the regexes are llama.cpp's, `src/llama-vocab.cpp`,
//! which are the models' own `tokenizer.json` splits), ByteLevel decoder,
//! control tokens (`token_type == 3`) as special tokens and user-defined
//! ones (4) as added tokens matched everywhere. That reproduces llama.cpp's
//! tokenization of those pre-tokenizer types.

use std::path::Path;

use tokenizers::{
    decoders::byte_level::ByteLevel as ByteLevelDecoder,
    models::bpe::BPE,
    pre_tokenizers::{
        byte_level::ByteLevel,
        digits::Digits,
        sequence::Sequence,
        split::{Split, SplitPattern},
        PreTokenizerWrapper,
    },
    AddedToken, SplitDelimiterBehavior, Tokenizer,
};

use super::error::{ModelError, Result};

/// GGUF token types (llama.cpp `llama_token_type`).
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// `tokenizer.ggml.pre` values this build rebuilds.
pub const PRE_TOKENIZERS: &[&str] = &["smollm", "qwen2", "llama-bpe", "gpt-2"];

/// Qwen2's split (its `tokenizer.json`; llama.cpp `LLAMA_VOCAB_PRE_TYPE_QWEN2`):
/// single digits, letters with one leading non-letter, punctuation runs.
const QWEN2_SPLIT: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Llama 3's split (`LLAMA_VOCAB_PRE_TYPE_LLAMA3`): as Qwen2's with digits
/// in runs of up to three.
const LLAMA3_SPLIT: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenizer for `tokenizer.ggml.pre` = `pre`.
fn pre_tokenizer(pre: &str) -> Result<Sequence> {
    let split = |re: &str| -> Result<PreTokenizerWrapper> {
        Ok(Split::new(
            SplitPattern::Regex(re.into()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| ModelError::Tokenizer(e.to_string()))?
        .into())
    };
    let parts: Vec<PreTokenizerWrapper> = match pre {
        // SmolLM: GPT-2's regex, digits split one by one.
        "smollm" => vec![
            Digits::new(true).into(),
            ByteLevel::new(false, true, true).into(),
        ],
        "qwen2" => vec![
            split(QWEN2_SPLIT)?,
            ByteLevel::new(false, false, false).into(),
        ],
        "llama-bpe" => vec![
            split(LLAMA3_SPLIT)?,
            ByteLevel::new(false, false, false).into(),
        ],
        "gpt-2" => vec![ByteLevel::new(false, true, true).into()],
        other => {
            return Err(ModelError::Tokenizer(format!(
                "pre-tokenizer `tokenizer.ggml.pre = {other}` is not supported (supported: {})",
                PRE_TOKENIZERS.join(", ")
            )))
        }
    };
    Ok(Sequence::new(parts))
}

/// The model's tokenizer plus the special ids generation needs.
#[derive(Clone)]
pub struct TextTokenizer {
    inner: Tokenizer,
    /// Ids of added (special) tokens, computed once: `tokenizers` clones its
    /// whole added-token map on every query.
    added: std::sync::Arc<std::collections::HashSet<u32>>,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("vocab_size", &self.inner.get_vocab_size(true))
            .finish()
    }
}

impl TextTokenizer {
    fn wrap(inner: Tokenizer) -> Self {
        let added = inner.get_added_tokens_decoder().keys().copied().collect();
        TextTokenizer {
            inner,
            added: std::sync::Arc::new(added),
        }
    }

    /// Loads `tokenizer.json`. Errors name the file.
    pub fn from_file(path: &Path) -> Result<Self> {
        if !path.is_file() {
            return Err(ModelError::MissingFile(path.into()));
        }
        let inner = Tokenizer::from_file(path).map_err(|e| ModelError::invalid(path, e))?;
        Ok(TextTokenizer::wrap(inner))
    }

    /// Builds a byte-level BPE from GGUF metadata arrays.
    ///
    /// `tokens[i]` is id `i`; `merges` are `"left right"` strings in rank
    /// order; `token_types` follow llama.cpp's enum (3 = control); `pre`
    /// is `tokenizer.ggml.pre` (one of [`PRE_TOKENIZERS`]).
    ///
    /// Errors: a malformed merge, an unsupported `pre`.
    pub fn from_gguf_bpe(
        tokens: &[String],
        merges: &[String],
        token_types: &[i64],
        pre: &str,
    ) -> Result<Self> {
        let vocab: tokenizers::models::bpe::Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let merges: Vec<(String, String)> = merges
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| ModelError::Tokenizer(format!("malformed merge `{m}`")))
            })
            .collect::<Result<_>>()?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            // Llama 3 takes a whole pre-token from the vocabulary before
            // merging (its tokenizer.json; llama.cpp `ignore_merges`).
            .ignore_merges(pre == "llama-bpe")
            .build()
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        let mut inner = Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(pre_tokenizer(pre)?));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        let special: Vec<AddedToken> = tokens
            .iter()
            .zip(token_types)
            .filter(|(_, &ty)| ty == TOKEN_TYPE_CONTROL)
            .map(|(t, _)| AddedToken::from(t.clone(), true))
            .collect();
        let user: Vec<AddedToken> = tokens
            .iter()
            .zip(token_types)
            .filter(|(_, &ty)| ty == TOKEN_TYPE_USER_DEFINED)
            .map(|(t, _)| AddedToken::from(t.clone(), false))
            .collect();
        inner.add_special_tokens(&special);
        inner.add_tokens(&user);
        Ok(TextTokenizer::wrap(inner))
    }

    /// Token ids of `text`; special-token strings in `text` (e.g.
    /// `<|im_start|>`) map to their ids. No BOS is added: chat templates
    /// write it themselves.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens included when `skip_special` is false.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))
    }

    /// The id of a token string, if in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The string of a token id.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The exact bytes token `id` stands for (a byte-level token may be part
    /// of a UTF-8 character, so this is not always valid UTF-8). Byte-level
    /// BPE pieces are mapped back through GPT-2's `bytes_to_unicode` table
    /// (openai/gpt-2 `encoder.py`); SentencePiece pieces map `▁` to a space
    /// and `<0xNN>` to byte NN; added/special tokens are their text.
    /// Unknown ids give an empty vector.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let Some(piece) = self.inner.id_to_token(id) else {
            return Vec::new();
        };
        let is_added = self.added.contains(&id);
        let byte_level = matches!(
            self.inner.get_decoder(),
            Some(tokenizers::DecoderWrapper::ByteLevel(_))
        );
        if is_added {
            return piece.into_bytes();
        }
        if byte_level {
            if let Some(bytes) = piece
                .chars()
                .map(byte_of_unicode)
                .collect::<Option<Vec<u8>>>()
            {
                return bytes;
            }
            return piece.into_bytes();
        }
        if let Some(hex) = piece.strip_prefix("<0x").and_then(|h| h.strip_suffix('>')) {
            if let Ok(b) = u8::from_str_radix(hex, 16) {
                return vec![b];
            }
        }
        piece.replace('\u{2581}', " ").into_bytes()
    }

    /// The text of every special (control) token: what decoding with
    /// `skip_special` drops, so the output pipeline can hide what its
    /// parsers did not consume. Longest first.
    pub fn special_token_texts(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .inner
            .get_added_tokens_decoder()
            .values()
            .filter(|t| t.special && !t.content.is_empty())
            .map(|t| t.content.clone())
            .collect();
        out.sort_by_key(|t| std::cmp::Reverse(t.len()));
        out.dedup();
        out
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Writes `tokenizer.json` (Hugging Face format).
    pub fn save(&self, path: &Path) -> Result<()> {
        self.inner
            .save(path, false)
            .map_err(|e| ModelError::invalid(path, e))
    }

    /// A stable hash of the serialized tokenizer (SSD cache keys):
    /// `xxh3-128:<32 hex digits>` of its canonical JSON, so it is the same
    /// across runs, builds and platforms.
    ///
    /// Errors: the tokenizer cannot be serialized.
    pub fn fingerprint(&self) -> Result<String> {
        let json = self
            .inner
            .to_string(false)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        Ok(format!(
            "xxh3-128:{:032x}",
            xxhash_rust::xxh3::xxh3_128(json.as_bytes())
        ))
    }
}

/// Inverse of GPT-2's `bytes_to_unicode`: printable bytes (`!`..=`~`,
/// `¡`..=`¬`, `®`..=`ÿ`) stand for themselves; the other 68 bytes were
/// shifted to U+0100.. in byte order.
fn byte_of_unicode(c: char) -> Option<u8> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let code = c as u32;
    if printable(code) {
        return u8::try_from(code).ok();
    }
    let shifted = code.checked_sub(256)?;
    (0u32..=255)
        .filter(|&b| !printable(b))
        .nth(shifted as usize)
        .and_then(|b| u8::try_from(b).ok())
}

#[cfg(test)]
mod byte_level_tests {
    use super::byte_of_unicode;

    #[test]
    fn gpt2_byte_map_round_trips() {
        // 'Ġ' (U+0120) is the space byte, 'Ċ' (U+010A) the newline.
        assert_eq!(byte_of_unicode('\u{120}'), Some(b' '));
        assert_eq!(byte_of_unicode('\u{10A}'), Some(b'\n'));
        assert_eq!(byte_of_unicode('a'), Some(b'a'));
        assert_eq!(byte_of_unicode('\u{100}'), Some(0));
        assert_eq!(byte_of_unicode('\u{4e00}'), None);
    }
}

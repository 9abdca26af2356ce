//! Text <-> token ids, with Hugging Face `tokenizers`.
//!
//! From a model directory's `tokenizer.json`, or rebuilt from GGUF metadata
//! (`tokenizer.ggml.*`) as a byte-level BPE: vocabulary and merges from the
//! file, pre-tokenizer `Sequence[Digits(individual), ByteLevel(no prefix
//! space, GPT-2 regex)]`, ByteLevel decoder, and control tokens
//! (`token_type == 3`) as special tokens. That reproduces llama.cpp's
//! tokenization of the `smollm` pre-tokenizer type.

use std::path::Path;

use tokenizers::{
    decoders::byte_level::ByteLevel as ByteLevelDecoder,
    models::bpe::BPE,
    pre_tokenizers::{
        byte_level::ByteLevel, digits::Digits, sequence::Sequence, PreTokenizerWrapper,
    },
    AddedToken, Tokenizer,
};

use super::error::{ModelError, Result};

/// GGUF token types (llama.cpp `llama_token_type`).
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// The model's tokenizer plus the special ids generation needs.
#[derive(Clone)]
pub struct TextTokenizer {
    inner: Tokenizer,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("vocab_size", &self.inner.get_vocab_size(true))
            .finish()
    }
}

impl TextTokenizer {
    /// Loads `tokenizer.json`. Errors name the file.
    pub fn from_file(path: &Path) -> Result<Self> {
        if !path.is_file() {
            return Err(ModelError::MissingFile(path.into()));
        }
        let inner = Tokenizer::from_file(path).map_err(|e| ModelError::invalid(path, e))?;
        Ok(TextTokenizer { inner })
    }

    /// Builds a byte-level BPE from GGUF metadata arrays.
    ///
    /// `tokens[i]` is id `i`; `merges` are `"left right"` strings in rank
    /// order; `token_types` follow llama.cpp's enum (3 = control).
    pub fn from_gguf_bpe(
        tokens: &[String],
        merges: &[String],
        token_types: &[i32],
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
            .build()
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        let mut inner = Tokenizer::new(bpe);
        let pre: Vec<PreTokenizerWrapper> = vec![
            Digits::new(true).into(),
            ByteLevel::new(false, true, true).into(),
        ];
        inner.with_pre_tokenizer(Some(Sequence::new(pre)));
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
        Ok(TextTokenizer { inner })
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

    /// A stable hash of the serialized tokenizer (cache keys).
    pub fn fingerprint(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.inner.to_string(false).unwrap_or_default().hash(&mut h);
        h.finish()
    }
}

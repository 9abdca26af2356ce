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
//!
//! `tokenizer.ggml.model = llama` (SentencePiece with scores, Gemma's and
//! Llama 2's) becomes a BPE whose merges are every split of a vocabulary
//! piece into two pieces, ranked by the merged piece's score: llama.cpp's
//! SPM tokenizer (`llm_tokenizer_spm`) merges, at each step, the adjacent
//! pair whose concatenation is the best-scoring vocabulary piece, which is
//! that BPE (transformers' `SentencePieceExtractor` builds the same merges).
//! Spaces become `▁` (plus a leading `▁` when `add_space_prefix`), and a
//! character outside the vocabulary falls back to its UTF-8 bytes
//! (`<0xNN>` pieces).

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

/// GGUF token type of SentencePiece's unknown piece (`<unk>`).
const TOKEN_TYPE_UNKNOWN: i64 = 2;
/// GGUF token type of SentencePiece's byte pieces (`<0x00>`..`<0xFF>`).
const TOKEN_TYPE_BYTE: i64 = 6;

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
    /// is `tokenizer.ggml.pre` (one of [`PRE_TOKENIZERS`]); `bos` is added
    /// by [`TextTokenizer::encode_prompt`] when given (`add_bos_token`,
    /// e.g. Llama 3).
    ///
    /// Errors: a malformed merge, an unsupported `pre`.
    pub fn from_gguf_bpe(
        tokens: &[String],
        merges: &[String],
        token_types: &[i64],
        pre: &str,
        bos: Option<u32>,
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
        add_bos(&mut inner, tokens, bos)?;
        // No normalizer here: whether user-defined tokens are "normalized"
        // changes nothing but the serialized form (the SSD cache key).
        add_gguf_tokens(&mut inner, tokens, token_types, true);
        Ok(TextTokenizer::wrap(inner))
    }

    /// Builds a SentencePiece tokenizer from GGUF metadata arrays
    /// (`tokenizer.ggml.model = llama`): `tokens[i]` is id `i` with score
    /// `scores[i]`; `token_types` follow llama.cpp's enum (3 control, 4
    /// user-defined, 6 byte); `add_space_prefix` prepends `▁` to the text
    /// (Llama 2; Gemma does not); `bos` is added by
    /// [`TextTokenizer::encode_prompt`] when given (`add_bos_token`).
    ///
    /// Errors: lengths that disagree; `tokenizers` rejecting the model.
    pub fn from_gguf_spm(
        tokens: &[String],
        scores: &[f32],
        token_types: &[i64],
        add_space_prefix: bool,
        bos: Option<u32>,
    ) -> Result<Self> {
        use tokenizers::decoders::{
            byte_fallback::ByteFallback, fuse::Fuse, sequence::Sequence as DecoderSequence,
            strip::Strip,
        };
        use tokenizers::normalizers::{
            prepend::Prepend, replace::Replace, NormalizerWrapper, Sequence as NormSequence,
        };
        if scores.len() != tokens.len() || token_types.len() != tokens.len() {
            return Err(ModelError::Tokenizer(format!(
                "{} tokens but {} scores and {} token types",
                tokens.len(),
                scores.len(),
                token_types.len()
            )));
        }
        let vocab: tokenizers::models::bpe::Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let merges = spm_merges(tokens, scores, token_types, &vocab);
        let mut builder = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .byte_fallback(true)
            .fuse_unk(true);
        if let Some(unk) = tokens
            .iter()
            .zip(token_types)
            .find(|(_, &ty)| ty == TOKEN_TYPE_UNKNOWN)
        {
            builder = builder.unk_token(unk.0.clone());
        }
        let bpe = builder
            .build()
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        let mut inner = Tokenizer::new(bpe);
        let tk = |e: tokenizers::Error| ModelError::Tokenizer(e.to_string());
        let space = Replace::new(" ", "\u{2581}").map_err(tk)?;
        let mut norms: Vec<NormalizerWrapper> = Vec::new();
        if add_space_prefix {
            norms.push(Prepend::new("\u{2581}".into()).into());
        }
        norms.push(space.into());
        inner.with_normalizer(Some(NormSequence::new(norms)));
        let mut decoders = vec![
            Replace::new("\u{2581}", " ").map_err(tk)?.into(),
            ByteFallback::new().into(),
            Fuse::new().into(),
        ];
        if add_space_prefix {
            decoders.push(Strip::new(' ', 1, 0).into());
        }
        inner.with_decoder(Some(DecoderSequence::new(decoders)));
        add_bos(&mut inner, tokens, bos)?;
        // llama.cpp matches user-defined tokens in the raw text, before
        // spaces become `▁`, so they are not normalized.
        add_gguf_tokens(&mut inner, tokens, token_types, false);
        Ok(TextTokenizer::wrap(inner))
    }

    /// Whether [`TextTokenizer::encode_prompt`] puts a BOS first.
    pub fn adds_bos(&self) -> bool {
        self.inner.get_post_processor().is_some()
    }

    /// Token ids of a raw-text prompt (no chat template): as
    /// [`TextTokenizer::encode`], with the model's BOS first when its
    /// tokenizer adds one (Gemma's `add_bos_token`), as llama.cpp's server
    /// and vLLM do for completions.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, true)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
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

/// Adds a GGUF vocabulary's control tokens (type 3) as special tokens,
/// matched only as specials and never normalized, and its user-defined ones
/// (type 4) as added tokens matched everywhere, normalized as
/// `normalize_user` says.
fn add_gguf_tokens(inner: &mut Tokenizer, tokens: &[String], types: &[i64], normalize_user: bool) {
    let of_type = |want: i64| tokens.iter().zip(types).filter(move |(_, &ty)| ty == want);
    let special: Vec<AddedToken> = of_type(TOKEN_TYPE_CONTROL)
        .map(|(t, _)| AddedToken::from(t.clone(), true))
        .collect();
    let user: Vec<AddedToken> = of_type(TOKEN_TYPE_USER_DEFINED)
        .map(|(t, _)| AddedToken::from(t.clone(), false).normalized(normalize_user))
        .collect();
    inner.add_special_tokens(&special);
    inner.add_tokens(&user);
}

/// Makes `encode(text, true)` put `bos` (`tokens[bos]`) first, as a
/// `TemplateProcessing` post-processor (what a Hugging Face
/// `tokenizer.json` of a BOS-adding model has, so `convert` writes it too).
fn add_bos(inner: &mut Tokenizer, tokens: &[String], bos: Option<u32>) -> Result<()> {
    let Some(bos) = bos else { return Ok(()) };
    let text = tokens
        .get(bos as usize)
        .cloned()
        .ok_or_else(|| ModelError::Tokenizer(format!("BOS id {bos} is outside the vocabulary")))?;
    let post = tokenizers::processors::template::TemplateProcessing::builder()
        .try_single(format!("{text} $A"))
        .and_then(|b| {
            b.special_tokens(vec![(text.clone(), bos)])
                .build()
                .map_err(|e| e.to_string())
        })
        .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    inner.with_post_processor(Some(post));
    Ok(())
}

/// SentencePiece merges from scores: every split of a normal piece into
/// two vocabulary pieces, best-scoring merged piece first (ties: lower id).
fn spm_merges(
    tokens: &[String],
    scores: &[f32],
    token_types: &[i64],
    vocab: &tokenizers::models::bpe::Vocab,
) -> Vec<(String, String)> {
    let mut ranked: Vec<(f32, u32, String, String)> = Vec::new();
    for (id, piece) in tokens.iter().enumerate() {
        let ty = token_types[id];
        if ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_BYTE || piece.chars().nth(1).is_none() {
            continue;
        }
        for (at, _) in piece.char_indices().skip(1) {
            let (left, right) = piece.split_at(at);
            if vocab.contains_key(left) && vocab.contains_key(right) {
                ranked.push((scores[id], id as u32, left.to_string(), right.to_string()));
            }
        }
    }
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    ranked.into_iter().map(|(_, _, l, r)| (l, r)).collect()
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

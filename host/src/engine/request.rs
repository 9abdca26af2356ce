//! The engine's request and result types: the canonical generation request,
//! the events a sequence streams, its summary and its errors, plus the
//! checks and parameter fills applied before a request runs.

use std::time::Duration;

use crate::model::{LoadedModel, ModelError};
use crate::plugin::{PluginError, SamplingParams};

/// One generation request in canonical form.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    /// Prompt token ids (chat template already applied).
    pub prompt_ids: Vec<u32>,
    /// Upper bound on generated tokens (the context limit also applies).
    pub max_tokens: usize,
    /// Stop strings (not returned).
    pub stop: Vec<String>,
    /// Keep special tokens' text in the output (for the output pipeline's
    /// parsers, which need `<tool_call>`, `[TOOL_CALLS]`, ...).
    pub keep_special: bool,
    /// Token sequences the reply must begin with one of (empty: free);
    /// see [`super::constrain`].
    pub forced_choices: Vec<Vec<u32>>,
    /// Sampling parameters for the sampler.
    pub params: SamplingParams,
    /// Sampler plugin name.
    pub sampler: String,
    /// Logits processor plugin names, in order.
    pub processors: Vec<String>,
    /// Per-plugin parameters, keyed by plugin name.
    pub plugin_params: serde_json::Value,
    /// Alternatives to report per token (raw distribution); 0 = none.
    pub top_logprobs: usize,
    /// Speculative decoding: the drafter and the most drafts per step
    /// (`engine::speculative`); off by default.
    pub speculative: super::speculative::SpecRequest,
    /// The LoRA adapter to run under, by its name in `--lora-dir`
    /// (`model::lora`); `None`: the base model.
    pub lora: Option<String>,
}

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS or a stop string.
    Stop,
    /// `max_tokens` or the context limit.
    Length,
    /// The caller cancelled.
    Cancelled,
}

/// One generated token as reported to callers.
#[derive(Debug, Clone)]
pub struct TokenInfo {
    /// Token id.
    pub id: u32,
    /// Log-probability under the model's raw distribution.
    pub logprob: f32,
    /// Top alternatives under the raw distribution, descending.
    pub top: Vec<(u32, f32)>,
}

/// Streamed to the caller during generation.
#[derive(Debug, Clone)]
pub enum GenerateEvent {
    /// The plugin chain accepted the request; prefill begins.
    Started {
        /// Prompt tokens whose KV came from the prompt cache.
        cached_tokens: usize,
    },
    /// Text that is final (stop strings already excluded).
    Text(String),
    /// A token was chosen (before its text is known to be final).
    Token(TokenInfo),
}

/// Totals of a finished generation.
#[derive(Debug, Clone)]
pub struct GenerateSummary {
    /// Why it stopped.
    pub finish_reason: FinishReason,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV came from the prompt cache (not prefilled).
    pub cached_tokens: usize,
    /// Generated tokens (EOS included when it ended generation).
    pub completion_tokens: usize,
    /// The stop string that ended generation, if one did.
    pub stop_sequence: Option<String>,
    /// Prefill wall time: admission to the first token read back (the
    /// prefill steps and the first token's evaluation, as mlx-lm's prompt
    /// time; the whole run when no token came).
    pub prefill: Duration,
    /// Decode wall time: from the first token read back to the end (the
    /// steps that chose tokens 2..=`completion_tokens`).
    pub decode: Duration,
    /// Time inside plugin calls.
    pub plugin_time: Duration,
}

impl GenerateSummary {
    /// Decode speed, tokens per second: the tokens after the first over
    /// [`decode`](Self::decode) (0 when fewer than two were generated).
    pub fn decode_tok_s(&self) -> f64 {
        let s = self.decode.as_secs_f64();
        if s > 0.0 {
            self.completion_tokens.saturating_sub(1) as f64 / s
        } else {
            0.0
        }
    }
}

/// Errors that fail a generation.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    /// The request cannot be served (names the field).
    #[error("{0}")]
    InvalidRequest(String),
    /// A plugin failed (its name is in the message).
    #[error(transparent)]
    Plugin(#[from] PluginError),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The host itself failed (a bug, not the request's fault).
    #[error("internal error: {0}")]
    Internal(String),
    /// The request's prompt KV and prefill activations could never fit in
    /// `--memory-budget` (a 400 naming the flag).
    #[error("{0}")]
    OverMemoryBudget(String),
    /// The server is shutting down and did not start the request.
    #[error("{0}")]
    Unavailable(String),
}

impl From<mlx_rs::error::Exception> for GenerateError {
    fn from(e: mlx_rs::error::Exception) -> Self {
        GenerateError::Model(ModelError::Mlx(e))
    }
}

/// The request's sampling parameters with the host's fills: XTC's protected
/// ids (EOS, newline) and a seed when the request has none.
pub fn effective_params(model: &LoadedModel, req: &GenerateRequest) -> SamplingParams {
    let mut params = req.params.clone();
    if params.xtc_special_ids.is_empty() {
        params.xtc_special_ids = model.eos_ids.clone();
        if let Ok(nl) = model.tokenizer.encode("\n") {
            params.xtc_special_ids.extend(nl);
        }
    }
    if params.seed.is_none() {
        params.seed = Some(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0),
        );
    }
    params
}

/// Checks a request against the model before it is queued.
///
/// Errors: [`GenerateError::InvalidRequest`] for an empty prompt, an id
/// outside the vocabulary, or a prompt that fills the whole context.
pub fn validate(model: &LoadedModel, req: &GenerateRequest) -> Result<(), GenerateError> {
    let vocab = model.model.config().vocab_size;
    let context = model.model.config().max_position_embeddings;
    if req.prompt_ids.is_empty() {
        return Err(GenerateError::InvalidRequest("the prompt is empty".into()));
    }
    if let Some(id) = req.prompt_ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(GenerateError::InvalidRequest(format!(
            "prompt token id {id} is outside the vocabulary"
        )));
    }
    if req.prompt_ids.len() >= context {
        return Err(GenerateError::InvalidRequest(format!(
            "the prompt is {} tokens; the model's context is {context}",
            req.prompt_ids.len()
        )));
    }
    Ok(())
}

/// The KV scheme a cache entry was computed under (cache namespace): KV
/// from one compute path, or one KV quantization (`--kv-bits`), never
/// seeds another.
pub fn kv_namespace(model: &LoadedModel) -> String {
    let kv = crate::model::quantized_kv::scheme_suffix(model.model.as_ref());
    match &model.merged_lora {
        None => format!("{:?}{kv}", model.compute),
        Some(f) => format!("{:?}{kv}+merged:{f}", model.compute),
    }
}

/// The cache namespace of KV computed under `adapter` (`None`: the base
/// model's, [`kv_namespace`]): an entry made under one adapter never seeds
/// another's or the base's prefill, in either tier (the SSD tier keys its
/// files by the namespace too).
pub fn lora_namespace(
    model: &LoadedModel,
    adapter: Option<&crate::model::lora::LoraAdapter>,
) -> String {
    crate::model::lora::namespace(&kv_namespace(model), adapter)
}

//! The decode loop: prefill, then per step forward every row, run each row's
//! plugin chain (processors, then sampler), evaluate once for all rows,
//! `accept`, detokenize, and stop on EOS, `max_tokens` or a stop string.
//!
//! No sampler is built into the host: every token is chosen by a plugin.

use std::time::{Duration, Instant};

use mlx_rs::{ops::indexing::IndexOp, transforms::eval, Array, Dtype};

use super::detokenize::{Detokenizer, StopMatcher};
use crate::cache::PrefixCache;
use crate::model::{LoadedModel, ModelError, RowInput};
use crate::plugin::session::{Chosen, RowChain, TokenChain};
use crate::plugin::{PluginError, PluginHost, SamplingParams};
use crate::score::PREFILL_CHUNK;

/// One generation request in canonical form.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    /// Prompt token ids (chat template already applied).
    pub prompt_ids: Vec<u32>,
    /// Upper bound on generated tokens (the context limit also applies).
    pub max_tokens: usize,
    /// Stop strings (not returned).
    pub stop: Vec<String>,
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
    Started,
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
    /// Prefill wall time.
    pub prefill: Duration,
    /// Decode wall time (all steps).
    pub decode: Duration,
    /// Time inside plugin calls.
    pub plugin_time: Duration,
}

impl GenerateSummary {
    /// Decode speed, tokens per second (0 when nothing was decoded).
    pub fn decode_tok_s(&self) -> f64 {
        let s = self.decode.as_secs_f64();
        if s > 0.0 {
            self.completion_tokens as f64 / s
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

/// Generates for one request, streaming events to `on_event`; `cancelled`
/// is polled once per step. Every token is chosen by the request's plugin
/// chain.
///
/// Errors: [`GenerateError::InvalidRequest`] (empty prompt, ids outside the
/// vocabulary, prompt over the context), [`GenerateError::Plugin`] (unknown
/// plugin, rejected parameters, a plugin failure), [`GenerateError::Model`].
pub fn generate(
    model: &LoadedModel,
    plugins: &PluginHost,
    req: &GenerateRequest,
    prompt_cache: Option<&mut PrefixCache>,
    on_event: impl FnMut(GenerateEvent),
    cancelled: impl Fn() -> bool,
) -> Result<GenerateSummary, GenerateError> {
    validate(model, req)?;
    let params = effective_params(model, req);
    let mut chain = RowChain::new(
        plugins,
        &req.sampler,
        &req.processors,
        &params,
        &req.plugin_params,
    )?;
    generate_with(model, &mut chain, req, prompt_cache, on_event, cancelled)
}

fn validate(model: &LoadedModel, req: &GenerateRequest) -> Result<(), GenerateError> {
    let vocab = model.model.config.vocab_size;
    let context = model.model.config.max_position_embeddings;
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
/// from one compute path never seeds another.
pub fn kv_namespace(model: &LoadedModel) -> String {
    format!("{:?}", model.compute)
}

/// The decode loop with a given token chain (see [`generate`]). With a
/// prompt cache, the longest cached prefix of the prompt is reused instead
/// of prefilled, and the finished row's KV is stored for later requests.
pub fn generate_with(
    model: &LoadedModel,
    chain: &mut impl TokenChain,
    req: &GenerateRequest,
    mut prompt_cache: Option<&mut PrefixCache>,
    mut on_event: impl FnMut(GenerateEvent),
    cancelled: impl Fn() -> bool,
) -> Result<GenerateSummary, GenerateError> {
    validate(model, req)?;
    let llama = &model.model;
    let vocab = llama.config.vocab_size;
    let context = llama.config.max_position_embeddings;
    on_event(GenerateEvent::Started);

    // Prefill in chunks; logits only for the last prompt position.
    let started = Instant::now();
    let prompt = &req.prompt_ids;
    let namespace = kv_namespace(model);
    let reuse = prompt_cache
        .as_deref_mut()
        .and_then(|c| c.lookup(&namespace, prompt));
    let (mut cache, cached_tokens) = match reuse {
        Some(r) => (r.kv, r.reused),
        None => (llama.new_cache(), 0),
    };
    let mut logits = None;
    let mut pos = cached_tokens;
    while pos < prompt.len() {
        // A long prefill is cancellable between chunks too.
        if cancelled() {
            return Ok(GenerateSummary {
                finish_reason: FinishReason::Cancelled,
                prompt_tokens: prompt.len(),
                cached_tokens,
                completion_tokens: 0,
                prefill: started.elapsed(),
                decode: Duration::ZERO,
                plugin_time: chain.chain_time(),
            });
        }
        let end = (pos + PREFILL_CHUNK).min(prompt.len());
        let last = end == prompt.len();
        let chunk = &prompt[pos..end];
        let out = llama.forward(&mut [RowInput {
            tokens: chunk,
            cache: &mut cache,
            logits_from: if last { chunk.len() - 1 } else { chunk.len() },
        }])?;
        if last {
            logits = out.into_iter().next();
        } else {
            eval(cache.arrays())?;
        }
        pos = end;
    }
    let mut logits =
        logits.ok_or_else(|| GenerateError::Internal("prefill produced no logits".into()))?;
    let mut arrays = vec![&logits];
    arrays.extend(cache.arrays());
    eval(arrays)?;
    let prefill = started.elapsed();

    let decode_started = Instant::now();
    let max_new = req.max_tokens.min(context - prompt.len());
    let mut ids = prompt.clone();
    let mut detok = Detokenizer::with_context(&prompt[prompt.len().saturating_sub(5)..]);
    let mut stops = StopMatcher::new(&req.stop);
    let mut finish = FinishReason::Length;
    let mut generated = 0usize;
    let mut stopped_by_string = false;
    while generated < max_new {
        if cancelled() {
            finish = FinishReason::Cancelled;
            break;
        }
        let row_logits = logits.index(0);
        let out = chain.step(row_logits.clone(), &ids, prompt.len(), generated as u32)?;
        let raw_lp = mlx_rs::nn::log_softmax(&row_logits, -1)?;
        let sampled_lp = mlx_rs::nn::log_softmax(&out.final_logits, -1)?;
        let token_arr = match &out.token {
            Chosen::Device(a) => a.reshape(&[1])?,
            Chosen::Host(id) => Array::from_slice(&[*id], &[1]),
        };
        let raw_at = raw_lp.take_axis(&token_arr, -1)?;
        let sampled_at = sampled_lp.take_axis(&token_arr, -1)?;
        let top = if req.top_logprobs > 0 {
            Some(crate::logprobs::top_k(
                &raw_lp,
                req.top_logprobs.min(vocab) as i32,
            )?)
        } else {
            None
        };
        let mut to_eval = vec![&token_arr, &raw_at, &sampled_at];
        if let Some((i, v)) = &top {
            to_eval.extend([i, v]);
        }
        eval(to_eval)?;
        let token_arr = token_arr.as_dtype(Dtype::Uint32)?;
        let id = token_arr
            .try_item_cast::<u32>()
            .map_err(|e| GenerateError::Internal(format!("reading the chosen token: {e}")))?;
        if id as usize >= vocab {
            return Err(PluginError::Failed {
                plugin: chain.sampler_name().to_string(),
                cause: format!("returned token id {id}, outside the vocabulary (size {vocab})"),
            }
            .into());
        }
        let raw = raw_at.try_item_cast::<f32>().unwrap_or(f32::NAN);
        let sampled = sampled_at.try_item_cast::<f32>().unwrap_or(f32::NAN);
        chain.accept(id, raw, sampled)?;
        generated += 1;
        let mut top_pairs = Vec::new();
        if let Some((i, v)) = &top {
            top_pairs = crate::logprobs::sorted_pairs(
                i.try_as_slice::<u32>().unwrap_or(&[]),
                v.try_as_slice::<f32>().unwrap_or(&[]),
            );
        }
        on_event(GenerateEvent::Token(TokenInfo {
            id,
            logprob: raw,
            top: top_pairs,
        }));
        if model.eos_ids.contains(&id) {
            finish = FinishReason::Stop;
            break;
        }
        ids.push(id);
        let delta = detok.push(&model.tokenizer, id)?;
        if !delta.is_empty() {
            let fed = stops.feed(&delta);
            if !fed.emit.is_empty() {
                on_event(GenerateEvent::Text(fed.emit));
            }
            if fed.stopped {
                finish = FinishReason::Stop;
                stopped_by_string = true;
                break;
            }
        }
        if generated >= max_new {
            break;
        }
        let next = llama.forward(&mut [RowInput {
            tokens: &[id],
            cache: &mut cache,
            logits_from: 0,
        }])?;
        logits = next
            .into_iter()
            .next()
            .ok_or_else(|| GenerateError::Internal("the decode step produced no logits".into()))?;
        // Evaluate the forward before the plugins run, so a plugin that reads
        // back pays only for its own work inside its deadline.
        eval([&logits])?;
    }
    // Text held back (an incomplete character, a possible stop-string
    // prefix) is real output unless a stop string ended generation.
    if !stopped_by_string {
        let tail = detok.flush(&model.tokenizer)?;
        let mut rest = stops.feed(&tail);
        if rest.stopped {
            finish = FinishReason::Stop;
        } else {
            rest.emit.push_str(&stops.flush());
        }
        if !rest.emit.is_empty() {
            on_event(GenerateEvent::Text(rest.emit));
        }
    }
    if let Some(c) = prompt_cache {
        // The KV holds exactly the tokens fed so far (the last sampled token
        // is never fed).
        let fed = cache.offset().min(ids.len());
        c.insert(&namespace, ids[..fed].to_vec(), cache);
    }
    Ok(GenerateSummary {
        finish_reason: finish,
        prompt_tokens: prompt.len(),
        cached_tokens,
        completion_tokens: generated,
        prefill,
        decode: decode_started.elapsed(),
        plugin_time: chain.chain_time(),
    })
}

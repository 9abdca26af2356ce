//! Canonical generation request (from an adapter) -> engine request:
//! server defaults applied, chat template rendered, prompt tokenized, and
//! every limit checked before the job is queued (`semantics.md`).

use crate::engine::GenerateRequest;
use crate::model::ChatMessage;
use crate::plugin::{Kind, PluginHost, SamplingParams};

use super::adapter::{ApiError, ErrorKind, GenerationRequest};
use crate::engine::worker::Frontend;

/// Server-side defaults, from `mlxhost serve` flags.
#[derive(Debug, Clone)]
pub struct Defaults {
    /// Used when a request omits `temperature`.
    pub temperature: f32,
    /// Used when a request omits `top_p`.
    pub top_p: f32,
    /// Used when a request omits `top_k`.
    pub top_k: u32,
    /// Used when a request omits `min_p`.
    pub min_p: f32,
    /// Used when a request omits `seed`.
    pub seed: Option<u64>,
    /// Cap on generated tokens when a request omits `max_tokens`.
    pub max_tokens: usize,
    /// Sampler plugin when a request omits `sampler`.
    pub sampler: String,
    /// System message added when a request has none.
    pub system: Option<String>,
}

/// The processors the host inserts for standard fields, in `semantics.md`'s
/// fixed order: (request field, first-party plugin name).
pub const STANDARD_PROCESSORS: [(&str, &str); 4] = [
    ("logit_bias", "logit-bias"),
    ("repetition_penalty", "repetition-penalty"),
    ("presence_penalty", "presence-penalty"),
    ("frequency_penalty", "frequency-penalty"),
];

/// A request ready for the engine.
#[derive(Debug)]
pub struct Prepared {
    /// What the engine runs.
    pub request: GenerateRequest,
    /// Stream as SSE.
    pub stream: bool,
    /// Report per-token logprobs.
    pub logprobs: bool,
}

fn bad(param: Option<&str>, message: impl Into<String>) -> ApiError {
    ApiError {
        status: 400,
        kind: ErrorKind::InvalidRequest,
        message: message.into(),
        param: param.map(str::to_string),
    }
}

/// Validates `g` and builds the engine request. Errors are 400s naming the
/// field: unknown plugins, token ids outside the vocabulary, a prompt over
/// the context, `max_tokens` that does not fit, bad `plugin_params`.
pub fn prepare(
    g: GenerationRequest,
    frontend: &Frontend,
    plugins: &PluginHost,
    defaults: &Defaults,
) -> Result<Prepared, ApiError> {
    let s = &g.sampling;
    let logit_bias = s.logit_bias.clone();
    if let Some((id, _)) = logit_bias
        .iter()
        .find(|(id, _)| *id as usize >= frontend.vocab)
    {
        return Err(bad(
            Some("logit_bias"),
            format!(
                "token id {id} in `logit_bias` is outside the vocabulary (size {})",
                frontend.vocab
            ),
        ));
    }
    let params = SamplingParams {
        temperature: s.temperature.unwrap_or(defaults.temperature),
        top_p: s.top_p.unwrap_or(defaults.top_p),
        top_k: s.top_k.unwrap_or(defaults.top_k),
        min_p: s.min_p.unwrap_or(defaults.min_p),
        xtc_probability: s.xtc_probability.unwrap_or(0.0),
        xtc_threshold: s.xtc_threshold.unwrap_or(0.0),
        seed: s.seed.or(defaults.seed),
        xtc_special_ids: Vec::new(),
        repetition_penalty: s.repetition_penalty.unwrap_or(1.0),
        repetition_context_size: s.repetition_context_size.unwrap_or(20),
        presence_penalty: s.presence_penalty.unwrap_or(0.0),
        frequency_penalty: s.frequency_penalty.unwrap_or(0.0),
        logit_bias,
    };

    // The chain: standard processors for the fields set, then the request's.
    let wanted = [
        !params.logit_bias.is_empty(),
        params.repetition_penalty != 1.0,
        params.presence_penalty != 0.0,
        params.frequency_penalty != 0.0,
    ];
    let mut processors = Vec::new();
    for ((field, plugin), on) in STANDARD_PROCESSORS.iter().zip(wanted) {
        if !on {
            continue;
        }
        if plugins.get(plugin, Kind::LogitsProcessor).is_err() {
            return Err(bad(
                Some(field),
                format!(
                    "`{field}` needs the `{plugin}` logits processor plugin, which is not loaded"
                ),
            ));
        }
        processors.push(plugin.to_string());
    }
    for name in &g.logits_processors {
        plugins
            .get(name, Kind::LogitsProcessor)
            .map_err(|e| bad(Some("logits_processors"), e.to_string()))?;
        processors.push(name.clone());
    }
    let sampler = g
        .sampler
        .clone()
        .unwrap_or_else(|| defaults.sampler.clone());
    plugins
        .get(&sampler, Kind::Sampler)
        .map_err(|e| bad(Some("sampler"), e.to_string()))?;
    let plugin_params: serde_json::Value = serde_json::from_str(&g.plugin_params).map_err(|e| {
        bad(
            Some("plugin_params"),
            format!("`plugin_params` is not valid JSON: {e}"),
        )
    })?;
    let Some(by_plugin) = plugin_params.as_object() else {
        return Err(bad(
            Some("plugin_params"),
            "`plugin_params` must be an object keyed by plugin name",
        ));
    };
    if let Some(name) = by_plugin
        .keys()
        .find(|k| **k != sampler && !processors.contains(k))
    {
        return Err(bad(
            Some("plugin_params"),
            format!("`plugin_params.{name}`: no plugin named `{name}` is in this request's chain"),
        ));
    }

    let prompt_ids = prompt_ids(&g, frontend, defaults)?;
    let context = frontend.context;
    if prompt_ids.len() >= context {
        return Err(bad(
            Some("messages"),
            format!(
                "this model's maximum context length is {context} tokens; the messages are {} tokens",
                prompt_ids.len()
            ),
        ));
    }
    let room = context - prompt_ids.len();
    let max_tokens = match g.max_tokens {
        Some(n) if n as usize > room => {
            return Err(bad(
                Some("max_tokens"),
                format!(
                    "max_tokens is {n}, but the prompt is {} tokens and the context {context}: at most {room} can be generated",
                    prompt_ids.len()
                ),
            ))
        }
        Some(n) => n as usize,
        None => room.min(defaults.max_tokens),
    };
    Ok(Prepared {
        request: GenerateRequest {
            prompt_ids,
            max_tokens,
            stop: g.stop.clone(),
            params,
            sampler,
            processors,
            plugin_params,
            top_logprobs: if g.logprobs {
                g.top_logprobs as usize
            } else {
                0
            },
        },
        stream: g.stream,
        logprobs: g.logprobs,
    })
}

/// Renders the chat template (with the server's system message when the
/// request has none) and tokenizes.
fn prompt_ids(
    g: &GenerationRequest,
    frontend: &Frontend,
    defaults: &Defaults,
) -> Result<Vec<u32>, ApiError> {
    let template = frontend
        .template
        .as_ref()
        .ok_or_else(|| bad(Some("messages"), "this model has no chat template"))?;
    let mut messages: Vec<ChatMessage> = Vec::with_capacity(g.messages.len() + 1);
    if let Some(system) = &defaults.system {
        if !g.messages.iter().any(|m| m.role == "system") {
            messages.push(ChatMessage {
                role: "system".into(),
                content: system.clone(),
            });
        }
    }
    messages.extend(g.messages.iter().map(|m| ChatMessage {
        role: m.role.clone(),
        content: m.content.clone(),
    }));
    let text = template.render(&messages, true).map_err(|e| {
        bad(
            Some("messages"),
            format!("the chat template rejected the messages: {e}"),
        )
    })?;
    frontend
        .tokenizer
        .encode(&text)
        .map_err(|e| bad(Some("messages"), e.to_string()))
}

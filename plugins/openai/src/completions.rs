//! `POST /v1/completions`: OpenAI's legacy Completions API (OpenAI API
//! reference, "Create completion") on the canonical request's `text` and
//! `token-ids` prompts. The host tokenizes a text prompt as is (no chat
//! template, no BOS) and checks token ids against the vocabulary; output
//! parsing is off (`tool_parser` and `reasoning_parser` "none"), so the
//! model's raw text comes back.
//!
//! Request fields: `model` (ignored), `prompt` (a string, an array of one
//! string, an array of token ids, or an array of one array of token ids),
//! `max_tokens` (default 16, as OpenAI), `temperature`, `top_p`, `n` (1),
//! `best_of` (1), `stream`, `stream_options.include_usage`, `logprobs` (an
//! integer in [0, 5]: that many alternatives per token, plus the sampled
//! token), `echo`, `stop`, `presence_penalty`, `frequency_penalty`,
//! `logit_bias`, `seed`, `user` (ignored), `suffix` (only empty), and the
//! extensions the chat adapter accepts (`top_k`, `min_p`, `xtc_*`,
//! `repetition_*`, `sampler`, `logits_processors`, `plugin_params`,
//! `return_tokens_as_token_ids`).
//!
//! Deviations from OpenAI (each a 400 naming the field):
//! - several prompts, `n > 1`, `best_of > 1`: the host runs one generation
//!   per request;
//! - `suffix` (insertion) is not supported;
//! - `echo` with a token-id prompt (the adapter never sees the prompt's
//!   text) and `echo` with `logprobs` (prompt logprobs are not computed);
//! - `max_tokens: 0` (OpenAI's "echo only" request) and an empty prompt.

use mlxhost_plugin_sdk::v2::adapter::exports::mlxhost::plugin::api_adapter::{
    GenerationUpdate, RequestContext, TokenLogprob,
};
use mlxhost_plugin_sdk::v2::adapter::mlxhost::plugin::request::{
    GenerationRequest, Prompt, ToolChoice,
};
use mlxhost_plugin_sdk::v2::adapter::mlxhost::plugin::types::GenerationEvent;
use serde_json::{json, Map, Value};

use crate::render;
use crate::request::{self, invalid, Endpoint, Fields, Invalid, RenderOptions};

/// OpenAI's default `max_tokens` for Completions.
pub const DEFAULT_MAX_TOKENS: u32 = 16;
/// OpenAI's largest `logprobs` for Completions.
pub const MAX_LOGPROBS: u32 = 5;

/// Parses and validates a Completions request body.
pub fn parse(body: &[u8]) -> Result<(GenerationRequest, RenderOptions), Invalid> {
    let value: Value = serde_json::from_slice(body).map_err(|e| Invalid {
        message: format!("the request body is not valid JSON: {e}"),
        param: None,
    })?;
    let obj = value.as_object().ok_or_else(|| Invalid {
        message: "the request body must be a JSON object".into(),
        param: None,
    })?;
    let f = Fields(obj);
    f.string("model")?;
    f.string("user")?;
    let prompt = parse_prompt(obj)?;
    let constraint = mlxhost_plugin_sdk::structured::vllm_structured_outputs(obj)
        .map_err(crate::request::lift)?;
    if let Some(n) = f.uint("n")? {
        if n != 1 {
            return Err(invalid(
                "n",
                format!("only n=1 is supported (one generation per request), got {n}"),
            ));
        }
    }
    if let Some(b) = f.uint("best_of")? {
        if b != 1 {
            return Err(invalid(
                "best_of",
                format!("only best_of=1 is supported (one generation per request), got {b}"),
            ));
        }
    }
    match f.string("suffix")? {
        Some(s) if !s.is_empty() => {
            return Err(invalid("suffix", "`suffix` is not supported"));
        }
        _ => {}
    }
    let max_tokens = f.uint("max_tokens")?.unwrap_or(DEFAULT_MAX_TOKENS);
    if max_tokens == 0 {
        return Err(invalid("max_tokens", "`max_tokens` must be at least 1"));
    }
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = request::include_usage(obj)?;
    let top_logprobs = f.uint("logprobs")?;
    if let Some(n) = top_logprobs {
        if n > MAX_LOGPROBS {
            return Err(invalid(
                "logprobs",
                format!("`logprobs` must be an integer in [0, {MAX_LOGPROBS}], got {n}"),
            ));
        }
    }
    let logprobs = top_logprobs.is_some();
    let echo = f.bool("echo")?.unwrap_or(false);
    let echo = if echo {
        if logprobs {
            return Err(invalid(
                "echo",
                "`echo` with `logprobs` is not supported (prompt logprobs are not computed)",
            ));
        }
        match &prompt {
            Prompt::Text(t) => Some(t.clone()),
            _ => return Err(invalid("echo", "echo needs a text prompt, not token ids")),
        }
    } else {
        None
    };
    let sampling = request::sampling(obj)?;
    let stop = request::stop(obj)?;
    let sampler = f.string("sampler")?;
    let logits_processors = request::logits_processors(obj)?;
    let plugin_params = request::plugin_params(obj)?;
    let tokens_as_ids = f.bool("return_tokens_as_token_ids")?.unwrap_or(false);
    Ok((
        GenerationRequest {
            prompt,
            sampling,
            max_tokens: Some(max_tokens),
            // An upper bound, as llama.cpp's server and our other dialects
            // treat it (opencode sends 32000 whatever the context); the
            // host's `--strict-max-tokens` restores OpenAI's 400.
            clamp_max_tokens: true,
            stop,
            stream,
            logprobs,
            top_logprobs: top_logprobs.unwrap_or(0),
            tools: Vec::new(),
            tool_choice: ToolChoice::None,
            parallel_tool_calls: false,
            tool_parser: Some("none".into()),
            reasoning_parser: Some("none".into()),
            chat_template_kwargs: "{}".into(),
            sampler,
            logits_processors,
            plugin_params,
            include_usage,
            previous_response_id: None,
        },
        RenderOptions {
            endpoint: Endpoint::Completions,
            logprobs,
            include_usage,
            tokens_as_ids,
            echo,
            offsets: Offsets::default(),
            constraint,
            strict_tools: Vec::new(),
            speculative: mlxhost_plugin_sdk::speculative::speculative(obj)
                .map_err(crate::request::lift)?,
        },
    ))
}

/// `prompt`: `"text"`, `["text"]`, `[id, ...]` or `[[id, ...]]`.
fn parse_prompt(obj: &Map<String, Value>) -> Result<Prompt, Invalid> {
    const P: &str = "prompt";
    let shape = "`prompt` must be a string, an array of one string, an array of token ids or an array of one array of token ids";
    let one = "only one prompt per request is supported";
    let prompt = match obj.get(P) {
        None | Some(Value::Null) => return Err(invalid(P, "`prompt` is required")),
        Some(Value::String(s)) => Prompt::Text(s.clone()),
        Some(Value::Array(items)) => match items.as_slice() {
            [] => return Err(invalid(P, "the prompt is empty")),
            [Value::String(s)] => Prompt::Text(s.clone()),
            [Value::Array(ids)] => Prompt::TokenIds(token_ids(ids, "prompt[0]")?),
            [Value::Number(_), ..] => Prompt::TokenIds(token_ids(items, "prompt")?),
            [Value::String(_) | Value::Array(_), rest @ ..]
                if rest.iter().all(|v| v.is_string() || v.is_array()) =>
            {
                return Err(invalid(
                    P,
                    format!("{one}, got a list of {} prompts", items.len()),
                ))
            }
            _ => return Err(invalid(P, shape)),
        },
        Some(_) => return Err(invalid(P, shape)),
    };
    match &prompt {
        Prompt::Text(t) if t.is_empty() => Err(invalid(P, "the prompt is empty")),
        Prompt::TokenIds(ids) if ids.is_empty() => Err(invalid(P, "the prompt is empty")),
        _ => Ok(prompt),
    }
}

fn token_ids(items: &[Value], at: &str) -> Result<Vec<u32>, Invalid> {
    items
        .iter()
        .enumerate()
        .map(|(k, v)| {
            v.as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| {
                    invalid(
                        "prompt",
                        format!("`{at}[{k}]` must be a token id (a non-negative integer), got {v}"),
                    )
                })
        })
        .collect()
}

/// Where the next token starts in the text so far, in code points (Python
/// string indices, as OpenAI's `text_offset`). A token may end inside a
/// UTF-8 character: its incomplete bytes wait in `pending`, and the next
/// token starts where that character starts.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Offsets {
    pub offset: usize,
    pub pending: Vec<u8>,
}

impl Offsets {
    /// The offset of a token with these bytes; advances past it.
    pub(crate) fn advance(&mut self, bytes: &[u8]) -> usize {
        let at = self.offset;
        self.pending.extend_from_slice(bytes);
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    self.offset += s.chars().count();
                    self.pending.clear();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    self.offset += std::str::from_utf8(&self.pending[..valid])
                        .map(|s| s.chars().count())
                        .unwrap_or(0);
                    match e.error_len() {
                        // Incomplete at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..valid);
                            break;
                        }
                        // Invalid bytes: one replacement character each run.
                        Some(n) => {
                            self.offset += 1;
                            self.pending.drain(..valid + n);
                        }
                    }
                }
            }
        }
        at
    }
}

/// The legacy `logprobs` object for `tokens` (null when not requested):
/// `tokens`, `token_logprobs`, `top_logprobs` (per token a map of the
/// alternatives and the sampled token to their logprobs) and `text_offset`.
pub fn logprobs(opts: &RenderOptions, offsets: &mut Offsets, tokens: &[TokenLogprob]) -> Value {
    if !opts.logprobs {
        return Value::Null;
    }
    let name = |token: &str, id: u32| {
        if opts.tokens_as_ids {
            format!("token_id:{id}")
        } else {
            token.to_string()
        }
    };
    let mut names = Vec::with_capacity(tokens.len());
    let mut values = Vec::with_capacity(tokens.len());
    let mut tops = Vec::with_capacity(tokens.len());
    let mut text_offset = Vec::with_capacity(tokens.len());
    for t in tokens {
        let token = name(&t.token, t.id);
        let mut top = Map::new();
        for a in &t.top {
            top.entry(name(&a.token, a.id)).or_insert(json!(a.logprob));
        }
        // As OpenAI: the sampled token is always among them.
        top.entry(token.clone()).or_insert(json!(t.logprob));
        names.push(Value::String(token));
        values.push(json!(t.logprob));
        tops.push(Value::Object(top));
        text_offset.push(json!(offsets.advance(&t.bytes)));
    }
    json!({
        "tokens": names,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": text_offset,
    })
}

/// The visible text of events: text, invalid calls and reasoning, in order
/// (with the parsers off only `text` comes).
pub fn text(events: &[GenerationEvent]) -> String {
    let mut out = String::new();
    for e in events {
        match e {
            GenerationEvent::Text(t)
            | GenerationEvent::InvalidCall(t)
            | GenerationEvent::Reasoning(t) => out.push_str(t),
            _ => {}
        }
    }
    out
}

fn completion_id(ctx: &RequestContext) -> String {
    format!("cmpl-{}", ctx.request_id)
}

/// A whole `text_completion` object.
pub fn completion(ctx: &RequestContext, opts: &RenderOptions, update: &GenerationUpdate) -> Value {
    let mut text = opts.echo.clone().unwrap_or_default();
    text.push_str(&self::text(&update.events));
    let mut offsets = Offsets::default();
    json!({
        "id": completion_id(ctx),
        "object": "text_completion",
        "created": ctx.created,
        "model": ctx.model_id,
        "system_fingerprint": null,
        "choices": [{
            "text": text,
            "index": 0,
            "logprobs": logprobs(opts, &mut offsets, &update.logprobs),
            "finish_reason": update.finish.map(render::finish_reason).unwrap_or("stop"),
        }],
        "usage": update.usage.as_ref().map(render::usage).unwrap_or(Value::Null),
    })
}

fn chunk(
    ctx: &RequestContext,
    opts: &RenderOptions,
    text: String,
    logprobs: Value,
    finish: Value,
) -> String {
    let mut c = json!({
        "id": completion_id(ctx),
        "object": "text_completion",
        "created": ctx.created,
        "model": ctx.model_id,
        "system_fingerprint": null,
        "choices": [{ "text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish }],
    });
    if opts.include_usage {
        // As chat: `usage: null` on every chunk but the usage chunk.
        c["usage"] = Value::Null;
    }
    c.to_string()
}

/// The chunks of one streamed update: its text (the echoed prompt first on
/// sequence 0) with its tokens' logprobs, when there is either; on the last
/// update a chunk with `finish_reason`, the usage chunk (`choices: []`,
/// when asked) and `[DONE]`. The usage the first update carries is not
/// rendered. `opts.offsets` carries `text_offset` across updates.
pub fn stream_chunks(
    ctx: &RequestContext,
    opts: &mut RenderOptions,
    update: &GenerationUpdate,
) -> Vec<String> {
    let mut out = Vec::new();
    let mut text = String::new();
    if update.sequence == 0 {
        if let Some(prompt) = &opts.echo {
            text.push_str(prompt);
        }
    }
    text.push_str(&self::text(&update.events));
    let has_logprobs = opts.logprobs && !update.logprobs.is_empty();
    if !text.is_empty() || has_logprobs {
        let mut offsets = std::mem::take(&mut opts.offsets);
        let lp = logprobs(opts, &mut offsets, &update.logprobs);
        opts.offsets = offsets;
        out.push(chunk(ctx, opts, text, lp, Value::Null));
    }
    if let Some(f) = update.finish {
        out.push(chunk(
            ctx,
            opts,
            String::new(),
            Value::Null,
            json!(render::finish_reason(f)),
        ));
        if opts.include_usage {
            if let Some(u) = &update.usage {
                out.push(
                    json!({
                        "id": completion_id(ctx),
                        "object": "text_completion",
                        "created": ctx.created,
                        "model": ctx.model_id,
                        "system_fingerprint": null,
                        "choices": [],
                        "usage": render::usage(u),
                    })
                    .to_string(),
                );
            }
        }
        out.push("[DONE]".into());
    }
    out
}

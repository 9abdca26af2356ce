//! Canonical generation request (from an adapter, WIT 0.2.0's request
//! model) -> engine request plus its output pipeline: server defaults
//! applied, parsers chosen, chat template rendered (with tools and
//! template keyword arguments), `tool_choice` enforced, prompt tokenized,
//! and every limit checked before the job is queued (`semantics.md`).

use std::sync::Arc;

use super::strict_tools::CallAlternative;
use crate::engine::GenerateRequest;
use crate::model::TemplateMessage;
use crate::output::{choose_parser, OutputPipeline, ParserSession};
use crate::plugin::constraint::ConstraintRequest;
use crate::plugin::{Kind, PluginHost, SamplingParams};

use super::adapter::{ApiError, ContentPart, ErrorKind, GenerationRequest, Prompt, ToolChoice};
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
    /// Tool-call parser when a request names none (`--tool-parser`;
    /// `None` = from the chat template, `"none"` = off).
    pub tool_parser: Option<String>,
    /// Reasoning parser when a request names none (`--reasoning-parser`).
    pub reasoning_parser: Option<String>,
    /// Most characters of prompt text tokenized per request
    /// (`--max-prompt-chars`); 0 = [`CHARS_PER_CONTEXT_TOKEN`] per token of
    /// the model's context. Checked before tokenizing, which costs about
    /// 85 bytes of memory per character (measured on a 31.5 MB prompt).
    pub max_prompt_chars: usize,
    /// `--strict-max-tokens`: a `max_tokens` over the room the prompt
    /// leaves is a 400 even where the adapter asks for it to be clamped.
    pub strict_max_tokens: bool,
    /// `--keep-prompt-metadata`: adapters keep client metadata verbatim
    /// (the host sets [`KEEP_METADATA_HEADER`] on every request).
    pub keep_prompt_metadata: bool,
    /// `--grammar-plugin`: the constraint plugin for structured output when
    /// a request names none.
    pub grammar_plugin: String,
    /// `--drafter`: speculative decoding's drafter when a request names
    /// none (`None`: off).
    pub drafter: Option<String>,
    /// `--draft-max`: the most drafts per step when a request does not say.
    pub draft_max: usize,
    /// `--draft-model` is loaded: requests may choose the `draft-model`
    /// drafter beside the drafter plugins.
    pub draft_model: bool,
}

/// The request header that tells an adapter to keep client metadata in the
/// prompt (`true`); set by the host under `--keep-prompt-metadata`, or by a
/// client for its own requests.
pub const KEEP_METADATA_HEADER: &str = "x-mlxhost-keep-metadata";

/// The default prompt-character bound per token of context: a prompt of
/// more characters than this per context token cannot fit the context
/// unless its tokens average more than 32 characters, which no text a
/// client sends does (English prose averages ~4, code ~3).
pub const CHARS_PER_CONTEXT_TOKEN: usize = 32;

/// The most prompt characters a request may have tokenized.
pub fn max_prompt_chars(frontend: &Frontend, defaults: &Defaults) -> usize {
    match defaults.max_prompt_chars {
        0 => frontend.context.saturating_mul(CHARS_PER_CONTEXT_TOKEN),
        n => n,
    }
}

/// Refuses a prompt of more than [`max_prompt_chars`] characters before it
/// is tokenized (or, for messages, rendered): a 400 naming the limit.
fn check_prompt_chars(
    chars: usize,
    field: &str,
    frontend: &Frontend,
    defaults: &Defaults,
) -> Result<(), ApiError> {
    let limit = max_prompt_chars(frontend, defaults);
    if chars <= limit {
        return Ok(());
    }
    let why = match defaults.max_prompt_chars {
        0 => format!(
            "{CHARS_PER_CONTEXT_TOKEN} per token of this model's {}-token context",
            frontend.context
        ),
        _ => "the server's limit".to_string(),
    };
    Err(bad(
        Some(field),
        format!(
            "the prompt has {chars} characters; at most {limit} are tokenized ({why}; --max-prompt-chars)"
        ),
    ))
}

/// Most logits-processor plugins one request may name (`logits_processors`).
pub const MAX_LOGITS_PROCESSORS: usize = 32;

/// Most stop sequences one request may give (`stop`; OpenAI allows 4,
/// Anthropic more).
pub const MAX_STOP_SEQUENCES: usize = 64;

/// The processors the host inserts for standard fields, in `semantics.md`'s
/// fixed order: (request field, first-party plugin name).
pub const STANDARD_PROCESSORS: [(&str, &str); 4] = [
    ("logit_bias", "logit-bias"),
    ("repetition_penalty", "repetition-penalty"),
    ("presence_penalty", "presence-penalty"),
    ("frequency_penalty", "frequency-penalty"),
];

/// A request ready for the engine.
pub struct Prepared {
    /// What the engine runs.
    pub request: GenerateRequest,
    /// Stream as SSE.
    pub stream: bool,
    /// Report per-token logprobs.
    pub logprobs: bool,
    /// The request's output stages.
    pub pipeline: OutputPipeline,
    /// Reply text the host forced (prefilled after the prompt) to enforce
    /// `tool_choice`; it is output, so the pipeline sees it first.
    pub forced: Option<String>,
    /// `parallel_tool_calls: false` with tools: the reply ends after its
    /// first complete call.
    pub single_call: bool,
    /// The grammar the output must match (structured output), if any.
    pub constraint: Option<ConstraintRequest>,
    /// When the reply must be a tool call: the functions it may call, with
    /// the rest of each one's call prefix after the prefilled text.
    pub call_alternatives: Vec<CallAlternative>,
    /// The request's tools (for strict tools' schemas).
    pub tools: Vec<crate::output::ToolDefinition>,
}

/// `p` with the output constraint its adapter attached, and its strict
/// tools enforced: when the reply must be a tool call and one of the tools
/// it may call is in `strict_tools`, a grammar over the call syntax
/// ([`super::strict_tools`]) replaces the first-token mask, where the
/// constraint plugin (`--grammar-plugin`) is loaded. Errors: a 400 when an
/// output constraint comes with a forced tool call (`tool_choice`
/// `required` or named), which the grammar would have to describe too.
pub fn constrained(
    mut p: Prepared,
    constraint: Option<ConstraintRequest>,
    strict_tools: &[String],
    plugins: &PluginHost,
    defaults: &Defaults,
) -> Result<Prepared, ApiError> {
    // Parameters for a constraint plugin this request does not run are a
    // mistake, as for parsers.
    let runs = constraint.as_ref().map(|c| c.plugin.clone()).or_else(|| {
        strict_tools
            .first()
            .map(|_| defaults.grammar_plugin.clone())
    });
    if let Some(name) = p.request.plugin_params.as_object().and_then(|m| {
        m.keys().find(|k| {
            plugins.get(k, Kind::Constraint).is_ok() && runs.as_deref() != Some(k.as_str())
        })
    }) {
        return Err(bad(
            Some("plugin_params"),
            format!("`plugin_params.{name}`: the `{name}` constraint plugin does not run for this request (it asks for no structured output)"),
        ));
    }
    if let Some(c) = &constraint {
        if p.forced.is_some() || !p.request.forced_choices.is_empty() {
            return Err(bad(
                Some(&c.field),
                format!(
                    "`{}` cannot be combined with `tool_choice` `required` or a named function: the reply must be a tool call",
                    c.field
                ),
            ));
        }
        p.constraint = constraint;
        return Ok(p);
    }
    let plugin = &defaults.grammar_plugin;
    if strict_tools.is_empty() || plugins.get(plugin, Kind::Constraint).is_err() {
        return Ok(p);
    }
    let prefilled = p.forced.clone().unwrap_or_default();
    let grammar =
        super::strict_tools::call_grammar(&prefilled, &p.call_alternatives, &p.tools, strict_tools)
            .map_err(|e| bad(Some("tools"), e))?;
    if let Some(grammar) = grammar {
        p.request.forced_choices.clear();
        p.constraint = Some(ConstraintRequest {
            plugin: plugin.clone(),
            grammar,
            field: "tools".into(),
        });
    }
    Ok(p)
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
    plugins: &Arc<PluginHost>,
    defaults: &Defaults,
) -> Result<Prepared, ApiError> {
    if g.previous_response_id.is_some() {
        return Err(bad(
            Some("previous_response_id"),
            "this server keeps no stored responses",
        ));
    }
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
    // Each processor is a plugin instance per row from a shared pool: a
    // client-chosen count must stay far from the pool's limits.
    if g.logits_processors.len() > MAX_LOGITS_PROCESSORS {
        return Err(bad(
            Some("logits_processors"),
            format!(
                "`logits_processors` names {} plugins; at most {MAX_LOGITS_PROCESSORS} per request",
                g.logits_processors.len()
            ),
        ));
    }
    if g.stop.len() > MAX_STOP_SEQUENCES {
        return Err(bad(
            Some("stop"),
            format!(
                "`stop` has {} sequences; at most {MAX_STOP_SEQUENCES} per request",
                g.stop.len()
            ),
        ));
    }
    for name in &g.logits_processors {
        plugins
            .get(name, Kind::LogitsProcessor)
            .map_err(|e| bad(Some("logits_processors"), e.to_string()))?;
        processors.push(name.clone());
    }
    let sampler = match &g.sampler {
        Some(named) => {
            plugins
                .get(named, Kind::Sampler)
                .map_err(|e| bad(Some("sampler"), e.to_string()))?;
            named.clone()
        }
        // The server's default is the operator's choice, not the client's:
        // when it is gone (removed or broken on disk and never loaded) the
        // server cannot serve such requests, a 503 naming the cause.
        None => {
            plugins
                .get(&defaults.sampler, Kind::Sampler)
                .map_err(|e| ApiError {
                    status: 503,
                    kind: ErrorKind::Server,
                    message: format!(
                        "the server's default sampler is unavailable (--sampler {}): {e}",
                        defaults.sampler
                    ),
                    param: None,
                })?;
            defaults.sampler.clone()
        }
    };
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
    // Parsers are chosen below, and a constraint plugin by the adapter
    // (structured output): their parameters may be given too.
    let is_parser = |k: &str| {
        plugins.get(k, Kind::ToolCallParser).is_ok()
            || plugins.get(k, Kind::ReasoningParser).is_ok()
            || plugins.get(k, Kind::Constraint).is_ok()
            || plugins.get(k, Kind::Drafter).is_ok()
    };
    if let Some(name) = by_plugin
        .keys()
        .find(|k| **k != sampler && !processors.contains(k) && !is_parser(k))
    {
        return Err(bad(
            Some("plugin_params"),
            format!("`plugin_params.{name}`: no plugin named `{name}` is in this request's chain"),
        ));
    }

    let kwargs = template_kwargs(&g)?;
    let tools_on = tools_on(&g);
    if let ToolChoice::Named(name) = &g.tool_choice {
        if !g.tools.iter().any(|t| &t.name == name) {
            return Err(bad(
                Some("tool_choice"),
                format!("`tool_choice` names function `{name}`, which is not in `tools`"),
            ));
        }
    }
    if matches!(g.tool_choice, ToolChoice::Required) && g.tools.is_empty() {
        return Err(bad(
            Some("tool_choice"),
            "`tool_choice` is `required` but no `tools` are given",
        ));
    }

    let template_source = frontend.template.as_ref().map(|t| t.source());
    let (mut prompt_ids, prompt_text) = prompt_ids(&g, &kwargs, tools_on, frontend, defaults)?;
    let reasoning = match choose_parser(
        g.reasoning_parser.as_deref(),
        defaults.reasoning_parser.as_deref(),
        template_source,
        plugins,
        Kind::ReasoningParser,
    ) {
        Some(name) => Some(
            ParserSession::reasoning_parser(plugins.clone(), &name, &prompt_text, &plugin_params)
                .map_err(|e| parser_error("reasoning_parser", e))?,
        ),
        None => None,
    };
    let tool_parser = if tools_on {
        match choose_parser(
            g.tool_parser.as_deref(),
            defaults.tool_parser.as_deref(),
            template_source,
            plugins,
            Kind::ToolCallParser,
        ) {
            Some(name) => Some(
                ParserSession::tool_parser(
                    plugins.clone(),
                    &name,
                    &g.tools,
                    g.parallel_tool_calls,
                    &plugin_params,
                )
                .map_err(|e| parser_error("tool_parser", e))?,
            ),
            None => None,
        }
    } else {
        None
    };
    // Parameters for a parser this request does not run are a mistake.
    let running = |k: &str| {
        reasoning.as_ref().is_some_and(|p| p.name() == k)
            || tool_parser.as_ref().is_some_and(|p| p.name() == k)
    };
    // A constraint plugin's run is known once the adapter's constraint is
    // attached ([`constrained`] checks its parameters).
    let is_constraint =
        |k: &str| plugins.get(k, Kind::Constraint).is_ok() || plugins.get(k, Kind::Drafter).is_ok();
    if let Some(name) = plugin_params.as_object().and_then(|m| {
        m.keys()
            .find(|k| is_parser(k) && !is_constraint(k) && !running(k))
    }) {
        return Err(bad(
            Some("plugin_params"),
            format!("`plugin_params.{name}`: the `{name}` parser does not run for this request"),
        ));
    }
    let mut pipeline = OutputPipeline::new(
        reasoning,
        tool_parser,
        frontend.tokenizer.special_token_texts(),
    );
    let (forced, choices, call_alternatives) = forced_call(&g, &mut pipeline)?;
    let encode = |text: &str| {
        frontend
            .tokenizer
            .encode(text)
            .map_err(|e| bad(Some("tool_choice"), e.to_string()))
    };
    if let Some(text) = &forced {
        prompt_ids.extend(encode(text)?);
    }
    let forced_choices = choices
        .iter()
        .map(|c| encode(c))
        .collect::<Result<Vec<_>, _>>()?;

    let context = frontend.context;
    let prompt_field = match g.prompt {
        Prompt::Messages(_) => "messages",
        Prompt::Text(_) | Prompt::TokenIds(_) => "prompt",
    };
    if prompt_ids.len() >= context {
        return Err(bad(
            Some(prompt_field),
            format!(
                "this model's maximum context length is {context} tokens; the prompt is {} tokens",
                prompt_ids.len()
            ),
        ));
    }
    let room = context - prompt_ids.len();
    let max_tokens = match g.max_tokens {
        Some(n) if n as usize > room && (defaults.strict_max_tokens || !g.clamp_max_tokens) => {
            return Err(bad(
                Some("max_tokens"),
                format!(
                    "max_tokens is {n}, but the prompt is {} tokens and the context {context}: at most {room} can be generated{}",
                    prompt_ids.len(),
                    if defaults.strict_max_tokens {
                        " (the server runs with --strict-max-tokens)"
                    } else {
                        ""
                    }
                ),
            ))
        }
        Some(n) => (n as usize).min(room),
        None => room.min(defaults.max_tokens),
    };
    Ok(Prepared {
        request: GenerateRequest {
            prompt_ids,
            max_tokens,
            stop: g.stop.clone(),
            keep_special: pipeline.parses(),
            forced_choices,
            params,
            sampler,
            processors,
            plugin_params,
            top_logprobs: if g.logprobs {
                g.top_logprobs as usize
            } else {
                0
            },
            speculative: speculative(None, defaults),
            lora: None,
        },
        stream: g.stream,
        logprobs: g.logprobs,
        single_call: tools_on && !g.parallel_tool_calls,
        pipeline,
        forced,
        constraint: None,
        call_alternatives,
        tools: g.tools.clone(),
    })
}

/// A request's speculation: what its adapter chose
/// (`speculation.speculate`), else the server's `--drafter` and
/// `--draft-max`.
pub fn speculative(
    choice: Option<&crate::plugin::services::SpeculationChoice>,
    defaults: &Defaults,
) -> crate::engine::speculative::SpecRequest {
    let drafter = match choice.and_then(|c| c.drafter.as_deref()) {
        Some("none") => None,
        Some(name) => Some(name.to_string()),
        None => defaults.drafter.clone(),
    };
    let max_draft = choice
        .and_then(|c| c.max_draft)
        .map_or(defaults.draft_max, |n| n as usize);
    crate::engine::speculative::SpecRequest { drafter, max_draft }
}

/// A parser that could not be set up: an unknown or rejected name is the
/// client's (or the flag's) fault, named by `field`.
fn parser_error(field: &str, e: crate::plugin::PluginError) -> ApiError {
    match e {
        crate::plugin::PluginError::Unknown { .. }
        | crate::plugin::PluginError::Rejected { .. } => bad(Some(field), e.to_string()),
        other => ApiError {
            status: 500,
            kind: ErrorKind::Plugin,
            message: other.to_string(),
            param: None,
        },
    }
}

/// `tool_choice` `required` / named, enforced. The reply starts with the
/// parser's call prefix for the function: prefilled after the prompt (the
/// returned text), so the model can only continue with arguments. For
/// `required` over several tools, the text the tools' prefixes share is
/// prefilled and each prefix's rest is returned as a choice: the engine
/// masks the first tokens to those choices ([`crate::engine::constrain`]),
/// so the model picks one of the functions and then writes its arguments.
///
/// Also returns each allowed function with the rest of its prefix after the
/// prefilled text (for strict tools' grammar, [`constrained`]).
fn forced_call(
    g: &GenerationRequest,
    pipeline: &mut OutputPipeline,
) -> Result<ForcedCall, ApiError> {
    let names: Vec<&str> = match &g.tool_choice {
        ToolChoice::Named(name) => vec![name.as_str()],
        ToolChoice::Required => g.tools.iter().map(|t| t.name.as_str()).collect(),
        ToolChoice::Auto | ToolChoice::None => return Ok((None, Vec::new(), Vec::new())),
    };
    let Some(parser) = pipeline.tool_parser() else {
        return Err(bad(
            Some("tool_choice"),
            "`tool_choice` needs a tool-call parser, and none is chosen for this model (set `tool_parser` or --tool-parser)",
        ));
    };
    let parser_name = parser.name().to_string();
    let mut prefixes = Vec::with_capacity(names.len());
    for name in &names {
        match parser.call_prefix(name) {
            Ok(Some(p)) => prefixes.push(p),
            Ok(None) => {
                return Err(bad(
                    Some("tool_choice"),
                    format!("the `{parser_name}` tool parser cannot force a call"),
                ))
            }
            Err(e) => return Err(parser_error("tool_parser", e)),
        }
    }
    let Some(first) = prefixes.first() else {
        return Ok((None, Vec::new(), Vec::new()));
    };
    let alternatives = |common: usize| {
        prefixes
            .iter()
            .zip(&names)
            .map(|(p, n)| CallAlternative {
                rest: p[common..].to_string(),
                name: n.to_string(),
            })
            .collect()
    };
    if prefixes.len() == 1 {
        return Ok((Some(first.clone()), Vec::new(), alternatives(first.len())));
    }
    let common = prefixes[1..]
        .iter()
        .map(|p| common_prefix_len(first, p))
        .min()
        .unwrap_or(0);
    let choices = prefixes.iter().map(|p| p[common..].to_string()).collect();
    Ok((
        (common > 0).then(|| first[..common].to_string()),
        choices,
        alternatives(common),
    ))
}

/// A forced call: the prefilled text, the choices the first tokens are
/// masked to, and the functions with the rest of their prefixes.
type ForcedCall = (Option<String>, Vec<String>, Vec<CallAlternative>);

/// Bytes `a` and `b` share at the start, at a character boundary.
fn common_prefix_len(a: &str, b: &str) -> usize {
    a.char_indices()
        .zip(b.chars())
        .find(|((_, x), y)| x != y)
        .map(|((i, _), _)| i)
        .unwrap_or(a.len().min(b.len()))
}

/// The prompt's token ids and text: messages rendered through the chat
/// template (with the server's system message when the request has none,
/// tools when `tools_on`, and `kwargs`), raw text tokenized, or ids checked
/// against the vocabulary.
/// `chat_template_kwargs` as an object. Errors: a 400 naming the field.
fn template_kwargs(
    g: &GenerationRequest,
) -> Result<serde_json::Map<String, serde_json::Value>, ApiError> {
    match serde_json::from_str::<serde_json::Value>(&g.chat_template_kwargs) {
        Ok(serde_json::Value::Object(m)) => Ok(m),
        _ => Err(bad(
            Some("chat_template_kwargs"),
            "`chat_template_kwargs` must be a JSON object",
        )),
    }
}

/// Whether the request's tools are offered to the model.
fn tools_on(g: &GenerationRequest) -> bool {
    !g.tools.is_empty() && !matches!(g.tool_choice, ToolChoice::None)
}

/// The number of prompt tokens `g` takes, exactly as [`prepare`] would
/// tokenize it (chat template with tools, `--system`, BOS): the `prompt`
/// service adapters call for Anthropic `count_tokens` and OpenAI
/// `/v1/responses/input_tokens`. Errors: the 400 the prompt would get.
pub fn count_prompt_tokens(
    g: &GenerationRequest,
    frontend: &Frontend,
    defaults: &Defaults,
) -> Result<u32, ApiError> {
    let kwargs = template_kwargs(g)?;
    let (ids, _) = prompt_ids(g, &kwargs, tools_on(g), frontend, defaults)?;
    Ok(ids.len() as u32)
}

fn prompt_ids(
    g: &GenerationRequest,
    kwargs: &serde_json::Map<String, serde_json::Value>,
    tools_on: bool,
    frontend: &Frontend,
    defaults: &Defaults,
) -> Result<(Vec<u32>, String), ApiError> {
    let tokenizer = &frontend.tokenizer;
    let messages = match &g.prompt {
        Prompt::Text(text) => {
            check_prompt_chars(text.chars().count(), "prompt", frontend, defaults)?;
            let ids = tokenizer
                .encode_prompt(text)
                .map_err(|e| bad(Some("prompt"), e.to_string()))?;
            return Ok((ids, text.clone()));
        }
        Prompt::TokenIds(ids) => {
            if ids.is_empty() {
                return Err(bad(Some("prompt"), "the prompt is empty"));
            }
            if let Some(id) = ids.iter().find(|id| **id as usize >= frontend.vocab) {
                return Err(bad(
                    Some("prompt"),
                    format!(
                        "token id {id} is outside the vocabulary (size {})",
                        frontend.vocab
                    ),
                ));
            }
            let text = tokenizer.decode(ids, false).unwrap_or_default();
            return Ok((ids.clone(), text));
        }
        Prompt::Messages(m) => m,
    };
    let template = frontend
        .template
        .as_ref()
        .ok_or_else(|| bad(Some("messages"), "this model has no chat template"))?;
    // Before rendering: the messages' text alone already over the bound.
    let given: usize = messages
        .iter()
        .flat_map(|m| &m.content)
        .map(|p| match p {
            ContentPart::Text(t) => t.len(),
            ContentPart::ImageUrl(_) => 0,
        })
        .sum();
    if given > max_prompt_chars(frontend, defaults) {
        let chars = messages
            .iter()
            .flat_map(|m| &m.content)
            .map(|p| match p {
                ContentPart::Text(t) => t.chars().count(),
                ContentPart::ImageUrl(_) => 0,
            })
            .sum();
        check_prompt_chars(chars, "messages", frontend, defaults)?;
    }
    let mut rendered: Vec<TemplateMessage> = Vec::with_capacity(messages.len() + 1);
    if let Some(system) = &defaults.system {
        if !messages.iter().any(|m| m.role == "system") {
            rendered.push(TemplateMessage {
                role: "system".into(),
                content: system.clone(),
                ..TemplateMessage::default()
            });
        }
    }
    for (i, m) in messages.iter().enumerate() {
        // Text parts are joined with newlines, as vLLM joins them.
        let mut content = String::new();
        for (j, part) in m.content.iter().enumerate() {
            match part {
                ContentPart::Text(t) => {
                    if j > 0 {
                        content.push('\n');
                    }
                    content.push_str(t)
                }
                ContentPart::ImageUrl(_) => {
                    return Err(bad(
                        Some(&format!("messages[{i}].content[{j}].type")),
                        "this model takes text only; image content is not supported",
                    ))
                }
            }
        }
        let tool_calls = (!m.tool_calls.is_empty()).then(|| {
            m.tool_calls
                .iter()
                .map(|c| {
                    // Templates `tojson` the arguments: give them the mapping.
                    let arguments = serde_json::from_str::<serde_json::Value>(&c.arguments)
                        .unwrap_or_else(|_| serde_json::Value::String(c.arguments.clone()));
                    serde_json::json!({
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": arguments},
                    })
                })
                .collect()
        });
        rendered.push(TemplateMessage {
            role: m.role.clone(),
            content,
            tool_calls,
            tool_call_id: m.tool_call_id.clone(),
            name: m.name.clone(),
            reasoning_content: m.reasoning.clone(),
        });
    }
    let tools: Vec<serde_json::Value> = if tools_on {
        g.tools
            .iter()
            .map(|t| {
                let parameters = serde_json::from_str::<serde_json::Value>(&t.parameters_json)
                    .unwrap_or_else(|_| serde_json::json!({}));
                let mut function = serde_json::Map::new();
                function.insert("name".into(), t.name.clone().into());
                if !t.description.is_empty() {
                    function.insert("description".into(), t.description.clone().into());
                }
                function.insert("parameters".into(), parameters);
                serde_json::json!({"type": "function", "function": function})
            })
            .collect()
    } else {
        Vec::new()
    };
    let text = template
        .render_with(&rendered, &tools, kwargs, true)
        .map_err(|e| {
            bad(
                Some("messages"),
                format!("the chat template rejected the messages: {e}"),
            )
        })?;
    check_prompt_chars(text.chars().count(), "messages", frontend, defaults)?;
    let ids = tokenizer
        .encode(&text)
        .map_err(|e| bad(Some("messages"), e.to_string()))?;
    Ok((ids, text))
}

#[cfg(test)]
mod tests {
    use super::common_prefix_len;

    #[test]
    fn common_prefixes_end_at_character_boundaries() {
        assert_eq!(common_prefix_len("<a>\"get_time", "<a>\"get_weather"), 8);
        assert_eq!(common_prefix_len("éa", "éb"), 2);
        assert_eq!(common_prefix_len("ab", "abc"), 2);
        assert_eq!(common_prefix_len("", "x"), 0);
    }
}

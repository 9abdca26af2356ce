//! WIT 0.1.0 adapters at the host's one conversion boundary: their
//! requests are lifted to the 0.2.0 request model (a 0.1.0 message is one
//! text part; its `tools` are offered with `tool-choice: auto`), and the
//! host's 0.2.0 updates are lowered for them (`invalid-call` becomes text,
//! the matched stop string is not reported, usage only on the last update).

use crate::plugin::bindings::adapter::exports::mlxhost::plugin::api_adapter as old;
use crate::plugin::bindings::sampler::mlxhost::plugin::types as old_types;
use crate::plugin::bindings::v2::adapter::exports::mlxhost::plugin::api_adapter as new;
use crate::plugin::bindings::v2::adapter::mlxhost::plugin::request as req;
use crate::plugin::bindings::v2::tool_parser::mlxhost::plugin::types as new_types;

pub(super) fn context(c: &new::RequestContext) -> old::RequestContext {
    old::RequestContext {
        request_id: c.request_id.clone(),
        created: c.created,
        model_id: c.model_id.clone(),
    }
}

pub(super) fn http_request(r: &new::HttpRequest) -> old::HttpRequest {
    old::HttpRequest {
        method: r.method.clone(),
        path: r.path.clone(),
        headers: r.headers.clone(),
        body: r.body.clone(),
    }
}

pub(super) fn http_response(r: old::HttpResponse) -> new::HttpResponse {
    new::HttpResponse {
        status: r.status,
        content_type: r.content_type,
        body: r.body,
    }
}

pub(super) fn sse_event(e: old::SseEvent) -> new::SseEvent {
    new::SseEvent {
        event: e.event,
        data: e.data,
    }
}

pub(super) fn action(a: old::Action) -> new::Action {
    match a {
        old::Action::Generate(g) => new::Action::Generate(generation_request(g)),
        old::Action::Respond(r) => new::Action::Respond(http_response(r)),
    }
}

fn generation_request(g: old::GenerationRequest) -> req::GenerationRequest {
    let s = g.sampling;
    let tool_choice = if g.tools.is_empty() {
        req::ToolChoice::None
    } else {
        req::ToolChoice::Auto
    };
    req::GenerationRequest {
        prompt: req::Prompt::Messages(
            g.messages
                .into_iter()
                .map(|m| req::Message {
                    role: m.role,
                    content: vec![req::ContentPart::Text(m.content)],
                    name: None,
                    tool_calls: Vec::new(),
                    tool_call_id: None,
                    reasoning: None,
                })
                .collect(),
        ),
        sampling: req::SamplingRequest {
            temperature: s.temperature,
            top_p: s.top_p,
            top_k: s.top_k,
            min_p: s.min_p,
            xtc_probability: s.xtc_probability,
            xtc_threshold: s.xtc_threshold,
            seed: s.seed,
            repetition_penalty: s.repetition_penalty,
            repetition_context_size: s.repetition_context_size,
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
            logit_bias: s.logit_bias,
        },
        max_tokens: g.max_tokens,
        // Every dialect treats an over-large max_tokens as an upper bound
        // (`--strict-max-tokens` rejects it instead).
        clamp_max_tokens: true,
        stop: g.stop,
        stream: g.stream,
        logprobs: g.logprobs,
        top_logprobs: g.top_logprobs,
        tools: g
            .tools
            .into_iter()
            .map(|t| new_types::ToolDefinition {
                name: t.name,
                parameters_json: t.parameters_json,
                description: t.description,
            })
            .collect(),
        tool_choice,
        parallel_tool_calls: true,
        tool_parser: None,
        reasoning_parser: None,
        chat_template_kwargs: "{}".into(),
        sampler: g.sampler,
        logits_processors: g.logits_processors,
        plugin_params: g.plugin_params,
        include_usage: g.include_usage,
        previous_response_id: None,
    }
}

fn event(e: &new_types::GenerationEvent) -> old_types::GenerationEvent {
    use new_types::GenerationEvent as N;
    use old_types::GenerationEvent as O;
    match e {
        N::Text(t) | N::InvalidCall(t) => O::Text(t.clone()),
        N::Reasoning(t) => O::Reasoning(t.clone()),
        N::ToolCallStart(s) => O::ToolCallStart((s.index, s.id.clone(), s.name.clone())),
        N::ToolCallArgumentsDelta(d) => O::ToolCallArgumentsDelta((d.index, d.arguments.clone())),
        N::ToolCallEnd(i) => O::ToolCallEnd(*i),
        N::Error(m) => O::Error(m.clone()),
    }
}

fn finish(f: new_types::FinishReason) -> old_types::FinishReason {
    use new_types::FinishReason as N;
    use old_types::FinishReason as O;
    match f {
        N::Stop => O::Stop,
        N::Length => O::Length,
        N::ToolCalls => O::ToolCalls,
        N::Cancelled => O::Cancelled,
        N::Error => O::Error,
    }
}

pub(super) fn update(u: &new::GenerationUpdate) -> old::GenerationUpdate {
    old::GenerationUpdate {
        sequence: u.sequence,
        events: u.events.iter().map(event).collect(),
        logprobs: u
            .logprobs
            .iter()
            .map(|t| old::TokenLogprob {
                token: t.token.clone(),
                bytes: t.bytes.clone(),
                id: t.id,
                logprob: t.logprob,
                top: t
                    .top
                    .iter()
                    .map(|a| old::TopLogprob {
                        token: a.token.clone(),
                        bytes: a.bytes.clone(),
                        id: a.id,
                        logprob: a.logprob,
                    })
                    .collect(),
            })
            .collect(),
        finish: u.finish.map(finish),
        // 0.1.0 promises usage on the last update only.
        usage: u
            .usage
            .as_ref()
            .filter(|_| u.finish.is_some())
            .map(|x| old::Usage {
                prompt_tokens: x.prompt_tokens,
                completion_tokens: x.completion_tokens,
                cached_tokens: x.cached_tokens,
            }),
    }
}

pub(super) fn api_error(e: &new::ApiError) -> old::ApiError {
    old::ApiError {
        status: e.status,
        kind: match e.kind {
            new::ErrorKind::InvalidRequest => old::ErrorKind::InvalidRequest,
            new::ErrorKind::NotFound => old::ErrorKind::NotFound,
            new::ErrorKind::TooLarge => old::ErrorKind::TooLarge,
            new::ErrorKind::Plugin => old::ErrorKind::Plugin,
            new::ErrorKind::Server => old::ErrorKind::Server,
        },
        message: e.message.clone(),
        param: e.param.clone(),
    }
}

//! Test-only API adapter on WIT 0.1.0: `POST /v1/echo` runs one user
//! message and answers `{"text", "events", "finish"}` (streamed: one SSE
//! event per update with the same fields). It proves a 0.1.0 adapter keeps
//! loading and serving on a host whose own request model is 0.2.0.
use mlxhost_plugin_sdk::adapter::exports::mlxhost::plugin::api_adapter::{
    self as api, Action, ApiError, GenerationRequest, GenerationUpdate, HttpRequest, HttpResponse,
    Message, RequestContext, Route, SamplingRequest, SseEvent,
};
use mlxhost_plugin_sdk::adapter::mlxhost::plugin::types::{
    FinishReason, GenerationEvent, ToolDefinition,
};
use serde_json::{json, Value};

struct Adapter;

fn respond(status: u16, body: Value) -> HttpResponse {
    HttpResponse {
        status,
        content_type: "application/json".into(),
        body: body.to_string().into_bytes(),
    }
}

fn summary(update: &GenerationUpdate) -> Value {
    let mut text = String::new();
    let mut events = Vec::new();
    for e in &update.events {
        match e {
            GenerationEvent::Text(t) => {
                text.push_str(t);
                events.push(json!({"text": t}));
            }
            GenerationEvent::Reasoning(t) => events.push(json!({"reasoning": t})),
            GenerationEvent::ToolCallStart((i, id, name)) => {
                events.push(json!({"tool_call_start": [i, id, name]}))
            }
            GenerationEvent::ToolCallArgumentsDelta((i, a)) => {
                events.push(json!({"tool_call_arguments": [i, a]}))
            }
            GenerationEvent::ToolCallEnd(i) => events.push(json!({"tool_call_end": i})),
            GenerationEvent::Error(m) => events.push(json!({"error": m})),
        }
    }
    let finish = update.finish.map(|f| match f {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::ToolCalls => "tool_calls",
        FinishReason::Cancelled => "cancelled",
        FinishReason::Error => "error",
    });
    json!({"text": text, "events": events, "finish": finish})
}

impl api::Guest for Adapter {
    fn routes() -> Vec<Route> {
        vec![Route {
            method: "POST".into(),
            path: "/v1/echo".into(),
        }]
    }

    fn handle(_ctx: RequestContext, req: HttpRequest) -> Action {
        let body: Value = match serde_json::from_slice(&req.body) {
            Ok(v) => v,
            Err(e) => return Action::Respond(respond(400, json!({"error": e.to_string()}))),
        };
        let Some(text) = body.get("text").and_then(Value::as_str) else {
            return Action::Respond(respond(400, json!({"error": "`text` is required"})));
        };
        let tools = body
            .get("tools")
            .and_then(Value::as_array)
            .map(|t| {
                t.iter()
                    .filter_map(Value::as_str)
                    .map(|name| ToolDefinition {
                        name: name.into(),
                        parameters_json: "{}".into(),
                        description: String::new(),
                    })
                    .collect()
            })
            .unwrap_or_default();
        Action::Generate(GenerationRequest {
            messages: vec![Message {
                role: "user".into(),
                content: text.into(),
            }],
            sampling: SamplingRequest {
                temperature: Some(0.0),
                top_p: None,
                top_k: None,
                min_p: None,
                xtc_probability: None,
                xtc_threshold: None,
                seed: None,
                repetition_penalty: None,
                repetition_context_size: None,
                presence_penalty: None,
                frequency_penalty: None,
                logit_bias: Vec::new(),
            },
            max_tokens: body
                .get("max_tokens")
                .and_then(Value::as_u64)
                .map(|n| n as u32),
            stop: Vec::new(),
            stream: body.get("stream").and_then(Value::as_bool).unwrap_or(false),
            logprobs: false,
            top_logprobs: 0,
            tools,
            sampler: body
                .get("sampler")
                .and_then(Value::as_str)
                .map(str::to_string),
            logits_processors: Vec::new(),
            plugin_params: body
                .get("plugin_params")
                .map(Value::to_string)
                .unwrap_or_else(|| "{}".into()),
            include_usage: false,
        })
    }

    fn render(_ctx: RequestContext, update: GenerationUpdate) -> HttpResponse {
        respond(200, summary(&update))
    }

    fn render_stream(_ctx: RequestContext, update: GenerationUpdate) -> Vec<SseEvent> {
        vec![SseEvent {
            event: String::new(),
            data: summary(&update).to_string(),
        }]
    }

    fn render_error(_ctx: RequestContext, error: ApiError) -> HttpResponse {
        respond(
            error.status,
            json!({"error": error.message, "param": error.param}),
        )
    }
}

mlxhost_plugin_sdk::adapter::export_adapter!(Adapter);

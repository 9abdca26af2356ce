//! The `anthropic` API adapter: Anthropic's Messages API over the host's
//! HTTP, on `mlxhost:plugin@0.2.0` (content blocks, tool use, thinking).
//!
//! Routes: `POST /v1/messages` (streamed as Anthropic's named SSE events,
//! or one `message`) and `POST /v1/messages/count_tokens` (the prompt's
//! tokens, counted by the host: WIT `prompt`). `request` turns the body into
//! the canonical generation request; `render` turns the host's generation
//! events into Anthropic's content blocks. The host creates one instance
//! per HTTP request, so the stream's state (which block is open, its
//! index) lives in this instance's memory between `render-stream` calls.

mod render;
mod request;
#[cfg(test)]
mod tests;

use std::cell::RefCell;

use mlxhost_plugin_sdk::v2::adapter::exports::mlxhost::plugin::api_adapter::{
    self as api, Action, ApiError, ErrorKind, GenerationUpdate, HttpRequest, HttpResponse,
    RequestContext, Route, SseEvent,
};
use mlxhost_plugin_sdk::v2::adapter::mlxhost::plugin::prompt;
use mlxhost_plugin_sdk::v3::structured_output::mlxhost::plugin0_3_0::structured_output;
use serde_json::json;

const MESSAGES: &str = "/v1/messages";
const COUNT_TOKENS: &str = "/v1/messages/count_tokens";

thread_local! {
    static STREAM: RefCell<render::Stream> = RefCell::new(render::Stream::default());
}

fn json_response(status: u16, body: String) -> HttpResponse {
    HttpResponse {
        status,
        content_type: "application/json".into(),
        body: body.into_bytes(),
    }
}

fn error_response(ctx: &RequestContext, e: &ApiError) -> HttpResponse {
    json_response(e.status, render::error(ctx, e).to_string())
}

struct Adapter;

/// The request's prompt normalisation: client metadata is dropped unless the
/// `x-mlxhost-keep-metadata` header is `true` or `1` (the host sets it on
/// every request under `serve --keep-prompt-metadata`; a client may send it
/// for its own requests).
fn normalize(headers: &[(String, String)]) -> request::Normalize {
    let keep_metadata = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case(KEEP_METADATA) && matches!(v.trim(), "true" | "1"));
    request::Normalize { keep_metadata }
}

/// The header that keeps client metadata in the prompt.
const KEEP_METADATA: &str = "x-mlxhost-keep-metadata";

/// Hands `output_config.format`'s constraint to the host (WIT 0.3.0
/// `structured-output`). Errors: a 400 naming the field when the server
/// cannot enforce it.
fn constrain(
    c: Option<&mlxhost_plugin_sdk::structured::OutputConstraint>,
) -> Result<(), request::Invalid> {
    let Some(c) = c else { return Ok(()) };
    structured_output::constrain(c).map_err(|message| request::Invalid {
        message: format!("{}: {message}", c.field),
        param: Some(c.field.clone()),
    })
}

impl api::Guest for Adapter {
    fn routes() -> Vec<Route> {
        [MESSAGES, COUNT_TOKENS]
            .into_iter()
            .map(|path| Route {
                method: "POST".into(),
                path: path.into(),
            })
            .collect()
    }

    fn handle(ctx: RequestContext, req: HttpRequest) -> Action {
        // Headers (`x-api-key`, `authorization`, `anthropic-version`,
        // `anthropic-beta`) are accepted and not read: the host checks keys.
        let norm = normalize(&req.headers);
        match (req.method.as_str(), req.path.as_str()) {
            ("POST", MESSAGES) => match request::parse_with_constraint(&req.body, norm)
                .and_then(|(generation, c)| constrain(c.as_ref()).map(|()| generation))
                .inspect(|_| {
                    let strict = request::strict_tool_names(&req.body);
                    if !strict.is_empty() {
                        structured_output::strict_tools(&strict);
                    }
                }) {
                Ok(generation) => {
                    STREAM.with(|s| *s.borrow_mut() = render::Stream::default());
                    Action::Generate(generation)
                }
                Err(invalid) => Action::Respond(error_response(
                    &ctx,
                    &ApiError {
                        status: 400,
                        kind: ErrorKind::InvalidRequest,
                        message: invalid.message,
                        param: invalid.param,
                    },
                )),
            },
            // The host counts: the same chat template and tokenizer a
            // generation uses (WIT `prompt.count-tokens`).
            ("POST", COUNT_TOKENS) => {
                let counted = request::parse_count(&req.body, norm)
                    .map_err(|invalid| (invalid.message, invalid.param))
                    .and_then(|g| prompt::count_tokens(&g).map_err(|m| (m, None)));
                Action::Respond(match counted {
                    Ok(n) => json_response(200, json!({ "input_tokens": n }).to_string()),
                    Err((message, param)) => error_response(
                        &ctx,
                        &ApiError {
                            status: 400,
                            kind: ErrorKind::InvalidRequest,
                            message,
                            param,
                        },
                    ),
                })
            }
            (method, path) => Action::Respond(error_response(
                &ctx,
                &ApiError {
                    status: 404,
                    kind: ErrorKind::NotFound,
                    message: format!("no route {method} {path}"),
                    param: None,
                },
            )),
        }
    }

    fn render(ctx: RequestContext, update: GenerationUpdate) -> HttpResponse {
        json_response(200, render::message(&ctx, &update))
    }

    fn render_stream(ctx: RequestContext, update: GenerationUpdate) -> Vec<SseEvent> {
        STREAM
            .with(|s| render::stream_events(&ctx, &mut s.borrow_mut(), &update))
            .into_iter()
            .map(|(event, data)| SseEvent {
                event: event.into(),
                data,
            })
            .collect()
    }

    fn render_error(ctx: RequestContext, error: ApiError) -> HttpResponse {
        error_response(&ctx, &error)
    }

    /// Anthropic's stream error: `event: error` with the error body (the
    /// SDKs act on the event name).
    fn render_stream_error(ctx: RequestContext, error: ApiError) -> Vec<SseEvent> {
        let body = error_response(&ctx, &error);
        vec![SseEvent {
            event: "error".into(),
            data: String::from_utf8_lossy(&body.body).into_owned(),
        }]
    }
}

mlxhost_plugin_sdk::v2::adapter::export_adapter!(Adapter);

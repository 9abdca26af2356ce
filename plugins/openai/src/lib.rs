//! The `openai` API adapter: OpenAI Chat Completions over the host's HTTP,
//! on `mlxhost:plugin@0.2.0` (content parts, tool calls, reasoning).
//!
//! Routes: `GET /v1/models`, `POST /v1/chat/completions` (streamed as SSE
//! `chat.completion.chunk`s ending in `data: [DONE]`, or one
//! `chat.completion`). `request` turns the body into the canonical
//! generation request; `render` turns the host's generation events (text,
//! reasoning, tool calls) into OpenAI's JSON. The host creates one instance
//! per HTTP request, so the options `handle` parsed are kept in this
//! instance's memory for the `render*` calls that follow.

mod render;
mod request;
#[cfg(test)]
mod tests;

use std::cell::RefCell;

use mlxhost_plugin_sdk::v2::adapter::exports::mlxhost::plugin::api_adapter::{
    self as api, Action, ApiError, ErrorKind, GenerationUpdate, HttpRequest, HttpResponse,
    RequestContext, Route, SseEvent,
};
use serde_json::json;

use request::RenderOptions;

const CHAT: &str = "/v1/chat/completions";
const MODELS: &str = "/v1/models";

thread_local! {
    static OPTIONS: RefCell<RenderOptions> = RefCell::new(RenderOptions::default());
}

fn options() -> RenderOptions {
    OPTIONS.with(|o| o.borrow().clone())
}

fn json_response(status: u16, body: serde_json::Value) -> HttpResponse {
    HttpResponse {
        status,
        content_type: "application/json".into(),
        body: body.to_string().into_bytes(),
    }
}

fn error_response(e: ApiError) -> HttpResponse {
    json_response(e.status, render::error(&e))
}

struct Adapter;

impl api::Guest for Adapter {
    fn routes() -> Vec<Route> {
        vec![
            Route {
                method: "GET".into(),
                path: MODELS.into(),
            },
            Route {
                method: "POST".into(),
                path: CHAT.into(),
            },
        ]
    }

    fn handle(ctx: RequestContext, req: HttpRequest) -> Action {
        match (req.method.as_str(), req.path.as_str()) {
            ("GET", MODELS) => Action::Respond(json_response(
                200,
                json!({
                    "object": "list",
                    "data": [{
                        "id": ctx.model_id,
                        "object": "model",
                        "created": ctx.created,
                        "owned_by": "mlxhost",
                    }],
                }),
            )),
            ("POST", CHAT) => match request::parse(&req.body) {
                Ok((generation, opts)) => {
                    OPTIONS.with(|o| *o.borrow_mut() = opts);
                    Action::Generate(generation)
                }
                Err(invalid) => Action::Respond(error_response(ApiError {
                    status: 400,
                    kind: ErrorKind::InvalidRequest,
                    message: invalid.message,
                    param: invalid.param,
                })),
            },
            (method, path) => Action::Respond(error_response(ApiError {
                status: 404,
                kind: ErrorKind::NotFound,
                message: format!("no route {method} {path}"),
                param: None,
            })),
        }
    }

    fn render(ctx: RequestContext, update: GenerationUpdate) -> HttpResponse {
        json_response(200, render::completion(&ctx, &options(), &update))
    }

    fn render_stream(ctx: RequestContext, update: GenerationUpdate) -> Vec<SseEvent> {
        render::stream_chunks(&ctx, &options(), &update)
            .into_iter()
            .map(|data| SseEvent {
                event: String::new(),
                data,
            })
            .collect()
    }

    fn render_error(_ctx: RequestContext, error: ApiError) -> HttpResponse {
        error_response(error)
    }
}

mlxhost_plugin_sdk::v2::adapter::export_adapter!(Adapter);

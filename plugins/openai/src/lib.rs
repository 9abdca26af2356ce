//! The `openai` API adapter: OpenAI Chat Completions and legacy
//! Completions over the host's HTTP, on `mlxhost:plugin@0.4.0` (0.2.0's
//! adapter world: content parts, tool calls, reasoning; plus structured
//! output through the host's `structured-output` service, 0.3.0, and the
//! request's `speculative` field through `speculation`, 0.4.0).
//!
//! Routes: `GET /v1/models` and `GET /v1/models/{model}` (OpenAI's shape,
//! or Anthropic's when the request carries `anthropic-version`), `POST /v1/chat/completions` (streamed as SSE
//! `chat.completion.chunk`s ending in `data: [DONE]`, or one
//! `chat.completion`), `POST /v1/completions` (`completions`: a text or
//! token-id prompt, `text_completion` objects, streamed or not).
//! `request` turns the body into the canonical generation request; `render`
//! turns the host's generation events (text, reasoning, tool calls) into
//! OpenAI's JSON. The host creates one instance per HTTP request, so the
//! options `handle` parsed (and which endpoint it served) are kept in this
//! instance's memory for the `render*` calls that follow.

mod completions;
#[cfg(test)]
mod completions_tests;
mod models;
mod render;
mod request;
#[cfg(test)]
mod tests;

use std::cell::RefCell;

use mlxhost_plugin_sdk::v2::adapter::exports::mlxhost::plugin::api_adapter::{
    self as api, Action, ApiError, ErrorKind, GenerationUpdate, HttpRequest, HttpResponse,
    RequestContext, Route, SseEvent,
};

use mlxhost_plugin_sdk::structured::OutputConstraint;
use mlxhost_plugin_sdk::v3::structured_output::mlxhost::plugin0_3_0::structured_output;
use mlxhost_plugin_sdk::v4::speculation::mlxhost::plugin0_4_0::speculation;
use request::{Endpoint, Invalid, RenderOptions};

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";
const MODELS: &str = "/v1/models";
const MODEL: &str = "/v1/models/{model}";

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

/// A parsed request becomes a generation (its options kept for `render*`),
/// a rejected one a 400 naming the field.
fn generate_or_400(parsed: Result<(api::GenerationRequest, RenderOptions), Invalid>) -> Action {
    match parsed.and_then(|(generation, opts)| {
        constrain(opts.constraint.as_ref())?;
        if !opts.strict_tools.is_empty() {
            structured_output::strict_tools(&opts.strict_tools);
        }
        if let Some(s) = &opts.speculative {
            speculation::speculate(s).map_err(|message| Invalid {
                message: format!("`speculative`: {message}"),
                param: Some("speculative".into()),
            })?;
        }
        Ok((generation, opts))
    }) {
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
    }
}

/// Hands the request's output constraint to the host (WIT 0.3.0
/// `structured-output`). Errors: a 400 naming the field when the server
/// cannot enforce it (no constraint plugin loaded, a grammar over its size
/// limit).
fn constrain(c: Option<&OutputConstraint>) -> Result<(), Invalid> {
    let Some(c) = c else { return Ok(()) };
    structured_output::constrain(c).map_err(|message| Invalid {
        message: format!("`{}`: {message}", c.field),
        param: Some(c.field.clone()),
    })
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
                method: "GET".into(),
                path: MODEL.into(),
            },
            Route {
                method: "POST".into(),
                path: CHAT.into(),
            },
            Route {
                method: "POST".into(),
                path: COMPLETIONS.into(),
            },
        ]
    }

    fn handle(ctx: RequestContext, req: HttpRequest) -> Action {
        match (req.method.as_str(), req.path.as_str()) {
            ("GET", MODELS) => Action::Respond(models::list(&ctx, &req.headers)),
            ("GET", path) if path.starts_with(MODELS) => Action::Respond(models::retrieve(
                &ctx,
                &req.headers,
                &path[MODELS.len() + 1..],
            )),
            ("POST", CHAT) => generate_or_400(request::parse(&req.body)),
            ("POST", COMPLETIONS) => generate_or_400(completions::parse(&req.body)),
            (method, path) => Action::Respond(error_response(ApiError {
                status: 404,
                kind: ErrorKind::NotFound,
                message: format!("no route {method} {path}"),
                param: None,
            })),
        }
    }

    fn render(ctx: RequestContext, update: GenerationUpdate) -> HttpResponse {
        let opts = options();
        let body = match opts.endpoint {
            Endpoint::Chat => render::completion(&ctx, &opts, &update),
            Endpoint::Completions => completions::completion(&ctx, &opts, &update),
        };
        json_response(200, body)
    }

    fn render_stream(ctx: RequestContext, update: GenerationUpdate) -> Vec<SseEvent> {
        let chunks = OPTIONS.with(|o| {
            let mut opts = o.borrow_mut();
            match opts.endpoint {
                Endpoint::Chat => render::stream_chunks(&ctx, &opts, &update),
                Endpoint::Completions => completions::stream_chunks(&ctx, &mut opts, &update),
            }
        });
        chunks
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

    /// OpenAI's stream error: a data-only event holding `{"error": ...}`
    /// (the SDKs raise on a chunk with an `error` key).
    fn render_stream_error(_ctx: RequestContext, error: ApiError) -> Vec<SseEvent> {
        vec![SseEvent {
            event: String::new(),
            data: String::from_utf8_lossy(&error_response(error).body).into_owned(),
        }]
    }
}

mlxhost_plugin_sdk::v2::adapter::export_adapter!(Adapter);

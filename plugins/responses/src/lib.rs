//! The `responses` API adapter: OpenAI's Responses API over the host's
//! HTTP (`mlxhost:plugin@0.2.0`), the dialect Codex CLI speaks.
//!
//! Routes:
//! - `POST /v1/responses`: a generation, non-streamed (one `response`) or
//!   streamed (`response.created` ... `response.completed`, each event with
//!   its `sequence_number`);
//! - `GET /v1/responses/{response_id}`, `DELETE /v1/responses/{response_id}`,
//!   `GET /v1/responses/{response_id}/input_items`: stored responses;
//! - `POST /v1/responses/input_tokens`: the prompt's token count.
//!
//! Stored responses live in the host's response store (WIT
//! `response-store`; TTL and byte cap are the server's), keyed by response
//! id: `store` (default true) keeps a response, `previous_response_id`
//! continues its conversation. The host creates one instance per HTTP
//! request, so what `handle` parsed is kept in this instance's memory for
//! the `render*` calls that follow.

mod items;
mod render;
mod request;
mod stored;
#[cfg(test)]
mod tests;

use std::cell::RefCell;

use mlxhost_plugin_sdk::fields::Invalid;
use mlxhost_plugin_sdk::v2::adapter::exports::mlxhost::plugin::api_adapter::{
    self as api, Action, ApiError, GenerationUpdate, HttpRequest, HttpResponse, RequestContext,
    Route, SseEvent,
};
use mlxhost_plugin_sdk::v2::adapter::mlxhost::plugin::{prompt, response_store};
use mlxhost_plugin_sdk::v3::structured_output::mlxhost::plugin0_3_0::structured_output;
use serde_json::{json, Value};

use request::Options;
use stored::Stored;

const RESPONSES: &str = "/v1/responses";
const ONE: &str = "/v1/responses/{response_id}";
const INPUT_ITEMS: &str = "/v1/responses/{response_id}/input_items";
const INPUT_TOKENS: &str = "/v1/responses/input_tokens";

thread_local! {
    static OPTIONS: RefCell<Options> = RefCell::new(Options::default());
    static STREAM: RefCell<render::Stream> = RefCell::new(render::Stream::default());
}

fn json_response(status: u16, body: Value) -> HttpResponse {
    HttpResponse {
        status,
        content_type: "application/json".into(),
        body: body.to_string().into_bytes(),
    }
}

/// OpenAI's error `type` for a status.
fn error_type(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "invalid_request_error",
        429 => "rate_limit_error",
        500..=599 => "server_error",
        _ => "invalid_request_error",
    }
}

/// OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`.
fn error_body(status: u16, message: &str, param: Option<&str>, code: Option<&str>) -> Value {
    json!({"error": {"message": message, "type": error_type(status), "param": param, "code": code}})
}

fn rejected(i: Invalid) -> HttpResponse {
    json_response(
        i.status,
        error_body(i.status, &i.message, i.param.as_deref(), i.code),
    )
}

fn not_found(id: &str) -> HttpResponse {
    json_response(
        404,
        error_body(
            404,
            &format!("Response with id '{id}' not found."),
            Some("response_id"),
            None,
        ),
    )
}

/// The stored response `id`, if the store has it (and it parses).
fn load(id: &str) -> Option<Stored> {
    response_store::get(id).and_then(|b| Stored::from_bytes(&b))
}

/// The `{response_id}` segment of a path under `/v1/responses/`.
fn path_id(path: &str) -> &str {
    path.trim_start_matches("/v1/responses/")
        .split('/')
        .next()
        .unwrap_or("")
}

fn create(body: &[u8]) -> Action {
    let resolve = |id: &str| load(id).map(|s| s.conversation);
    match request::parse(body, &resolve, false).and_then(|(generation, opts)| {
        constrain(opts.constraint.as_ref())?;
        let strict = request::strict_tool_names(body);
        if !strict.is_empty() {
            structured_output::strict_tools(&strict);
        }
        Ok((generation, opts))
    }) {
        Ok((generation, opts)) => {
            OPTIONS.with(|o| *o.borrow_mut() = opts);
            Action::Generate(generation)
        }
        Err(i) => Action::Respond(rejected(i)),
    }
}

/// Hands `text.format`'s constraint to the host (WIT 0.3.0
/// `structured-output`). Errors: a 400 naming the field when the server
/// cannot enforce it.
fn constrain(c: Option<&mlxhost_plugin_sdk::structured::OutputConstraint>) -> Result<(), Invalid> {
    let Some(c) = c else { return Ok(()) };
    structured_output::constrain(c).map_err(|message| {
        mlxhost_plugin_sdk::fields::invalid(&c.field, format!("`{}`: {message}", c.field))
    })
}

fn input_tokens(body: &[u8]) -> Action {
    let resolve = |id: &str| load(id).map(|s| s.conversation);
    let (generation, _) = match request::parse(body, &resolve, true) {
        Ok(p) => p,
        Err(i) => return Action::Respond(rejected(i)),
    };
    Action::Respond(match prompt::count_tokens(&generation) {
        Ok(n) => json_response(
            200,
            json!({"object": "response.input_tokens", "input_tokens": n}),
        ),
        Err(message) => json_response(400, error_body(400, &message, Some("input"), None)),
    })
}

fn input_items(id: &str) -> HttpResponse {
    let Some(s) = load(id) else {
        return not_found(id);
    };
    // OpenAI lists input items newest first by default; items without an
    // id get one derived from the response's.
    let data: Vec<Value> = s
        .input_items
        .into_iter()
        .enumerate()
        .map(|(i, item)| items::with_id(item, id, i))
        .rev()
        .collect();
    let first = data.first().map(|i| i["id"].clone());
    let last = data.last().map(|i| i["id"].clone());
    json_response(
        200,
        json!({"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": false}),
    )
}

/// Keeps a finished response when the request asked for it (`store`).
/// A store that refuses (over its cap) leaves the response unstored: the
/// reply itself is unaffected, a later `previous_response_id` gets a 404.
fn keep(ctx: &RequestContext, opts: &Options, update: &GenerationUpdate, response: &Value) {
    if !opts.store {
        return;
    }
    let mut conversation = opts.conversation.clone();
    conversation.push(render::assistant_turn(&update.events));
    let record = Stored {
        response: response.clone(),
        conversation,
        input_items: opts.input_items.clone(),
    };
    let _ = response_store::put(&render::response_id(ctx), &record.to_bytes());
}

struct Adapter;

impl api::Guest for Adapter {
    fn routes() -> Vec<Route> {
        [
            ("POST", RESPONSES),
            ("POST", INPUT_TOKENS),
            ("GET", ONE),
            ("DELETE", ONE),
            ("GET", INPUT_ITEMS),
        ]
        .into_iter()
        .map(|(method, path)| Route {
            method: method.into(),
            path: path.into(),
        })
        .collect()
    }

    fn handle(_ctx: RequestContext, req: HttpRequest) -> Action {
        let path = req.path.as_str();
        match req.method.as_str() {
            "POST" if path == RESPONSES => create(&req.body),
            "POST" if path == INPUT_TOKENS => input_tokens(&req.body),
            "GET" if path.ends_with("/input_items") => Action::Respond(input_items(path_id(path))),
            "GET" => {
                let id = path_id(path);
                Action::Respond(match load(id) {
                    Some(s) => json_response(200, s.response),
                    None => not_found(id),
                })
            }
            "DELETE" => {
                let id = path_id(path);
                Action::Respond(if response_store::delete(id) {
                    json_response(
                        200,
                        json!({"id": id, "object": "response", "deleted": true}),
                    )
                } else {
                    not_found(id)
                })
            }
            method => Action::Respond(json_response(
                404,
                error_body(404, &format!("no route {method} {path}"), None, None),
            )),
        }
    }

    fn render(ctx: RequestContext, update: GenerationUpdate) -> HttpResponse {
        let body = OPTIONS.with(|o| {
            let opts = o.borrow();
            let body = render::response(&ctx, &opts, &update);
            keep(&ctx, &opts, &update, &body);
            body
        });
        json_response(200, body)
    }

    fn render_stream(ctx: RequestContext, update: GenerationUpdate) -> Vec<SseEvent> {
        let events = OPTIONS.with(|o| {
            let opts = o.borrow();
            STREAM.with(|s| {
                let mut stream = s.borrow_mut();
                let events = render::stream_events(&ctx, &opts, &mut stream, &update);
                if let Some((whole, body)) = stream.finished.take() {
                    keep(&ctx, &opts, &whole, &body);
                }
                events
            })
        });
        events
            .into_iter()
            .map(|(event, data)| SseEvent { event, data })
            .collect()
    }

    fn render_error(_ctx: RequestContext, error: ApiError) -> HttpResponse {
        let (param, code) = render::host_error_fields(&error);
        json_response(
            error.status,
            error_body(error.status, &error.message, param.as_deref(), code),
        )
    }

    /// A failure after the stream began: `response.failed`, the terminal
    /// event OpenAI sends (clients stop on it rather than waiting for
    /// `response.completed`).
    fn render_stream_error(ctx: RequestContext, error: ApiError) -> Vec<SseEvent> {
        let events = OPTIONS.with(|o| {
            let opts = o.borrow();
            STREAM.with(|s| render::stream_failed(&ctx, &opts, &mut s.borrow_mut(), &error))
        });
        events
            .into_iter()
            .map(|(event, data)| SseEvent { event, data })
            .collect()
    }
}

mlxhost_plugin_sdk::v2::adapter::export_adapter!(Adapter);

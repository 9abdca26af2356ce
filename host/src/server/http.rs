//! HTTP handlers: `GET /health` (host-owned) and every adapter route
//! (dispatched by exact method + path to the adapter that declared it).
//!
//! Per request: a fresh adapter instance turns the body into an action; a
//! generation is prepared (template, tokenize, limits), queued on the
//! engine, and its events are rendered by the same instance either as one
//! response or as SSE. Status is only sent once the engine accepted the job
//! (so a bad plugin parameter is still a 400), and dropping the response
//! (client gone) cancels the job at its next step.

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use tokio::sync::mpsc;

use crate::cache::ResponseStore;
use crate::engine::{FinishReason, GenerateError, GenerateSummary};
use crate::output::{merge, GenerationEvent, OutputPipeline};
use crate::plugin::bindings::v2::tool_parser::mlxhost::plugin::types::FinishReason as WitFinish;
use crate::plugin::{AdapterServices, Kind, LivePlugins, PluginError, PluginHost};

use super::adapter::{
    host_error, Action, AdapterCall, ApiError, ErrorKind, GenerationUpdate, HttpRequest,
    HttpResponse, RequestContext, SseEvent, TokenLogprob, TopLogprob, Usage,
};
use super::request::{prepare, Defaults};
use super::RequestId;
use crate::engine::worker::{EngineHandle, Frontend, Job, JobEvent};

/// Shared by every handler.
pub struct AppState {
    /// The live plugins; each request takes a snapshot at arrival.
    pub plugins: Arc<LivePlugins>,
    /// Set once the model is loaded and warmed up.
    pub frontend: OnceLock<Arc<Frontend>>,
    /// The engine thread.
    pub engine: EngineHandle,
    /// Server defaults.
    pub defaults: Defaults,
    /// Request body cap, bytes.
    pub body_limit: usize,
    /// Most generations queued or running; more get a 503.
    pub max_queue: usize,
    /// Set when shutdown begins.
    pub shutting_down: AtomicBool,
    /// Output pipeline counters, for `/stats`.
    pub output: OutputStats,
    /// Stored responses adapters keep (`--response-store-*`).
    pub response_store: Option<Arc<ResponseStore>>,
    /// API keys, allowed hosts and origins.
    pub access: super::access::AccessPolicy,
    /// Longest wait for a request body once its headers arrived.
    pub body_timeout: std::time::Duration,
    /// Longest a generation may take from arrival (`--request-timeout`);
    /// `None` = no limit.
    pub request_timeout: Option<std::time::Duration>,
    /// How long a stream may be silent before a keep-alive (`--sse-keep-alive`).
    pub sse_keep_alive: std::time::Duration,
    /// `/metrics` values recorded as requests are served.
    pub metrics: super::metrics::Metrics,
    /// Request intake bounds (large bodies, JSON size, preparation).
    pub intake: super::intake::Intake,
}

/// What the output pipelines saw, since start (`/stats` `output`).
#[derive(Debug, Default)]
pub struct OutputStats {
    /// Complete tool calls returned.
    pub tool_calls: std::sync::atomic::AtomicU64,
    /// Calls a parser could not complete, returned as content.
    pub invalid_tool_calls: std::sync::atomic::AtomicU64,
    /// Requests that failed because a parser plugin failed.
    pub parser_failures: std::sync::atomic::AtomicU64,
}

impl OutputStats {
    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "tool_calls": self.tool_calls.load(Ordering::Relaxed),
            "invalid_tool_calls": self.invalid_tool_calls.load(Ordering::Relaxed),
            "parser_failures": self.parser_failures.load(Ordering::Relaxed),
        })
    }

    fn record(&self, p: &OutputPipeline) {
        self.tool_calls
            .fetch_add(p.tool_calls() as u64, Ordering::Relaxed);
        self.invalid_tool_calls
            .fetch_add(p.invalid_calls() as u64, Ordering::Relaxed);
    }
}

/// Seconds a 503 (queue full, loading, shutting down) asks the client to
/// wait before retrying (`Retry-After`).
const RETRY_AFTER_S: &str = "1";

fn response(r: HttpResponse) -> Response {
    let status = StatusCode::from_u16(r.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut resp = Response::new(Body::from(r.body));
    *resp.status_mut() = status;
    if let Ok(v) = HeaderValue::from_str(&r.content_type) {
        resp.headers_mut().insert(header::CONTENT_TYPE, v);
    }
    if status == StatusCode::SERVICE_UNAVAILABLE {
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static(RETRY_AFTER_S));
    }
    resp
}

/// The adapter whose dialect a request speaks: the one serving its path
/// (any method), else the one whose route is the longest segment prefix of
/// it (`/v1/messages/nope` is Anthropic's), else the `anthropic` adapter
/// for a client that sends `anthropic-version`; `None` = the host's own
/// (OpenAI) shape.
fn dialect_of(plugins: &PluginHost, path: &str, headers: &axum::http::HeaderMap) -> Option<String> {
    let routes = super::adapter_routes(plugins);
    routes
        .iter()
        .find(|(_, p, _)| super::route_matches(p, path))
        .or_else(|| {
            routes
                .iter()
                .filter(|(_, p, _)| super::route_prefixes(p, path))
                .max_by_key(|(_, p, _)| p.split('/').count())
        })
        .map(|(_, _, a)| a.clone())
        .or_else(|| {
            let anthropic = headers.contains_key("anthropic-version")
                && routes.iter().any(|(_, _, a)| a == "anthropic");
            anthropic.then(|| "anthropic".to_string())
        })
}

/// An error response in the request's dialect ([`dialect_of`]), rendered
/// by that adapter; the host's shape when none applies or it fails.
pub fn dialect_error(
    app: &AppState,
    path: &str,
    headers: &axum::http::HeaderMap,
    request_id: &str,
    error: ApiError,
) -> Response {
    let adapter = dialect_of(&app.plugins.current(), path, headers);
    adapter_error(app, adapter, request_id, error)
}

/// An error response rendered by a fresh instance of `adapter`; the host's
/// shape when it is `None` or fails.
fn adapter_error(
    app: &AppState,
    adapter: Option<String>,
    request_id: &str,
    error: ApiError,
) -> Response {
    let plugins = app.plugins.current();
    let rendered = adapter.and_then(|adapter| {
        let ctx = RequestContext {
            request_id: request_id.to_string(),
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            model_id: app
                .frontend
                .get()
                .map(|f| f.model_id.clone())
                .unwrap_or_default(),
        };
        let mut call = AdapterCall::new(plugins.clone(), &adapter, ctx, None).ok()?;
        Some(call.render_error(&error))
    });
    response(rendered.unwrap_or_else(|| host_error(&error)))
}

pub(crate) fn api_error(status: u16, kind: ErrorKind, message: impl Into<String>) -> ApiError {
    ApiError {
        status,
        kind,
        message: message.into(),
        param: None,
    }
}

/// `GET /health`: 200 once the model is loaded and warmed up, 503 while
/// loading or shutting down. Answers during generations (never touches the
/// engine thread).
pub async fn health(State(app): State<Arc<AppState>>) -> Response {
    let (status, body) = if app.shutting_down.load(Ordering::Relaxed) {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            serde_json::json!({"status": "shutting_down"}),
        )
    } else if let Some(reason) = crate::distributed::failure() {
        // A tensor-parallel rank is gone: every step fails until restart.
        (
            StatusCode::SERVICE_UNAVAILABLE,
            serde_json::json!({"status": "unhealthy", "error": reason}),
        )
    } else if let Some(f) = app.frontend.get() {
        (
            StatusCode::OK,
            serde_json::json!({"status": "ok", "model": f.model_id, "in_flight": app.engine.in_flight()}),
        )
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            serde_json::json!({"status": "loading"}),
        )
    };
    let mut resp = (status, axum::Json(body)).into_response();
    if status == StatusCode::SERVICE_UNAVAILABLE {
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    resp
}

/// `GET /stats`: the RAM prompt cache's counters (hits, misses, tokens
/// reused, entries, bytes, cap, evictions), the SSD tier's (`null` when
/// off; see `SsdCacheStats`), the scheduler's (`batch`: running rows,
/// waiting requests, prefill tokens per step, batch occupancy, step time
/// and plugin share per batch size; see `SchedulerStats`), the output
/// pipelines' (`output`: tool calls, invalid tool calls returned as
/// content, parser failures), the response store's (`response_store`:
/// entries, bytes, cap; null when off), the plugins (`plugins`: loaded,
/// kept in their last good version after a failed reload, skipped), MLX's
/// memory (`memory`: active, cache, peak and limit bytes, the cache's cap
/// and the weights' share) and the requests in flight.
pub async fn stats(State(app): State<Arc<AppState>>) -> Response {
    let cache = app.engine.prompt_cache_stats();
    let ssd = app.engine.ssd_stats.get().map(|h| h.stats());
    let batch = app.engine.scheduler_stats();
    axum::Json(serde_json::json!({
        "in_flight": app.engine.in_flight(),
        "batch": batch,
        "prompt_cache": cache,
        "ssd_cache": ssd,
        "memory": crate::device_memory::report(),
        "output": app.output.json(),
        "response_store": app.response_store.as_ref().map(|s| s.stats()),
        "plugins": app.plugins.current().status_json(),
    }))
    .into_response()
}

/// A method the host's own routes do not serve: 405 with `Allow`, in the
/// host's error shape (axum's default has no body).
pub async fn method_not_allowed(req: Request) -> Response {
    let message = format!(
        "method {} is not allowed on {} (only GET and HEAD)",
        req.method(),
        req.uri().path()
    );
    let mut resp = response(host_error(&api_error(405, ErrorKind::NotFound, message)));
    resp.headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
    resp
}

/// `GET /metrics`: Prometheus / OpenMetrics text ([`super::metrics`]).
/// Scrape-time values come from the same sources as `/stats`.
pub async fn metrics(State(app): State<Arc<AppState>>) -> Response {
    use super::metrics::{Snapshot, Tier};
    let batch = app.engine.scheduler_stats();
    let ram = app.engine.prompt_cache_stats();
    let mut tiers = vec![Tier {
        name: "ram",
        hits: ram.hits,
        tokens: ram.tokens_reused,
        bytes: ram.bytes as u64,
        entries: ram.entries as u64,
    }];
    if let Some(ssd) = app.engine.ssd_stats.get().map(|h| h.stats()) {
        tiers.push(Tier {
            name: "ssd",
            hits: ssd.hits,
            tokens: ssd.tokens_restored,
            bytes: ssd.bytes,
            entries: ssd.entries as u64,
        });
    }
    let snap = Snapshot {
        in_flight: app.engine.in_flight(),
        waiting: batch.waiting,
        running: batch.running,
        max_batch: batch.max_batch,
        steps: batch.steps,
        prefill_tokens: batch.prefill_tokens,
        decode_tokens: batch.decode_tokens,
        spec_drafted: batch.speculative.drafted,
        spec_accepted: batch.speculative.accepted,
        tiers,
        plugins: crate::plugin::timing::snapshot()
            .into_iter()
            .map(|(name, t)| (name, t.calls, t.seconds))
            .collect(),
    };
    let mut resp = Response::new(Body::from(app.metrics.render(&snap)));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(super::metrics::CONTENT_TYPE),
    );
    resp
}

/// Every other route: find the adapter, let it handle the request.
pub async fn dispatch(
    State(app): State<Arc<AppState>>,
    Extension(request_id): Extension<RequestId>,
    req: Request,
) -> Response {
    let method = req.method().as_str().to_string();
    let path = req.uri().path().to_string();
    let plugins = app.plugins.current();
    let routes = super::adapter_routes(&plugins);
    let Some(adapter) = routes
        .iter()
        .find(|(m, p, _)| *m == method && super::route_matches(p, &path))
        .map(|(_, _, a)| a.clone())
    else {
        let allowed: Vec<&str> = routes
            .iter()
            .filter(|(_, p, _)| super::route_matches(p, &path))
            .map(|(m, _, _)| m.as_str())
            .collect();
        if !allowed.is_empty() {
            let message = format!("method {method} is not allowed on {path}");
            let error = api_error(405, ErrorKind::NotFound, message);
            let mut resp = dialect_error(&app, &path, req.headers(), &request_id.0, error);
            if let Ok(v) = HeaderValue::from_str(&allowed.join(", ")) {
                resp.headers_mut().insert(header::ALLOW, v);
            }
            return resp;
        }
        let message = format!("no route {method} {path} (routes come from API adapter plugins)");
        let error = api_error(404, ErrorKind::NotFound, message);
        return dialect_error(&app, &path, req.headers(), &request_id.0, error);
    };
    let Some(frontend) = app.frontend.get().cloned() else {
        return response(host_error(&api_error(
            503,
            ErrorKind::Server,
            "the model is still loading",
        )));
    };
    let ctx = RequestContext {
        request_id: request_id.0.clone(),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        model_id: frontend.model_id.clone(),
    };
    let services = adapter_services(&app, &plugins, &adapter, &frontend);
    let mut call = match AdapterCall::new(plugins.clone(), &adapter, ctx, Some(services)) {
        Ok(c) => c,
        Err(e) => return response(host_error(&plugin_error(&e))),
    };
    if app.shutting_down.load(Ordering::Relaxed) {
        return response(call.render_error(&api_error(
            503,
            ErrorKind::Server,
            "the server is shutting down",
        )));
    }

    let headers: Vec<(String, String)> = req
        .headers()
        .iter()
        .filter_map(|(k, v)| Some((k.as_str().to_string(), v.to_str().ok()?.to_string())))
        .collect();
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
    let too_large = || {
        api_error(
            413,
            ErrorKind::TooLarge,
            format!(
                "the request body exceeds the server's limit of {} bytes (--body-limit)",
                app.body_limit
            ),
        )
    };
    if declared.is_some_and(|n| n > app.body_limit) {
        return response(call.render_error(&too_large()));
    }
    let chunked = req
        .headers()
        .get(header::TRANSFER_ENCODING)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"chunked"));
    let busy = |e: super::intake::IntakeError| api_error(503, ErrorKind::Server, e.to_string());
    // Held until the request is prepared: a large body's bytes and its
    // parse are what the permit bounds.
    let large_body_permit = match app.intake.admit_body(declared, chunked).await {
        Ok(p) => p,
        Err(e) => return response(call.render_error(&busy(e))),
    };
    let read = axum::body::to_bytes(req.into_body(), app.body_limit);
    let Ok(read) = tokio::time::timeout(app.body_timeout, read).await else {
        let slow = api_error(
            408,
            ErrorKind::InvalidRequest,
            format!(
                "the request body did not arrive within {} s (--body-timeout)",
                app.body_timeout.as_secs()
            ),
        );
        let mut resp = response(call.render_error(&slow));
        // The rest of the body may never come: do not wait for it.
        resp.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        return resp;
    };
    let body = match read {
        Ok(b) => b,
        // axum reports a body over the limit as "length limit exceeded";
        // anything else is a body that could not be read.
        Err(e) if format!("{e:#}").contains("length limit") => {
            return response(call.render_error(&too_large()))
        }
        Err(e) => {
            let bad = api_error(
                400,
                ErrorKind::InvalidRequest,
                format!("the request body could not be read: {e}"),
            );
            return response(call.render_error(&bad));
        }
    };
    if let Err(e) = app.intake.check_json(&body) {
        return response(call.render_error(&api_error(413, ErrorKind::TooLarge, e.to_string())));
    }
    let prepare_permit = match app.intake.admit_prepare().await {
        Ok(p) => p,
        Err(e) => return response(call.render_error(&busy(e))),
    };
    let mut headers = headers;
    if app.defaults.keep_prompt_metadata {
        headers.push((
            super::request::KEEP_METADATA_HEADER.to_string(),
            "true".to_string(),
        ));
    }
    let http_req = HttpRequest {
        method,
        path,
        headers,
        body: body.to_vec(),
    };
    drop(body);
    // Adapter calls and tokenization of a long prompt are CPU work: keep
    // them off the async workers so /health stays responsive.
    let app2 = app.clone();
    let frontend2 = frontend.clone();
    let plugins2 = plugins.clone();
    let joined = tokio::task::spawn_blocking(move || {
        let action = call.handle(&http_req);
        let served = frontend2.lora.read().map(|l| l.clone()).unwrap_or_default();
        let prepared = match action {
            Ok(Action::Respond(r)) if http_req.method == "GET" && http_req.path == "/v1/models" => {
                Ok(Err(super::lora::with_adapters(r, &served)))
            }
            Ok(Action::Respond(r)) => Ok(Err(r)),
            Ok(Action::Generate(g)) => {
                let lora = if served.is_empty() {
                    Ok(None)
                } else {
                    super::lora::resolve(&http_req.body, &frontend2.model_id, &served)
                };
                let constraint = call.take_constraint();
                let strict = call.take_strict_tools();
                let speculation = call.take_speculation();
                match lora
                    .and_then(|lora| {
                        prepare(g, &frontend2, &plugins2, &app2.defaults).map(|mut p| {
                            p.request.lora = lora;
                            p
                        })
                    })
                    .and_then(|mut p| {
                        if speculation.is_some() {
                            p.request.speculative =
                                super::request::speculative(speculation.as_ref(), &app2.defaults);
                        }
                        super::request::constrained(
                            p,
                            constraint,
                            &strict,
                            &plugins2,
                            &app2.defaults,
                        )
                    }) {
                    Ok(p) => Ok(Ok(p)),
                    Err(e) => Ok(Err(call.render_error(&e))),
                }
            }
            Err(e) => Err(e),
        };
        drop(http_req);
        drop((prepare_permit, large_body_permit));
        (call, prepared)
    })
    .await;
    let (call, prepared) = match joined {
        Ok(x) => x,
        Err(e) => {
            return response(host_error(&api_error(
                500,
                ErrorKind::Server,
                format!("request task failed: {e}"),
            )))
        }
    };
    let prepared = match prepared {
        Ok(Ok(p)) => p,
        Ok(Err(r)) => return response(r),
        // The instance that failed cannot render: a fresh one of the
        // same adapter does (the host's shape if that fails too).
        Err(e) => return adapter_error(&app, Some(adapter), &request_id.0, plugin_error(&e)),
    };
    run_generation(app, call, prepared, frontend, request_id, plugins).await
}

/// What adapter `name` may call while serving one request: its part of
/// the response store and the served model's prompt counter.
fn adapter_services(
    app: &Arc<AppState>,
    plugins: &PluginHost,
    name: &str,
    frontend: &Arc<Frontend>,
) -> AdapterServices {
    let frontend = frontend.clone();
    let defaults = app.defaults.clone();
    let count = move |g: super::adapter::GenerationRequest| {
        super::request::count_prompt_tokens(&g, &frontend, &defaults).map_err(|e| e.message)
    };
    AdapterServices {
        namespace: name.to_string(),
        store: app.response_store.clone(),
        count_tokens: Some(Arc::new(count)),
        constraint_plugins: constraint_plugins(plugins),
        default_constraint: app.defaults.grammar_plugin.clone(),
        drafter_plugins: plugins
            .plugins
            .values()
            .filter(|p| p.manifest.kinds.contains(&Kind::Drafter))
            .map(|p| p.manifest.name.clone())
            // The host-native drafter, where `--draft-model` loaded one.
            .chain(
                app.defaults
                    .draft_model
                    .then(|| crate::engine::draft_model::DRAFTER_NAME.to_string()),
            )
            .collect(),
    }
}

/// The names of the constraint plugins `plugins` holds.
fn constraint_plugins(plugins: &PluginHost) -> Vec<String> {
    plugins
        .plugins
        .values()
        .filter(|p| p.manifest.kinds.contains(&Kind::Constraint))
        .map(|p| p.manifest.name.clone())
        .collect()
}

/// Queues the job and renders its events.
async fn run_generation(
    app: Arc<AppState>,
    mut call: AdapterCall,
    prepared: super::request::Prepared,
    frontend: Arc<Frontend>,
    request_id: RequestId,
    plugins: Arc<PluginHost>,
) -> Response {
    let keep_alive_every = app.sse_keep_alive;
    let adapter_keep_alive = plugins
        .get(call.name(), Kind::ApiAdapter)
        .ok()
        .and_then(|p| p.manifest.stream_keep_alive.clone());
    let (tx, rx) = mpsc::unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let mut rx = Events {
        rx,
        deadline: app
            .request_timeout
            .map(|d| (tokio::time::Instant::now() + d, d)),
        cancel: cancel.clone(),
        app: app.clone(),
    };
    let guard = CancelOnDrop(cancel.clone());
    let cancel_flag = cancel.clone();
    let prompt_tokens = prepared.request.prompt_ids.len();
    let job = Job {
        request_id: request_id.0.clone(),
        request: prepared.request,
        events: tx,
        cancel,
        plugins,
        constraint: prepared.constraint,
    };
    if app.engine.in_flight() >= app.max_queue {
        let busy = api_error(
            503,
            ErrorKind::Server,
            format!(
                "the server is busy: {} generations are queued or running (--max-queue)",
                app.max_queue
            ),
        );
        return response(call.render_error(&busy));
    }
    let submitted = std::time::Instant::now();
    if app.engine.submit(job).is_err() {
        return response(call.render_error(&api_error(
            503,
            ErrorKind::Server,
            "the engine is not running",
        )));
    }
    // Wait for the engine to accept (or reject) the job before choosing a status.
    let cached_tokens = match rx.recv().await {
        Ok(Some(JobEvent::Started { cached_tokens })) => cached_tokens,
        Ok(Some(JobEvent::Failed(e))) => return response(call.render_error(&generate_error(&e))),
        Err(timed_out) => return response(call.render_error(&timed_out)),
        Ok(Some(_) | None) => {
            return response(call.render_error(&api_error(
                500,
                ErrorKind::Server,
                "the engine dropped the request",
            )))
        }
    };
    let mut acc = Accumulator::new(frontend, prepared.logprobs);
    let mut clock = TokenClock::new(submitted);
    let mut out = Output {
        pipeline: prepared.pipeline.single_call(prepared.single_call),
        app: app.clone(),
        ended: false,
        cancel: cancel_flag,
    };
    // Forced reply text (tool_choice) is output the model did not sample.
    let forced = match prepared.forced.as_deref().map(|t| out.text(t)) {
        Some(Ok(events)) => events,
        Some(Err(e)) => return response(call.render_error(&e)),
        None => Vec::new(),
    };
    if !prepared.stream {
        let mut events = forced;
        loop {
            let ev = match rx.recv().await {
                Ok(Some(ev)) => ev,
                Ok(None) => break,
                Err(timed_out) => return response(call.render_error(&timed_out)),
            };
            match ev {
                JobEvent::Token(t) => {
                    clock.token(&app.metrics);
                    out.pipeline.token(t.id);
                    acc.token(t)
                }
                JobEvent::Text(t) => match out.text(&t) {
                    Ok(e) => events.extend(e),
                    Err(e) => return response(call.render_error(&e)),
                },
                JobEvent::Finished(summary) => {
                    drop(guard);
                    record_finished(&app.metrics, &summary);
                    match out.finish() {
                        Ok(e) => events.extend(e),
                        Err(e) => return response(call.render_error(&e)),
                    }
                    return match finished_update(&mut acc, &out, 0, merge(events), &summary, &app) {
                        Ok(update) => match call.render(&update) {
                            Ok(r) => response(r),
                            Err(e) => response(host_error(&plugin_error(&e))),
                        },
                        Err(e) => response(call.render_error(&e)),
                    };
                }
                JobEvent::Failed(e) => {
                    record_failed(&app.metrics);
                    return response(call.render_error(&generate_error(&e)));
                }
                JobEvent::Started { .. } => {}
            }
        }
        return response(call.render_error(&api_error(
            500,
            ErrorKind::Server,
            "the engine stopped",
        )));
    }

    // Streamed: a task renders events into the SSE body; when the client
    // goes away the body (and `sse_rx`) is dropped, and the task cancels.
    let (sse_tx, sse_rx) = mpsc::channel::<Event>(64);
    tokio::spawn(async move {
        let _guard = guard;
        let mut sequence = 0u32;
        let mut first = acc.update(sequence, forced);
        // The prompt's size is known before the first token: dialects that
        // report it up front (Anthropic's `message_start`) read it here.
        first.usage = Some(Usage {
            prompt_tokens: prompt_tokens as u32,
            completion_tokens: 0,
            cached_tokens: cached_tokens as u32,
        });
        if !send_all(&mut call, &first, &sse_tx).await {
            return;
        }
        sequence += 1;
        loop {
            let ev = tokio::select! {
                ev = rx.recv() => ev,
                _ = sse_tx.closed() => return,
            };
            let ev = match ev {
                Ok(ev) => ev,
                Err(timed_out) => {
                    send_stream_error(&mut call, &timed_out, &sse_tx).await;
                    return;
                }
            };
            let Some(ev) = ev else {
                let stopped = api_error(500, ErrorKind::Server, "the engine stopped");
                send_stream_error(&mut call, &stopped, &sse_tx).await;
                return;
            };
            match ev {
                JobEvent::Started { .. } => {}
                JobEvent::Token(t) => {
                    clock.token(&app.metrics);
                    out.pipeline.token(t.id);
                    acc.token(t)
                }
                JobEvent::Text(t) => {
                    let events = match out.text(&t) {
                        Ok(e) => e,
                        Err(e) => {
                            send_stream_error(&mut call, &e, &sse_tx).await;
                            return;
                        }
                    };
                    // Text a parser holds back (a possible call) is sent
                    // once it is decided; logprobs wait with it.
                    if events.is_empty() {
                        continue;
                    }
                    let update = acc.update(sequence, events);
                    sequence += 1;
                    if !send_all(&mut call, &update, &sse_tx).await {
                        return;
                    }
                }
                JobEvent::Finished(summary) => {
                    record_finished(&app.metrics, &summary);
                    let events = match out.finish() {
                        Ok(e) => e,
                        Err(e) => {
                            send_stream_error(&mut call, &e, &sse_tx).await;
                            return;
                        }
                    };
                    match finished_update(&mut acc, &out, sequence, events, &summary, &app) {
                        Ok(update) => {
                            send_all(&mut call, &update, &sse_tx).await;
                        }
                        Err(e) => {
                            send_stream_error(&mut call, &e, &sse_tx).await;
                        }
                    }
                    return;
                }
                JobEvent::Failed(e) => {
                    record_failed(&app.metrics);
                    // Headers are sent: the error goes in the stream, in the
                    // adapter's error shape, and the stream ends.
                    send_stream_error(&mut call, &generate_error(&e), &sse_tx).await;
                    return;
                }
            }
        }
    });
    let stream = futures_util::stream::unfold(sse_rx, |mut rx| async move {
        rx.recv().await.map(|e| (Ok::<_, Infallible>(e), rx))
    });
    // During a long prefill nothing else is sent: every 15 s the adapter's
    // keep-alive event (Anthropic's `ping`) or an SSE comment keeps
    // idle-timeout proxies and clients' watchdogs from cutting the stream.
    let keep_alive = axum::response::sse::KeepAlive::new().interval(keep_alive_every);
    let keep_alive = match adapter_keep_alive {
        Some(k) => keep_alive.event(sse_event(SseEvent {
            event: k.event,
            data: k.data,
        })),
        None => keep_alive,
    };
    Sse::new(stream).keep_alive(keep_alive).into_response()
}

/// Token timing of one generation for `/metrics`: TTFT from submission,
/// then the gap between consecutive tokens.
struct TokenClock {
    submitted: std::time::Instant,
    last: Option<std::time::Instant>,
}

impl TokenClock {
    fn new(submitted: std::time::Instant) -> Self {
        TokenClock {
            submitted,
            last: None,
        }
    }

    fn token(&mut self, m: &super::metrics::Metrics) {
        let now = std::time::Instant::now();
        match self.last {
            None => m.ttft.observe((now - self.submitted).as_secs_f64()),
            Some(prev) => m.inter_token.observe((now - prev).as_secs_f64()),
        }
        self.last = Some(now);
    }
}

fn record_finished(m: &super::metrics::Metrics, summary: &GenerateSummary) {
    m.prompt_tokens.inc_by(summary.prompt_tokens as u64);
    m.cached_tokens.inc_by(summary.cached_tokens as u64);
    m.completion_tokens.inc_by(summary.completion_tokens as u64);
    let finish = match summary.finish_reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Cancelled => "cancelled",
    };
    m.generations
        .get_or_create(&super::metrics::FinishLabels {
            finish_reason: finish.into(),
        })
        .inc();
}

fn record_failed(m: &super::metrics::Metrics) {
    m.generations
        .get_or_create(&super::metrics::FinishLabels {
            finish_reason: "error".into(),
        })
        .inc();
}

/// Longest wait, after `--request-timeout` passed, for the engine to stop
/// the generation (it does at its next step).
const TIMEOUT_SETTLE: std::time::Duration = std::time::Duration::from_secs(5);

/// A job's events with the request's deadline (`--request-timeout`).
struct Events {
    rx: mpsc::UnboundedReceiver<JobEvent>,
    /// (when, the configured limit).
    deadline: Option<(tokio::time::Instant, std::time::Duration)>,
    /// The job's cancel flag, set when the deadline passes.
    cancel: Arc<AtomicBool>,
    /// Where a timed-out generation's end is counted.
    app: Arc<AppState>,
}

impl Events {
    /// The next event (`None`: the engine dropped the job). Errors: the
    /// deadline passed; the generation is then cancelled and its end
    /// awaited (a step, at most [`TIMEOUT_SETTLE`]), so the client that
    /// gets the 504 finds its slot free for a retry.
    async fn recv(&mut self) -> Result<Option<JobEvent>, ApiError> {
        let Some((at, limit)) = self.deadline else {
            return Ok(self.rx.recv().await);
        };
        tokio::select! {
            ev = self.rx.recv() => return Ok(ev),
            _ = tokio::time::sleep_until(at) => {}
        }
        self.cancel.store(true, Ordering::Relaxed);
        let settle = async {
            while let Some(ev) = self.rx.recv().await {
                match ev {
                    JobEvent::Finished(summary) => {
                        record_finished(&self.app.metrics, &summary);
                        break;
                    }
                    JobEvent::Failed(_) => {
                        record_failed(&self.app.metrics);
                        break;
                    }
                    _ => {}
                }
            }
        };
        let _ = tokio::time::timeout(TIMEOUT_SETTLE, settle).await;
        Err(api_error(
            504,
            ErrorKind::Server,
            format!(
                "the request took longer than {} s and was stopped (--request-timeout)",
                limit.as_secs_f64()
            ),
        ))
    }
}

/// A request's output pipeline with the server's counters: a parser
/// failure fails the request (500 naming the plugin), counted in `/stats`.
struct Output {
    pipeline: OutputPipeline,
    app: Arc<AppState>,
    /// The reply ended here (the engine is told to stop the row; what it
    /// still sends is not output), as at a stop string.
    ended: bool,
    cancel: Arc<AtomicBool>,
}

impl Output {
    fn text(&mut self, t: &str) -> Result<Vec<GenerationEvent>, ApiError> {
        let events = self.pipeline.text(t).map_err(|e| self.failed(e))?;
        self.stop_if_ended();
        Ok(events)
    }

    fn finish(&mut self) -> Result<Vec<GenerationEvent>, ApiError> {
        let events = self.pipeline.finish().map_err(|e| self.failed(e))?;
        self.app.output.record(&self.pipeline);
        Ok(events)
    }

    /// The reply ended early (its only allowed call): stop the row.
    fn stop_if_ended(&mut self) {
        if self.pipeline.ended() && !self.ended {
            self.ended = true;
            self.cancel.store(true, Ordering::Relaxed);
        }
    }

    fn failed(&self, e: PluginError) -> ApiError {
        self.app
            .output
            .parser_failures
            .fetch_add(1, Ordering::Relaxed);
        api_error(500, ErrorKind::Plugin, e.to_string())
    }
}

/// Sends an error body as the stream's last event (headers are already
/// sent, so the error travels in the stream, in the adapter's shape).
async fn send_error_event(tx: &mpsc::Sender<Event>, body: HttpResponse) {
    let _ = tx
        .send(Event::default().data(String::from_utf8_lossy(&body.body)))
        .await;
}

/// One adapter SSE event as an axum event: `event:` before `data:`, the
/// order OpenAI and Anthropic write their frames in (axum writes fields in
/// the order they are set).
fn sse_event(e: SseEvent) -> Event {
    let event = Event::default();
    let event = if e.event.is_empty() {
        event
    } else {
        event.event(e.event)
    };
    event.data(e.data)
}

/// Sends an error as the stream's last events, in the adapter's shape
/// (`render-stream-error`).
async fn send_stream_error(call: &mut AdapterCall, error: &ApiError, tx: &mpsc::Sender<Event>) {
    for e in call.render_stream_error(error) {
        let event = sse_event(e);
        if tx.send(event).await.is_err() {
            return;
        }
    }
}

/// Renders one update and sends its events; false when the client is gone
/// or the adapter failed (the error is sent in the stream first).
async fn send_all(
    call: &mut AdapterCall,
    update: &GenerationUpdate,
    tx: &mpsc::Sender<Event>,
) -> bool {
    let events = match call.render_stream(update) {
        Ok(e) => e,
        Err(e) => {
            tracing::warn!(error = %e, "adapter failed while streaming");
            send_error_event(tx, host_error(&plugin_error(&e))).await;
            return false;
        }
    };
    for e in events {
        let event = sse_event(e);
        if tx.send(event).await.is_err() {
            return false;
        }
    }
    true
}

/// The last update of a generation, or the error to report when it ended
/// because the server is shutting down.
fn finished_update(
    acc: &mut Accumulator,
    out: &Output,
    sequence: u32,
    events: Vec<GenerationEvent>,
    summary: &GenerateSummary,
    app: &AppState,
) -> Result<GenerationUpdate, ApiError> {
    let finish = match summary.finish_reason {
        // A reply that made a complete call ends for the client to run it;
        // so does one the pipeline ended after its only allowed call (the
        // engine reports that row as cancelled).
        _ if out.ended => WitFinish::ToolCalls,
        FinishReason::Stop | FinishReason::Length if out.pipeline.tool_calls() > 0 => {
            WitFinish::ToolCalls
        }
        FinishReason::Stop => WitFinish::Stop,
        FinishReason::Length => WitFinish::Length,
        FinishReason::Cancelled => {
            let why = if app.engine.cancel_all.load(Ordering::Relaxed) {
                "the server shut down before the generation finished"
            } else {
                "the generation was cancelled"
            };
            return Err(api_error(503, ErrorKind::Server, why));
        }
    };
    let mut update = acc.update(sequence, events);
    update.finish = Some(finish);
    update.stop_sequence = summary.stop_sequence.clone();
    update.usage = Some(Usage {
        prompt_tokens: summary.prompt_tokens as u32,
        completion_tokens: summary.completion_tokens as u32,
        cached_tokens: summary.cached_tokens as u32,
    });
    Ok(update)
}

/// Collects tokens' logprobs until the text they belong to is emitted.
struct Accumulator {
    frontend: Arc<Frontend>,
    logprobs: bool,
    pending: Vec<TokenLogprob>,
}

impl Accumulator {
    fn new(frontend: Arc<Frontend>, logprobs: bool) -> Self {
        Accumulator {
            frontend,
            logprobs,
            pending: Vec::new(),
        }
    }

    fn token(&mut self, t: crate::engine::TokenInfo) {
        // The EOS token ends generation but is not output (as OpenAI and
        // vLLM report it); it still counts in `usage.completion_tokens`.
        if !self.logprobs || self.frontend.eos_ids.contains(&t.id) {
            return;
        }
        let top = t
            .top
            .iter()
            .map(|&(id, logprob)| {
                let bytes = self.frontend.tokenizer.token_bytes(id);
                TopLogprob {
                    token: String::from_utf8_lossy(&bytes).into_owned(),
                    bytes,
                    id,
                    logprob,
                }
            })
            .collect();
        let bytes = self.frontend.tokenizer.token_bytes(t.id);
        self.pending.push(TokenLogprob {
            token: String::from_utf8_lossy(&bytes).into_owned(),
            bytes,
            id: t.id,
            logprob: t.logprob,
            top,
        });
    }

    fn update(&mut self, sequence: u32, events: Vec<GenerationEvent>) -> GenerationUpdate {
        GenerationUpdate {
            sequence,
            events,
            logprobs: std::mem::take(&mut self.pending),
            finish: None,
            stop_sequence: None,
            usage: None,
        }
    }
}

/// Sets the job's cancel flag when the response (or stream task) is dropped.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// A plugin error as an API error: rejected parameters and unknown plugins
/// are the client's fault (400), the rest a 500 naming the plugin. A
/// rejection names `plugin_params.<plugin>` in `param` (the object the
/// plugin was handed; the Anthropic adapter leads its message with it).
fn plugin_error(e: &PluginError) -> ApiError {
    match e {
        PluginError::Rejected { plugin, .. } => ApiError {
            param: Some(format!("plugin_params.{plugin}")),
            ..api_error(400, ErrorKind::InvalidRequest, e.to_string())
        },
        PluginError::Grammar { field, .. } => ApiError {
            param: Some(field.clone()),
            ..api_error(400, ErrorKind::InvalidRequest, e.to_string())
        },
        PluginError::Unknown { .. } => api_error(400, ErrorKind::InvalidRequest, e.to_string()),
        PluginError::OutOfMemory { plugin, cap_bytes } => api_error(
            413,
            ErrorKind::TooLarge,
            format!(
                "the request is too large for the `{plugin}` adapter's memory cap of {} MiB (--adapter-memory)",
                cap_bytes >> 20
            ),
        ),
        _ => api_error(500, ErrorKind::Plugin, e.to_string()),
    }
}

fn generate_error(e: &GenerateError) -> ApiError {
    match e {
        GenerateError::InvalidRequest(m) => api_error(400, ErrorKind::InvalidRequest, m.clone()),
        GenerateError::Plugin(p) => plugin_error(p),
        GenerateError::Model(m) => api_error(500, ErrorKind::Server, m.to_string()),
        GenerateError::Internal(m) => {
            api_error(500, ErrorKind::Server, format!("internal error: {m}"))
        }
        // The prompt is what does not fit (its field's name is the
        // dialect's: `messages`, `prompt`, `input`); the message says so.
        GenerateError::OverMemoryBudget(m) => api_error(400, ErrorKind::InvalidRequest, m.clone()),
        GenerateError::Unavailable(m) => api_error(503, ErrorKind::Server, m.clone()),
    }
}

//! The HTTP server (`mlxhost serve`): axum on tokio for HTTP, one engine
//! thread for the model. The host owns listening, body limits, SSE framing,
//! errors and `/health`; API adapter plugins own the dialects and their
//! routes (`docs/architecture.md`).

pub mod access;
pub mod adapter;
mod adapter_v1;
mod guard;
pub mod http;
pub mod intake;
pub mod listen;
pub mod lora;
pub mod metrics;
pub mod request;
pub mod strict_tools;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method};
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::get;

use crate::engine::worker as engine;
use crate::engine::SchedulerConfig;
use crate::model::LoadedModel;
use crate::plugin::{Kind, LivePlugins, PluginHost};

pub use request::Defaults;

/// Everything `serve` needs besides the model loader.
pub struct ServeConfig {
    /// Address to listen on.
    pub addr: SocketAddr,
    /// The plugins directory, live (hot reload).
    pub plugins: Arc<LivePlugins>,
    /// Request defaults.
    pub defaults: Defaults,
    /// Request body cap, bytes.
    pub body_limit: usize,
    /// After SIGTERM/SIGINT, how long in-flight requests may finish before
    /// they are cancelled.
    pub drain: Duration,
    /// The cache tiers (RAM prompt cache, SSD tier).
    pub caches: engine::CacheConfig,
    /// Most generations queued or running; more get a 503.
    pub max_queue: usize,
    /// The continuous-batching scheduler's settings (`--batch`,
    /// `--prefill-budget`).
    pub schedule: SchedulerConfig,
    /// Stored responses adapters keep (`--response-store-*`); `None` = none.
    pub response_store: Option<Arc<crate::cache::ResponseStore>>,
    /// API keys, allowed hosts and origins.
    pub access: access::AccessPolicy,
    /// Header timeout and connection cap.
    pub connections: listen::ConnectionLimits,
    /// Longest wait for a request body (`--body-timeout`).
    pub body_timeout: Duration,
    /// Longest a generation may take (`--request-timeout`); `None` = none.
    pub request_timeout: Option<Duration>,
    /// How long a stream may be silent before a keep-alive is sent.
    pub sse_keep_alive: Duration,
    /// Request intake bounds (large bodies, JSON size, preparation).
    pub intake: intake::Intake,
}

/// Errors that stop the server.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The address could not be bound.
    #[error("cannot listen on {addr} (--host, --port)")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The model failed to load or warm up.
    #[error("{0}")]
    Load(String),
    /// Runtime or I/O failure.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// How long after the drain period (and the cancellation of what still
/// runs) the server waits for connections to close before it stops anyway.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// How long shutdown waits for the engine to write unwritten SSD cache
/// entries (after any job still running has been cancelled): the engine's
/// own wait for the writer plus time to hand the last entries over.
const SHUTDOWN_FLUSH: Duration = engine::SHUTDOWN_FLUSH.saturating_add(Duration::from_secs(30));

/// The server-generated request id assigned by the middleware (unique per
/// request; also the `x-request-id` response header unless the client sent
/// its own).
#[derive(Debug, Clone)]
pub struct RequestId(pub String);

/// What `run` reports once the server is ready (for the startup summary).
pub struct Ready {
    /// Bound address.
    pub addr: SocketAddr,
    /// The model as clients see it.
    pub frontend: Arc<engine::Frontend>,
    /// (method, path, adapter).
    pub routes: Vec<(String, String, String)>,
}

/// Serves until SIGTERM/SIGINT. The listener is bound first, so `/health`
/// answers 503 while `load` runs on the engine thread; `on_ready` is called
/// once the model is warmed up.
///
/// Errors: bind failure, model load or warm-up failure, runtime failure.
pub fn run(
    config: ServeConfig,
    load: Box<dyn FnOnce() -> Result<(LoadedModel, String), String> + Send>,
    on_ready: impl FnOnce(&Ready) + Send + 'static,
) -> Result<(), ServeError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("http")
        .build()?;
    rt.block_on(serve(config, load, on_ready))
}

/// The adapter routes of a plugins snapshot as (method, path, adapter);
/// `/health` and duplicates (first adapter by name wins) are left out.
pub fn adapter_routes(plugins: &PluginHost) -> Vec<(String, String, String)> {
    let mut routes: Vec<(String, String, String)> = Vec::new();
    for p in plugins.plugins.values() {
        if !p.manifest.kinds.contains(&Kind::ApiAdapter) {
            continue;
        }
        for (method, path) in &p.routes {
            if path == "/health" || path == "/stats" || path == "/" {
                tracing::debug!(adapter = %p.manifest.name, %path, "route is the host's; ignored");
                continue;
            }
            if let Some((_, _, owner)) = routes.iter().find(|(m, q, _)| m == method && q == path) {
                tracing::debug!(adapter = %p.manifest.name, %method, %path, %owner, "route already served; ignored");
                continue;
            }
            routes.push((method.clone(), path.clone(), p.manifest.name.clone()));
        }
    }
    // Literal paths are tried before `{name}` patterns, so
    // `/v1/responses/input_tokens` wins over `/v1/responses/{id}`.
    routes.sort_by_key(|(_, path, _)| path.contains('{'));
    routes
}

/// Whether request path `path` matches route `pattern`: equal segment by
/// segment, a `{name}` segment matching any one non-empty segment.
pub fn route_matches(pattern: &str, path: &str) -> bool {
    let (mut p, mut q) = (pattern.split('/'), path.split('/'));
    loop {
        match (p.next(), q.next()) {
            (None, None) => return true,
            (Some(a), Some(b)) if a.starts_with('{') && a.ends_with('}') => {
                if b.is_empty() {
                    return false;
                }
            }
            (Some(a), Some(b)) if a == b => {}
            _ => return false,
        }
    }
}

/// Whether `pattern` (as in [`route_matches`]) matches the leading
/// segments of `path`, with at least one segment after it
/// (`/v1/messages` prefixes `/v1/messages/x`, not `/v1/messagesx`).
pub fn route_prefixes(pattern: &str, path: &str) -> bool {
    let n = pattern.split('/').count();
    let segments: Vec<&str> = path.split('/').collect();
    segments.len() > n && route_matches(pattern, &segments[..n].join("/"))
}

async fn serve(
    config: ServeConfig,
    load: Box<dyn FnOnce() -> Result<(LoadedModel, String), String> + Send>,
    on_ready: impl FnOnce(&Ready) + Send + 'static,
) -> Result<(), ServeError> {
    let listener = tokio::net::TcpListener::bind(config.addr)
        .await
        .map_err(|source| ServeError::Bind {
            addr: config.addr,
            source,
        })?;
    let addr = listener.local_addr()?;
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
    let engine = engine::spawn(
        load,
        config.plugins.clone(),
        config.defaults.sampler.clone(),
        config.caches,
        config.schedule,
        ready_tx,
    )?;
    let routes = adapter_routes(&config.plugins.current());
    let app = Arc::new(http::AppState {
        plugins: config.plugins,
        frontend: OnceLock::new(),
        engine,
        defaults: config.defaults,
        body_limit: config.body_limit,
        max_queue: config.max_queue,
        shutting_down: AtomicBool::new(false),
        output: Default::default(),
        response_store: config.response_store,
        access: config.access,
        body_timeout: config.body_timeout,
        request_timeout: config.request_timeout,
        sse_keep_alive: config.sse_keep_alive,
        intake: config.intake,
        metrics: Default::default(),
    });
    let host_only = || get(http::health).fallback(http::method_not_allowed);
    let mut router = axum::Router::new()
        .route("/health", host_only())
        // Clients probe the server's root first (Claude Code sends `HEAD /`).
        .route("/", host_only())
        .route(
            "/stats",
            get(http::stats).fallback(http::method_not_allowed),
        )
        .route(
            "/metrics",
            get(http::metrics).fallback(http::method_not_allowed),
        )
        .fallback(http::dispatch)
        // The host enforces the limit itself (with a dialect-shaped 413).
        .layer(axum::extract::DefaultBodyLimit::disable())
        .layer(axum::middleware::from_fn_with_state(
            app.clone(),
            guard::guard,
        ));
    if let Some(cors) = guard::cors_layer(&app.access) {
        router = router.layer(cors);
    }
    let router = router
        .layer(axum::middleware::from_fn_with_state(
            app.clone(),
            request_id,
        ))
        .with_state(app.clone());

    // Load in the background while /health answers 503.
    let (fail_tx, mut fail_rx) = tokio::sync::mpsc::channel::<String>(1);
    let app_ready = app.clone();
    tokio::spawn(async move {
        match ready_rx.await {
            Ok(Ok(frontend)) => {
                let frontend = Arc::new(frontend);
                let _ = app_ready.frontend.set(frontend.clone());
                on_ready(&Ready {
                    addr,
                    frontend,
                    routes,
                });
            }
            Ok(Err(e)) => {
                let _ = fail_tx.send(e).await;
            }
            Err(_) => {
                let _ = fail_tx
                    .send("the engine thread stopped while loading".into())
                    .await;
            }
        }
    });

    let shutdown_app = app.clone();
    let drain = config.drain;
    // Graceful shutdown waits for every connection; a client that stops
    // reading (or never finishes its body) would hold it forever, so the
    // server stops anyway this long after the drain period.
    let hard_stop = Arc::new(tokio::sync::Notify::new());
    let hard_stop_timer = hard_stop.clone();
    let load_failed = Arc::new(OnceLock::<String>::new());
    let failed = load_failed.clone();
    let shutdown = async move {
        tokio::select! {
            _ = shutdown_signal() => {}
            Some(e) = fail_rx.recv() => { let _ = failed.set(e); }
        }
        shutdown_app.shutting_down.store(true, Ordering::Relaxed);
        let in_flight = shutdown_app.engine.in_flight();
        tracing::info!(
            in_flight,
            drain_s = drain.as_secs(),
            "shutting down: draining in-flight requests"
        );
        // After the drain period, cancel what is still running so the
        // graceful shutdown can complete.
        let cancel = shutdown_app.clone();
        tokio::spawn(async move {
            tokio::time::sleep(drain).await;
            if cancel.engine.in_flight() > 0 {
                tracing::warn!("drain period over: cancelling in-flight generations");
            }
            cancel.engine.cancel_all.store(true, Ordering::Relaxed);
            tokio::time::sleep(SHUTDOWN_GRACE).await;
            hard_stop_timer.notify_one();
        });
    };
    let server = listen::serve(listener, router, config.connections, shutdown);
    tokio::select! {
        _ = server => {},
        _ = hard_stop.notified() => {
            tracing::warn!(grace_s = SHUTDOWN_GRACE.as_secs(), "connections still open after the drain period; stopping anyway");
        }
    }
    if let Some(e) = load_failed.get() {
        // The engine thread is still dropping what it loaded; exiting now
        // would race MLX's destructors (an abort instead of exit code 1).
        join_engine(&app).await;
        return Err(ServeError::Load(e.clone()));
    }
    // Write the cache entries not yet on disk (SSD tier) before exiting.
    let engine_app = app.clone();
    let flushed = tokio::task::spawn_blocking(move || engine_app.engine.shutdown(SHUTDOWN_FLUSH))
        .await
        .unwrap_or(false);
    if !flushed {
        tracing::warn!("the engine did not finish writing the SSD cache before shutdown");
    } else {
        join_engine(&app).await;
    }
    tracing::info!("server stopped");
    Ok(())
}

/// Joins the engine thread, waiting at most [`SHUTDOWN_FLUSH`] (a thread
/// stuck in a step is left behind rather than hanging the exit).
async fn join_engine(app: &Arc<http::AppState>) {
    let app = app.clone();
    let joined = tokio::task::spawn_blocking(move || app.engine.join());
    if tokio::time::timeout(SHUTDOWN_FLUSH, joined).await.is_err() {
        tracing::warn!("the engine thread did not stop in time");
    }
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = terminate => {}
    }
}

/// Assigns every request a server-generated id, unique across requests and
/// restarts (plugins build response ids from it, and the response store keys
/// on those, so a client's value must never become it), logs the request
/// with it, and returns it as `x-request-id`. A client's own `x-request-id`
/// (when short and printable) is logged beside it and echoed back instead,
/// so a client can still correlate its requests.
async fn request_id(
    State(app): State<Arc<http::AppState>>,
    mut req: Request,
    next: Next,
) -> Response {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let client_id = req
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| {
            !v.is_empty()
                && v.len() <= 64
                && v.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        })
        .map(str::to_string);
    let id = format!(
        "{:x}{:06x}",
        process_start_nanos() & 0xffff_ffff,
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    req.extensions_mut().insert(RequestId(id.clone()));
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let started = std::time::Instant::now();
    let span = tracing::info_span!(
        "request",
        request_id = %id,
        client_request_id = client_id.as_deref().unwrap_or("")
    );
    let mut resp = {
        let _e = span.enter();
        tracing::debug!(%method, %path, "request");
        drop(_e);
        next.run(req).await
    };
    let _e = span.enter();
    tracing::info!(
        %method,
        %path,
        status = resp.status().as_u16(),
        ms = started.elapsed().as_millis() as u64,
        "response"
    );
    app.metrics
        .requests
        .get_or_create(&metrics::RequestLabels {
            route: route_label(&app, &path),
            // Extension methods are client-minted: one label for them all.
            method: match method {
                Method::GET
                | Method::POST
                | Method::PUT
                | Method::DELETE
                | Method::HEAD
                | Method::OPTIONS
                | Method::PATCH => method.as_str().to_string(),
                _ => "other".to_string(),
            },
            status: resp.status().as_u16(),
        })
        .inc();
    if let Ok(v) = HeaderValue::from_str(client_id.as_deref().unwrap_or(&id)) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

/// The `route` label of a request: a host path, the adapter route pattern
/// it matched, or `other` (arbitrary paths must not mint label values).
fn route_label(app: &http::AppState, path: &str) -> String {
    if matches!(path, "/" | "/health" | "/stats" | "/metrics") {
        return path.to_string();
    }
    adapter_routes(&app.plugins.current())
        .into_iter()
        .find(|(_, p, _)| route_matches(p, path))
        .map(|(_, p, _)| p)
        .unwrap_or_else(|| "other".into())
}

/// Nanoseconds since the epoch at first use: makes ids unique across restarts.
fn process_start_nanos() -> u128 {
    static START: OnceLock<u128> = OnceLock::new();
    *START.get_or_init(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    })
}

#[cfg(test)]
mod route_tests {
    use super::route_matches;

    #[test]
    fn placeholders_match_one_non_empty_segment() {
        assert!(route_matches("/v1/models", "/v1/models"));
        assert!(!route_matches("/v1/models", "/v1/models/x"));
        assert!(route_matches("/v1/responses/{id}", "/v1/responses/resp_1"));
        assert!(!route_matches("/v1/responses/{id}", "/v1/responses/"));
        assert!(!route_matches("/v1/responses/{id}", "/v1/responses"));
        assert!(!route_matches("/v1/responses/{id}", "/v1/responses/a/b"));
        assert!(route_matches(
            "/v1/responses/{id}/input_items",
            "/v1/responses/r/input_items"
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::{route_matches, route_prefixes};

    #[test]
    fn routes_match_whole_paths_and_prefix_deeper_ones() {
        assert!(route_matches("/v1/responses/{id}", "/v1/responses/r1"));
        assert!(!route_matches("/v1/responses/{id}", "/v1/responses/"));
        assert!(route_prefixes("/v1/messages", "/v1/messages/nope"));
        assert!(route_prefixes("/v1/messages", "/v1/messages/a/b"));
        assert!(!route_prefixes("/v1/messages", "/v1/messages"));
        assert!(!route_prefixes("/v1/messages", "/v1/messagesx"));
        assert!(!route_prefixes("/v1/messages", "/v1/chat/completions"));
    }
}

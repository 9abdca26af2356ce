//! The middleware that applies the [`AccessPolicy`] to every request
//! before its route runs, and the CORS layer for `--allowed-origins`.
//! Refusals are rendered in the request's dialect (the adapter serving its
//! path, or Anthropic's for a client sending `anthropic-version`).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method};
use axum::middleware::Next;
use axum::response::Response;
use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};

use super::access::{AccessPolicy, Refusal};
use super::adapter::ErrorKind;
use super::http::{api_error, dialect_error, AppState};
use super::RequestId;

/// Paths anyone may read (liveness probes; clients probing the root).
fn is_open(path: &str) -> bool {
    path == "/health" || path == "/"
}

/// The host's own routes (no request body, not an adapter's).
fn is_host_route(path: &str) -> bool {
    is_open(path) || path == "/stats" || path == "/metrics"
}

/// Longest request target (path and query) served, bytes; longer gets a
/// 414 (llama.cpp's server and nginx use 8 KiB too).
pub const MAX_URI_BYTES: usize = 8 << 10;
/// Most header bytes (names and values) served; more gets a 431. hyper
/// itself refuses, with an empty body, headers past its ~400 KiB buffer.
pub const MAX_HEADER_BYTES: usize = 64 << 10;
/// Most header fields served; more gets a 431 (hyper's own default).
pub const MAX_HEADER_COUNT: usize = 100;
/// The header fields hyper parses before it refuses a request with an
/// empty 431 of its own: room above [`MAX_HEADER_COUNT`] so that requests
/// just past the limit get [`guard`]'s refusal in the dialect's shape.
pub const PARSED_HEADER_COUNT: usize = 1000;

/// Why a request's head is refused before routing (414/431), if it is.
fn oversized_head(req: &Request) -> Option<(u16, String)> {
    let target = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().len())
        .unwrap_or(0);
    if target > MAX_URI_BYTES {
        return Some((
            414,
            format!("the request target is {target} bytes; at most {MAX_URI_BYTES} are served"),
        ));
    }
    let headers: usize = req
        .headers()
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len())
        .sum();
    let count = req.headers().len();
    if count > MAX_HEADER_COUNT {
        return Some((
            431,
            format!("the request has {count} header fields; at most {MAX_HEADER_COUNT} are served"),
        ));
    }
    (headers > MAX_HEADER_BYTES).then(|| {
        (
            431,
            format!(
                "the request headers are {headers} bytes; at most {MAX_HEADER_BYTES} are served"
            ),
        )
    })
}

/// Checks the head's size, `Host`, `Origin`, the API key and the content
/// type; a refusal answers 414/431/401/403/415 in the dialect's error shape.
pub async fn guard(State(app): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    if let Some((status, message)) = oversized_head(&req) {
        tracing::info!(status, "request refused: {message}");
        return refuse(&app, &req, &path, status, message);
    }
    let json_route = !is_host_route(&path) && {
        let plugins = app.plugins.current();
        super::adapter_routes(&plugins)
            .iter()
            .any(|(_, p, _)| super::route_matches(p, &path))
    };
    let checked = app.access.check(
        req.method(),
        req.uri(),
        req.headers(),
        is_open(&path),
        json_route,
    );
    let Err(refusal) = checked else {
        return next.run(req).await;
    };
    tracing::info!(%path, reason = %refusal.message(), "request refused");
    let mut resp = refuse(&app, &req, &path, refusal.status(), refusal.message());
    if refusal == Refusal::Unauthorized {
        resp.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    resp
}

/// A refusal of `req` with `status` and `message`, in the dialect of the
/// adapter serving `path` (or Anthropic's for `anthropic-version` clients).
fn refuse(app: &AppState, req: &Request, path: &str, status: u16, message: String) -> Response {
    let id = req
        .extensions()
        .get::<RequestId>()
        .map(|r| r.0.clone())
        .unwrap_or_default();
    let error = api_error(status, ErrorKind::InvalidRequest, message);
    dialect_error(app, path, req.headers(), &id, error)
}

/// The CORS layer for `--allowed-origins` (tower-http: preflights answered
/// with the allowed methods, the headers the page asked for and a 10-minute
/// max age); `None` when no origin is allowed (CORS off: preflights then
/// reach [`guard`] and are refused for their `Origin`).
pub fn cors_layer(policy: &AccessPolicy) -> Option<CorsLayer> {
    if policy.allowed_origins.is_empty() {
        return None;
    }
    let origin = if policy.allowed_origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        // The same case-insensitive match as the guard's (scheme and host
        // are case-insensitive): the grant echoes the page's own spelling.
        let policy = policy.clone();
        AllowOrigin::predicate(move |origin, _| {
            origin.to_str().is_ok_and(|o| policy.origin_allowed(o))
        })
    };
    Some(
        CorsLayer::new()
            .allow_origin(origin)
            .allow_methods([Method::GET, Method::POST, Method::DELETE, Method::OPTIONS])
            .allow_headers(AllowHeaders::mirror_request())
            .expose_headers([header::HeaderName::from_static("x-request-id")])
            .max_age(Duration::from_secs(600)),
    )
}

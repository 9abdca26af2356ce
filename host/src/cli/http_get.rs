//! A one-shot `GET` against a running server, for CLI commands that report
//! its state (`plugins list --server`). Plain HTTP/1.1 over hyper's client;
//! the server is local or on a trusted network (no TLS, as `serve` has none).

use anyhow::{bail, Context};
use axum::http::{header, Request, Uri};
use hyper_util::rt::TokioIo;

/// Largest response read, bytes (`/stats` is a few KiB).
const MAX_RESPONSE_BYTES: usize = 16 << 20;

/// `GET {base}{path}` as JSON.
///
/// Errors: a URL that is not `http://host[:port]`, a failed connection, a
/// non-2xx status (with the server's message), or a body that is not JSON.
pub fn get_json(
    base: &str,
    path: &str,
    api_key: Option<&str>,
) -> anyhow::Result<serde_json::Value> {
    let uri: Uri = format!("{}{path}", base.trim_end_matches('/'))
        .parse()
        .with_context(|| format!("--server `{base}` is not a URL (e.g. http://127.0.0.1:8080)"))?;
    if uri.scheme_str() != Some("http") {
        bail!("--server `{base}`: only http:// URLs are served (mlxhost has no TLS)");
    }
    let authority = uri
        .authority()
        .with_context(|| format!("--server `{base}` names no host"))?
        .clone();
    let address = format!(
        "{}:{}",
        authority.host(),
        authority.port_u16().unwrap_or(80)
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let stream = tokio::net::TcpStream::connect(&address)
            .await
            .with_context(|| format!("cannot connect to {address} (--server)"))?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(conn);
        let mut request = Request::get(uri.path()).header(header::HOST, authority.as_str());
        if let Some(key) = api_key {
            request = request.header(header::AUTHORIZATION, format!("Bearer {key}"));
        }
        let response = sender
            .send_request(request.body(axum::body::Body::empty())?)
            .await
            .with_context(|| format!("GET {uri} failed"))?;
        let status = response.status();
        let body = axum::body::to_bytes(
            axum::body::Body::new(response.into_body()),
            MAX_RESPONSE_BYTES,
        )
        .await
        .with_context(|| format!("reading GET {uri}"))?;
        if !status.is_success() {
            bail!("GET {uri}: {status}: {}", String::from_utf8_lossy(&body));
        }
        serde_json::from_slice(&body).with_context(|| format!("GET {uri} did not answer JSON"))
    })
}

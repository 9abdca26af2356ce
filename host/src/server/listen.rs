//! The accept loop: HTTP/1.1 connections served by hyper with the limits
//! `axum::serve` does not offer. A client that is slow to send its headers
//! (or keeps an idle keep-alive connection open) is disconnected after
//! `header_timeout`; at most `max_connections` are open at once (further
//! clients wait in the kernel's accept queue); shutdown stops accepting
//! and lets open connections finish (graceful: in-flight responses end,
//! idle connections close).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// Connection limits (`--header-timeout`, `--max-connections`).
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// Longest wait for a request's headers, the first or the next on a
    /// kept-alive connection (so also the idle keep-alive timeout).
    pub header_timeout: Duration,
    /// Most connections open at once.
    pub max_connections: usize,
}

/// Serves `router` on `listener` until `shutdown` resolves, then waits for
/// open connections to finish.
///
/// Errors: none; accept failures (e.g. out of file descriptors) are logged
/// and retried after a pause.
pub async fn serve(
    listener: TcpListener,
    router: axum::Router,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()>,
) {
    let graceful = GracefulShutdown::new();
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
            _ = &mut shutdown => break,
        };
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _peer)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        // Tokens are small writes: send each at once.
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(router.clone());
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
            .max_headers(super::guard::PARSED_HEADER_COUNT)
            .serve_connection(TokioIo::new(stream), service);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

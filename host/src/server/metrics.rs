//! `GET /metrics`: the server's counters in the OpenMetrics text format
//! (which Prometheus scrapes), written with the `prometheus-client` crate.
//!
//! Two kinds of values: those recorded as traffic flows ([`Metrics`]:
//! requests by route and status, tokens, TTFT and inter-token latency
//! histograms), and those read from the engine, caches and plugins when
//! scraped (queue depth, running rows, cache hits and bytes per tier,
//! plugin call time by plugin), so the hot paths keep their own counters
//! and this module never touches them.

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Labels of `mlxhost_http_requests_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// The route pattern (`/v1/responses/{response_id}`), a host path, or
    /// `other` (unknown paths are not labels: a client could mint them).
    pub route: String,
    /// HTTP method.
    pub method: String,
    /// Response status.
    pub status: u16,
}

/// Labels of `mlxhost_generations_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FinishLabels {
    /// `stop`, `length`, `cancelled`, `error`, ...
    pub finish_reason: String,
}

/// Values recorded as requests are served.
#[derive(Debug)]
pub struct Metrics {
    /// Responses by route, method and status.
    pub requests: Family<RequestLabels, Counter>,
    /// Finished generations by finish reason.
    pub generations: Family<FinishLabels, Counter>,
    /// Prompt tokens of finished generations.
    pub prompt_tokens: Counter,
    /// Of those, tokens whose KV came from a cache tier.
    pub cached_tokens: Counter,
    /// Generated tokens.
    pub completion_tokens: Counter,
    /// Seconds from a generation's submission to its first token.
    pub ttft: Histogram,
    /// Seconds between consecutive tokens of one generation.
    pub inter_token: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Family::default(),
            generations: Family::default(),
            prompt_tokens: Counter::default(),
            cached_tokens: Counter::default(),
            completion_tokens: Counter::default(),
            // 5 ms .. ~82 s
            ttft: Histogram::new(exponential_buckets(0.005, 2.0, 15)),
            // 1 ms .. ~4 s
            inter_token: Histogram::new(exponential_buckets(0.001, 2.0, 13)),
        }
    }
}

/// What is read at scrape time (see `http::metrics` for the sources).
#[derive(Debug, Default, Clone)]
pub struct Snapshot {
    /// Generations queued or running.
    pub in_flight: usize,
    /// Requests waiting for a batch slot.
    pub waiting: usize,
    /// Rows in the running batch.
    pub running: usize,
    /// `--batch`.
    pub max_batch: usize,
    /// Steps run; prompt tokens prefilled; tokens decoded.
    pub steps: u64,
    /// Prompt tokens prefilled by the scheduler.
    pub prefill_tokens: u64,
    /// Tokens decoded by the scheduler.
    pub decode_tokens: u64,
    /// Speculative decoding: draft tokens fed for verification, and of
    /// those accepted.
    pub spec_drafted: u64,
    /// See `spec_drafted`.
    pub spec_accepted: u64,
    /// Per cache tier (`ram`, `ssd`): (hits, misses or `None`, tokens
    /// reused, bytes held, entries).
    pub tiers: Vec<Tier>,
    /// Per plugin: (name, calls, seconds inside them).
    pub plugins: Vec<(String, u64, f64)>,
}

/// One cache tier's counters.
#[derive(Debug, Default, Clone)]
pub struct Tier {
    /// `ram` or `ssd`.
    pub name: &'static str,
    /// Lookups served from this tier.
    pub hits: u64,
    /// Prompt tokens whose KV this tier supplied.
    pub tokens: u64,
    /// Bytes held.
    pub bytes: u64,
    /// Entries held.
    pub entries: u64,
}

fn labeled<L>(labels: L) -> Vec<(String, String)>
where
    L: IntoIterator<Item = (&'static str, String)>,
{
    labels
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
}

impl Metrics {
    /// The whole exposition: recorded values and `snap`, OpenMetrics text
    /// (ends in `# EOF`). Prefix `mlxhost_`; counters end in `_total`,
    /// times are seconds, sizes bytes.
    pub fn render(&self, snap: &Snapshot) -> String {
        let mut r = Registry::with_prefix("mlxhost");
        // Clones share their values with `self` (they are handles).
        r.register(
            "http_requests",
            "HTTP responses by route, method and status",
            self.requests.clone(),
        );
        r.register(
            "generations",
            "Finished generations by finish reason",
            self.generations.clone(),
        );
        r.register(
            "prompt_tokens",
            "Prompt tokens of finished generations",
            self.prompt_tokens.clone(),
        );
        r.register(
            "prompt_tokens_cached",
            "Prompt tokens whose KV came from a cache tier instead of prefill",
            self.cached_tokens.clone(),
        );
        r.register(
            "completion_tokens",
            "Generated tokens",
            self.completion_tokens.clone(),
        );
        r.register(
            "time_to_first_token_seconds",
            "Seconds from a generation's submission to its first token (TTFT)",
            self.ttft.clone(),
        );
        r.register(
            "inter_token_latency_seconds",
            "Seconds between consecutive tokens of one generation",
            self.inter_token.clone(),
        );
        r.register(
            "requests_in_flight",
            "Generations queued or running",
            ConstGauge::new(snap.in_flight as i64),
        );
        r.register(
            "queue_depth",
            "Requests waiting for a batch slot",
            ConstGauge::new(snap.waiting as i64),
        );
        r.register(
            "batch_running_rows",
            "Rows in the running batch",
            ConstGauge::new(snap.running as i64),
        );
        r.register(
            "batch_max_rows",
            "The batch size limit (--batch)",
            ConstGauge::new(snap.max_batch as i64),
        );
        let memory = Family::<Vec<(String, String)>, Gauge>::default();
        let m = crate::device_memory::report();
        for (kind, bytes) in [
            ("active", Some(m.now.active_bytes)),
            ("cache", Some(m.now.cache_bytes)),
            ("peak", Some(m.now.peak_bytes)),
            ("limit", Some(m.now.limit_bytes)),
            ("cache_limit", m.cache_limit_bytes),
            ("weights", m.weights_bytes),
        ] {
            if let Some(b) = bytes {
                memory
                    .get_or_create(&labeled([("kind", kind.to_string())]))
                    .set(i64::try_from(b).unwrap_or(i64::MAX));
            }
        }
        r.register(
            "memory_bytes",
            "MLX's memory by kind: active (weights, KV, activations), cache (freed buffers kept), \
             peak, limit, cache_limit (--memory-limit, --memory-cache) and weights",
            memory,
        );
        r.register(
            "engine_steps",
            "Scheduler steps run",
            ConstCounter::new(snap.steps),
        );
        r.register(
            "engine_prefill_tokens",
            "Prompt tokens prefilled",
            ConstCounter::new(snap.prefill_tokens),
        );
        r.register(
            "engine_decode_tokens",
            "Tokens decoded",
            ConstCounter::new(snap.decode_tokens),
        );
        r.register(
            "spec_draft_tokens",
            "Speculative decoding: draft tokens fed for verification",
            ConstCounter::new(snap.spec_drafted),
        );
        r.register(
            "spec_accepted_tokens",
            "Speculative decoding: draft tokens accepted (emitted as drafted)",
            ConstCounter::new(snap.spec_accepted),
        );
        r.register(
            "spec_acceptance_rate",
            "Speculative decoding: accepted / drafted since start (0 before any draft)",
            ConstGauge::new(if snap.spec_drafted > 0 {
                snap.spec_accepted as f64 / snap.spec_drafted as f64
            } else {
                0.0
            }),
        );
        let hits = Family::<Vec<(String, String)>, Counter>::default();
        let tokens = Family::<Vec<(String, String)>, Counter>::default();
        let bytes =
            Family::<Vec<(String, String)>, prometheus_client::metrics::gauge::Gauge>::default();
        let entries =
            Family::<Vec<(String, String)>, prometheus_client::metrics::gauge::Gauge>::default();
        for t in &snap.tiers {
            let l = labeled([("tier", t.name.to_string())]);
            hits.get_or_create(&l).inc_by(t.hits);
            tokens.get_or_create(&l).inc_by(t.tokens);
            bytes.get_or_create(&l).set(t.bytes as i64);
            entries.get_or_create(&l).set(t.entries as i64);
        }
        r.register("cache_hits", "Prompt-cache lookups served, by tier", hits);
        r.register(
            "cache_tokens_reused",
            "Prompt tokens whose KV a cache tier supplied, by tier",
            tokens,
        );
        r.register("cache_bytes", "Bytes held by each cache tier", bytes);
        r.register("cache_entries", "Entries held by each cache tier", entries);
        let calls = Family::<Vec<(String, String)>, Counter>::default();
        let seconds =
            Family::<Vec<(String, String)>, Counter<f64, std::sync::atomic::AtomicU64>>::default();
        for (name, n, s) in &snap.plugins {
            let l = labeled([("plugin", name.clone())]);
            calls.get_or_create(&l).inc_by(*n);
            seconds.get_or_create(&l).inc_by(*s);
        }
        r.register("plugin_calls", "Plugin calls made, by plugin", calls);
        r.register(
            "plugin_call_seconds",
            "Seconds spent inside plugin calls, by plugin",
            seconds,
        );
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut out, &r);
        out
    }
}

/// The Content-Type of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recorded_and_scraped_values_are_exposed() {
        let m = Metrics::default();
        m.requests
            .get_or_create(&RequestLabels {
                route: "/v1/chat/completions".into(),
                method: "POST".into(),
                status: 200,
            })
            .inc();
        m.completion_tokens.inc_by(7);
        m.ttft.observe(0.25);
        let snap = Snapshot {
            running: 2,
            tiers: vec![Tier {
                name: "ram",
                hits: 3,
                ..Default::default()
            }],
            plugins: vec![("standard".into(), 10, 0.5)],
            ..Default::default()
        };
        let text = m.render(&snap);
        assert!(text.contains(
            "mlxhost_http_requests_total{route=\"/v1/chat/completions\",method=\"POST\",status=\"200\"} 1"
        ), "{text}");
        assert!(text.contains("mlxhost_completion_tokens_total 7"), "{text}");
        assert!(text.contains("mlxhost_batch_running_rows 2"), "{text}");
        assert!(
            text.contains("mlxhost_cache_hits_total{tier=\"ram\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("mlxhost_plugin_call_seconds_total{plugin=\"standard\"} 0.5"),
            "{text}"
        );
        assert!(
            text.contains("mlxhost_time_to_first_token_seconds_count 1"),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"));
    }
}

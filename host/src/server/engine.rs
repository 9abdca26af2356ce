//! The engine thread: owns the model (MLX arrays never leave it) and runs
//! queued generations one at a time (serial mode; continuous batching is a
//! later step of the scheduler). HTTP handlers talk to it through a job
//! queue and get events back on a per-job channel, so they never block it
//! and it never blocks them.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedSender;

use crate::cache::ssd::{KvGeometry, ModelIdentity, SsdStatsHandle};
use crate::cache::{PrefixCache, PromptCache, PromptCacheStats, SsdCache, SsdConfig};
use crate::engine::{self, GenerateError, GenerateEvent, GenerateRequest, GenerateSummary};
use crate::model::{ChatTemplate, LoadedModel, TextTokenizer};
use crate::plugin::{LivePlugins, PluginHost};

/// What request handlers need from the model without touching the engine
/// thread: the tokenizer, the chat template and the model's limits.
#[derive(Clone)]
pub struct Frontend {
    /// The id clients see (`model` in responses).
    pub model_id: String,
    /// Text <-> ids.
    pub tokenizer: TextTokenizer,
    /// The chat template (`None`: the model has none; chat requests fail).
    pub template: Option<ChatTemplate>,
    /// Every id that ends generation.
    pub eos_ids: Vec<u32>,
    /// Context length, tokens.
    pub context: usize,
    /// Vocabulary size (logits width).
    pub vocab: usize,
    /// Compute path, for the startup summary.
    pub compute: String,
}

/// Events a job sends back, in order: `Started`, then `Token`/`Text`
/// interleaved, then exactly one of `Finished` or `Failed` (or `Failed`
/// alone when the request is rejected before it starts).
#[derive(Debug)]
pub enum JobEvent {
    /// The chain accepted the request (headers can be sent now).
    Started,
    /// A token was chosen (raw logprob and alternatives).
    Token(engine::generate::TokenInfo),
    /// Final text.
    Text(String),
    /// Done.
    Finished(GenerateSummary),
    /// Failed; nothing more follows.
    Failed(GenerateError),
}

/// A generation waiting for the engine.
pub struct Job {
    /// For logs.
    pub request_id: String,
    /// The canonical engine request.
    pub request: GenerateRequest,
    /// Where events go; a closed receiver cancels the job.
    pub events: UnboundedSender<JobEvent>,
    /// Set by the HTTP side when the client went away.
    pub cancel: Arc<AtomicBool>,
    /// The plugins snapshot the request was validated against (a hot reload
    /// after that does not change this request's chain).
    pub plugins: Arc<PluginHost>,
}

/// Entries unwritten for this long are written after the next request even
/// when requests never settle.
const MAX_UNWRITTEN: Duration = Duration::from_secs(30);

/// The cache tiers' settings.
#[derive(Debug, Clone, Default)]
pub struct CacheConfig {
    /// RAM prompt cache cap, bytes (0 disables it).
    pub prompt_cache_bytes: usize,
    /// The SSD tier, when on.
    pub ssd: Option<SsdConfig>,
    /// How long the queue must stay empty before unwritten entries go to
    /// the SSD tier (write-behind after requests settle).
    pub settle: Duration,
}

enum Msg {
    Job(Box<Job>),
    /// Write every unwritten cache entry, answer, and stop.
    Shutdown(mpsc::Sender<bool>),
}

/// The HTTP side's handle on the engine thread.
pub struct EngineHandle {
    jobs: mpsc::Sender<Msg>,
    /// The prompt cache's counters, refreshed after every job.
    pub cache_stats: Arc<std::sync::Mutex<PromptCacheStats>>,
    /// The SSD tier's counters (set once the model is loaded, when on).
    pub ssd_stats: Arc<OnceLock<SsdStatsHandle>>,
    /// Set at shutdown once the drain period is over: running jobs stop at
    /// their next step.
    pub cancel_all: Arc<AtomicBool>,
    queued: Arc<AtomicUsize>,
}

/// The engine thread is gone (it panicked or shut down).
#[derive(Debug, thiserror::Error)]
#[error("the engine is not running")]
pub struct EngineGone;

impl EngineHandle {
    /// Queues a job. Errors when the engine thread has stopped.
    pub fn submit(&self, job: Job) -> Result<(), EngineGone> {
        self.queued.fetch_add(1, Ordering::Relaxed);
        self.jobs.send(Msg::Job(Box::new(job))).map_err(|_| {
            self.queued.fetch_sub(1, Ordering::Relaxed);
            EngineGone
        })
    }

    /// Jobs queued or running.
    pub fn in_flight(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }

    /// Asks the engine thread to write unwritten cache entries to the SSD
    /// tier and stop, after the jobs already queued; waits at most
    /// `timeout`. Returns whether everything was written.
    pub fn shutdown(&self, timeout: Duration) -> bool {
        let (tx, rx) = mpsc::channel();
        if self.jobs.send(Msg::Shutdown(tx)).is_err() {
            return true;
        }
        rx.recv_timeout(timeout).unwrap_or(false)
    }
}

/// Starts the engine thread: `load` runs on it (the model lives there),
/// the model's vocabulary is lent to `plugins` (and every later reload),
/// then a warm-up generation with `warmup_sampler`, then `ready` receives
/// the [`Frontend`] (or the load/warm-up error) and jobs are served.
pub fn spawn(
    load: Box<dyn FnOnce() -> Result<(LoadedModel, String), String> + Send>,
    plugins: Arc<LivePlugins>,
    warmup_sampler: String,
    caches: CacheConfig,
    ready: tokio::sync::oneshot::Sender<Result<Frontend, String>>,
) -> std::io::Result<EngineHandle> {
    let (tx, rx) = mpsc::channel::<Msg>();
    let cache_stats = Arc::new(std::sync::Mutex::new(
        PromptCache::new(caches.prompt_cache_bytes).stats(),
    ));
    let stats = cache_stats.clone();
    let ssd_stats = Arc::new(OnceLock::new());
    let ssd_stats_set = ssd_stats.clone();
    let cancel_all = Arc::new(AtomicBool::new(false));
    let queued = Arc::new(AtomicUsize::new(0));
    let (c, q) = (cancel_all.clone(), queued.clone());
    std::thread::Builder::new()
        .name("engine".into())
        .spawn(move || {
            let (model, model_id) = match load() {
                Ok(m) => m,
                Err(e) => {
                    let _ = ready.send(Err(e));
                    return;
                }
            };
            plugins.set_vocab(Arc::new(crate::plugin::VocabView::new(
                model.tokenizer.clone(),
            )));
            if let Err(e) = warm_up(&model, &plugins.current(), &warmup_sampler) {
                let _ = ready.send(Err(format!("warm-up generation failed: {e}")));
                return;
            }
            // The cache tiers live here, beside the model whose KV they hold.
            let ssd = match &caches.ssd {
                Some(cfg) => match open_ssd(&model, cfg) {
                    Ok(ssd) => {
                        let _ = ssd_stats_set
                            .set(ssd.stats_handle(&engine::generate::kv_namespace(&model)));
                        Some(ssd)
                    }
                    Err(e) => {
                        let _ = ready.send(Err(e));
                        return;
                    }
                },
                None => None,
            };
            let caches_settle = caches.settle.max(Duration::from_millis(1));
            let mut caches = PrefixCache::new(PromptCache::new(caches.prompt_cache_bytes), ssd);
            let frontend = Frontend {
                model_id,
                tokenizer: model.tokenizer.clone(),
                template: model.template.clone(),
                eos_ids: model.eos_ids.clone(),
                context: model.model.config.max_position_embeddings,
                vocab: model.model.config.vocab_size,
                compute: format!("{:?}", model.compute),
            };
            if ready.send(Ok(frontend)).is_err() {
                return;
            }
            drop(plugins);
            let mut unwritten_since: Option<Instant> = None;
            loop {
                // With unwritten entries, wait only until requests settle.
                let msg = if caches.has_unwritten() {
                    match rx.recv_timeout(caches_settle) {
                        Ok(m) => m,
                        Err(mpsc::RecvTimeoutError::Timeout) => {
                            guarded("settle", || caches.settle());
                            unwritten_since = None;
                            continue;
                        }
                        Err(mpsc::RecvTimeoutError::Disconnected) => break,
                    }
                } else {
                    match rx.recv() {
                        Ok(m) => m,
                        Err(_) => break,
                    }
                };
                let job = match msg {
                    Msg::Job(job) => job,
                    Msg::Shutdown(ack) => {
                        let flushed = guarded("flush", || caches.flush(SHUTDOWN_FLUSH));
                        let _ = ack.send(flushed.unwrap_or(false));
                        return;
                    }
                };
                // A panic fails only this job (its event channel is dropped,
                // which the HTTP side reports as a 500).
                let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    run_job(&model, *job, &c, &mut caches, &stats)
                }));
                if ran.is_err() {
                    tracing::error!("the engine panicked while running a job; it keeps serving");
                }
                guarded("spill", || caches.spill_evicted());
                if caches.has_unwritten() {
                    let since = *unwritten_since.get_or_insert_with(Instant::now);
                    if since.elapsed() >= MAX_UNWRITTEN {
                        guarded("settle", || caches.settle());
                        unwritten_since = None;
                    }
                }
                if let Ok(mut s) = stats.lock() {
                    *s = caches.ram_stats();
                }
                q.fetch_sub(1, Ordering::Relaxed);
            }
            // Every handle is gone: write what is left.
            guarded("flush", || caches.flush(SHUTDOWN_FLUSH));
        })?;
    Ok(EngineHandle {
        jobs: tx,
        cache_stats,
        ssd_stats,
        cancel_all,
        queued,
    })
}

/// How long a shutdown waits for the SSD writer (the HTTP side waits a
/// little longer for the engine's answer).
pub const SHUTDOWN_FLUSH: Duration = Duration::from_secs(60);

/// Runs cache upkeep so a panic (an MLX exception surfacing through
/// mlx-rs) loses that upkeep, not the engine thread.
fn guarded<T>(what: &str, f: impl FnOnce() -> T) -> Option<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(v) => Some(v),
        Err(_) => {
            tracing::error!(what, "the cache tiers panicked; the engine keeps serving");
            None
        }
    }
}

/// Opens the SSD tier for `model`: fingerprints the checkpoint (config and
/// weights content) and the tokenizer.
fn open_ssd(model: &LoadedModel, cfg: &SsdConfig) -> Result<SsdCache, String> {
    let started = Instant::now();
    let fingerprint =
        crate::model::fingerprint::fingerprint(&model.path, &model.format).map_err(|e| {
            format!(
                "fingerprinting {} for --ssd-cache: {e}",
                model.path.display()
            )
        })?;
    let config = &model.model.config;
    let identity = ModelIdentity {
        model: fingerprint,
        tokenizer: model
            .tokenizer
            .fingerprint()
            .map_err(|e| format!("fingerprinting the tokenizer for --ssd-cache: {e}"))?,
        geometry: KvGeometry {
            layers: config.num_hidden_layers,
            kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim(),
            dtype: model.model.dtype,
        },
    };
    let ssd = SsdCache::open(cfg, identity).map_err(|e| e.to_string())?;
    let stats = ssd
        .stats_handle(&engine::generate::kv_namespace(model))
        .stats();
    tracing::info!(
        dir = %cfg.dir.display(),
        entries = stats.entries,
        entries_all = stats.entries_all,
        bytes = stats.bytes,
        quarantined = stats.quarantined,
        ms = started.elapsed().as_millis() as u64,
        "SSD cache opened"
    );
    Ok(ssd)
}

/// Two tokens through the whole path (template, prefill, plugin chain,
/// decode), so the first request does not pay one-time costs and a broken
/// default sampler is found before the server reports ready.
fn warm_up(model: &LoadedModel, plugins: &PluginHost, sampler: &str) -> Result<(), String> {
    let prompt_ids = model.tokenizer.encode("Hello").map_err(|e| e.to_string())?;
    let req = GenerateRequest {
        prompt_ids,
        max_tokens: 2,
        stop: Vec::new(),
        params: crate::plugin::SamplingParams {
            temperature: 0.0,
            ..Default::default()
        },
        sampler: sampler.into(),
        processors: Vec::new(),
        plugin_params: serde_json::json!({}),
        top_logprobs: 0,
    };
    engine::generate(model, plugins, &req, None, |_| {}, || false)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

fn run_job(
    model: &LoadedModel,
    job: Job,
    cancel_all: &AtomicBool,
    caches: &mut PrefixCache,
    stats: &std::sync::Mutex<PromptCacheStats>,
) {
    let Job {
        request_id,
        request,
        events,
        cancel,
        plugins,
    } = job;
    let span = tracing::info_span!("generate", request_id = %request_id);
    let _enter = span.enter();
    if cancel.load(Ordering::Relaxed) || events.is_closed() {
        tracing::info!("cancelled before it started");
        return;
    }
    if cancel_all.load(Ordering::Relaxed) {
        let _ = events.send(JobEvent::Failed(GenerateError::Unavailable(
            "the server is shutting down".into(),
        )));
        return;
    }
    let started = Instant::now();
    let mut first_token = None;
    let result = engine::generate(
        model,
        &plugins,
        &request,
        Some(caches),
        |ev| {
            let out = match ev {
                GenerateEvent::Started => JobEvent::Started,
                GenerateEvent::Token(t) => {
                    first_token.get_or_insert_with(|| started.elapsed());
                    JobEvent::Token(t)
                }
                GenerateEvent::Text(t) => JobEvent::Text(t),
            };
            let _ = events.send(out);
        },
        || {
            cancel.load(Ordering::Relaxed)
                || cancel_all.load(Ordering::Relaxed)
                || events.is_closed()
        },
    );
    // Published before the response ends, so a client that reads /stats
    // after its response sees its own request counted.
    if let Ok(mut s) = stats.lock() {
        *s = caches.ram_stats();
    }
    match result {
        Ok(summary) => {
            tracing::info!(
                prompt_tokens = summary.prompt_tokens,
                cached_tokens = summary.cached_tokens,
                completion_tokens = summary.completion_tokens,
                ttft_ms = first_token.map(|d| d.as_millis() as u64),
                decode_tok_s = format!("{:.1}", summary.decode_tok_s()),
                finish = ?summary.finish_reason,
                "generation finished"
            );
            let _ = events.send(JobEvent::Finished(summary));
        }
        Err(e) => {
            tracing::warn!(error = %e, "generation failed");
            let _ = events.send(JobEvent::Failed(e));
        }
    }
}

//! The engine thread: owns the model (MLX arrays never leave it), both
//! cache tiers and the [`Scheduler`]; HTTP handlers talk to it through a job
//! queue and get events back on a per-job channel, so they never block it
//! and it never blocks them. Between steps it takes every queued message, so
//! new requests join the running batch at the next step.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedSender;

use super::request::{
    kv_namespace, FinishReason, GenerateError, GenerateEvent, GenerateRequest, GenerateSummary,
    TokenInfo,
};
use super::scheduler::{ChainSource, Pending, Scheduler, SchedulerConfig, SchedulerStats};
use super::sequence::SequenceSink;
use crate::cache::ssd::{KvGeometry, ModelIdentity, SsdStatsHandle};
use crate::cache::{PrefixCache, PromptCache, PromptCacheStats, SsdCache, SsdConfig};
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
    /// The LoRA adapters served (`--lora-dir`), kept current by the engine.
    pub lora: crate::model::lora::LoraListing,
}

/// Events a job sends back, in order: `Started`, then `Token`/`Text`
/// interleaved, then exactly one of `Finished` or `Failed` (or `Failed`
/// alone when the request is rejected before it starts).
#[derive(Debug)]
pub enum JobEvent {
    /// The chain accepted the request (headers can be sent now); how many
    /// prompt tokens the prompt cache supplied.
    Started {
        /// Prompt tokens whose KV came from the prompt cache.
        cached_tokens: usize,
    },
    /// A token was chosen (raw logprob and alternatives).
    Token(TokenInfo),
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
    /// The grammar its output must match (structured output), if any.
    pub constraint: Option<crate::plugin::constraint::ConstraintRequest>,
}

/// Builds every constraint plugin's per-model engine (its token trie over
/// the vocabulary: ~0.5 s for Qwen's 152k tokens) before the server is
/// ready, so the first structured-output request does not stall the batch
/// it joins. A failure is logged; such a plugin fails its requests later.
fn warm_constraints(plugins: &PluginHost) {
    let names: Vec<String> = plugins
        .plugins
        .values()
        .filter(|p| p.manifest.kinds.contains(&crate::plugin::Kind::Constraint))
        .map(|p| p.manifest.name.clone())
        .collect();
    for name in names {
        let started = Instant::now();
        let warmed = plugins
            .constraint(&name)
            .and_then(|shared| shared.lock().unwrap_or_else(|p| p.into_inner()).warm());
        match warmed {
            Ok(()) => {
                tracing::info!(plugin = %name, ms = started.elapsed().as_millis() as u64, "constraint engine built")
            }
            Err(e) => {
                tracing::warn!(plugin = %name, error = %e, "constraint engine could not be built")
            }
        }
    }
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
    /// The prompt cache's counters, refreshed after every step that retired
    /// a row (before that row's response ends).
    pub cache_stats: Arc<Mutex<PromptCacheStats>>,
    /// The scheduler's counters, refreshed after every step.
    pub batch_stats: Arc<Mutex<SchedulerStats>>,
    /// The SSD tier's counters (set once the model is loaded, when on).
    pub ssd_stats: Arc<OnceLock<SsdStatsHandle>>,
    /// Set at shutdown once the drain period is over: running jobs stop at
    /// their next step.
    pub cancel_all: Arc<AtomicBool>,
    queued: Arc<AtomicUsize>,
    /// The engine thread, joined by [`EngineHandle::join`].
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
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

    /// The prompt cache's counters now (defaults if the lock is poisoned).
    pub fn prompt_cache_stats(&self) -> PromptCacheStats {
        self.cache_stats
            .lock()
            .map(|s| s.clone())
            .unwrap_or_default()
    }

    /// The scheduler's counters now (defaults if the lock is poisoned).
    pub fn scheduler_stats(&self) -> SchedulerStats {
        self.batch_stats
            .lock()
            .map(|s| s.clone())
            .unwrap_or_default()
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

    /// Waits for the engine thread to end (after a failed load, or after
    /// [`EngineHandle::shutdown`]); at most once, later calls return at once.
    /// The process must not exit while that thread still frees MLX arrays:
    /// MLX's static destructors would race it (a heap-corruption abort).
    pub fn join(&self) {
        let thread = self.thread.lock().ok().and_then(|mut t| t.take());
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

/// Starts the engine thread: `load` runs on it (the model lives there),
/// the model's vocabulary is lent to `plugins` (and every later reload),
/// then a warm-up through the scheduler with `warmup_sampler`, then `ready`
/// receives the [`Frontend`] (or the load/warm-up error) and jobs are
/// served, batched by a scheduler with `schedule`.
pub fn spawn(
    load: Box<dyn FnOnce() -> Result<(LoadedModel, String), String> + Send>,
    plugins: Arc<LivePlugins>,
    warmup_sampler: String,
    caches: CacheConfig,
    schedule: SchedulerConfig,
    ready: tokio::sync::oneshot::Sender<Result<Frontend, String>>,
) -> std::io::Result<EngineHandle> {
    let (tx, rx) = mpsc::channel::<Msg>();
    let cache_stats = Arc::new(Mutex::new(
        PromptCache::new(caches.prompt_cache_bytes).stats(),
    ));
    let batch_stats = Arc::new(Mutex::new(Scheduler::new(schedule).stats()));
    let ssd_stats = Arc::new(OnceLock::new());
    let cancel_all = Arc::new(AtomicBool::new(false));
    let queued = Arc::new(AtomicUsize::new(0));
    let shared = Shared {
        cache_stats: cache_stats.clone(),
        batch_stats: batch_stats.clone(),
        ssd_stats: ssd_stats.clone(),
        cancel_all: cancel_all.clone(),
        queued: queued.clone(),
    };
    let thread = std::thread::Builder::new()
        .name("engine".into())
        .spawn(move || {
            let Some(mut engine) = Engine::start(
                load,
                &plugins,
                &warmup_sampler,
                caches,
                schedule,
                shared,
                ready,
            ) else {
                return;
            };
            drop(plugins);
            engine.serve(rx);
        })?;
    Ok(EngineHandle {
        jobs: tx,
        cache_stats,
        batch_stats,
        ssd_stats,
        cancel_all,
        queued,
        thread: Mutex::new(Some(thread)),
    })
}

/// What the engine thread shares with the handle.
struct Shared {
    cache_stats: Arc<Mutex<PromptCacheStats>>,
    batch_stats: Arc<Mutex<SchedulerStats>>,
    ssd_stats: Arc<OnceLock<SsdStatsHandle>>,
    cancel_all: Arc<AtomicBool>,
    queued: Arc<AtomicUsize>,
}

/// Responses held until the step's counters are published, so a client that
/// reads `/stats` after its response sees its own request counted.
type Outbox = Rc<RefCell<Vec<(UnboundedSender<JobEvent>, JobEvent)>>>;

/// The engine thread's state.
struct Engine {
    model: LoadedModel,
    caches: PrefixCache,
    settle: Duration,
    scheduler: Scheduler<'static>,
    shared: Shared,
    outbox: Outbox,
}

impl Engine {
    /// Loads, lends the vocabulary, warms up, opens the SSD tier and
    /// reports ready; `None` (after telling `ready`) when any of it failed.
    fn start(
        load: Box<dyn FnOnce() -> Result<(LoadedModel, String), String> + Send>,
        plugins: &LivePlugins,
        warmup_sampler: &str,
        caches: CacheConfig,
        schedule: SchedulerConfig,
        shared: Shared,
        ready: tokio::sync::oneshot::Sender<Result<Frontend, String>>,
    ) -> Option<Engine> {
        let (model, model_id) = match load() {
            Ok(m) => m,
            Err(e) => {
                let _ = ready.send(Err(e));
                return None;
            }
        };
        plugins.set_vocab(Arc::new(
            crate::plugin::VocabView::new(model.tokenizer.clone())
                .with_model(model.eos_ids.clone(), model.model.config().vocab_size),
        ));
        // The model is loaded and nothing else allocated yet: what MLX
        // holds now is its weights (a device budget is computed from it).
        let weights = crate::device_memory::record_weights();
        // `--decode-lookahead auto` depends on the backend and the model's
        // size (see `Lookahead::resolve`).
        let gpu = crate::runtime::gpu_available();
        let schedule = SchedulerConfig {
            decode_lookahead: schedule.decode_lookahead.resolve(gpu, weights),
            ..schedule
        };
        tracing::info!(
            on = schedule.decode_lookahead.is_on(),
            gpu,
            weights_bytes = weights,
            "decode lookahead"
        );
        warm_constraints(&plugins.current());
        let device_limits = match schedule.memory_budget {
            crate::engine::admission::MemoryBudget::Device { limits, keep } => Some((limits, keep)),
            _ => None,
        };
        let mut scheduler = Scheduler::new(schedule);
        if let (Some((limits, keep)), Some(0)) = (device_limits, scheduler.memory_budget()) {
            let gib = crate::engine::admission::gib;
            let _ = ready.send(Err(format!(
                "--memory-limit {} leaves no memory for KV caches: the weights take {}, \
                 --memory-cache {} and --prompt-cache {}; raise the limit or lower the caches",
                gib(limits.limit),
                gib(crate::device_memory::record_weights()),
                gib(limits.cache_limit),
                gib(keep)
            )));
            return None;
        }
        match scheduler.memory_budget() {
            Some(b) => tracing::info!(
                memory_budget = %crate::engine::admission::gib(b),
                "admission checks requests' KV and activations against the memory budget"
            ),
            None => {
                tracing::info!("no memory budget: requests are admitted without a memory check")
            }
        }
        match super::warmup::warm_up(
            &model,
            &plugins.current(),
            warmup_sampler,
            &mut scheduler,
            super::warmup::full_warm_up(),
        ) {
            Ok(w) => tracing::info!(
                rows = w.rows,
                prompt_cache_hits = w.cache_hits,
                reused_tokens = w.reused_tokens,
                "warm-up done"
            ),
            Err(e) => {
                let _ = ready.send(Err(format!("warm-up generation failed: {e}")));
                return None;
            }
        }
        // MLX's CUDA completion worker exists now (and busy-waits): keep it
        // off this thread's core before requests are served.
        crate::busy_threads::isolate_from_caller_once();
        // The cache tiers live here, beside the model whose KV they hold.
        let ssd = match &caches.ssd {
            Some(cfg) => match open_ssd(&model, cfg) {
                Ok(ssd) => {
                    let _ = shared
                        .ssd_stats
                        .set(ssd.stats_handle(&kv_namespace(&model)));
                    Some(ssd)
                }
                Err(e) => {
                    let _ = ready.send(Err(e));
                    return None;
                }
            },
            None => None,
        };
        let frontend = Frontend {
            model_id,
            tokenizer: model.tokenizer.clone(),
            template: model.template.clone(),
            eos_ids: model.eos_ids.clone(),
            context: model.model.config().max_position_embeddings,
            vocab: model.model.config().vocab_size,
            compute: format!("{:?}", model.compute),
            lora: model.lora.listing(),
        };
        let engine = Engine {
            caches: PrefixCache::new(PromptCache::new(caches.prompt_cache_bytes), ssd),
            settle: caches.settle.max(Duration::from_millis(1)),
            model,
            scheduler,
            shared,
            outbox: Rc::new(RefCell::new(Vec::new())),
        };
        engine.publish();
        ready.send(Ok(frontend)).ok()?;
        Some(engine)
    }

    /// Serves until every handle is gone or a shutdown is asked for and the
    /// batch has drained.
    fn serve(&mut self, rx: mpsc::Receiver<Msg>) {
        let mut shutdown: Option<mpsc::Sender<bool>> = None;
        let mut unwritten_since: Option<Instant> = None;
        loop {
            if self.scheduler.is_idle() {
                if let Some(ack) = shutdown.take() {
                    let flushed = guarded("flush", || self.caches.flush(SHUTDOWN_FLUSH));
                    let _ = ack.send(flushed.unwrap_or(false));
                    return;
                }
                // Nothing to run: block for the next message, or (with
                // unwritten entries) only until requests settle.
                let msg = if self.caches.has_unwritten() {
                    match rx.recv_timeout(self.settle) {
                        Ok(m) => m,
                        Err(mpsc::RecvTimeoutError::Timeout) => {
                            guarded("settle", || self.caches.settle());
                            unwritten_since = None;
                            continue;
                        }
                        Err(mpsc::RecvTimeoutError::Disconnected) => break,
                    }
                } else if self.model.lora.watching() {
                    // A watched adapter folder is looked at while idle too.
                    match rx.recv_timeout(crate::model::lora::registry::POLL_INTERVAL) {
                        Ok(m) => m,
                        Err(mpsc::RecvTimeoutError::Timeout) => {
                            self.poll_lora();
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
                self.take(msg, &mut shutdown);
            }
            // Everything else already queued joins at this step.
            while let Ok(msg) = rx.try_recv() {
                self.take(msg, &mut shutdown);
            }
            self.poll_lora();
            self.step();
            if self.caches.has_unwritten() {
                let since = *unwritten_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= MAX_UNWRITTEN {
                    guarded("settle", || self.caches.settle());
                    unwritten_since = None;
                }
            }
        }
        // Every handle is gone: write what is left.
        guarded("flush", || self.caches.flush(SHUTDOWN_FLUSH));
    }

    /// Applies settled changes of the adapter folder (between steps: a
    /// running row keeps the adapter it started with; an adapter a waiting
    /// request names is not removed under it).
    fn poll_lora(&mut self) {
        let waiting = self.scheduler.waiting_loras();
        self.model
            .lora
            .poll(&|name| waiting.iter().any(|w| w == name));
    }

    /// Queues a job (or notes a shutdown request).
    fn take(&mut self, msg: Msg, shutdown: &mut Option<mpsc::Sender<bool>>) {
        let job = match msg {
            Msg::Job(job) => job,
            Msg::Shutdown(ack) => {
                *shutdown = Some(ack);
                return;
            }
        };
        let Job {
            request_id,
            request,
            events,
            cancel,
            plugins,
            constraint,
        } = *job;
        let sink = JobSink {
            span: tracing::info_span!("generate", request_id = %request_id),
            events,
            cancel,
            cancel_all: self.shared.cancel_all.clone(),
            outbox: self.outbox.clone(),
            _slot: QueueSlot(self.shared.queued.clone()),
            queued_at: Instant::now(),
            first_token: None,
            started: false,
        };
        self.scheduler.submit(Pending {
            request,
            chain: match constraint {
                Some(c) => ChainSource::Constrained(plugins, c),
                None => ChainSource::Plugins(plugins),
            },
            sink: Box::new(sink),
        });
    }

    /// One scheduler step; a panic fails the rows in the batch (their state
    /// is unknown), not the engine. Then publishes counters and delivers
    /// the responses of rows that finished.
    fn step(&mut self) {
        let (model, caches, scheduler) = (&self.model, &mut self.caches, &mut self.scheduler);
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            scheduler.step(model, Some(caches))
        }));
        let retired = match ran {
            Ok(report) => report.retired,
            Err(_) => {
                tracing::error!(
                    "the engine panicked during a step; its rows fail, it keeps serving"
                );
                self.scheduler
                    .fail_all("the engine failed while running this request");
                1
            }
        };
        if retired > 0 {
            guarded("spill", || self.caches.spill_evicted());
        }
        self.publish();
        let ready: Vec<_> = self.outbox.borrow_mut().drain(..).collect();
        for (tx, ev) in ready {
            let _ = tx.send(ev);
        }
    }

    fn publish(&self) {
        if let Ok(mut s) = self.shared.cache_stats.lock() {
            *s = self.caches.ram_stats();
        }
        if let Ok(mut s) = self.shared.batch_stats.lock() {
            *s = self.scheduler.stats();
        }
    }
}

/// Holds one place in the handle's in-flight count until dropped.
struct QueueSlot(Arc<AtomicUsize>);

impl Drop for QueueSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A job's sink: events go straight to the HTTP side; the final one waits
/// in the outbox until the step's counters are published.
struct JobSink {
    span: tracing::Span,
    events: UnboundedSender<JobEvent>,
    cancel: Arc<AtomicBool>,
    cancel_all: Arc<AtomicBool>,
    outbox: Outbox,
    _slot: QueueSlot,
    queued_at: Instant,
    first_token: Option<Duration>,
    started: bool,
}

impl SequenceSink for JobSink {
    fn event(&mut self, event: GenerateEvent) {
        let out = match event {
            GenerateEvent::Started { cached_tokens } => {
                self.started = true;
                JobEvent::Started { cached_tokens }
            }
            GenerateEvent::Token(t) => {
                self.first_token
                    .get_or_insert_with(|| self.queued_at.elapsed());
                JobEvent::Token(t)
            }
            GenerateEvent::Text(t) => JobEvent::Text(t),
        };
        let _ = self.events.send(out);
    }

    fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed)
            || self.cancel_all.load(Ordering::Relaxed)
            || self.events.is_closed()
    }

    fn finished(&mut self, result: Result<GenerateSummary, GenerateError>) {
        let _enter = self.span.enter();
        let event = match result {
            // Cancelled before it started: the client left (nobody reads
            // this), or the drain period ended (the client gets a 503).
            Ok(s) if s.finish_reason == FinishReason::Cancelled && !self.started => {
                tracing::info!("cancelled before it started");
                JobEvent::Failed(GenerateError::Unavailable(
                    "the server is shutting down".into(),
                ))
            }
            Ok(summary) => {
                tracing::info!(
                    prompt_tokens = summary.prompt_tokens,
                    cached_tokens = summary.cached_tokens,
                    completion_tokens = summary.completion_tokens,
                    ttft_ms = self.first_token.map(|d| d.as_millis() as u64),
                    decode_tok_s = format!("{:.1}", summary.decode_tok_s()),
                    finish = ?summary.finish_reason,
                    "generation finished"
                );
                JobEvent::Finished(summary)
            }
            Err(e) => {
                tracing::warn!(error = %e, "generation failed");
                JobEvent::Failed(e)
            }
        };
        self.outbox.borrow_mut().push((self.events.clone(), event));
    }
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
    let identity = ModelIdentity {
        model: fingerprint,
        tokenizer: model
            .tokenizer
            .fingerprint()
            .map_err(|e| format!("fingerprinting the tokenizer for --ssd-cache: {e}"))?,
        geometry: KvGeometry {
            shapes: model.model.kv_shapes(),
            dtype: model.model.dtype(),
            kinds: model.model.new_cache().kinds(),
            quant: model.model.new_cache().quant(),
        },
    };
    let ssd = SsdCache::open(cfg, identity).map_err(|e| e.to_string())?;
    let stats = ssd.stats_handle(&kv_namespace(model)).stats();
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

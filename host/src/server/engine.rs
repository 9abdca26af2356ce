//! The engine thread: owns the model (MLX arrays never leave it) and runs
//! queued generations one at a time (serial mode; continuous batching is a
//! later step of the scheduler). HTTP handlers talk to it through a job
//! queue and get events back on a per-job channel, so they never block it
//! and it never blocks them.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;

use crate::cache::{PromptCache, PromptCacheStats};
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

/// The HTTP side's handle on the engine thread.
pub struct EngineHandle {
    jobs: mpsc::Sender<Job>,
    /// The prompt cache's counters, refreshed after every job.
    pub cache_stats: Arc<std::sync::Mutex<PromptCacheStats>>,
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
        self.jobs.send(job).map_err(|_| {
            self.queued.fetch_sub(1, Ordering::Relaxed);
            EngineGone
        })
    }

    /// Jobs queued or running.
    pub fn in_flight(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
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
    prompt_cache_bytes: usize,
    ready: tokio::sync::oneshot::Sender<Result<Frontend, String>>,
) -> std::io::Result<EngineHandle> {
    let (tx, rx) = mpsc::channel::<Job>();
    let cache_stats = Arc::new(std::sync::Mutex::new(
        PromptCache::new(prompt_cache_bytes).stats(),
    ));
    let stats = cache_stats.clone();
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
            // The prompt cache lives here, beside the model whose KV it holds.
            let mut prompt_cache = PromptCache::new(prompt_cache_bytes);
            while let Ok(job) = rx.recv() {
                // A panic fails only this job (its event channel is dropped,
                // which the HTTP side reports as a 500).
                let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    run_job(&model, job, &c, &mut prompt_cache)
                }));
                if ran.is_err() {
                    tracing::error!("the engine panicked while running a job; it keeps serving");
                }
                if let Ok(mut s) = stats.lock() {
                    *s = prompt_cache.stats();
                }
                q.fetch_sub(1, Ordering::Relaxed);
            }
        })?;
    Ok(EngineHandle {
        jobs: tx,
        cache_stats,
        cancel_all,
        queued,
    })
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

fn run_job(model: &LoadedModel, job: Job, cancel_all: &AtomicBool, prompt_cache: &mut PromptCache) {
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
        Some(prompt_cache),
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

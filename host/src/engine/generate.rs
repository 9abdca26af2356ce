//! One request run to completion on the calling thread, through the same
//! scheduler and step the server uses (a batch of one): `mlxhost generate`,
//! `bench-chain` and tests call this.

use std::cell::RefCell;

use super::request::{
    effective_params, validate, GenerateError, GenerateEvent, GenerateRequest, GenerateSummary,
};
use super::scheduler::{ChainSource, Pending, Scheduler, SchedulerConfig};
use super::sequence::SequenceSink;
use crate::cache::PrefixCache;
use crate::model::LoadedModel;
use crate::plugin::session::{RowChain, TokenChain};
use crate::plugin::PluginHost;

/// A sink from two closures; the result lands in `result`.
struct FnSink<'a, E: FnMut(GenerateEvent), C: Fn() -> bool> {
    on_event: E,
    cancelled: C,
    result: &'a RefCell<Option<Result<GenerateSummary, GenerateError>>>,
}

impl<E: FnMut(GenerateEvent), C: Fn() -> bool> SequenceSink for FnSink<'_, E, C> {
    fn event(&mut self, event: GenerateEvent) {
        (self.on_event)(event)
    }
    fn cancelled(&self) -> bool {
        (self.cancelled)()
    }
    fn finished(&mut self, result: Result<GenerateSummary, GenerateError>) {
        *self.result.borrow_mut() = Some(result);
    }
}

/// Generates for one request with its plugin chain (sampler and processors
/// named in `req`), streaming events to `on_event`; `cancelled` is polled
/// once per step. With a prompt cache, the longest cached prefix is reused
/// and the finished row's KV is stored.
///
/// Errors: [`GenerateError::InvalidRequest`] (empty prompt, ids outside the
/// vocabulary, prompt over the context), [`GenerateError::Plugin`] (unknown
/// plugin, rejected parameters, a plugin failure), [`GenerateError::Model`].
pub fn generate(
    model: &LoadedModel,
    plugins: &PluginHost,
    req: &GenerateRequest,
    prompt_cache: Option<&mut PrefixCache>,
    on_event: impl FnMut(GenerateEvent),
    cancelled: impl Fn() -> bool,
) -> Result<GenerateSummary, GenerateError> {
    validate(model, req)?;
    let params = effective_params(model, req);
    let mut chain = RowChain::new(
        plugins,
        &req.sampler,
        &req.processors,
        &params,
        &req.plugin_params,
    )?;
    let spec = match req.speculative.drafter.as_deref() {
        Some(name) if req.speculative.enabled() => {
            let d = crate::plugin::drafter::PluginDrafter::new(
                plugins,
                name,
                req.prompt_ids.len(),
                model.model.config().vocab_size,
                &req.plugin_params,
            )?;
            Some(super::speculative::RowSpec::new(
                Box::new(d),
                req.speculative.max_draft,
            ))
        }
        _ => None,
    };
    let source = match spec {
        Some(spec) => ChainSource::ReadyDrafting(Box::new(&mut chain), spec),
        None => ChainSource::Ready(Box::new(&mut chain)),
    };
    run_one(model, source, req, prompt_cache, on_event, cancelled)
}

/// [`generate`] with a given token chain (benchmarks: a native chain).
pub fn generate_with(
    model: &LoadedModel,
    chain: &mut impl TokenChain,
    req: &GenerateRequest,
    prompt_cache: Option<&mut PrefixCache>,
    on_event: impl FnMut(GenerateEvent),
    cancelled: impl Fn() -> bool,
) -> Result<GenerateSummary, GenerateError> {
    run_one(
        model,
        ChainSource::Ready(Box::new(chain)),
        req,
        prompt_cache,
        on_event,
        cancelled,
    )
}

fn run_one<'s>(
    model: &LoadedModel,
    chain: ChainSource<'s>,
    req: &GenerateRequest,
    mut prompt_cache: Option<&mut PrefixCache>,
    on_event: impl FnMut(GenerateEvent) + 's,
    cancelled: impl Fn() -> bool + 's,
) -> Result<GenerateSummary, GenerateError> {
    let result = RefCell::new(None);
    {
        let mut scheduler = Scheduler::new(SchedulerConfig {
            max_batch: 1,
            ..SchedulerConfig::default()
        });
        scheduler.submit(Pending {
            request: req.clone(),
            chain,
            sink: Box::new(FnSink {
                on_event,
                cancelled,
                result: &result,
            }),
        });
        let mut step_ms = Vec::new();
        while !scheduler.is_idle() {
            let started = std::time::Instant::now();
            scheduler.step(model, prompt_cache.as_deref_mut());
            step_ms.push(started.elapsed().as_secs_f64() * 1e3);
        }
        log_step_spread(step_ms);
        // Where the steps' time went (`MLXHOST_LOG=debug`): the same
        // breakdown `/stats` gives a server, for one request.
        for s in scheduler.stats().by_batch_size {
            tracing::debug!(
                rows = s.rows,
                steps = s.steps,
                step_ms = s.step_ms,
                forward_graph_ms = s.forward_graph_ms,
                forward_build_ms = s.forward_build_ms,
                plugin_ms = s.plugin_ms,
                eval_ms = s.eval_ms,
                "step timing"
            );
        }
    }
    result
        .into_inner()
        .unwrap_or_else(|| Err(GenerateError::Internal("the request never finished".into())))
}

/// Logs (`MLXHOST_LOG=debug`) the spread of one request's step times, ms:
/// the median beside the mean shows whether rare slow steps (a KV buffer
/// growing, a first-seen shape) or every step set the decode rate.
fn log_step_spread(mut step_ms: Vec<f64>) {
    if step_ms.is_empty() || !tracing::enabled!(tracing::Level::DEBUG) {
        return;
    }
    step_ms.sort_by(f64::total_cmp);
    let at = |q: f64| step_ms[((step_ms.len() - 1) as f64 * q).round() as usize];
    let mean = step_ms.iter().sum::<f64>() / step_ms.len() as f64;
    let slow: Vec<f64> = step_ms.iter().rev().take(5).copied().collect();
    tracing::debug!(
        steps = step_ms.len(),
        median = at(0.5),
        mean,
        p90 = at(0.9),
        p99 = at(0.99),
        slowest = ?slow,
        "step spread"
    );
}

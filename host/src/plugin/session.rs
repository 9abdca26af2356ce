//! One row's plugin chain for one request: its logits processors (in order)
//! and its sampler, each a fresh instance with its own store and session
//! resource, created from the pre-instantiated component (~microseconds).

use std::time::{Duration, Instant};

use mlx_rs::Array;
use wasmtime::component::{Resource, ResourceAny};
use wasmtime::Store;

use super::bindings::processor::LogitsProcessorPlugin;
use super::bindings::sampler::exports::mlxhost::plugin::sampler::Choice;
use super::bindings::sampler::mlxhost::plugin::types as wit;
use super::bindings::sampler::SamplerPlugin;
use super::manifest::Kind;
use super::runtime::{PluginError, PluginHost};
use super::tensors::{HistoryHandle, LogitsHandle, PluginState};

/// Sampling parameters of a request (OpenAI spelling; `semantics.md`
/// defaults). Mirrors the WIT `sampling-params` record.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 1.0 = off.
    pub top_p: f32,
    /// 0 = off.
    pub top_k: u32,
    /// 0.0 = off.
    pub min_p: f32,
    /// 0.0 = off.
    pub xtc_probability: f32,
    /// XTC threshold.
    pub xtc_threshold: f32,
    /// Per-row seed; `None` = random per request.
    pub seed: Option<u64>,
    /// Ids XTC never removes (EOS ids, newline).
    pub xtc_special_ids: Vec<u32>,
    /// Hugging Face repetition penalty; 1.0 = off.
    pub repetition_penalty: f32,
    /// History tokens the repetition penalty looks at.
    pub repetition_context_size: u32,
    /// OpenAI presence penalty; 0.0 = off.
    pub presence_penalty: f32,
    /// OpenAI frequency penalty; 0.0 = off.
    pub frequency_penalty: f32,
    /// OpenAI `logit_bias`: (token id, bias).
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            xtc_probability: 0.0,
            xtc_threshold: 0.0,
            seed: None,
            xtc_special_ids: Vec::new(),
            repetition_penalty: 1.0,
            repetition_context_size: 20,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    fn to_wit(&self, extra: &serde_json::Value) -> wit::SamplingParams {
        wit::SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            xtc_probability: self.xtc_probability,
            xtc_threshold: self.xtc_threshold,
            seed: self.seed,
            xtc_special_ids: self.xtc_special_ids.clone(),
            repetition_penalty: self.repetition_penalty,
            repetition_context_size: self.repetition_context_size,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            logit_bias: self.logit_bias.clone(),
            extra: extra.to_string(),
        }
    }
}

struct ProcessorInstance {
    name: String,
    store: Store<PluginState>,
    bindings: LogitsProcessorPlugin,
    session: ResourceAny,
}

struct SamplerInstance {
    name: String,
    store: Store<PluginState>,
    bindings: SamplerPlugin,
    session: ResourceAny,
}

/// What the sampler chose for a step.
pub enum Chosen {
    /// A device scalar (uint32), evaluated with the rest of the step.
    Device(Array),
    /// An id the guest decided.
    Host(u32),
}

/// The output of a row's chain for one step.
pub struct StepOutput {
    /// The chosen token.
    pub token: Chosen,
    /// The logits after every processor and the sampler's own edits: the
    /// distribution the token was drawn from (`[V]`, lazy).
    pub final_logits: Array,
}

/// Lends the row's logits and history to one plugin's store for `call` (as
/// borrowed handles), then takes the logits back, edited or not, whatever
/// the call returned: handles never outlive the call in the guest's table.
fn lend<R>(
    store: &mut Store<PluginState>,
    name: &str,
    logits: Array,
    ids: &[u32],
    prompt_len: usize,
    call: impl FnOnce(
        &mut Store<PluginState>,
        Resource<LogitsHandle>,
        Resource<HistoryHandle>,
    ) -> wasmtime::Result<R>,
) -> Result<(wasmtime::Result<R>, Array), PluginError> {
    let table = &mut store.data_mut().table;
    let l = table
        .push(LogitsHandle { array: logits })
        .map_err(|e| failed(name, e))?;
    let history = HistoryHandle {
        ids: ids.to_vec(),
        prompt_len,
    };
    let h = table.push(history).map_err(|e| failed(name, e))?;
    let result = call(
        store,
        Resource::new_borrow(l.rep()),
        Resource::new_borrow(h.rep()),
    );
    let table = &mut store.data_mut().table;
    let _ = table.delete(h);
    let logits = table.delete(l).map_err(|e| failed(name, e))?.array;
    Ok((result, logits))
}

/// A row's processors and sampler for one request.
pub struct RowChain {
    processors: Vec<ProcessorInstance>,
    sampler: SamplerInstance,
    processor_ticks: u64,
    sampler_ticks: u64,
    /// Wall time spent inside plugin calls (instantiation excluded).
    pub plugin_time: Duration,
    /// Every plugin in the chain declares `history_free` in its manifest.
    history_free: bool,
    /// The batch step's cap on every call's deadline while the row shares
    /// a step with others ([`TokenChain::set_step_cap`]): (cap, its ticks).
    step_cap: Option<(Duration, u64)>,
}

/// How a capped call's interrupt reads (the plugin missed the batch step's
/// bound, not its own deadline).
fn over_step_cap(cap: Duration) -> String {
    format!(
        "exceeded its time limit: the batch step's plugin bound of {} ms while sharing the batch (--plugin-step-ms)",
        cap.as_millis()
    )
}

pub(crate) fn failed(plugin: &str, cause: impl std::fmt::Display) -> PluginError {
    PluginError::Failed {
        plugin: plugin.to_string(),
        cause: cause.to_string(),
    }
}

/// A plugin call's outcome as the request sees it: a trap (or host error)
/// and an error the plugin returned both fail with the plugin's name.
fn outcome<T>(
    name: &str,
    result: wasmtime::Result<Result<T, wit::PluginError>>,
) -> Result<T, PluginError> {
    result
        .map_err(|e| failed(name, trap_cause(&e)))?
        .map_err(|e| failed(name, e.message))
}

/// A session's `create` outcome: an error the plugin returned means the
/// request's parameters are bad ([`PluginError::Rejected`]); a trap is a
/// plugin failure.
fn created<T>(
    name: &str,
    result: wasmtime::Result<Result<T, wit::PluginError>>,
) -> Result<T, PluginError> {
    created_with(name, result, |e| e.message)
}

/// [`created`] for any WIT version's plugin error (`message` gives its text).
pub(crate) fn created_with<T, E>(
    name: &str,
    result: wasmtime::Result<Result<T, E>>,
    message: impl FnOnce(E) -> String,
) -> Result<T, PluginError> {
    result
        .map_err(|e| failed(name, trap_cause(&e)))?
        .map_err(|e| PluginError::Rejected {
            plugin: name.to_string(),
            cause: message(e),
        })
}

/// What an interrupted call (past its deadline) reads as.
const INTERRUPTED: &str = "exceeded its time limit (epoch deadline)";

/// Trap causes in words users understand.
pub(crate) fn trap_cause(e: &wasmtime::Error) -> String {
    if let Some(trap) = e.downcast_ref::<wasmtime::Trap>() {
        return match trap {
            wasmtime::Trap::Interrupt => INTERRUPTED.into(),
            other => format!("trapped: {other}"),
        };
    }
    // A host call that failed: its own message is the root cause (the
    // outer layers only say "error while executing at wasm backtrace").
    let text = e.root_cause().to_string();
    // StoreLimits' trap_on_grow_failure reports a refused memory.grow.
    if text.contains("memory") && text.contains("grow") {
        return format!("exceeded its memory limit ({text})");
    }
    text
}

/// A plugin's `extra` parameters: its manifest `defaults` with the
/// request's `plugin_params.<name>` object merged over them.
pub(crate) fn merged_params(
    name: &str,
    defaults: serde_json::Value,
    plugin_params: &serde_json::Value,
) -> serde_json::Value {
    let mut merged = match defaults {
        serde_json::Value::Object(m) => m,
        _ => serde_json::Map::new(),
    };
    if let Some(serde_json::Value::Object(m)) = plugin_params.get(name) {
        for (k, v) in m {
            merged.insert(k.clone(), v.clone());
        }
    }
    serde_json::Value::Object(merged)
}

/// What chooses each token of a row: the plugin chain ([`RowChain`]) in
/// the host; benchmarks implement it natively to measure the plugin cost.
/// The engine's scheduler drives any implementation, one per row.
pub trait TokenChain {
    /// Edits `logits` (`[V]`, lazy) and chooses the token.
    fn step(
        &mut self,
        logits: Array,
        ids: &[u32],
        prompt_len: usize,
        step: u32,
    ) -> Result<StepOutput, PluginError>;
    /// After the step's evaluation: the chosen id and its log-probabilities.
    fn accept(
        &mut self,
        token: u32,
        raw_logprob: f32,
        sampled_logprob: f32,
    ) -> Result<(), PluginError>;
    /// Names the sampler in errors.
    fn sampler_name(&self) -> &str;
    /// Time spent choosing tokens (inside plugin calls, for the plugin chain).
    fn chain_time(&self) -> Duration;
    /// True when `step` ignores the history's last token and `accept` keeps
    /// no state, so the engine may run the row's next step before reading
    /// the token this one chose (decode lookahead). Default false.
    fn history_free(&self) -> bool {
        false
    }
    /// Caps the deadline of every plugin call at `cap` until called again
    /// (`None`: each plugin's own deadline). The engine sets it while the
    /// row shares a batch step, so one slow plugin cannot hold the other
    /// rows for its whole deadline. Default: ignored.
    fn set_step_cap(&mut self, cap: Option<Duration>) {
        let _ = cap;
    }
    /// Time the chain's calls spent waiting on the host (read-backs that
    /// wait for the step's forward), since the chain was made: not the
    /// plugins' own time. Default zero.
    fn host_wait(&self) -> Duration {
        Duration::ZERO
    }
}

impl RowChain {
    /// Instantiates `sampler` and `processors` (in order) for one row.
    /// `plugin_params` maps plugin name to its JSON parameters.
    ///
    /// Errors: [`PluginError::Unknown`] for a name that is not loaded (or not
    /// of that kind); [`PluginError::Rejected`] when a session rejects its
    /// parameters; [`PluginError::Failed`] when instantiation fails.
    pub fn new(
        host: &PluginHost,
        sampler: &str,
        processors: &[String],
        params: &SamplingParams,
        plugin_params: &serde_json::Value,
    ) -> Result<Self, PluginError> {
        let extra_for =
            |name: &str, defaults: serde_json::Value| merged_params(name, defaults, plugin_params);
        let mut procs = Vec::with_capacity(processors.len());
        let mut history_free = true;
        for name in processors {
            let p = host.get(name, Kind::LogitsProcessor)?;
            history_free &= p.manifest.history_free;
            let pre = p
                .processor
                .as_ref()
                .ok_or_else(|| failed(name, "no logits-processor world"))?;
            let mut store = host.new_store(Kind::LogitsProcessor);
            let bindings = pre
                .instantiate(&mut store)
                .map_err(|e| failed(name, trap_cause(&e)))?;
            let extra = extra_for(name, p.manifest.defaults_json());
            let session = created(
                name,
                bindings
                    .mlxhost_plugin_logits_processor()
                    .session()
                    .call_create(&mut store, &params.to_wit(&extra)),
            )?;
            procs.push(ProcessorInstance {
                name: name.clone(),
                store,
                bindings,
                session,
            });
        }
        let p = host.get(sampler, Kind::Sampler)?;
        history_free &= p.manifest.history_free;
        let pre = p
            .sampler
            .as_ref()
            .ok_or_else(|| failed(sampler, "no sampler world"))?;
        let mut store = host.new_store(Kind::Sampler);
        let bindings = pre
            .instantiate(&mut store)
            .map_err(|e| failed(sampler, trap_cause(&e)))?;
        let extra = extra_for(sampler, p.manifest.defaults_json());
        let session = created(
            sampler,
            bindings
                .mlxhost_plugin_sampler()
                .session()
                .call_create(&mut store, &params.to_wit(&extra)),
        )?;
        Ok(RowChain {
            processors: procs,
            sampler: SamplerInstance {
                name: sampler.into(),
                store,
                bindings,
                session,
            },
            processor_ticks: host.deadline_ticks(Kind::LogitsProcessor),
            sampler_ticks: host.deadline_ticks(Kind::Sampler),
            plugin_time: Duration::ZERO,
            history_free,
            step_cap: None,
        })
    }

    /// The deadline, in epoch ticks, of a call whose plugin's own deadline
    /// is `own` ticks: the step cap when it is shorter.
    fn ticks(&self, own: u64) -> u64 {
        self.step_cap.map_or(own, |(_, cap)| cap.min(own))
    }

    /// A failure as the request sees it: an interrupt under a step cap
    /// shorter than the plugin's own deadline names the cap (the plugin's
    /// own deadline did not fire).
    fn named(&self, e: PluginError) -> PluginError {
        match (e, self.step_cap) {
            (PluginError::Failed { plugin, cause }, Some((cap, cap_ticks)))
                if cause == INTERRUPTED =>
            {
                let own = if plugin == self.sampler.name {
                    self.sampler_ticks
                } else {
                    self.processor_ticks
                };
                let cause = if cap_ticks < own {
                    over_step_cap(cap)
                } else {
                    cause
                };
                PluginError::Failed { plugin, cause }
            }
            (e, _) => e,
        }
    }
}

/// Forwards [`TokenChain`] through a pointer type: a borrowed chain
/// (benchmarks keep theirs to read it afterwards) and a boxed one (the
/// engine wraps a row's chain in host constraints).
macro_rules! forward_token_chain {
    ($($ptr:ty),*) => {$(
        impl<T: TokenChain + ?Sized> TokenChain for $ptr {
            fn step(
                &mut self,
                logits: Array,
                ids: &[u32],
                prompt_len: usize,
                step: u32,
            ) -> Result<StepOutput, PluginError> {
                (**self).step(logits, ids, prompt_len, step)
            }
            fn accept(
                &mut self,
                token: u32,
                raw_logprob: f32,
                sampled_logprob: f32,
            ) -> Result<(), PluginError> {
                (**self).accept(token, raw_logprob, sampled_logprob)
            }
            fn sampler_name(&self) -> &str {
                (**self).sampler_name()
            }
            fn chain_time(&self) -> Duration {
                (**self).chain_time()
            }
            fn history_free(&self) -> bool {
                (**self).history_free()
            }
            fn set_step_cap(&mut self, cap: Option<Duration>) {
                (**self).set_step_cap(cap)
            }
            fn host_wait(&self) -> Duration {
                (**self).host_wait()
            }
        }
    )*};
}
forward_token_chain!(&mut T, Box<T>);

impl TokenChain for RowChain {
    /// Runs the processors then the sampler on `logits` (`[V]`, float32,
    /// lazy). Nothing is evaluated unless a plugin reads back.
    fn step(
        &mut self,
        logits: Array,
        ids: &[u32],
        prompt_len: usize,
        step: u32,
    ) -> Result<StepOutput, PluginError> {
        self.run_step(logits, ids, prompt_len, step)
            .map_err(|e| self.named(e))
    }

    /// Tells every session which token was chosen (after the step's eval).
    fn accept(
        &mut self,
        token: u32,
        raw_logprob: f32,
        sampled_logprob: f32,
    ) -> Result<(), PluginError> {
        self.run_accept(token, raw_logprob, sampled_logprob)
            .map_err(|e| self.named(e))
    }

    /// The sampler's name.
    fn sampler_name(&self) -> &str {
        &self.sampler.name
    }

    fn chain_time(&self) -> Duration {
        self.plugin_time
    }

    fn history_free(&self) -> bool {
        self.history_free
    }

    fn set_step_cap(&mut self, cap: Option<Duration>) {
        self.step_cap = cap.map(|c| {
            let tick = super::runtime::EPOCH_TICK.as_millis().max(1);
            (c, (c.as_millis() / tick).max(1) as u64 + 1)
        });
    }

    fn host_wait(&self) -> Duration {
        self.processors
            .iter()
            .map(|p| p.store.data().host_wait_total)
            .sum::<Duration>()
            + self.sampler.store.data().host_wait_total
    }
}

impl RowChain {
    fn run_step(
        &mut self,
        logits: Array,
        ids: &[u32],
        prompt_len: usize,
        step: u32,
    ) -> Result<StepOutput, PluginError> {
        let started = Instant::now();
        let (processor_ticks, sampler_ticks) = (
            self.ticks(self.processor_ticks),
            self.ticks(self.sampler_ticks),
        );
        let vocab = logits.shape().first().copied().unwrap_or(0) as u32;
        let mut logits = logits;
        for p in &mut self.processors {
            let call_started = Instant::now();
            p.store.set_epoch_deadline(processor_ticks);
            let (bindings, session) = (&p.bindings, p.session);
            let (result, edited) = lend(
                &mut p.store,
                &p.name,
                logits,
                ids,
                prompt_len,
                |store, l, h| {
                    bindings
                        .mlxhost_plugin_logits_processor()
                        .session()
                        .call_process(store, session, l, h, step)
                },
            )?;
            logits = edited;
            super::timing::record(&p.name, call_started.elapsed());
            outcome(&p.name, result)?;
        }
        let call_started = Instant::now();
        let s = &mut self.sampler;
        s.store.set_epoch_deadline(sampler_ticks);
        let (bindings, session) = (&s.bindings, s.session);
        let (result, final_logits) = lend(
            &mut s.store,
            &s.name,
            logits,
            ids,
            prompt_len,
            |store, l, h| {
                bindings
                    .mlxhost_plugin_sampler()
                    .session()
                    .call_sample(store, session, l, h, step)
            },
        )?;
        super::timing::record(&s.name, call_started.elapsed());
        let choice = outcome(&s.name, result)?;
        let token = match choice {
            Choice::Device(t) => Chosen::Device(
                s.store
                    .data_mut()
                    .table
                    .delete(t)
                    .map_err(|e| failed(&s.name, e))?
                    .array,
            ),
            Choice::Host(id) if id < vocab => Chosen::Host(id),
            Choice::Host(id) => {
                return Err(failed(
                    &s.name,
                    format!("returned token id {id}, outside the vocabulary (size {vocab})"),
                ))
            }
        };
        self.plugin_time += started.elapsed();
        Ok(StepOutput {
            token,
            final_logits,
        })
    }

    fn run_accept(
        &mut self,
        token: u32,
        raw_logprob: f32,
        sampled_logprob: f32,
    ) -> Result<(), PluginError> {
        let started = Instant::now();
        let (processor_ticks, sampler_ticks) = (
            self.ticks(self.processor_ticks),
            self.ticks(self.sampler_ticks),
        );
        for p in &mut self.processors {
            let call_started = Instant::now();
            p.store.set_epoch_deadline(processor_ticks);
            let r = p
                .bindings
                .mlxhost_plugin_logits_processor()
                .session()
                .call_accept(&mut p.store, p.session, token, raw_logprob, sampled_logprob);
            super::timing::record(&p.name, call_started.elapsed());
            r.map_err(|e| failed(&p.name, trap_cause(&e)))?;
        }
        let call_started = Instant::now();
        let s = &mut self.sampler;
        s.store.set_epoch_deadline(sampler_ticks);
        let r = s.bindings.mlxhost_plugin_sampler().session().call_accept(
            &mut s.store,
            s.session,
            token,
            raw_logprob,
            sampled_logprob,
        );
        super::timing::record(&s.name, call_started.elapsed());
        r.map_err(|e| failed(&s.name, trap_cause(&e)))?;
        self.plugin_time += started.elapsed();
        Ok(())
    }
}

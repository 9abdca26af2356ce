//! Host side of the `tensors` interface: the row's device arrays behind
//! resource handles, and the device operations plugins compose on them.
//!
//! Edits replace the handle's array with a new lazy one (MLX graphs are
//! functional); nothing is evaluated until the host's once-per-step `eval`,
//! except by `read-*` methods. The operations themselves, and where their
//! definitions come from, are in `device_ops`; this file validates what
//! guests pass and moves arrays in and out of handles.

use mlx_rs::{ops::indexing::IndexOp, Array, Dtype};
use wasmtime::component::{Resource, ResourceTable};

use super::bindings::sampler::mlxhost::plugin::tensors::{
    Host, HostHistory, HostLogits, HostToken,
};
use super::bindings::sampler::mlxhost::plugin::types;
use super::device_ops::{self as dev, vocab};

pub use super::device_ops::step_key;

/// The row's logits `[V]` (float32), edited through the handle.
pub struct LogitsHandle {
    /// Current (lazy) logits.
    pub array: Array,
}

/// The row's token history: prompt then generated ids.
pub struct HistoryHandle {
    /// All ids so far.
    pub ids: Vec<u32>,
    /// Generated ids start here.
    pub prompt_len: usize,
}

/// A chosen token on the device: a scalar uint32 array.
pub struct TokenHandle {
    /// `[]` uint32.
    pub array: Array,
}

/// Per-store host state: the resource table, the store's limits and the
/// model's vocabulary (for the `vocab` interface).
pub struct PluginState {
    /// Handles lent to the guest.
    pub table: ResourceTable,
    /// Memory limits of this instance (and whether they refused it memory).
    pub limits: super::limiter::CappedLimits,
    /// The model's vocabulary; `None` before a model is loaded.
    pub vocab: Option<std::sync::Arc<super::vocab::VocabView>>,
    /// What an API adapter instance may call (`response-store`, `prompt`);
    /// `None` for other plugins.
    pub services: Option<super::services::AdapterServices>,
    /// Time spent inside host calls that wait on the host (read-backs that
    /// wait for the step's forward, tokenizing a long prompt in
    /// `prompt.count-tokens`) not yet credited: the deadline bounds the
    /// guest's own time, so the epoch callback ([`super::runtime`]) extends
    /// it by the whole ticks of this instead of trapping a guest that
    /// waited on the host. Fractions carry over (rounding each call up
    /// would let a guest that calls the host in a loop run forever).
    pub host_wait_credit: std::time::Duration,
    /// All time spent waiting on the host since the store was made (the
    /// engine subtracts it from a chain's time to get the guest's own).
    pub host_wait_total: std::time::Duration,
    /// The output constraint an API adapter attached to the request it
    /// handles (`structured-output.constrain`).
    pub constraint: Option<super::constraint::ConstraintRequest>,
    /// The tools an API adapter marked strict (`structured-output.strict-tools`).
    pub strict_tools: Vec<String>,
    /// The speculation settings an API adapter chose for the request it
    /// handles (`speculation.speculate`, WIT 0.4.0).
    pub speculation: Option<super::services::SpeculationChoice>,
}

impl PluginState {
    /// Fresh state with the given limits and no vocabulary.
    pub fn new(limits: wasmtime::StoreLimits) -> Self {
        PluginState {
            table: ResourceTable::new(),
            limits: super::limiter::CappedLimits::new(limits),
            vocab: None,
            services: None,
            host_wait_credit: std::time::Duration::ZERO,
            host_wait_total: std::time::Duration::ZERO,
            constraint: None,
            strict_tools: Vec::new(),
            speculation: None,
        }
    }

    /// Runs host work for the guest, crediting its time to the guest's
    /// deadline (see [`PluginState::host_wait_credit`]).
    pub(crate) fn timed<T>(&mut self, work: impl FnOnce(&mut Self) -> T) -> T {
        let started = std::time::Instant::now();
        let r = work(self);
        let waited = started.elapsed();
        self.host_wait_credit += waited;
        self.host_wait_total += waited;
        r
    }

    /// Whole epoch ticks of uncredited host time, taken (the fraction
    /// stays for the next deadline).
    pub(crate) fn take_credit_ticks(&mut self) -> u64 {
        let tick = super::runtime::EPOCH_TICK;
        let ticks = (self.host_wait_credit.as_nanos() / tick.as_nanos().max(1)) as u64;
        self.host_wait_credit = self
            .host_wait_credit
            .saturating_sub(tick.saturating_mul(ticks as u32));
        ticks
    }

    fn logits(&self, r: &Resource<LogitsHandle>) -> wasmtime::Result<&Array> {
        Ok(&self.table.get(r)?.array)
    }

    fn set(&mut self, r: &Resource<LogitsHandle>, a: Array) -> wasmtime::Result<()> {
        self.table.get_mut(r)?.array = a;
        Ok(())
    }
}

type R<T> = wasmtime::Result<T>;

/// `x > 0`, false for NaN.
fn is_positive(x: f32) -> bool {
    x > 0.0
}

impl types::Host for PluginState {}
impl super::bindings::v2::tool_parser::mlxhost::plugin::types::Host for PluginState {}
impl super::bindings::v2::adapter::mlxhost::plugin::request::Host for PluginState {}
impl Host for PluginState {}

impl HostToken for PluginState {
    fn drop(&mut self, rep: Resource<TokenHandle>) -> R<()> {
        self.table.delete(rep)?;
        Ok(())
    }
}

impl HostHistory for PluginState {
    fn len(&mut self, h: Resource<HistoryHandle>) -> R<u32> {
        Ok(self.table.get(&h)?.ids.len() as u32)
    }

    fn prompt_len(&mut self, h: Resource<HistoryHandle>) -> R<u32> {
        Ok(self.table.get(&h)?.prompt_len as u32)
    }

    fn read(&mut self, h: Resource<HistoryHandle>, start: u32, end: u32) -> R<Vec<u32>> {
        let ids = &self.table.get(&h)?.ids;
        let end = (end as usize).min(ids.len());
        let start = (start as usize).min(end);
        Ok(ids[start..end].to_vec())
    }

    fn drop(&mut self, rep: Resource<HistoryHandle>) -> R<()> {
        // Borrowed handles are owned by the host; nothing to free here.
        let _ = rep;
        Ok(())
    }
}

impl HostLogits for PluginState {
    fn vocab_size(&mut self, l: Resource<LogitsHandle>) -> R<u32> {
        Ok(vocab(self.logits(&l)?) as u32)
    }

    fn scale(&mut self, l: Resource<LogitsHandle>, temperature: f32) -> R<()> {
        if !is_positive(temperature) || !temperature.is_finite() || !(1.0 / temperature).is_finite()
        {
            wasmtime::bail!(
                "scale: temperature must be a positive normal number, got {temperature}"
            );
        }
        let a = dev::scale(self.logits(&l)?, temperature)?;
        self.set(&l, a)
    }

    fn add_bias(&mut self, l: Resource<LogitsHandle>, ids: Vec<u32>, biases: Vec<f32>) -> R<()> {
        if ids.len() != biases.len() {
            wasmtime::bail!("add-bias: {} ids but {} biases", ids.len(), biases.len());
        }
        let a = dev::add_bias(self.logits(&l)?, &ids, &biases)?;
        self.set(&l, a)
    }

    fn ban(&mut self, l: Resource<LogitsHandle>, ids: Vec<u32>) -> R<()> {
        let a = dev::ban(self.logits(&l)?, &ids)?;
        self.set(&l, a)
    }

    fn allow_only(&mut self, l: Resource<LogitsHandle>, ids: Vec<u32>) -> R<()> {
        let a = dev::allow_only(self.logits(&l)?, &ids)?;
        self.set(&l, a)
    }

    fn repetition_penalty(
        &mut self,
        l: Resource<LogitsHandle>,
        h: Resource<HistoryHandle>,
        penalty: f32,
        window: u32,
    ) -> R<()> {
        if !is_positive(penalty) {
            wasmtime::bail!("repetition-penalty: penalty must be > 0, got {penalty}");
        }
        let hist = self.table.get(&h)?;
        let a = dev::repetition_penalty(self.logits(&l)?, &hist.ids, penalty, window)?;
        self.set(&l, a)
    }

    fn presence_frequency_penalty(
        &mut self,
        l: Resource<LogitsHandle>,
        h: Resource<HistoryHandle>,
        presence: f32,
        frequency: f32,
    ) -> R<()> {
        if !presence.is_finite() || !frequency.is_finite() {
            wasmtime::bail!("presence-frequency-penalty: penalties must be finite");
        }
        let hist = self.table.get(&h)?;
        let generated = &hist.ids[hist.prompt_len.min(hist.ids.len())..];
        let a = dev::presence_frequency_penalty(self.logits(&l)?, generated, presence, frequency)?;
        self.set(&l, a)
    }

    fn top_k(&mut self, l: Resource<LogitsHandle>, k: u32) -> R<()> {
        let a = dev::top_k(self.logits(&l)?, k)?;
        self.set(&l, a)
    }

    fn top_p(&mut self, l: Resource<LogitsHandle>, p: f32) -> R<()> {
        let a = dev::top_p(self.logits(&l)?, p)?;
        self.set(&l, a)
    }

    fn min_p(&mut self, l: Resource<LogitsHandle>, p: f32) -> R<()> {
        if !is_positive(p) {
            return Ok(());
        }
        if p > 1.0 {
            wasmtime::bail!("min-p: p must be in (0, 1], got {p}");
        }
        let a = dev::min_p(self.logits(&l)?, p)?;
        self.set(&l, a)
    }

    fn min_logprob(&mut self, l: Resource<LogitsHandle>, threshold: f32) -> R<()> {
        if threshold.is_nan() {
            wasmtime::bail!("min-logprob: threshold is NaN");
        }
        let a = dev::min_logprob(self.logits(&l)?, threshold)?;
        self.set(&l, a)
    }

    fn xtc(
        &mut self,
        l: Resource<LogitsHandle>,
        probability: f32,
        threshold: f32,
        keep: Vec<u32>,
        seed: u64,
        step: u32,
    ) -> R<()> {
        if !is_positive(probability) {
            return Ok(());
        }
        let a = dev::xtc(self.logits(&l)?, probability, threshold, &keep, seed, step)?;
        self.set(&l, a)
    }

    fn argmax(&mut self, l: Resource<LogitsHandle>) -> R<Resource<TokenHandle>> {
        let array = dev::argmax(self.logits(&l)?)?;
        Ok(self.table.push(TokenHandle { array })?)
    }

    fn categorical(
        &mut self,
        l: Resource<LogitsHandle>,
        seed: u64,
        step: u32,
    ) -> R<Resource<TokenHandle>> {
        let array = dev::categorical(self.logits(&l)?, seed, step)?;
        Ok(self.table.push(TokenHandle { array })?)
    }

    fn read_top(&mut self, l: Resource<LogitsHandle>, k: u32) -> R<Vec<(u32, f32)>> {
        let cur = self.logits(&l)?;
        let k = (k as usize).min(vocab(cur)) as i32;
        if k <= 0 {
            return Ok(Vec::new());
        }
        let (idx, vals) = crate::logprobs::top_k(cur, k)?;
        self.timed(|_| mlx_rs::transforms::eval([&idx, &vals]))?;
        Ok(crate::logprobs::sorted_pairs(
            idx.try_as_slice::<u32>()?,
            vals.try_as_slice::<f32>()?,
        ))
    }

    fn read_value(&mut self, l: Resource<LogitsHandle>, id: u32) -> R<f32> {
        let cur = self.logits(&l)?;
        if id as usize >= vocab(cur) {
            wasmtime::bail!(
                "read-value: id {id} outside the vocabulary ({})",
                vocab(cur)
            );
        }
        let x = cur.index(id as i32);
        self.timed(|_| x.eval())?;
        Ok(x.try_item_cast::<f32>()?)
    }

    fn read_all(&mut self, l: Resource<LogitsHandle>) -> R<Vec<f32>> {
        let cur = self.logits(&l)?.as_dtype(Dtype::Float32)?.contiguous()?;
        // The wait is mostly the step's forward: the host's time, not the
        // plugin's.
        self.timed(|_| cur.eval())?;
        Ok(cur.try_as_slice::<f32>()?.to_vec())
    }

    fn drop(&mut self, rep: Resource<LogitsHandle>) -> R<()> {
        // Borrowed handles are owned by the host.
        let _ = rep;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! Golden values: mlx-lm 0.32.2's own `apply_top_p` / `apply_min_p` /
    //! `apply_top_k` on fixed log-probabilities
    //! (`host/tests/fixtures/mlx_lm_filters.json`, made by
    //! `benches/make_sampling_fixtures.py`). Our ops run on the raw logits;
    //! the filters are shift-invariant, so the kept sets must be equal.
    use super::*;

    const FIXTURE: &str = include_str!("../../tests/fixtures/mlx_lm_filters.json");

    fn kept_after(op: &str, arg: f64, logits: &[f32]) -> Vec<bool> {
        let mut state = PluginState::new(wasmtime::StoreLimitsBuilder::new().build());
        let l = state
            .table
            .push(LogitsHandle {
                array: Array::from_slice(logits, &[logits.len() as i32]),
            })
            .expect("push");
        let r = || Resource::<LogitsHandle>::new_borrow(l.rep());
        match op {
            "top_p" => state.top_p(r(), arg as f32),
            "min_p" => state.min_p(r(), arg as f32),
            "top_k" => state.top_k(r(), arg as u32),
            other => panic!("unknown op {other}"),
        }
        .expect("op");
        let out = state.read_all(r()).expect("read");
        out.iter().map(|x| x.is_finite()).collect()
    }

    #[test]
    fn filters_keep_what_mlx_lm_keeps() {
        let f: serde_json::Value = serde_json::from_str(FIXTURE).expect("fixture");
        let logits: Vec<f32> = f["logits"]
            .as_array()
            .expect("logits")
            .iter()
            .map(|v| v.as_f64().expect("num") as f32)
            .collect();
        for case in f["cases"].as_array().expect("cases") {
            let op = case["op"].as_str().expect("op");
            let arg = case["arg"].as_f64().expect("arg");
            let expected: Vec<bool> = case["kept"]
                .as_array()
                .expect("kept")
                .iter()
                .map(|v| !v.is_null())
                .collect();
            assert_eq!(kept_after(op, arg, &logits), expected, "{op}({arg})");
        }
    }

    #[test]
    fn same_seed_and_step_draw_the_same_token() {
        let mut state = PluginState::new(wasmtime::StoreLimitsBuilder::new().build());
        let logits: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
        let l = state
            .table
            .push(LogitsHandle {
                array: Array::from_slice(&logits, &[64]),
            })
            .expect("push");
        let draw = |state: &mut PluginState, seed, step| {
            let t = state
                .categorical(Resource::new_borrow(l.rep()), seed, step)
                .expect("draw");
            let a = state.table.delete(t).expect("token").array;
            a.try_item_cast::<u32>().expect("id")
        };
        assert_eq!(draw(&mut state, 5, 3), draw(&mut state, 5, 3));
        let distinct: std::collections::BTreeSet<u32> =
            (0..20).map(|s| draw(&mut state, s, 0)).collect();
        assert!(distinct.len() > 3, "20 seeds drew only {distinct:?}");
    }

    #[test]
    fn penalties_follow_their_definitions() {
        let mut state = PluginState::new(wasmtime::StoreLimitsBuilder::new().build());
        let l = state
            .table
            .push(LogitsHandle {
                array: Array::from_slice(&[2.0f32, -2.0, 1.0, 0.5], &[4]),
            })
            .expect("push");
        let h = state
            .table
            .push(HistoryHandle {
                ids: vec![0, 1, 2, 2],
                prompt_len: 2,
            })
            .expect("push");
        let (lr, hr) = (
            || Resource::<LogitsHandle>::new_borrow(l.rep()),
            || Resource::<HistoryHandle>::new_borrow(h.rep()),
        );
        // Repetition over the last 3 tokens (1, 2, 2): id 1 (negative) x2, id 2 (positive) /2.
        state.repetition_penalty(lr(), hr(), 2.0, 3).expect("rep");
        assert_eq!(
            state.read_all(lr()).expect("read"),
            vec![2.0, -4.0, 0.5, 0.5]
        );
        // Presence/frequency over generated tokens only (2, 2): id 2 -= 2*0.25 + 1.
        state
            .presence_frequency_penalty(lr(), hr(), 1.0, 0.25)
            .expect("pf");
        assert_eq!(
            state.read_all(lr()).expect("read"),
            vec![2.0, -4.0, -1.0, 0.5]
        );
    }
}

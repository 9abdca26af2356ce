//! Host side of the `tensors` interface: the row's device arrays behind
//! resource handles, and the device operations plugins compose on them.
//!
//! Edits replace the handle's array with a new lazy one (MLX graphs are
//! functional); nothing is evaluated until the host's once-per-step `eval`,
//! except by `read-*` methods. Operation definitions follow mlx-lm's
//! `mlx_lm/sample_utils.py` (top-p, min-p, XTC, top-k), Hugging Face's
//! repetition penalty and OpenAI's presence/frequency penalties.

use mlx_rs::{
    ops::{self, indexing::IndexOp},
    random, Array, Dtype,
};
use wasmtime::component::{Resource, ResourceTable};

use super::bindings::sampler::mlxhost::plugin::tensors::{
    Host, HostHistory, HostLogits, HostToken,
};
use super::bindings::sampler::mlxhost::plugin::types;

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

/// Per-store host state: the resource table and the store's limits.
pub struct PluginState {
    /// Handles lent to the guest.
    pub table: ResourceTable,
    /// Memory limits of this instance.
    pub limits: wasmtime::StoreLimits,
}

impl PluginState {
    /// Fresh state with the given limits.
    pub fn new(limits: wasmtime::StoreLimits) -> Self {
        PluginState {
            table: ResourceTable::new(),
            limits,
        }
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

fn neg_inf() -> Array {
    Array::from_f32(f32::NEG_INFINITY)
}

/// A `[V]` float32 vector that is `value` at `ids` (ids >= V ignored) and
/// `fill` elsewhere; duplicates accumulate when `accumulate`.
fn dense(vocab: usize, ids: &[u32], values: &[f32], fill: f32, accumulate: bool) -> Array {
    let mut v = vec![fill; vocab];
    for (&id, &x) in ids.iter().zip(values) {
        if let Some(slot) = v.get_mut(id as usize) {
            *slot = if accumulate { *slot + x } else { x };
        }
    }
    Array::from_slice(&v, &[vocab as i32])
}

/// A `[V]` boolean mask, true at `ids` (ids >= V ignored).
fn id_mask(vocab: usize, ids: &[u32]) -> mlx_rs::error::Result<Array> {
    ops::gt(
        dense(vocab, ids, &vec![1.0; ids.len()], 0.0, false),
        Array::from_f32(0.5),
    )
}

fn vocab(a: &Array) -> usize {
    a.shape().first().copied().unwrap_or(0) as usize
}

/// Log-softmax over the last axis.
fn log_softmax(a: &Array) -> mlx_rs::error::Result<Array> {
    mlx_rs::nn::log_softmax(a, -1)
}

/// Deterministic PRNG key for (seed, step): the same pair gives the same draw.
pub fn step_key(seed: u64, step: u32, stream: u64) -> mlx_rs::error::Result<Array> {
    // SplitMix64 finalizer over the triple, so nearby seeds/steps decorrelate.
    let mut z = seed
        ^ (u64::from(step) << 32 | u64::from(step))
        ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    random::key(z ^ (z >> 31))
}

impl types::Host for PluginState {}
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
        let a = ops::multiply(self.logits(&l)?, Array::from_f32(1.0 / temperature))?;
        self.set(&l, a)
    }

    fn add_bias(&mut self, l: Resource<LogitsHandle>, ids: Vec<u32>, biases: Vec<f32>) -> R<()> {
        if ids.len() != biases.len() {
            wasmtime::bail!("add-bias: {} ids but {} biases", ids.len(), biases.len());
        }
        let cur = self.logits(&l)?;
        let bias = dense(vocab(cur), &ids, &biases, 0.0, true);
        let a = ops::add(cur, &bias)?;
        self.set(&l, a)
    }

    fn ban(&mut self, l: Resource<LogitsHandle>, ids: Vec<u32>) -> R<()> {
        let cur = self.logits(&l)?;
        let a = ops::select(&id_mask(vocab(cur), &ids)?, neg_inf(), cur)?;
        self.set(&l, a)
    }

    fn allow_only(&mut self, l: Resource<LogitsHandle>, ids: Vec<u32>) -> R<()> {
        let cur = self.logits(&l)?;
        let a = ops::select(&id_mask(vocab(cur), &ids)?, cur, neg_inf())?;
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
        let start = hist.ids.len().saturating_sub(window as usize);
        let mut ids: Vec<u32> = hist.ids[start..].to_vec();
        ids.sort_unstable();
        ids.dedup();
        let cur = self.logits(&l)?;
        let v = vocab(cur);
        ids.retain(|&i| (i as usize) < v);
        if ids.is_empty() {
            return Ok(());
        }
        let mask = id_mask(v, &ids)?;
        let penalized = ops::select(
            &ops::gt(cur, Array::from_f32(0.0))?,
            ops::divide(cur, Array::from_f32(penalty))?,
            ops::multiply(cur, Array::from_f32(penalty))?,
        )?;
        let a = ops::select(&mask, &penalized, cur)?;
        self.set(&l, a)
    }

    fn presence_frequency_penalty(
        &mut self,
        l: Resource<LogitsHandle>,
        h: Resource<HistoryHandle>,
        presence: f32,
        frequency: f32,
    ) -> R<()> {
        let hist = self.table.get(&h)?;
        let generated = &hist.ids[hist.prompt_len.min(hist.ids.len())..];
        let cur = self.logits(&l)?;
        let v = vocab(cur);
        let mut counts = std::collections::BTreeMap::<u32, f32>::new();
        for &id in generated.iter().filter(|&&i| (i as usize) < v) {
            *counts.entry(id).or_default() += 1.0;
        }
        if counts.is_empty() {
            return Ok(());
        }
        let ids: Vec<u32> = counts.keys().copied().collect();
        let pen: Vec<f32> = counts.values().map(|&c| c * frequency + presence).collect();
        let a = ops::subtract(cur, dense(v, &ids, &pen, 0.0, false))?;
        self.set(&l, a)
    }

    fn top_k(&mut self, l: Resource<LogitsHandle>, k: u32) -> R<()> {
        let cur = self.logits(&l)?;
        if k == 0 || k as usize >= vocab(cur) {
            return Ok(());
        }
        // The k-th largest value is the threshold (mlx-lm's apply_top_k keeps
        // exactly the argpartition's top k; ties at the boundary are kept here).
        let kth =
            ops::argpartition_axis(&ops::negative(cur)?, k as i32 - 1, -1)?.index(k as i32 - 1);
        let threshold = cur.take_axis(&kth, -1)?;
        let a = ops::select(&ops::lt(cur, &threshold)?, neg_inf(), cur)?;
        self.set(&l, a)
    }

    fn top_p(&mut self, l: Resource<LogitsHandle>, p: f32) -> R<()> {
        if !(p > 0.0 && p < 1.0) {
            return Ok(());
        }
        // mlx-lm apply_top_p: drop the low tail whose mass lies at or above
        // 1 - p of the total, measured from the top.
        let cur = self.logits(&l)?;
        let lp = log_softmax(cur)?;
        let sorted = ops::sort_axis(&lp, -1)?;
        let probs = ops::exp(&sorted)?;
        let mass_above = ops::cumsum(&probs, -1, true, false)?;
        let total = ops::add(mass_above.index(..1), probs.index(..1))?;
        let dropped = ops::sum_axis(
            &ops::ge(&mass_above, &ops::multiply(&total, Array::from_f32(p))?)?
                .as_dtype(Dtype::Int32)?,
            -1,
            true,
        )?;
        let threshold = sorted.take_axis(&dropped, -1)?;
        let a = ops::select(&ops::lt(&lp, &threshold)?, neg_inf(), cur)?;
        self.set(&l, a)
    }

    fn min_p(&mut self, l: Resource<LogitsHandle>, p: f32) -> R<()> {
        if !is_positive(p) {
            return Ok(());
        }
        if p > 1.0 {
            wasmtime::bail!("min-p: p must be in (0, 1], got {p}");
        }
        // mlx-lm apply_min_p: keep tokens with logprob >= max + ln(p) (the top
        // token always survives, so at least one is kept).
        let cur = self.logits(&l)?;
        let lp = log_softmax(cur)?;
        let top = ops::max_axis(&lp, -1, true)?;
        let threshold = ops::add(&top, Array::from_f32(p.ln()))?;
        let a = ops::select(&ops::lt(&lp, &threshold)?, neg_inf(), cur)?;
        self.set(&l, a)
    }

    fn min_logprob(&mut self, l: Resource<LogitsHandle>, threshold: f32) -> R<()> {
        if threshold.is_nan() {
            wasmtime::bail!("min-logprob: threshold is NaN");
        }
        // llama.cpp's mirostat truncation (llama-sampling.cpp,
        // `llama_sampler_mirostat_v2_apply`): drop tokens whose surprise
        // exceeds mu, i.e. logprob < -mu ln 2; the top token always stays.
        let cur = self.logits(&l)?;
        let lp = log_softmax(cur)?;
        let top = ops::max_axis(&lp, -1, true)?;
        let below = ops::logical_and(
            &ops::lt(&lp, Array::from_f32(threshold))?,
            &ops::lt(&lp, &top)?,
        )?;
        let a = ops::select(&below, neg_inf(), cur)?;
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
        // mlx-lm apply_xtc: with probability `probability`, remove every token
        // whose probability exceeds the smallest probability above
        // `threshold` (so the least likely of the "top choices" survives);
        // `keep` (EOS, newline) are never removed.
        let cur = self.logits(&l)?;
        let v = vocab(cur);
        let probs = ops::softmax_axis(cur, -1, None)?;
        let above = ops::gt(&probs, Array::from_f32(threshold))?;
        let inf = Array::from_f32(f32::INFINITY);
        let min_above = ops::min_axis(&ops::select(&above, &probs, &inf)?, -1, true)?;
        let mut remove = ops::gt(&probs, &min_above)?;
        if !keep.is_empty() {
            let protect = id_mask(v, &keep)?;
            remove = ops::logical_and(&remove, &ops::logical_not(&protect)?)?;
        }
        let draw = random::uniform::<f32, f32>(0.0, 1.0, &[], Some(&step_key(seed, step, 2)?))?;
        let apply = ops::lt(&draw, Array::from_f32(probability))?;
        let a = ops::select(&ops::logical_and(&remove, &apply)?, neg_inf(), cur)?;
        self.set(&l, a)
    }

    fn argmax(&mut self, l: Resource<LogitsHandle>) -> R<Resource<TokenHandle>> {
        let idx =
            ops::indexing::argmax_axis(self.logits(&l)?, -1, None)?.as_dtype(Dtype::Uint32)?;
        Ok(self.table.push(TokenHandle { array: idx })?)
    }

    fn categorical(
        &mut self,
        l: Resource<LogitsHandle>,
        seed: u64,
        step: u32,
    ) -> R<Resource<TokenHandle>> {
        let key = step_key(seed, step, 1)?;
        let idx =
            random::categorical(self.logits(&l)?, -1, None, Some(&key))?.as_dtype(Dtype::Uint32)?;
        Ok(self.table.push(TokenHandle { array: idx })?)
    }

    fn read_top(&mut self, l: Resource<LogitsHandle>, k: u32) -> R<Vec<(u32, f32)>> {
        let cur = self.logits(&l)?;
        let k = (k as usize).min(vocab(cur)) as i32;
        if k <= 0 {
            return Ok(Vec::new());
        }
        let (idx, vals) = crate::logprobs::top_k(cur, k)?;
        mlx_rs::transforms::eval([&idx, &vals])?;
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
        x.eval()?;
        Ok(x.try_item_cast::<f32>()?)
    }

    fn read_all(&mut self, l: Resource<LogitsHandle>) -> R<Vec<f32>> {
        let cur = self.logits(&l)?.as_dtype(Dtype::Float32)?.contiguous()?;
        cur.eval()?;
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

//! The `standard` sampler: mlx-lm's `make_sampler` (mlx_lm/sample_utils.py)
//! as device operations on the row's logits handle.
//!
//! temperature 0: argmax. Otherwise, in mlx-lm's order: top-p (when
//! 0 < top_p < 1), min-p (when != 0), XTC (when xtc_probability > 0), top-k
//! (when > 0), then a categorical draw from `logits / temperature`, keyed by
//! (seed, step) so a seed reproduces a run. The filters are shift-invariant,
//! so applying them to logits equals mlx-lm applying them to log-probabilities.

use mlxhost_plugin_sdk::sampler::exports::mlxhost::plugin::sampler::{self as api, Choice};
use mlxhost_plugin_sdk::sampler::mlxhost::plugin::tensors::{History, Logits};
use mlxhost_plugin_sdk::sampler::mlxhost::plugin::types::{PluginError, SamplingParams};

struct Plugin;

impl api::Guest for Plugin {
    type Session = Session;
}

struct Session {
    p: SamplingParams,
    seed: u64,
}

fn error(message: String) -> PluginError {
    PluginError { message }
}

impl api::GuestSession for Session {
    fn create(p: SamplingParams) -> Result<api::Session, PluginError> {
        if !(p.temperature >= 0.0) || !p.temperature.is_finite() {
            return Err(error(format!(
                "`temperature` must be >= 0, got {}",
                p.temperature
            )));
        }
        if !(0.0..=1.0).contains(&p.top_p) {
            return Err(error(format!("`top_p` must be in [0, 1], got {}", p.top_p)));
        }
        if !(0.0..=1.0).contains(&p.min_p) {
            return Err(error(format!("`min_p` must be in [0, 1], got {}", p.min_p)));
        }
        if !(0.0..=1.0).contains(&p.xtc_probability) {
            return Err(error(format!(
                "`xtc_probability` must be in [0, 1], got {}",
                p.xtc_probability
            )));
        }
        if !(0.0..=0.5).contains(&p.xtc_threshold) {
            return Err(error(format!(
                "`xtc_threshold` must be in [0, 0.5], got {}",
                p.xtc_threshold
            )));
        }
        if !p.extra.trim().is_empty() && p.extra.trim() != "{}" {
            return Err(error(format!(
                "`standard` takes no plugin parameters, got {}",
                p.extra
            )));
        }
        let seed = p.seed.unwrap_or(0);
        Ok(api::Session::new(Session { p, seed }))
    }

    fn sample(
        &self,
        logits: &Logits,
        _history: &History,
        step: u32,
    ) -> Result<Choice, PluginError> {
        let p = &self.p;
        if p.temperature == 0.0 {
            return Ok(Choice::Device(logits.argmax()));
        }
        if p.top_p > 0.0 && p.top_p < 1.0 {
            logits.top_p(p.top_p);
        }
        if p.min_p != 0.0 {
            logits.min_p(p.min_p);
        }
        if p.xtc_probability > 0.0 {
            logits.xtc(
                p.xtc_probability,
                p.xtc_threshold,
                &p.xtc_special_ids,
                self.seed,
                step,
            );
        }
        if p.top_k > 0 {
            logits.top_k(p.top_k);
        }
        if p.temperature != 1.0 {
            logits.scale(p.temperature);
        }
        Ok(Choice::Device(logits.categorical(self.seed, step)))
    }

    fn accept(&self, _token: u32, _raw_logprob: f32, _sampled_logprob: f32) {}
}

mlxhost_plugin_sdk::sampler::export_sampler!(Plugin);

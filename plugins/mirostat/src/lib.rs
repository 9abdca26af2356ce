//! `mirostat`: Mirostat v2 (Basu et al., "Mirostat: A Neural Text Decoding
//! Algorithm that Directly Controls Perplexity", ICLR 2021), as llama.cpp
//! implements it (`src/llama-sampling.cpp`, `llama_sampler_mirostat_v2_apply`):
//!
//! 1. logits / temperature (llama.cpp's chain runs its temperature sampler
//!    first; temperature 0 is greedy);
//! 2. drop tokens whose surprise `-log2 p` exceeds `mu` (the top token stays);
//! 3. draw from the renormalized rest;
//! 4. `mu -= eta * (-log2 p_chosen - tau)`, with `p_chosen` under the
//!    truncated, renormalized distribution; `mu` starts at `2 * tau`.
//!
//! Steps 1-3 are device ops on the logits handle (no read-back). Step 4 runs
//! in `accept`, whose `sampled-logprob` is exactly `ln p_chosen` under the
//! distribution the draw came from. Parameters (`plugin_params.mirostat`):
//! `tau` (default 5.0), `eta` (default 0.1).

use std::cell::Cell;

use mlxhost_plugin_sdk::sampler::exports::mlxhost::plugin::sampler::{self as api, Choice};
use mlxhost_plugin_sdk::sampler::mlxhost::plugin::tensors::{History, Logits};
use mlxhost_plugin_sdk::sampler::mlxhost::plugin::types::{PluginError, SamplingParams};

struct Plugin;

impl api::Guest for Plugin {
    type Session = Session;
}

struct Session {
    temperature: f32,
    tau: f32,
    eta: f32,
    seed: u64,
    mu: Cell<f32>,
}

fn error(message: String) -> PluginError {
    PluginError { message }
}

impl api::GuestSession for Session {
    fn create(p: SamplingParams) -> Result<api::Session, PluginError> {
        let mut tau = 5.0f32;
        let mut eta = 0.1f32;
        for (key, value) in mlxhost_plugin_sdk::numeric_params(&p.extra).map_err(error)? {
            match key.as_str() {
                "tau" => tau = value as f32,
                "eta" => eta = value as f32,
                other => {
                    return Err(error(format!(
                        "unknown parameter `{other}` (mirostat takes `tau`, `eta`)"
                    )))
                }
            }
        }
        if !(tau.is_finite() && tau > 0.0) {
            return Err(error(format!("`tau` must be > 0, got {tau}")));
        }
        if !(eta.is_finite() && eta > 0.0) {
            return Err(error(format!("`eta` must be > 0, got {eta}")));
        }
        if !(p.temperature >= 0.0) {
            return Err(error(format!(
                "`temperature` must be >= 0, got {}",
                p.temperature
            )));
        }
        Ok(api::Session::new(Session {
            temperature: p.temperature,
            tau,
            eta,
            seed: p.seed.unwrap_or(0),
            mu: Cell::new(2.0 * tau),
        }))
    }

    fn sample(
        &self,
        logits: &Logits,
        _history: &History,
        step: u32,
    ) -> Result<Choice, PluginError> {
        if self.temperature == 0.0 {
            return Ok(Choice::Device(logits.argmax()));
        }
        logits.scale(self.temperature);
        logits.min_logprob(-self.mu.get() * std::f32::consts::LN_2);
        Ok(Choice::Device(logits.categorical(self.seed, step)))
    }

    fn accept(&self, _token: u32, _raw_logprob: f32, sampled_logprob: f32) {
        if self.temperature == 0.0 || !sampled_logprob.is_finite() {
            return;
        }
        let surprise = -sampled_logprob / std::f32::consts::LN_2;
        self.mu
            .set(self.mu.get() - self.eta * (surprise - self.tau));
    }
}

mlxhost_plugin_sdk::sampler::export_sampler!(Plugin);

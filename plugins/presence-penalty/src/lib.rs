//! `presence-penalty`: OpenAI's `presence_penalty` (API reference, "Parameter
//! details"): over the tokens generated so far in this completion (not the
//! prompt), `logit[j] -= count[j] * frequency + (count[j] > 0) * presence`
//! with only the presence term set. Runs on device over the history handle.

use mlxhost_plugin_sdk::processor::exports::mlxhost::plugin::logits_processor as api;
use mlxhost_plugin_sdk::processor::mlxhost::plugin::tensors::{History, Logits};
use mlxhost_plugin_sdk::processor::mlxhost::plugin::types::{PluginError, SamplingParams};

struct Plugin;

impl api::Guest for Plugin {
    type Session = Session;
}

struct Session {
    penalty: f32,
}

impl api::GuestSession for Session {
    fn create(p: SamplingParams) -> Result<api::Session, PluginError> {
        let penalty = p.presence_penalty;
        if !(-2.0..=2.0).contains(&penalty) {
            return Err(PluginError {
                message: format!("`presence_penalty` must be in [-2, 2], got {penalty}"),
            });
        }
        Ok(api::Session::new(Session { penalty }))
    }

    fn process(&self, logits: &Logits, history: &History, _step: u32) -> Result<(), PluginError> {
        if self.penalty != 0.0 {
            logits.presence_frequency_penalty(history, self.penalty, 0.0);
        }
        Ok(())
    }

    fn accept(&self, _token: u32, _raw_logprob: f32, _sampled_logprob: f32) {}
}

mlxhost_plugin_sdk::processor::export_processor!(Plugin);

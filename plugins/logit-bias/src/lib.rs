//! `logit-bias`: OpenAI's `logit_bias` (a map of token id to a bias in
//! [-100, 100], added to the logits before the other processors), as one
//! device op on the row's logits handle.

use mlxhost_plugin_sdk::processor::exports::mlxhost::plugin::logits_processor as api;
use mlxhost_plugin_sdk::processor::mlxhost::plugin::tensors::{History, Logits};
use mlxhost_plugin_sdk::processor::mlxhost::plugin::types::{PluginError, SamplingParams};

struct Plugin;

impl api::Guest for Plugin {
    type Session = Session;
}

struct Session {
    ids: Vec<u32>,
    biases: Vec<f32>,
}

impl api::GuestSession for Session {
    fn create(p: SamplingParams) -> Result<api::Session, PluginError> {
        if let Some((id, b)) = p
            .logit_bias
            .iter()
            .find(|(_, b)| !(-100.0..=100.0).contains(b))
        {
            return Err(PluginError {
                message: format!("`logit_bias` for token {id} must be in [-100, 100], got {b}"),
            });
        }
        let (ids, biases) = p.logit_bias.into_iter().unzip();
        Ok(api::Session::new(Session { ids, biases }))
    }

    fn process(&self, logits: &Logits, _history: &History, _step: u32) -> Result<(), PluginError> {
        if !self.ids.is_empty() {
            logits.add_bias(&self.ids, &self.biases);
        }
        Ok(())
    }

    fn accept(&self, _token: u32, _raw_logprob: f32, _sampled_logprob: f32) {}
}

mlxhost_plugin_sdk::processor::export_processor!(Plugin);

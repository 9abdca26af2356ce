//! Test-only sampler that returns a token id outside the vocabulary.
use mlxhost_plugin_sdk::sampler::exports::mlxhost::plugin::sampler::{self as api, Choice};
use mlxhost_plugin_sdk::sampler::mlxhost::plugin::tensors::{History, Logits};
use mlxhost_plugin_sdk::sampler::mlxhost::plugin::types::{PluginError, SamplingParams};

struct Plugin;
impl api::Guest for Plugin {
    type Session = Session;
}

struct Session;

impl api::GuestSession for Session {
    fn create(_p: SamplingParams) -> Result<api::Session, PluginError> {
        Ok(api::Session::new(Session))
    }

    fn sample(
        &self,
        _logits: &Logits,
        _history: &History,
        _step: u32,
    ) -> Result<Choice, PluginError> {
        Ok(Choice::Host(u32::MAX))
    }

    fn accept(&self, _token: u32, _raw: f32, _sampled: f32) {}
}

mlxhost_plugin_sdk::sampler::export_sampler!(Plugin);

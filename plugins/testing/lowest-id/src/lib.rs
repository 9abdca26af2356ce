//! Test-only sampler: the lowest token id whose logit is still finite,
//! decided in the guest after reading the logits back.
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
        logits: &Logits,
        _history: &History,
        _step: u32,
    ) -> Result<Choice, PluginError> {
        let all = logits.read_all();
        all.iter()
            .position(|x| x.is_finite())
            .map(|i| Choice::Host(i as u32))
            .ok_or_else(|| PluginError {
                message: "every token is banned".into(),
            })
    }

    fn accept(&self, _token: u32, _raw: f32, _sampled: f32) {}
}

mlxhost_plugin_sdk::sampler::export_sampler!(Plugin);

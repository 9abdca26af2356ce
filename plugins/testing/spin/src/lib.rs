//! Test-only sampler that never returns (the host's epoch deadline must stop it).
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
        step: u32,
    ) -> Result<Choice, PluginError> {
        let mut x = step as u64;
        loop {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
            if x == 0 {
                return Ok(Choice::Device(logits.argmax()));
            }
        }
    }

    fn accept(&self, _token: u32, _raw: f32, _sampled: f32) {}
}

mlxhost_plugin_sdk::sampler::export_sampler!(Plugin);

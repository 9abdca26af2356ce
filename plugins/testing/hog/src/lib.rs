//! Test-only sampler that allocates without bound (the host's memory cap must stop it).
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
        let mut hoard: Vec<Vec<u8>> = Vec::new();
        loop {
            hoard.push(vec![1u8; 1 << 20]);
            if std::hint::black_box(hoard.len()) == usize::MAX {
                return Ok(Choice::Device(logits.argmax()));
            }
        }
    }

    fn accept(&self, _token: u32, _raw: f32, _sampled: f32) {}
}

mlxhost_plugin_sdk::sampler::export_sampler!(Plugin);

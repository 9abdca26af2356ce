//! Test-only logits processor: bans the token id given as parameter `id`.
use mlxhost_plugin_sdk::processor::exports::mlxhost::plugin::logits_processor as api;
use mlxhost_plugin_sdk::processor::mlxhost::plugin::tensors::{History, Logits};
use mlxhost_plugin_sdk::processor::mlxhost::plugin::types::{PluginError, SamplingParams};

struct Plugin;
impl api::Guest for Plugin {
    type Session = Session;
}

struct Session {
    id: u32,
}

impl api::GuestSession for Session {
    fn create(p: SamplingParams) -> Result<api::Session, PluginError> {
        let params = mlxhost_plugin_sdk::numeric_params(&p.extra)
            .map_err(|message| PluginError { message })?;
        let id = params
            .iter()
            .find(|(k, _)| k == "id")
            .map(|(_, v)| *v as u32)
            .ok_or_else(|| PluginError {
                message: "parameter `id` is required".into(),
            })?;
        Ok(api::Session::new(Session { id }))
    }

    fn process(&self, logits: &Logits, _history: &History, _step: u32) -> Result<(), PluginError> {
        logits.ban(&[self.id]);
        Ok(())
    }

    fn accept(&self, _token: u32, _raw: f32, _sampled: f32) {}
}

mlxhost_plugin_sdk::processor::export_processor!(Plugin);

//! Example logits processor in Rust: bans the row's previous token, so the
//! same token never appears twice in a row. It reads one id of the history
//! handle (4 bytes) and edits the logits on the device through the handle.

use mlxhost_plugin_sdk::processor::exports::mlxhost::plugin::logits_processor as api;
use mlxhost_plugin_sdk::processor::mlxhost::plugin::tensors::{History, Logits};
use mlxhost_plugin_sdk::processor::mlxhost::plugin::types::{PluginError, SamplingParams};

struct Plugin;

impl api::Guest for Plugin {
    type Session = NoRepeat;
}

struct NoRepeat;

impl api::GuestSession for NoRepeat {
    fn create(_params: SamplingParams) -> Result<api::Session, PluginError> {
        Ok(api::Session::new(NoRepeat))
    }

    fn process(&self, logits: &Logits, history: &History, _step: u32) -> Result<(), PluginError> {
        let n = history.len();
        if n > 0 {
            logits.ban(&history.read(n - 1, n));
        }
        Ok(())
    }

    fn accept(&self, _token: u32, _raw_logprob: f32, _sampled_logprob: f32) {}
}

mlxhost_plugin_sdk::processor::export_processor!(Plugin);

//! `repetition-penalty`: mlx-lm's `make_repetition_penalty`
//! (mlx_lm/sample_utils.py, after Hugging Face's
//! `RepetitionPenaltyLogitsProcessor`): over the last
//! `repetition_context_size` tokens of prompt + generation, positive logits
//! are divided by the penalty and negative ones multiplied. Runs on device
//! over the history handle (nothing is copied into the guest).

use mlxhost_plugin_sdk::processor::exports::mlxhost::plugin::logits_processor as api;
use mlxhost_plugin_sdk::processor::mlxhost::plugin::tensors::{History, Logits};
use mlxhost_plugin_sdk::processor::mlxhost::plugin::types::{PluginError, SamplingParams};

struct Plugin;

impl api::Guest for Plugin {
    type Session = Session;
}

struct Session {
    penalty: f32,
    window: u32,
}

impl api::GuestSession for Session {
    fn create(p: SamplingParams) -> Result<api::Session, PluginError> {
        if !(p.repetition_penalty.is_finite() && p.repetition_penalty > 0.0) {
            return Err(PluginError {
                message: format!(
                    "`repetition_penalty` must be > 0, got {}",
                    p.repetition_penalty
                ),
            });
        }
        Ok(api::Session::new(Session {
            penalty: p.repetition_penalty,
            window: p.repetition_context_size,
        }))
    }

    fn process(&self, logits: &Logits, history: &History, _step: u32) -> Result<(), PluginError> {
        if self.penalty != 1.0 && self.window > 0 {
            logits.repetition_penalty(history, self.penalty, self.window);
        }
        Ok(())
    }

    fn accept(&self, _token: u32, _raw_logprob: f32, _sampled_logprob: f32) {}
}

mlxhost_plugin_sdk::processor::export_processor!(Plugin);

//! A row whose output must match a grammar (structured output): before the
//! row's plugin chain runs, its constraint session's token bitset masks the
//! logits ([`crate::plugin::token_mask`]), so any sampler can only pick a
//! token the grammar allows; after the step, the chosen token advances the
//! session. Once the grammar is complete the mask holds only EOS ids, so
//! the row ends there.
//!
//! The mask is computed inside the step, after the forward was started
//! (`async_eval`), so the plugin's trie walk overlaps the model's compute.
//! A dead end, a rejected token or a trap fails this row only.

use std::time::{Duration, Instant};

use mlx_rs::Array;

use crate::plugin::constraint::ConstraintSession;
use crate::plugin::session::StepOutput;
use crate::plugin::{token_mask, PluginError, TokenChain};

/// A chain under a grammar.
pub struct GrammarConstraint<C> {
    inner: C,
    session: ConstraintSession,
    /// Time in the constraint plugin's calls.
    spent: Duration,
}

impl<C: TokenChain> GrammarConstraint<C> {
    /// Wraps `inner` with `session`'s masks.
    pub fn new(inner: C, session: ConstraintSession) -> Self {
        GrammarConstraint {
            inner,
            session,
            spent: Duration::ZERO,
        }
    }
}

impl<C: TokenChain> TokenChain for GrammarConstraint<C> {
    fn step(
        &mut self,
        logits: Array,
        ids: &[u32],
        prompt_len: usize,
        step: u32,
    ) -> Result<StepOutput, PluginError> {
        let started = Instant::now();
        let words = self.session.mask();
        let took = started.elapsed();
        self.spent += took;
        crate::plugin::timing::record(self.session.plugin(), took);
        let logits = token_mask::apply(&logits, &words?).map_err(|e| PluginError::Failed {
            plugin: self.session.plugin().to_string(),
            cause: format!("applying its token mask: {e}"),
        })?;
        self.inner.step(logits, ids, prompt_len, step)
    }

    fn accept(
        &mut self,
        token: u32,
        raw_logprob: f32,
        sampled_logprob: f32,
    ) -> Result<(), PluginError> {
        let started = Instant::now();
        let accepted = self.session.accept(token);
        let took = started.elapsed();
        self.spent += took;
        crate::plugin::timing::record(self.session.plugin(), took);
        accepted?;
        self.inner.accept(token, raw_logprob, sampled_logprob)
    }

    fn sampler_name(&self) -> &str {
        self.inner.sampler_name()
    }

    fn chain_time(&self) -> Duration {
        self.inner.chain_time() + self.spent
    }

    fn set_step_cap(&mut self, cap: Option<Duration>) {
        self.session.set_step_cap(cap);
        self.inner.set_step_cap(cap)
    }

    fn host_wait(&self) -> Duration {
        self.inner.host_wait()
    }
}

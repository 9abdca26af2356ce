//! Forced choices for a row's first tokens: the reply must begin with one
//! of a few token sequences (the rest of a tool call's start, one per
//! allowed function, when `tool_choice` is `required` over several tools).
//! While a choice is still open, every logit outside the next tokens of
//! the choices that still match is masked to -inf before the row's plugin
//! chain runs, so any sampler that draws from the logits can only pick an
//! allowed continuation; the mask ends as soon as one choice is complete.

use mlx_rs::Array;

use crate::plugin::session::StepOutput;
use crate::plugin::{device_ops, PluginError, TokenChain};

/// A chain whose first tokens are limited to `choices`.
pub struct ChoiceConstraint<C> {
    inner: C,
    choices: Vec<Vec<u32>>,
    /// Which choices the tokens so far still match.
    alive: Vec<bool>,
    /// Tokens accepted since the start.
    pos: usize,
    done: bool,
}

impl<C: TokenChain> ChoiceConstraint<C> {
    /// Wraps `inner`; empty choices are ignored, and no choice at all
    /// leaves the chain unconstrained.
    pub fn new(inner: C, choices: Vec<Vec<u32>>) -> Self {
        let choices: Vec<Vec<u32>> = choices.into_iter().filter(|c| !c.is_empty()).collect();
        let alive = vec![true; choices.len()];
        let done = choices.is_empty();
        ChoiceConstraint {
            inner,
            choices,
            alive,
            pos: 0,
            done,
        }
    }

    /// The ids allowed at this step; `None` once unconstrained.
    fn allowed(&self) -> Option<Vec<u32>> {
        if self.done {
            return None;
        }
        let mut ids: Vec<u32> = self
            .choices
            .iter()
            .zip(&self.alive)
            .filter(|(_, alive)| **alive)
            .filter_map(|(c, _)| c.get(self.pos).copied())
            .collect();
        ids.sort_unstable();
        ids.dedup();
        (!ids.is_empty()).then_some(ids)
    }
}

impl<C: TokenChain> TokenChain for ChoiceConstraint<C> {
    fn step(
        &mut self,
        logits: Array,
        ids: &[u32],
        prompt_len: usize,
        step: u32,
    ) -> Result<StepOutput, PluginError> {
        let logits = match self.allowed() {
            Some(allowed) => {
                device_ops::allow_only(&logits, &allowed).map_err(|e| PluginError::Failed {
                    plugin: "host".into(),
                    cause: format!("masking forced choices: {e}"),
                })?
            }
            None => logits,
        };
        self.inner.step(logits, ids, prompt_len, step)
    }

    fn accept(
        &mut self,
        token: u32,
        raw_logprob: f32,
        sampled_logprob: f32,
    ) -> Result<(), PluginError> {
        if !self.done {
            for (c, alive) in self.choices.iter().zip(self.alive.iter_mut()) {
                *alive &= c.get(self.pos) == Some(&token);
            }
            self.pos += 1;
            // Done when a choice is complete, or none matches any more (a
            // sampler that ignores the logits; the parser reports the call).
            let complete = self
                .choices
                .iter()
                .zip(&self.alive)
                .any(|(c, alive)| *alive && c.len() == self.pos);
            self.done = complete || !self.alive.iter().any(|a| *a);
        }
        self.inner.accept(token, raw_logprob, sampled_logprob)
    }

    fn sampler_name(&self) -> &str {
        self.inner.sampler_name()
    }

    fn chain_time(&self) -> std::time::Duration {
        self.inner.chain_time()
    }
    fn set_step_cap(&mut self, cap: Option<std::time::Duration>) {
        self.inner.set_step_cap(cap)
    }
    fn host_wait(&self) -> std::time::Duration {
        self.inner.host_wait()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugin::session::Chosen;

    /// Greedy over the logits it is given, recording what it saw.
    struct Greedy {
        seen_finite: Vec<usize>,
    }

    impl TokenChain for Greedy {
        fn step(
            &mut self,
            logits: Array,
            _: &[u32],
            _: usize,
            _: u32,
        ) -> Result<StepOutput, PluginError> {
            logits.eval().expect("eval");
            let v: Vec<f32> = logits.as_slice::<f32>().to_vec();
            self.seen_finite
                .push(v.iter().filter(|x| x.is_finite()).count());
            let best = v
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map(|(i, _)| i as u32)
                .unwrap_or(0);
            Ok(StepOutput {
                token: Chosen::Host(best),
                final_logits: logits,
            })
        }
        fn accept(&mut self, _: u32, _: f32, _: f32) -> Result<(), PluginError> {
            Ok(())
        }
        fn sampler_name(&self) -> &str {
            "greedy"
        }
        fn chain_time(&self) -> std::time::Duration {
            std::time::Duration::ZERO
        }
    }

    fn pick(c: &mut ChoiceConstraint<Greedy>, favourite: u32) -> u32 {
        let mut logits = vec![0.0f32; 8];
        logits[favourite as usize] = 5.0;
        let out = c
            .step(Array::from_slice(&logits, &[8]), &[], 0, 0)
            .expect("step");
        let Chosen::Host(id) = out.token else {
            unreachable!()
        };
        c.accept(id, 0.0, 0.0).expect("accept");
        id
    }

    #[test]
    fn only_a_choice_can_be_written_then_the_row_is_free() {
        let mut c = ChoiceConstraint::new(
            Greedy {
                seen_finite: Vec::new(),
            },
            vec![vec![1, 2, 3], vec![1, 4]],
        );
        // The model prefers 7, but only 1 may start; then 2 or 4.
        assert_eq!(pick(&mut c, 7), 1);
        assert_eq!(pick(&mut c, 4), 4);
        // `[1, 4]` is complete: unconstrained from here.
        assert_eq!(pick(&mut c, 7), 7);
        assert_eq!(c.inner.seen_finite, vec![1, 2, 8]);
    }
}

//! `dry`: the DRY ("Don't Repeat Yourself") repetition penalty by pi6am
//! (koboldcpp PR 982), exactly as llama.cpp implements it
//! (`src/llama-sampling.cpp`, `llama_sampler_dry_apply`):
//!
//! 1. Over the last `penalty_last_n` tokens of history (prompt + generated;
//!    -1 = all), find the most recent sequence breaker; repeats may not
//!    reach back past it (`rep_limit`).
//! 2. With the Z-algorithm run backwards, find for every earlier position
//!    how long the sequence ending there matches the sequence ending at the
//!    last token.
//! 3. The token that followed each match of length >= `allowed_length`
//!    would extend a repeat; keep the longest match per token.
//! 4. `logit[token] -= multiplier * base^(len - allowed_length)` (the
//!    exponent clamped against float overflow), except for tokens that are a
//!    sequence breaker on their own.
//!
//! Sequence breakers are strings; the host's `vocab.token-sequences-for`
//! turns each into (head token, tail tokens) pairs as llama.cpp does (tails
//! cut to 20 tokens, breakers to 40 bytes). Parameters
//! (`plugin_params.dry`): `multiplier` (0.8; 0 disables), `base` (1.75),
//! `allowed_length` (2), `penalty_last_n` (-1), `sequence_breakers`
//! (`["\n", ":", "\"", "*"]`). The history is read once per step (4 bytes
//! per token in the window); the penalty is one `add-bias` on the device.

use std::collections::HashMap;

use mlxhost_plugin_sdk::processor::exports::mlxhost::plugin::logits_processor as api;
use mlxhost_plugin_sdk::processor::mlxhost::plugin::tensors::{History, Logits};
use mlxhost_plugin_sdk::processor::mlxhost::plugin::types::{PluginError, SamplingParams};
use mlxhost_plugin_sdk::processor::mlxhost::plugin::vocab;
use serde_json::Value;

/// llama.cpp's limits on breakers (`llama_sampler_init_dry`).
const MAX_CHAR_LEN: usize = 40;
const MAX_SEQ_LEN: u32 = 20;

struct Plugin;

impl api::Guest for Plugin {
    type Session = Dry;
}

struct Dry {
    multiplier: f32,
    base: f32,
    allowed_length: usize,
    /// -1 = the whole history.
    penalty_last_n: i64,
    /// Head token -> tails (empty tail: the head alone is a breaker).
    breakers: HashMap<u32, Vec<Vec<u32>>>,
}

fn error(message: String) -> PluginError {
    PluginError { message }
}

fn number(
    obj: &serde_json::Map<String, Value>,
    key: &str,
    default: f64,
) -> Result<f64, PluginError> {
    match obj.get(key) {
        None => Ok(default),
        Some(v) => v
            .as_f64()
            .ok_or_else(|| error(format!("`{key}` must be a number, got {v}"))),
    }
}

impl api::GuestSession for Dry {
    fn create(p: SamplingParams) -> Result<api::Session, PluginError> {
        let extra: Value = serde_json::from_str(&p.extra)
            .map_err(|e| error(format!("parameters are not JSON: {e}")))?;
        let obj = extra.as_object().cloned().unwrap_or_default();
        const KNOWN: [&str; 5] = [
            "multiplier",
            "base",
            "allowed_length",
            "penalty_last_n",
            "sequence_breakers",
        ];
        if let Some(k) = obj.keys().find(|k| !KNOWN.contains(&k.as_str())) {
            return Err(error(format!(
                "unknown parameter `{k}` (dry takes {})",
                KNOWN.join(", ")
            )));
        }
        let multiplier = number(&obj, "multiplier", 0.8)? as f32;
        let base = number(&obj, "base", 1.75)? as f32;
        let allowed_length = number(&obj, "allowed_length", 2.0)?;
        let penalty_last_n = number(&obj, "penalty_last_n", -1.0)?;
        if !(multiplier >= 0.0 && multiplier.is_finite()) {
            return Err(error(format!(
                "`multiplier` must be >= 0, got {multiplier}"
            )));
        }
        if !(base >= 1.0 && base.is_finite()) {
            return Err(error(format!("`base` must be >= 1, got {base}")));
        }
        if allowed_length < 1.0 || allowed_length.fract() != 0.0 {
            return Err(error(format!(
                "`allowed_length` must be an integer >= 1, got {allowed_length}"
            )));
        }
        if penalty_last_n < -1.0 || penalty_last_n.fract() != 0.0 {
            return Err(error(format!(
                "`penalty_last_n` must be -1 or an integer >= 0, got {penalty_last_n}"
            )));
        }
        let texts: Vec<String> = match obj.get("sequence_breakers") {
            None => ["\n", ":", "\"", "*"].map(String::from).to_vec(),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_str()
                        .map(String::from)
                        .ok_or_else(|| error("`sequence_breakers` must be strings".into()))
                })
                .collect::<Result<_, _>>()?,
            Some(v) => {
                return Err(error(format!(
                    "`sequence_breakers` must be an array of strings, got {v}"
                )))
            }
        };
        let mut breakers: HashMap<u32, Vec<Vec<u32>>> = HashMap::new();
        if multiplier > 0.0 && penalty_last_n != 0.0 {
            for text in texts.iter().filter(|t| !t.is_empty()) {
                // llama.cpp truncates breakers to 40 bytes (on a char boundary here).
                let mut cut = text.len().min(MAX_CHAR_LEN);
                while !text.is_char_boundary(cut) {
                    cut -= 1;
                }
                for (head, tail) in vocab::token_sequences_for(&text[..cut], MAX_SEQ_LEN) {
                    let tails = breakers.entry(head).or_default();
                    if !tails.contains(&tail) {
                        tails.push(tail);
                    }
                }
            }
        }
        Ok(api::Session::new(Dry {
            multiplier,
            base,
            allowed_length: allowed_length as usize,
            penalty_last_n: penalty_last_n as i64,
            breakers,
        }))
    }

    fn process(&self, logits: &Logits, history: &History, _step: u32) -> Result<(), PluginError> {
        if self.multiplier == 0.0 || self.penalty_last_n == 0 {
            return Ok(());
        }
        let len = history.len();
        let window = match self.penalty_last_n {
            -1 => len,
            n => len.min(u32::try_from(n).unwrap_or(u32::MAX)),
        };
        let tokens = history.read(len - window, len);
        let (ids, penalties) = self.penalties(&tokens);
        if !ids.is_empty() {
            let biases: Vec<f32> = penalties.iter().map(|p| -p).collect();
            logits.add_bias(&ids, &biases);
        }
        Ok(())
    }

    fn accept(&self, _token: u32, _raw_logprob: f32, _sampled_logprob: f32) {}
}

impl Dry {
    /// Steps 1-4 over `tokens` (oldest first): (token ids, penalties).
    fn penalties(&self, tokens: &[u32]) -> (Vec<u32>, Vec<f32>) {
        let n = tokens.len();
        let allowed = self.allowed_length;
        if n <= allowed {
            return (Vec::new(), Vec::new());
        }
        // `rat(i)`: the i-th token from the end (llama.cpp's ring_buffer::rat).
        let rat = |i: usize| tokens[n - 1 - i];

        // Step 1: the most recent restart sequence limits repeat lengths.
        let mut rep_limit = n;
        for i in 0..n {
            let Some(tails) = self.breakers.get(&rat(i)) else {
                continue;
            };
            let mut longest: Option<usize> = None;
            for tail in tails {
                let seq_len = tail.len();
                if longest.is_none_or(|l| seq_len > l) && seq_len <= i {
                    if (0..seq_len).all(|off| tail[off] == rat(i - off - 1)) {
                        longest = Some(seq_len);
                    }
                }
            }
            if let Some(l) = longest {
                rep_limit = i - l;
                break;
            }
        }
        if rep_limit < allowed {
            return (Vec::new(), Vec::new());
        }

        // Step 2: Z-algorithm over the reversed window.
        let last = n - 1;
        let mut repeat = vec![0usize; n];
        let (mut lt, mut rt) = (0usize, 0usize);
        for k in 1..n {
            if k > rt {
                let mut m = 0;
                while m + k < n && rat(m) == rat(m + k) {
                    m += 1;
                }
                repeat[last - k] = m.min(rep_limit);
                if m > 0 {
                    lt = k;
                    rt = k + m - 1;
                }
            } else {
                let p = k - lt;
                let right_part_len = rt - k + 1;
                if repeat[last - p] < right_part_len {
                    repeat[last - k] = repeat[last - p].min(rep_limit);
                } else {
                    let mut i = rt + 1;
                    while i < n && rat(i) == rat(i - k) {
                        i += 1;
                    }
                    repeat[last - k] = (i - k).min(rep_limit);
                    lt = k;
                    rt = i - 1;
                }
            }
        }

        // Step 3: the token after each long-enough match would extend it.
        let mut max_repeat: Vec<(u32, usize)> = Vec::new();
        for (i, &len) in repeat.iter().enumerate().take(n - 1) {
            if len >= allowed {
                let token = rat(n - 2 - i);
                match max_repeat.iter_mut().find(|(t, _)| *t == token) {
                    Some((_, l)) if *l < len => *l = len,
                    Some(_) => {}
                    None => max_repeat.push((token, len)),
                }
            }
        }

        // Step 4: penalties, clamped against float overflow; a token that is
        // a sequence breaker on its own is never penalized.
        let max_exponent = if self.base > 1.000_001 {
            (88.722_84f32 / self.base.ln()) as i64
        } else {
            0
        };
        let mut ids = Vec::new();
        let mut penalties = Vec::new();
        for (token, len) in max_repeat {
            let single = self
                .breakers
                .get(&token)
                .is_some_and(|tails| tails.iter().any(Vec::is_empty));
            if single {
                continue;
            }
            let mut exp = len as i64 - allowed as i64;
            if max_exponent > 0 && exp > max_exponent {
                exp = max_exponent;
            }
            ids.push(token);
            penalties.push(self.multiplier * self.base.powi(exp as i32));
        }
        (ids, penalties)
    }
}

mlxhost_plugin_sdk::processor::export_processor!(Plugin);

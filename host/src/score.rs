//! Teacher-forced scoring (`mlxhost score`): the log-probability the model
//! assigns to each given continuation token, plus its top alternatives.
//!
//! Input: JSON lines, each `{"prompt_ids": [...], "continuation_ids": [...]}`
//! or `{"messages": [...], "continuation_ids": [...]}` (messages rendered
//! with the chat template and a generation prompt). Output: one JSON line per
//! input, `{"steps": [{"token": id, "logprob": x, "top": [[id, x], ...]}]}`,
//! natural log, log-softmax of the raw logits at the position before each
//! token.

use mlx_rs::{ops, transforms::eval, Array};
use serde::{Deserialize, Serialize};

use crate::model::lora::LoraAdapter;
use crate::model::{ChatMessage, LoadedModel, ModelError, RowInput};

/// Prompt tokens per forward pass while prefilling (bounds attention memory).
pub const PREFILL_CHUNK: usize = 512;

/// One input line, as written by the user.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScoreInput {
    /// Prompt token ids (exclusive with `messages`).
    #[serde(default)]
    pub prompt_ids: Option<Vec<u32>>,
    /// Chat messages rendered with the chat template (exclusive with `prompt_ids`).
    #[serde(default)]
    pub messages: Option<Vec<ChatMessage>>,
    /// The tokens to score, in order.
    pub continuation_ids: Vec<u32>,
    /// The LoRA adapter to score under, by its name in `--lora-dir`
    /// (absent: `--lora`, else the base model).
    #[serde(default)]
    pub lora: Option<String>,
}

/// A scored token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Step {
    /// The continuation token.
    pub token: u32,
    /// Its log-probability (natural log).
    pub logprob: f32,
    /// The `top_logprobs` most likely tokens at this position, descending.
    pub top: Vec<(u32, f32)>,
}

/// One output line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScoreOutput {
    /// One entry per continuation token.
    pub steps: Vec<Step>,
}

/// Errors from scoring; input errors name the line and field.
#[derive(Debug, thiserror::Error)]
pub enum ScoreError {
    /// A line is not valid input.
    #[error("input line {line}: {reason}")]
    Input {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        reason: String,
    },
    /// The model failed.
    #[error(transparent)]
    Model(#[from] ModelError),
}

impl From<mlx_rs::error::Exception> for ScoreError {
    fn from(e: mlx_rs::error::Exception) -> Self {
        ScoreError::Model(ModelError::Mlx(e))
    }
}

/// Parses line `line` (1-based) into prompt and continuation ids.
pub fn parse_line(
    model: &LoadedModel,
    text: &str,
    line: usize,
) -> Result<(Vec<u32>, Vec<u32>), ScoreError> {
    parse_line_lora(model, text, line).map(|(p, c, _)| (p, c))
}

/// A parsed input line: prompt ids, continuation ids, the `lora` field.
pub type ParsedLine = (Vec<u32>, Vec<u32>, Option<String>);

/// As [`parse_line`], plus the line's `lora` field.
pub fn parse_line_lora(
    model: &LoadedModel,
    text: &str,
    line: usize,
) -> Result<ParsedLine, ScoreError> {
    let bad = |reason: String| ScoreError::Input { line, reason };
    let input: ScoreInput = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
    let lora = input.lora.clone();
    let prompt = match (input.prompt_ids, input.messages) {
        (Some(ids), None) => ids,
        (None, Some(messages)) => {
            let template = model
                .template
                .as_ref()
                .ok_or_else(|| bad("`messages` given but the model has no chat template".into()))?;
            let text = template
                .render(&messages, true)
                .map_err(|e| bad(format!("`messages`: {e}")))?;
            model.tokenizer.encode(&text)?
        }
        (Some(_), Some(_)) => {
            return Err(bad(
                "give either `prompt_ids` or `messages`, not both".into()
            ))
        }
        (None, None) => return Err(bad("missing field `prompt_ids` (or `messages`)".into())),
    };
    if prompt.is_empty() {
        return Err(bad(
            "`prompt_ids` is empty: the first continuation token needs a preceding token".into(),
        ));
    }
    let vocab = model.model.config().vocab_size;
    for (field, ids) in [
        ("prompt_ids", &prompt),
        ("continuation_ids", &input.continuation_ids),
    ] {
        if let Some(id) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(bad(format!(
                "`{field}` has token id {id}, outside the vocabulary (size {vocab})"
            )));
        }
    }
    let context = model.model.config().max_position_embeddings;
    if prompt.len() + input.continuation_ids.len() > context {
        return Err(bad(format!(
            "prompt + continuation is {} tokens, more than the model's context of {context}",
            prompt.len() + input.continuation_ids.len()
        )));
    }
    Ok((prompt, input.continuation_ids, lora))
}

/// Scores a batch of rows in one set of forward passes (rows may differ in
/// length). `top_k` alternatives per step (0 for none). `decode`: after the
/// prompt's prefill, feed the continuation one token per forward (the
/// decode path generation runs, batched over the rows) instead of in
/// prefill chunks of `prefill_chunk` tokens (at least 1).
pub fn score_rows(
    model: &LoadedModel,
    rows: &[(Vec<u32>, Vec<u32>)],
    top_k: usize,
    decode: bool,
    prefill_chunk: usize,
) -> Result<Vec<ScoreOutput>, ScoreError> {
    let none = vec![None; rows.len()];
    score_rows_lora(model, rows, &none, top_k, decode, prefill_chunk)
}

/// As [`score_rows`], row `i` under the LoRA adapter `adapters[i]` (`None`:
/// the base model); rows of different adapters share each forward.
pub fn score_rows_lora(
    model: &LoadedModel,
    rows: &[(Vec<u32>, Vec<u32>)],
    adapters: &[Option<&LoraAdapter>],
    top_k: usize,
    decode: bool,
    prefill_chunk: usize,
) -> Result<Vec<ScoreOutput>, ScoreError> {
    let chunk = prefill_chunk.max(1);
    let lm = &model.model;
    // Each row feeds prompt + continuation[..-1]; logits from the last prompt
    // position on predict the continuation tokens.
    let inputs: Vec<Vec<u32>> = rows
        .iter()
        .map(|(p, c)| {
            let mut t = p.clone();
            if !c.is_empty() {
                t.extend_from_slice(&c[..c.len() - 1]);
            }
            t
        })
        .collect();
    let mut caches: Vec<_> = rows.iter().map(|_| lm.new_cache()).collect();
    let mut pieces: Vec<Vec<Array>> = vec![Vec::new(); rows.len()];
    let mut pos = vec![0usize; rows.len()];
    loop {
        let mut batch: Vec<RowInput<'_>> = Vec::new();
        let mut which = Vec::new();
        for (i, cache) in caches.iter_mut().enumerate() {
            let (p, c) = (&rows[i].0, &rows[i].1);
            let t = &inputs[i];
            if pos[i] >= t.len() || c.is_empty() {
                continue;
            }
            let end = if decode && pos[i] >= p.len() {
                pos[i] + 1
            } else if decode {
                (pos[i] + chunk).min(p.len())
            } else {
                (pos[i] + chunk).min(t.len())
            };
            let first_needed = p.len() - 1;
            batch.push(RowInput {
                tokens: &t[pos[i]..end],
                cache,
                logits_from: first_needed.saturating_sub(pos[i]).min(end - pos[i]),
                lora: adapters.get(i).copied().flatten(),
            });
            which.push((i, end));
        }
        if batch.is_empty() {
            break;
        }
        let logits = lm.forward(&mut batch)?;
        let mut to_eval: Vec<&Array> = logits.iter().collect();
        for row in &batch {
            to_eval.extend(row.cache.arrays());
        }
        eval(to_eval)?;
        drop(batch);
        for ((i, end), l) in which.into_iter().zip(logits) {
            if l.shape()[0] > 0 {
                pieces[i].push(l);
            }
            pos[i] = end;
        }
    }
    let mut out = Vec::with_capacity(rows.len());
    for (i, (_, cont)) in rows.iter().enumerate() {
        if cont.is_empty() {
            out.push(ScoreOutput { steps: Vec::new() });
            continue;
        }
        let logits = ops::concatenate(&pieces[i], 0)?;
        out.push(ScoreOutput {
            steps: steps_from_logits(&logits, cont, top_k)?,
        });
    }
    Ok(out)
}

/// Log-softmax of `logits [C, V]`, the logprob of `targets[c]` at row `c`
/// and the `top_k` largest per row, sorted descending.
pub fn steps_from_logits(
    logits: &Array,
    targets: &[u32],
    top_k: usize,
) -> Result<Vec<Step>, ScoreError> {
    let lp = mlx_rs::nn::log_softmax(logits, -1)?;
    let c = targets.len() as i32;
    let tgt = Array::from_slice(targets, &[c, 1]);
    let chosen = lp.take_along_axis(&tgt, -1)?.contiguous()?;
    let vocab = lp.shape()[1];
    let k = (top_k as i32).min(vocab);
    let (top_idx, top_val) = if k > 0 {
        let (idx, vals) = crate::logprobs::top_k(&lp, k)?;
        (Some(idx), Some(vals))
    } else {
        (None, None)
    };
    let mut arrays = vec![&chosen];
    arrays.extend(top_idx.iter());
    arrays.extend(top_val.iter());
    eval(arrays)?;
    let chosen = chosen.as_slice::<f32>();
    let mut steps = Vec::with_capacity(targets.len());
    for (r, &token) in targets.iter().enumerate() {
        let mut top = Vec::new();
        if let (Some(idx), Some(val)) = (&top_idx, &top_val) {
            let k = k as usize;
            let ids = &idx.as_slice::<u32>()[r * k..(r + 1) * k];
            let vals = &val.as_slice::<f32>()[r * k..(r + 1) * k];
            top = crate::logprobs::sorted_pairs(ids, vals);
        }
        steps.push(Step {
            token,
            logprob: chosen[r],
            top,
        });
    }
    Ok(steps)
}

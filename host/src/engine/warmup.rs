//! The warm-up the engine runs before `/health` reports ready: requests
//! through the real scheduler (template-free prompt ids, prefill, batched
//! decode steps, the default sampler's plugin chain), so a broken default
//! sampler is found before the server is ready and the first requests do
//! not pay one-time costs.
//!
//! On a GPU backend those costs are large: MLX compiles a kernel the first
//! time it meets a new (op, dtype, shape class), through NVRTC on CUDA, and
//! the first request after ready used to wait ~50 s for its first token on
//! an H200 (issue "NVIDIA"). There the warm-up covers what requests will
//! meet: every decode batch size from `--batch` down to 1 (rows with
//! staggered `max_tokens` leave the batch one per step), prefill pieces of
//! the scheduler's sizes (a full `--prefill-budget` piece and odd
//! remainders), greedy and sampled rows (top-p, top-k, min-p), and
//! `top_logprobs`. On the CPU backend nothing is compiled at run time, so
//! two short requests suffice and start-up stays fast.

use std::cell::RefCell;
use std::rc::Rc;

use super::request::{GenerateError, GenerateEvent, GenerateRequest, GenerateSummary};
use super::scheduler::{ChainSource, Pending, Scheduler};
use super::sequence::SequenceSink;
use crate::model::LoadedModel;
use crate::plugin::{PluginHost, SamplingParams};
use std::sync::Arc;

/// One warm-up row: its prompt length in tokens, decode tokens and
/// sampling settings.
#[derive(Debug, Clone, PartialEq)]
struct WarmRow {
    prompt_tokens: usize,
    max_tokens: usize,
    sampled: bool,
    top_logprobs: usize,
}

/// The rows to run. `gpu`: the backend compiles kernels at run time;
/// `max_batch`, `prefill_budget`: the scheduler's settings; `context`: the
/// model's context length in tokens.
fn plan(gpu: bool, max_batch: usize, prefill_budget: usize, context: usize) -> Vec<WarmRow> {
    if !gpu {
        return vec![
            WarmRow {
                prompt_tokens: 1,
                max_tokens: 2,
                sampled: false,
                top_logprobs: 0,
            },
            WarmRow {
                prompt_tokens: 7,
                max_tokens: 2,
                sampled: false,
                top_logprobs: 0,
            },
        ];
    }
    let rows = max_batch.max(1);
    // Prompt lengths spread over 1..=prefill_budget so prefill pieces of many
    // sizes are met, plus one prompt longer than a whole budget (a full piece
    // followed by a remainder in the next step).
    let budget = prefill_budget.max(1);
    let cap = context.saturating_sub(rows + 4).max(1);
    (0..rows)
        .map(|i| {
            let prompt_tokens = if i == 0 {
                budget + budget / 3 + 1
            } else {
                1 + (i * 37) % budget
            };
            WarmRow {
                prompt_tokens: prompt_tokens.min(cap),
                // Row i leaves after i + 2 tokens: the batch shrinks from
                // `rows` to 1 one row per step, so every batch size runs.
                max_tokens: i + 2,
                sampled: i % 2 == 1,
                top_logprobs: if i % 4 == 2 { 5 } else { 0 },
            }
        })
        .collect()
}

/// Whether to run the full plan: on a GPU backend, or when
/// `MLXHOST_WARMUP=full` asks for it (to try the GPU's plan on the CPU).
pub fn full_warm_up() -> bool {
    crate::runtime::gpu_available() || std::env::var("MLXHOST_WARMUP").is_ok_and(|v| v == "full")
}

/// Runs the warm-up through `scheduler` with `sampler` from `plugins`;
/// `gpu` selects the plan (see the module docs). Errors: the first failed
/// row's message (a sampler that traps, a model that cannot step).
pub fn warm_up(
    model: &LoadedModel,
    plugins: &Arc<PluginHost>,
    sampler: &str,
    scheduler: &mut Scheduler<'static>,
    gpu: bool,
) -> Result<(), String> {
    let config = scheduler.config();
    let context = model.model.config().max_position_embeddings;
    let rows = plan(gpu, config.max_batch, config.prefill_budget, context);
    // Real text, repeated to length: ids a model meets in practice.
    let text_ids = model
        .tokenizer
        .encode("Hello, how are you today? Tell me about the sea and the stars.")
        .map_err(|e| e.to_string())?;
    if text_ids.is_empty() {
        return Err("the tokenizer encoded the warm-up text to no tokens".into());
    }
    let results: Rc<RefCell<Vec<Result<GenerateSummary, GenerateError>>>> = Rc::default();
    for (i, row) in rows.iter().enumerate() {
        let prompt_ids: Vec<u32> = text_ids
            .iter()
            .copied()
            .cycle()
            .take(row.prompt_tokens)
            .collect();
        let params = if row.sampled {
            SamplingParams {
                temperature: 0.7,
                top_p: 0.9,
                top_k: 40,
                min_p: 0.05,
                seed: Some(i as u64),
                ..Default::default()
            }
        } else {
            SamplingParams {
                temperature: 0.0,
                ..Default::default()
            }
        };
        scheduler.submit(Pending {
            request: GenerateRequest {
                prompt_ids,
                max_tokens: row.max_tokens,
                stop: Vec::new(),
                keep_special: false,
                forced_choices: Vec::new(),
                params,
                sampler: sampler.into(),
                processors: Vec::new(),
                plugin_params: serde_json::json!({}),
                top_logprobs: row.top_logprobs,
            },
            chain: ChainSource::Plugins(plugins.clone()),
            sink: Box::new(WarmSink(results.clone())),
        });
    }
    while !scheduler.is_idle() {
        scheduler.step(model, None);
    }
    scheduler.reset_stats();
    let results = std::mem::take(&mut *results.borrow_mut());
    for r in results {
        r.map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Collects warm-up results.
struct WarmSink(Rc<RefCell<Vec<Result<GenerateSummary, GenerateError>>>>);

impl SequenceSink for WarmSink {
    fn event(&mut self, _: GenerateEvent) {}
    fn cancelled(&self) -> bool {
        false
    }
    fn finished(&mut self, result: Result<GenerateSummary, GenerateError>) {
        self.0.borrow_mut().push(result);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_plan_is_two_short_greedy_rows() {
        let rows = plan(false, 16, 256, 8192);
        assert_eq!(rows.len(), 2);
        assert!(rows.iter().all(|r| !r.sampled && r.max_tokens == 2));
    }

    #[test]
    fn gpu_plan_runs_every_batch_size_and_a_prompt_over_one_budget() {
        let rows = plan(true, 16, 256, 8192);
        assert_eq!(rows.len(), 16);
        // Distinct max_tokens 2..=17: one row leaves per step, so the batch
        // passes through 16, 15, ..., 1 rows.
        let mut lens: Vec<usize> = rows.iter().map(|r| r.max_tokens).collect();
        lens.sort_unstable();
        assert_eq!(lens, (2..=17).collect::<Vec<_>>());
        assert!(rows.iter().any(|r| r.prompt_tokens > 256));
        assert!(rows.iter().any(|r| r.sampled) && rows.iter().any(|r| !r.sampled));
        assert!(rows.iter().any(|r| r.top_logprobs > 0));
        assert!(rows.iter().all(|r| r.prompt_tokens >= 1));
    }

    #[test]
    fn gpu_plan_fits_a_short_context() {
        let rows = plan(true, 4, 256, 64);
        assert!(rows.iter().all(|r| r.prompt_tokens + r.max_tokens <= 64));
        assert_eq!(plan(true, 1, 256, 8192).len(), 1);
    }
}

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
//! `top_logprobs`, then prompt-cache hits: rows seeded from a warm-up-only
//! cache holding the first rows' KV (an exact repeat, a prompt extending a
//! cached one, and one sharing only part of one, which trims the cached KV
//! and continues), and last the structured-output mask's device ops on
//! one row of logits. The first request to hit the RAM cache after ready once
//! waited 36.6 s on an H100 for kernels the first rows never met (issue
//! 35). On the CPU backend nothing is compiled at run time, so two short
//! requests suffice and start-up stays fast.

use std::cell::RefCell;
use std::rc::Rc;

use super::request::{GenerateError, GenerateEvent, GenerateRequest, GenerateSummary};
use super::scheduler::{ChainSource, Pending, Scheduler};
use super::sequence::SequenceSink;
use crate::cache::prompt::ReuseSource;
use crate::cache::tiers::PrefixCache;
use crate::cache::PromptCache;
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
    /// Where the prompt's text starts in the warm-up text's cycle of ids
    /// (the cache-hit rows' tails differ from the cached prompts here).
    text_offset: usize,
    /// The cache-hit rows: this many first tokens are the first phase's
    /// row `.0`'s prompt (then the prompt goes on from `text_offset`).
    shared: Option<(usize, usize)>,
}

impl WarmRow {
    fn fresh(prompt_tokens: usize, max_tokens: usize, sampled: bool, top_logprobs: usize) -> Self {
        WarmRow {
            prompt_tokens,
            max_tokens,
            sampled,
            top_logprobs,
            text_offset: 0,
            shared: None,
        }
    }
}

/// The second phase (GPU plan): rows hitting the prompt cache the first
/// phase's `rows` filled: an exact repeat of row 1, row 1's prompt plus 20
/// tokens, and the first 26 tokens of row 0 (longer) plus 20 others (the
/// cached KV trimmed, then continued; the case that stalled). Greedy, and
/// one sampled. Prompts stay within `cap` tokens.
fn cache_hit_plan(rows: &[WarmRow], cap: usize) -> Vec<WarmRow> {
    let mut out = Vec::new();
    let mut hit = |src: usize, shared: usize, extra: usize, sampled: bool| {
        let prompt_tokens = (shared + extra).min(cap);
        out.push(WarmRow {
            prompt_tokens,
            max_tokens: 2,
            sampled,
            top_logprobs: 0,
            text_offset: 3,
            shared: Some((src, shared.min(prompt_tokens))),
        });
    };
    if let Some(r) = rows.get(1).or(rows.first()) {
        let src = usize::from(rows.len() > 1);
        hit(src, r.prompt_tokens, 0, false);
        hit(src, r.prompt_tokens, 20, true);
    }
    if let Some(r) = rows.first() {
        hit(0, r.prompt_tokens.min(26), 20, false);
    }
    out
}

/// The rows to run. `gpu`: the backend compiles kernels at run time;
/// `max_batch`, `prefill_budget`: the scheduler's settings; `context`: the
/// model's context length in tokens.
fn plan(gpu: bool, max_batch: usize, prefill_budget: usize, context: usize) -> Vec<WarmRow> {
    if !gpu {
        return vec![
            WarmRow::fresh(1, 2, false, 0),
            WarmRow::fresh(7, 2, false, 0),
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
            // Row i leaves after i + 2 tokens: the batch shrinks from
            // `rows` to 1 one row per step, so every batch size runs.
            WarmRow::fresh(
                prompt_tokens.min(cap),
                i + 2,
                i % 2 == 1,
                if i % 4 == 2 { 5 } else { 0 },
            )
        })
        .collect()
}

/// Whether to run the full plan: on a GPU backend, or when
/// `MLXHOST_WARMUP=full` asks for it (to try the GPU's plan on the CPU).
pub fn full_warm_up() -> bool {
    crate::runtime::gpu_available() || std::env::var("MLXHOST_WARMUP").is_ok_and(|v| v == "full")
}

/// What the warm-up ran: rows, and of the cache-hit rows how many were
/// seeded from the warm-up cache and with how many tokens (for the log).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WarmReport {
    pub rows: usize,
    pub cache_hits: usize,
    pub reused_tokens: usize,
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
) -> Result<WarmReport, String> {
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
    let prompts: Vec<Vec<u32>> = rows.iter().map(|r| prompt_ids(&text_ids, r, &[])).collect();
    let mut report = WarmReport {
        rows: rows.len(),
        ..Default::default()
    };
    if !gpu {
        run_rows(model, plugins, sampler, scheduler, &rows, &prompts, None)?;
        scheduler.reset_stats();
        return Ok(report);
    }
    // A cache of the warm-up's own, dropped afterwards: the server's cache
    // starts empty and its statistics count requests only.
    let mut cache = PrefixCache::new(PromptCache::new(1 << 30), None);
    run_rows(
        model,
        plugins,
        sampler,
        scheduler,
        &rows,
        &prompts,
        Some(&mut cache),
    )?;
    let cap = context.saturating_sub(8).max(1);
    let hits = cache_hit_plan(&rows, cap);
    let hit_prompts: Vec<Vec<u32>> = hits
        .iter()
        .map(|r| {
            let base = r.shared.map_or(&[][..], |(src, n)| &prompts[src][..n]);
            prompt_ids(&text_ids, r, base)
        })
        .collect();
    let before = scheduler.stats().recent.last().map_or(0, |r| r.row + 1);
    run_rows(
        model,
        plugins,
        sampler,
        scheduler,
        &hits,
        &hit_prompts,
        Some(&mut cache),
    )?;
    for r in scheduler.stats().recent.iter().filter(|r| r.row >= before) {
        if r.reused_from != ReuseSource::None {
            report.cache_hits += 1;
            report.reused_tokens += r.reused_tokens;
        }
    }
    report.rows += hits.len();
    warm_token_mask(model.model.config().vocab_size)
        .map_err(|e| format!("warming the structured-output mask: {e}"))?;
    scheduler.reset_stats();
    Ok(report)
}

/// Structured output's device ops on one `[V]` float32 row of logits (what
/// a constrained row's chain meets): the grammar's bitset gathered per id,
/// its bit tested, the logits selected, then the greedy pick and the
/// log-softmax of the masked row. MLX compiles kernels at their first use,
/// and these are ops only constrained rows meet. (In the fourth H100 run,
/// docs/benchmarks.md, batch-1 constrained rounds of the Qwen3-8B shape
/// averaged 245 ms a step against a 7.2 ms median, ~47 s of stalls in all,
/// before this warm-up existed; whether these kernels were the stall is not
/// yet measured.)
fn warm_token_mask(vocab: usize) -> mlx_rs::error::Result<()> {
    use crate::plugin::{device_ops, token_mask};
    let words: Vec<u32> = (0..token_mask::words_for(vocab))
        .map(|i| if i % 3 == 0 { u32::MAX } else { 0x5555_5555 })
        .collect();
    let logits = mlx_rs::Array::zeros::<f32>(&[vocab as i32])?;
    let masked = token_mask::apply_on_device(&logits, &words)?;
    let pick = device_ops::argmax(&masked)?;
    let logprobs = device_ops::log_softmax(&masked)?;
    mlx_rs::transforms::eval([&pick, &logprobs])
}

/// `row`'s prompt: `base`, then the warm-up text's ids from
/// `row.text_offset` on, to `row.prompt_tokens` in all.
fn prompt_ids(text_ids: &[u32], row: &WarmRow, base: &[u32]) -> Vec<u32> {
    let rest = row.prompt_tokens.saturating_sub(base.len());
    base.iter()
        .copied()
        .chain(
            text_ids
                .iter()
                .copied()
                .cycle()
                .skip(row.text_offset)
                .take(rest),
        )
        .collect()
}

/// Submits `rows` (with their `prompts`) and steps until all finished.
fn run_rows(
    model: &LoadedModel,
    plugins: &Arc<PluginHost>,
    sampler: &str,
    scheduler: &mut Scheduler<'static>,
    rows: &[WarmRow],
    prompts: &[Vec<u32>],
    mut cache: Option<&mut PrefixCache>,
) -> Result<(), String> {
    let results: Rc<RefCell<Vec<Result<GenerateSummary, GenerateError>>>> = Rc::default();
    for (i, (row, prompt_ids)) in rows.iter().zip(prompts).enumerate() {
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
                prompt_ids: prompt_ids.clone(),
                max_tokens: row.max_tokens,
                stop: Vec::new(),
                keep_special: false,
                forced_choices: Vec::new(),
                params,
                sampler: sampler.into(),
                processors: Vec::new(),
                plugin_params: serde_json::json!({}),
                top_logprobs: row.top_logprobs,
                speculative: crate::engine::speculative::SpecRequest::off(),
                lora: None,
            },
            chain: ChainSource::Plugins(plugins.clone()),
            sink: Box::new(WarmSink(results.clone())),
        });
    }
    while !scheduler.is_idle() {
        scheduler.step(model, cache.as_deref_mut());
    }
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
    fn cache_hit_rows_repeat_extend_and_branch_from_the_first_rows() {
        let rows = plan(true, 16, 256, 8192);
        let hits = cache_hit_plan(&rows, 8184);
        let r1 = rows[1].prompt_tokens;
        assert_eq!(hits.len(), 3);
        // An exact repeat of row 1, row 1 extended by 20, and a 26-token
        // branch of row 0 continued by 20 others.
        assert_eq!((hits[0].shared, hits[0].prompt_tokens), (Some((1, r1)), r1));
        assert_eq!(
            (hits[1].shared, hits[1].prompt_tokens),
            (Some((1, r1)), r1 + 20)
        );
        assert_eq!((hits[2].shared, hits[2].prompt_tokens), (Some((0, 26)), 46));
        assert!(hits.iter().any(|h| h.sampled));
        // The branch's tail differs from row 0's own continuation.
        let text: Vec<u32> = (0..13).collect();
        let base = prompt_ids(&text, &rows[0], &[]);
        let branch = prompt_ids(&text, &hits[2], &base[..26]);
        assert_eq!(branch.len(), 46);
        assert_eq!(&branch[..26], &base[..26]);
        assert_ne!(&branch[26..], &base[26..46]);
    }

    #[test]
    fn gpu_plan_fits_a_short_context() {
        let rows = plan(true, 4, 256, 64);
        assert!(rows.iter().all(|r| r.prompt_tokens + r.max_tokens <= 64));
        assert_eq!(plan(true, 1, 256, 8192).len(), 1);
    }
}

//! `mlxhost generate`: one chat turn, streamed to stdout; timing on stderr.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use mlxhost::engine::{self, GenerateEvent, GenerateRequest};
use mlxhost::model::ChatMessage;
use mlxhost::plugin::SamplingParams;

use super::ModelArgs;

/// Arguments of `mlxhost generate`.
#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Plugins directory (one folder per plugin).
    #[arg(long, default_value = "plugins", env = "MLXHOST_PLUGINS")]
    plugins: PathBuf,
    /// Sampler plugin.
    #[arg(long, default_value = "standard")]
    sampler: String,
    /// Logits processor plugins, in order (repeat the flag).
    #[arg(long = "logits-processor")]
    logits_processors: Vec<String>,
    /// Plugin parameters as JSON keyed by plugin name, e.g. '{"ban-token": {"id": 7042}}'.
    #[arg(long, default_value = "{}")]
    plugin_params: String,
    /// The user message (rendered by the chat template); for a model
    /// without one, the raw text to continue.
    #[arg(long)]
    prompt: String,
    /// System message; the chat template's default when absent.
    #[arg(long, alias = "system-prompt")]
    system: Option<String>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// Sampling temperature; 0 = greedy.
    #[arg(long, alias = "temperature", default_value_t = 0.0)]
    temp: f32,
    /// Nucleus mass (1.0 = off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Keep the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: u32,
    /// Min-p threshold relative to the most likely token (0 = off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Seed for reproducible sampling.
    #[arg(long)]
    seed: Option<u64>,
    /// Stop string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Speculative decoding: the drafter plugin (e.g. `prompt-lookup`;
    /// `none`: off). Output is unchanged; see docs/speculative.md.
    #[arg(long, default_value = "none")]
    drafter: String,
    /// The most tokens drafted per step (llama.cpp's `--draft-max`).
    #[arg(long, alias = "draft", default_value_t = mlxhost::engine::speculative::DEFAULT_DRAFT_MAX)]
    draft_max: usize,
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let plugin_params: serde_json::Value = serde_json::from_str(&args.plugin_params)
        .context("--plugin-params must be a JSON object")?;
    if !plugin_params.is_object() {
        anyhow::bail!("--plugin-params must be a JSON object keyed by plugin name");
    }
    let (plugins, model) = super::load_plugins_and_model(&args.plugins, &args.model)?;
    // Loading evaluated the weights, so MLX's CUDA worker runs: as `serve`
    // does after its warm-up.
    mlxhost::busy_threads::isolate_from_caller_once();
    // A base model (no chat template, e.g. Gemma 3 270M) continues the
    // prompt as raw text, BOS first when its tokenizer adds one.
    let prompt_ids = match &model.template {
        Some(template) => {
            let mut messages = Vec::new();
            if let Some(system) = &args.system {
                messages.push(ChatMessage {
                    role: "system".into(),
                    content: system.clone(),
                });
            }
            messages.push(ChatMessage {
                role: "user".into(),
                content: args.prompt.clone(),
            });
            model.tokenizer.encode(&template.render(&messages, true)?)?
        }
        None if args.system.is_some() => {
            anyhow::bail!("--system needs a chat template, and this model has none")
        }
        None => model.tokenizer.encode_prompt(&args.prompt)?,
    };
    let req = GenerateRequest {
        prompt_ids,
        max_tokens: args.max_tokens,
        stop: args.stop.clone(),
        keep_special: false,
        forced_choices: Vec::new(),
        params: SamplingParams {
            temperature: args.temp,
            top_p: args.top_p,
            top_k: args.top_k,
            min_p: args.min_p,
            seed: args.seed,
            ..SamplingParams::default()
        },
        sampler: args.sampler.clone(),
        processors: args.logits_processors.clone(),
        plugin_params,
        top_logprobs: 0,
        speculative: mlxhost::engine::speculative::SpecRequest {
            drafter: (args.drafter != "none").then(|| args.drafter.clone()),
            max_draft: args.draft_max,
        },
        lora: None,
    };
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let summary = engine::generate(
        &model,
        &plugins,
        &req,
        None,
        |ev| {
            if let GenerateEvent::Text(t) = ev {
                let _ = out.write_all(t.as_bytes());
                let _ = out.flush();
            }
        },
        || false,
    )?;
    let _ = writeln!(out);
    let decode_s = summary.decode.as_secs_f64();
    eprintln!(
        "prompt: {} tokens, {:.1} tok/s | generation: {} tokens, {:.1} tok/s | plugins: {:.1}% of decode time | finish: {:?}",
        summary.prompt_tokens,
        summary.prompt_tokens as f64 / summary.prefill.as_secs_f64().max(1e-9),
        summary.completion_tokens,
        summary.decode_tok_s(),
        100.0 * summary.plugin_time.as_secs_f64() / decode_s.max(1e-9),
        summary.finish_reason,
    );
    Ok(())
}

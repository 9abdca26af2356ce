//! `mlxhost bench-chain`: what choosing tokens through WASM plugins costs,
//! at batch 1 on the real model. The same full sampling chain (logit_bias on
//! 10 ids, repetition_penalty 1.1 over 64 tokens, presence 0.5, frequency
//! 0.5, top_k 40, top_p 0.9, min_p 0.05, temperature 0.8, fixed seed) runs
//! (a) through the first-party plugins, with the host's time inside plugin
//! calls instrumented, and (b) natively: the same device ops
//! (`plugin::device_ops`) called directly by this harness. Runs alternate
//! (WASM, native, WASM, ...) so machine noise hits both alike; the report
//! is the median decode tok/s ratio and its spread over the pairs.

use std::time::Duration;

use anyhow::Context;
use mlx_rs::Array;
use mlxhost::engine::{self, GenerateRequest, TokenChain};
use mlxhost::model::ChatMessage;
use mlxhost::plugin::device_ops as dev;
use mlxhost::plugin::session::{Chosen, StepOutput};
use mlxhost::plugin::{PluginError, RowChain, SamplingParams};

use super::ModelArgs;

/// Arguments of `mlxhost bench-chain`.
#[derive(Debug, clap::Args)]
pub struct BenchChainArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Plugins directory with the first-party plugins.
    #[arg(long, default_value = "plugins", env = "MLXHOST_PLUGINS")]
    plugins: std::path::PathBuf,
    /// Tokens generated per run.
    #[arg(long, default_value_t = 64)]
    tokens: usize,
    /// (WASM, native) run pairs.
    #[arg(long, default_value_t = 5)]
    pairs: usize,
}

/// The benchmark's chain, computed natively with the same device ops.
struct NativeChain {
    params: SamplingParams,
    seed: u64,
    time: Duration,
}

impl TokenChain for NativeChain {
    fn step(
        &mut self,
        logits: Array,
        ids: &[u32],
        prompt_len: usize,
        step: u32,
    ) -> Result<StepOutput, PluginError> {
        let started = std::time::Instant::now();
        let p = &self.params;
        let fail = |e: mlx_rs::error::Exception| PluginError::Failed {
            plugin: "native".into(),
            cause: e.to_string(),
        };
        let (bias_ids, biases): (Vec<u32>, Vec<f32>) = p.logit_bias.iter().copied().unzip();
        let generated = &ids[prompt_len.min(ids.len())..];
        let mut l = dev::add_bias(&logits, &bias_ids, &biases).map_err(fail)?;
        l = dev::repetition_penalty(&l, ids, p.repetition_penalty, p.repetition_context_size)
            .map_err(fail)?;
        l = dev::presence_frequency_penalty(&l, generated, p.presence_penalty, 0.0)
            .map_err(fail)?;
        l = dev::presence_frequency_penalty(&l, generated, 0.0, p.frequency_penalty)
            .map_err(fail)?;
        // The `standard` sampler's order (mlx-lm's make_sampler).
        l = dev::top_p(&l, p.top_p).map_err(fail)?;
        l = dev::min_p(&l, p.min_p).map_err(fail)?;
        l = dev::top_k(&l, p.top_k).map_err(fail)?;
        l = dev::scale(&l, p.temperature).map_err(fail)?;
        let token = dev::categorical(&l, self.seed, step).map_err(fail)?;
        self.time += started.elapsed();
        Ok(StepOutput {
            token: Chosen::Device(token),
            final_logits: l,
        })
    }
    fn accept(&mut self, _token: u32, _raw: f32, _sampled: f32) -> Result<(), PluginError> {
        Ok(())
    }
    fn sampler_name(&self) -> &str {
        "native"
    }
    fn chain_time(&self) -> Duration {
        self.time
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn run(args: BenchChainArgs) -> anyhow::Result<()> {
    let (plugins, model) = super::load_plugins_and_model(&args.plugins, &args.model)?;
    let template = model
        .template
        .as_ref()
        .context("the model has no chat template")?;
    let prompt = template.render(
        &[ChatMessage {
            role: "user".into(),
            content: "Write a short story about a lighthouse keeper.".into(),
        }],
        true,
    )?;
    let params = SamplingParams {
        temperature: 0.8,
        top_p: 0.9,
        top_k: 40,
        min_p: 0.05,
        seed: Some(1234),
        repetition_penalty: 1.1,
        repetition_context_size: 64,
        presence_penalty: 0.5,
        frequency_penalty: 0.5,
        logit_bias: (0..10u32)
            .map(|i| (1000 + 37 * i, if i % 2 == 0 { 1.5 } else { -1.5 }))
            .collect(),
        ..SamplingParams::default()
    };
    let req = GenerateRequest {
        prompt_ids: model.tokenizer.encode(&prompt)?,
        // No stop: every run decodes exactly `tokens` unless EOS comes first.
        max_tokens: args.tokens,
        stop: Vec::new(),
        keep_special: false,
        forced_choices: Vec::new(),
        params: params.clone(),
        sampler: "standard".into(),
        processors: [
            "logit-bias",
            "repetition-penalty",
            "presence-penalty",
            "frequency-penalty",
        ]
        .map(String::from)
        .to_vec(),
        plugin_params: serde_json::json!({}),
        top_logprobs: 0,
        speculative: mlxhost::engine::speculative::SpecRequest::off(),
        lora: None,
    };
    let effective = engine::effective_params(&model, &req);
    let (mut ratios, mut shares, mut wasm_tps, mut native_tps) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // One warm-up of each path (first-call costs), then the measured pairs.
    for pair in 0..=args.pairs {
        let mut chain = RowChain::new(
            &plugins,
            &req.sampler,
            &req.processors,
            &effective,
            &req.plugin_params,
        )?;
        let wasm = engine::generate_with(&model, &mut chain, &req, None, |_| {}, || false)?;
        let mut native = NativeChain {
            params: effective.clone(),
            seed: effective.seed.unwrap_or(0),
            time: Duration::ZERO,
        };
        let nat = engine::generate_with(&model, &mut native, &req, None, |_| {}, || false)?;
        if pair == 0 {
            continue;
        }
        let (w, n) = (wasm.decode_tok_s(), nat.decode_tok_s());
        eprintln!(
            "pair {pair}: wasm {w:.2} tok/s ({} tokens, plugins {:.2}% of decode), native {n:.2} tok/s ({} tokens)",
            wasm.completion_tokens,
            100.0 * wasm.plugin_time.as_secs_f64() / wasm.decode.as_secs_f64(),
            nat.completion_tokens
        );
        shares.push(100.0 * wasm.plugin_time.as_secs_f64() / wasm.decode.as_secs_f64().max(1e-9));
        ratios.push(w / n);
        wasm_tps.push(w);
        native_tps.push(n);
    }
    let result = serde_json::json!({
        "tokens_per_run": args.tokens,
        "pairs": args.pairs,
        "plugin_share_pct_median": median(shares.clone()),
        "plugin_share_pct_max": shares.iter().cloned().fold(0.0, f64::max),
        "wasm_decode_tok_s_median": median(wasm_tps),
        "native_decode_tok_s_median": median(native_tps),
        "wasm_over_native_median": median(ratios.clone()),
        "wasm_over_native_min": ratios.iter().cloned().fold(f64::INFINITY, f64::min),
        "wasm_over_native_max": ratios.iter().cloned().fold(0.0, f64::max),
    });
    println!("{result}");
    Ok(())
}

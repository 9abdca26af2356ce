//! Engine requests the scheduler tests build.

use mlxhost::engine::GenerateRequest;
use mlxhost::plugin::SamplingParams;

/// A greedy request (temperature 0, the `standard` sampler, no processors,
/// stop strings, forced choices, drafting or adapter) over `prompt` for up
/// to `max_tokens` tokens, recording `top_logprobs` alternatives per token.
/// Tests change the fields they vary with struct update syntax.
pub fn greedy_request(prompt: &[u32], max_tokens: usize, top_logprobs: usize) -> GenerateRequest {
    GenerateRequest {
        prompt_ids: prompt.to_vec(),
        max_tokens,
        stop: Vec::new(),
        keep_special: false,
        forced_choices: Vec::new(),
        params: SamplingParams {
            temperature: 0.0,
            ..Default::default()
        },
        sampler: "standard".into(),
        processors: Vec::new(),
        plugin_params: serde_json::json!({}),
        top_logprobs,
        speculative: Default::default(),
        lora: None,
    }
}

//! First-party processor and sampler plugins, run through the real host on
//! fixed logits, against golden values from other implementations:
//! mlx-lm 0.32.2's processors (`tests/fixtures/processor_goldens.json`, made
//! by `benches/make_processor_fixtures.py`), llama.cpp's own DRY and
//! mirostat v2 samplers (`tests/fixtures/llama_cpp_goldens.json`, made by
//! `benches/make_llama_cpp_fixtures.py` with llama-cpp-python 0.3.16 on
//! SmolLM2's vocabulary), and OpenAI's published presence/frequency formula
//! computed here.

use mlx_rs::Array;
use mlxhost::plugin::{PluginHost, PluginLimits, RowChain, SamplingParams, TokenChain};
use serde_json::{json, Value};

fn fixture() -> Value {
    fixture_named("processor_goldens.json")
}

fn fixture_named(name: &str) -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name);
    serde_json::from_str(&std::fs::read_to_string(path).expect("fixture")).expect("json")
}

/// The plugin host with SmolLM2's vocabulary lent to instances (for `dry`).
fn host_with_vocab() -> PluginHost {
    let host = host();
    let tokenizer = mlxhost::model::load_tokenizer(&mlxhost_e2e::model_path()).expect("tokenizer");
    host.set_vocab(std::sync::Arc::new(mlxhost::plugin::VocabView::new(
        tokenizer,
    )));
    host
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_f64().expect("number") as f32)
        .collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn host() -> PluginHost {
    PluginHost::load_dir(&mlxhost_e2e::plugins_dir(), PluginLimits::default()).expect("plugins")
}

/// Runs one step of `processors` + `sampler` and returns the final logits.
fn final_logits(
    chain: &mut RowChain,
    logits: &[f32],
    history: &[u32],
    prompt_len: usize,
    step: u32,
) -> Vec<f32> {
    let arr = Array::from_slice(logits, &[logits.len() as i32]);
    let out = chain.step(arr, history, prompt_len, step).expect("step");
    out.final_logits.eval().expect("eval");
    out.final_logits.as_slice::<f32>().to_vec()
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5 * w.abs().max(1.0),
            "{what}: logit {i}: got {g}, want {w}"
        );
    }
}

#[test]
fn repetition_penalty_and_logit_bias_match_mlx_lm() {
    let f = fixture();
    let host = host();
    let logits = floats(&f["logits"]);
    let prompt = ids(&f["prompt"]);
    let history: Vec<u32> = prompt
        .iter()
        .chain(ids(&f["generated"]).iter())
        .copied()
        .collect();
    for case in f["cases"].as_array().expect("cases") {
        let plugin = case["plugin"].as_str().expect("plugin");
        let p = &case["params"];
        let params = SamplingParams {
            temperature: 0.0,
            repetition_penalty: p["repetition_penalty"].as_f64().unwrap_or(1.0) as f32,
            repetition_context_size: p["repetition_context_size"].as_u64().unwrap_or(20) as u32,
            logit_bias: p["logit_bias"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|kv| {
                            (
                                kv[0].as_u64().expect("id") as u32,
                                kv[1].as_f64().expect("bias") as f32,
                            )
                        })
                        .collect()
                })
                .unwrap_or_default(),
            ..SamplingParams::default()
        };
        let mut chain = RowChain::new(
            &host,
            "standard",
            &[plugin.to_string()],
            &params,
            &json!({}),
        )
        .expect("chain");
        let got = final_logits(&mut chain, &logits, &history, prompt.len(), 0);
        assert_close(&got, &floats(&case["logits_out"]), &format!("{plugin} {p}"));
    }
}

#[test]
fn presence_and_frequency_penalties_follow_openais_formula_over_generated_tokens() {
    let f = fixture();
    let host = host();
    let logits = floats(&f["logits"]);
    let prompt = ids(&f["prompt"]);
    let generated = ids(&f["generated"]);
    let history: Vec<u32> = prompt.iter().chain(generated.iter()).copied().collect();
    let count = |j: usize| generated.iter().filter(|&&t| t as usize == j).count() as f32;
    for (presence, frequency) in [(0.5f32, 0.0f32), (0.0, 0.5), (1.5, -0.7), (-2.0, 2.0)] {
        let params = SamplingParams {
            temperature: 0.0,
            presence_penalty: presence,
            frequency_penalty: frequency,
            ..SamplingParams::default()
        };
        let chain_names = [
            "presence-penalty".to_string(),
            "frequency-penalty".to_string(),
        ];
        let mut chain =
            RowChain::new(&host, "standard", &chain_names, &params, &json!({})).expect("chain");
        let got = final_logits(&mut chain, &logits, &history, prompt.len(), 0);
        // logit[j] -= count[j] * frequency + (count[j] > 0) * presence; prompt tokens (3, 5, 9) untouched.
        let want: Vec<f32> = (0..logits.len())
            .map(|j| {
                let c = count(j);
                logits[j] - (c * frequency + if c > 0.0 { presence } else { 0.0 })
            })
            .collect();
        assert_close(
            &got,
            &want,
            &format!("presence {presence} frequency {frequency}"),
        );
    }
}

#[test]
fn dry_penalties_match_llama_cpp() {
    let f = fixture_named("llama_cpp_goldens.json");
    let host = host_with_vocab();
    let vocab = f["n_vocab"].as_u64().expect("n_vocab") as usize;
    let zeros = vec![0.0f32; vocab];
    for case in f["dry"].as_array().expect("dry") {
        let p = &case["params"];
        let plugin_params = json!({"dry": {
            "multiplier": p["multiplier"], "base": p["base"], "allowed_length": p["allowed_length"],
            "penalty_last_n": p["penalty_last_n"], "sequence_breakers": p["breakers"],
        }});
        let params = SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        };
        let mut chain = RowChain::new(
            &host,
            "standard",
            &["dry".to_string()],
            &params,
            &plugin_params,
        )
        .expect("chain");
        let history = ids(&case["history"]);
        let got = final_logits(&mut chain, &zeros, &history, history.len(), 0);
        let got: Vec<(u32, f32)> = got
            .iter()
            .enumerate()
            .filter(|(_, x)| **x != 0.0)
            .map(|(i, x)| (i as u32, -x))
            .collect();
        let want: Vec<(u32, f32)> = case["penalties"]
            .as_array()
            .expect("penalties")
            .iter()
            .map(|kv| {
                (
                    kv[0].as_u64().expect("id") as u32,
                    kv[1].as_f64().expect("penalty") as f32,
                )
            })
            .collect();
        assert_eq!(
            got.len(),
            want.len(),
            "{:?} {p}: penalized ids {got:?} vs llama.cpp {want:?}",
            case["text"]
        );
        for ((gi, gp), (wi, wp)) in got.iter().zip(&want) {
            assert_eq!(gi, wi, "{:?} {p}", case["text"]);
            assert!(
                (gp - wp).abs() <= 1e-4 * wp.abs().max(1.0),
                "{:?} {p}: token {gi}: {gp} vs {wp}",
                case["text"]
            );
        }
    }
}

#[test]
fn mirostat_follows_llama_cpp_step_by_step() {
    let f = fixture_named("llama_cpp_goldens.json");
    let host = host();
    let logits = floats(&f["mirostat_logits"]);
    for case in f["mirostat"].as_array().expect("mirostat") {
        let params = SamplingParams {
            temperature: case["temperature"].as_f64().expect("t") as f32,
            seed: Some(7),
            ..SamplingParams::default()
        };
        let plugin_params = json!({"mirostat": {"tau": case["tau"], "eta": case["eta"]}});
        let mut chain =
            RowChain::new(&host, "mirostat", &[], &params, &plugin_params).expect("chain");
        let mut history = vec![1u32];
        for (step, s) in case["steps"].as_array().expect("steps").iter().enumerate() {
            let got = final_logits(&mut chain, &logits, &history, 1, step as u32);
            let kept: Vec<u32> = (0..got.len() as u32)
                .filter(|&i| got[i as usize].is_finite())
                .collect();
            assert_eq!(
                kept,
                ids(&s["kept"]),
                "case {} step {step}: tokens kept (depends on mu)",
                case["tau"]
            );
            // Force llama.cpp's draw, with its probability under our distribution.
            let token = s["token"].as_u64().expect("token") as u32;
            let max = got.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let z: f32 = got
                .iter()
                .filter(|x| x.is_finite())
                .map(|x| (x - max).exp())
                .sum();
            let sampled = got[token as usize] - max - z.ln();
            let p = s["p_chosen"].as_f64().expect("p") as f32;
            assert!(
                (sampled.exp() - p).abs() < 1e-4,
                "step {step}: p {} vs llama.cpp {p}",
                sampled.exp()
            );
            chain.accept(token, f32::NAN, sampled).expect("accept");
            history.push(token);
        }
    }
}

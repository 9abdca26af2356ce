//! Gemma 3 270M (base model, Q4_K_M GGUF: gemma3 architecture with
//! sliding-window attention, SentencePiece vocabulary of 262k pieces)
//! against what llama.cpp itself does with the same file
//! (tests/fixtures/models/gemma3-270m.llama-cpp.json, made by
//! benches/make_model_fixtures.py with llama-cpp-python 0.3.16), and the
//! sliding-window cache against a cold run.
//!
//! Needs the model installed: `mlxhost models pull gemma3-270m`
//! (scripts/test.sh does it).

use std::path::PathBuf;

use mlxhost::model::TextTokenizer;
use mlxhost_e2e::*;
use serde_json::Value;

fn gemma_path() -> PathBuf {
    let m = mlxhost::model::catalog::find("gemma3-270m").expect("in the catalog");
    assert!(
        m.is_installed(),
        "Gemma 3 270M not installed at {}: run `mlxhost models pull gemma3-270m`",
        m.path().display()
    );
    m.path()
}

fn fixture() -> Value {
    llama_cpp_fixture("gemma3-270m")
}

#[test]
fn tokenization_equals_llama_cpp_on_the_corpus() {
    let tok: TextTokenizer = mlxhost::model::load_tokenizer(&gemma_path()).expect("tokenizer");
    let fx = fixture();
    let corpus = fx["tokenize"].as_array().expect("corpus");
    assert!(corpus.len() >= 10);
    let mut wrong = Vec::new();
    for case in corpus {
        let text = case["text"].as_str().expect("text");
        let want = fixture_ids(&case["ids"]);
        let got = tok.encode(text).expect("encode");
        if got != want {
            wrong.push(format!("{text:?}: ours {got:?}, llama.cpp {want:?}"));
        }
        // And back, as llama.cpp detokenizes (a literal `▁` reads as a space).
        let back = case["detokenized"].as_str().unwrap_or(text);
        assert_eq!(tok.decode(&want, false).expect("decode"), back, "{text:?}");
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn prompts_tokenize_as_llama_cpp_with_bos_first() {
    let tok: TextTokenizer = mlxhost::model::load_tokenizer(&gemma_path()).expect("tokenizer");
    assert!(tok.adds_bos());
    for case in fixture()["cases"].as_array().expect("cases") {
        let text = case["prompt_text"].as_str().expect("text");
        assert_eq!(
            tok.encode_prompt(text).expect("encode"),
            fixture_ids(&case["prompt_ids"]),
            "{text:?}"
        );
    }
}

#[test]
fn float32_path_top_token_within_0_15_nats_of_llama_cpp() {
    top_token_gap_to_llama_cpp(&gemma_path(), &fixture(), "float32");
}

#[test]
fn default_quantized_path_top_token_within_0_15_nats_of_llama_cpp() {
    top_token_gap_to_llama_cpp(&gemma_path(), &fixture(), "auto");
}

/// The long case (over 600 tokens, past the 512-token window) scored in
/// 100-token prefill chunks and one token per step on the default path: the
/// sliding-window cache's compaction and masks give the same logprobs as
/// one pass.
#[test]
fn sliding_window_gives_the_same_logprobs_chunked_and_step_by_step() {
    let fx = fixture();
    let case = fx["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .max_by_key(|c| c["prompt_ids"].as_array().map(Vec::len).unwrap_or(0))
        .expect("a case")
        .clone();
    let prompt = fixture_ids(&case["prompt_ids"]);
    assert!(
        prompt.len() > 600,
        "the long case has {} tokens",
        prompt.len()
    );
    let rows = vec![(prompt, fixture_ids(&case["greedy_ids"]))];
    let input = score_input(&rows);
    let model = gemma_path();
    let score = |extra: &[&str]| {
        let mut args = vec![
            "score",
            "--model",
            model.to_str().expect("path"),
            "--input",
            input.path().to_str().expect("path"),
        ];
        args.extend_from_slice(extra);
        parse_score(&mlxhost_ok(&args)).remove(0)
    };
    let whole = score(&["--prefill-chunk", "4096"]);
    for other in [score(&["--prefill-chunk", "100"]), score(&["--decode"])] {
        for (a, b) in whole.steps.iter().zip(&other.steps) {
            assert_eq!(a.top[0].0, b.top[0].0);
            assert!((a.top[0].1 - b.top[0].1).abs() < 2e-3, "{a:?} vs {b:?}");
        }
    }
}

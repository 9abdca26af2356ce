//! Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF: qwen2 architecture, K-quants,
//! Qwen2's byte-level BPE) against what llama.cpp itself does with the same
//! file (tests/fixtures/models/qwen2.5-coder-0.5b-instruct.llama-cpp.json,
//! made by benches/make_model_fixtures.py with llama-cpp-python 0.3.16).
//!
//! Needs the model installed: `mlxhost models pull qwen2.5-coder-0.5b`
//! (scripts/test.sh does it).

use std::path::PathBuf;

use mlxhost::model::{TemplateMessage, TextTokenizer};
use mlxhost_e2e::*;
use serde_json::Value;

fn qwen_path() -> PathBuf {
    installed_model("qwen2.5-coder-0.5b")
}

fn fixture() -> Value {
    llama_cpp_fixture("qwen2.5-coder-0.5b-instruct")
}

fn ids(v: &Value) -> Vec<u32> {
    fixture_ids(v)
}

#[test]
fn tokenization_equals_llama_cpp_on_the_corpus() {
    let tok: TextTokenizer = mlxhost::model::load_tokenizer(&qwen_path()).expect("tokenizer");
    let fx = fixture();
    let corpus = fx["tokenize"].as_array().expect("corpus");
    assert!(corpus.len() >= 10);
    for case in corpus {
        let text = case["text"].as_str().expect("text");
        assert_eq!(
            tok.encode(text).expect("encode"),
            ids(&case["ids"]),
            "{text:?}"
        );
        // And back: decoding keeps the text (special tokens included).
        assert_eq!(tok.decode(&ids(&case["ids"]), false).expect("decode"), text);
    }
}

#[test]
fn chat_template_renders_the_prompts_llama_cpp_saw() {
    let loaded = mlxhost::model::load(&qwen_path(), &Default::default()).expect("load");
    let template = loaded.template.as_ref().expect("Qwen has a chat template");
    for case in fixture()["cases"].as_array().expect("cases") {
        let messages: Vec<TemplateMessage> = case["messages"]
            .as_array()
            .expect("messages")
            .iter()
            .map(|m| TemplateMessage {
                role: m["role"].as_str().expect("role").into(),
                content: m["content"].as_str().expect("content").into(),
                ..Default::default()
            })
            .collect();
        let tools: Vec<Value> = case["tools"].as_array().cloned().unwrap_or_default();
        let text = template
            .render_with(&messages, &tools, &Default::default(), true)
            .expect("render");
        assert_eq!(text, case["prompt_text"].as_str().expect("text"));
        assert_eq!(
            loaded.tokenizer.encode(&text).expect("encode"),
            ids(&case["prompt_ids"])
        );
    }
    // <|im_end|> is declared; <|endoftext|> ends generation too (llama.cpp).
    assert_eq!(loaded.eos_ids, vec![151645, 151643]);
}

#[test]
fn float32_path_top_token_within_0_15_nats_of_llama_cpp() {
    top_token_gap_to_llama_cpp(&qwen_path(), &fixture(), "float32", LLAMA_CPP_TOL);
}

#[test]
fn default_quantized_path_top_token_within_0_15_nats_of_llama_cpp() {
    top_token_gap_to_llama_cpp(&qwen_path(), &fixture(), "auto", LLAMA_CPP_TOL);
}

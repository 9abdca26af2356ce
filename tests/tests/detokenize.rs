//! Incremental detokenization with the real tokenizer: multi-byte
//! characters split across byte-level BPE tokens are never emitted half-way.

use mlxhost::engine::detokenize::Detokenizer;
use mlxhost_e2e::model_path;

#[test]
fn streamed_text_equals_the_full_decode_and_never_holds_a_replacement_char() {
    let g = mlxhost::model::gguf::Gguf::open(&model_path()).expect("open gguf");
    let tok = g.tokenizer().expect("tokenizer");
    let text = "Vagues 🌊 sur la mer, 世界は広い — naïve café ✨ 123";
    let ids = tok.encode(text).expect("encode");
    // The emoji and CJK characters take several byte-level tokens each.
    assert!(ids.len() > text.chars().count() / 2);
    let prompt = tok.encode("<|im_start|>assistant\n").expect("encode");
    let mut d = Detokenizer::with_context(&prompt);
    let mut streamed = String::new();
    for &id in &ids {
        let delta = d.push(&tok, id).expect("push");
        assert!(
            !delta.contains('\u{FFFD}'),
            "half a character emitted: {delta:?}"
        );
        streamed.push_str(&delta);
    }
    streamed.push_str(&d.flush(&tok).expect("flush"));
    assert_eq!(streamed, text);
}

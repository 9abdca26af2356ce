//! The real model through the real binary, against mlx-lm's reference
//! outputs (fixtures/smollm2-greedy.json) and `semantics.md`'s thresholds.

use mlxhost_e2e::*;

const NATIVE_TOL: f32 = 0.05;
const FLOAT32_TOL: f32 = 0.1;

fn reference_rows() -> Vec<(Vec<u32>, Vec<u32>)> {
    reference()
        .into_iter()
        .map(|c| (c.prompt_ids, c.greedy_ids))
        .collect()
}

fn check_against_reference(dtype: &str, tol: f32, extra: &[&str]) {
    let input = score_input(&reference_rows());
    let model = model_path();
    let mut args = vec![
        "score",
        "--model",
        model.to_str().expect("utf-8 path"),
        "--dtype",
        dtype,
    ];
    args.extend(["--input", input.path().to_str().expect("utf-8 path")]);
    args.extend(extra);
    let out = parse_score(&mlxhost_ok(&args));
    let cases = reference();
    assert_eq!(out.len(), cases.len());
    for (c, (case, ours)) in cases.iter().zip(&out).enumerate() {
        assert_eq!(ours.steps.len(), case.teacher_forced_top5.len());
        for (s, (r, o)) in case.teacher_forced_top5.iter().zip(&ours.steps).enumerate() {
            assert_eq!(o.token, r.token);
            assert_eq!(o.top.len(), 5);
            if let Err(e) = check_top(&o.top, &r.top5, tol) {
                panic!("{dtype}: case {c} step {s}: {e}");
            }
        }
    }
}

#[test]
fn chat_template_and_tokenizer_give_the_reference_prompt_ids() {
    let g = mlxhost::model::gguf::Gguf::open(&model_path()).expect("open gguf");
    let tok = g.tokenizer().expect("tokenizer");
    let template_src = g.chat_template().expect("template in gguf");
    let eos = tok
        .id_to_token(g.eos_ids().expect("eos")[0])
        .expect("eos token");
    let template = mlxhost::model::ChatTemplate::new(&template_src, "", &eos).expect("template");
    for case in reference() {
        let text = template.render(&case.messages, true).expect("render");
        assert_eq!(
            tok.encode(&text).expect("encode"),
            case.prompt_ids,
            "prompt: {text:?}"
        );
    }
}

#[test]
fn native_path_matches_mlx_lm_within_0_05_nats() {
    check_against_reference("native", NATIVE_TOL, &[]);
}

#[test]
fn float32_path_matches_mlx_lm_within_0_1_nats() {
    check_against_reference("float32", FLOAT32_TOL, &[]);
}

#[test]
fn default_path_is_quantized_on_cpu_and_matches() {
    check_against_reference("auto", NATIVE_TOL, &[]);
}

/// The quantized path keeps the checkpoint's 4/8-bit weights (prefill:
/// tiles dequantized into BLAS, exact in float32).
#[test]
fn quantized_path_matches_mlx_lm_within_0_05_nats() {
    check_against_reference("quantized", NATIVE_TOL, &[]);
}

/// Teacher-forced one token per step: the fused decoder-layer op and the
/// int8-activation kernel, what generation runs on the quantized path.
#[test]
fn quantized_decode_path_matches_mlx_lm_within_0_05_nats() {
    check_against_reference("quantized", NATIVE_TOL, &["--decode"]);
}

/// `mlxhost score --dtype quantized --decode` of the reference rows, `batch`
/// rows per forward, with `extra` flags and `env`.
fn decode_scores(
    input: &std::path::Path,
    batch: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Vec<mlxhost::score::ScoreOutput> {
    let path = input.to_str().expect("path");
    let args = [
        &[
            "score",
            "--dtype",
            "quantized",
            "--decode",
            "--input",
            path,
            "--batch-size",
            batch,
        ][..],
        extra,
    ]
    .concat();
    parse_score(&mlxhost_ok_env(&args, env))
}

/// The fused decode op against the same model through MLX ops
/// (`MLXHOST_DECODE_LAYER=mlx`), rows decoding together and alone.
#[test]
fn fused_decode_layer_scores_like_mlx_ops() {
    let input = score_input(&reference_rows());
    let fused_batched = decode_scores(input.path(), "3", &[], &[]);
    let fused_alone = decode_scores(input.path(), "1", &[], &[]);
    let unfused = decode_scores(input.path(), "1", &[], &[("MLXHOST_DECODE_LAYER", "mlx")]);
    assert_scores_close(&fused_alone, &unfused, 5e-3);
    assert_scores_close(&fused_batched, &fused_alone, 5e-3);
}

/// Per step of every row, |a - b| of the scored token's logprob.
fn token_logprob_gaps(
    a: &[mlxhost::score::ScoreOutput],
    b: &[mlxhost::score::ScoreOutput],
) -> Vec<f32> {
    assert_eq!(a.len(), b.len(), "row counts differ");
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.steps.len(), y.steps.len(), "step counts differ");
            x.steps
                .iter()
                .zip(&y.steps)
                .map(|(p, q)| (p.logprob - q.logprob).abs())
        })
        .collect()
}

fn mean(xs: &[f32]) -> f32 {
    xs.iter().sum::<f32>() / xs.len().max(1) as f32
}

/// With quantized KV (`--kv-bits`), the fused decode op (it quantizes the
/// new keys and values itself and attends over the packed rows, split by
/// position over the pool) against the MLX-op path (`mlx::quantize` and
/// the per-layer quantized attention op). The two cannot agree to float
/// rounding: each computes a key in its own float order, and a key element
/// near a rounding boundary lands on the neighbouring code (one step is
/// 1/15 of the group's range at 4 bits). So: rows together equal rows
/// alone; at 8 bits the paths agree closely; at both widths the fused
/// path drifts from the float cache no more than the MLX-op path does.
#[test]
fn fused_decode_layer_with_quantized_kv_scores_like_mlx_ops() {
    let input = score_input(&reference_rows());
    let float = decode_scores(input.path(), "1", &[], &[]);
    for bits in ["8", "4"] {
        let kv = ["--kv-bits", bits];
        let fused_alone = decode_scores(input.path(), "1", &kv, &[]);
        let fused_batched = decode_scores(input.path(), "3", &kv, &[]);
        let unfused = decode_scores(input.path(), "1", &kv, &[("MLXHOST_DECODE_LAYER", "mlx")]);
        assert_scores_close(&fused_batched, &fused_alone, 1e-4);
        let between = token_logprob_gaps(&fused_alone, &unfused);
        if bits == "8" {
            let worst = between.iter().copied().fold(0.0f32, f32::max);
            assert!(
                mean(&between) <= 0.02 && worst <= 0.15,
                "8 bits: fused vs MLX ops mean {} max {worst}",
                mean(&between)
            );
        }
        let fused_drift = mean(&token_logprob_gaps(&fused_alone, &float));
        let mlx_drift = mean(&token_logprob_gaps(&unfused, &float));
        assert!(
            fused_drift <= 1.25 * mlx_drift + 0.005,
            "{bits} bits: drift from the float cache {fused_drift} (fused) vs {mlx_drift} (MLX ops)"
        );
    }
}

#[test]
fn messages_input_scores_like_prompt_ids() {
    use std::io::Write;
    let cases = reference();
    let mut f = tempfile::NamedTempFile::new().expect("temp");
    for c in &cases {
        let line = serde_json::json!({ "messages": c.messages, "continuation_ids": c.greedy_ids });
        writeln!(f, "{line}").expect("write");
    }
    let by_messages = parse_score(&mlxhost_ok(&[
        "score",
        "--input",
        f.path().to_str().expect("path"),
    ]));
    let ids = score_input(&reference_rows());
    let by_ids = parse_score(&mlxhost_ok(&[
        "score",
        "--input",
        ids.path().to_str().expect("path"),
    ]));
    assert_scores_close(&by_messages, &by_ids, 1e-4);
}

#[test]
fn batch_of_rows_with_different_lengths_scores_like_each_alone() {
    let rows = reference_rows();
    assert_ne!(
        rows[0].0.len() + rows[0].1.len(),
        rows[1].0.len() + rows[1].1.len()
    );
    let input = score_input(&rows);
    let path = input.path().to_str().expect("path");
    for dtype in ["native", "float32"] {
        let tol = if dtype == "native" {
            NATIVE_TOL
        } else {
            FLOAT32_TOL
        };
        let alone = parse_score(&mlxhost_ok(&[
            "score",
            "--dtype",
            dtype,
            "--input",
            path,
            "--batch-size",
            "1",
        ]));
        let batched = parse_score(&mlxhost_ok(&[
            "score",
            "--dtype",
            dtype,
            "--input",
            path,
            "--batch-size",
            "3",
        ]));
        assert_scores_close(&batched, &alone, tol);
    }
}

#[test]
fn converted_directory_scores_like_the_gguf() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("smollm2-mlx");
    let model = model_path();
    let out_s = out.to_str().expect("path");
    mlxhost_ok(&["convert", model.to_str().expect("path"), out_s]);
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        assert!(
            out.join(f).is_file(),
            "{f} missing from the converted directory"
        );
    }
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).expect("config"))
            .expect("json");
    assert_eq!(config["quantization"]["bits"], 4);
    assert_eq!(config["quantization"]["model.embed_tokens"]["bits"], 8);
    let input = score_input(&reference_rows());
    let path = input.path().to_str().expect("path");
    for (dtype, tol) in [("native", NATIVE_TOL), ("float32", FLOAT32_TOL)] {
        let from_gguf = parse_score(&mlxhost_ok(&["score", "--dtype", dtype, "--input", path]));
        let from_dir = parse_score(&mlxhost_ok(&[
            "score", "--model", out_s, "--dtype", dtype, "--input", path,
        ]));
        assert_scores_close(&from_dir, &from_gguf, tol);
    }
    // The converted directory's template + tokenizer also give the reference ids.
    let loaded = mlxhost::model::load(&out, &Default::default()).expect("load dir");
    let template = loaded.template.as_ref().expect("template");
    for case in reference() {
        let text = template.render(&case.messages, true).expect("render");
        assert_eq!(
            loaded.tokenizer.encode(&text).expect("encode"),
            case.prompt_ids
        );
    }
    // <|im_end|> declared, <|endoftext|> collected as llama.cpp does.
    assert_eq!(loaded.eos_ids, vec![2, 0]);
}

/// SmolLM2's GGUF tokenizer (byte-level BPE, `smollm` pre-tokenizer)
/// equals llama.cpp's on the corpus (tests/fixtures/models/
/// smollm2-135m.llama-cpp.json, benches/make_model_fixtures.py): unicode,
/// emoji, digits, runs of spaces and newlines, special tokens.
#[test]
fn tokenization_equals_llama_cpp_on_the_corpus() {
    let tok = mlxhost::model::load_tokenizer(&model_path()).expect("tokenizer");
    let fx = llama_cpp_fixture("smollm2-135m");
    let corpus = fx["tokenize"].as_array().expect("corpus");
    assert!(corpus.len() >= 10);
    for case in corpus {
        let text = case["text"].as_str().expect("text");
        let want = fixture_ids(&case["ids"]);
        assert_eq!(tok.encode(text).expect("encode"), want, "{text:?}");
        let back = case["detokenized"].as_str().unwrap_or(text);
        assert_eq!(tok.decode(&want, false).expect("decode"), back);
    }
    // Its chat prompts too, as llama.cpp rendered and tokenized them.
    for case in fx["cases"].as_array().expect("cases") {
        let text = case["prompt_text"].as_str().expect("text");
        assert_eq!(
            tok.encode(text).expect("encode"),
            fixture_ids(&case["prompt_ids"])
        );
    }
}

//! Bad model files and bad score input give clear errors naming the file or
//! field, and a non-zero exit, never a crash.

use std::io::Write;

use mlxhost_e2e::*;

fn stderr_of(args: &[&str]) -> String {
    let out = mlxhost(args);
    assert!(
        !out.status.success(),
        "mlxhost {args:?} unexpectedly succeeded"
    );
    // A panic or abort would not exit with status 1.
    assert_eq!(
        out.status.code(),
        Some(1),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn one_line_input(line: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().expect("temp");
    writeln!(f, "{line}").expect("write");
    f
}

fn good_input() -> tempfile::NamedTempFile {
    one_line_input(r#"{"prompt_ids": [1, 2], "continuation_ids": [3]}"#)
}

#[test]
fn missing_model_file_is_named() {
    let input = good_input();
    let err = stderr_of(&[
        "score",
        "--model",
        "/nonexistent/model.gguf",
        "--input",
        input.path().to_str().expect("p"),
    ]);
    assert!(err.contains("/nonexistent/model.gguf"), "{err}");
}

#[test]
fn missing_input_file_names_the_flag() {
    let err = stderr_of(&["score", "--input", "/nonexistent/input.jsonl"]);
    assert!(
        err.contains("--input") && err.contains("/nonexistent/input.jsonl"),
        "{err}"
    );
}

#[test]
fn truncated_gguf_is_named_and_called_truncated() {
    let bytes = std::fs::read(model_path()).expect("read model");
    let dir = tempfile::tempdir().expect("tempdir");
    for cut in [16usize, 4096, bytes.len() / 2, bytes.len() - 1] {
        let p = dir.path().join(format!("cut-{cut}.gguf"));
        std::fs::write(&p, &bytes[..cut]).expect("write");
        let input = good_input();
        let err = stderr_of(&[
            "score",
            "--model",
            p.to_str().expect("p"),
            "--input",
            input.path().to_str().expect("p"),
        ]);
        assert!(
            err.contains(p.to_str().expect("p")) && err.contains("truncated"),
            "cut {cut}: {err}"
        );
    }
}

#[test]
fn gguf_of_another_architecture_is_rejected_by_name() {
    let mut bytes = std::fs::read(model_path()).expect("read model");
    // general.architecture = "llama" -> "mamba" (same length, still valid GGUF).
    let key = b"general.architecture";
    let at = bytes
        .windows(key.len())
        .position(|w| w == key)
        .expect("key present");
    let value = at + key.len() + 4 + 8;
    assert_eq!(&bytes[value..value + 5], b"llama");
    bytes[value..value + 5].copy_from_slice(b"mamba");
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join("other.gguf");
    std::fs::write(&p, &bytes).expect("write");
    let input = good_input();
    let err = stderr_of(&[
        "score",
        "--model",
        p.to_str().expect("p"),
        "--input",
        input.path().to_str().expect("p"),
    ]);
    assert!(err.contains("unsupported architecture `mamba`"), "{err}");
}

#[test]
fn model_directory_missing_a_file_names_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("m");
    mlxhost_ok(&[
        "convert",
        model_path().to_str().expect("p"),
        out.to_str().expect("p"),
    ]);
    let input = good_input();
    std::fs::remove_file(out.join("tokenizer.json")).expect("rm");
    let err = stderr_of(&[
        "score",
        "--model",
        out.to_str().expect("p"),
        "--input",
        input.path().to_str().expect("p"),
    ]);
    assert!(err.contains("tokenizer.json"), "{err}");
    // Truncated weights are named too.
    mlxhost_ok(&[
        "convert",
        model_path().to_str().expect("p"),
        dir.path().join("m2").to_str().expect("p"),
    ]);
    let st = dir.path().join("m2/model.safetensors");
    let len = std::fs::metadata(&st).expect("meta").len();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&st)
        .expect("open");
    f.set_len(len / 3).expect("truncate");
    let err = stderr_of(&[
        "score",
        "--model",
        dir.path().join("m2").to_str().expect("p"),
        "--input",
        input.path().to_str().expect("p"),
    ]);
    assert!(err.contains("model.safetensors"), "{err}");
}

#[test]
fn convert_refuses_a_non_empty_output_directory() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("keep.txt"), "user data").expect("write");
    let err = stderr_of(&[
        "convert",
        model_path().to_str().expect("p"),
        dir.path().to_str().expect("p"),
    ]);
    assert!(err.contains("not empty"), "{err}");
    assert!(dir.path().join("keep.txt").is_file());
}

#[test]
fn malformed_score_input_names_line_and_field() {
    let cases = [
        ("not json", "line 1"),
        (r#"{"prompt_ids": [1, 2]}"#, "continuation_ids"),
        (r#"{"continuation_ids": [1]}"#, "prompt_ids"),
        (
            r#"{"prompt_ids": [1], "continuation_ids": [99999999]}"#,
            "continuation_ids",
        ),
        (
            r#"{"prompt_ids": [], "continuation_ids": [1]}"#,
            "prompt_ids",
        ),
        (
            r#"{"prompt_ids": ["a"], "continuation_ids": [1]}"#,
            "line 1",
        ),
        (
            r#"{"prompt_ids": [1], "messages": [], "continuation_ids": [1]}"#,
            "not both",
        ),
        (
            r#"{"prompt_ids": [1], "continuation_ids": [1], "extra": 1}"#,
            "extra",
        ),
    ];
    for (line, expect) in cases {
        let f = one_line_input(line);
        let err = stderr_of(&["score", "--input", f.path().to_str().expect("p")]);
        assert!(err.contains(expect), "input {line:?}: {err}");
    }
}

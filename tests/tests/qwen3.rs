//! The `qwen3` graph (per-head q/k RMSNorm, explicit head_dim, tied head)
//! against mlx-lm 0.32.2 on a small random-weight Qwen3 that mlx-lm built and
//! saved itself (tests/fixtures/models/qwen3-tiny, made by
//! benches/make_qwen3_tiny.py, with mlx-lm's teacher-forced scores).

use mlxhost_e2e::*;

const TOL: f32 = 0.05;

#[test]
fn qwen3_scores_match_mlx_lm_within_0_05_nats() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/models/qwen3-tiny");
    let reference = parse_score(
        &std::fs::read_to_string(format!("{dir}/mlx-lm-scores.jsonl")).expect("scores"),
    );
    for (dtype, extra) in [
        ("float32", None),
        ("auto", None),
        ("float32", Some("--decode")),
    ] {
        let mut args = vec!["score", "--model", dir, "--dtype", dtype];
        let rows = format!("{dir}/rows.jsonl");
        args.extend(["--input", rows.as_str()]);
        args.extend(extra);
        let ours = parse_score(&mlxhost_ok(&args));
        assert_eq!(ours.len(), reference.len());
        for (r, (o, t)) in ours.iter().zip(&reference).enumerate() {
            assert_eq!(o.steps.len(), t.steps.len());
            for (s, (so, st)) in o.steps.iter().zip(&t.steps).enumerate() {
                assert!(
                    (so.logprob - st.logprob).abs() <= TOL,
                    "{dtype} {extra:?}: row {r} step {s}: {} vs {}",
                    so.logprob,
                    st.logprob
                );
                if let Err(e) = check_top(&so.top, &st.top, TOL) {
                    panic!("{dtype} {extra:?}: row {r} step {s}: {e}");
                }
            }
        }
    }
}

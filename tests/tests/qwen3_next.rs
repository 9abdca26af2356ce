//! The `qwen3_next` graph (Qwen3-Next-80B-A3B's architecture: Qwen3.5's
//! hybrid of gated DeltaNet and gated full attention, with the DeltaNet
//! projections fused per key head in the checkpoint, and sparse MLPs of
//! routed experts plus a gated shared expert) against mlx-lm 0.32.2 on
//! small random-weight models that mlx-lm built and saved itself
//! (tests/fixtures/models/qwen3-next-tiny and qwen3-next-tiny-4bit, made by
//! benches/make_qwen3_next_tiny.py, with mlx-lm's teacher-forced scores).
//! The recurrent-state machinery (batching, both cache tiers) is the one
//! `qwen3_5` uses (`qwen3_5_batching.rs`, `qwen3_5_cache.rs`); a
//! conversation over this model's cache is checked here too.

use mlx_rs::ops::indexing::IndexOp;
use mlxhost::cache::{PrefixCache, PromptCache};
use mlxhost_e2e::sliding_cache;
use mlxhost_e2e::tiny_fixture::{
    self, assert_batched_equals_alone_within, assert_matches_mlx_lm, edited_copy, fixture,
    own_rows, EVERY_PATH,
};

/// Every path computes in float32 on both sides (measured within 1e-4
/// nats); a token sent to another expert would move a logprob by more.
const TOL: f32 = 1e-3;

#[test]
fn qwen3_next_scores_match_mlx_lm() {
    let names = ["qwen3-next-tiny", "qwen3-next-tiny-4bit"];
    assert_matches_mlx_lm(&names, own_rows, &EVERY_PATH, TOL);
}

/// Rows scored together (the decoding rows' states one stack, their
/// tokens routed to different experts in the same sparse layers) equal
/// each row scored alone (the 4-bit fixture: see `qwen3_5.rs` for its
/// wider bound).
#[test]
fn batched_rows_equal_rows_alone() {
    for (name, tol) in [("qwen3-next-tiny", 1e-4), ("qwen3-next-tiny-4bit", 5e-4)] {
        let dir = fixture(name);
        assert_batched_equals_alone_within(&dir, &own_rows(&dir), "4", tol);
    }
}

fn load_error(dir: &tempfile::TempDir) -> String {
    let path = dir.path().to_str().expect("utf-8 path");
    tiny_fixture::load_error(dir.path(), &own_rows(path))
}

#[test]
fn missing_or_misshaped_fused_and_expert_weights_are_named() {
    let qkvz = "model.layers.0.linear_attn.in_proj_qkvz.weight";
    let dir = edited_copy(
        "qwen3-next-tiny",
        |t| {
            let w = t[qkvz].index(0..100);
            t.insert(qkvz.into(), w);
        },
        |_| {},
    );
    let err = load_error(&dir);
    assert!(err.contains(qkvz) && err.contains("rows"), "{err}");

    let ba = "model.layers.2.linear_attn.in_proj_ba.weight";
    let dir = edited_copy(
        "qwen3-next-tiny",
        |t| {
            t.remove(ba);
        },
        |_| {},
    );
    let err = load_error(&dir);
    assert!(err.contains(ba) && err.contains("missing"), "{err}");

    let gate = "model.layers.0.mlp.shared_expert_gate.weight";
    let dir = edited_copy(
        "qwen3-next-tiny",
        |t| {
            t.remove(gate);
        },
        |_| {},
    );
    let err = load_error(&dir);
    assert!(err.contains(gate), "{err}");

    let dir = edited_copy(
        "qwen3-next-tiny",
        |_| {},
        |c| c["shared_expert_intermediate_size"] = 0.into(),
    );
    let err = load_error(&dir);
    assert!(err.contains("shared_expert_intermediate_size"), "{err}");
}

/// A conversation resent turn by turn resumes every turn from the last
/// one's end (a recurrent checkpoint), with a cold run's output.
#[test]
fn a_conversation_resumes_turn_by_turn() {
    let f = sliding_cache::fixture("qwen3-next-tiny");
    let mut ram = PrefixCache::new(PromptCache::new(1 << 30), None);
    let mut prompt: Vec<u32> = (0..300u32).map(|i| (i * 37 + 11) % 256).collect();
    let mut last: Option<(usize, Vec<u32>)> = None;
    for k in 0..6u32 {
        if let Some((_, reply)) = &last {
            prompt.extend(reply);
        }
        prompt.extend((0..20u32).map(|i| (i * 13 + 7 * k + 3) % 256));
        let (out, cached) = sliding_cache::generate(&f, &prompt, 4, Some(&mut ram));
        if let Some((prev, _)) = &last {
            assert!(
                cached + 1 >= prev + 4,
                "turn {k}: reused {cached} of {}",
                prompt.len()
            );
        }
        let cold = sliding_cache::generate(&f, &prompt, 4, None).0;
        sliding_cache::assert_same(&format!("turn {k}"), &out, &cold);
        last = Some((prompt.len(), out.iter().map(|t| t.0).collect()));
    }
}

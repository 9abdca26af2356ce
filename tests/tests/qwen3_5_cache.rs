//! The prompt cache over a hybrid model (tests/fixtures/models/qwen3.5-tiny:
//! gated-DeltaNet layers whose recurrent state cannot be trimmed back,
//! beside full-attention KV), in both tiers, through the engine's
//! scheduler with the real plugins (`mlxhost_e2e::sliding_cache::generate`).
//! A recurrent state is resumed only from a checkpoint that is an exact
//! prefix of the new prompt; every warm run gives a cold run's tokens and
//! logprobs, and the prefilled token counts are checked against the cold
//! ones:
//! - a 30-turn conversation resent turn by turn reuses everything up to
//!   the new turn, from RAM, and from the SSD tier after a restart;
//! - a prompt diverging inside a long earlier prompt resumes from the last
//!   checkpoint before the divergence (prefill checkpoints about every
//!   2048 tokens: a 3900-token prompt in 512-token chunks keeps 512, 2560
//!   and its end);
//! - a divergence before the first checkpoint is a clean miss.

use std::time::Duration;

use mlxhost::cache::state::CHECKPOINT_SPACING;
use mlxhost::cache::{PrefixCache, PromptCache};
use mlxhost_e2e::sliding_cache::{assert_same, fixture, generate, open_ssd, Fixture};

const TURNS: usize = 30;
/// Tokens each turn generates.
const REPLY: usize = 4;

/// A system-prompt-like opening of 300 tokens.
fn opening() -> Vec<u32> {
    (0..300u32).map(|i| (i * 37 + 11) % 256).collect()
}

/// Turn `k`'s new user message (20 tokens).
fn user_turn(k: usize) -> Vec<u32> {
    (0..20u32)
        .map(|i| (i * 13 + 7 * k as u32 + 3) % 256)
        .collect()
}

/// Runs the conversation turn by turn through `caches`: each prompt is
/// the previous prompt, its reply and a new turn. Checks every turn
/// reuses everything up to its new turn (the reply's last token, sampled
/// but never fed, may be prefilled) and, where `cold_every` divides the
/// turn, gives a cold run's output. Returns the prompts and the
/// prefilled token count (the cold count is printed beside it).
fn converse(
    f: &Fixture,
    caches: &mut PrefixCache,
    turns: usize,
    cold_every: usize,
) -> (Vec<Vec<u32>>, usize) {
    let mut prompt = opening();
    let (mut prompts, mut replies): (Vec<Vec<u32>>, Vec<Vec<u32>>) = (Vec::new(), Vec::new());
    let (mut warm_prefill, mut cold_prefill) = (0, 0);
    for k in 0..turns {
        if let Some(last) = replies.last() {
            prompt = [&prompt[..], &last[..], &user_turn(k)[..]].concat();
        } else {
            prompt.extend(user_turn(k));
        }
        let (out, cached) = generate(f, &prompt, REPLY, Some(caches));
        let reply: Vec<u32> = out.iter().map(|t| t.0).collect();
        assert_eq!(reply.len(), REPLY, "turn {k}: the reply ended early");
        if let Some(prev) = prompts.last().map(Vec::len) {
            let upto = prev + REPLY;
            assert!(
                (upto - 1..=upto).contains(&cached),
                "turn {k}: reused {cached} of {}, expected {}..={upto}",
                prompt.len(),
                upto - 1
            );
        }
        if k % cold_every == 0 || k + 1 == turns {
            assert_same(
                &format!("turn {k}"),
                &out,
                &generate(f, &prompt, REPLY, None).0,
            );
        }
        warm_prefill += prompt.len() - cached;
        cold_prefill += prompt.len();
        prompts.push(prompt.clone());
        replies.push(reply);
    }
    eprintln!(
        "{turns} turns: prefilled {warm_prefill} tokens warm, {cold_prefill} cold ({:.1}x fewer)",
        cold_prefill as f64 / warm_prefill as f64
    );
    (prompts, warm_prefill)
}

#[test]
fn a_conversation_resumes_turn_by_turn_from_ram() {
    let f = fixture("qwen3.5-tiny");
    let mut ram = PrefixCache::new(PromptCache::new(1 << 30), None);
    let (prompts, warm) = converse(&f, &mut ram, TURNS, 1);
    // Each turn prefills its new message and at most one reply token; the
    // first its whole prompt.
    let first = prompts[0].len();
    assert!(warm <= first + (TURNS - 1) * (20 + 1), "prefilled {warm}");
    let stats = ram.ram_stats();
    assert_eq!(stats.hits as usize, TURNS - 1, "{stats:?}");
    // Each turn's entry holds a state where it resumed (the previous
    // turn's end), so it covers and replaces the previous entry.
    assert_eq!(stats.entries, 1, "{stats:?}");
}

#[test]
fn a_conversation_resumes_from_the_ssd_tier_after_a_restart() {
    let f = fixture("qwen3.5-tiny");
    let dir = tempfile::tempdir().expect("tempdir");
    let ssd_dir = dir.path().join("ssd");
    // RAM keeps nothing: every hit comes from the disk, written behind.
    let (prompts, replies) = {
        let mut tiers = PrefixCache::new(PromptCache::new(0), Some(open_ssd(&f.model, &ssd_dir)));
        let mut prompt = opening();
        let (mut prompts, mut replies): (Vec<Vec<u32>>, Vec<Vec<u32>>) = (Vec::new(), Vec::new());
        for k in 0..TURNS {
            if let Some(last) = replies.last() {
                prompt = [&prompt[..], &last[..], &user_turn(k)[..]].concat();
            } else {
                prompt.extend(user_turn(k));
            }
            let (out, cached) = generate(&f, &prompt, REPLY, Some(&mut tiers));
            assert!(tiers.flush(Duration::from_secs(60)), "written to disk");
            if let Some(prev) = prompts.last().map(Vec::len) {
                assert!(
                    cached + 1 >= prev + REPLY,
                    "turn {k}: reused {cached} from SSD"
                );
            }
            if k % 10 == 9 {
                let cold = generate(&f, &prompt, REPLY, None).0;
                assert_same(&format!("turn {k} from SSD"), &out, &cold);
            }
            prompts.push(prompt.clone());
            replies.push(out.iter().map(|t| t.0).collect());
        }
        (prompts, replies)
    };
    // A restart: a fresh index over the same directory.
    let mut tiers = PrefixCache::new(PromptCache::new(0), Some(open_ssd(&f.model, &ssd_dir)));
    let (last_prompt, last_reply) = (&prompts[TURNS - 1], &replies[TURNS - 1]);
    let next = [&last_prompt[..], &last_reply[..], &user_turn(TURNS)[..]].concat();
    let (warm, cached) = generate(&f, &next, REPLY, Some(&mut tiers));
    let upto = last_prompt.len() + REPLY;
    assert!(
        (upto - 1..=upto).contains(&cached),
        "after a restart: reused {cached}, expected {}..={upto}",
        upto - 1
    );
    assert_same(
        "after a restart",
        &warm,
        &generate(&f, &next, REPLY, None).0,
    );
    let stats = tiers.ssd().expect("ssd").stats_handle("Float32").stats();
    assert_eq!(stats.quarantined, 0, "{stats:?}");
    assert!(stats.hits >= 1, "{stats:?}");
}

/// A 3900-token prompt (the fixture's context is 4096), prefilled in
/// 512-token chunks.
fn long_prompt() -> Vec<u32> {
    (0..3900u32)
        .map(|i| (i * 37 + 11 + i / 256) % 256)
        .collect()
}

/// `prompt` cut at `at` with a different token there, then 10 more.
fn diverging(prompt: &[u32], at: usize) -> Vec<u32> {
    let mut p = prompt[..at].to_vec();
    p.push((prompt[at] + 1) % 256);
    p.extend((0..10u32).map(|i| (i * 5 + 1) % 256));
    p
}

/// The divergence cases: (label, divergence point, tokens to reuse).
fn divergences() -> Vec<(&'static str, usize, usize)> {
    assert_eq!(CHECKPOINT_SPACING, 2048, "the expected checkpoints below");
    vec![
        ("a divergence after the 2560 checkpoint", 3000, 2560),
        ("a divergence near the end", 3800, 2560),
        ("a divergence right at a checkpoint", 2560, 2560),
        ("a divergence between the first two", 2000, 512),
        ("a divergence before the first checkpoint", 300, 0),
    ]
}

/// Runs the first prompt cold, then each divergence warm through the
/// tiers `open` gives (a fresh one per case: for the SSD tier, a restart).
fn check_divergences(f: &Fixture, mut open: impl FnMut() -> PrefixCache) {
    let prompt = long_prompt();
    {
        let mut caches = open();
        let (first, cached) = generate(f, &prompt, REPLY, Some(&mut caches));
        assert_eq!(cached, 0);
        assert_same("first run", &first, &generate(f, &prompt, REPLY, None).0);
        assert!(caches.flush(Duration::from_secs(60)), "written");
    }
    for (label, at, expected) in divergences() {
        let p = diverging(&prompt, at);
        let mut caches = open();
        let (warm, cached) = generate(f, &p, REPLY, Some(&mut caches));
        assert!(caches.flush(Duration::from_secs(60)), "written");
        drop(caches);
        assert_eq!(cached, expected, "{label}: reused");
        eprintln!(
            "{label}: prefilled {} of {} tokens (cold: all)",
            p.len() - cached,
            p.len()
        );
        assert_same(label, &warm, &generate(f, &p, REPLY, None).0);
    }
}

/// The same prompt resent (a client retrying) resumes one token before
/// its end: a prefill chunk leaves a checkpoint there, and the last
/// token is always fed again for its logits.
#[test]
fn the_same_prompt_resent_reuses_all_but_its_last_token() {
    let f = fixture("qwen3.5-tiny");
    let prompt = long_prompt();
    let mut ram = PrefixCache::new(PromptCache::new(1 << 30), None);
    let (first, _) = generate(&f, &prompt, REPLY, Some(&mut ram));
    let (again, cached) = generate(&f, &prompt, REPLY, Some(&mut ram));
    assert_eq!(cached, prompt.len() - 1);
    assert_same("resent", &again, &first);
}

#[test]
fn a_divergence_resumes_from_the_last_checkpoint_before_it_in_ram() {
    // One RAM cache for every case (the diverged prompts' entries beside
    // the first one's never offer a later checkpoint).
    let f = fixture("qwen3.5-tiny");
    let mut ram = PrefixCache::new(PromptCache::new(1 << 30), None);
    let prompt = long_prompt();
    let (first, cached) = generate(&f, &prompt, REPLY, Some(&mut ram));
    assert_eq!(cached, 0);
    assert_same("first run", &first, &generate(&f, &prompt, REPLY, None).0);
    for (label, at, expected) in divergences() {
        let p = diverging(&prompt, at);
        let (warm, cached) = generate(&f, &p, REPLY, Some(&mut ram));
        assert_eq!(cached, expected, "{label}: reused");
        assert_same(label, &warm, &generate(&f, &p, REPLY, None).0);
    }
    // Every case but the one diverging right at a checkpoint and the miss
    // resumed short of what it shares with the first prompt.
    let stats = ram.ram_stats();
    assert_eq!(stats.hits, 4, "{stats:?}");
    assert_eq!(stats.hits_by_kind.get("recurrent"), Some(&4), "{stats:?}");
    assert_eq!(stats.checkpoint_hits, 3, "{stats:?}");
}

#[test]
fn a_divergence_resumes_from_the_last_checkpoint_before_it_from_ssd() {
    let f = fixture("qwen3.5-tiny");
    let dir = tempfile::tempdir().expect("tempdir");
    let ssd_dir = dir.path().join("ssd");
    check_divergences(&f, || {
        PrefixCache::new(PromptCache::new(0), Some(open_ssd(&f.model, &ssd_dir)))
    });
}

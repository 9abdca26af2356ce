//! Quantized KV caches (`--kv-bits`, issue 41) on the real models:
//! SmolLM2-135M (llama), Qwen2.5-Coder-0.5B (qwen2) and Gemma 3 270M
//! (sliding-window layers, which stay float). Greedy output under 8- and
//! 4-bit caches equals the float cache's up to its first near-tie; rows
//! batched together equal rows alone; a RAM hit and an SSD restore equal a
//! cold run under the same scheme; an SSD tier written under one scheme
//! never restores under another (nor under float). Drives the engine's
//! scheduler directly with the `standard` sampler plugin.
//!
//! Needs the models installed (`mlxhost models pull smollm2-135m`,
//! `qwen2.5-coder-0.5b`, `gemma3-270m`; scripts/test.sh does it).

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use mlxhost::cache::{KvQuant, PrefixCache, PromptCache};
use mlxhost::engine::scheduler::{ChainSource, Pending, Scheduler, SchedulerConfig};
use mlxhost::model::LoadedModel;
use mlxhost_e2e::installed_model;
use mlxhost_e2e::requests::greedy_request;
use mlxhost_e2e::sliding_cache::{assert_same_within, open_ssd, Fixture, Record, Sink};

/// Greedy tokens are compared up to the first step whose float top-2
/// margin is below this: semantics.md's near-tie rule for the float32 path
/// (twice its 0.1-nat tolerance).
const NEAR_TIE: f32 = 0.2;

/// Logprobs of two runs under the same scheme (warm vs cold, batched vs
/// alone) agree within this: semantics.md's tolerance for "the same
/// thing computed two ways" on the float32 path. Not the 1e-4 float caches
/// meet: a key computed by the decode path and the same key computed in a
/// prefill chunk (or in a batch of another shape) differ in the last float
/// bits, and now and then that moves an element across a quantization step
/// (measured up to 0.03 nats at 8 bits, 0.13 at 4 bits, each test in its own
/// process as CI's nextest runs them; under `cargo test`'s threads the batch
/// composition follows timing and 8 bits have reached 0.21).
const SAME_SCHEME_TOL: f32 = 0.1;

fn load(name: &str, quant: Option<KvQuant>) -> Fixture {
    let model =
        mlxhost::model::load(&installed_model(name), &Default::default()).expect("model loads");
    let model =
        mlxhost::model::quantized_kv::with_kv_quant(model, quant).expect("a scheme the model fits");
    Fixture::with_standard_sampler(model)
}

fn q(bits: u32) -> Option<KvQuant> {
    Some(KvQuant::new(bits, 64).expect("a scheme"))
}

/// A few hundred tokens of natural text (this crate's docs), then its
/// first lines again: the model goes on copying them, with clear margins,
/// by attending far back over the (quantized) cache.
fn prompt(f: &Fixture, extra: &str) -> Vec<u32> {
    let text: String = include_str!("../../docs/architecture.md")
        .chars()
        .take(1500)
        .collect();
    let again: String = text.chars().take(200).collect();
    let text = format!("{text}\n{extra}\n\n{again}");
    f.model.tokenizer.encode(&text).expect("tokenizes")
}

type Tokens = Vec<(u32, f32, f32)>;

/// Greedy generation of `max_tokens` after each prompt, all submitted to
/// one scheduler of `batch` rows; per prompt its tokens (id, logprob,
/// top-2 margin) and the prompt tokens a cache gave it.
fn generate(
    f: &Fixture,
    prompts: &[Vec<u32>],
    max_tokens: usize,
    batch: usize,
    mut caches: Option<&mut PrefixCache>,
) -> Vec<(Tokens, usize)> {
    let mut scheduler = Scheduler::new(SchedulerConfig {
        max_batch: batch,
        ..SchedulerConfig::default()
    });
    let records: Vec<Rc<RefCell<Record>>> = prompts
        .iter()
        .map(|p| {
            let record = Rc::new(RefCell::new(Record::default()));
            scheduler.submit(Pending {
                request: greedy_request(p, max_tokens, 2),
                chain: ChainSource::Plugins(f.plugins.clone()),
                sink: Box::new(Sink(Rc::clone(&record))),
            });
            record
        })
        .collect();
    let mut steps = 0;
    while !scheduler.is_idle() {
        scheduler.step(&f.model, caches.as_deref_mut());
        steps += 1;
        assert!(steps < 10_000, "the scheduler never drained");
    }
    records
        .into_iter()
        .map(|r| {
            let r = r.take();
            match r.result {
                Some(Ok(s)) => (r.tokens, s.cached_tokens),
                other => panic!("generation failed: {other:?}"),
            }
        })
        .collect()
}

/// Greedy under quantized caches of `bits` against the float cache.
fn greedy_equals_float(name: &str, bits: &[u32]) {
    let float = load(name, None);
    let p = prompt(&float, "");
    let want = generate(&float, std::slice::from_ref(&p), 24, 1, None)
        .remove(0)
        .0;
    drop(float);
    for &bits in bits {
        let f = load(name, q(bits));
        let got = generate(&f, std::slice::from_ref(&p), 24, 1, None)
            .remove(0)
            .0;
        let label = format!("{name} {bits}-bit vs float");
        assert_same_within(&label, &got, &want, f32::INFINITY, NEAR_TIE);
    }
}

#[test]
fn smollm2_quantized_greedy_equals_float_up_to_a_near_tie() {
    greedy_equals_float("smollm2-135m", &[8, 4]);
}

/// Measured (docs/semantics.md, "Quantized KV cache"): on this prompt
/// Qwen2.5's greedy output under an 8-bit cache differs from float's at
/// token 4 with a float top-2 margin above 0.2 nats (at 4 bits at token 0
/// on another prompt). Kept as the record of that; run with `--ignored`.
#[test]
#[ignore = "measured divergence: Qwen2.5 at 8 bits differs at token 4 (docs/semantics.md)"]
fn qwen_quantized_greedy_equals_float_up_to_a_near_tie() {
    greedy_equals_float("qwen2.5-coder-0.5b", &[8]);
}

#[test]
fn gemma3_quantized_greedy_equals_float_up_to_a_near_tie() {
    greedy_equals_float("gemma3-270m", &[8]);
}

/// Measured: Gemma 3 under a 4-bit cache (its full layers; sliding layers
/// stay float) differs from float at token 1. Run with `--ignored`.
#[test]
#[ignore = "measured divergence: Gemma 3 at 4 bits differs at token 1 (docs/semantics.md)"]
fn gemma3_4bit_greedy_equals_float_up_to_a_near_tie() {
    greedy_equals_float("gemma3-270m", &[4]);
}

/// Three rows of different lengths decoding together (the quantized CPU
/// decode op over several rows, prompt chunks beside decode rows) equal
/// each row alone: SmolLM2 (the fused decode layer) and Gemma 3 (its full
/// layers through the batched decode op, its sliding layers float).
#[test]
fn quantized_rows_batched_equal_rows_alone() {
    for name in ["smollm2-135m", "gemma3-270m"] {
        let f = load(name, q(8));
        let prompts: Vec<Vec<u32>> = ["", "A second, longer question follows here.", "Third."]
            .iter()
            .map(|e| prompt(&f, e))
            .collect();
        let together = generate(&f, &prompts, 16, 3, None);
        for (i, p) in prompts.iter().enumerate() {
            let alone = generate(&f, std::slice::from_ref(p), 16, 1, None)
                .remove(0)
                .0;
            assert_same_within(
                &format!("{name} row {i}"),
                &together[i].0,
                &alone,
                SAME_SCHEME_TOL,
                NEAR_TIE,
            );
        }
    }
}

/// A conversation resent with one more turn: from the RAM tier, and from
/// the SSD tier alone after it is reopened, it equals a cold run under the
/// same scheme and reuses the conversation.
#[test]
fn quantized_cache_hits_equal_a_cold_run_in_both_tiers() {
    for name in ["smollm2-135m", "gemma3-270m"] {
        let f = load(name, q(8));
        let p = prompt(&f, "");
        let dir = tempfile::tempdir().expect("tempdir");
        let ssd = dir.path().join("ssd");
        let mut tiers = PrefixCache::new(PromptCache::new(1 << 30), Some(open_ssd(&f.model, &ssd)));
        let (first, cached) =
            generate(&f, std::slice::from_ref(&p), 12, 1, Some(&mut tiers)).remove(0);
        assert_eq!(cached, 0);
        assert!(tiers.flush(Duration::from_secs(60)), "written to disk");
        let reply: Vec<u32> = first.iter().map(|t| t.0).collect();
        let next = [
            &p[..],
            &reply,
            &f.model.tokenizer.encode(" And then?").expect("tokenizes"),
        ]
        .concat();
        let cold = generate(&f, std::slice::from_ref(&next), 8, 1, None)
            .remove(0)
            .0;
        let (warm, cached) =
            generate(&f, std::slice::from_ref(&next), 8, 1, Some(&mut tiers)).remove(0);
        assert!(
            cached >= p.len(),
            "{name}: RAM reused {cached} of {}",
            next.len()
        );
        assert_same_within(
            &format!("{name} RAM hit"),
            &warm,
            &cold,
            SAME_SCHEME_TOL,
            NEAR_TIE,
        );
        drop(tiers);
        // The SSD tier alone, reopened as after a restart.
        let mut disk = PrefixCache::new(PromptCache::new(0), Some(open_ssd(&f.model, &ssd)));
        let (restored, cached) =
            generate(&f, std::slice::from_ref(&next), 8, 1, Some(&mut disk)).remove(0);
        assert!(
            cached >= p.len(),
            "{name}: SSD restored {cached} of {}",
            next.len()
        );
        assert_same_within(
            &format!("{name} SSD restore"),
            &restored,
            &cold,
            SAME_SCHEME_TOL,
            NEAR_TIE,
        );
    }
}

/// Entries written under 8 bits never seed a float, a 4-bit or an 8-bit
/// group-32 request, from the RAM tier or from the SSD tier after a restart
/// with another `--kv-bits`; none is quarantined for it (each scheme has
/// its own key). Under 8 bits again, both do seed it.
#[test]
fn a_scheme_change_never_restores_an_old_scheme_entry() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ssd = dir.path().join("ssd");
    let q8 = load("smollm2-135m", q(8));
    let p = prompt(&q8, "");
    // A RAM tier holding 8-bit entries (one process never mixes schemes,
    // but the namespace must keep them apart all the same) and an SSD tier
    // written under 8 bits (one tier per directory at a time: each opened
    // and dropped in turn, as by a restart).
    let mut ram = PrefixCache::new(PromptCache::new(1 << 30), None);
    generate(&q8, std::slice::from_ref(&p), 4, 1, Some(&mut ram));
    let reopen = |m: &LoadedModel| PrefixCache::new(PromptCache::new(0), Some(open_ssd(m, &ssd)));
    {
        let mut disk = reopen(&q8.model);
        generate(&q8, std::slice::from_ref(&p), 4, 1, Some(&mut disk));
        assert!(disk.flush(Duration::from_secs(60)), "written to disk");
    }
    let (_, cached) = generate(&q8, std::slice::from_ref(&p), 2, 1, Some(&mut ram)).remove(0);
    assert!(cached > 0, "the 8-bit RAM entry seeds an 8-bit request");
    {
        let mut disk = reopen(&q8.model);
        let (_, cached) = generate(&q8, std::slice::from_ref(&p), 2, 1, Some(&mut disk)).remove(0);
        assert!(
            cached > 0,
            "the 8-bit SSD entry restores under 8 bits after a restart"
        );
    }
    drop(q8);
    for quant in [None, q(4), Some(KvQuant::new(8, 32).expect("a scheme"))] {
        let f = load("smollm2-135m", quant);
        let (_, cached) = generate(&f, std::slice::from_ref(&p), 2, 1, Some(&mut ram)).remove(0);
        assert_eq!(cached, 0, "{quant:?}: reused an 8-bit entry from RAM");
        let mut disk = reopen(&f.model);
        let (_, cached) = generate(&f, std::slice::from_ref(&p), 2, 1, Some(&mut disk)).remove(0);
        assert_eq!(
            cached, 0,
            "{quant:?}: restored an 8-bit entry from the SSD tier"
        );
        let ns = mlxhost::engine::kv_namespace(&f.model);
        let stats = disk.ssd().expect("ssd").stats_handle(&ns).stats();
        assert_eq!(stats.quarantined, 0, "{stats:?}");
    }
}

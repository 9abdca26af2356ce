//! The SSD tier end to end at unit level: real files, real MLX arrays.

use std::path::Path;
use std::time::Duration;

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{Array, Dtype};

use super::*;
use crate::cache::{LayerKind, PrefixCache, PromptCache};

const LAYERS: usize = 2;
const HEADS: usize = 2;

fn identity(model: &str, tokenizer: &str, head_dim: usize) -> ModelIdentity {
    ModelIdentity {
        model: model.into(),
        tokenizer: tokenizer.into(),
        geometry: KvGeometry {
            shapes: vec![
                crate::cache::KvShape {
                    kv_heads: HEADS,
                    head_dim,
                };
                LAYERS
            ],
            dtype: Dtype::Float32,
            kinds: vec![crate::cache::LayerKind::Full; LAYERS],
            quant: None,
        },
    }
}

fn open(dir: &Path, id: ModelIdentity, max_bytes: u64, verify: bool) -> SsdCache {
    SsdCache::open(
        &SsdConfig {
            dir: dir.to_path_buf(),
            max_bytes,
            verify,
        },
        id,
    )
    .unwrap()
}

/// The value every test stores at (layer, keys/values, head, position, d):
/// a function of the token at that position, so a restore that mixes up
/// files, positions or tensors is caught.
fn value(token: u32, layer: usize, kind: usize, head: usize, d: usize) -> f32 {
    (token % 32768) as f32 + layer as f32 * 0.25 + kind as f32 * 0.5 + head as f32 * 0.125
        - d as f32 / 1024.0
}

fn tensor(tokens: &[u32], layer: usize, kind: usize, head_dim: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(HEADS * tokens.len() * head_dim);
    for h in 0..HEADS {
        for &t in tokens {
            for d in 0..head_dim {
                out.push(value(t, layer, kind, h, d));
            }
        }
    }
    out
}

/// A KV cache holding `tokens` (through `KvCache::update`, so its buffers
/// have spare capacity like a real one).
fn kv_for(tokens: &[u32], head_dim: usize) -> KvCache {
    let mut kv = KvCache::new(LAYERS);
    let shape = [1, HEADS as i32, tokens.len() as i32, head_dim as i32];
    for layer in 0..LAYERS {
        let k = Array::from_slice(&tensor(tokens, layer, 0, head_dim), &shape);
        let v = Array::from_slice(&tensor(tokens, layer, 1, head_dim), &shape);
        kv.update(layer, &k, &v).unwrap();
    }
    kv.advance(tokens.len());
    kv
}

/// Whether `kv`'s first `n` positions hold exactly what `kv_for(tokens)` stored.
fn holds(kv: &KvCache, tokens: &[u32], n: usize, head_dim: usize) -> bool {
    kv.offset() == n
        && kv.layer_buffers().iter().enumerate().all(|(layer, buf)| {
            let Some((k, v)) = buf else { return false };
            [(*k, 0), (*v, 1)].iter().all(|(a, kind)| {
                let got = a.index((.., .., ..n as i32, ..)).contiguous().unwrap();
                got.as_slice::<f32>() == &tensor(&tokens[..n], layer, *kind, head_dim)[..]
            })
        })
}

/// The rwx bits of `path`'s mode.
#[cfg(unix)]
fn permission_bits(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

fn seq(start: u32, n: usize) -> Vec<u32> {
    (start..start + n as u32).collect()
}

const D: usize = 64;
const BIG: u64 = 1 << 30;

fn write(ssd: &SsdCache, tokens: &[u32]) {
    ssd.submit("ns", tokens, &kv_for(tokens, D)).unwrap();
    assert!(ssd.flush(Duration::from_secs(30)));
}

#[test]
fn a_restart_restores_the_longest_prefix_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = seq(10, 300);
    {
        let ssd = open(dir.path(), identity("m", "t", D), BIG, false);
        write(&ssd, &tokens);
        assert_eq!(ssd.stats_handle("ns").stats().writes, 1);
    }
    // A new process: a fresh index over the same directory.
    let ssd = open(dir.path(), identity("m", "t", D), BIG, true);
    let mut prompt = tokens[..200].to_vec();
    prompt.extend([7, 7, 7]);
    assert_eq!(ssd.peek("ns", &prompt), 200);
    let r = ssd.restore("ns", &prompt).unwrap();
    assert_eq!(r.reused, 200);
    assert!(holds(&r.kv, &tokens, 200, D));
    // The whole sequence resent: all but one token.
    let r = ssd.restore("ns", &tokens).unwrap();
    assert_eq!(r.reused, 299);
    let s = ssd.stats_handle("ns").stats();
    assert_eq!((s.hits, s.tokens_restored, s.entries), (2, 499, 1));
    #[cfg(unix)]
    assert_eq!(permission_bits(&dir.path().join("v1")), 0o700);
}

#[test]
fn another_model_tokenizer_or_namespace_never_reuses() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = seq(1, 50);
    write(
        &open(dir.path(), identity("m", "t", D), BIG, false),
        &tokens,
    );
    {
        let fine_tune = open(dir.path(), identity("m2", "t", D), BIG, false);
        assert_eq!(fine_tune.peek("ns", &tokens), 0);
        assert!(fine_tune.restore("ns", &tokens).is_none());
    }
    {
        let new_tokenizer = open(dir.path(), identity("m", "t2", D), BIG, false);
        assert!(new_tokenizer.restore("ns", &tokens).is_none());
    }
    let same = open(dir.path(), identity("m", "t", D), BIG, false);
    assert!(same.restore("other-kv-scheme", &tokens).is_none());
    assert!(same.restore("ns", &tokens).is_some());
    // None of them was taken for corrupt.
    assert_eq!(same.stats_handle("ns").stats().quarantined, 0);
}

#[test]
fn a_file_in_the_wrong_key_directory_is_quarantined() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = seq(1, 40);
    let ssd = open(dir.path(), identity("m", "t", D), BIG, false);
    write(&ssd, &tokens);
    let digest = key_digest(&ssd.key("ns"));
    drop(ssd);
    let src = dir.path().join("v1").join(&digest);
    let other = dir
        .path()
        .join("v1")
        .join("0123456789abcdef0123456789abcdef");
    std::fs::rename(&src, &other).unwrap();
    let ssd = open(dir.path(), identity("m", "t", D), BIG, false);
    assert_eq!(ssd.stats_handle("ns").stats().quarantined, 1);
    assert!(ssd.restore("ns", &tokens).is_none());
}

/// Writes one entry, damages it with `damage`, reopens; returns the stats
/// and whether a restore happened.
fn damaged(damage: impl Fn(&Path), verify: bool) -> (SsdCacheStats, bool) {
    let dir = tempfile::tempdir().unwrap();
    let tokens = seq(1, 40);
    let ssd = open(dir.path(), identity("m", "t", D), BIG, false);
    write(&ssd, &tokens);
    let path = ssd.store.lock().unwrap().entries()[0].path.clone();
    drop(ssd);
    damage(&path);
    let ssd = open(dir.path(), identity("m", "t", D), BIG, verify);
    let restored = ssd.restore("ns", &tokens).is_some();
    let quarantined_files = std::fs::read_dir(dir.path().join("quarantine"))
        .unwrap()
        .count();
    let stats = ssd.stats_handle("ns").stats();
    assert_eq!(quarantined_files as u64, stats.quarantined);
    (stats, restored)
}

/// A way to damage an entry file.
type Damage = Box<dyn Fn(&Path)>;

fn flip_byte(path: &Path, at: usize) {
    let mut b = std::fs::read(path).unwrap();
    b[at] ^= 0x01;
    std::fs::write(path, b).unwrap();
}

#[test]
fn truncated_bit_flipped_wrong_version_and_foreign_files_are_quarantined() {
    let cases: Vec<(&str, Damage)> = vec![
        (
            "truncated",
            Box::new(|p: &Path| {
                let len = std::fs::metadata(p).unwrap().len();
                let f = std::fs::OpenOptions::new().write(true).open(p).unwrap();
                f.set_len(len - 4096).unwrap();
            }),
        ),
        ("header bit", Box::new(|p: &Path| flip_byte(p, 64))),
        ("hash bit", Box::new(|p: &Path| flip_byte(p, 20))),
        ("wrong version", Box::new(|p: &Path| flip_byte(p, 9))),
        (
            "foreign",
            Box::new(|p: &Path| std::fs::write(p, b"PK\x03\x04 not a cache file").unwrap()),
        ),
        (
            "empty",
            Box::new(|p: &Path| std::fs::write(p, b"").unwrap()),
        ),
    ];
    for (name, damage) in cases {
        let (stats, restored) = damaged(damage, false);
        assert_eq!(stats.quarantined, 1, "{name}");
        assert!(!restored, "{name}");
        assert_eq!(stats.entries, 0, "{name}");
    }
}

#[test]
fn a_flipped_data_bit_is_quarantined_when_verifying() {
    // The last tensor's bytes end the file.
    let flip_data = |p: &Path| {
        let len = std::fs::metadata(p).unwrap().len() as usize;
        flip_byte(p, len - 100)
    };
    let (stats, restored) = damaged(flip_data, true);
    assert_eq!((stats.quarantined, restored), (1, false));
    // Without --ssd-cache-verify only the header is checked (documented).
    let (stats, restored) = damaged(flip_data, false);
    assert_eq!((stats.quarantined, restored), (0, true));
}

#[test]
fn the_byte_cap_evicts_the_least_recently_used_first() {
    let dir = tempfile::tempdir().unwrap();
    let one = {
        let ssd = open(dir.path(), identity("m", "t", D), BIG, false);
        write(&ssd, &seq(1000, 100));
        ssd.stats_handle("ns").stats().bytes
    };
    std::fs::remove_dir_all(dir.path()).unwrap();
    let ssd = open(dir.path(), identity("m", "t", D), 2 * one + one / 2, false);
    let (a, b, c) = (seq(1000, 100), seq(2000, 100), seq(3000, 100));
    write(&ssd, &a);
    std::thread::sleep(Duration::from_millis(20));
    write(&ssd, &b);
    std::thread::sleep(Duration::from_millis(20));
    // Using `a` makes `b` the least recently used.
    assert!(ssd.restore("ns", &a).is_some());
    std::thread::sleep(Duration::from_millis(20));
    write(&ssd, &c);
    assert!(ssd.restore("ns", &b).is_none(), "b was evicted");
    assert!(ssd.restore("ns", &a).is_some());
    assert!(ssd.restore("ns", &c).is_some());
    let s = ssd.stats_handle("ns").stats();
    assert_eq!((s.evictions, s.entries), (1, 2));
    assert!(s.bytes <= s.max_bytes);
    // The cap also holds after a restart with a smaller one.
    drop(ssd);
    let ssd = open(dir.path(), identity("m", "t", D), one + 1, false);
    let s = ssd.stats_handle("ns").stats();
    assert_eq!(s.entries, 1);
    assert!(ssd.restore("ns", &c).is_some(), "the most recent one stays");
}

#[test]
fn a_longer_conversation_replaces_the_entries_it_covers() {
    let dir = tempfile::tempdir().unwrap();
    let ssd = open(dir.path(), identity("m", "t", D), BIG, false);
    let long = seq(1, 120);
    write(&ssd, &long[..60]);
    write(&ssd, &long[..90]);
    write(&ssd, &long);
    // Already covered: not written again.
    write(&ssd, &long[..30]);
    let s = ssd.stats_handle("ns").stats();
    assert_eq!((s.writes, s.entries), (3, 1));
    let files = std::fs::read_dir(dir.path().join("v1").join(key_digest(&ssd.key("ns"))))
        .unwrap()
        .count();
    assert_eq!(files, 1);
}

#[test]
fn both_tiers_restore_from_ssd_only_when_it_covers_more() {
    let dir = tempfile::tempdir().unwrap();
    let long = seq(1, 200);
    {
        // SSD only (RAM off): entries reach the disk when requests settle.
        let ssd = open(dir.path(), identity("m", "t", D), BIG, false);
        let mut tiers = PrefixCache::new(PromptCache::new(0), Some(ssd));
        tiers.insert("ns", long.clone(), kv_for(&long, D));
        assert!(tiers.has_unwritten());
        assert!(tiers.flush(Duration::from_secs(30)));
        assert!(!tiers.has_unwritten());
    }
    let ssd = open(dir.path(), identity("m", "t", D), BIG, false);
    let mut tiers = PrefixCache::new(PromptCache::new(1 << 30), Some(ssd));
    // RAM holds a shorter prefix: the SSD's longer one wins.
    tiers.insert("ns", long[..50].to_vec(), kv_for(&long[..50], D));
    let r = tiers.lookup("ns", &long).unwrap();
    assert_eq!(r.reused, 199);
    assert!(holds(&r.kv, &long, 199, D));
    // RAM holds as much: RAM serves it, the disk is not read.
    tiers.insert("ns", long.clone(), kv_for(&long, D));
    let r = tiers.lookup("ns", &long).unwrap();
    assert_eq!(r.reused, 199);
    let ssd_hits = tiers.ssd().unwrap().stats_handle("ns").stats().hits;
    assert_eq!((ssd_hits, tiers.ram_stats().hits), (1, 1));
}

#[test]
fn ram_evictions_spill_to_ssd() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (seq(1, 100), seq(500, 100));
    let one = kv_for(&a, D).nbytes();
    let ssd = open(dir.path(), identity("m", "t", D), BIG, false);
    let mut tiers = PrefixCache::new(PromptCache::new(one), Some(ssd));
    tiers.insert("ns", a.clone(), kv_for(&a, D));
    tiers.insert("ns", b.clone(), kv_for(&b, D));
    tiers.spill_evicted();
    assert!(tiers.ssd().unwrap().flush(Duration::from_secs(30)));
    let r = tiers.lookup("ns", &a).unwrap();
    assert_eq!(r.reused, 99);
    assert!(holds(&r.kv, &a, 99, D));
    assert_eq!(tiers.ssd().unwrap().stats_handle("ns").stats().hits, 1);
}

/// The child side of [`a_writer_killed_at_random_points_never_leaves_a_wrong_file`]:
/// writes growing conversations until it is killed. Does nothing unless
/// started by that test.
#[test]
fn sigkill_writer_child() {
    let Some(dir) = std::env::var_os(CHILD_ENV) else {
        return;
    };
    let seed: u32 = std::env::var("MLXHOST_SSD_CHILD_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let ssd = open(
        Path::new(&dir),
        identity("m", "t", CHILD_D),
        CHILD_CAP,
        false,
    );
    // The KV of eight conversation families built once (so the child
    // spends its time writing, where the kills should land); a
    // conversation's tokens are offset by its id, and its KV values depend
    // on its family, so a mix-up between files of different families shows.
    let base: Vec<u32> = (0..CHILD_MAX_LEN as u32).collect();
    let families: Vec<KvCache> = (0..8u32)
        .map(|f| {
            let tokens: Vec<u32> = base.iter().map(|p| f * 4096 + p).collect();
            kv_for(&tokens, CHILD_D)
        })
        .collect();
    // Tell the parent the writes begin now.
    println!("{CHILD_READY}");
    for i in 0u32.. {
        // Each conversation grows over three writes (each replaces the
        // entry it covers); older conversations are evicted by the cap.
        let conv = seed * 1000 + i / 3;
        let len = 64 + (i % 3) as usize * 300 + (seed as usize * 37 + i as usize) % 64;
        let tokens: Vec<u32> = base[..len].iter().map(|p| conv * 4096 + p).collect();
        let mut kv = families[(conv % 8) as usize].clone();
        kv.truncate(len);
        ssd.submit("ns", &tokens, &kv).unwrap();
        ssd.flush(Duration::from_secs(30));
    }
}

const CHILD_ENV: &str = "MLXHOST_SSD_CHILD_DIR";
const CHILD_D: usize = 256;
const CHILD_MAX_LEN: usize = 760;
const CHILD_READY: &str = "mlxhost-ssd-child-writing";
const CHILD_CAP: u64 = 24 << 20;

#[test]
fn a_writer_killed_at_random_points_never_leaves_a_wrong_file() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut rng = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos() | 1)
        .unwrap_or(12345);
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 17;
        rng ^= rng << 5;
        rng
    };
    const KILLS: usize = 60;
    let (mut partials_seen, mut restored) = (0usize, 0usize);
    for round in 0..KILLS {
        let mut child = std::process::Command::new(&exe)
            .args([
                "--exact",
                "cache::ssd::tests::sigkill_writer_child",
                "--nocapture",
            ])
            .env(CHILD_ENV, dir.path())
            .env("MLXHOST_SSD_CHILD_SEED", round.to_string())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // Wait until it writes, then kill it at a random point of its loop.
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        while !line.contains(CHILD_READY) {
            line.clear();
            if std::io::BufRead::read_line(&mut out, &mut line).unwrap() == 0 {
                panic!("the writer child exited before writing");
            }
        }
        std::thread::sleep(Duration::from_micros(next() as u64 % 60_000));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        partials_seen += std::fs::read_dir(dir.path().join("tmp"))
            .map(|d| d.count())
            .unwrap_or(0)
            .min(1);
        // Whatever the kill left: every indexed entry restores to exactly
        // the KV of its tokens, with or without tensor verification.
        let ssd = open(
            dir.path(),
            identity("m", "t", CHILD_D),
            CHILD_CAP,
            round % 2 == 0,
        );
        let entries: Vec<Vec<u32>> = ssd
            .store
            .lock()
            .unwrap()
            .entries()
            .iter()
            .map(|e| e.tokens.to_vec())
            .collect();
        for tokens in entries {
            let mut prompt = tokens.clone();
            prompt.push(u32::MAX);
            let r = ssd
                .restore("ns", &prompt)
                .expect("an indexed entry restores");
            assert_eq!(r.reused, tokens.len());
            assert!(
                holds(&r.kv, &tokens, tokens.len(), CHILD_D),
                "round {round}"
            );
            restored += 1;
        }
        let s = ssd.stats_handle("ns").stats();
        assert_eq!(
            s.quarantined, 0,
            "round {round}: a killed writer left a bad file"
        );
        assert!(s.bytes <= CHILD_CAP);
        assert_eq!(
            std::fs::read_dir(dir.path().join("tmp")).unwrap().count(),
            0,
            "orphans are removed at open"
        );
    }
    // The kills did land mid-write, and entries did survive them.
    assert!(partials_seen > 0, "no kill interrupted a write");
    assert!(restored > 0, "no entry was ever completed");
    eprintln!("{KILLS} kills: {partials_seen} interrupted a write; {restored} entries restored");
}

/// Restored arrays hold the file's mapping only as long as MLX needs it
/// (the release callback runs): nothing stays mapped once the KV is gone.
#[cfg(target_os = "linux")]
#[test]
fn a_restore_releases_the_mapping() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = seq(1, 100);
    let ssd = open(dir.path(), identity("m", "t", D), BIG, false);
    write(&ssd, &tokens);
    let path = ssd.store.lock().unwrap().entries()[0].path.clone();
    let file = path.to_string_lossy().into_owned();
    let mapped = || {
        std::fs::read_to_string("/proc/self/maps")
            .unwrap()
            .lines()
            .any(|l| l.ends_with(&*file))
    };
    let r = ssd.restore("ns", &tokens).unwrap();
    assert!(holds(&r.kv, &tokens, 99, D));
    drop(r);
    assert!(
        !mapped(),
        "the entry file is still mapped after its KV was dropped"
    );
}

#[test]
fn one_server_per_directory() {
    let dir = tempfile::tempdir().unwrap();
    let first = open(dir.path(), identity("m", "t", D), BIG, false);
    let config = SsdConfig {
        dir: dir.path().to_path_buf(),
        max_bytes: BIG,
        verify: false,
    };
    let second = SsdCache::open(&config, identity("m", "t", D));
    assert!(matches!(
        second,
        Err(SsdError::Dir {
            source: store::OpenError::Busy,
            ..
        })
    ));
    drop(first);
    assert!(SsdCache::open(&config, identity("m", "t", D)).is_ok());
}

#[cfg(unix)]
#[test]
fn a_directory_others_can_write_is_refused_and_special_files_are_skipped() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("cache");
    drop(open(&root, identity("m", "t", D), BIG, false));
    std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o777)).unwrap();
    let config = SsdConfig {
        dir: root.clone(),
        max_bytes: BIG,
        verify: false,
    };
    assert!(matches!(
        SsdCache::open(&config, identity("m", "t", D)),
        Err(SsdError::Dir {
            source: store::OpenError::Unsafe(_),
            ..
        })
    ));
    std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o700)).unwrap();
    // Our subdirectories are made private again.
    std::fs::set_permissions(root.join("v1"), std::fs::Permissions::from_mode(0o755)).unwrap();
    // A FIFO where an entry would be must not block the start.
    let key_dir = root.join("v1").join("0123456789abcdef0123456789abcdef");
    std::fs::create_dir(&key_dir).unwrap();
    let status = std::process::Command::new("mkfifo")
        .arg(key_dir.join("pipe.kv"))
        .status()
        .unwrap();
    assert!(status.success());
    let ssd = open(&root, identity("m", "t", D), BIG, false);
    assert_eq!(ssd.stats_handle("ns").stats().quarantined, 1);
    assert_eq!(permission_bits(&root.join("v1")), 0o700);
}

#[test]
fn an_entry_larger_than_the_cap_is_not_written() {
    let dir = tempfile::tempdir().unwrap();
    let small = seq(1, 10);
    let ssd = open(dir.path(), identity("m", "t", D), 2 << 20, false);
    write(&ssd, &small);
    // 2,000 positions of 2 layers x 2 heads x 64 x f32 x (K, V): 4 MiB.
    write(&ssd, &seq(100, 2000));
    let s = ssd.stats_handle("ns").stats();
    assert_eq!((s.writes, s.entries, s.evictions), (1, 1, 0));
    assert!(ssd.restore("ns", &small).is_some());
}

/// A cache whose layer 0 is a sliding-window layer (window `w`) and layer 1
/// full, fed `tokens` one at a time (so the window layer drops positions);
/// each position's values are `value(token, ...)` as in [`kv_for`].
fn windowed_kv_for(tokens: &[u32], w: usize, head_dim: usize) -> KvCache {
    let kinds = [LayerKind::SlidingWindow { window: w }, LayerKind::Full];
    let mut kv = KvCache::with_kinds(&kinds);
    let shape = [1, HEADS as i32, 1, head_dim as i32];
    for t in tokens {
        for layer in 0..LAYERS {
            let k = Array::from_slice(&tensor(&[*t], layer, 0, head_dim), &shape);
            let v = Array::from_slice(&tensor(&[*t], layer, 1, head_dim), &shape);
            kv.update(layer, &k, &v).unwrap();
        }
        kv.advance(1);
    }
    kv
}

#[test]
fn a_sliding_window_entry_restores_what_its_layers_kept_and_trims_only_within_its_margin() {
    let dir = tempfile::tempdir().unwrap();
    let w = 16;
    let kinds = vec![LayerKind::SlidingWindow { window: w }, LayerKind::Full];
    let windowed = |model: &str| ModelIdentity {
        geometry: KvGeometry {
            kinds: kinds.clone(),
            ..identity(model, "t", 8).geometry
        },
        ..identity(model, "t", 8)
    };
    let n = KvCache::ROLLBACK + 3 * KvCache::STEP + 40;
    let tokens = seq(5, n);
    let kv = windowed_kv_for(&tokens, w, 8);
    let start = kv.layer_start(0);
    let min = kv.min_resume();
    assert!(start > 0 && min < n);
    {
        let ssd = open(dir.path(), windowed("m"), BIG, false);
        ssd.submit("ns", &tokens, &kv).unwrap();
        assert!(ssd.flush(Duration::from_secs(30)));
    }
    let ssd = open(dir.path(), windowed("m"), BIG, true);
    // Resent with one more token: everything restored; the window layer
    // holds exactly its kept positions, the full layer all of them.
    let mut prompt = tokens.clone();
    prompt.push(9);
    let r = ssd.restore("ns", &prompt).unwrap();
    assert_eq!(r.reused, n);
    assert_eq!((r.kv.layer_start(0), r.kv.layer_start(1)), (start, 0));
    let buffers = r.kv.layer_buffers();
    let (k0, _) = buffers[0].unwrap();
    let got = k0
        .index((.., .., ..(n - start) as i32, ..))
        .contiguous()
        .unwrap();
    assert_eq!(
        got.as_slice::<f32>(),
        &tensor(&tokens[start..], 0, 0, 8)[..]
    );
    // A prefix inside the rollback margin is a hit; one further back is not
    // (the window layer no longer holds what it would need).
    let mut inside = tokens[..min + 2].to_vec();
    inside.extend([7, 7]);
    assert_eq!(ssd.peek("ns", &inside), min + 2);
    let mut outside = tokens[..min - 1].to_vec();
    outside.extend([7, 7]);
    assert_eq!(ssd.peek("ns", &outside), 0);
    assert!(ssd.restore("ns", &outside).is_none());
    // A model whose layers are all full never reads the entry.
    drop(ssd);
    let full = open(dir.path(), identity("m", "t", 8), BIG, false);
    assert_eq!(full.peek("ns", &prompt), 0);
}

/// A quantized cache (`--kv-bits`) round-trips through a restart: its
/// packed rows come back bit for bit, in its scheme; a tier opened under
/// another scheme (or float) never restores it, and quarantines nothing.
#[test]
fn quantized_entries_restore_only_under_their_scheme() {
    use crate::cache::KvQuant;
    let dir = tempfile::tempdir().unwrap();
    let tokens = seq(3, 300);
    let q8 = KvQuant::new(8, 64).ok();
    let with = |quant: Option<KvQuant>| ModelIdentity {
        geometry: KvGeometry {
            quant,
            ..identity("m", "t", D).geometry
        },
        ..identity("m", "t", D)
    };
    let quantized = |tokens: &[u32]| {
        let mut kv = KvCache::new(LAYERS).with_quant(q8);
        let shape = [1, HEADS as i32, tokens.len() as i32, D as i32];
        for layer in 0..LAYERS {
            let k = Array::from_slice(&tensor(tokens, layer, 0, D), &shape);
            let v = Array::from_slice(&tensor(tokens, layer, 1, D), &shape);
            kv.update(layer, &k, &v).unwrap();
        }
        kv.advance(tokens.len());
        kv
    };
    let kv = quantized(&tokens);
    {
        let ssd = open(dir.path(), with(q8), BIG, false);
        ssd.submit("ns", &tokens, &kv).unwrap();
        assert!(ssd.flush(Duration::from_secs(30)));
        assert_eq!(ssd.stats_handle("ns").stats().writes, 1);
    }
    for other in [None, KvQuant::new(4, 64).ok(), KvQuant::new(8, 32).ok()] {
        let ssd = open(dir.path(), with(other), BIG, true);
        assert!(ssd.restore("ns", &tokens).is_none(), "{other:?}");
        let stats = ssd.stats_handle("ns").stats();
        assert_eq!(stats.quarantined, 0, "{other:?}: {stats:?}");
    }
    let ssd = open(dir.path(), with(q8), BIG, true);
    let r = ssd
        .restore("ns", &tokens[..200])
        .expect("restores under its scheme");
    assert_eq!((r.reused, r.kv.quant()), (199, q8));
    for (got, want) in r.kv.layer_buffers().iter().zip(kv.layer_buffers()) {
        let ((gk, _), (wk, _)) = (got.unwrap(), want.unwrap());
        assert_eq!(gk.dtype(), mlx_rs::Dtype::Uint32);
        let n = 199;
        let g = gk.index((.., .., ..n, ..)).contiguous().unwrap();
        let w = wk.index((.., .., ..n, ..)).contiguous().unwrap();
        assert_eq!(g.as_slice::<u32>(), w.as_slice::<u32>());
    }
}

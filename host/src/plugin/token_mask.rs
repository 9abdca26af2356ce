//! Applying a constraint plugin's token bitset (WIT 0.3.0
//! `constraint.session.mask`) to a row's logits: tokens whose bit is clear
//! become -inf, the others keep their logit.
//!
//! The bitset is `ceil(V / 32)` words, bit `i % 32` of word `i / 32` for
//! token `i` (llguidance's and toktrie's layout). On a GPU backend the
//! words go to the device as they are (19 KB for Qwen's 152k ids, not a
//! 152k-entry mask) and are expanded there: each id's word is gathered and
//! tested against its bit (two constant `[V]` index arrays built once per
//! vocabulary size). On the CPU backend the device is this memory, and
//! MLX's CPU ops cost a vocabulary-wide pass each, so the words are
//! expanded here in one pass into a byte mask and one `select` applies it.

use std::cell::RefCell;

use mlx_rs::error::{Exception, Result};
use mlx_rs::{ops, Array, Dtype, StreamOrDevice};

use super::device_ops::{neg_inf, vocab};

/// Words a bitset over `vocab` ids needs.
pub fn words_for(vocab: usize) -> usize {
    vocab.div_ceil(32)
}

/// Whether id `i` is set in `words` (missing words are clear).
pub fn is_set(words: &[u32], i: usize) -> bool {
    words
        .get(i / 32)
        .is_some_and(|w| w & (1u32 << (i % 32)) != 0)
}

/// `logits` (`[V]`) with every id whose bit is clear set to -inf.
pub fn apply(logits: &Array, words: &[u32]) -> Result<Array> {
    if crate::runtime::gpu_available() {
        apply_on_device(logits, words)
    } else {
        apply_expanded(logits, words)
    }
}

/// The CPU path: one host pass to a byte mask, one select.
pub fn apply_expanded(logits: &Array, words: &[u32]) -> Result<Array> {
    let v = vocab(logits);
    let mut mask = vec![false; v];
    for (w, &word) in words.iter().enumerate().take(words_for(v)) {
        if word == 0 {
            continue;
        }
        let base = w * 32;
        for (bit, slot) in mask[base..(base + 32).min(v)].iter_mut().enumerate() {
            *slot = word & (1u32 << bit) != 0;
        }
    }
    let mask = Array::from_slice(&mask, &[v as i32]);
    ops::select(&mask, logits, neg_inf())
}

thread_local! {
    /// Per vocabulary size: each id's word index and its bit's value, as
    /// device arrays (built once; the engine thread is the only user).
    static INDEX: RefCell<Option<(usize, Array, Array)>> = const { RefCell::new(None) };
}

/// `(word index, bit value)` `[V]` uint32 arrays for `v` ids.
fn index_arrays(v: usize) -> (Array, Array) {
    INDEX.with(|cell| {
        let mut cell = cell.borrow_mut();
        if let Some((n, w, b)) = cell.as_ref() {
            if *n == v {
                return (w.clone(), b.clone());
            }
        }
        let word: Vec<u32> = (0..v as u32).map(|i| i / 32).collect();
        let bit: Vec<u32> = (0..v as u32).map(|i| 1u32 << (i % 32)).collect();
        let w = Array::from_slice(&word, &[v as i32]);
        let b = Array::from_slice(&bit, &[v as i32]);
        *cell = Some((v, w.clone(), b.clone()));
        (w, b)
    })
}

/// The GPU path: the words uploaded as they are, expanded on the device.
pub fn apply_on_device(logits: &Array, words: &[u32]) -> Result<Array> {
    let v = vocab(logits);
    let n = words_for(v);
    let mut padded: Vec<u32> = words.iter().copied().take(n).collect();
    padded.resize(n, 0);
    let words = Array::from_slice(&padded, &[n as i32]);
    let (word_index, bit) = index_arrays(v);
    let per_id = words.take_axis(&word_index, 0)?;
    let zero = Array::from_int(0).as_dtype(Dtype::Uint32)?;
    let on = ops::ne(&bitwise_and(&per_id, &bit)?, &zero)?;
    ops::select(&on, logits, neg_inf())
}

/// `a & b`, elementwise (mlx-rs has no wrapper for MLX's `bitwise_and`).
fn bitwise_and(a: &Array, b: &Array) -> Result<Array> {
    let stream = StreamOrDevice::default();
    // SAFETY: `a` and `b` are borrowed for the call; the output handle is
    // fresh and taken over by the returned `Array` either way.
    unsafe {
        crate::native_op::build_one(
            |out| mlx_sys::mlx_bitwise_and(out, a.as_ptr(), b.as_ptr(), stream.as_ref().as_ptr()),
            || "bitwise_and rejected its inputs".to_string(),
        )
    }
    .map_err(|e: Exception| e)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bits(ids: &[usize], v: usize) -> Vec<u32> {
        let mut w = vec![0u32; words_for(v)];
        for &i in ids {
            w[i / 32] |= 1 << (i % 32);
        }
        w
    }

    fn finite(a: &Array) -> Vec<usize> {
        a.eval().expect("eval");
        a.as_slice::<f32>()
            .iter()
            .enumerate()
            .filter(|(_, x)| x.is_finite())
            .map(|(i, _)| i)
            .collect()
    }

    #[test]
    fn both_paths_keep_exactly_the_set_ids() {
        let v = 70;
        let logits = Array::from_slice(&(0..v).map(|i| i as f32).collect::<Vec<_>>(), &[v as i32]);
        let ids = [0, 5, 31, 32, 63, 64, 69];
        let words = bits(&ids, v);
        for masked in [
            apply_expanded(&logits, &words).expect("cpu"),
            apply_on_device(&logits, &words).expect("device"),
        ] {
            assert_eq!(finite(&masked), ids);
            assert_eq!(masked.as_slice::<f32>()[64], 64.0);
        }
    }

    #[test]
    fn missing_words_allow_nothing_and_extra_words_are_ignored() {
        let v = 40;
        let logits = Array::from_slice(&vec![1.0f32; v], &[v as i32]);
        let short = vec![u32::MAX]; // ids 0..32 only
        let long = vec![0, 1, u32::MAX, u32::MAX]; // id 32 only; beyond V ignored
        for apply in [apply_expanded, apply_on_device] {
            assert_eq!(
                finite(&apply(&logits, &short).expect("short")),
                (0..32).collect::<Vec<_>>()
            );
            assert_eq!(finite(&apply(&logits, &long).expect("long")), vec![32]);
        }
        assert!(is_set(&long, 32) && !is_set(&long, 33) && !is_set(&long, 1000));
    }
}

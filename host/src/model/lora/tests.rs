use std::collections::HashMap;
use std::path::PathBuf;

use mlx_rs::{ops::indexing::IndexOp, random, Array, Dtype};

use super::*;

fn targets(layers: usize) -> LoraTargets {
    let layer: HashMap<Module, (i32, i32)> = [
        (Module::Q, (8, 8)),
        (Module::K, (8, 4)),
        (Module::V, (8, 4)),
        (Module::O, (8, 8)),
        (Module::Gate, (8, 12)),
        (Module::Up, (8, 12)),
        (Module::Down, (12, 8)),
    ]
    .into();
    LoraTargets {
        layers: vec![layer; layers],
        dtype: Dtype::Float32,
    }
}

fn normal(shape: &[i32], key: u64) -> Array {
    let k = random::key(key).expect("key");
    random::normal::<f32>(shape, None, None, &k).expect("normal")
}

fn part(layer: usize, module: Module, d_in: i32, r: i32, d_out: i32, key: u64) -> LoraPart {
    LoraPart {
        layer,
        module,
        a: normal(&[d_in, r], key),
        b: normal(&[r, d_out], key + 1000),
        scale: 0.5,
        names: (
            format!("{}.a", module.path()),
            format!("{}.b", module.path()),
        ),
    }
}

fn raw(parts: Vec<LoraPart>) -> RawAdapter {
    RawAdapter {
        format: "mlx",
        parts,
        path: PathBuf::from("/nowhere"),
    }
}

fn values(a: &Array) -> Vec<f32> {
    let a = a.as_dtype(Dtype::Float32).expect("cast");
    a.eval().expect("eval");
    a.as_slice::<f32>().to_vec()
}

fn close(a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() < 1e-4, "[{i}] {x} vs {y}");
    }
}

#[test]
fn module_names_parse_both_spellings() {
    assert_eq!(Module::parse("self_attn.q_proj"), Some(Module::Q));
    assert_eq!(Module::parse("down_proj"), Some(Module::Down));
    assert_eq!(Module::parse("lm_head"), None);
}

#[test]
fn shapes_that_do_not_fit_name_the_tensor() {
    let t = targets(2);
    let e = LoraAdapter::build("x", raw(vec![part(0, Module::K, 8, 2, 8, 1)]), &t)
        .expect_err("k_proj gives 4 outputs");
    let msg = e.to_string();
    assert!(
        msg.contains("self_attn.k_proj.b") && msg.contains("[2, 4]"),
        "{msg}"
    );
    let e = LoraAdapter::build("x", raw(vec![part(0, Module::Down, 8, 2, 8, 1)]), &t)
        .expect_err("down_proj takes 12 inputs");
    assert!(e.to_string().contains("mlp.down_proj.a"), "{e}");
    let e = LoraAdapter::build("x", raw(vec![part(5, Module::Q, 8, 2, 8, 1)]), &t)
        .expect_err("layer 5 of 2");
    assert!(e.to_string().contains("layer 5"), "{e}");
}

/// The joined q/k/v delta equals each module's `x @ A @ B * scale` at
/// its own columns, and nothing where no module is adapted.
#[test]
fn joined_slots_equal_each_module_alone() {
    let t = targets(1);
    let (q, v) = (
        part(0, Module::Q, 8, 2, 8, 1),
        part(0, Module::V, 8, 3, 4, 2),
    );
    let x = normal(&[3, 8], 9);
    let expect = |p: &LoraPart| {
        values(
            &ops::multiply(
                ops::matmul(ops::matmul(&x, &p.a).expect("xa"), &p.b).expect("xab"),
                Array::from_f32(p.scale),
            )
            .expect("scale"),
        )
    };
    let (eq, ev) = (expect(&q), expect(&v));
    let a = LoraAdapter::build("x", raw(vec![q, v]), &t).expect("build");
    let step = StepLora::new(&[Some(&a)], &[3]).expect("plan");
    let d = values(
        &step
            .delta(0, Slot::Qkv, &x)
            .expect("delta")
            .expect("adapted"),
    );
    // [3, 16]: q at 0..8, k (not adapted) at 8..12, v at 12..16.
    for r in 0..3 {
        close(&d[r * 16..r * 16 + 8], &eq[r * 8..r * 8 + 8]);
        close(&d[r * 16 + 8..r * 16 + 12], &[0.0; 4]);
        close(&d[r * 16 + 12..r * 16 + 16], &ev[r * 4..r * 4 + 4]);
    }
    assert!(step.delta(0, Slot::O, &x).expect("o").is_none());
}

/// Rows of two adapters (different ranks) and a base row in one step get
/// the deltas each gets alone.
#[test]
fn mixed_rows_equal_each_alone() {
    let t = targets(2);
    let a = LoraAdapter::build("a", raw(vec![part(1, Module::O, 8, 2, 8, 1)]), &t).expect("a");
    let b = LoraAdapter::build(
        "b",
        raw(vec![
            part(1, Module::O, 8, 5, 8, 3),
            part(0, Module::Q, 8, 5, 8, 4),
        ]),
        &t,
    )
    .expect("b");
    let x = normal(&[6, 8], 7);
    let lens = [2usize, 1, 3];
    let step = StepLora::new(&[Some(&a), None, Some(&b)], &lens).expect("plan");
    let mixed = values(&step.delta(1, Slot::O, &x).expect("o").expect("adapted"));
    let alone = |ad: &LoraAdapter, from: i32, to: i32| {
        let xs = x.index(from..to);
        let s = StepLora::new(&[Some(ad)], &[(to - from) as usize]).expect("plan");
        values(&s.delta(1, Slot::O, &xs).expect("o").expect("adapted"))
    };
    close(&mixed[0..16], &alone(&a, 0, 2));
    close(&mixed[16..24], &[0.0; 8]);
    close(&mixed[24..48], &alone(&b, 3, 6));
    // Layer 0's q/k/v: only b adapts it.
    let q = values(&step.delta(0, Slot::Qkv, &x).expect("qkv").expect("adapted"));
    close(&q[0..48], &[0.0; 48]);
    assert!(q[48..].iter().any(|v| v.abs() > 1e-3));
}

#[test]
fn no_adapter_rows_plan_nothing() {
    assert!(StepLora::new(&[None, None], &[1, 4]).is_none());
}

#[test]
fn namespaces_differ_by_adapter_content() {
    let t = targets(1);
    let a = LoraAdapter::build("a", raw(vec![part(0, Module::O, 8, 2, 8, 1)]), &t).expect("a");
    let same =
        LoraAdapter::build("renamed", raw(vec![part(0, Module::O, 8, 2, 8, 1)]), &t).expect("same");
    let other =
        LoraAdapter::build("a", raw(vec![part(0, Module::O, 8, 2, 8, 2)]), &t).expect("other");
    assert_eq!(namespace("Float32", None), "Float32");
    assert_eq!(
        namespace("Float32", Some(&a)),
        namespace("Float32", Some(&same))
    );
    assert_ne!(
        namespace("Float32", Some(&a)),
        namespace("Float32", Some(&other))
    );
    assert_ne!(namespace("Float32", Some(&a)), "Float32");
}

/// The fused decode op's packed parts (float16, no zero blocks) give the
/// block-diagonal pair's delta: an adapter of q and v only reads no k
/// columns, and values far outside float16's range survive the power-of-two
/// factors.
#[test]
fn packed_parts_equal_the_block_diagonal_pair() {
    let t = targets(1);
    let mut q = part(0, Module::Q, 8, 2, 8, 1);
    // Far past float16's largest (65504) and smallest normal (6e-5).
    q.b = ops::multiply(&q.b, Array::from_f32(1e6)).expect("scale");
    let mut v = part(0, Module::V, 8, 3, 4, 2);
    v.a = ops::multiply(&v.a, Array::from_f32(1e-7)).expect("scale");
    let adapter = LoraAdapter::build("x", raw(vec![q, v]), &t).expect("build");
    let pair = adapter.pair(0, Slot::Qkv).expect("qkv");
    let packed = &pair.packed;
    let spans: Vec<(i32, i32, i32, i32)> = packed
        .parts
        .iter()
        .map(|p| (p.rank_offset, p.rank, p.out_offset, p.width))
        .collect();
    assert_eq!(spans, [(0, 2, 0, 8), (2, 3, 12, 4)]);
    assert_eq!(packed.a.dtype(), Dtype::Float16);
    assert_eq!(packed.b.dtype(), Dtype::Float16);
    assert_eq!(packed.b.size(), 2 * 8 + 3 * 4, "no zero blocks");
    // x @ (A @ B) from the packed parts against the block-diagonal pair.
    let x = normal(&[3, 8], 7);
    let want = values(&ops::matmul(ops::matmul(&x, &pair.a).expect("xa"), &pair.b).expect("xab"));
    let a = packed.a.as_dtype(Dtype::Float32).expect("a");
    let b = packed.b.as_dtype(Dtype::Float32).expect("b");
    let mut b_at = 0;
    for p in &packed.parts {
        let ap = a.index((.., p.rank_offset..p.rank_offset + p.rank));
        let bp = b
            .index(b_at..b_at + p.rank * p.width)
            .reshape(&[p.rank, p.width])
            .expect("reshape");
        b_at += p.rank * p.width;
        let d = ops::multiply(
            ops::matmul(ops::matmul(&x, &ap).expect("xa"), &bp).expect("xab"),
            Array::from_f32(p.scale),
        )
        .expect("scale");
        let d = values(&d);
        let cols = |row: usize| {
            row * 16 + p.out_offset as usize..row * 16 + (p.out_offset + p.width) as usize
        };
        // float16's 11-bit mantissa: within 2^-9 of the part's largest value
        // (the parts' magnitudes differ by 13 orders).
        let largest = (0..3)
            .flat_map(|row| want[cols(row)].to_vec())
            .fold(0f32, |m, x| m.max(x.abs()));
        assert!(largest > 0.0);
        for row in 0..3 {
            for (c, (g, w)) in d[row * p.width as usize..][..p.width as usize]
                .iter()
                .zip(&want[cols(row)])
                .enumerate()
            {
                assert!(
                    (g - w).abs() <= 2e-3 * largest,
                    "row {row}, part at {}, column {c}: {g} vs {w}",
                    p.out_offset
                );
            }
        }
    }
}

//! How many MLX primitives an evaluation would run, by kind
//! (`native/graph_census.cpp`). On a GPU backend each primitive is one
//! kernel to encode and launch (views of contiguous inputs excepted), and a
//! small model's decode step is bound by that host work, not by the device:
//! `mlxhost bench` reports the decode step's census beside its time.

use std::collections::BTreeMap;

use mlx_rs::{error::Exception, Array};

/// Primitives of an unevaluated graph.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct GraphCensus {
    /// Distinct primitives (a multi-output primitive counts once).
    pub total: usize,
    /// Primitives per kind (MLX's primitive names, e.g. `QuantizedMatmul`).
    pub by_kind: BTreeMap<String, usize>,
}

/// The census of everything `arrays` still depend on (evaluated arrays and
/// their inputs are not counted). Errors: MLX's, reported by the native
/// helper.
pub fn graph_census(arrays: &[&Array]) -> Result<GraphCensus, Exception> {
    let handles: Vec<mlx_sys::mlx_array> = arrays.iter().map(|a| a.as_ptr()).collect();
    let mut buf = vec![0u8; 16 * 1024];
    // SAFETY: the handles are borrowed for the call; `buf` is writable for
    // its length and the helper NUL-terminates within it.
    let total = unsafe {
        mlx_sys::mlxhost_graph_census(
            handles.as_ptr(),
            handles.len() as i32,
            buf.as_mut_ptr().cast(),
            buf.len() as i32,
        )
    };
    if total < 0 {
        return Err(Exception::custom("graph census failed"));
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let text = String::from_utf8_lossy(&buf[..end]);
    let by_kind = text
        .lines()
        .filter_map(|line| {
            let (name, n) = line.rsplit_once(' ')?;
            Some((name.to_string(), n.parse().ok()?))
        })
        .collect();
    Ok(GraphCensus {
        total: total as usize,
        by_kind,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::{ops, transforms::eval};

    #[test]
    fn counts_unevaluated_primitives_once_each() {
        let a = Array::from_slice(&[1.0f32, 2.0, 3.0], &[3]);
        let b = ops::add(&a, &a).unwrap();
        let c = ops::multiply(&b, &b).unwrap();
        let d = ops::add(&c, &b).unwrap();
        let census = graph_census(&[&d, &c]).unwrap();
        assert_eq!(census.total, 3);
        assert_eq!(census.by_kind.get("Add"), Some(&2));
        assert_eq!(census.by_kind.get("Multiply"), Some(&1));
        eval([&b]).unwrap();
        let after = graph_census(&[&d]).unwrap();
        assert_eq!(after.total, 2, "an evaluated input is not counted");
    }
}

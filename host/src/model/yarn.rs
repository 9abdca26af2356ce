//! YaRN RoPE scaling (`rope_scaling.rope_type: "yarn"`, gpt-oss's) as
//! mlx-lm 0.32.2's `YarnRoPE` (`models/rope_utils.py`) computes it: each
//! pair's period blends the original (`base^(2i/D)`, extrapolated) and the
//! one stretched by `factor` (interpolated) along a linear ramp between
//! the dimensions that rotate `beta_fast` and `beta_slow` times over the
//! original context, and queries and keys are multiplied by
//! `mscale = (0.1 mscale ln(factor) + 1) / (0.1 mscale_all_dim ln(factor) + 1)`
//! before the rotation.
//!
//! mlx-lm ignores Hugging Face's `truncate` field (it always floors and
//! ceils the correction range); so does this.

use mlx_rs::{ops, Array};
use serde_json::Value;

use super::error::Result;

/// The fields of a `yarn` `rope_scaling` (mlx-lm's defaults where absent,
/// except `factor`, which it requires).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct YarnParams {
    /// How much longer the context is than `original_max_position_embeddings`.
    pub factor: f64,
    /// The context the model was pre-trained at (default 4096).
    pub original_max_position_embeddings: f64,
    /// Rotations over the original context above which a pair keeps its
    /// original period (default 32).
    pub beta_fast: f64,
    /// Rotations below which a pair is fully interpolated (default 1).
    pub beta_slow: f64,
    /// Default 1.
    pub mscale: f64,
    /// Default 0.
    pub mscale_all_dim: f64,
}

/// A YaRN RoPE ready to apply.
#[derive(Debug, Clone)]
pub struct Yarn {
    /// Per-pair periods `[D/2]` (position / period is the angle), as
    /// mx.fast.rope's `freqs` takes them.
    pub periods: Array,
    /// Multiplier of queries and keys before the rotation.
    pub mscale: f32,
}

impl YarnParams {
    /// Reads a `rope_scaling` object of type `yarn`.
    ///
    /// Errors (naming the field): no positive `factor`, or a field that is
    /// not a number.
    pub fn from_scaling(scaling: &Value) -> Result<YarnParams, String> {
        let num = |key: &str, default: Option<f64>| -> Result<f64, String> {
            match scaling.get(key) {
                None | Some(Value::Null) => {
                    default.ok_or_else(|| format!("`rope_scaling.{key}` is required for yarn"))
                }
                Some(v) => v
                    .as_f64()
                    .ok_or_else(|| format!("`rope_scaling.{key}` must be a number")),
            }
        };
        let p = YarnParams {
            factor: num("factor", None)?,
            original_max_position_embeddings: num(
                "original_max_position_embeddings",
                Some(4096.0),
            )?,
            beta_fast: num("beta_fast", Some(32.0))?,
            beta_slow: num("beta_slow", Some(1.0))?,
            mscale: num("mscale", Some(1.0))?,
            mscale_all_dim: num("mscale_all_dim", Some(0.0))?,
        };
        if p.factor <= 0.0 || p.original_max_position_embeddings <= 0.0 {
            return Err(
                "`rope_scaling.factor` and `original_max_position_embeddings` must be positive"
                    .into(),
            );
        }
        if p.beta_fast <= 0.0 || p.beta_slow <= 0.0 {
            return Err("`rope_scaling.beta_fast` and `beta_slow` must be positive".into());
        }
        Ok(p)
    }

    /// The dimension whose pair rotates `rotations` times over the
    /// original context (mlx-lm's `yarn_find_correction_dim`).
    fn correction_dim(&self, dims: usize, base: f64, rotations: f64) -> f64 {
        let ctx = self.original_max_position_embeddings;
        dims as f64 * (ctx / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
    }

    /// mlx-lm's `yarn_get_mscale`.
    fn get_mscale(&self, m: f64) -> f64 {
        if self.factor <= 1.0 {
            1.0
        } else {
            0.1 * m * self.factor.ln() + 1.0
        }
    }

    /// The RoPE of a `dims`-wide head with base `base`, computed op for op
    /// as mlx-lm does (float32 arrays, Python floats for the scalars), so
    /// the periods round as its do.
    pub fn rope(&self, dims: usize, base: f32) -> Result<Yarn> {
        let b = base as f64;
        let low = self
            .correction_dim(dims, b, self.beta_fast)
            .floor()
            .max(0.0);
        let high = self
            .correction_dim(dims, b, self.beta_slow)
            .ceil()
            .min(dims as f64 - 1.0);
        // mlx-lm nudges an empty ramp open to avoid dividing by zero.
        let high = if low == high { high + 0.001 } else { high };
        let ramp = ops::clip(
            ops::divide(
                ops::subtract(
                    ops::arange::<_, f32>(0.0, (dims / 2) as f32, 1.0)?,
                    Array::from_f32(low as f32),
                )?,
                Array::from_f32((high - low) as f32),
            )?,
            (0.0f32, 1.0f32),
        )?;
        let mask = ops::subtract(Array::from_f32(1.0), &ramp)?;
        let extra = ops::power(
            Array::from_f32(base),
            ops::divide(
                ops::arange::<_, f32>(0.0, dims as f32, 2.0)?,
                Array::from_f32(dims as f32),
            )?,
        )?;
        let inter = ops::multiply(Array::from_f32(self.factor as f32), &extra)?;
        let periods = ops::divide(
            ops::multiply(&inter, &extra)?,
            ops::add(
                ops::multiply(&inter, &mask)?,
                ops::multiply(&extra, ops::subtract(Array::from_f32(1.0), &mask)?)?,
            )?,
        )?;
        let mscale = self.get_mscale(self.mscale) / self.get_mscale(self.mscale_all_dim);
        Ok(Yarn {
            periods,
            mscale: mscale as f32,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// gpt-oss-20b's `rope_scaling`.
    fn gpt_oss() -> Value {
        serde_json::json!({"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                           "original_max_position_embeddings": 4096, "rope_type": "yarn",
                           "truncate": false})
    }

    #[test]
    fn blends_original_and_stretched_periods_along_the_ramp() -> Result<()> {
        let p = YarnParams::from_scaling(&gpt_oss()).expect("valid");
        // Head width 16, base 150000: the correction range is 2..5 of 8
        // pairs (computed by hand from mlx-lm's formulas).
        let y = p.rope(16, 150_000.0)?;
        let got = y.periods.as_slice::<f32>().to_vec();
        assert_eq!(got.len(), 8);
        for (i, &g) in got.iter().enumerate() {
            let original = 150_000f64.powf(2.0 * i as f64 / 16.0);
            let ramp = ((i as f64 - 2.0) / 3.0).clamp(0.0, 1.0);
            // Pairs below the range keep their period, those above it are
            // stretched 32 times, those between blend (harmonically).
            let mask = 1.0 - ramp;
            let inter = 32.0 * original;
            let want = inter * original / (inter * mask + original * (1.0 - mask));
            assert!(
                ((g as f64) - want).abs() <= want * 1e-5,
                "pair {i}: {g} vs {want}"
            );
        }
        assert!(
            (got[0] - 1.0).abs() < 1e-6
                && (got[7] as f64 / 150_000f64.powf(14.0 / 16.0) - 32.0).abs() < 1e-3
        );
        // mscale = 0.1 ln 32 + 1.
        assert!((y.mscale as f64 - (0.1 * 32f64.ln() + 1.0)).abs() < 1e-6);
        Ok(())
    }

    #[test]
    fn missing_factor_and_bad_fields_are_named() {
        let err = YarnParams::from_scaling(&serde_json::json!({"rope_type": "yarn"})).unwrap_err();
        assert!(err.contains("rope_scaling.factor"), "{err}");
        let mut bad = gpt_oss();
        bad["beta_fast"] = serde_json::json!("fast");
        let err = YarnParams::from_scaling(&bad).unwrap_err();
        assert!(err.contains("rope_scaling.beta_fast"), "{err}");
    }
}

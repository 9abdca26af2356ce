//! LoRA adapters: low-rank deltas `x @ A @ B * scale` added beside a base
//! model's linear products, chosen per row, never merged into the shared
//! weights (so rows with different adapters, and rows with none, share one
//! forward).
//!
//! - [`mlx`]: mlx-lm's adapter folder (`adapters.safetensors`,
//!   `adapter_config.json` with `lora_parameters`);
//! - [`peft`]: PEFT's (`adapter_model.safetensors`, `adapter_config.json`
//!   with `r`, `lora_alpha`, `target_modules`);
//! - [`registry`]: a folder of adapters (`--lora-dir`), reloaded when it
//!   changes;
//! - [`StepLora`]: one step's rows' adapters, applied to a packed `[N, in]`
//!   activation: one adapter for every token is two products and an add; a
//!   mix goes through `gather_mm` over the step's adapters stacked (a zero
//!   slot for base rows), so the cost does not grow with the number of
//!   adapters.
//!
//! Both formats are read into [`LoraPart`]s (one module of one layer:
//! `A [in, r]`, `B [r, out]`, scale), checked against the base model's
//! [`LoraTargets`] (errors name the tensor), and built into a
//! [`LoraAdapter`]: per layer four slots in the layout the model computes
//! (q/k/v side by side, o, gate/up side by side, down), the scale folded
//! into B, in the model's activation dtype.

pub mod merge;
pub mod mlx;
pub mod peft;
pub mod registry;

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};

use mlx_rs::{ops, Array, Dtype};
use sha2::{Digest, Sha256};

pub use registry::{LoraInfo, LoraListing, LoraSet};

/// What can go wrong loading or applying an adapter. Messages name the
/// adapter folder and the tensor or field at fault.
#[derive(Debug, thiserror::Error)]
pub enum LoraError {
    /// A file is missing, unreadable or not what its format says.
    #[error("LoRA adapter {path}: {reason}")]
    InvalidFile {
        /// The file or folder.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A tensor does not fit the base model.
    #[error("LoRA adapter {adapter}: tensor `{tensor}`: {reason}")]
    Tensor {
        /// The adapter's name.
        adapter: String,
        /// The tensor's name as stored.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// The base model cannot run adapters.
    #[error("LoRA adapters are not supported for this model: {0}")]
    Unsupported(String),
    /// An MLX operation failed.
    #[error("MLX: {0}")]
    Mlx(#[from] mlx_rs::error::Exception),
}

impl LoraError {
    fn invalid(path: impl Into<PathBuf>, reason: impl std::fmt::Display) -> Self {
        LoraError::InvalidFile {
            path: path.into(),
            reason: reason.to_string(),
        }
    }
}

/// A projection an adapter may target, by its Hugging Face / mlx-lm name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Module {
    /// `self_attn.q_proj`.
    Q,
    /// `self_attn.k_proj`.
    K,
    /// `self_attn.v_proj`.
    V,
    /// `self_attn.o_proj`.
    O,
    /// `mlp.gate_proj`.
    Gate,
    /// `mlp.up_proj`.
    Up,
    /// `mlp.down_proj`.
    Down,
}

impl Module {
    /// Every module, in the model's order.
    pub const ALL: [Module; 7] = [
        Module::Q,
        Module::K,
        Module::V,
        Module::O,
        Module::Gate,
        Module::Up,
        Module::Down,
    ];

    /// The path inside a decoder layer (`self_attn.q_proj`).
    pub fn path(self) -> &'static str {
        match self {
            Module::Q => "self_attn.q_proj",
            Module::K => "self_attn.k_proj",
            Module::V => "self_attn.v_proj",
            Module::O => "self_attn.o_proj",
            Module::Gate => "mlp.gate_proj",
            Module::Up => "mlp.up_proj",
            Module::Down => "mlp.down_proj",
        }
    }

    /// The module a layer-relative path (`self_attn.q_proj`) or a bare
    /// name (`q_proj`, PEFT's `target_modules`) names.
    pub fn parse(name: &str) -> Option<Module> {
        Module::ALL
            .into_iter()
            .find(|m| m.path() == name || m.path().rsplit('.').next() == Some(name))
    }

    /// The slot the model computes it in, and its place among the slot's
    /// parts.
    fn slot(self) -> (Slot, usize) {
        match self {
            Module::Q => (Slot::Qkv, 0),
            Module::K => (Slot::Qkv, 1),
            Module::V => (Slot::Qkv, 2),
            Module::O => (Slot::O, 0),
            Module::Gate => (Slot::GateUp, 0),
            Module::Up => (Slot::GateUp, 1),
            Module::Down => (Slot::Down, 0),
        }
    }
}

/// A product of a decoder layer as the model computes it: q/k/v side by
/// side, o, gate/up side by side, down.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Slot {
    /// The fused q/k/v product.
    Qkv = 0,
    /// `o_proj`.
    O = 1,
    /// The fused gate/up product.
    GateUp = 2,
    /// `down_proj`.
    Down = 3,
}

/// The base model's adaptable products: per layer, each module's
/// `(in, out)` (absent: the layer has no such module, e.g. a
/// mixture-of-experts MLP).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraTargets {
    /// One map per decoder layer.
    pub layers: Vec<HashMap<Module, (i32, i32)>>,
    /// The activation dtype adapters compute in.
    pub dtype: Dtype,
}

/// One module of one layer, as a format stores it (already in mlx-lm's
/// orientation).
pub struct LoraPart {
    /// Decoder layer.
    pub layer: usize,
    /// Which projection.
    pub module: Module,
    /// `[in, r]`.
    pub a: Array,
    /// `[r, out]`.
    pub b: Array,
    /// The delta's factor.
    pub scale: f32,
    /// A's and B's names in the file (for errors).
    pub names: (String, String),
}

/// An adapter as read from its folder, before it is fitted to a model.
pub struct RawAdapter {
    /// Which format it came in.
    pub format: &'static str,
    /// Its modules.
    pub parts: Vec<LoraPart>,
    /// The folder.
    pub path: PathBuf,
}

/// One LoRA tensor of a format's file, recognized by that format: its
/// layer, module, whether it is A (else B), its name as stored and its
/// array in mlx-lm's orientation (A `[in, r]`, B `[r, out]`).
pub struct FoundTensor {
    /// Decoder layer.
    pub layer: usize,
    /// Which projection.
    pub module: Module,
    /// A (`lora_a`, `lora_A`), else B.
    pub is_a: bool,
    /// The name in the file (for errors).
    pub name: String,
    /// The array.
    pub array: Array,
}

/// Pairs each projection's A with its B into [`LoraPart`]s of `scale`, in
/// (layer, module) order. `path`: the weights file (for errors); `leaves`:
/// the format's names of A and B (`lora_a and lora_b`), for the message.
///
/// Errors: an A without its B or a B without its A (naming the tensor).
pub fn pair_parts(
    path: &Path,
    tensors: Vec<FoundTensor>,
    scale: f32,
    leaves: &str,
) -> Result<Vec<LoraPart>, LoraError> {
    type Half = Option<(String, Array)>;
    let mut pairs: std::collections::BTreeMap<(usize, Module), (Half, Half)> =
        std::collections::BTreeMap::new();
    for t in tensors {
        let entry = pairs.entry((t.layer, t.module)).or_default();
        let side = if t.is_a { &mut entry.0 } else { &mut entry.1 };
        *side = Some((t.name, t.array));
    }
    let mut parts = Vec::with_capacity(pairs.len());
    for ((layer, module), pair) in pairs {
        match pair {
            (Some((na, a)), Some((nb, b))) => parts.push(LoraPart {
                layer,
                module,
                a,
                b,
                scale,
                names: (na, nb),
            }),
            (Some((n, _)), None) | (None, Some((n, _))) => {
                return Err(LoraError::invalid(
                    path,
                    format!("tensor `{n}` has no partner (an adapted projection needs {leaves})"),
                ))
            }
            (None, None) => {}
        }
    }
    Ok(parts)
}

/// Reads the adapter in `dir`, in whichever format its files say.
///
/// Errors: neither format's files, or a file that does not parse.
pub fn read(dir: &Path) -> Result<RawAdapter, LoraError> {
    if dir.join(mlx::WEIGHTS).is_file() {
        mlx::read(dir)
    } else if dir.join(peft::WEIGHTS).is_file() {
        peft::read(dir)
    } else {
        Err(LoraError::invalid(
            dir,
            format!(
                "no `{}` (mlx-lm) or `{}` (PEFT) in the folder",
                mlx::WEIGHTS,
                peft::WEIGHTS
            ),
        ))
    }
}

/// A: `[in, r]`, B: `[r, out]` with the scale folded in (MLX's ops), and
/// the same parts as the fused CPU decode op reads them.
#[derive(Debug, Clone)]
pub struct LoraPair {
    /// `[in, r]`.
    pub a: Array,
    /// `[r, out]`, times the scale.
    pub b: Array,
    /// The same delta for [`crate::model::decode_layer`].
    pub packed: PackedPair,
}

/// One slot of an adapter as the fused CPU decode op reads it: float16
/// (half the bytes of float32; a batch-1 decode step is bound by the bytes
/// it reads) and without the zero blocks of [`LoraPair::b`] (an adapter of
/// q alone reads no k/v columns). The op sums in float32.
#[derive(Debug, Clone)]
pub struct PackedPair {
    /// `[in, sum of ranks]` float16: the parts' A side by side.
    pub a: Array,
    /// The parts' B `[rank, width]` float16, row-major, one after another
    /// (flat: `sum of rank * width` elements).
    pub b: Array,
    /// The parts, in A's column order (at most 3: q, k, v).
    pub parts: Vec<PackedPart>,
}

/// One module of a [`PackedPair`]: it adds `scale * (x @ A[:,
/// rank_offset..][..rank]) @ B_part` to output columns `out_offset ..
/// out_offset + width`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PackedPart {
    /// Its first column in A.
    pub rank_offset: i32,
    /// Its rank.
    pub rank: i32,
    /// Its first output column of the slot's product.
    pub out_offset: i32,
    /// Its output columns.
    pub width: i32,
    /// The adapter's scale times the powers of two [`to_half`] divided
    /// A and B by.
    pub scale: f32,
}

/// An adapter fitted to a model: per layer its four slots.
#[derive(Debug)]
pub struct LoraAdapter {
    /// Its name (the folder's name).
    pub name: String,
    /// `mlx` or `peft`.
    pub format: &'static str,
    /// The largest rank among its modules.
    pub rank: i32,
    /// The modules it adapts (for listings).
    pub modules: Vec<Module>,
    /// Content digest (tensors and scales): the prompt cache's namespace,
    /// so a changed adapter under the same name never reuses the old KV.
    pub fingerprint: String,
    /// Unique per load in this process.
    pub uid: u64,
    /// Per decoder layer, per [`Slot`].
    pub layers: Vec<[Option<LoraPair>; 4]>,
}

static NEXT_UID: AtomicU64 = AtomicU64::new(1);

impl LoraAdapter {
    /// Fits `raw` to the model: every part's layer, module and shapes
    /// checked against `targets` (errors name the tensor), q/k/v and
    /// gate/up joined into the model's fused layout, scales folded into B,
    /// everything cast to the activation dtype and evaluated.
    pub fn build(name: &str, raw: RawAdapter, targets: &LoraTargets) -> Result<Self, LoraError> {
        let bad = |tensor: &str, reason: String| LoraError::Tensor {
            adapter: name.to_string(),
            tensor: tensor.to_string(),
            reason,
        };
        let mut hasher = Sha256::new();
        let mut by_slot: HashMap<(usize, Slot), Vec<(usize, LoraPart)>> = HashMap::new();
        let mut rank = 0;
        let mut modules = Vec::new();
        let mut parts = raw.parts;
        parts.sort_by_key(|p| (p.layer, p.module));
        for p in parts {
            let Some(layer) = targets.layers.get(p.layer) else {
                return Err(bad(
                    &p.names.0,
                    format!(
                        "layer {} is past the model's {} layers",
                        p.layer,
                        targets.layers.len()
                    ),
                ));
            };
            let Some(&(d_in, d_out)) = layer.get(&p.module) else {
                return Err(bad(
                    &p.names.0,
                    format!(
                        "layer {} of the model has no `{}` to adapt",
                        p.layer,
                        p.module.path()
                    ),
                ));
            };
            let (sa, sb) = (p.a.shape().to_vec(), p.b.shape().to_vec());
            if sa.len() != 2 || sa[0] != d_in {
                return Err(bad(
                    &p.names.0,
                    format!("shape {sa:?}; the model's `{}` takes {d_in} inputs, so A must be [{d_in}, r]", p.module.path()),
                ));
            }
            let r = sa[1];
            if sb != [r, d_out] {
                return Err(bad(
                    &p.names.1,
                    format!(
                        "shape {sb:?}; with rank {r} and the model's `{}` giving {d_out} outputs, B must be [{r}, {d_out}]",
                        p.module.path()
                    ),
                ));
            }
            if !p.scale.is_finite() {
                return Err(bad(&p.names.1, format!("scale {} is not finite", p.scale)));
            }
            for a in [&p.a, &p.b] {
                if !matches!(a.dtype(), Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16) {
                    return Err(bad(
                        &p.names.0,
                        format!("dtype {:?}; adapters are float tensors", a.dtype()),
                    ));
                }
            }
            hasher.update(format!("{}:{}:{}:{r}:", p.layer, p.module.path(), p.scale));
            // The same values give the same digest whatever the format's
            // dtype or orientation (PEFT's transposes are views).
            for a in [&p.a, &p.b] {
                let f = a.as_dtype(Dtype::Float32)?.contiguous()?;
                f.eval()?;
                let v = f
                    .try_as_slice::<f32>()
                    .map_err(|e| LoraError::Mlx(mlx_rs::error::Exception::custom(e.to_string())))?;
                hasher.update(bytes_of(v));
            }
            rank = rank.max(r);
            if !modules.contains(&p.module) {
                modules.push(p.module);
            }
            let (slot, index) = p.module.slot();
            by_slot.entry((p.layer, slot)).or_default().push((index, p));
        }
        if by_slot.is_empty() {
            return Err(LoraError::invalid(&raw.path, "the adapter has no tensors"));
        }
        modules.sort();
        let mut layers: Vec<[Option<LoraPair>; 4]> = (0..targets.layers.len())
            .map(|_| Default::default())
            .collect();
        for ((layer, slot), parts) in by_slot {
            let widths = slot_widths(&targets.layers[layer], slot);
            let pair = join_slot(&parts, &widths, targets.dtype)?;
            layers[layer][slot as usize] = Some(pair);
        }
        let all: Vec<&Array> = layers
            .iter()
            .flatten()
            .flatten()
            .flat_map(|p| [&p.a, &p.b])
            .collect();
        mlx_rs::transforms::eval(all)?;
        Ok(LoraAdapter {
            name: name.to_string(),
            format: raw.format,
            rank,
            modules,
            fingerprint: format!("{:x}", hasher.finalize())[..16].to_string(),
            uid: NEXT_UID.fetch_add(1, Ordering::Relaxed),
            layers,
        })
    }

    /// Bytes of its tensors.
    pub fn nbytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .flatten()
            .map(|p| p.a.nbytes() + p.b.nbytes())
            .sum()
    }

    fn pair(&self, layer: usize, slot: Slot) -> Option<&LoraPair> {
        self.layers.get(layer)?[slot as usize].as_ref()
    }
}

fn bytes_of(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The output widths of a slot's parts, in order (q, k, v / gate, up / one).
fn slot_widths(layer: &HashMap<Module, (i32, i32)>, slot: Slot) -> Vec<i32> {
    let modules: &[Module] = match slot {
        Slot::Qkv => &[Module::Q, Module::K, Module::V],
        Slot::O => &[Module::O],
        Slot::GateUp => &[Module::Gate, Module::Up],
        Slot::Down => &[Module::Down],
    };
    modules
        .iter()
        .map(|m| layer.get(m).map_or(0, |&(_, out)| out))
        .collect()
}

/// One slot's pair from its parts: A side by side `[in, sum r]`, B
/// block-diagonal `[sum r, sum out]` (a part's B in its rows, at its
/// output columns; zeros elsewhere), each B times its scale.
fn join_slot(
    parts: &[(usize, LoraPart)],
    widths: &[i32],
    dtype: Dtype,
) -> Result<LoraPair, LoraError> {
    let total: i32 = widths.iter().sum();
    let mut a_cols = Vec::new();
    let mut b_rows = Vec::new();
    let (mut packed_a, mut packed_b, mut packed_parts) = (Vec::new(), Vec::new(), Vec::new());
    for (index, p) in parts {
        let start: i32 = widths[..*index].iter().sum();
        let width = widths[*index];
        let r = p.a.shape()[1];
        let (ha, fa) = to_half(&p.a)?;
        let (hb, fb) = to_half(&p.b)?;
        packed_b.push(hb.flatten(None, None)?);
        packed_a.push(ha);
        packed_parts.push(PackedPart {
            rank_offset: packed_parts.iter().map(|q: &PackedPart| q.rank).sum(),
            rank: r,
            out_offset: start,
            width,
            scale: p.scale * fa * fb,
        });
        let b = ops::multiply(p.b.as_dtype(Dtype::Float32)?, Array::from_f32(p.scale))?;
        let mut row = Vec::new();
        if start > 0 {
            row.push(Array::zeros::<f32>(&[r, start])?);
        }
        row.push(b);
        if start + width < total {
            row.push(Array::zeros::<f32>(&[r, total - start - width])?);
        }
        b_rows.push(ops::concatenate(&row, 1)?);
        a_cols.push(p.a.as_dtype(Dtype::Float32)?);
    }
    // Contiguous: the fused CPU decode op reads them as stored (PEFT's
    // transposed views would otherwise pass through a one-part slot).
    Ok(LoraPair {
        a: ops::concatenate(&a_cols, 1)?
            .as_dtype(dtype)?
            .contiguous()?,
        b: ops::concatenate(&b_rows, 0)?
            .as_dtype(dtype)?
            .contiguous()?,
        packed: PackedPair {
            a: ops::concatenate(&packed_a, 1)?.contiguous()?,
            b: ops::concatenate(&packed_b, 0)?.contiguous()?,
            parts: packed_parts,
        },
    })
}

/// `x` in float16 for the fused decode op, divided by a power of two `f`
/// that puts its largest magnitude in `[2^14, 2^15)` (float16's largest
/// normal numbers): any float32 adapter fits float16's range, and values
/// down to 2^-29 of the largest stay normal, so only the mantissa is
/// rounded (exact for float16 adapters, and bfloat16 ones within that
/// range). Returns the float16 array and `f` (`x = f * result`).
///
/// Errors: MLX failures.
fn to_half(x: &Array) -> Result<(Array, f32), LoraError> {
    let x = x.as_dtype(Dtype::Float32)?;
    let largest = ops::abs(&x)?.max(None)?.item_exact::<f32>();
    let f = if largest > 0.0 && largest.is_finite() {
        // largest in [2^e, 2^(e + 1)) (read from its exponent bits: exact);
        // the clamp keeps 1 / f finite for subnormal `largest`.
        let e = ((largest.to_bits() >> 23) & 0xff) as i32 - 127;
        2f32.powi((e - 14).clamp(-100, 100))
    } else {
        1.0
    };
    let h = ops::multiply(&x, Array::from_f32(1.0 / f))?.as_dtype(Dtype::Float16)?;
    Ok((h, f))
}

/// The prompt cache namespace of KV computed under `adapter` on top of the
/// base namespace `base`: the base's own for no adapter.
pub fn namespace(base: &str, adapter: Option<&LoraAdapter>) -> String {
    match adapter {
        None => base.to_string(),
        Some(a) => format!("{base}+lora:{}", a.fingerprint),
    }
}

/// One step's adapters over the packed tokens of its rows.
pub struct StepLora<'a> {
    plan: Plan<'a>,
}

enum Plan<'a> {
    /// Every token runs one adapter.
    Uniform(&'a LoraAdapter),
    /// Tokens of several adapters (and maybe base rows): `slots[t]` is 0
    /// for a base token, `i + 1` for `adapters[i]`.
    Mixed {
        adapters: Vec<&'a LoraAdapter>,
        slots: Array,
        /// `slots` on the host.
        slot_list: Vec<u32>,
        key: Vec<u64>,
    },
}

thread_local! {
    /// Stacked adapter sets of recent steps (`gather_mm`'s operands), by
    /// the set's uids: a steady batch stacks them once.
    static STACKS: RefCell<Vec<(Vec<u64>, Rc<Stacks>)>> = const { RefCell::new(Vec::new()) };
}

/// Per (layer, slot): `A [G + 1, in, r_max]`, `B [G + 1, r_max, out]`
/// (slot 0 zeros), float32.
type Stacks = HashMap<(usize, Slot), (Array, Array)>;

/// How many adapter sets [`STACKS`] keeps.
const STACK_SETS: usize = 4;

impl<'a> StepLora<'a> {
    /// The plan for rows with `adapters` feeding `lens` tokens each; `None`
    /// when no row that feeds tokens has an adapter.
    pub fn new(adapters: &[Option<&'a LoraAdapter>], lens: &[usize]) -> Option<Self> {
        let feeding: Vec<(Option<&'a LoraAdapter>, usize)> = adapters
            .iter()
            .zip(lens)
            .filter(|(_, &t)| t > 0)
            .map(|(a, &t)| (*a, t))
            .collect();
        let first = feeding.first().and_then(|(a, _)| *a);
        if let Some(first) = first {
            if feeding
                .iter()
                .all(|(a, _)| a.is_some_and(|a| a.uid == first.uid))
            {
                return Some(StepLora {
                    plan: Plan::Uniform(first),
                });
            }
        }
        let mut set: Vec<&'a LoraAdapter> = Vec::new();
        let mut slots = Vec::new();
        for (a, t) in &feeding {
            let slot = match a {
                None => 0u32,
                Some(a) => match set.iter().position(|s| s.uid == a.uid) {
                    Some(i) => i as u32 + 1,
                    None => {
                        set.push(a);
                        set.len() as u32
                    }
                },
            };
            slots.extend(std::iter::repeat_n(slot, *t));
        }
        if set.is_empty() {
            return None;
        }
        let key = set.iter().map(|a| a.uid).collect();
        Some(StepLora {
            plan: Plan::Mixed {
                adapters: set,
                slots: Array::from_slice(&slots, &[slots.len() as i32]),
                slot_list: slots,
                key,
            },
        })
    }

    /// `y + delta` for layer `layer`'s product `slot` of `x: [N, in]`
    /// (`y: [N, out]`); `y` itself when no adapter of the step adapts it.
    pub fn add(&self, layer: usize, slot: Slot, x: &Array, y: Array) -> Result<Array, LoraError> {
        Ok(match self.delta(layer, slot, x)? {
            Some(d) => ops::add(&y, &d)?,
            None => y,
        })
    }

    /// The step's delta of layer `layer`'s product `slot` for `x: [N, in]`:
    /// `[N, out]` in `x`'s dtype, or `None` when no adapter of the step
    /// adapts it.
    pub fn delta(&self, layer: usize, slot: Slot, x: &Array) -> Result<Option<Array>, LoraError> {
        match &self.plan {
            Plan::Uniform(a) => {
                let Some(p) = a.pair(layer, slot) else {
                    return Ok(None);
                };
                let xc = cast(x, p.a.dtype())?;
                let d = ops::matmul(ops::matmul(&xc, &p.a)?, &p.b)?;
                Ok(Some(cast(&d, x.dtype())?))
            }
            Plan::Mixed {
                adapters,
                slots,
                key,
                ..
            } => {
                let stacks = stacks_for(key, adapters)?;
                let Some((sa, sb)) = stacks.get(&(layer, slot)) else {
                    return Ok(None);
                };
                let n = x.shape()[0];
                let xin = cast(x, Dtype::Float32)?.reshape(&[n, 1, -1])?;
                let t = ops::gather_mm(&xin, sa, None, slots, false)?;
                let d = ops::gather_mm(&t, sb, None, slots, false)?;
                let out = sb.shape()[2];
                Ok(Some(cast(&d.reshape(&[n, out])?, x.dtype())?))
            }
        }
    }
}

impl<'a> StepLora<'a> {
    /// Layer `layer`'s deltas for the fused CPU decode op
    /// ([`crate::model::decode_layer`]), for a step whose every row feeds
    /// one token (`rows` of them): each adapter of the step with its
    /// [`PackedPair`]s, each row with its adapter's index (-1: base).
    pub fn fused(&self, layer: usize, rows: usize) -> crate::model::decode_layer::FusedLora<'a> {
        let packed = |a: &'a LoraAdapter| {
            [Slot::Qkv, Slot::O, Slot::GateUp, Slot::Down]
                .map(|s| a.pair(layer, s).map(|p| &p.packed))
        };
        match &self.plan {
            Plan::Uniform(a) => crate::model::decode_layer::FusedLora {
                adapters: vec![packed(a)],
                rows: vec![0; rows],
            },
            Plan::Mixed {
                adapters,
                slot_list,
                ..
            } => crate::model::decode_layer::FusedLora {
                adapters: adapters.iter().map(|a| packed(a)).collect(),
                rows: slot_list.iter().map(|&s| s as i32 - 1).collect(),
            },
        }
    }
}

fn cast(x: &Array, dtype: Dtype) -> Result<Array, LoraError> {
    Ok(if x.dtype() == dtype {
        x.clone()
    } else {
        x.as_dtype(dtype)?
    })
}

/// The stacked operands of the adapter set `key` (cached per thread).
fn stacks_for(key: &[u64], adapters: &[&LoraAdapter]) -> Result<Rc<Stacks>, LoraError> {
    if let Some(s) = STACKS.with(|c| {
        c.borrow()
            .iter()
            .find(|(k, _)| k.as_slice() == key)
            .map(|(_, s)| s.clone())
    }) {
        return Ok(s);
    }
    let layers = adapters.iter().map(|a| a.layers.len()).max().unwrap_or(0);
    let mut stacks = Stacks::new();
    for layer in 0..layers {
        for slot in [Slot::Qkv, Slot::O, Slot::GateUp, Slot::Down] {
            let pairs: Vec<Option<&LoraPair>> =
                adapters.iter().map(|a| a.pair(layer, slot)).collect();
            let Some(like) = pairs.iter().flatten().next() else {
                continue;
            };
            let (d_in, d_out) = (like.a.shape()[0], like.b.shape()[1]);
            let r_max = pairs
                .iter()
                .flatten()
                .map(|p| p.a.shape()[1])
                .max()
                .unwrap_or(0);
            let zero_a = Array::zeros::<f32>(&[d_in, r_max])?;
            let zero_b = Array::zeros::<f32>(&[r_max, d_out])?;
            let mut a_stack = vec![zero_a.clone()];
            let mut b_stack = vec![zero_b.clone()];
            for p in &pairs {
                match p {
                    None => {
                        a_stack.push(zero_a.clone());
                        b_stack.push(zero_b.clone());
                    }
                    Some(p) => {
                        let r = p.a.shape()[1];
                        let (mut a, mut b) =
                            (cast(&p.a, Dtype::Float32)?, cast(&p.b, Dtype::Float32)?);
                        if r < r_max {
                            a = ops::concatenate(
                                &[a, Array::zeros::<f32>(&[d_in, r_max - r])?],
                                1,
                            )?;
                            b = ops::concatenate(
                                &[b, Array::zeros::<f32>(&[r_max - r, d_out])?],
                                0,
                            )?;
                        }
                        a_stack.push(a);
                        b_stack.push(b);
                    }
                }
            }
            let a = ops::stack(&a_stack, 0)?;
            let b = ops::stack(&b_stack, 0)?;
            mlx_rs::transforms::eval([&a, &b])?;
            stacks.insert((layer, slot), (a, b));
        }
    }
    let stacks = Rc::new(stacks);
    STACKS.with(|c| {
        let mut c = c.borrow_mut();
        if c.len() >= STACK_SETS {
            c.remove(0);
        }
        c.push((key.to_vec(), stacks.clone()));
    });
    Ok(stacks)
}

#[cfg(test)]
mod tests;

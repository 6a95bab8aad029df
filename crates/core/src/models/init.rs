//! Initial weights: one counter-based generator that the host and the GPU
//! evaluate to the same bits.
//!
//! Every element's value is a pure function of `(seed, parameter name,
//! element index)` computed with integer arithmetic only, then turned into
//! an f32 by one exact conversion and one correctly rounded multiply, and
//! rounded to the parameter's dtype to nearest even. No transcendental
//! function is involved (`log`/`cos` differ between libm and CUDA), so the
//! CUDA kernel (`crates/cuda/kernels/init.cu`) gives the same bits as
//! [`init_params`] for every seed and dtype.
//!
//! **The streams are per parameter name**, not per position: the stream of
//! `model.layers.0.mlp.up_proj.weight` is the same in a 2-layer and a
//! 30-layer model, in a forward trace and in a step trace (whose parameter
//! order differs), and in every rank of a data-parallel group.
//!
//! **The distribution** of a random (matrix or embedding) weight is the
//! Irwin–Hall sum of four independent uniform integers on `0..65536`,
//! centred and scaled to standard deviation 0.02: mean exactly 0 (it is
//! symmetric), standard deviation 0.02 to within one f32 rounding of the
//! scale, excess kurtosis −0.3 (a normal's is 0), and bounded at
//! ±√12·σ ≈ ±0.0693 (a normal would exceed that once in about 1 900
//! draws). The four uniforms are the four 16-bit quarters of one splitmix64
//! output. Biases start at zero and norm weights at one, as litgpt and
//! Hugging Face initialise a fresh model; a norm weight stored as an offset
//! from one (Gemma's `x·(1 + w)`, recorded as `w + 1`) starts at zero, so
//! the fresh network is the same ([`param_init`]).
//!
//! **Adapters** start as PEFT starts them: a LoRA `A` matrix (`*.lora_A.weight`,
//! `[rank, in]`) is uniform on `[−1/√in, 1/√in)` (PyTorch's Kaiming-uniform
//! with `a = √5`, which `peft` uses), drawn as the top 24 bits of the same
//! splitmix64 output, centred (an integer in `[−2²³, 2²³)`), converted
//! exactly and multiplied once by `1/(√in · 2²³)`; a `B` matrix
//! (`*.lora_B.weight`) starts at zero, so an adapter changes nothing
//! before its first update.
//!
//! [`init_params`] draws on the host (in parallel); a session's
//! [`crate::session::Session::init_params`] writes straight into its own
//! memory, on the device where the backend has a kernel for it.

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::host::HostTensor;
use crate::ir::{DType, TensorType, Trace, ValueId};
use crate::ops::{BinaryFn, Op};

/// The standard deviation of a random weight.
pub const INIT_STD: f64 = 0.02;

/// The weight one unit of the centred Irwin–Hall sum stands for: the f32
/// nearest to `0.02 / √((65536² − 1) / 3)` (`0.02` divided by the sum's
/// standard deviation), fixed as bits so that every language multiplies by
/// the same number. `init_scale_is_the_rounded_ratio` recomputes it.
pub const IRWIN_HALL_SCALE_BITS: u32 = 0x350D_E3BD;

/// The centre of the sum of four uniforms on `0..65536`: `4 · 65535 / 2`.
pub const IRWIN_HALL_CENTRE: i32 = 2 * 65535;

/// splitmix64's increment (2⁶⁴ / φ): element `i` of a stream is the
/// generator's output number `i + 1`.
pub const SPLITMIX_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// The two multipliers of splitmix64's output function ([`mix64`]).
pub const MIX64_MULTIPLIERS: [u64; 2] = [0xBF58_476D_1CE4_E5B9, 0x94D0_49BB_1331_11EB];

/// How a parameter starts, from its name (and, for an adapter, its shape).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ParamInit {
    /// Biases (`*.bias`) and LoRA `B` matrices (`*.lora_B.weight`).
    Zeros,
    /// Norm weights (names containing `norm`).
    Ones,
    /// Every other weight: the Irwin–Hall draw of the module doc.
    Random,
    /// LoRA `A` matrices (`*.lora_A.weight`): uniform on
    /// `[−1/√fan_in, 1/√fan_in)`, `fan_in` the matrix's last dimension.
    KaimingUniform { fan_in: usize },
}

/// Where a LoRA `A` matrix's uniform integer is centred: its 24 bits span `[0, 2²⁴)`.
const UNIFORM_CENTRE: f64 = (1u64 << 23) as f64;

impl ParamInit {
    /// The rule for the parameter called `name` of shape `shape`.
    pub fn of(name: &str, shape: &[usize]) -> ParamInit {
        if name.ends_with(".bias") || name.ends_with(".lora_B.weight") {
            ParamInit::Zeros
        } else if name.ends_with(".lora_A.weight") {
            ParamInit::KaimingUniform { fan_in: shape.last().copied().unwrap_or(1).max(1) }
        } else if name.contains("norm") {
            ParamInit::Ones
        } else {
            ParamInit::Random
        }
    }

    /// The code the CUDA kernel takes for this rule (`init.cu`: 0 zeros,
    /// 1 ones, 2 random, 3 uniform).
    pub fn code(self) -> i32 {
        match self {
            ParamInit::Zeros => 0,
            ParamInit::Ones => 1,
            ParamInit::Random => 2,
            ParamInit::KaimingUniform { .. } => 3,
        }
    }

    /// The one multiplier of a drawn integer: [`irwin_hall_scale`] for a
    /// random weight, `1/(√fan_in · 2²³)` rounded once to f32 for a
    /// uniform one (computed in f64, so host and kernel take the same bits).
    pub fn scale(self) -> f32 {
        match self {
            ParamInit::KaimingUniform { fan_in } => (1.0 / ((fan_in as f64).sqrt() * UNIFORM_CENTRE)) as f32,
            _ => irwin_hall_scale(),
        }
    }
}

/// splitmix64's output function (Stafford's "mix 13").
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(MIX64_MULTIPLIERS[0]);
    z = (z ^ (z >> 27)).wrapping_mul(MIX64_MULTIPLIERS[1]);
    z ^ (z >> 31)
}

/// FNV-1a, 64 bits, of `bytes`: a parameter name's contribution to its stream.
fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xCBF2_9CE4_8422_2325, |h, &b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3))
}

/// The stream of the parameter `name` under `seed`: the state its
/// splitmix64 generator starts from. Computed on the host only; the device
/// receives it as a kernel argument.
pub fn param_stream(seed: u64, name: &str) -> u64 {
    mix64(seed.wrapping_mul(SPLITMIX_GAMMA) ^ fnv1a64(name.as_bytes()))
}

/// The scale of [`IRWIN_HALL_SCALE_BITS`] as an f32.
pub fn irwin_hall_scale() -> f32 {
    f32::from_bits(IRWIN_HALL_SCALE_BITS)
}

/// Element `i` of the random weight whose stream is `stream`, in f32.
#[inline]
pub fn random_value(stream: u64, i: u64) -> f32 {
    let z = mix64(stream.wrapping_add(i.wrapping_add(1).wrapping_mul(SPLITMIX_GAMMA)));
    let quarter = |k: u32| ((z >> (16 * k)) & 0xFFFF) as i32;
    let centred = quarter(0) + quarter(1) + quarter(2) + quarter(3) - IRWIN_HALL_CENTRE;
    // |centred| ≤ 131070 < 2²⁴: the conversion is exact, and the one
    // multiply rounds to nearest even in Rust and in CUDA (`__fmul_rn`) alike.
    centred as f32 * irwin_hall_scale()
}

/// Element `i` of the uniform weight whose stream is `stream` and whose
/// multiplier is `scale` ([`ParamInit::scale`]), in f32: the top 24 bits of
/// the same splitmix64 output as [`random_value`], centred.
#[inline]
pub fn uniform_value(stream: u64, i: u64, scale: f32) -> f32 {
    let z = mix64(stream.wrapping_add(i.wrapping_add(1).wrapping_mul(SPLITMIX_GAMMA)));
    // |centred| ≤ 2²³: exact in f32; one rounded multiply, as in CUDA.
    let centred = (z >> 40) as i32 - (1 << 23);
    centred as f32 * scale
}

/// Fills `out`, the bytes of a `dtype` tensor, with the initial values of
/// the parameter `name` under `seed` (in parallel). Values are made in f32
/// and rounded once to `dtype`, to nearest even (f64 holds them exactly).
/// Refuses a dtype that is not a float type and bytes that are not a whole
/// number of elements.
pub fn fill_param(name: &str, ty: &TensorType, seed: u64, out: &mut [u8]) -> Result<()> {
    fill_param_as(ParamInit::of(name, &ty.shape), name, ty, seed, out)
}

/// [`fill_param`] by the rule `init` (see [`param_init`]).
pub fn fill_param_as(init: ParamInit, name: &str, ty: &TensorType, seed: u64, out: &mut [u8]) -> Result<()> {
    let dtype = ty.dtype;
    fn fill<T: bytemuck::Pod + Send>(out: &mut [u8], value: impl Fn(u64) -> T + Sync) {
        let s: &mut [T] = bytemuck::cast_slice_mut(out);
        // Chunks, not elements, per task: the work per element is a few
        // integer operations, less than a task costs.
        const CHUNK: usize = 1 << 14;
        s.par_chunks_mut(CHUNK).enumerate().for_each(|(c, chunk)| {
            let first = (c * CHUNK) as u64;
            for (k, o) in chunk.iter_mut().enumerate() {
                *o = value(first + k as u64);
            }
        });
    }
    let bad = |reason: String| Err(Error::Input { name: name.into(), reason });
    if !dtype.is_float() {
        return bad(format!(
            "a parameter of dtype {dtype} has no initial weights; they are drawn for f32, bf16, f16 and f64"
        ));
    }
    if !out.len().is_multiple_of(dtype.size()) || out.as_ptr().align_offset(dtype.size()) != 0 {
        return bad(format!("{} bytes are not whole aligned {dtype} elements", out.len()));
    }
    let (stream, scale) = (param_stream(seed, name), init.scale());
    let value = move |i: u64| match init {
        ParamInit::Zeros => 0.0f32,
        ParamInit::Ones => 1.0f32,
        ParamInit::Random => random_value(stream, i),
        ParamInit::KaimingUniform { .. } => uniform_value(stream, i, scale),
    };
    match dtype {
        DType::F32 => fill(out, value),
        DType::F64 => fill(out, |i| value(i) as f64),
        DType::BF16 => fill(out, |i| half::bf16::from_f32(value(i))),
        DType::F16 => fill(out, |i| half::f16::from_f32(value(i))),
        DType::I32 | DType::I64 | DType::Bool => unreachable!("refused above"),
    }
    Ok(())
}

/// The initial value of the parameter `name` of type `ty` (a float type).
pub fn init_param(name: &str, ty: &TensorType, seed: u64) -> Result<HostTensor> {
    init_param_as(ParamInit::of(name, &ty.shape), name, ty, seed)
}

/// [`init_param`] by the rule `init` (see [`param_init`]).
pub fn init_param_as(init: ParamInit, name: &str, ty: &TensorType, seed: u64) -> Result<HostTensor> {
    let mut t = HostTensor::zeros(ty.clone());
    fill_param_as(init, name, ty, seed, t.bytes_mut())?;
    Ok(t)
}

/// How parameter `p` of `trace` starts: by its name ([`ParamInit::of`]),
/// except that a norm weight the trace adds one to before use (directly or
/// after a cast: `x·(1 + w)`, Gemma's RMSNorm) starts at zero rather than
/// one, as `transformers` starts it, so that the fresh network normalises
/// with a unit scale like every other.
pub fn param_init(trace: &Trace, p: ValueId) -> ParamInit {
    let name = trace.value(p).kind.leaf_name().unwrap_or_default();
    let rule = ParamInit::of(name, &trace.ty(p).shape);
    if rule == ParamInit::Ones && is_unit_offset(trace, p) {
        ParamInit::Zeros
    } else {
        rule
    }
}

/// Whether `v` (or a cast of it) is added to a constant one.
fn is_unit_offset(trace: &Trace, v: ValueId) -> bool {
    let is_one =
        |x: ValueId| trace.producer(x).is_some_and(|n| matches!(&trace.node(n).op, Op::Full(f) if f.value == 1.0));
    trace.nodes.iter().filter(|n| n.inputs.contains(&v)).any(|n| match &n.op {
        Op::Cast(_) => n.outputs.iter().any(|&o| is_unit_offset(trace, o)),
        Op::Binary(b) if b.f == BinaryFn::Add => n.inputs.iter().any(|&x| x != v && is_one(x)),
        _ => false,
    })
}

/// Initial values of every parameter of `trace` (a forward or a step
/// trace), drawn on the host: random weights as in the module doc, ones for
/// norm weights, zeros for biases. Deterministic in `seed`, and the same
/// bits a session's [`crate::session::Session::init_params`] writes.
///
/// # Panics
/// On a parameter that is not of a float type, which the model builder
/// never makes ([`init_param`] returns that as an error).
pub fn init_params(trace: &Trace, seed: u64) -> Vec<(ValueId, HostTensor)> {
    trace
        .weights()
        // NF4 leaves hold a drawn weight quantized: `lora::init_quantized`.
        .filter(|&v| !trace.value(v).kind.leaf_name().is_some_and(crate::models::lora::is_quantized_leaf))
        .map(|p| {
            let name = trace.value(p).kind.leaf_name().expect("a parameter is a leaf");
            (p, init_param_as(param_init(trace, p), name, trace.ty(p), seed).unwrap_or_else(|e| panic!("{e}")))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::{build_forward, LossKind, ModelSpec};

    #[test]
    fn init_scale_is_the_rounded_ratio() {
        let sum_std = ((65536f64 * 65536.0 - 1.0) / 3.0).sqrt();
        assert_eq!(irwin_hall_scale(), (INIT_STD / sum_std) as f32);
        // The largest value: the bound the module doc gives.
        let bound = IRWIN_HALL_CENTRE as f32 * irwin_hall_scale();
        assert!((bound as f64 - INIT_STD * 12f64.sqrt()).abs() < 1e-5, "{bound}");
    }

    /// The generator is splitmix64: its first outputs from state 0 are the
    /// published ones (Vigna's reference implementation), so a port to
    /// another language can be checked against them.
    #[test]
    fn the_mix_is_splitmix64() {
        let out: Vec<u64> = (1..=3u64).map(|k| mix64(k.wrapping_mul(SPLITMIX_GAMMA))).collect();
        assert_eq!(out, [0xE220_A839_7B1D_CDAF, 0x6E78_9E6A_A1B9_65F4, 0x06C4_5D18_8009_454F]);
        // FNV-1a's published test vectors.
        assert_eq!(fnv1a64(b""), 0xCBF2_9CE4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xAF63_DC4C_8601_EC8C);
    }

    #[test]
    fn rules_follow_the_name() {
        assert_eq!(ParamInit::of("model.layers.0.self_attn.q_proj.bias", &[4, 4]), ParamInit::Zeros);
        assert_eq!(ParamInit::of("model.layers.3.input_layernorm.weight", &[4, 4]), ParamInit::Ones);
        assert_eq!(ParamInit::of("model.norm.weight", &[4, 4]), ParamInit::Ones);
        assert_eq!(ParamInit::of("model.layers.0.mlp.down_proj.weight", &[4, 4]), ParamInit::Random);
        assert_eq!(ParamInit::of("lm_head.weight", &[4, 4]), ParamInit::Random);
    }

    /// Every dtype holds the f32 value rounded to nearest even, as
    /// `HostTensor::from_f64` rounds.
    #[test]
    fn each_dtype_is_the_f32_value_rounded_once() {
        let name = "model.embed_tokens.weight";
        let n = 4099;
        let f32s: Vec<f64> = init_param(name, &TensorType::new(DType::F32, [n]), 9).unwrap().to_f64();
        for dtype in [DType::F64, DType::BF16, DType::F16] {
            let ty = TensorType::new(dtype, [n]);
            assert_eq!(init_param(name, &ty, 9).unwrap(), HostTensor::from_f64(ty.clone(), &f32s), "{dtype}");
        }
        for (i, &x) in f32s.iter().enumerate() {
            assert_eq!(x, random_value(param_stream(9, name), i as u64) as f64);
        }
    }

    #[test]
    fn random_weights_have_mean_0_and_std_0_02() {
        let n = 1 << 20;
        let t = init_param("w", &TensorType::new(DType::F32, [n]), 1).unwrap();
        let x = t.to_f64();
        let mean = x.iter().sum::<f64>() / n as f64;
        let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n as f64;
        let fourth = x.iter().map(|v| (v - mean).powi(4)).sum::<f64>() / n as f64;
        // Standard errors at n = 2²⁰: mean 0.02/1024 ≈ 2e-5; std ≈ 0.02·0.45/1024.
        assert!(mean.abs() < 1e-4, "mean {mean}");
        assert!((var.sqrt() - INIT_STD).abs() < 1e-4, "std {}", var.sqrt());
        // Irwin–Hall of 4: kurtosis 3 − 1.2/4 = 2.7.
        let kurtosis = fourth / (var * var);
        assert!((kurtosis - 2.7).abs() < 0.02, "kurtosis {kurtosis}");
        let bound = IRWIN_HALL_CENTRE as f64 * irwin_hall_scale() as f64;
        assert!(x.iter().all(|v| v.abs() <= bound));
        // Many distinct values, not a coarse lattice: of the 2·131070 + 1
        // possible ones, a million draws hit most of the central ones.
        let mut distinct: Vec<u32> = x.iter().map(|&v| (v as f32).to_bits()).collect();
        distinct.sort_unstable();
        distinct.dedup();
        assert!(distinct.len() > 100_000, "{} distinct values", distinct.len());
        // Neighbouring elements are uncorrelated.
        let lag1 = x.windows(2).map(|w| w[0] * w[1]).sum::<f64>() / (n - 1) as f64 / var;
        assert!(lag1.abs() < 5e-3, "lag-1 correlation {lag1}");
    }

    #[test]
    fn adapter_a_is_kaiming_uniform_and_b_starts_at_zero() {
        let (rank, fan_in) = (16, 4096);
        let a = init_param("m.q_proj.lora_A.weight", &TensorType::new(DType::F32, [rank, fan_in]), 5).unwrap();
        let x = a.to_f64();
        let bound = 1.0 / (fan_in as f64).sqrt();
        assert!(x.iter().all(|v| (-bound..bound).contains(v)), "outside ±1/√{fan_in}");
        // Uniform on [−b, b): mean 0, variance b²/3 (standard errors at
        // 65536 draws: b/443 for the mean, under 1% for the variance).
        let n = x.len() as f64;
        let mean = x.iter().sum::<f64>() / n;
        let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
        assert!(mean.abs() < bound / 100.0, "mean {mean}");
        assert!((var / (bound * bound / 3.0) - 1.0).abs() < 0.02, "variance {var}");
        // Both ends are reached: the draw spans the whole interval.
        let (lo, hi) = x.iter().fold((0.0f64, 0.0f64), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        assert!(lo < -0.999 * bound && hi > 0.999 * bound, "{lo} {hi}");
        let b = init_param("m.q_proj.lora_B.weight", &TensorType::new(DType::BF16, [fan_in, rank]), 5).unwrap();
        assert!(b.to_f64().iter().all(|&v| v == 0.0));
        assert_eq!(ParamInit::of("m.lora_A.weight", &[8, 64]), ParamInit::KaimingUniform { fan_in: 64 });
        assert_eq!(ParamInit::of("m.lora_A.weight", &[8, 64]).scale(), (1.0 / (8.0 * 8_388_608.0)) as f32);
    }

    #[test]
    fn integer_parameters_are_refused_by_name() {
        let e = init_param("model.x", &TensorType::new(DType::I32, [4]), 1).unwrap_err().to_string();
        assert!(e.contains("`model.x`") && e.contains("dtype i32") && e.contains("f32, bf16, f16 and f64"), "{e}");
        let e = fill_param("w", &TensorType::new(DType::F32, [2]), 1, &mut [0u8; 6]).unwrap_err().to_string();
        assert!(e.contains("6 bytes are not whole aligned f32 elements"), "{e}");
    }

    fn tiny(n_layer: usize) -> Trace {
        let mut spec = ModelSpec::named("tiny-llama", 1, 8, DType::F32, LossKind::CrossEntropy).unwrap();
        spec.config.n_layer = n_layer;
        build_forward(&spec).unwrap()
    }

    fn by_name(trace: &Trace, seed: u64) -> Vec<(String, HostTensor)> {
        init_params(trace, seed)
            .into_iter()
            .map(|(v, t)| (trace.value(v).kind.leaf_name().unwrap().to_string(), t))
            .collect()
    }

    #[test]
    fn norms_start_at_one_biases_at_zero_and_weights_differ_by_name_and_seed() {
        let spec = ModelSpec::named("tiny-neox", 1, 8, DType::F32, LossKind::CrossEntropy).unwrap();
        let fwd = build_forward(&spec).unwrap();
        let params = by_name(&fwd, 3);
        let (mut zeros, mut ones, mut random) = (0, 0, 0);
        for (name, t) in &params {
            let x = t.to_f64();
            match ParamInit::of(name, &t.ty.shape) {
                ParamInit::Zeros => {
                    zeros += 1;
                    assert!(x.iter().all(|&v| v == 0.0), "{name}");
                }
                ParamInit::Ones => {
                    ones += 1;
                    assert!(x.iter().all(|&v| v == 1.0), "{name}");
                }
                ParamInit::Random => {
                    random += 1;
                    assert!(x.iter().filter(|&&v| v != 0.0).count() > x.len() / 2, "{name}");
                }
                ParamInit::KaimingUniform { .. } => unreachable!("{name}: the model has no adapters"),
            }
        }
        assert!(zeros > 0 && ones > 0 && random > 0, "{zeros} {ones} {random}");
        // Two parameters of one shape draw different values; so does another seed.
        let same_shape: Vec<&HostTensor> = params
            .iter()
            .filter(|(n, _)| n.ends_with("q_proj.weight") || n.ends_with("k_proj.weight"))
            .map(|(_, t)| t)
            .collect();
        assert!(same_shape.len() >= 2 && same_shape[0].ty == same_shape[1].ty);
        assert_ne!(same_shape[0], same_shape[1]);
        for ((name, a), (_, b)) in params.iter().zip(by_name(&fwd, 4)) {
            if ParamInit::of(name, &a.ty.shape) == ParamInit::Random {
                assert_ne!(*a, b, "{name}: seeds 3 and 4 agree");
            }
        }
        assert_eq!(params, by_name(&fwd, 3), "deterministic in the seed");
    }

    #[test]
    fn norms_stored_as_offsets_from_one_start_at_zero() {
        let small = crate::models::Overrides {
            n_layer: Some(2),
            n_embd: Some(64),
            n_head: Some(4),
            n_query_groups: Some(1),
            vocab_size: Some(96),
            intermediate_size: Some(128),
            ..Default::default()
        };
        let config = crate::models::Config::named("gemma-3-1b").unwrap().with_overrides(&small).unwrap();
        let spec = ModelSpec {
            config,
            batch: 1,
            seq: 8,
            dtype: DType::BF16,
            loss: LossKind::CrossEntropy,
            adapters: None,
            documents: false,
        };
        let fwd = build_forward(&spec).unwrap();
        let norms: Vec<(String, HostTensor)> =
            by_name(&fwd, 3).into_iter().filter(|(n, _)| n.contains("norm")).collect();
        // The four sandwich norms of each layer, its q and k norms and the final one.
        assert_eq!(norms.len(), 2 * 6 + 1);
        for (name, t) in &norms {
            assert!(t.to_f64().iter().all(|&v| v == 0.0), "{name} should start at zero (x·(1 + w))");
        }
        // A plain RMSNorm's weight still starts at one.
        let llama =
            build_forward(&ModelSpec::named("tiny-llama", 1, 8, DType::F32, LossKind::CrossEntropy).unwrap()).unwrap();
        let w = llama.leaf_by_name("model.norm.weight").unwrap();
        assert_eq!(param_init(&llama, w), ParamInit::Ones);
    }

    #[test]
    fn adding_a_layer_keeps_every_other_weight() {
        let (two, three) = (by_name(&tiny(2), 5), by_name(&tiny(3), 5));
        assert_eq!(three.len(), two.len() + two.iter().filter(|(n, _)| n.contains("layers.1.")).count());
        for (name, t) in &two {
            let other = three.iter().find(|(n, _)| n == name).map(|(_, t)| t);
            assert_eq!(Some(t), other, "{name}");
        }
    }
}

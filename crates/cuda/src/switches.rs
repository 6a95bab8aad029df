//! The run-time switches that change what the CUDA backend runs or what it
//! computes, in one typed structure parsed once from the environment.
//!
//! [`Switches::from_env`] reads every `STEPGRAPH_*` variable listed here,
//! once, at the entry points that build sessions or lower steps (the CLI's
//! commands, the test harnesses); the result is carried from there in
//! [`crate::session::CudaOptions`] and the lowering's
//! [`crate::ops::Target`], and nothing below reads the environment for
//! them. Commands print [`Switches::not_default`] when it is not empty, and
//! training records the serialized structure in its checkpoints, so a run
//! resumed under other switches is refused naming the one that differs.
//!
//! One convention for all of them: a boolean switch is on for `1`, `on`,
//! `true` or `yes` and off for `0`, `off`, `false` or `no` (any case, spaces
//! around ignored); an unset or empty variable is the default; any other
//! value is an error naming the variable and the values it accepts.
//!
//! Invariants: every field has its default in one place ([`Default`]); the
//! serialized names are the fields' (snake_case), stable because
//! checkpoints record them; [`Switches::not_default`] prints values that
//! parse back to the same switches.
//!
//! Variables that change no result stay outside: where kernels are cached
//! (`STEPGRAPH_KERNEL_CACHE`), how much NVRTC prints
//! (`STEPGRAPH_NVRTC_VERBOSE`), which libraries must be present
//! (`STEPGRAPH_REQUIRE_NVRTC`, `STEPGRAPH_REQUIRE_NCCL`), where NCCL is
//! (`STEPGRAPH_NCCL`), and core's host memory limit
//! (`STEPGRAPH_HOST_MEMORY_LIMIT`, a limit the planner checks, not a
//! choice of kernels). They are read where they are used.

use serde::{Deserialize, Serialize};

use crate::error::{CudaError, Result};

/// Which attention kernels serve the cases both kinds cover
/// (`STEPGRAPH_ATTENTION`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttentionKernels {
    /// Tensor-core kernels where they cover the dtype and head size
    /// ([`crate::attention::mma_width`]), CUDA-core kernels elsewhere.
    #[default]
    Auto,
    /// CUDA-core kernels everywhere (`simt`, for comparisons).
    Simt,
}

/// What a switch for candidates beyond cuBLASLt's asks for
/// (`STEPGRAPH_GEMM_CUBLAS`, `STEPGRAPH_GEMM_SKINNY`, `STEPGRAPH_GEMM_TILED`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CandidateUse {
    /// Not used (off).
    #[default]
    Off,
    /// On: more candidates for tuning to time.
    #[serde(rename = "on")]
    Candidate,
    /// `only`: the first of these candidates runs every product it can,
    /// untimed, so the GPU tests compare exactly that path with the CPU.
    Only,
}

/// A switch's value as its variable spells it: parsed from the variable's
/// text and shown so that it parses back.
trait Value: Sized {
    /// `text` (trimmed, not empty) of variable `var`.
    fn parse(var: &str, text: &str) -> Result<Self>;
    fn show(&self) -> String;
}

const ON: [&str; 4] = ["1", "on", "true", "yes"];
const OFF: [&str; 4] = ["0", "off", "false", "no"];
const BOOL_VALUES: &str = "1, on, true, yes or 0, off, false, no";

fn bad(var: &str, text: &str, expected: impl Into<String>) -> CudaError {
    CudaError::Switch { var: var.to_string(), value: text.to_string(), expected: expected.into() }
}

/// `Some(true)` or `Some(false)` for the boolean spellings, in any case.
fn boolean(text: &str) -> Option<bool> {
    let t = text.to_ascii_lowercase();
    if ON.contains(&t.as_str()) {
        Some(true)
    } else if OFF.contains(&t.as_str()) {
        Some(false)
    } else {
        None
    }
}

impl Value for bool {
    fn parse(var: &str, text: &str) -> Result<Self> {
        boolean(text).ok_or_else(|| bad(var, text, BOOL_VALUES))
    }
    fn show(&self) -> String {
        if *self { "on" } else { "off" }.into()
    }
}

impl Value for CandidateUse {
    fn parse(var: &str, text: &str) -> Result<Self> {
        match boolean(text) {
            Some(true) => Ok(CandidateUse::Candidate),
            Some(false) => Ok(CandidateUse::Off),
            None if text.eq_ignore_ascii_case("only") => Ok(CandidateUse::Only),
            None => Err(bad(var, text, format!("{BOOL_VALUES}, or only"))),
        }
    }
    fn show(&self) -> String {
        match self {
            CandidateUse::Off => "off",
            CandidateUse::Candidate => "on",
            CandidateUse::Only => "only",
        }
        .into()
    }
}

impl Value for AttentionKernels {
    fn parse(var: &str, text: &str) -> Result<Self> {
        match text.to_ascii_lowercase().as_str() {
            "auto" => Ok(AttentionKernels::Auto),
            "simt" => Ok(AttentionKernels::Simt),
            _ => Err(bad(var, text, "auto or simt")),
        }
    }
    fn show(&self) -> String {
        match self {
            AttentionKernels::Auto => "auto",
            AttentionKernels::Simt => "simt",
        }
        .into()
    }
}

/// The number of cuBLASLt algorithms timed per shape: 1 to [`CANDIDATES_LIMIT`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct GemmCandidates(pub usize);

impl Value for GemmCandidates {
    fn parse(var: &str, text: &str) -> Result<Self> {
        match text.parse::<usize>() {
            Ok(n) if (1..=CANDIDATES_LIMIT).contains(&n) => Ok(GemmCandidates(n)),
            _ => Err(bad(var, text, format!("a number of algorithms from 1 to {CANDIDATES_LIMIT}"))),
        }
    }
    fn show(&self) -> String {
        self.0.to_string()
    }
}

/// Declares the switches once: the structure, its defaults, its parser and
/// its listing all come from this list.
macro_rules! switches {
    ($($(#[doc = $doc:literal])* $field:ident: $ty:ty = $default:expr, $var:expr;)*) => {
        /// Every run-time switch that changes what runs or its results,
        /// with its default: see the module doc.
        #[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
        #[serde(default)]
        pub struct Switches {
            $($(#[doc = $doc])* pub $field: $ty,)*
        }

        impl Default for Switches {
            fn default() -> Self {
                Switches { $($field: $default,)* }
            }
        }

        impl Switches {
            /// The environment variable of each switch, in field order.
            pub const VARS: &'static [&'static str] = &[$($var),*];

            /// The switches `get` gives values for (`get(var)`: the
            /// variable's value, `None` when unset); see the module doc for
            /// the spellings accepted.
            pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Switches> {
                Ok(Switches {
                    $($field: match get($var).as_deref().map(str::trim) {
                        None | Some("") => $default,
                        Some(text) => <$ty as Value>::parse($var, text)?,
                    },)*
                })
            }

            /// The switches that differ from their defaults, as
            /// `(variable, value)` pairs in field order; each value parses
            /// back to the same setting.
            pub fn not_default(&self) -> Vec<(&'static str, String)> {
                let mut out = Vec::new();
                $(if self.$field != $default {
                    out.push(($var, Value::show(&self.$field)));
                })*
                out
            }
        }
    };
}

switches! {
    /// `STEPGRAPH_ATTENTION`: `simt` runs the CUDA-core attention kernels
    /// where tensor-core ones exist (for comparisons).
    attention: AttentionKernels = AttentionKernels::Auto, "STEPGRAPH_ATTENTION";
    /// `STEPGRAPH_PORTABLE_KERNELS`: keep to the kernels every supported GPU
    /// runs (on sm_90: `mma.sync` instead of warpgroup MMA), for comparisons.
    portable_kernels: bool = false, "STEPGRAPH_PORTABLE_KERNELS";
    /// `STEPGRAPH_DECODE_STAGING`: decode attention's split pass stages the
    /// cache through shared memory where it can.
    decode_staging: bool = false, "STEPGRAPH_DECODE_STAGING";
    /// `STEPGRAPH_GEMM_AUTOTUNE`: time cuBLASLt's candidates per shape and
    /// keep the fastest; off takes the heuristic's first choice.
    gemm_autotune: bool = true, AUTOTUNE_ENV;
    /// `STEPGRAPH_GEMM_CANDIDATES`: how many algorithms are timed per shape.
    gemm_candidates: GemmCandidates = GemmCandidates(MAX_CANDIDATES), CANDIDATES_ENV;
    /// `STEPGRAPH_GEMM_SPLIT_K`: also time split-k variants of products of
    /// few output tiles.
    gemm_split_k: bool = false, SPLIT_K_ENV;
    /// `STEPGRAPH_GEMM_CUBLAS`: cuBLAS's own GEMM as a candidate (`only`:
    /// for every product it can run).
    gemm_cublas: CandidateUse = CandidateUse::Off, CUBLAS_ENV;
    /// `STEPGRAPH_GEMM_SKINNY`: our kernels for products of a few rows as
    /// candidates (`only`: for every product they can run).
    gemm_skinny: CandidateUse = CandidateUse::Off, SKINNY_ENV;
    /// `STEPGRAPH_GEMM_TILED`: our exact-f32 kernels in small tiles as
    /// candidates (`only`: for every product they can run).
    gemm_tiled: CandidateUse = CandidateUse::Off, TILED_ENV;
    /// `STEPGRAPH_MULTI_TENSOR`: merge a step's back-to-back AdamW updates,
    /// a layer's cache writes and its q and k rotations into single
    /// launches; off keeps one launch per node (for comparisons).
    multi_tensor: bool = true, "STEPGRAPH_MULTI_TENSOR";
    /// `STEPGRAPH_PDL`: launch every kernel with programmatic dependent
    /// launch on devices that have it (sm_90 and later).
    pdl: bool = false, PDL_ENV;
}

impl Switches {
    /// The switches of this process's environment. Call it once, where a
    /// command or test starts, and carry the result.
    pub fn from_env() -> Result<Switches> {
        Switches::from_vars(|var| std::env::var(var).ok())
    }

    /// [`Switches::not_default`] as one line, `VAR=value` separated by
    /// spaces (empty when every switch has its default).
    pub fn not_default_line(&self) -> String {
        self.not_default().iter().map(|(var, value)| format!("{var}={value}")).collect::<Vec<_>>().join(" ")
    }
}

// The names of the product-tuning switches and the range of the
// candidate count, here with the switches they name; the products
// ([`crate::blas`]) read them through [`Switches`] and re-export them.

/// The environment variable that adds cuBLAS's GEMM to the timed candidates (`1`).
pub const CUBLAS_ENV: &str = "STEPGRAPH_GEMM_CUBLAS";
/// How many algorithms the heuristic is asked for per shape when tuning,
/// unless [`CANDIDATES_ENV`] says otherwise.
pub const MAX_CANDIDATES: usize = 8;
/// The environment variable that sets how many algorithms are timed per
/// shape (1 to [`CANDIDATES_LIMIT`]): more find rarer winners (split-k
/// variants for the few-row products of decode, say) at more build time.
pub const CANDIDATES_ENV: &str = "STEPGRAPH_GEMM_CANDIDATES";
/// The most candidates [`CANDIDATES_ENV`] may ask for.
pub const CANDIDATES_LIMIT: usize = 64;
/// The environment variable that turns tuning off (`0`, `off`, `false`, `no`).
pub const AUTOTUNE_ENV: &str = "STEPGRAPH_GEMM_AUTOTUNE";
/// The environment variable that adds split-k variants to the timed
/// candidates (`1`); off until measured on a GPU.
pub const SPLIT_K_ENV: &str = "STEPGRAPH_GEMM_SPLIT_K";
/// The environment variable that adds these kernels to tuning (`1`) or
/// makes them the only candidate where they apply (`only`).
pub const SKINNY_ENV: &str = "STEPGRAPH_GEMM_SKINNY";
/// The environment variable that adds these kernels to tuning (`1`) or
/// makes the first the only candidate where they apply (`only`).
pub const TILED_ENV: &str = "STEPGRAPH_GEMM_TILED";

// Programmatic dependent launch.

/// The environment variable ([`Switches::pdl`]) that
/// launches every stepgraph kernel with programmatic dependent launch, on devices of compute capability
/// 9.0 and later: each kernel may be scheduled while the kernel before it
/// in the stream finishes, its `sg_pdl_entry()` (common.cuh) waiting for
/// that kernel's results, so launch latency hides behind the previous
/// kernel's last blocks. Off until a GPU run has checked and timed it.
pub const PDL_ENV: &str = "STEPGRAPH_PDL";

/// Whether kernels launch with programmatic dependent launch on a device of
/// architecture `arch` (`sm_90`, ...): `switches` asks for it ([`PDL_ENV`])
/// and the device has `griddepcontrol` (sm_90 and later).
pub fn pdl_on(arch: &str, switches: &crate::switches::Switches) -> bool {
    switches.pdl && has_griddepcontrol(arch)
}

/// Does a device of architecture `arch` (`sm_90`, `sm_90a`, `sm_80`, ...)
/// have `griddepcontrol`: compute capability 9.0 or later?
fn has_griddepcontrol(arch: &str) -> bool {
    let cc = arch.strip_prefix("sm_").and_then(|v| v.trim_end_matches(char::is_alphabetic).parse::<u32>().ok());
    cc.is_some_and(|v| v >= 90)
}

#[cfg(test)]
mod tests {
    #[test]
    fn programmatic_launch_needs_hopper_or_later() {
        let cases =
            [("sm_90", true), ("sm_90a", true), ("sm_100", true), ("sm_89", false), ("sm_80", false), ("gpu", false)];
        for (arch, has) in cases {
            assert_eq!(super::has_griddepcontrol(arch), has, "{arch}");
        }
    }

    use super::*;

    fn parse(pairs: &[(&str, &str)]) -> Result<Switches> {
        Switches::from_vars(|var| pairs.iter().find(|(k, _)| *k == var).map(|(_, v)| v.to_string()))
    }

    #[test]
    fn unset_and_empty_variables_are_the_defaults() {
        let d = Switches::default();
        assert_eq!(parse(&[]).unwrap(), d);
        assert_eq!(parse(&[("STEPGRAPH_PDL", ""), ("STEPGRAPH_GEMM_CANDIDATES", " ")]).unwrap(), d);
        assert!(d.gemm_autotune && d.multi_tensor && !d.pdl && !d.portable_kernels && !d.decode_staging);
        assert!(!d.gemm_split_k && d.gemm_candidates == GemmCandidates(MAX_CANDIDATES));
        assert_eq!(
            (d.gemm_cublas, d.gemm_skinny, d.gemm_tiled),
            (CandidateUse::Off, CandidateUse::Off, CandidateUse::Off)
        );
        assert_eq!(d.attention, AttentionKernels::Auto);
        assert!(d.not_default().is_empty() && d.not_default_line().is_empty());
        assert_eq!(Switches::VARS.len(), 11);
    }

    #[test]
    fn every_boolean_spelling_parses_in_any_case() {
        for on in ["1", "on", "ON", "true", "True", " yes "] {
            let s = parse(&[("STEPGRAPH_PDL", on), ("STEPGRAPH_MULTI_TENSOR", on), ("STEPGRAPH_GEMM_SPLIT_K", on)]);
            let s = s.unwrap();
            assert!(s.pdl && s.multi_tensor && s.gemm_split_k, "{on}");
        }
        for off in ["0", "off", "OFF", "false", " no "] {
            let s = parse(&[("STEPGRAPH_GEMM_AUTOTUNE", off), ("STEPGRAPH_MULTI_TENSOR", off)]).unwrap();
            assert!(!s.gemm_autotune && !s.multi_tensor, "{off}");
        }
    }

    #[test]
    fn the_documented_values_keep_working() {
        let s = parse(&[
            ("STEPGRAPH_GEMM_AUTOTUNE", "0"),
            ("STEPGRAPH_GEMM_SKINNY", "only"),
            ("STEPGRAPH_GEMM_TILED", "1"),
            ("STEPGRAPH_GEMM_CUBLAS", "ONLY"),
            ("STEPGRAPH_ATTENTION", "simt"),
            ("STEPGRAPH_GEMM_CANDIDATES", " 32 "),
            ("STEPGRAPH_PORTABLE_KERNELS", "1"),
            ("STEPGRAPH_DECODE_STAGING", "1"),
        ])
        .unwrap();
        assert!(!s.gemm_autotune && s.portable_kernels && s.decode_staging);
        assert_eq!(
            (s.gemm_skinny, s.gemm_tiled, s.gemm_cublas),
            (CandidateUse::Only, CandidateUse::Candidate, CandidateUse::Only)
        );
        assert_eq!(s.attention, AttentionKernels::Simt);
        assert_eq!(s.gemm_candidates, GemmCandidates(32));
        assert!(!parse(&[("STEPGRAPH_GEMM_AUTOTUNE", "off")]).unwrap().gemm_autotune);
        assert_eq!(parse(&[("STEPGRAPH_GEMM_CANDIDATES", "1")]).unwrap().gemm_candidates, GemmCandidates(1));
    }

    #[test]
    fn candidate_switches_take_the_boolean_spellings_and_only() {
        let skinny = |v: &str| parse(&[(SKINNY_ENV, v)]).unwrap().gemm_skinny;
        assert_eq!(skinny("0"), CandidateUse::Off);
        assert_eq!(skinny("off"), CandidateUse::Off);
        assert_eq!(skinny("1"), CandidateUse::Candidate);
        assert_eq!(skinny(" 1"), CandidateUse::Candidate);
        assert_eq!(skinny("yes"), CandidateUse::Candidate);
        assert_eq!(skinny(" only"), CandidateUse::Only);
    }

    #[test]
    fn a_bad_value_is_an_error_naming_the_variable_and_the_accepted_values() {
        let e = parse(&[("STEPGRAPH_MULTI_TENSOR", "maybe")]).unwrap_err().to_string();
        assert!(e.contains("STEPGRAPH_MULTI_TENSOR=\"maybe\"") && e.contains(BOOL_VALUES), "{e}");
        let e = parse(&[("STEPGRAPH_GEMM_SKINNY", "sometimes")]).unwrap_err().to_string();
        assert!(e.contains("STEPGRAPH_GEMM_SKINNY") && e.contains("or only"), "{e}");
        let e = parse(&[("STEPGRAPH_ATTENTION", "tensor")]).unwrap_err().to_string();
        assert!(e.contains("STEPGRAPH_ATTENTION") && e.contains("auto or simt"), "{e}");
        for bad in ["0", "65", "many"] {
            let e = parse(&[("STEPGRAPH_GEMM_CANDIDATES", bad)]).unwrap_err().to_string();
            assert!(e.contains(CANDIDATES_ENV) && e.contains("1 to 64"), "{bad}: {e}");
        }
    }

    #[test]
    fn the_listing_names_what_differs_and_parses_back() {
        let s = parse(&[
            ("STEPGRAPH_MULTI_TENSOR", "no"),
            ("STEPGRAPH_GEMM_SKINNY", "only"),
            ("STEPGRAPH_GEMM_CANDIDATES", "16"),
            ("STEPGRAPH_PDL", "0"),
        ])
        .unwrap();
        let listed = s.not_default();
        assert_eq!(
            listed,
            vec![
                (CANDIDATES_ENV, "16".to_string()),
                (SKINNY_ENV, "only".to_string()),
                ("STEPGRAPH_MULTI_TENSOR", "off".to_string())
            ]
        );
        assert_eq!(
            s.not_default_line(),
            "STEPGRAPH_GEMM_CANDIDATES=16 STEPGRAPH_GEMM_SKINNY=only STEPGRAPH_MULTI_TENSOR=off"
        );
        let back = Switches::from_vars(|var| listed.iter().find(|(k, _)| *k == var).map(|(_, v)| v.clone())).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn serialized_names_are_the_fields_and_round_trip() {
        let s = Switches { multi_tensor: false, gemm_tiled: CandidateUse::Candidate, ..Switches::default() };
        let v = serde_json::to_value(s).unwrap();
        assert_eq!(v["multi_tensor"], serde_json::json!(false));
        assert_eq!(v["gemm_tiled"], serde_json::json!("on"));
        assert_eq!(v["gemm_candidates"], serde_json::json!(MAX_CANDIDATES));
        assert_eq!(v["attention"], serde_json::json!("auto"));
        assert_eq!(v.as_object().unwrap().len(), Switches::VARS.len());
        assert_eq!(serde_json::from_value::<Switches>(v).unwrap(), s);
    }
}

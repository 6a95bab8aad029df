//! The memory flags every command that builds a step shares (`plan`,
//! `trace`, `train`, `bench`): the memory budget that drives recomputation,
//! the recompute policy without one, where a train step's optimizer runs,
//! the MLP row tiles, whether adds fold into the kernels that produce
//! their operands (which also frees the sums they stored), and how f32
//! products are computed (their split operands are planned bytes). They map
//! onto [`StepOptions`]'s `recompute`, `optimizer`, `mlp_tiles`,
//! `epilogues` and `f32_products`.

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};

use stepgraph_core::passes::fusion::Epilogues;
use stepgraph_core::passes::optimizer_placement::OptimizerPlacement;
use stepgraph_core::passes::recompute::RecomputePolicy;
use stepgraph_core::passes::F32Products;
use stepgraph_core::pipeline::{Fp8Mode, StepOptions};

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum RecomputeArg {
    /// Recompute cheap values (pointwise, norms) whose inputs are kept anyway, when that lowers the peak.
    Auto,
    /// Keep every saved value.
    Off,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum PlacementArg {
    /// In backward unless that raises the planned peak.
    Auto,
    /// Each AdamW update right after its gradient is final.
    On,
    /// Every update after backward.
    Off,
}

#[derive(Args, Clone, Debug)]
pub struct MemoryArgs {
    /// Plan the step to fit this many bytes (persistent + arena) by
    /// recomputing saved activations in backward, cheapest first: a size
    /// with a unit (32GB, 500MB, 1.5GiB, 2.5e9) or `auto` (the free memory of
    /// the GPU, or of the host without one). A budget no recomputation can
    /// meet is refused, naming the smallest that works.
    #[arg(help_heading = "Memory", long, value_name = "BYTES|auto")]
    pub memory_budget: Option<String>,
    /// Without a budget: recompute cheap values when that lowers the peak (auto) or never (off).
    #[arg(help_heading = "Memory", long, value_enum, default_value_t = RecomputeArg::Auto, conflicts_with = "memory_budget")]
    pub recompute: RecomputeArg,
    /// Where a train step's AdamW updates run: in backward right after each
    /// gradient is final (on), after backward (off), or whichever plans lower (auto).
    #[arg(help_heading = "Memory", long, value_enum, default_value_t = PlacementArg::Auto)]
    pub optimizer_in_backward: PlacementArg,
    /// Split the rows of every MLP into this many tiles, run one after the
    /// other, so backward holds one tile's intermediates at a time. A
    /// memory budget these cannot meet tries twice as many, and again.
    #[arg(help_heading = "Memory", long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub mlp_tiles: u32,
    /// Fold adds into the products and norm backwards that produce their
    /// operands (the residual adds, gradients read by several products, a
    /// bias), as those kernels' epilogues (on), or keep each add a kernel (off).
    #[arg(help_heading = "Performance tuning", long, value_enum, default_value_t = EpilogueArg::On)]
    pub epilogues: EpilogueArg,
    /// How f32 matrix products are computed: exactly (CUDA-core SGEMM on a
    /// GPU), or each as three TF32 tensor-core products of operands split
    /// into a TF32 part and the rest (3xTF32: about f32 accuracy, several
    /// times faster on Ampere and later; the split operands cost planned
    /// bytes). bf16 and f16 steps have no f32 products.
    #[arg(help_heading = "Performance tuning", long, value_enum, default_value_t = F32ProductsArg::Exact)]
    pub f32_products: F32ProductsArg,
    /// Matrix products in 8-bit floats: `products` runs the decoder layers'
    /// linear layers (forward, input and weight gradients) as FP8 tensor-core
    /// products, e4m3 activations and weights, e5m2 gradients, each tensor
    /// scaled by its own amax in the same step; the output head, attention,
    /// the router, the experts of a mixture and LoRA adapters stay in the
    /// model's dtype. Needs an
    /// FP8-capable GPU (compute capability 8.9 or later) and a bf16 or f16
    /// model. Faster and a little less accurate: compare the loss curve.
    #[arg(help_heading = "Performance tuning", long, value_enum, default_value_t = Fp8Arg::Off)]
    pub fp8: Fp8Arg,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum Fp8Arg {
    Off,
    Products,
}

impl From<Fp8Arg> for Fp8Mode {
    fn from(a: Fp8Arg) -> Fp8Mode {
        match a {
            Fp8Arg::Off => Fp8Mode::Off,
            Fp8Arg::Products => Fp8Mode::Products,
        }
    }
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum F32ProductsArg {
    Exact,
    #[value(name = "3xtf32")]
    Split3xTf32,
}

impl From<F32ProductsArg> for F32Products {
    fn from(a: F32ProductsArg) -> F32Products {
        match a {
            F32ProductsArg::Exact => F32Products::Exact,
            F32ProductsArg::Split3xTf32 => F32Products::Split3xTf32,
        }
    }
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum EpilogueArg {
    On,
    Off,
}

impl From<EpilogueArg> for Epilogues {
    fn from(a: EpilogueArg) -> Epilogues {
        match a {
            EpilogueArg::On => Epilogues::On,
            EpilogueArg::Off => Epilogues::Off,
        }
    }
}

impl MemoryArgs {
    /// Sets the recompute policy and optimizer placement of `opts`;
    /// `free_bytes` answers `--memory-budget auto`.
    pub fn apply(&self, opts: &mut StepOptions, free_bytes: impl FnOnce() -> Result<u64>) -> Result<()> {
        opts.recompute = match (&self.memory_budget, self.recompute) {
            (Some(b), _) if b.trim().eq_ignore_ascii_case("auto") => {
                RecomputePolicy::Budget(free_bytes().context("--memory-budget auto: measuring free memory")?)
            }
            (Some(b), _) => RecomputePolicy::Budget(parse_bytes(b)?),
            (None, RecomputeArg::Auto) => RecomputePolicy::Auto,
            (None, RecomputeArg::Off) => RecomputePolicy::Off,
        };
        opts.optimizer = match self.optimizer_in_backward {
            PlacementArg::Auto => OptimizerPlacement::Auto,
            PlacementArg::On => OptimizerPlacement::InBackward,
            PlacementArg::Off => OptimizerPlacement::AfterBackward,
        };
        // Read under every policy: the fit verdict plans budgets of its own.
        opts.host_budget = host_budget()?;
        opts.mlp_tiles = self.mlp_tiles as usize;
        opts.epilogues = self.epilogues.into();
        opts.f32_products = self.f32_products.into();
        opts.fp8 = self.fp8.into();
        Ok(())
    }
}

/// Page-locked host memory a budgeted step may plan when it offloads a
/// value instead of recomputing it: three quarters of the host memory
/// available now ([`stepgraph_core::host::memory`]), leaving the rest to
/// the data, the checkpoint being read and the rest of the system; `None`
/// where that is unknown.
fn host_budget() -> Result<Option<u64>> {
    let host = stepgraph_core::host::memory::available()?;
    Ok(host.map(|h| h.available / 4 * 3))
}

/// Bytes of a flag given in MiB (`--max-shard-mb`, `--bucket-mb`), or
/// `default` without it; the size must be positive, at least one byte.
pub fn mib_flag(flag: &str, mib: Option<f64>, default: u64) -> Result<u64> {
    match mib {
        None => Ok(default),
        Some(mb) if mb.is_finite() && mb * 1048576.0 >= 1.0 => Ok((mb * 1048576.0).round() as u64),
        Some(mb) => bail!("{flag} must be a positive size in MiB, got {mb}"),
    }
}

/// Bytes from a size with an optional unit: B, kB/MB/GB/TB (powers of
/// 1000), KiB/MiB/GiB/TiB (powers of 1024); a plain number is bytes.
pub fn parse_bytes(text: &str) -> Result<u64> {
    parse_size("--memory-budget", text, ", or `auto`", false)
}

/// [`parse_bytes`] for `flag`, whose errors name it; `more` ends the list
/// of what it takes. With `as_sold`, kB to TB are powers of 1024, as
/// memory cards are sold (a "24GB" card holds 24 GiB).
pub fn parse_size(flag: &str, text: &str, more: &str, as_sold: bool) -> Result<u64> {
    let k = if as_sold { 1024.0 } else { 1000.0 };
    let t = text.trim();
    // The unit is the trailing run of letters, so an exponent (2.5e9) stays
    // part of the number.
    let split = t.trim_end_matches(|c: char| c.is_ascii_alphabetic()).len();
    let (number, unit) = t.split_at(split);
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" | "k" => k,
        "mb" | "m" => k * k,
        "gb" | "g" => k * k * k,
        "tb" | "t" => k * k * k * k,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024.0f64.powi(4),
        other => bail!("{flag} {text:?}: unknown unit {other:?}; use B, kB, MB, GB, TB, KiB, MiB, GiB or TiB{more}"),
    };
    let value: f64 = number
        .trim()
        .parse()
        .map_err(|_| anyhow::anyhow!("{flag} {text:?}: expected a size such as 32GB, 500MB or 2.5e9{more}"))?;
    let bytes = value * scale;
    if !((1.0..1.2e18).contains(&bytes)) {
        bail!("{flag} {text:?}: expected a positive size below 1 EB, got {bytes} bytes");
    }
    Ok(bytes as u64)
}

/// What `--memory-budget auto` plans for: the free memory of GPU 0 (less
/// 256 MiB for the CUDA libraries' workspaces and kernel modules, which
/// the plan does not hold) when there is a GPU, else the host memory
/// available (`MemAvailable`, a cgroup's limit, or
/// `STEPGRAPH_HOST_MEMORY_LIMIT`: [`stepgraph_core::host::memory`]), what
/// the CPU backend checks a plan against.
pub fn free_bytes() -> Result<u64> {
    const RESERVE: u64 = 256 << 20;
    if stepgraph_cuda::session::gpu_available() {
        let free = stepgraph_cuda::session::free_device_memory(0)?;
        return Ok(free.saturating_sub(RESERVE));
    }
    let host = stepgraph_core::host::memory::available()?.context(
        "the host memory available is unknown here (no /proc/meminfo or cgroup limit): give a size, or set \
         STEPGRAPH_HOST_MEMORY_LIMIT",
    )?;
    Ok(host.available)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Card sizes as sold: GB are GiB; the binary units and bytes are as ever;
    /// errors name the flag.
    #[test]
    fn card_sizes_read_gb_as_gib() {
        let sold = |t: &str| parse_size("--gpu-memory", t, "", true);
        assert_eq!(sold("24GB").unwrap(), 24 << 30);
        assert_eq!(sold("0.5TB").unwrap(), 1 << 39);
        assert_eq!(sold("80GiB").unwrap(), 80 << 30);
        assert_eq!(sold("1000").unwrap(), 1000);
        let e = sold("lots").unwrap_err().to_string();
        assert!(e.starts_with("--gpu-memory \"lots\": unknown unit") && !e.contains("auto"), "{e}");
    }

    #[test]
    fn sizes_parse_with_their_units() {
        assert_eq!(parse_bytes("32GB").unwrap(), 32_000_000_000);
        assert_eq!(parse_bytes("0.5GB").unwrap(), 500_000_000);
        assert_eq!(parse_bytes("500 MB").unwrap(), 500_000_000);
        assert_eq!(parse_bytes("1.5GiB").unwrap(), 1_610_612_736);
        assert_eq!(parse_bytes("2.5e9").unwrap(), 2_500_000_000);
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        for bad in ["", "GB", "-1GB", "0", "12 parsecs", "1e30", "nan", "inf"] {
            let e = parse_bytes(bad).unwrap_err().to_string();
            assert!(e.contains("--memory-budget"), "{bad}: {e}");
        }
    }

    #[test]
    fn the_flags_set_the_step_options() {
        let mut opts = StepOptions::new(stepgraph_core::autodiff::StepKind::Train);
        let args = MemoryArgs {
            memory_budget: Some("auto".into()),
            recompute: RecomputeArg::Auto,
            optimizer_in_backward: PlacementArg::Off,
            mlp_tiles: 4,
            epilogues: EpilogueArg::Off,
            f32_products: F32ProductsArg::Split3xTf32,
            fp8: Fp8Arg::Products,
        };
        args.apply(&mut opts, || Ok(123_000)).unwrap();
        assert_eq!(opts.recompute, RecomputePolicy::Budget(123_000));
        assert_eq!(opts.optimizer, OptimizerPlacement::AfterBackward);
        assert_eq!(opts.mlp_tiles, 4);
        assert_eq!(opts.epilogues, Epilogues::Off);
        assert_eq!(opts.f32_products, F32Products::Split3xTf32);
        assert_eq!(opts.fp8, Fp8Mode::Products);
        let args = MemoryArgs {
            memory_budget: None,
            recompute: RecomputeArg::Off,
            optimizer_in_backward: PlacementArg::On,
            mlp_tiles: 1,
            epilogues: EpilogueArg::On,
            f32_products: F32ProductsArg::Exact,
            fp8: Fp8Arg::Off,
        };
        args.apply(&mut opts, || unreachable!("no budget asked")).unwrap();
        assert_eq!(opts.recompute, RecomputePolicy::Off);
        assert_eq!(opts.optimizer, OptimizerPlacement::InBackward);
        assert_eq!(opts.mlp_tiles, 1);
        assert_eq!(opts.epilogues, Epilogues::On);
        assert_eq!(opts.f32_products, F32Products::Exact);
        assert_eq!(opts.fp8, Fp8Mode::Off);
    }
}

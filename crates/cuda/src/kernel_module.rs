//! One CUDA C kernel module's declaration: its name, its source (embedded
//! from `crates/cuda/kernels/`) and the `#define`s of a variant, and the
//! text NVRTC compiles for it. Every lowering declares the modules it
//! launches with this type; which modules exist is [`crate::kernels`].

/// The header every source starts with: dtype helpers and conversions.
pub const COMMON: &str = include_str!("../kernels/common.cuh");

/// One kernel module: its name (what [`crate::launch::KernelLaunch::module`]
/// names), its source and the text prepended to it: a variant's `#define`s,
/// or a header the module shares with others (empty for a plain source).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct KernelModule {
    pub name: &'static str,
    pub source: &'static str,
    pub defines: &'static str,
    /// Compiled for the architecture-specific target (`sm_90a` on an
    /// `sm_90` device): it uses instructions that only that architecture
    /// has (warpgroup MMA), so lowerings name it only for such a device
    /// ([`crate::ops::Target`]).
    pub arch_specific: bool,
}

impl KernelModule {
    /// A plain source compiled as it is.
    pub const fn plain(name: &'static str, source: &'static str) -> Self {
        KernelModule { name, source, defines: "", arch_specific: false }
    }

    /// A source with a shared header (such as `kernels/activation.cuh`)
    /// before it.
    pub const fn with_header(name: &'static str, header: &'static str, source: &'static str) -> Self {
        KernelModule { name, source, defines: header, arch_specific: false }
    }

    /// The full text NVRTC compiles: the shared header, the defines, the source.
    pub fn text(&self) -> String {
        format!("{COMMON}\n{}#line 1 \"{}.cu\"\n{}", self.defines, self.name, self.source)
    }

    /// The target it is built for on a device of `arch` (`sm_90`): that
    /// architecture's specific target (`sm_90a`) when it is [`Self::arch_specific`].
    pub fn target(&self, arch: &str) -> String {
        if self.arch_specific {
            format!("{arch}a")
        } else {
            arch.to_string()
        }
    }
}

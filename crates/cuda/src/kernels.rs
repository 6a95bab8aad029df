//! The CUDA C kernel modules: which exist and the text NVRTC compiles for
//! each. The sources live in `crates/cuda/kernels/` and are embedded in the
//! binary; each op's lowering declares the modules it launches
//! ([`crate::ops::Lower::KERNELS`]), and the module list here is derived from
//! the op list, so a new op with a new source needs no edit of this file.
//! The session's own kernels (initial weights, [`crate::init`]) join the
//! list after the ops'.
//!
//! A module is one source with the shared header `common.cuh` and, for a
//! variant, a few `#define`s prepended (NVRTC has no file system of our
//! own). Variants exist where one source would otherwise instantiate many
//! large kernels of which a step uses one or two: each tensor-core attention
//! variant (dtype × head width) is its own module, so a run compiles and
//! loads only the ones it launches.
//!
//! **Invariant:** module names are unique; two ops naming one module give
//! the same source and defines (checked by `every_module_has_one_source`).

use crate::error::{CudaError, Result};
pub use crate::kernel_module::{KernelModule, COMMON};

/// Every module the op list declares, each once, in op-list order, then
/// the session's own.
pub fn all() -> impl Iterator<Item = &'static KernelModule> {
    declared().enumerate().filter(move |(i, m)| declared().take(*i).all(|e| e.name != m.name)).map(|(_, m)| m)
}

/// Every declaration, repeats included: the ops' modules, then the
/// session's (initial weights) and the products' own.
fn declared() -> impl Iterator<Item = &'static KernelModule> {
    crate::ops::KERNELS_BY_OP.iter().flat_map(|m| m.iter()).chain(crate::init::KERNELS).chain(crate::blas::KERNELS)
}

/// Every module name.
pub fn modules() -> impl Iterator<Item = &'static str> {
    all().map(|m| m.name)
}

/// The declaration of `module`.
pub fn module(name: &str) -> Option<&'static KernelModule> {
    all().find(|m| m.name == name)
}

/// Compiles the module named `name` for `arch` ([`crate::nvrtc::compile`]).
pub fn compile(name: &str, arch: &str) -> Result<Vec<u8>> {
    let m = module(name).ok_or_else(|| CudaError::Compile {
        source_name: name.into(),
        arch: arch.into(),
        log: "no such kernel source".into(),
    })?;
    crate::nvrtc::compile(m, arch)
}

/// The full text NVRTC compiles for `module`.
pub fn module_source(module: &str) -> Option<String> {
    self::module(module).map(KernelModule::text)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel of every module starts its body with `sg_pdl_entry()`,
    /// before anything touches global memory: what makes launching any of
    /// them with programmatic dependent launch safe
    /// ([`crate::launch::launch_kernel`]).
    #[test]
    fn every_kernel_waits_for_its_dependencies_first() {
        let mut kernels = 0;
        for m in all() {
            let src = m.source;
            for (at, _) in src.match_indices("extern \"C\"") {
                let params = at + src[at..].find('(').expect("a kernel has parameters");
                let mut depth = 0;
                let close = params
                    + src[params..]
                        .char_indices()
                        .find(|&(_, c)| {
                            depth += match c {
                                '(' => 1,
                                ')' => -1,
                                _ => 0,
                            };
                            depth == 0
                        })
                        .expect("balanced parentheses")
                        .0;
                let body = close + src[close..].find('{').expect("a kernel has a body") + 1;
                let first = src[body..].trim_start();
                assert!(
                    first.starts_with("sg_pdl_entry();"),
                    "module `{}`: the kernel at byte {at} begins with `{}`",
                    m.name,
                    &first[..first.len().min(60)]
                );
                kernels += 1;
            }
        }
        assert!(kernels >= 64, "{kernels} kernel definitions found");
    }

    #[test]
    fn every_module_has_one_source() {
        let declared: Vec<&KernelModule> = declared().collect();
        for m in &declared {
            let first = declared.iter().find(|e| e.name == m.name).unwrap();
            assert_eq!(*first, *m, "module `{}` is declared with two sources", m.name);
        }
        let names: Vec<_> = modules().collect();
        let mut unique = names.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), names.len(), "module names repeat");
        for m in ["elementwise", "reduce", "movement", "embedding", "adamw", "norm", "rope", "softmax", "loss", "init"]
        {
            assert!(names.contains(&m), "no module {m}");
        }
        for m in names {
            let src = module_source(m).unwrap();
            assert!(src.starts_with(COMMON));
        }
        assert!(module_source("nope").is_none());
        // Plain sources keep the text (and so the cache key) they always had.
        let plain = module_source("softmax").unwrap();
        assert!(plain.starts_with(&format!("{COMMON}\n#line 1 \"softmax.cu\"\n")));
        let v = module_source("attention_mma_d112_f16").unwrap();
        assert!(v.contains("#define SGM_DP 112\n") && v.contains("#define SGM_TYPE __half\n"));
    }
}

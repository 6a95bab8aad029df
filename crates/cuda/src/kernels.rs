//! The CUDA C kernel sources, kept in `crates/cuda/kernels/` and embedded in
//! the binary, and the modules compiled from them. A module is one source
//! with the shared header `common.cuh` and, for a variant, a few `#define`s
//! prepended (NVRTC has no file system of our own). Variants exist where one
//! source would otherwise instantiate many large kernels of which a step uses
//! one or two: each tensor-core attention variant (dtype × head width) is its
//! own module, so a run compiles and loads only the ones it launches.

/// The header every source starts with: dtype helpers and conversions.
pub const COMMON: &str = include_str!("../kernels/common.cuh");

const ATTENTION_MMA: &str = include_str!("../kernels/attention_mma.cu");

/// `(module name, source)` for every plain kernel source.
pub const SOURCES: &[(&str, &str)] = &[
    ("elementwise", include_str!("../kernels/elementwise.cu")),
    ("reduce", include_str!("../kernels/reduce.cu")),
    ("movement", include_str!("../kernels/movement.cu")),
    ("embedding", include_str!("../kernels/embedding.cu")),
    ("adamw", include_str!("../kernels/adamw.cu")),
    ("norm", include_str!("../kernels/norm.cu")),
    ("rope", include_str!("../kernels/rope.cu")),
    ("softmax", include_str!("../kernels/softmax.cu")),
    ("loss", include_str!("../kernels/loss.cu")),
    ("attention", include_str!("../kernels/attention.cu")),
];

macro_rules! mma_variants {
    ($(($name:literal, $sfx:literal, $ty:literal, $dp:literal)),* $(,)?) => {
        &[$(($name, ATTENTION_MMA, concat!(
            "#define SGM_SFX ", $sfx, "\n#define SGM_TYPE ", $ty, "\n#define SGM_DP ", $dp, "\n"
        ))),*]
    };
}

/// `(module name, source, defines)` for every variant module.
pub const VARIANTS: &[(&str, &str, &str)] = mma_variants![
    ("attention_mma_d32_bf16", "bf16", "__nv_bfloat16", "32"),
    ("attention_mma_d48_bf16", "bf16", "__nv_bfloat16", "48"),
    ("attention_mma_d64_bf16", "bf16", "__nv_bfloat16", "64"),
    ("attention_mma_d80_bf16", "bf16", "__nv_bfloat16", "80"),
    ("attention_mma_d96_bf16", "bf16", "__nv_bfloat16", "96"),
    ("attention_mma_d112_bf16", "bf16", "__nv_bfloat16", "112"),
    ("attention_mma_d128_bf16", "bf16", "__nv_bfloat16", "128"),
    ("attention_mma_d32_f16", "f16", "__half", "32"),
    ("attention_mma_d48_f16", "f16", "__half", "48"),
    ("attention_mma_d64_f16", "f16", "__half", "64"),
    ("attention_mma_d80_f16", "f16", "__half", "80"),
    ("attention_mma_d96_f16", "f16", "__half", "96"),
    ("attention_mma_d112_f16", "f16", "__half", "112"),
    ("attention_mma_d128_f16", "f16", "__half", "128"),
    ("attention_mma_d32_f32", "f32", "float", "32"),
    ("attention_mma_d48_f32", "f32", "float", "48"),
    ("attention_mma_d64_f32", "f32", "float", "64"),
    ("attention_mma_d80_f32", "f32", "float", "80"),
    ("attention_mma_d96_f32", "f32", "float", "96"),
    ("attention_mma_d112_f32", "f32", "float", "112"),
    ("attention_mma_d128_f32", "f32", "float", "128"),
];

/// Every module name: plain sources, then variants.
pub fn modules() -> impl Iterator<Item = &'static str> {
    SOURCES.iter().map(|(m, _)| *m).chain(VARIANTS.iter().map(|(m, _, _)| *m))
}

/// The full text NVRTC compiles for `module`.
pub fn module_source(module: &str) -> Option<String> {
    if let Some((name, src)) = SOURCES.iter().find(|(name, _)| *name == module) {
        return Some(format!("{COMMON}\n#line 1 \"{name}.cu\"\n{src}"));
    }
    VARIANTS
        .iter()
        .find(|(name, _, _)| *name == module)
        .map(|(name, src, defines)| format!("{COMMON}\n{defines}#line 1 \"{name}.cu\"\n{src}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_module_has_one_source() {
        let names: Vec<_> = modules().collect();
        let mut unique = names.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), names.len(), "module names repeat");
        for m in names {
            let src = module_source(m).unwrap();
            assert!(src.starts_with(COMMON));
        }
        assert!(module_source("nope").is_none());
        let v = module_source("attention_mma_d112_f16").unwrap();
        assert!(v.contains("#define SGM_DP 112\n") && v.contains("#define SGM_TYPE __half\n"));
    }
}

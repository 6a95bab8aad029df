//! The CUDA C kernel sources, kept in `crates/cuda/kernels/` and embedded in
//! the binary. Each source is compiled as its own module with the shared
//! header `common.cuh` prepended (NVRTC has no file system of our own).

/// The header every source starts with: dtype helpers and conversions.
pub const COMMON: &str = include_str!("../kernels/common.cuh");

/// `(module name, source)` for every kernel source.
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

/// The full text NVRTC compiles for `module`.
pub fn module_source(module: &str) -> Option<String> {
    SOURCES
        .iter()
        .find(|(name, _)| *name == module)
        .map(|(name, src)| format!("{COMMON}\n#line 1 \"{name}.cu\"\n{src}"))
}

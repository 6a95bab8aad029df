//! Run-time compilation of the kernel sources with NVRTC, to CUBIN for the
//! device's architecture, cached on disk keyed by the SHA-256 of the source,
//! the architecture and the NVRTC version.
//!
//! NVRTC works without a GPU (the `nvidia-cuda-nvrtc` wheel), so CI compiles
//! every kernel for `sm_90` and a kernel that does not build fails CI.

use std::ffi::{c_char, CStr, CString};
use std::path::PathBuf;

use sha2::{Digest, Sha256};

use crate::error::{CudaError, Result};
use crate::kernel_module::KernelModule;

/// Is the NVRTC library loadable here?
pub fn available() -> bool {
    // SAFETY: only dlopens the library and reports whether it was found;
    // no NVRTC function is called through it.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// For CPU tests of a module's kernels: its sm_90 CUBIN where NVRTC is
/// installed (CI); elsewhere `None`, after saying why, unless
/// `STEPGRAPH_REQUIRE_NVRTC` is set, which turns a missing NVRTC into a
/// failure.
#[cfg(test)]
pub(crate) fn test_cubin(module: &KernelModule) -> Option<Vec<u8>> {
    if !available() {
        eprintln!("NVRTC not found: CUBIN check of `{}` skipped (see .ci/run)", module.name);
        assert!(
            std::env::var_os("STEPGRAPH_REQUIRE_NVRTC").is_none(),
            "STEPGRAPH_REQUIRE_NVRTC is set but NVRTC is missing"
        );
        return None;
    }
    Some(compile(module, "sm_90").unwrap_or_else(|e| panic!("{e}")))
}

fn require() -> Result<()> {
    if available() {
        Ok(())
    } else {
        Err(CudaError::Missing {
            lib: "nvrtc",
            hint: "install the CUDA toolkit or the `nvidia-cuda-nvrtc` wheel and put its lib folder on LD_LIBRARY_PATH"
                .into(),
        })
    }
}

/// NVRTC's version as (major, minor).
pub fn version() -> Result<(i32, i32)> {
    require()?;
    let (mut a, mut b) = (0, 0);
    // SAFETY: NVRTC is loaded (checked by `require`); the call writes two ints
    // through pointers to live locals.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut a, &mut b) }
        .result()
        .map_err(|e| CudaError::Driver(format!("nvrtcVersion: {e:?}")))?;
    Ok((a, b))
}

/// Folders holding the CUDA headers NVRTC needs (`cuda_bf16.h`, `cuda_fp16.h`):
/// `$CUDA_INCLUDE`, then the toolkit's.
pub fn include_dirs() -> Vec<String> {
    let mut dirs = Vec::new();
    if let Ok(d) = std::env::var("CUDA_INCLUDE") {
        dirs.push(d);
    }
    for d in ["/usr/local/cuda/include", "/usr/local/cuda-13.0/include"] {
        if std::path::Path::new(d).join("cuda_bf16.h").exists() {
            dirs.push(d.into());
        }
    }
    dirs
}

fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("STEPGRAPH_KERNEL_CACHE") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    home.join("stepgraph").join("kernels")
}

/// Compiles `m` to CUBIN for `arch` (e.g. `sm_90`; `sm_90a` for a
/// module declared [`KernelModule::arch_specific`]), from the disk cache
/// when it is there. ([`crate::kernels::compile`] finds a module by name.)
pub fn compile(m: &KernelModule, arch: &str) -> Result<Vec<u8>> {
    let module = m.name;
    let (src, target) = (m.text(), m.target(arch));
    let arch = target.as_str();
    let (maj, min) = version()?;
    let key = {
        let mut h = Sha256::new();
        h.update(src.as_bytes());
        h.update(arch.as_bytes());
        h.update(format!("nvrtc {maj}.{min}").as_bytes());
        h.finalize().iter().map(|b| format!("{b:02x}")).collect::<String>()
    };
    let path = cache_dir().join(format!("{module}-{arch}-{key}.cubin"));
    if let Ok(bytes) = std::fs::read(&path) {
        return Ok(bytes);
    }
    let cubin = compile_uncached(module, &src, arch)?;
    // The cache is an optimisation: a read-only home must not fail the run.
    // Written through a temporary file and a rename so a reader never sees half a file.
    if std::fs::create_dir_all(path.parent().expect("cache path has a parent")).is_ok() {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &cubin).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok(cubin)
}

/// An NVRTC program, destroyed when dropped: every path out of
/// [`compile_uncached`], errors included, frees it.
struct Program(cudarc::nvrtc::sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by `create_program`, is owned by
        // this guard alone and is destroyed exactly once, here.
        unsafe { cudarc::nvrtc::result::destroy_program(self.0) }.ok();
    }
}

fn compile_uncached(module: &str, src: &str, arch: &str) -> Result<Vec<u8>> {
    use cudarc::nvrtc::result as nr;
    require()?;
    let fail = |log: String| CudaError::Compile { source_name: module.into(), arch: arch.into(), log };
    let csrc = CString::new(src).map_err(|_| fail("source contains a NUL byte".into()))?;
    let name = CString::new(format!("{module}.cu")).expect("module names have no NUL");
    let prog = Program(nr::create_program(&csrc, Some(&name)).map_err(|e| fail(format!("{e:?}")))?);
    let mut opts = vec![format!("--gpu-architecture={arch}"), "--std=c++17".to_string(), "-lineinfo".to_string()];
    for d in include_dirs() {
        opts.push(format!("--include-path={d}"));
    }
    // Register and spill counts per kernel, for tuning kernels.
    let verbose = std::env::var_os("STEPGRAPH_NVRTC_VERBOSE").is_some();
    if verbose {
        opts.push("--ptxas-options=-v".into());
    }
    // The log of a compiled program, as text.
    let log = || -> Option<String> {
        // SAFETY: `prog` is live and was compiled; the log is a NUL-terminated
        // string that NVRTC wrote into a buffer we own.
        let raw = unsafe { nr::get_program_log(prog.0) }.ok()?;
        // SAFETY: as above, `raw` ends with a NUL within its length.
        Some(unsafe { CStr::from_ptr(raw.as_ptr()) }.to_string_lossy().to_string())
    };
    // SAFETY: `prog` is a live program; options are plain strings.
    if unsafe { nr::compile_program(prog.0, &opts) }.is_err() {
        return Err(fail(log().unwrap_or_default()));
    }
    if verbose {
        if let Some(log) = log() {
            eprintln!("{module}: {log}");
        }
    }
    let mut size = 0usize;
    // SAFETY: `prog` compiled successfully; the size query writes one
    // usize and the copy writes exactly `size` bytes into a buffer of that size.
    let cubin = unsafe {
        cudarc::nvrtc::sys::nvrtcGetCUBINSize(prog.0, &mut size).result().map_err(|e| fail(format!("{e:?}")))?;
        let mut buf = vec![0u8; size];
        cudarc::nvrtc::sys::nvrtcGetCUBIN(prog.0, buf.as_mut_ptr() as *mut c_char)
            .result()
            .map_err(|e| fail(format!("{e:?}")))?;
        buf
    };
    Ok(cubin)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel source compiles for Hopper. Runs wherever NVRTC is
    /// installed (CI installs the wheel); elsewhere it says why it did nothing.
    #[test]
    fn every_kernel_compiles_for_sm_90() {
        if !available() {
            eprintln!("NVRTC not found: kernel compile check skipped (see .ci/run)");
            assert!(
                std::env::var_os("STEPGRAPH_REQUIRE_NVRTC").is_none(),
                "STEPGRAPH_REQUIRE_NVRTC is set but NVRTC is missing"
            );
            return;
        }
        let dir = std::env::temp_dir().join(format!("stepgraph-nvrtc-test-{}", std::process::id()));
        std::env::set_var("STEPGRAPH_KERNEL_CACHE", &dir);
        for module in crate::kernels::modules() {
            let cubin = crate::kernels::compile(module, "sm_90").unwrap_or_else(|e| panic!("{e}"));
            assert!(cubin.len() > 100, "{module}: empty CUBIN");
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}

//! Host memory: how much this process may still allocate, and fallible
//! allocation, so that the CPU backend refuses a plan larger than the
//! memory available before it allocates anything, as the CUDA backend does
//! with device memory, and an allocation that still fails is an error, not
//! an abort.
//!
//! Available memory is the least of:
//! - `MemAvailable` in `/proc/meminfo` (what the kernel can hand out
//!   without swapping);
//! - for the cgroup of this process and each cgroup above it, its limit
//!   less its usage: `memory.max − memory.current` (cgroup v2) or
//!   `memory.limit_in_bytes − memory.usage_in_bytes` (v1), where a limit
//!   is set.
//!
//! [`HOST_MEMORY_LIMIT_ENV`] (`STEPGRAPH_HOST_MEMORY_LIMIT=BYTES`) replaces
//! all of these with a number: tests use it to stand for a small machine,
//! and a user can keep a run below what the machine shows. Where none of
//! the sources can be read (not Linux), nothing is refused in advance and
//! only a failed allocation is reported.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The environment variable that sets the host memory available, in bytes.
pub const HOST_MEMORY_LIMIT_ENV: &str = "STEPGRAPH_HOST_MEMORY_LIMIT";

/// Host memory this process may still allocate, and where the number comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostMemory {
    pub available: u64,
    /// What set `available`: the environment variable, `MemAvailable`, or a cgroup's limit.
    pub source: String,
}

/// The host memory available now (see the module doc); `Ok(None)` where no
/// source can be read. A malformed [`HOST_MEMORY_LIMIT_ENV`] is an error.
pub fn available() -> Result<Option<HostMemory>> {
    if let Some(text) = std::env::var_os(HOST_MEMORY_LIMIT_ENV) {
        let text = text.to_string_lossy();
        let available = text.trim().parse::<u64>().map_err(|_| {
            Error::Cpu(format!("{HOST_MEMORY_LIMIT_ENV}={text:?}: expected a number of bytes, such as 8000000000"))
        })?;
        return Ok(Some(HostMemory { available, source: format!("{HOST_MEMORY_LIMIT_ENV}={available}") }));
    }
    let mut least: Option<HostMemory> = None;
    let mut consider = |available: u64, source: String| {
        if least.as_ref().is_none_or(|l| available < l.available) {
            least = Some(HostMemory { available, source });
        }
    };
    if let Some(kb) = std::fs::read_to_string("/proc/meminfo").ok().as_deref().and_then(mem_available_kb) {
        consider(kb.saturating_mul(1024), "MemAvailable in /proc/meminfo".into());
    }
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    for (dir, limit_file, usage_file) in cgroup_dirs(&cgroups, Path::new("/sys/fs/cgroup")) {
        let read = |file: &str| std::fs::read_to_string(dir.join(file)).ok();
        // "max" (v2) or a number near i64::MAX (v1) means no limit.
        let limit = read(limit_file).and_then(|t| t.trim().parse::<u64>().ok()).filter(|&l| l < 1 << 62);
        let usage = read(usage_file).and_then(|t| t.trim().parse::<u64>().ok());
        if let (Some(limit), Some(usage)) = (limit, usage) {
            consider(
                limit.saturating_sub(usage),
                format!("the cgroup limit {} less its usage {usage}", dir.join(limit_file).display()),
            );
        }
    }
    Ok(least)
}

/// `MemAvailable` of a `/proc/meminfo` text, in kB.
fn mem_available_kb(meminfo: &str) -> Option<u64> {
    meminfo.lines().find_map(|l| l.strip_prefix("MemAvailable:"))?.trim().trim_end_matches("kB").trim().parse().ok()
}

/// The memory cgroup directories of this process under `root` (from the
/// text of `/proc/self/cgroup`), its own first and then each one above it,
/// each with its limit and usage file names: cgroup v2 (`0::/path`) and v1
/// (a line whose controllers include `memory`).
fn cgroup_dirs(proc_cgroup: &str, root: &Path) -> Vec<(PathBuf, &'static str, &'static str)> {
    let mut dirs = Vec::new();
    for line in proc_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else { continue };
        let (base, limit, usage) = if controllers.is_empty() {
            (root.to_path_buf(), "memory.max", "memory.current")
        } else if controllers.split(',').any(|c| c == "memory") {
            (root.join("memory"), "memory.limit_in_bytes", "memory.usage_in_bytes")
        } else {
            continue;
        };
        let mut dir = base.join(path.trim_start_matches('/'));
        loop {
            dirs.push((dir.clone(), limit, usage));
            if dir == base || !dir.pop() {
                break;
            }
        }
    }
    dirs
}

/// Refuses `needed` bytes for `what` when more than the host memory
/// available, naming both numbers and where the available one comes from.
pub fn check_fits(needed: u64, what: &str) -> Result<()> {
    match available()? {
        Some(host) if needed > host.available => {
            Err(Error::HostMemory { what: what.to_string(), needed, available: host.available, origin: host.source })
        }
        _ => Ok(()),
    }
}

/// An empty vector with room for `len` elements, or an error naming
/// `what` when the allocation fails (instead of aborting the process).
pub fn try_with_capacity<T>(len: usize, what: &str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| Error::Allocation {
        what: what.to_string(),
        bytes: (len as u128 * std::mem::size_of::<T>() as u128).min(u64::MAX as u128) as u64,
    })?;
    Ok(v)
}

/// A vector of `len` copies of `value`, or an error naming `what` when the
/// allocation fails (instead of aborting the process).
pub fn try_vec<T: Clone>(len: usize, value: T, what: &str) -> Result<Vec<T>> {
    let mut v = try_with_capacity(len, what)?;
    v.resize(len, value);
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_available_is_read_in_kb() {
        let text = "MemTotal:       32000000 kB\nMemFree:  1000 kB\nMemAvailable:   24115384 kB\n";
        assert_eq!(mem_available_kb(text), Some(24115384));
        assert_eq!(mem_available_kb("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn cgroup_dirs_of_v1_and_v2_walk_up_to_the_root() {
        let root = Path::new("/cg");
        let v1 = "4:memory:/a/b\n3:cpuset:/\n";
        let dirs: Vec<String> = cgroup_dirs(v1, root).iter().map(|d| d.0.display().to_string()).collect();
        assert_eq!(dirs, ["/cg/memory/a/b", "/cg/memory/a", "/cg/memory"]);
        assert_eq!(cgroup_dirs(v1, root)[0].1, "memory.limit_in_bytes");
        let v2 = "0::/user.slice/x\n";
        let dirs = cgroup_dirs(v2, root);
        let names: Vec<String> = dirs.iter().map(|d| d.0.display().to_string()).collect();
        assert_eq!(names, ["/cg/user.slice/x", "/cg/user.slice", "/cg"]);
        assert_eq!((dirs[0].1, dirs[0].2), ("memory.max", "memory.current"));
        assert!(cgroup_dirs("1:cpu:/\n", root).is_empty());
    }

    #[test]
    fn a_failed_allocation_is_an_error() {
        let err = try_vec(usize::MAX / 8, 0u64, "a test buffer").unwrap_err().to_string();
        assert!(err.contains("a test buffer") && err.contains("bytes"), "{err}");
        assert_eq!(try_vec(3, 7u8, "small").unwrap(), [7, 7, 7]);
        assert!(try_with_capacity::<u32>(usize::MAX / 2, "huge").is_err());
    }
}

//! Outputs are checked before the work: every command that writes a file
//! or a folder calls [`refuse_overwriting_inputs`] and [`check_writable`]
//! on it before it reads, tokenizes or trains anything, so a mistake in a
//! path costs nothing and never replaces what the command reads.
//!
//! Paths are compared after resolving `..` and symbolic links; a path that
//! does not exist yet is resolved through its deepest existing ancestor
//! (the rest cannot hold links, since it does not exist), so
//! `runs/../data/x.txt` and a link to `data/` name the same file as
//! `data/x.txt` does.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

use anyhow::{anyhow, bail, Result};

/// `path` made absolute, with every link and `..` of its existing part
/// resolved and the `..` of the rest removed lexically.
pub fn resolve(path: &Path) -> Result<PathBuf> {
    let absolute = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .map_err(|e| anyhow!("reading the current folder to resolve {}: {e}", path.display()))?
            .join(path)
    };
    // The deepest ancestor that resolves, and the components after it.
    let mut base = absolute.as_path();
    let mut rest: Vec<Component> = Vec::new();
    let resolved = loop {
        match base.canonicalize() {
            Ok(p) => break p,
            Err(_) => {
                let Some(parent) = base.parent() else { break PathBuf::from("/") };
                rest.extend(base.components().next_back());
                base = parent;
            }
        }
    };
    let mut out = resolved;
    for c in rest.into_iter().rev() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other.as_os_str()),
        }
    }
    Ok(out)
}

/// Whether two existing paths are one file (a hard link of it included).
fn same_inode(a: &Path, b: &Path) -> bool {
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// `path` as given, with what it resolves to when that differs.
fn shown(given: &Path, resolved: &Path) -> String {
    let absolute = std::env::current_dir().map(|d| d.join(given)).unwrap_or_else(|_| given.to_path_buf());
    if absolute == resolved {
        given.display().to_string()
    } else {
        format!("{} (that is {})", given.display(), resolved.display())
    }
}

/// Refuses an output `out` (given as `flag`) that would replace or change
/// one of `inputs` (each with the flag that gave it): the same file, a
/// place equal to or inside an input folder, or an output folder that
/// holds an input (writing the folder replaces what it holds). Paths are
/// compared resolved ([`resolve`]), and existing files also by inode, so
/// `..`, symbolic and hard links are seen through.
pub fn refuse_overwriting_inputs(flag: &str, out: &Path, inputs: &[(&str, &Path)]) -> Result<()> {
    let out_r = resolve(out)?;
    for &(in_flag, input) in inputs {
        let in_r = resolve(input)?;
        let is_dir = in_r.is_dir();
        let kind = if is_dir { "folder" } else { "file" };
        let (o, i) = (shown(out, &out_r), shown(input, &in_r));
        if out_r == in_r || same_inode(&out_r, &in_r) {
            bail!("{flag} {o} is the {in_flag} {kind} {i}: writing there would replace it; choose another path");
        }
        if is_dir && out_r.starts_with(&in_r) {
            bail!(
                "{flag} {o} is inside the {in_flag} folder {i}: writing there would change an input; choose a path \
                 outside it"
            );
        }
        if in_r.starts_with(&out_r) {
            bail!(
                "{flag} {o} holds the {in_flag} {kind} {i}: writing {flag} would replace it; choose a path that \
                 holds no input"
            );
        }
    }
    Ok(())
}

/// A byte count for people: `512 B`, `3.4 MB`, `1.20 GB`.
pub fn human_bytes(b: u64) -> String {
    match b {
        0..1_000 => format!("{b} B"),
        1_000..1_000_000 => format!("{:.1} kB", b as f64 / 1e3),
        1_000_000..1_000_000_000 => format!("{:.1} MB", b as f64 / 1e6),
        _ => format!("{:.2} GB", b as f64 / 1e9),
    }
}

/// Bytes free to an unprivileged writer on the filesystem of `dir`.
pub fn free_bytes(dir: &Path) -> std::io::Result<u64> {
    let c = CString::new(dir.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    // SAFETY: `statvfs` only writes the struct it is given, and `c` is a
    // NUL-terminated path that outlives the call.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    #[allow(clippy::unnecessary_cast)] // The field types differ between platforms.
    Ok((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// Checks that `path` (given as `flag`) can be written, before any work:
/// the folders above it are created, a temporary file is created and
/// removed in the folder that will hold it, and that folder's filesystem
/// must have `bytes_needed` free. A folder output whose files go inside it
/// is checked by passing a path inside it.
pub fn check_writable(flag: &str, path: &Path, bytes_needed: u64) -> Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let p = path.display();
    if let Err(e) = std::fs::create_dir_all(&dir) {
        bail!("{flag} {p}: cannot create the folder {} ({e}); choose a writable place", dir.display());
    }
    if !dir.is_dir() {
        bail!("{flag} {p}: {} is not a folder; choose a writable place", dir.display());
    }
    match tempfile::Builder::new().prefix(".stepgraph-write-check-").tempfile_in(&dir) {
        // Dropping the file removes it.
        Ok(probe) => drop(probe),
        Err(e) => bail!("{flag} {p}: cannot write in {} ({e}); choose a writable place", dir.display()),
    }
    let free =
        free_bytes(&dir).map_err(|e| anyhow!("{flag} {p}: cannot read the free space of {} ({e})", dir.display()))?;
    if free < bytes_needed {
        bail!(
            "{flag} {p} needs about {} but the filesystem of {} has {} free; free some space or choose another place",
            human_bytes(bytes_needed),
            dir.display(),
            human_bytes(free)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(r: Result<()>) -> String {
        format!("{:#}", r.expect_err("should be refused"))
    }

    #[test]
    fn resolve_sees_through_links_and_dots_also_for_new_paths() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().canonicalize().unwrap();
        std::fs::create_dir(root.join("data")).unwrap();
        std::fs::write(root.join("data/x.txt"), "text").unwrap();
        std::os::unix::fs::symlink(root.join("data"), root.join("link")).unwrap();
        assert_eq!(resolve(&root.join("link/x.txt")).unwrap(), root.join("data/x.txt"));
        assert_eq!(resolve(&root.join("data/../data/x.txt")).unwrap(), root.join("data/x.txt"));
        // Not there yet: through the link, and through folders that do not exist.
        assert_eq!(resolve(&root.join("link/new/y.tokens")).unwrap(), root.join("data/new/y.tokens"));
        assert_eq!(resolve(&root.join("link/no/../x.txt")).unwrap(), root.join("data/x.txt"));
    }

    #[test]
    fn an_output_onto_an_input_is_refused_naming_both_flags() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path();
        std::fs::create_dir_all(root.join("data/tok")).unwrap();
        let input = root.join("data/x.txt");
        std::fs::write(&input, "text").unwrap();
        std::fs::write(root.join("data/tok/tokenizer.json"), "{}").unwrap();
        std::os::unix::fs::symlink(root.join("data"), root.join("link")).unwrap();
        std::fs::hard_link(&input, root.join("hard.txt")).unwrap();
        let tok = root.join("data/tok");
        let inputs = [("--input", input.as_path()), ("--tokenizer", tok.as_path())];
        let e = err(refuse_overwriting_inputs("--out", &input, &inputs));
        assert!(e.contains("--out") && e.contains("is the --input file") && e.contains("x.txt"), "{e}");
        assert!(e.contains("would replace it"), "{e}");
        for same in ["data/tok/../x.txt", "link/x.txt", "hard.txt", "data/new/../x.txt"] {
            let e = err(refuse_overwriting_inputs("--out", &root.join(same), &inputs));
            assert!(e.contains("is the --input file"), "{same}: {e}");
        }
        // Into the tokenizer folder, onto it, or a folder output holding an input.
        let e = err(refuse_overwriting_inputs("--out", &root.join("link/tok/tokenizer.json"), &inputs));
        assert!(e.contains("inside the --tokenizer folder"), "{e}");
        let e = err(refuse_overwriting_inputs("--out", &tok, &inputs));
        assert!(e.contains("is the --tokenizer folder"), "{e}");
        let e = err(refuse_overwriting_inputs("--out", &root.join("data"), &inputs));
        assert!(e.contains("holds the --input file"), "{e}");
        // Beside them is fine, existing or not.
        refuse_overwriting_inputs("--out", &root.join("data/x.tokens"), &inputs).unwrap();
        refuse_overwriting_inputs("--out", &root.join("runs/new/x.tokens"), &inputs).unwrap();
    }

    #[test]
    fn writable_places_are_created_and_unwritable_ones_named() {
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("runs/deeper/x.tokens");
        check_writable("--out", &out, 1).unwrap();
        assert!(d.path().join("runs/deeper").is_dir());
        assert_eq!(std::fs::read_dir(d.path().join("runs/deeper")).unwrap().count(), 0, "the probe file stays");
        // Tests run as root, to whom a read-only mode is no barrier: /proc
        // and a path under a regular file are.
        let e = err(check_writable("--out", Path::new("/proc/x.tokens"), 1));
        assert!(e.contains("--out /proc/x.tokens") && e.contains("cannot write in /proc"), "{e}");
        let e = err(check_writable("--out", Path::new("/proc/nowhere/x.tokens"), 1));
        assert!(e.contains("--out") && e.contains("cannot create the folder /proc/nowhere"), "{e}");
        let file = d.path().join("file");
        std::fs::write(&file, "").unwrap();
        let e = err(check_writable("--metrics", &file.join("m.jsonl"), 1));
        assert!(e.contains("--metrics") && e.contains("cannot create the folder"), "{e}");
    }

    #[test]
    fn a_need_beyond_the_free_space_is_refused_with_both_sizes() {
        let d = tempfile::tempdir().unwrap();
        let free = free_bytes(d.path()).unwrap();
        check_writable("--out", &d.path().join("x"), free / 2).unwrap();
        let need = free.saturating_mul(2).max(1 << 40);
        let e = err(check_writable("--out", &d.path().join("x"), need));
        assert!(e.contains(&format!("needs about {}", human_bytes(need))), "{e}");
        assert!(e.contains(" free;") && e.contains("choose another place"), "{e}");
    }
}

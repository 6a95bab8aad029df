//! NCCL: the library behind the collective ops of a data-parallel step.
//!
//! The library is loaded the first time a collective needs it ([`nccl`]),
//! never before, so every other part of the backend works on machines
//! without NCCL. Types and enums are cudarc's (`cudarc::nccl::sys`, the
//! `nccl` feature); the entry points are resolved here because cudarc's
//! loader looks for `libnccl.so`, `libnccl.so.1` and `libnccl.so.<CUDA
//! major>` only, while NCCL itself (the `nvidia-nccl-cu13` wheel, the NVIDIA
//! packages) ships `libnccl.so.2`, and because cudarc panics where a
//! missing library must be an error naming it.
//!
//! Where it is looked for: the path in `STEPGRAPH_NCCL` (the library file,
//! or a folder holding `libnccl.so.2`), otherwise the dynamic loader's
//! search (`LD_LIBRARY_PATH`, the system folders) for `libnccl.so.2` and
//! `libnccl.so`. NCCL 2.10 or newer is required (`ncclAvg` and bf16; stream
//! capture needs 2.9).
//!
//! **Invariants:** a bucket is issued as one `ncclGroupStart` … `ncclGroupEnd`
//! with one call per tensor, on the session's stream, so it is ordered with
//! the kernels around it and recorded by graph capture like them; a group
//! that was started is always ended, even when a call in it failed.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cudarc::nccl::sys::{ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclUniqueId};

use crate::error::{CudaError, Result};
use crate::launch::{CollectiveCall, CollectiveOp, NcclRed, NcclType};

/// The environment variable naming the NCCL library (a file or its folder).
pub const NCCL_ENV: &str = "STEPGRAPH_NCCL";

/// The oldest NCCL accepted: 2.10 (`ncclAvg`, bf16), as `ncclGetVersion` encodes it.
pub const MIN_VERSION: i32 = 21000;

/// The file names NCCL is installed under, most specific first.
pub const LIB_NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

/// How to make NCCL visible, for error messages.
pub const HINT: &str = "collectives (data-parallel steps) need NCCL 2.10 or newer: put the folder holding \
    libnccl.so.2 on LD_LIBRARY_PATH (e.g. the `nvidia-nccl-cu13` wheel's lib folder, \
    <venv>/lib/python3.X/site-packages/nvidia/nccl/lib in PyTorch's venv) or set STEPGRAPH_NCCL to the library \
    file or that folder";

type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> c_int;
type GetUniqueIdFn = unsafe extern "C" fn(*mut ncclUniqueId) -> c_int;
type CommInitRankFn = unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int) -> c_int;
type CommFn = unsafe extern "C" fn(ncclComm_t) -> c_int;
type ErrorStringFn = unsafe extern "C" fn(c_int) -> *const c_char;
type GroupFn = unsafe extern "C" fn() -> c_int;
type ReduceFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    ncclDataType_t,
    ncclRedOp_t,
    ncclComm_t,
    *mut c_void,
) -> c_int;
type AllGatherFn =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, ncclDataType_t, ncclComm_t, *mut c_void) -> c_int;

/// The loaded library and the entry points stepgraph uses.
pub struct Nccl {
    /// Where it was loaded from (the name given to the loader).
    pub path: String,
    /// `ncclGetVersion`'s code, e.g. 22809 for 2.28.9.
    pub version: i32,
    get_unique_id: GetUniqueIdFn,
    comm_init_rank: CommInitRankFn,
    comm_destroy: CommFn,
    comm_abort: CommFn,
    error_string: ErrorStringFn,
    group_start: GroupFn,
    group_end: GroupFn,
    all_reduce: ReduceFn,
    reduce_scatter: ReduceFn,
    all_gather: AllGatherFn,
    /// Keeps the entry points above valid; never unloaded.
    _lib: libloading::Library,
}

/// The names to try, from `STEPGRAPH_NCCL` when set (a file, or a folder
/// holding one of [`LIB_NAMES`]), else [`LIB_NAMES`] for the loader's search.
pub fn candidates(env: Option<&Path>) -> Vec<PathBuf> {
    match env {
        Some(p) if p.is_dir() => LIB_NAMES.iter().map(|n| p.join(n)).collect(),
        Some(p) => vec![p.to_path_buf()],
        None => LIB_NAMES.iter().map(PathBuf::from).collect(),
    }
}

/// The process's NCCL (or why it could not be loaded), once [`nccl`] was called.
static LIB: OnceLock<std::result::Result<Nccl, String>> = OnceLock::new();

/// Has this process tried to load NCCL? (A one-device session never does.)
pub fn load_attempted() -> bool {
    LIB.get().is_some()
}

/// The process's NCCL, loaded on first use from [`candidates`].
pub fn nccl() -> Result<&'static Nccl> {
    let loaded = LIB.get_or_init(|| {
        let env = std::env::var_os(NCCL_ENV).map(PathBuf::from);
        Nccl::load(&candidates(env.as_deref())).map_err(|e| match e {
            CudaError::Missing { hint, .. } => hint,
            e => e.to_string(),
        })
    });
    loaded.as_ref().map_err(|hint| CudaError::Missing { lib: "libnccl", hint: hint.clone() })
}

/// Is NCCL loadable (for tests that need it)?
pub fn nccl_available() -> bool {
    nccl().is_ok()
}

/// A loader error with its cause (libloading keeps dlerror's text in the source).
fn with_source(e: &libloading::Error) -> String {
    match std::error::Error::source(e) {
        Some(s) => format!("{e}: {s}"),
        None => e.to_string(),
    }
}

fn symbol<T: Copy>(lib: &libloading::Library, name: &str, path: &str) -> Result<T> {
    // SAFETY: every `T` used here is the C signature of the NCCL entry point `name`.
    unsafe { lib.get::<T>(name.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| CudaError::Missing { lib: "libnccl", hint: format!("{path} lacks `{name}` ({e}); {HINT}") })
}

impl Nccl {
    /// Loads the first of `names` that the dynamic loader opens.
    pub fn load(names: &[PathBuf]) -> Result<Nccl> {
        let mut tried = Vec::new();
        for name in names {
            // SAFETY: loading NCCL runs its initialisers, which have no preconditions.
            match unsafe { libloading::Library::new(name) } {
                Ok(lib) => return Nccl::from_library(lib, name.display().to_string()),
                Err(e) => tried.push(format!("{} ({})", name.display(), with_source(&e))),
            }
        }
        Err(CudaError::Missing { lib: "libnccl", hint: format!("{HINT}; tried {}", tried.join(", ")) })
    }

    fn from_library(lib: libloading::Library, path: String) -> Result<Nccl> {
        let get_version: GetVersionFn = symbol(&lib, "ncclGetVersion", &path)?;
        let mut version: c_int = 0;
        // SAFETY: a valid out-pointer.
        let r = unsafe { get_version(&mut version) };
        if r != 0 || version < MIN_VERSION {
            return Err(CudaError::Missing {
                lib: "libnccl",
                hint: format!("{path} is NCCL {} (code {r}); {HINT}", version_string(version)),
            });
        }
        Ok(Nccl {
            version,
            get_unique_id: symbol(&lib, "ncclGetUniqueId", &path)?,
            comm_init_rank: symbol(&lib, "ncclCommInitRank", &path)?,
            comm_destroy: symbol(&lib, "ncclCommDestroy", &path)?,
            comm_abort: symbol(&lib, "ncclCommAbort", &path)?,
            error_string: symbol(&lib, "ncclGetErrorString", &path)?,
            group_start: symbol(&lib, "ncclGroupStart", &path)?,
            group_end: symbol(&lib, "ncclGroupEnd", &path)?,
            all_reduce: symbol(&lib, "ncclAllReduce", &path)?,
            reduce_scatter: symbol(&lib, "ncclReduceScatter", &path)?,
            all_gather: symbol(&lib, "ncclAllGather", &path)?,
            path,
            _lib: lib,
        })
    }

    /// `2.28.9` for code 22809.
    pub fn version_string(&self) -> String {
        version_string(self.version)
    }

    /// An error for result code `r` of `what`, with NCCL's own words.
    fn check(&self, r: c_int, what: &str) -> Result<()> {
        if r == 0 {
            return Ok(());
        }
        // SAFETY: NCCL returns a static string for any code.
        let s = unsafe { (self.error_string)(r) };
        let text = if s.is_null() {
            "unknown error".to_string()
        } else {
            // SAFETY: a NUL-terminated static string.
            unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
        };
        Err(CudaError::Nccl(format!("{what} failed with code {r}: {text}")))
    }

    /// A new unique id: the rendezvous every rank of one group joins with.
    pub fn unique_id(&self) -> Result<NcclId> {
        let mut id = ncclUniqueId { internal: [0; 128] };
        // SAFETY: a valid out-pointer.
        self.check(unsafe { (self.get_unique_id)(&mut id) }, "ncclGetUniqueId")?;
        Ok(NcclId(id.internal.map(|c| c as u8)))
    }
}

fn version_string(code: i32) -> String {
    if code >= 20900 {
        format!("{}.{}.{}", code / 10000, code / 100 % 100, code % 100)
    } else {
        format!("{}.{}.{}", code / 1000, code / 100 % 10, code % 100)
    }
}

/// NCCL's unique id: 128 opaque bytes that rank 0's side creates and every
/// rank passes to `ncclCommInitRank`. Travels between processes as hex.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclId(pub [u8; 128]);

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclId({}…)", &self.to_hex()[..16])
    }
}

impl NcclId {
    /// A fresh id from NCCL (loads the library).
    pub fn new() -> Result<Self> {
        nccl()?.unique_id()
    }

    /// 256 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses 256 hex digits (surrounding whitespace ignored). An error
    /// says what is wrong (the length, or the position of the first
    /// character that is not a hex digit) and never echoes the text: it may
    /// be a file a rank was pointed at by mistake.
    pub fn from_hex(s: &str) -> Result<Self> {
        let s = s.trim();
        let bad = |why: String| CudaError::Nccl(format!("not an NCCL unique id: {why}"));
        if let Some(pos) = s.bytes().position(|b| !b.is_ascii_hexdigit()) {
            // Counted in characters, as an editor shows them.
            let column = s.char_indices().take_while(|&(i, _)| i < pos).count();
            return Err(bad(format!("character {} is not a hex digit (0-9, a-f)", column + 1)));
        }
        if s.len() != 2 * ID_BYTES {
            return Err(bad(format!("{} hex digits, expected {}", s.len(), 2 * ID_BYTES)));
        }
        let mut id = [0u8; ID_BYTES];
        for (byte, pair) in id.iter_mut().zip(s.as_bytes().chunks_exact(2)) {
            *byte = (hex_value(pair[0]) << 4) | hex_value(pair[1]);
        }
        Ok(NcclId(id))
    }

    /// Writes the id as hex to a new file at `path`, readable and writable
    /// by its owner only (mode 0600 from the moment it exists). A file
    /// already at `path` is an error and is left untouched: it is never
    /// truncated, and a symbolic link there is not followed.
    pub fn write_file(&self, path: &Path) -> Result<()> {
        let io = |source| CudaError::Io { path: path.display().to_string(), source };
        let mut opts = std::fs::OpenOptions::new();
        opts.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
        let mut f = opts.open(path).map_err(io)?;
        std::io::Write::write_all(&mut f, self.to_hex().as_bytes()).map_err(io)?;
        f.sync_all().map_err(io)?;
        Ok(())
    }

    /// Reads an id [`write_file`](Self::write_file) wrote. Errors name the
    /// file and what is wrong with it, not what it holds.
    pub fn read_file(path: &Path) -> Result<Self> {
        let io = |source| CudaError::Io { path: path.display().to_string(), source };
        let file = std::fs::File::open(path).map_err(io)?;
        // An id file is 256 bytes; read a little more than that to tell a
        // wrong file from a long one without reading a large file whole.
        let mut bytes = Vec::with_capacity(READ_LIMIT + 1);
        std::io::Read::read_to_end(&mut std::io::Read::take(file, READ_LIMIT as u64 + 1), &mut bytes).map_err(io)?;
        let wrong = |why: String| CudaError::Nccl(format!("{} is not an NCCL id file: {why}", path.display()));
        if bytes.len() > READ_LIMIT {
            return Err(wrong(format!("it is longer than {READ_LIMIT} bytes, expected {} hex digits", 2 * ID_BYTES)));
        }
        let text = std::str::from_utf8(&bytes)
            .map_err(|e| wrong(format!("byte {} is not UTF-8 text", e.valid_up_to() + 1)))?;
        Self::from_hex(text).map_err(|e| match e {
            CudaError::Nccl(why) => wrong(why.trim_start_matches("not an NCCL unique id: ").to_string()),
            e => e,
        })
    }
}

/// The bytes of an NCCL unique id.
const ID_BYTES: usize = 128;

/// The most bytes [`NcclId::read_file`] reads: an id with room for whitespace.
const READ_LIMIT: usize = 1024;

/// The value of one ASCII hex digit (checked by the caller).
fn hex_value(digit: u8) -> u8 {
    match digit {
        b'0'..=b'9' => digit - b'0',
        b'a'..=b'f' => digit - b'a' + 10,
        _ => digit - b'A' + 10,
    }
}

/// One rank's place in a group: the id every rank shares, this rank, the size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NcclGroup {
    pub id: NcclId,
    pub rank: usize,
    pub world: usize,
}

/// One rank's NCCL communicator. Created while the rank's device context is
/// current (NCCL binds it to the current device); destroyed on drop, after
/// the session's stream is idle.
pub struct NcclComm {
    nccl: &'static Nccl,
    comm: ncclComm_t,
    pub rank: usize,
    pub world: usize,
}

impl NcclComm {
    /// Joins `group`: blocks until every rank of it has called this.
    pub fn init(nccl: &'static Nccl, group: &NcclGroup) -> Result<Self> {
        if group.world == 0 || group.rank >= group.world {
            return Err(CudaError::Rank(format!("rank {} is outside a group of {}", group.rank, group.world)));
        }
        let mut comm: ncclComm_t = std::ptr::null_mut();
        let id = ncclUniqueId { internal: group.id.0.map(|b| b as c_char) };
        // SAFETY: a valid out-pointer; rank < world checked above.
        let r = unsafe { (nccl.comm_init_rank)(&mut comm, group.world as c_int, id, group.rank as c_int) };
        nccl.check(r, &format!("ncclCommInitRank (rank {} of {})", group.rank, group.world))?;
        Ok(NcclComm { nccl, comm, rank: group.rank, world: group.world })
    }

    /// Enqueues one bucket on `stream`: one group, one call per tensor.
    ///
    /// # Safety
    /// Every part's buffers must be live device memory of the sizes NCCL
    /// expects for the collective (the lowering's contract), and `stream`
    /// a stream of the communicator's device.
    pub unsafe fn issue(&self, call: &CollectiveCall, stream: cudarc::driver::sys::CUstream) -> Result<()> {
        let stream = stream as *mut c_void;
        let n = self.nccl;
        let what = call.op.nccl_name();
        // SAFETY: no preconditions.
        n.check(unsafe { (n.group_start)() }, "ncclGroupStart")?;
        let mut first = Ok(());
        for p in &call.parts {
            let (send, recv) = (p.send as *const c_void, p.recv as *mut c_void);
            let ty = nccl_type(p.ty);
            // SAFETY: the lowering's contract: `send` and `recv` are planned
            // device buffers of the counts NCCL expects for this collective,
            // in place or not overlapping, and the stream belongs to the
            // communicator's device.
            let r = unsafe {
                match call.op {
                    CollectiveOp::AllReduce(red) => {
                        (n.all_reduce)(send, recv, p.count, ty, nccl_red(red), self.comm, stream)
                    }
                    CollectiveOp::ReduceScatter(red) => {
                        (n.reduce_scatter)(send, recv, p.count, ty, nccl_red(red), self.comm, stream)
                    }
                    CollectiveOp::AllGather => (n.all_gather)(send, recv, p.count, ty, self.comm, stream),
                }
            };
            if first.is_ok() {
                first = n.check(r, &format!("{what} of {} {:?} elements", p.count, p.ty));
            }
        }
        // SAFETY: closes the group opened above.
        let end = n.check(unsafe { (n.group_end)() }, &format!("ncclGroupEnd after {what}"));
        first.and(end)
    }

    /// Aborts pending work and frees the communicator (after a failure,
    /// when peers may never arrive).
    pub fn abort(self) {
        let me = std::mem::ManuallyDrop::new(self);
        // SAFETY: a live communicator, not used again (Drop is skipped).
        let _ = unsafe { (me.nccl.comm_abort)(me.comm) };
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // SAFETY: a live communicator; its owner synchronised its stream first.
        let _ = unsafe { (self.nccl.comm_destroy)(self.comm) };
    }
}

fn nccl_type(t: NcclType) -> ncclDataType_t {
    match t {
        NcclType::F32 => ncclDataType_t::ncclFloat32,
        NcclType::BF16 => ncclDataType_t::ncclBfloat16,
        NcclType::F16 => ncclDataType_t::ncclFloat16,
        NcclType::F64 => ncclDataType_t::ncclFloat64,
    }
}

fn nccl_red(r: NcclRed) -> ncclRedOp_t {
    match r {
        NcclRed::Sum => ncclRedOp_t::ncclSum,
        NcclRed::Avg => ncclRedOp_t::ncclAvg,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> NcclId {
        let mut b = [0u8; 128];
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i as u8).wrapping_mul(37).wrapping_add(250);
        }
        NcclId(b)
    }

    #[test]
    fn ids_round_trip_through_hex_and_files() {
        let a = id();
        let hex = a.to_hex();
        assert_eq!(hex.len(), 256);
        assert_eq!(NcclId::from_hex(&hex).unwrap(), a);
        assert_eq!(NcclId::from_hex(&format!("  {hex}\n")).unwrap(), a);
        let dir = std::env::temp_dir().join(format!("stepgraph-nccl-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("id");
        a.write_file(&path).unwrap();
        assert_eq!(NcclId::read_file(&path).unwrap(), a);
        std::fs::remove_dir_all(&dir).unwrap();

        let short = NcclId::from_hex("abcd").unwrap_err().to_string();
        assert!(short.contains("4 hex digits, expected 256") && !short.contains("abcd"), "{short}");
        let mut bad = hex.clone();
        bad.replace_range(10..12, "zz");
        let msg = NcclId::from_hex(&bad).unwrap_err().to_string();
        assert!(msg.contains("character 11 is not a hex digit") && !msg.contains("zz"), "{msg}");
        // Positions count characters, not bytes.
        let msg = NcclId::from_hex("ab\u{e9}cd").unwrap_err().to_string();
        assert!(msg.contains("character 3 is not"), "{msg}");
        let missing = NcclId::read_file(Path::new("/nonexistent/stepgraph/id")).unwrap_err().to_string();
        assert!(missing.contains("/nonexistent/stepgraph/id"), "{missing}");
        assert!(format!("{a:?}").starts_with("NcclId("));
    }

    /// A fresh, empty directory for one test.
    fn temp_dir(test: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("stepgraph-nccl-{}-{test}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn the_id_file_is_new_and_private() {
        let dir = temp_dir("private");
        let path = dir.join("id");
        id().write_file(&path).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        }
        // A second write to the same path fails and leaves the first id in place.
        let other = NcclId([7; 128]);
        let err = other.write_file(&path).unwrap_err().to_string();
        assert!(err.contains(&path.display().to_string()) && err.contains("exists"), "{err}");
        assert_eq!(NcclId::read_file(&path).unwrap(), id());
        // Any file already there is neither truncated nor overwritten.
        let planted = dir.join("planted");
        std::fs::write(&planted, "keep me").unwrap();
        assert!(other.write_file(&planted).is_err());
        assert_eq!(std::fs::read_to_string(&planted).unwrap(), "keep me");
        // Nor is a symbolic link followed to its target.
        #[cfg(unix)]
        {
            let target = dir.join("target");
            std::fs::write(&target, "victim").unwrap();
            let link = dir.join("link");
            std::os::unix::fs::symlink(&target, &link).unwrap();
            assert!(other.write_file(&link).is_err());
            assert_eq!(std::fs::read_to_string(&target).unwrap(), "victim");
            // A dangling link is not followed either (it would create its target).
            let dangling = dir.join("dangling");
            std::os::unix::fs::symlink(dir.join("nowhere"), &dangling).unwrap();
            assert!(other.write_file(&dangling).is_err());
            assert!(!dir.join("nowhere").exists());
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_bad_id_file_is_named_and_its_contents_are_not_echoed() {
        let dir = temp_dir("bad");
        let secret = "hunter2-password-of-someone-else";
        let cases: [(&str, Vec<u8>, &str); 5] = [
            ("text", secret.as_bytes().to_vec(), "character 1 is not a hex digit"),
            ("short", b"0123abcd\n".to_vec(), "8 hex digits, expected 256"),
            ("long", vec![b'a'; 5000], "longer than 1024 bytes"),
            ("binary", vec![b'a', b'b', 0xff, 0xfe], "byte 3 is not UTF-8"),
            ("empty", vec![], "0 hex digits, expected 256"),
        ];
        for (name, contents, why) in cases {
            let path = dir.join(name);
            std::fs::write(&path, &contents).unwrap();
            let err = NcclId::read_file(&path).unwrap_err().to_string();
            assert!(err.contains(&path.display().to_string()) && err.contains(why), "{name}: {err}");
            assert!(!err.contains("hunter2") && !err.contains("0123abcd") && !err.contains("aaaa"), "{name}: {err}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_missing_library_is_an_error_naming_libnccl_and_the_fix() {
        let e = Nccl::load(&[PathBuf::from("/nonexistent/nccl/libnccl.so.2")]).err().expect("nothing to load");
        let msg = e.to_string();
        assert!(msg.contains("libnccl") && msg.contains("LD_LIBRARY_PATH") && msg.contains("STEPGRAPH_NCCL"), "{msg}");
        assert!(msg.contains("nvidia-nccl-cu13") && msg.contains("/nonexistent/nccl/libnccl.so.2"), "{msg}");
    }

    #[test]
    fn candidates_follow_the_environment_variable() {
        assert_eq!(candidates(None), vec![PathBuf::from("libnccl.so.2"), PathBuf::from("libnccl.so")]);
        let file = Path::new("/opt/x/libnccl.so.2.28.9");
        assert_eq!(candidates(Some(file)), vec![file.to_path_buf()]);
        let dir = std::env::temp_dir();
        assert_eq!(candidates(Some(&dir))[0], dir.join("libnccl.so.2"));
    }

    #[test]
    fn the_process_library_loads_or_says_how_to_provide_it() {
        // A machine meant to have NCCL sets this so the test cannot skip the load.
        if std::env::var_os("STEPGRAPH_REQUIRE_NCCL").is_some() {
            nccl().unwrap();
        }
        match nccl() {
            Ok(n) => {
                assert!(n.version >= MIN_VERSION, "{}", n.version_string());
                let (a, b) = (n.unique_id().unwrap(), n.unique_id().unwrap());
                assert_ne!(a, b, "two unique ids from {}", n.path);
            }
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.contains("libnccl") && msg.contains("LD_LIBRARY_PATH"), "{msg}");
                assert!(NcclId::new().is_err());
            }
        }
        assert_eq!(version_string(22809), "2.28.9");
    }
}

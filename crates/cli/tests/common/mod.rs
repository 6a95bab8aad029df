//! What the CLI integration tests share: running the built binary from the
//! repository root and checking that a command fails with a message.
//! (Each test file includes this module; not every file uses every item.)
#![allow(dead_code)]

use std::path::Path;
use std::process::Command;

/// The repository root, where the tests run the binary (so `data/` resolves).
pub fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

/// A path as a command-line argument.
pub fn s(p: &Path) -> &str {
    p.to_str().expect("a UTF-8 path")
}

/// Runs `stepgraph ARGS` from the repository root: success, stdout, stderr.
/// `RUST_BACKTRACE` is removed so a panic's output is the same everywhere.
pub fn stepgraph(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_stepgraph"))
        .args(args)
        .env_remove("RUST_BACKTRACE")
        .current_dir(root())
        .output()
        .expect("run stepgraph");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

/// `args` fails and its stderr holds `want`; returns the stderr.
pub fn fails_with(args: &[&str], want: &str) -> String {
    let (ok, out, err) = stepgraph(args);
    assert!(!ok, "{args:?} should fail: {out}");
    assert!(err.contains(want), "{args:?}: expected `{want}` in:\n{err}");
    err
}

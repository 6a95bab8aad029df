//! SIGTERM and SIGINT during a training run: the first asks the run to stop
//! after the step under way (with a checkpoint, when a checkpoint directory
//! is set); a second ends the process at once.
//!
//! Schedulers (Slurm, Kubernetes) send SIGTERM some seconds before they
//! kill, and a user presses Ctrl-C once meaning "stop" and twice meaning
//! "now": the handler only records the signal and restores the default
//! action of both, so that the second signal terminates as usual. The
//! training loop polls [`requested`] between steps.

use std::sync::atomic::{AtomicI32, Ordering};

/// The signal received first, or 0.
static RECEIVED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(signal: libc::c_int) {
    if RECEIVED.compare_exchange(0, signal, Ordering::SeqCst, Ordering::SeqCst).is_err() {
        // A second signal that reached this handler anyway (the kernel
        // delivers signals pending together before either handler runs).
        // SAFETY: _exit is async-signal-safe and ends the process at once.
        unsafe { libc::_exit(128 + signal) }
    }
    // SAFETY: `signal` (like the atomic store) is async-signal-safe; the
    // second SIGTERM or SIGINT then ends the process with the default action.
    unsafe {
        libc::signal(libc::SIGTERM, libc::SIG_DFL);
        libc::signal(libc::SIGINT, libc::SIG_DFL);
    }
}

/// Installs the handler for SIGTERM and SIGINT.
pub fn install() {
    RECEIVED.store(0, Ordering::SeqCst);
    let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: the handler only stores an atomic and calls `signal`, both
    // async-signal-safe.
    unsafe {
        libc::signal(libc::SIGTERM, handler);
        libc::signal(libc::SIGINT, handler);
    }
}

/// The signal that asked the run to stop, if one did.
pub fn requested() -> Option<i32> {
    match RECEIVED.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// A signal's name as people write it.
pub fn name(signal: i32) -> &'static str {
    match signal {
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        _ => "a signal",
    }
}

/// The error a run stopped by a signal ends with; the process exits with
/// `128 + signal`, as a shell reports a process the signal ended.
#[derive(Debug)]
pub struct Interrupted {
    pub signal: i32,
    pub message: String,
}

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Interrupted {}

impl Interrupted {
    pub fn exit_code(&self) -> i32 {
        128 + self.signal
    }
}

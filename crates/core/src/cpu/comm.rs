//! Communicators for the CPU backend: how the collective ops of a
//! data-parallel step ([`crate::ops::collective`]) meet their peers.
//!
//! A [`Communicator`] is one rank's handle on a group of `world` ranks. Its
//! one primitive is [`Communicator::exchange`]: every rank hands in its
//! tensors and gets back every rank's tensors in rank order. The collective
//! kernels reduce or concatenate that result themselves, each rank in the
//! same order (rank 0 first), so every rank computes identical bits.
//!
//! [`LocalGroup`] is the in-memory implementation: N rank sessions in N
//! threads of one process (see [`run_ranks`]). It exists so that data
//! parallelism, ZeRO-1 and their memory plans are tested without GPUs; the
//! CUDA backend lowers the same ops to NCCL instead.
//!
//! **Invariants:** a rank that fails aborts the group, so its peers return an
//! error instead of waiting forever; every exchange checks that all ranks
//! reached the same collective with the same tensor types (a mismatch is a
//! program error that would hang or corrupt NCCL, here it is a message);
//! waits time out after [`LocalGroup::timeout`].

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::host::HostTensor;

pub use crate::ops::kernel::Communicator;

/// Shared state of a [`LocalGroup`].
struct State {
    /// Completed exchanges; a waiting rank is released when this passes its ticket.
    generation: u64,
    /// Contributions of the exchange in progress, by rank.
    slots: Vec<Option<(String, Vec<HostTensor>)>>,
    arrived: usize,
    /// The result of the last completed exchange, read by every rank of it.
    result: Option<std::result::Result<Arc<Vec<Vec<HostTensor>>>, String>>,
    /// Set once by the first failure; every later exchange fails with it.
    aborted: Option<(usize, String)>,
}

struct Shared {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    cond: Condvar,
}

/// An in-memory group of `world` ranks in one process. Clone it into one
/// [`LocalComm`] per rank with [`LocalGroup::comm`].
#[derive(Clone)]
pub struct LocalGroup {
    shared: Arc<Shared>,
}

impl LocalGroup {
    /// How long a rank waits for its peers at one exchange before it gives up.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

    pub fn new(world: usize) -> Result<Self> {
        Self::with_timeout(world, Self::DEFAULT_TIMEOUT)
    }

    pub fn with_timeout(world: usize, timeout: Duration) -> Result<Self> {
        if world == 0 {
            return Err(Error::Collective("a group needs at least one rank".into()));
        }
        let state =
            State { generation: 0, slots: (0..world).map(|_| None).collect(), arrived: 0, result: None, aborted: None };
        Ok(LocalGroup { shared: Arc::new(Shared { world, timeout, state: Mutex::new(state), cond: Condvar::new() }) })
    }

    pub fn world(&self) -> usize {
        self.shared.world
    }

    pub fn timeout(&self) -> Duration {
        self.shared.timeout
    }

    /// The handle of rank `rank`.
    pub fn comm(&self, rank: usize) -> Result<LocalComm> {
        if rank >= self.shared.world {
            return Err(Error::Collective(format!("rank {rank} is outside a group of {}", self.shared.world)));
        }
        Ok(LocalComm { rank, shared: self.shared.clone() })
    }

    /// The rank that failed first and why, if any did.
    pub fn failure(&self) -> Option<(usize, String)> {
        self.shared.lock().aborted.clone()
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A rank that panicked while holding the lock leaves the state
        // consistent (every update is a single assignment), so keep going.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One rank of a [`LocalGroup`].
#[derive(Clone)]
pub struct LocalComm {
    rank: usize,
    shared: Arc<Shared>,
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.shared.world
    }

    fn exchange(&self, tag: &str, data: Vec<HostTensor>) -> Result<Arc<Vec<Vec<HostTensor>>>> {
        let sh = &self.shared;
        let rank = self.rank;
        let mut st = sh.lock();
        if let Some((r, why)) = &st.aborted {
            return Err(aborted(rank, tag, *r, why));
        }
        if st.slots[rank].is_some() {
            return Err(Error::Collective(format!("rank {rank} entered `{tag}` twice in one exchange")));
        }
        st.slots[rank] = Some((tag.to_string(), data));
        st.arrived += 1;
        let ticket = st.generation;
        if st.arrived == sh.world {
            let slots: Vec<(String, Vec<HostTensor>)> =
                st.slots.iter_mut().map(|s| s.take().expect("every rank arrived")).collect();
            st.result = Some(match slots.iter().position(|(t, _)| t != &slots[0].0) {
                None => Ok(Arc::new(slots.into_iter().map(|(_, d)| d).collect())),
                Some(r) => Err(format!(
                    "ranks disagree on the collective: rank 0 is at `{}`, rank {r} at `{}`",
                    slots[0].0, slots[r].0
                )),
            });
            st.arrived = 0;
            st.generation += 1;
            sh.cond.notify_all();
        } else {
            let deadline = Instant::now() + sh.timeout;
            while st.generation == ticket {
                if let Some((r, why)) = &st.aborted {
                    return Err(aborted(rank, tag, *r, why));
                }
                let now = Instant::now();
                if now >= deadline {
                    let missing: Vec<usize> = (0..sh.world).filter(|&r| st.slots[r].is_none()).collect();
                    let why = format!("waited {:?} at `{tag}` for ranks {missing:?}, which never arrived", sh.timeout);
                    st.aborted = Some((rank, why.clone()));
                    sh.cond.notify_all();
                    return Err(Error::Collective(format!("rank {rank}: {why}")));
                }
                st = sh.cond.wait_timeout(st, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
            }
        }
        // The result stays in place until every rank of this exchange has
        // read it: the next exchange cannot complete before they all join it.
        match st.result.as_ref().expect("set by the exchange that completed") {
            Ok(r) => Ok(r.clone()),
            Err(e) => Err(Error::Collective(format!("rank {rank}: {e}"))),
        }
    }

    fn abort(&self, reason: &str) {
        let mut st = self.shared.lock();
        if st.aborted.is_none() {
            st.aborted = Some((self.rank, reason.to_string()));
        }
        self.shared.cond.notify_all();
    }
}

fn aborted(rank: usize, tag: &str, failed: usize, why: &str) -> Error {
    Error::Collective(format!("rank {rank} at `{tag}`: the group was aborted because rank {failed} failed: {why}"))
}

/// Runs `f(comm)` for every rank of a new in-memory group, each in its own
/// thread, and returns the results in rank order. When a rank fails (an
/// error or a panic) the group is aborted so the others stop at their next
/// collective, and the first failure's own error is returned.
pub fn run_ranks<T: Send>(world: usize, f: impl Fn(LocalComm) -> Result<T> + Sync) -> Result<Vec<T>> {
    let group = LocalGroup::new(world)?;
    run_group(&group, f)
}

/// [`run_ranks`] on a given group (to choose its timeout).
pub fn run_group<T: Send>(group: &LocalGroup, f: impl Fn(LocalComm) -> Result<T> + Sync) -> Result<Vec<T>> {
    /// Aborts the group if its rank's thread unwinds.
    struct AbortOnPanic(LocalComm);
    impl Drop for AbortOnPanic {
        fn drop(&mut self) {
            if std::thread::panicking() {
                self.0.abort("its thread panicked");
            }
        }
    }
    let comms: Vec<LocalComm> = (0..group.world()).map(|r| group.comm(r)).collect::<Result<_>>()?;
    let results: Vec<std::thread::Result<Result<T>>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let f = &f;
                std::thread::Builder::new()
                    .name(format!("rank-{}", comm.rank))
                    .spawn_scoped(s, move || {
                        let guard = AbortOnPanic(comm.clone());
                        let r = f(comm);
                        if let Err(e) = &r {
                            guard.0.abort(&e.to_string());
                        }
                        r
                    })
                    .expect("spawn a rank thread")
            })
            .collect();
        handles.into_iter().map(|h| h.join()).collect()
    });
    let first = group.failure().map(|(r, _)| r);
    let mut out = Vec::with_capacity(results.len());
    let mut errors: Vec<(usize, Error)> = Vec::new();
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(Ok(v)) => out.push(v),
            Ok(Err(e)) => errors.push((rank, e)),
            Err(panic) => {
                let msg = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "a panic without a message".into());
                errors.push((rank, Error::Collective(format!("rank {rank} panicked: {msg}"))));
            }
        }
    }
    if errors.is_empty() {
        return Ok(out);
    }
    // The rank that failed first has the cause; the others report the abort.
    let pick = errors.iter().position(|(r, _)| Some(*r) == first).unwrap_or(0);
    let (rank, e) = errors.swap_remove(pick);
    Err(match e {
        Error::Collective(m) => Error::Collective(m),
        e => Error::Collective(format!("rank {rank}: {e}")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DType, TensorType};

    fn t(x: f64) -> HostTensor {
        HostTensor::from_f64(TensorType::new(DType::F32, [1]), &[x])
    }

    #[test]
    fn exchange_returns_every_rank_in_order_many_times() {
        let got = run_ranks(4, |c| {
            let mut seen = Vec::new();
            for round in 0..50 {
                let all = c.exchange("x", vec![t((c.rank() * 100 + round) as f64)])?;
                seen.push(all.iter().map(|v| v[0].to_f64()[0]).collect::<Vec<f64>>());
            }
            Ok(seen)
        })
        .unwrap();
        for rank_view in &got {
            assert_eq!(rank_view, &got[0]);
        }
        assert_eq!(got[0][7], vec![7.0, 107.0, 207.0, 307.0]);
    }

    #[test]
    fn a_failing_rank_aborts_the_others_with_its_own_error() {
        let err = run_ranks(3, |c| {
            if c.rank() == 1 {
                return Err(Error::Input { name: "x".into(), reason: "rank one is broken".into() });
            }
            c.exchange("x", vec![t(0.0)])?;
            Ok(())
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains("rank 1") && err.contains("rank one is broken"), "{err}");
    }

    #[test]
    fn a_panicking_rank_aborts_the_others() {
        let err = run_ranks(2, |c| {
            if c.rank() == 0 {
                panic!("boom");
            }
            c.exchange("x", vec![t(0.0)])?;
            Ok(())
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains("rank 0 panicked: boom"), "{err}");
    }

    #[test]
    fn mismatched_collectives_and_missing_ranks_are_errors() {
        let err = run_ranks(2, |c| {
            let tag = if c.rank() == 0 { "all_reduce_sum f32[4]" } else { "all_gather f32[4]" };
            c.exchange(tag, vec![t(0.0)])?;
            Ok(())
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains("ranks disagree") && err.contains("all_gather f32[4]"), "{err}");

        let group = LocalGroup::with_timeout(2, Duration::from_millis(50)).unwrap();
        let err = run_group(&group, |c| {
            if c.rank() == 0 {
                c.exchange("x", vec![t(0.0)])?;
            }
            Ok(())
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains("for ranks [1], which never arrived"), "{err}");
        assert!(LocalGroup::new(0).is_err());
        assert!(group.comm(2).is_err());
    }
}

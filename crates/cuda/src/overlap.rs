//! Where launches on the side stream rejoin the compute stream.
//!
//! Two kinds of launch run beside the compute: copies between device and
//! host memory (offloaded values, always) and collectives (with overlap on,
//! [`crate::session::RankOptions::overlap`]). Each forks from the compute
//! stream (an event recorded there, waited on by the side stream), runs on
//! the side stream, and records a join event. The compute stream waits for
//! that event right before the first later launch whose node touches any
//! byte of the side launch's node (reads or writes: a reduce-scatter's full
//! gradient, or a value copied to the host, may be reused by a later node,
//! as the plan allows, since the plan assumes a launch completes at its own
//! position), and at the end of the step (or of the node range run) for the
//! ones nothing touched. Side launches stay ordered among themselves by the
//! side stream. This module only computes those join points, as data.
//!
//! **Invariant:** every launch after a side launch that shares a byte with
//! it runs after it, exactly as on one stream; every side-stream launch is
//! joined before the step ends (so graph capture, which needs every forked
//! stream joined, stays valid).

use crate::launch::Launch;

/// The join points of a launch list.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Joins {
    /// For launch `j`: the collectives (by launch index) the compute stream
    /// waits for right before launch `j`.
    pub before: Vec<Vec<usize>>,
    /// Collectives the compute stream waits for at the end of the step.
    pub at_end: Vec<usize>,
}

fn overlaps(a: &[(u64, u64)], b: &[(u64, u64)]) -> bool {
    a.iter().any(|&(a0, a1)| b.iter().any(|&(b0, b1)| a0 < b1 && b0 < a1))
}

/// Which of `launches` run on the side stream: every host copy, and the
/// collectives when `collectives` (overlap) is on.
pub fn on_side(launches: &[Launch], collectives: bool) -> Vec<bool> {
    launches
        .iter()
        .map(|l| matches!(l, Launch::HostCopy { .. }) || (collectives && matches!(l, Launch::Collective(_))))
        .collect()
}

/// The join points of a launch list whose launch `j` runs on the side
/// stream when `on_side[j]`, belongs to node `nodes[j]`, and where node
/// `n` touches the byte ranges `[start, end)` of `ranges[n]` (its inputs
/// and outputs).
pub fn joins(on_side: &[bool], nodes: &[usize], ranges: &[Vec<(u64, u64)>]) -> Joins {
    let mut before = Vec::with_capacity(on_side.len());
    let mut pending: Vec<usize> = Vec::new();
    for (j, &side) in on_side.iter().enumerate() {
        let mut wait = Vec::new();
        // A side launch follows the earlier ones on the side stream: no join.
        if !side {
            let mine = &ranges[nodes[j]];
            pending.retain(|&k| {
                let hit = nodes[k] != nodes[j] && overlaps(mine, &ranges[nodes[k]]);
                if hit {
                    wait.push(k);
                }
                !hit
            });
        }
        before.push(wait);
        if side {
            pending.push(j);
        }
    }
    Joins { before, at_end: pending }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::{CollectiveCall, CollectiveOp, NcclRed};

    fn coll() -> Launch {
        Launch::Collective(CollectiveCall { op: CollectiveOp::AllReduce(NcclRed::Avg), world: 2, parts: vec![] })
    }

    fn copy() -> Launch {
        Launch::Copy { dst: 0, src: 0, bytes: 0 }
    }

    #[test]
    fn compute_waits_before_the_first_launch_touching_a_collectives_bytes() {
        // Nodes: 0 writes [0,10); 1 all-reduces [0,10); 2 touches [20,30);
        // 3 all-reduces [20,30); 4 reads [5,6) (two launches); 5 untouched.
        let ranges =
            vec![vec![(0, 10)], vec![(0, 10)], vec![(20, 30)], vec![(20, 30)], vec![(5, 6), (40, 50)], vec![(60, 70)]];
        let launches = [copy(), coll(), copy(), coll(), copy(), copy(), copy()];
        let nodes = [0, 1, 2, 3, 4, 4, 5];
        let j = joins(&on_side(&launches, true), &nodes, &ranges);
        assert_eq!(j.before, vec![vec![], vec![], vec![], vec![], vec![1], vec![], vec![]]);
        assert_eq!(j.at_end, vec![3]);
        // A launch right after a collective on its bytes (a reduce-scatter's
        // dead input reused) waits at once; a later collective never waits.
        let j = joins(&on_side(&[coll(), coll(), copy()], true), &[1, 3, 2], &ranges);
        assert_eq!(j.before, vec![vec![], vec![], vec![1]]);
        assert_eq!(j.at_end, vec![0]);
    }

    #[test]
    fn host_copies_run_beside_the_compute_and_collectives_only_with_overlap() {
        let host = Launch::HostCopy { dst: 0, src: 0, bytes: 0 };
        let launches = [copy(), host.clone(), coll(), copy()];
        assert_eq!(on_side(&launches, false), vec![false, true, false, false]);
        assert_eq!(on_side(&launches, true), vec![false, true, true, false]);
        // Node 0 writes [0,10); node 1 copies it to the host [100,110);
        // node 2 reuses [0,10) (the value's bytes): it waits for the copy.
        let ranges = vec![vec![(0, 10)], vec![(0, 10), (100, 110)], vec![(0, 10)]];
        let j = joins(&on_side(&[copy(), host, copy()], false), &[0, 1, 2], &ranges);
        assert_eq!(j.before, vec![vec![], vec![], vec![1]]);
        assert!(j.at_end.is_empty());
    }
}

//! Property tests of the memory planner: random lifetimes for the offset
//! assignment, random programs for the whole planner, each checked by
//! `check_plan`; and the fuzz target for the checker itself
//! (`fuzz_planner_and_checker`): random programs of several dtypes, shapes,
//! views, in-place chains and state updates, planned, checked, run planned
//! against unplanned, and then mutated into plans the checker must reject.
//!
//! The fuzz target runs 48 cases in CI; the long run is `#[ignore]`d and
//! takes its case count from `PROPTEST_CASES` (see the README):
//! `PROPTEST_CASES=100000 cargo test --release -p stepgraph-core --test plan_props -- --ignored`.

use proptest::prelude::*;

use stepgraph_core::cpu::exec::CpuSession;
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{Builder, DType, OutputKind, TensorType, Trace, ValueId, ValueKind};
use stepgraph_core::ops::UnaryFn;
use stepgraph_core::plan::{
    align_up, assign_offsets, check_plan, plan, MemoryPlan, PlanOptions, Region, ARENA_ALIGN, MAX_PLAN_BYTES,
};

/// One random instruction: which op, which earlier values it reads.
#[derive(Clone, Debug)]
pub enum Instr {
    Unary(u8, usize),
    Binary(u8, usize, usize),
    Reshape(usize),
    Sum(usize),
}

fn instr() -> impl Strategy<Value = Instr> {
    prop_oneof![
        (0u8..4, any::<usize>()).prop_map(|(f, a)| Instr::Unary(f, a)),
        (0u8..3, any::<usize>(), any::<usize>()).prop_map(|(f, a, b)| Instr::Binary(f, a, b)),
        any::<usize>().prop_map(Instr::Reshape),
        any::<usize>().prop_map(Instr::Sum),
    ]
}

/// Builds a program over [4, 8] tensors (and their [8, 4] views) from the instructions.
pub fn program(instrs: &[Instr], outputs: &[usize]) -> Trace {
    let mut b = Builder::new("random");
    let ty = TensorType::new(DType::F32, [4, 8]);
    let mut vals: Vec<ValueId> = vec![b.input("x", ty.clone()).unwrap(), b.param("w", ty).unwrap()];
    let pick = |vals: &[ValueId], i: usize| vals[i % vals.len()];
    for ins in instrs {
        let v = match *ins {
            Instr::Unary(f, a) => {
                let f = [UnaryFn::Tanh, UnaryFn::Neg, UnaryFn::Sigmoid, UnaryFn::Silu][f as usize];
                b.unary(f, pick(&vals, a)).unwrap()
            }
            Instr::Binary(f, a, c) => {
                let (x, y) = (pick(&vals, a), pick(&vals, c));
                // Bring both to [4, 8] so the shapes agree.
                let x = b.reshape(x, &[4, 8]).unwrap();
                let y = b.reshape(y, &[4, 8]).unwrap();
                match f {
                    0 => b.add(x, y).unwrap(),
                    1 => b.mul(x, y).unwrap(),
                    _ => b.sub(x, y).unwrap(),
                }
            }
            Instr::Reshape(a) => {
                let x = pick(&vals, a);
                let to: &[usize] = if b.shape(x) == [4, 8] { &[8, 4] } else { &[4, 8] };
                b.reshape(x, to).unwrap()
            }
            Instr::Sum(a) => {
                let x = b.reshape(pick(&vals, a), &[4, 8]).unwrap();
                let s = b.sum(x, &[0], true).unwrap();
                let s = b.broadcast(s, &[4, 8]).unwrap();
                b.unary(UnaryFn::Tanh, s).unwrap()
            }
        };
        vals.push(v);
    }
    for (k, &o) in outputs.iter().enumerate() {
        let v = pick(&vals, o);
        b.output(OutputKind::Named(format!("o{k}")), v);
    }
    b.finish("random").unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn greedy_offsets_never_overlap_live_intervals(items in prop::collection::vec((0usize..40, 0usize..10, 1u64..5000), 1..60)) {
        let items: Vec<(usize, usize, u64)> = items.into_iter().map(|(s, len, b)| (s, s + len, b)).collect();
        let offs = assign_offsets(&items).unwrap();
        for i in 0..items.len() {
            prop_assert_eq!(offs[i] % 256, 0);
            for j in i + 1..items.len() {
                let (a, b) = (items[i], items[j]);
                let live = a.0 <= b.1 && b.0 <= a.1;
                let bytes = offs[i] < offs[j] + align_up(b.2) && offs[j] < offs[i] + align_up(a.2);
                prop_assert!(!(live && bytes), "{:?}@{} and {:?}@{}", a, offs[i], b, offs[j]);
            }
        }
    }

    #[test]
    fn random_programs_plan_safely(instrs in prop::collection::vec(instr(), 1..40), outs in prop::collection::vec(any::<usize>(), 1..4)) {
        let trace = program(&instrs, &outs);
        for reuse in [true, false] {
            let p = plan(&trace, PlanOptions { reuse, ..PlanOptions::default() }).unwrap();
            check_plan(&trace, &p).unwrap();
            prop_assert!(p.arena_bytes >= p.arena_floor_bytes);
            prop_assert_eq!(p.persistent_bytes, 4 * 8 * 4);
            // Leaves: the parameter is persistent, the step input lives in the arena
            // (views of the parameter share its persistent bytes).
            for v in trace.leaves() {
                let want = if trace.value(v).kind.leaf_name() == Some("w") { Region::Persistent } else { Region::Arena };
                prop_assert_eq!(p.slot(v).region, want);
            }
        }
    }
}

#[test]
fn check_plan_rejects_overlapping_live_values() {
    let trace = program(&[Instr::Unary(0, 0), Instr::Unary(0, 2), Instr::Binary(0, 2, 3)], &[4]);
    let mut p = plan(&trace, PlanOptions::default()).unwrap();
    check_plan(&trace, &p).unwrap();
    // Force the two tanh outputs, both read by the add, onto the same bytes.
    let (a, b) = (ValueId(2), ValueId(3));
    let g = p.group_of[b.index()];
    p.groups[g].offset = p.slot(a).offset;
    p.slots[b.index()].offset = p.slot(a).offset;
    let err = check_plan(&trace, &p).unwrap_err().to_string();
    assert!(err.contains("overlap"), "{err}");
}

#[test]
fn elementwise_chains_run_in_place() {
    // x -> tanh -> neg -> sigmoid: each intermediate dies where the next is born.
    let trace = program(&[Instr::Unary(0, 0), Instr::Unary(1, 2), Instr::Unary(2, 3)], &[4]);
    let p = plan(&trace, PlanOptions::default()).unwrap();
    check_plan(&trace, &p).unwrap();
    let (t, ng, sg) = (ValueId(2), ValueId(3), ValueId(4));
    assert_eq!(p.slot(t).offset, p.slot(ng).offset);
    assert_eq!(p.slot(ng).offset, p.slot(sg).offset);
    // One tensor of arena for the chain plus the input it starts from (kept: a leaf).
    assert_eq!(p.arena_bytes, 2 * align_up(4 * 8 * 4));
}

/// One instruction of a fuzzed program; `usize`s pick earlier values.
#[derive(Clone, Debug)]
pub enum FuzzInstr {
    Unary(u8, usize),
    Binary(u8, usize, usize),
    /// A view: the value reshaped to one of four shapes of its size.
    View(u8, usize),
    /// A smaller value: the sum over the rows, `[1, cols]`.
    SumRows(usize),
    /// A value of another size: `a · bᵀ`, `[rows, rows]`.
    Matmul(usize, usize),
    Cast(u8, usize),
    /// Part `k` of four copies of a value side by side, `[1, 1, rows·cols]`
    /// (a slice, made a view where it starts on an arena boundary), then
    /// seen as `[rows, cols]`.
    SlicePart(u8, usize),
}

/// A fuzzed program: leaves, instructions, outputs and state updates.
#[derive(Clone, Debug)]
pub struct FuzzProgram {
    rows: usize,
    cols: usize,
    /// The dtype of the input, then of each parameter, then of each state.
    leaf_dtypes: Vec<u8>,
    params: usize,
    instrs: Vec<FuzzInstr>,
    outputs: Vec<usize>,
    /// For each state, the value its update adds.
    updates: Vec<usize>,
}

const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

fn fuzz_instr() -> impl Strategy<Value = FuzzInstr> {
    prop_oneof![
        3 => (0u8..4, any::<usize>()).prop_map(|(f, a)| FuzzInstr::Unary(f, a)),
        3 => (0u8..3, any::<usize>(), any::<usize>()).prop_map(|(f, a, b)| FuzzInstr::Binary(f, a, b)),
        2 => (0u8..4, any::<usize>()).prop_map(|(s, a)| FuzzInstr::View(s, a)),
        1 => any::<usize>().prop_map(FuzzInstr::SumRows),
        1 => (any::<usize>(), any::<usize>()).prop_map(|(a, b)| FuzzInstr::Matmul(a, b)),
        1 => (0u8..3, any::<usize>()).prop_map(|(d, a)| FuzzInstr::Cast(d, a)),
        1 => (0u8..4, any::<usize>()).prop_map(|(k, a)| FuzzInstr::SlicePart(k, a)),
    ]
}

fn fuzz_program(max_instrs: usize) -> impl Strategy<Value = FuzzProgram> {
    (
        1usize..6,
        1usize..70,
        0usize..4,
        0usize..4,
        prop::collection::vec(fuzz_instr(), 1..max_instrs),
        prop::collection::vec(any::<usize>(), 1..5),
    )
        .prop_flat_map(|(rows, cols, params, states, instrs, outputs)| {
            (prop::collection::vec(0u8..3, 1 + params + states), prop::collection::vec(any::<usize>(), states))
                .prop_map(move |(leaf_dtypes, updates)| FuzzProgram {
                    rows,
                    cols,
                    leaf_dtypes,
                    params,
                    instrs: instrs.clone(),
                    outputs: outputs.clone(),
                    updates,
                })
        })
}

/// Builds the program. Values that are states or views of states are never
/// outputs and never read after the updates, which run last, so every
/// update can run in place as the planner requires.
pub fn fuzz_trace(p: &FuzzProgram) -> Trace {
    let (r, c) = (p.rows, p.cols);
    let mut b = Builder::new("fuzz");
    let base = |d: u8| TensorType::new(DTYPES[d as usize], [r, c]);
    // (value, whether it shares a state's bytes)
    let mut vals: Vec<(ValueId, bool)> = vec![(b.input("x", base(p.leaf_dtypes[0])).unwrap(), false)];
    for k in 0..p.params {
        vals.push((b.param(&format!("w{k}"), base(p.leaf_dtypes[1 + k])).unwrap(), false));
    }
    let states: Vec<ValueId> = (0..p.updates.len())
        .map(|k| b.state(&format!("s{k}"), base(p.leaf_dtypes[1 + p.params + k])).unwrap())
        .collect();
    vals.extend(states.iter().map(|&s| (s, true)));
    let pick = |vals: &[(ValueId, bool)], i: usize| vals[i % vals.len()];
    // Any value as a fresh-or-view [r, c] tensor of `dtype`.
    let coerce = |b: &mut Builder, v: ValueId, dtype: DType| {
        let v = if b.ty(v).numel() == r * c {
            b.reshape(v, &[r, c]).unwrap()
        } else {
            let s = b.sum_all(v).unwrap();
            let s = b.reshape(s, &[1, 1]).unwrap();
            b.broadcast(s, &[r, c]).unwrap()
        };
        b.cast(v, dtype).unwrap()
    };
    for ins in &p.instrs {
        let v = match *ins {
            FuzzInstr::Unary(f, a) => {
                let f = [UnaryFn::Tanh, UnaryFn::Neg, UnaryFn::Sigmoid, UnaryFn::Silu][f as usize];
                (b.unary(f, pick(&vals, a).0).unwrap(), false)
            }
            FuzzInstr::Binary(f, a, e) => {
                let x = pick(&vals, a).0;
                let dtype = b.dtype(x);
                let x = coerce(&mut b, x, dtype);
                let y = coerce(&mut b, pick(&vals, e).0, dtype);
                let v = match f {
                    0 => b.add(x, y),
                    1 => b.mul(x, y),
                    _ => b.sub(x, y),
                };
                (v.unwrap(), false)
            }
            FuzzInstr::View(shape, a) => {
                let (x, of_state) = pick(&vals, a);
                let n = b.ty(x).numel();
                let shapes: [Vec<usize>; 4] =
                    [vec![n], vec![1, n], vec![n, 1], b.shape(x).iter().rev().copied().collect()];
                (b.reshape(x, &shapes[shape as usize]).unwrap(), of_state)
            }
            FuzzInstr::SumRows(a) => {
                let x = pick(&vals, a).0;
                let dtype = b.dtype(x);
                let x = coerce(&mut b, x, dtype);
                (b.sum(x, &[0], true).unwrap(), false)
            }
            FuzzInstr::Matmul(a, e) => {
                let x = pick(&vals, a).0;
                let dtype = b.dtype(x);
                let x = coerce(&mut b, x, dtype);
                let y = coerce(&mut b, pick(&vals, e).0, dtype);
                (b.matmul(x, y, false, true).unwrap(), false)
            }
            FuzzInstr::Cast(d, a) => {
                let (x, of_state) = pick(&vals, a);
                // A cast to the same dtype is the value itself (a view when of a state).
                let same = b.dtype(x) == DTYPES[d as usize];
                (b.cast(x, DTYPES[d as usize]).unwrap(), of_state && same)
            }
            FuzzInstr::SlicePart(k, a) => {
                let x = pick(&vals, a).0;
                let dtype = b.dtype(x);
                let x = coerce(&mut b, x, dtype);
                let x = b.reshape(x, &[1, 1, r * c]).unwrap();
                let wide = b.broadcast(x, &[1, 4, r * c]).unwrap();
                let part = b.slice(wide, 1, k as usize, k as usize + 1).unwrap();
                (b.reshape(part, &[r, c]).unwrap(), false)
            }
        };
        vals.push(v);
    }
    let free: Vec<ValueId> = vals.iter().filter(|v| !v.1).map(|v| v.0).collect();
    for (k, &o) in p.outputs.iter().enumerate() {
        b.output(OutputKind::Named(format!("o{k}")), free[o % free.len()]);
    }
    // First what each update adds (fresh values), then the updates themselves.
    let addends: Vec<ValueId> = states
        .iter()
        .zip(&p.updates)
        .map(|(&s, &a)| {
            let dtype = b.dtype(s);
            let x = coerce(&mut b, free[a % free.len()], dtype);
            b.unary(UnaryFn::Tanh, x).unwrap()
        })
        .collect();
    for (&s, &t) in states.iter().zip(&addends) {
        let new = b.add(s, t).unwrap();
        b.update(s, new);
    }
    let trace = b.finish("fuzz").unwrap();
    stepgraph_core::passes::slice_views(&trace).unwrap().0
}

/// Runs `trace` under `plan` on the CPU from deterministic leaves and
/// returns the bytes of every output and every updated state.
fn run(trace: &Trace, plan: MemoryPlan) -> Vec<Vec<u8>> {
    let mut s = CpuSession::new(trace.clone(), plan).unwrap();
    for (k, v) in trace.leaves().enumerate() {
        let ty = trace.ty(v).clone();
        let data: Vec<f64> = (0..ty.numel()).map(|i| ((i * 37 + k * 11) % 17) as f64 / 8.0 - 1.0).collect();
        s.write(v, &HostTensor::from_f64(ty, &data)).unwrap();
    }
    s.run_eager().unwrap();
    let mut out: Vec<ValueId> = trace.outputs.iter().map(|o| o.value).collect();
    out.extend(trace.updates.iter().map(|u| u.new));
    out.into_iter().map(|v| s.read(v).bytes().to_vec()).collect()
}

/// Moves every value of group `g` to `offset`, growing its region to fit.
fn move_group(p: &mut MemoryPlan, g: usize, offset: u64) {
    let from = p.groups[g].offset;
    p.groups[g].offset = offset;
    // Members keep their places within the group (a slice view starts inside it).
    for &m in &p.groups[g].members.clone() {
        let slot = &mut p.slots[m.index()];
        slot.offset = slot.offset - from + offset;
    }
    let end = align_up(offset + p.groups[g].bytes);
    match p.groups[g].region {
        Region::Arena => p.arena_bytes = p.arena_bytes.max(end),
        Region::Persistent => p.persistent_bytes = p.persistent_bytes.max(end),
        Region::Host => p.host_bytes = p.host_bytes.max(end),
    }
}

/// What [`fuzz_case`] saw, summed over cases by the fuzz target.
#[derive(Default, Debug)]
struct FuzzStats {
    programs: usize,
    values: usize,
    /// Mutations the checker must reject, and rejected.
    rejected: usize,
    /// Random moves the checker accepted (then run and found to compute the same).
    accepted_moves: usize,
    /// Random moves the checker rejected.
    rejected_moves: usize,
}

/// Plans, checks and runs one program, then mutates its plan.
fn fuzz_case(program: &FuzzProgram, seed: u64, stats: &mut FuzzStats) -> Result<(), TestCaseError> {
    let trace = fuzz_trace(program);
    let planned = plan(&trace, PlanOptions::default()).unwrap();
    let unplanned = plan(&trace, PlanOptions { reuse: false, ..PlanOptions::default() }).unwrap();
    for p in [&planned, &unplanned] {
        check_plan(&trace, p).unwrap();
        prop_assert!(p.arena_bytes >= p.arena_floor_bytes);
        prop_assert_eq!(p.arena_bytes % ARENA_ALIGN, 0);
    }
    prop_assert!(planned.arena_bytes <= unplanned.arena_bytes);
    let reference = run(&trace, unplanned);
    prop_assert!(run(&trace, planned.clone()) == reference, "planned and unplanned runs differ");
    stats.programs += 1;
    stats.values += trace.values.len();

    let mut rng = seed | 1;
    let mut next = |n: usize| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % n.max(1) as u64) as usize
    };
    let rejects = |p: &MemoryPlan, why: &str, what: &str| -> Result<(), TestCaseError> {
        match check_plan(&trace, p) {
            Ok(()) => Err(TestCaseError::fail(format!("check_plan accepted {what}"))),
            Err(e) => {
                prop_assert!(e.to_string().contains(why), "{what}: {e}");
                Ok(())
            }
        }
    };
    let groups = &planned.groups;
    let arena: Vec<usize> =
        (0..groups.len()).filter(|&g| groups[g].region == Region::Arena && groups[g].bytes > 0).collect();

    // Two arena groups alive together at a position inside both lifetimes:
    // no hand-over can make them share bytes. (Only groups whose every
    // value starts at the group's start: a slice view, and what runs in
    // place on one at its source's start, hold only part of the group's
    // bytes, and the rest may truly be free before the group ends.)
    let whole = |g: usize| groups[g].members.iter().all(|m| planned.slots[m.index()].offset == groups[g].offset);
    let mut pairs = Vec::new();
    for &g in &arena {
        for &h in &arena {
            let (a, b) = (&groups[g], &groups[h]);
            if g != h && whole(g) && whole(h) && a.start.max(b.start) + 1 < a.end.min(b.end) {
                pairs.push((g, h));
            }
        }
    }
    if !pairs.is_empty() {
        let (g, h) = pairs[next(pairs.len())];
        let mut p = planned.clone();
        move_group(&mut p, h, groups[g].offset);
        rejects(&p, "overlap", "two live arena groups on one offset")?;
        stats.rejected += 1;
    }
    // An offset off the arena's alignment.
    if !arena.is_empty() {
        let g = arena[next(arena.len())];
        let mut p = planned.clone();
        move_group(&mut p, g, groups[g].offset + 1 + next(ARENA_ALIGN as usize - 1) as u64);
        rejects(&p, "not aligned", "a misaligned arena offset")?;
        stats.rejected += 1;
    }
    // An arena one byte short of its last value.
    let top = (0..trace.values.len())
        .filter(|&v| planned.slots[v].region == Region::Arena)
        .map(|v| planned.slots[v].offset + trace.values[v].ty.bytes())
        .max()
        .unwrap_or(0);
    if top > 0 {
        let mut p = planned.clone();
        p.arena_bytes = top - 1;
        rejects(&p, "does not fit", "a value past the end of the arena")?;
        stats.rejected += 1;
    }
    // A view moved off its source.
    let views: Vec<ValueId> = trace.nodes.iter().filter(|n| n.op.view_of().is_some()).map(|n| n.outputs[0]).collect();
    if !views.is_empty() {
        let v = views[next(views.len())];
        let mut p = planned.clone();
        let slot = &mut p.slots[v.index()];
        slot.offset += ARENA_ALIGN;
        let end = slot.offset + trace.ty(v).bytes();
        match slot.region {
            Region::Arena => p.arena_bytes = p.arena_bytes.max(end),
            Region::Persistent => p.persistent_bytes = p.persistent_bytes.max(end),
            Region::Host => p.host_bytes = p.host_bytes.max(end),
        }
        rejects(&p, "does not sit at its place", "a view apart from its source")?;
        stats.rejected += 1;
    }
    // Two persistent buffers on one offset (aligned for both).
    let persistent: Vec<usize> =
        (0..groups.len()).filter(|&g| groups[g].region == Region::Persistent && groups[g].bytes > 0).collect();
    let elem = |g: usize| trace.ty(groups[g].members[0]).dtype.size() as u64;
    let shareable: Vec<(usize, usize)> = persistent
        .iter()
        .flat_map(|&g| persistent.iter().map(move |&h| (g, h)))
        .filter(|&(g, h)| g != h && groups[g].offset.is_multiple_of(elem(h)))
        .collect();
    if !shareable.is_empty() {
        let (g, h) = shareable[next(shareable.len())];
        let mut p = planned.clone();
        move_group(&mut p, h, groups[g].offset);
        rejects(&p, "overlap", "two persistent buffers on one offset")?;
        stats.rejected += 1;
    }
    // A parameter or state moved into the arena.
    let leaves: Vec<ValueId> = trace
        .leaves()
        .filter(|&v| matches!(trace.value(v).kind, ValueKind::Param { .. } | ValueKind::State { .. }))
        .collect();
    if !leaves.is_empty() {
        let v = leaves[next(leaves.len())];
        let mut p = planned.clone();
        p.slots[v.index()] = stepgraph_core::plan::Slot { region: Region::Arena, offset: 0, ..p.slots[v.index()] };
        p.arena_bytes = p.arena_bytes.max(align_up(trace.ty(v).bytes()));
        rejects(&p, "wrong region", "a parameter in the arena")?;
        stats.rejected += 1;
    }
    // A random move: whatever the checker accepts must compute what the
    // unplanned program computes.
    if !arena.is_empty() {
        let g = arena[next(arena.len())];
        let slots = (planned.arena_bytes / ARENA_ALIGN) as usize + 1;
        let mut p = planned.clone();
        move_group(&mut p, g, next(slots) as u64 * ARENA_ALIGN);
        if check_plan(&trace, &p).is_ok() {
            prop_assert!(run(&trace, p) == reference, "check_plan accepted a plan that computes something else");
            stats.accepted_moves += 1;
        } else {
            stats.rejected_moves += 1;
        }
    }
    Ok(())
}

/// Runs the fuzz target over `config.cases` programs and prints what it saw.
fn fuzz(config: ProptestConfig, max_instrs: usize) {
    let stats = std::cell::RefCell::new(FuzzStats::default());
    let mut runner = proptest::test_runner::TestRunner::new(config);
    let result = runner.run(&(fuzz_program(max_instrs), any::<u64>()), |(program, seed)| {
        fuzz_case(&program, seed, &mut stats.borrow_mut())
    });
    eprintln!("fuzz_planner_and_checker: {:?}", stats.borrow());
    if let Err(e) = result {
        panic!("{e}");
    }
}

#[test]
fn fuzz_planner_and_checker_briefly() {
    fuzz(ProptestConfig::with_cases(48), 40);
}

/// The long run: `PROPTEST_CASES=N cargo test --release -p stepgraph-core
/// --test plan_props -- --ignored --nocapture` (see the README).
#[test]
#[ignore = "long fuzz run; the case count comes from PROPTEST_CASES"]
fn fuzz_planner_and_checker() {
    fuzz(ProptestConfig::default(), 80);
}

#[test]
fn check_plan_rejects_misaligned_and_out_of_region_slots_without_overflow() {
    let trace = program(&[Instr::Unary(0, 0), Instr::Unary(0, 2)], &[3]);
    let p = plan(&trace, PlanOptions::default()).unwrap();
    let v = ValueId(2);
    let mut misaligned = p.clone();
    misaligned.slots[v.index()].offset += 8;
    misaligned.arena_bytes += ARENA_ALIGN;
    let err = check_plan(&trace, &misaligned).unwrap_err().to_string();
    assert!(err.contains("not aligned to 256 bytes") && err.contains("offset"), "{err}");
    // An offset near the top of u64 is out of the region, not a wrapped sum.
    let mut far = p.clone();
    far.slots[v.index()].offset = u64::MAX - 255;
    let err = check_plan(&trace, &far).unwrap_err().to_string();
    assert!(err.contains("does not fit its slot"), "{err}");
}

#[test]
fn sizes_past_the_plan_cap_are_errors_not_wrapped_sums() {
    let err = assign_offsets(&[(0, 1, u64::MAX), (0, 1, 256)]).unwrap_err().to_string();
    assert!(err.contains("interval 0") && err.contains(&MAX_PLAN_BYTES.to_string()), "{err}");
    let err = assign_offsets(&[(0, 1, MAX_PLAN_BYTES / 2), (1, 2, MAX_PLAN_BYTES / 2 + 1)]).unwrap_err().to_string();
    assert!(err.contains("interval 1"), "{err}");
    assert_eq!(assign_offsets(&[(0, 1, MAX_PLAN_BYTES / 2), (2, 3, MAX_PLAN_BYTES / 2)]).unwrap(), [0, 0]);

    // A program whose values sum past the cap: two [2^29, 2^29] f32 tensors of 2^60 bytes each.
    let mut b = Builder::new("huge");
    let x = b.input("x", TensorType::new(DType::F32, [1 << 29, 1 << 29])).unwrap();
    let y = b.unary(UnaryFn::Neg, x).unwrap();
    b.output(OutputKind::Named("y".into()), y);
    let trace = b.finish("huge").unwrap();
    let err = plan(&trace, PlanOptions::default()).unwrap_err().to_string();
    assert!(err.contains("`huge` needs more than") && err.contains("the most one plan can hold"), "{err}");
}

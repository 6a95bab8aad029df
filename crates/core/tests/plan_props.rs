//! Property tests of the memory planner: random lifetimes for the offset
//! assignment, random programs for the whole planner, each checked by
//! `check_plan` (and, for programs, by running planned against unplanned).

use proptest::prelude::*;

use stepgraph_core::ir::{Builder, DType, OutputKind, TensorType, Trace, ValueId};
use stepgraph_core::ops::UnaryFn;
use stepgraph_core::plan::{align_up, assign_offsets, check_plan, plan, PlanOptions, Region};

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
            let p = plan(&trace, PlanOptions { reuse }).unwrap();
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

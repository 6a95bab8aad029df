//! The IR: typed ids, dtypes, tensor types, values, nodes and the [`Trace`].
//!
//! A trace is a straight-line SSA program over tensors with static shapes.
//! Values live in one dense table indexed by [`ValueId`]; nodes in another
//! indexed by [`NodeId`]. A value is either a *leaf* (a step input, a
//! parameter or a piece of optimizer state: persistent or written between
//! steps) or the output of exactly one node.
//!
//! **Invariants** (checked by [`verify::verify`] after every pass in debug builds):
//! - every node input is a leaf or the output of an earlier node;
//! - every non-leaf value is the output of exactly one node;
//! - each node's output types are what its op's shape rule infers;
//! - `saved` lists exactly the forward values that backward nodes read;
//! - each state update pairs a leaf with a node value of the same type;
//! - every value spans at most [`MAX_VALUE_BYTES`] with each zero
//!   dimension counted as one ([`TensorType::check_size`]), so its element
//!   count, its bytes and every partial product of its dimensions (a row, a
//!   stride) fit their integer types: `numel()` and `bytes()` are exact.

pub mod parse;
pub mod print;
pub mod verify;

use std::fmt;

use crate::error::{Error, Result};
use crate::ops::Op;
pub use crate::types::{DType, TensorType, MAX_VALUE_BYTES};

/// The byte boundary every planned tensor starts on (what GPU libraries
/// want). The plan places each arena offset on it, and ops rely on it where
/// a view of part of a tensor must start where a tensor could.
pub const ARENA_ALIGN: u64 = 256;

/// Index of a value in [`Trace::values`]; prints as `%12`.
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct ValueId(pub u32);

/// Index of a node in [`Trace::nodes`].
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct NodeId(pub u32);

impl ValueId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}
impl NodeId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}
impl fmt::Display for ValueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.0)
    }
}

/// What a value is to the step, which decides where its memory lives.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum ValueKind {
    /// Written by the host before each step (token ids, targets, learning rate, step count).
    Input { name: String },
    /// A model parameter: persistent, trained (a train step differentiates
    /// the loss with respect to it and updates it).
    Param { name: String },
    /// A frozen model weight (the base model under adapters): persistent
    /// and read-only. It gets no gradient, no gradient buffer and no
    /// optimizer state, and no node may update it.
    Frozen { name: String },
    /// Optimizer state (AdamW moments): persistent.
    State { name: String },
    /// Produced by a node. Its memory comes from the arena.
    Node(NodeId),
}

impl ValueKind {
    pub fn is_leaf(&self) -> bool {
        !matches!(self, ValueKind::Node(_))
    }

    pub fn leaf_name(&self) -> Option<&str> {
        match self {
            ValueKind::Input { name }
            | ValueKind::Param { name }
            | ValueKind::Frozen { name }
            | ValueKind::State { name } => Some(name),
            ValueKind::Node(_) => None,
        }
    }
}

#[derive(Clone, PartialEq, Debug)]
pub struct Value {
    pub ty: TensorType,
    pub kind: ValueKind,
}

/// Which part of the step a node belongs to; printed as section markers.
#[derive(Copy, Clone, PartialEq, Eq, Debug, PartialOrd, Ord)]
pub enum Phase {
    Forward,
    Backward,
    Optimizer,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer",
        }
    }
}

#[derive(Clone, PartialEq, Debug)]
pub struct Node {
    pub op: Op,
    pub inputs: Vec<ValueId>,
    pub outputs: Vec<ValueId>,
    pub phase: Phase,
}

/// What a trace output means to its caller.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum OutputKind {
    /// The scalar loss.
    Loss,
    /// The gradient of a parameter (the parameter's leaf value).
    Grad(ValueId),
    /// Any other named result (logits of an inference trace, ...).
    Named(String),
}

#[derive(Clone, PartialEq, Debug)]
pub struct Output {
    pub kind: OutputKind,
    pub value: ValueId,
}

/// The new value of a persistent leaf after the step (parameters and optimizer
/// state under `train`). The planner gives `new` the storage of `state`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Update {
    pub state: ValueId,
    pub new: ValueId,
}

/// One step program. See the module doc for its invariants.
#[derive(Clone, PartialEq, Debug, Default)]
pub struct Trace {
    /// What the trace computes: `forward`, `grads`, `train`, or a test name.
    pub name: String,
    /// The pass that produced this version of the trace.
    pub pass: String,
    pub values: Vec<Value>,
    pub nodes: Vec<Node>,
    pub outputs: Vec<Output>,
    pub updates: Vec<Update>,
    /// Forward values read by backward nodes, kept alive across the boundary.
    pub saved: Vec<ValueId>,
}

impl Trace {
    pub fn value(&self, v: ValueId) -> &Value {
        &self.values[v.index()]
    }

    pub fn ty(&self, v: ValueId) -> &TensorType {
        &self.values[v.index()].ty
    }

    pub fn node(&self, n: NodeId) -> &Node {
        &self.nodes[n.index()]
    }

    pub fn value_ids(&self) -> impl Iterator<Item = ValueId> {
        (0..self.values.len() as u32).map(ValueId)
    }

    pub fn leaves(&self) -> impl Iterator<Item = ValueId> + '_ {
        self.value_ids().filter(|v| self.value(*v).kind.is_leaf())
    }

    pub fn params(&self) -> impl Iterator<Item = ValueId> + '_ {
        self.value_ids().filter(|v| matches!(self.value(*v).kind, ValueKind::Param { .. }))
    }

    /// The frozen weights ([`ValueKind::Frozen`]).
    pub fn frozen(&self) -> impl Iterator<Item = ValueId> + '_ {
        self.value_ids().filter(|v| matches!(self.value(*v).kind, ValueKind::Frozen { .. }))
    }

    /// The model's weights: trained parameters and frozen weights alike,
    /// what a model folder or a checkpoint of the model fills.
    pub fn weights(&self) -> impl Iterator<Item = ValueId> + '_ {
        self.value_ids().filter(|v| matches!(self.value(*v).kind, ValueKind::Param { .. } | ValueKind::Frozen { .. }))
    }

    pub fn inputs(&self) -> impl Iterator<Item = ValueId> + '_ {
        self.value_ids().filter(|v| matches!(self.value(*v).kind, ValueKind::Input { .. }))
    }

    /// The leaf called `name`, if any.
    pub fn leaf_by_name(&self, name: &str) -> Option<ValueId> {
        self.leaves().find(|v| self.value(*v).kind.leaf_name() == Some(name))
    }

    /// The node that defines `v`, or `None` for a leaf.
    pub fn producer(&self, v: ValueId) -> Option<NodeId> {
        match self.value(v).kind {
            ValueKind::Node(n) => Some(n),
            _ => None,
        }
    }

    pub fn loss(&self) -> Option<ValueId> {
        self.outputs.iter().find(|o| o.kind == OutputKind::Loss).map(|o| o.value)
    }

    /// The gradient output of parameter `param`, if the trace has one.
    pub fn grad_of(&self, param: ValueId) -> Option<ValueId> {
        self.outputs.iter().find(|o| o.kind == OutputKind::Grad(param)).map(|o| o.value)
    }

    /// A short label for a value in reports: its leaf name, or `%N` with the op that made it.
    pub fn describe(&self, v: ValueId) -> String {
        match &self.value(v).kind {
            ValueKind::Input { name } => format!("input {name}"),
            ValueKind::Param { name } => format!("param {name}"),
            ValueKind::Frozen { name } => format!("frozen {name}"),
            ValueKind::State { name } => format!("state {name}"),
            ValueKind::Node(n) => {
                let node = self.node(*n);
                let grad = self.outputs.iter().find_map(|o| match o.kind {
                    OutputKind::Grad(p) if o.value == v => self.value(p).kind.leaf_name(),
                    _ => None,
                });
                match grad {
                    Some(p) => format!("{v} grad of {p}"),
                    None => format!("{v} = {} ({})", node.op.name(), node.phase.name()),
                }
            }
        }
    }

    /// Values that forward nodes define and backward/optimizer nodes read.
    pub fn derive_saved(&self) -> Vec<ValueId> {
        let mut seen = vec![false; self.values.len()];
        let mut saved = Vec::new();
        for node in self.nodes.iter().filter(|n| n.phase != Phase::Forward) {
            for &i in &node.inputs {
                let fwd = match self.producer(i) {
                    Some(p) => self.node(p).phase == Phase::Forward,
                    None => false,
                };
                if fwd && !seen[i.index()] {
                    seen[i.index()] = true;
                    saved.push(i);
                }
            }
        }
        saved.sort();
        saved
    }

    /// Bytes of all leaves of one kind.
    pub fn leaf_bytes(&self, pred: impl Fn(&ValueKind) -> bool) -> u64 {
        self.values.iter().filter(|v| pred(&v.kind)).map(|v| v.ty.bytes()).sum()
    }
}

/// How a leaf of `kind` is called in messages.
fn leaf_kind_name(kind: &ValueKind) -> &'static str {
    match kind {
        ValueKind::Input { .. } => "input",
        ValueKind::Param { .. } => "parameter",
        ValueKind::Frozen { .. } => "frozen weight",
        ValueKind::State { .. } => "state",
        ValueKind::Node(_) => "value",
    }
}

/// Records ops on symbolic tensors into a [`Trace`], inferring every output type.
pub struct Builder {
    trace: Trace,
    phase: Phase,
    /// The names of the trace's leaves, so adding one is not a scan of every value.
    leaf_names: std::collections::HashSet<String>,
}

impl Builder {
    pub fn new(name: impl Into<String>) -> Self {
        Builder {
            trace: Trace { name: name.into(), pass: "build".into(), ..Trace::default() },
            phase: Phase::Forward,
            leaf_names: Default::default(),
        }
    }

    /// Continue building on an existing trace (autodiff appends backward nodes).
    pub fn from_trace(trace: Trace) -> Self {
        let leaf_names = trace.values.iter().filter_map(|v| v.kind.leaf_name()).map(str::to_string).collect();
        Builder { trace, phase: Phase::Forward, leaf_names }
    }

    pub fn set_phase(&mut self, phase: Phase) {
        self.phase = phase;
    }

    pub fn trace(&self) -> &Trace {
        &self.trace
    }

    pub fn ty(&self, v: ValueId) -> &TensorType {
        self.trace.ty(v)
    }

    pub fn shape(&self, v: ValueId) -> &[usize] {
        &self.trace.ty(v).shape
    }

    pub fn dtype(&self, v: ValueId) -> DType {
        self.trace.ty(v).dtype
    }

    /// Appends a value whose type has passed [`TensorType::check_size`];
    /// fails when value ids (32-bit) run out.
    fn add_value(&mut self, ty: TensorType, kind: ValueKind) -> Result<ValueId> {
        let id = u32::try_from(self.trace.values.len()).map_err(|_| Error::Size {
            keys: vec![],
            reason: format!("trace `{}` has more values than 2^32 ids", self.trace.name),
        })?;
        self.trace.values.push(Value { ty, kind });
        Ok(ValueId(id))
    }

    fn leaf(&mut self, kind: ValueKind, ty: TensorType) -> Result<ValueId> {
        let name = kind.leaf_name().unwrap_or_default().to_string();
        if name.is_empty() || name.chars().any(char::is_whitespace) {
            return Err(Error::op("leaf", format!("invalid leaf name `{name}`")));
        }
        if self.leaf_names.contains(&name) {
            return Err(Error::op("leaf", format!("duplicate leaf name `{name}`")));
        }
        ty.check_size().map_err(|reason| Error::Size {
            keys: vec![],
            reason: format!("{kind_name} `{name}`: {reason}", kind_name = leaf_kind_name(&kind)),
        })?;
        self.leaf_names.insert(name);
        self.add_value(ty, kind)
    }

    /// A step input written by the host before each step.
    pub fn input(&mut self, name: &str, ty: TensorType) -> Result<ValueId> {
        self.leaf(ValueKind::Input { name: name.into() }, ty)
    }

    pub fn param(&mut self, name: &str, ty: TensorType) -> Result<ValueId> {
        self.leaf(ValueKind::Param { name: name.into() }, ty)
    }

    /// A frozen weight: persistent, read-only, never differentiated.
    pub fn frozen(&mut self, name: &str, ty: TensorType) -> Result<ValueId> {
        self.leaf(ValueKind::Frozen { name: name.into() }, ty)
    }

    pub fn state(&mut self, name: &str, ty: TensorType) -> Result<ValueId> {
        self.leaf(ValueKind::State { name: name.into() }, ty)
    }

    /// Copies every leaf of `from` (inputs, parameters, state: same names,
    /// kinds and types) into this trace, for a rewrite that rebuilds `from`'s
    /// nodes; returns `from`'s value ids mapped to the copies (leaves only).
    pub fn copy_leaves(&mut self, from: &Trace) -> Result<Vec<Option<ValueId>>> {
        let mut map = vec![None; from.values.len()];
        for v in from.leaves() {
            let val = from.value(v);
            map[v.index()] = Some(self.leaf(val.kind.clone(), val.ty.clone())?);
        }
        Ok(map)
    }

    /// Append a node, checking its inputs and inferring its output types.
    pub fn push(&mut self, op: Op, inputs: &[ValueId]) -> Result<Vec<ValueId>> {
        for &i in inputs {
            if i.index() >= self.trace.values.len() {
                return Err(Error::op(op.name(), format!("input {i} does not exist")));
            }
        }
        let types: Vec<&TensorType> = inputs.iter().map(|&i| self.trace.ty(i)).collect();
        let out_types = op.infer(&types).map_err(|reason| {
            let shown: Vec<String> = types.iter().map(|t| t.to_string()).collect();
            Error::op(op.name(), format!("{reason} (inputs: {})", shown.join(", ")))
        })?;
        for t in &out_types {
            t.check_size().map_err(|reason| Error::Size {
                keys: vec![],
                reason: format!("the output of `{}`: {reason}", op.name()),
            })?;
        }
        let node_id = NodeId(u32::try_from(self.trace.nodes.len()).map_err(|_| Error::Size {
            keys: vec![],
            reason: format!("trace `{}` has more nodes than 2^32 ids", self.trace.name),
        })?);
        let outputs: Vec<ValueId> =
            out_types.into_iter().map(|t| self.add_value(t, ValueKind::Node(node_id))).collect::<Result<_>>()?;
        self.trace.nodes.push(Node { op, inputs: inputs.to_vec(), outputs: outputs.clone(), phase: self.phase });
        Ok(outputs)
    }

    /// [`Builder::push`] for ops with exactly one output.
    pub fn push1(&mut self, op: Op, inputs: &[ValueId]) -> Result<ValueId> {
        let name = op.name();
        let outs = self.push(op, inputs)?;
        match outs.as_slice() {
            [v] => Ok(*v),
            _ => Err(Error::op(name, format!("expected one output, got {}", outs.len()))),
        }
    }

    pub fn output(&mut self, kind: OutputKind, value: ValueId) {
        self.trace.outputs.push(Output { kind, value });
    }

    pub fn update(&mut self, state: ValueId, new: ValueId) {
        self.trace.updates.push(Update { state, new });
    }

    /// Finish a rewrite of `from` (leaves copied by [`Builder::copy_leaves`],
    /// nodes pushed anew, `map` taking each old value to its new one): its
    /// outputs and updates through `map`, then [`Builder::finish`] under
    /// `pass`, keeping `from`'s name.
    pub fn finish_rewrite(mut self, from: &Trace, map: &[Option<ValueId>], pass: &str) -> Result<Trace> {
        let m = |v: ValueId| map[v.index()].expect("every output and update is defined by the rewrite");
        for o in &from.outputs {
            let kind = match &o.kind {
                OutputKind::Grad(p) => OutputKind::Grad(m(*p)),
                other => other.clone(),
            };
            self.output(kind, m(o.value));
        }
        for u in &from.updates {
            self.update(m(u.state), m(u.new));
        }
        let mut t = self.finish(pass)?;
        t.name = from.name.clone();
        Ok(t)
    }

    /// Finish: number the values canonically (leaves first, then in node
    /// order), record which values are saved for backward, and verify.
    pub fn finish(self, pass: &str) -> Result<Trace> {
        let mut trace = renumber(self.trace);
        trace.pass = pass.into();
        trace.saved = trace.derive_saved();
        verify::verify(&trace)?;
        Ok(trace)
    }
}

/// Renumber values densely: leaves in creation order, then node outputs in
/// node order, so a printed trace reads top to bottom with increasing ids.
pub fn renumber(trace: Trace) -> Trace {
    let n = trace.values.len();
    let mut order: Vec<ValueId> = trace.leaves().collect();
    for node in &trace.nodes {
        order.extend(node.outputs.iter().copied());
    }
    let mut map = vec![ValueId(u32::MAX); n];
    for (new, old) in order.iter().enumerate() {
        map[old.index()] = ValueId(new as u32);
    }
    let m = |v: &ValueId| map[v.index()];
    let values = order.iter().map(|old| trace.values[old.index()].clone()).collect();
    Trace {
        name: trace.name,
        pass: trace.pass,
        values,
        nodes: trace
            .nodes
            .into_iter()
            .map(|nd| Node {
                op: nd.op,
                inputs: nd.inputs.iter().map(m).collect(),
                outputs: nd.outputs.iter().map(m).collect(),
                phase: nd.phase,
            })
            .collect(),
        outputs: trace
            .outputs
            .into_iter()
            .map(|o| Output {
                kind: match o.kind {
                    OutputKind::Grad(p) => OutputKind::Grad(m(&p)),
                    k => k,
                },
                value: m(&o.value),
            })
            .collect(),
        updates: trace.updates.iter().map(|u| Update { state: m(&u.state), new: m(&u.new) }).collect(),
        saved: trace.saved.iter().map(m).collect(),
    }
}

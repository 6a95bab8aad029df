//! Parses the text that [`super::print`] writes. Print → parse → print is
//! stable; a parsed trace is verified before it is returned, and every error
//! names the line and what was expected there.

use std::collections::BTreeMap;

use crate::error::{Error, Result};
use crate::ir::{DType, Node, NodeId, Output, OutputKind, Phase, TensorType, Trace, Update, Value, ValueId, ValueKind};
use crate::ops::{Attr, Attrs, Op};

/// Parses a printed trace.
pub fn parse(text: &str) -> Result<Trace> {
    let mut trace = Trace::default();
    let mut slots: Vec<Option<Value>> = Vec::new();
    let mut phase = Phase::Forward;
    let mut saved = None;
    let mut seen_trace = false;
    for (i, raw) in text.lines().enumerate() {
        let line_no = i + 1;
        let err = |reason: String| Error::Parse { line: line_no, reason };
        if let Some(pass) = raw.trim().strip_prefix("# after:") {
            trace.pass = pass.trim().to_string();
            continue;
        }
        let line = match raw.find(" #") {
            Some(p) => &raw[..p],
            None if raw.trim_start().starts_with('#') => "",
            None => raw,
        }
        .trim();
        if line.is_empty() {
            continue;
        }
        let (head, rest) = line.split_once(' ').unwrap_or((line, ""));
        match head {
            "trace" => {
                trace.name = rest.trim().to_string();
                seen_trace = true;
            }
            "input" | "param" | "frozen" | "state" => {
                let (id, rest) = rest.split_once(':').ok_or_else(|| err(format!("expected `{head} %N: TYPE NAME`")))?;
                let id = parse_id(id).map_err(err)?;
                let mut parts = rest.split_whitespace();
                let ty = parse_type(parts.next().unwrap_or("")).map_err(err)?;
                let name = parts.next().ok_or_else(|| err(format!("{head} {id} has no name")))?.to_string();
                if parts.next().is_some() {
                    return Err(err("unexpected text after the name".into()));
                }
                let kind = match head {
                    "input" => ValueKind::Input { name },
                    "param" => ValueKind::Param { name },
                    "frozen" => ValueKind::Frozen { name },
                    _ => ValueKind::State { name },
                };
                define(&mut slots, id, Value { ty, kind }).map_err(err)?;
            }
            "==" => {
                let name = rest.trim_end_matches('=').trim();
                phase = match name {
                    "forward" => Phase::Forward,
                    "backward" => Phase::Backward,
                    "optimizer" => Phase::Optimizer,
                    _ => return Err(err(format!("unknown phase `{name}`"))),
                };
            }
            "saved" => {
                saved = Some(rest.split(',').map(parse_id).collect::<std::result::Result<Vec<_>, _>>().map_err(err)?);
            }
            "output" => {
                let mut parts = rest.split_whitespace();
                let kind = parts.next().unwrap_or("");
                let value = parse_id(parts.next().unwrap_or("")).map_err(err)?;
                let kind = match kind {
                    "loss" => OutputKind::Loss,
                    "grad" => {
                        let pname = parts.next().ok_or_else(|| err("grad output without a parameter name".into()))?;
                        let p = slots
                            .iter()
                            .position(
                                |s| matches!(s, Some(Value { kind: ValueKind::Param { name }, .. }) if name == pname),
                            )
                            .ok_or_else(|| err(format!("no parameter named `{pname}`")))?;
                        OutputKind::Grad(ValueId(p as u32))
                    }
                    "value" => OutputKind::Named(
                        parts.next().ok_or_else(|| err("value output without a name".into()))?.to_string(),
                    ),
                    k => return Err(err(format!("unknown output kind `{k}`"))),
                };
                trace.outputs.push(Output { kind, value });
            }
            "update" => {
                let (a, b) = rest.split_once("<-").ok_or_else(|| err("expected `update %STATE <- %NEW`".into()))?;
                trace.updates.push(Update { state: parse_id(a).map_err(err)?, new: parse_id(b).map_err(err)? });
            }
            _ if head.starts_with('%') => {
                let node = parse_node(line, NodeId(trace.nodes.len() as u32), phase, &mut slots).map_err(err)?;
                trace.nodes.push(node);
            }
            _ => return Err(err(format!("cannot parse `{line}`"))),
        }
    }
    if !seen_trace {
        return Err(Error::Parse { line: 1, reason: "missing `trace NAME` line".into() });
    }
    trace.values = slots
        .into_iter()
        .enumerate()
        .map(|(i, s)| s.ok_or_else(|| Error::Parse { line: 0, reason: format!("%{i} is never defined") }))
        .collect::<Result<_>>()?;
    trace.saved = match saved {
        Some(s) => s,
        None => trace.derive_saved(),
    };
    super::verify::verify(&trace)?;
    Ok(trace)
}

fn define(slots: &mut Vec<Option<Value>>, id: ValueId, v: Value) -> std::result::Result<(), String> {
    if id.index() >= slots.len() {
        slots.resize(id.index() + 1, None);
    }
    if slots[id.index()].is_some() {
        return Err(format!("{id} is defined twice"));
    }
    slots[id.index()] = Some(v);
    Ok(())
}

fn parse_id(s: &str) -> std::result::Result<ValueId, String> {
    let s = s.trim();
    s.strip_prefix('%')
        .and_then(|n| n.parse::<u32>().ok())
        .map(ValueId)
        .ok_or_else(|| format!("expected a value id like %3, got `{s}`"))
}

fn parse_type(s: &str) -> std::result::Result<TensorType, String> {
    let (dt, rest) = s.split_once('[').ok_or_else(|| format!("expected a type like f32[2,3], got `{s}`"))?;
    let dtype = DType::parse(dt).ok_or_else(|| format!("unknown dtype `{dt}`"))?;
    let dims = rest.strip_suffix(']').ok_or_else(|| format!("unclosed shape in `{s}`"))?;
    let shape = if dims.is_empty() {
        vec![]
    } else {
        dims.split(',')
            .map(|d| d.trim().parse::<usize>().map_err(|_| format!("bad dimension `{d}` in `{s}`")))
            .collect::<std::result::Result<_, _>>()?
    };
    Ok(TensorType { dtype, shape })
}

/// `%a: T, %b: T = op %x, %y {k=v, k2=[1,2]}`
fn parse_node(
    line: &str,
    id: NodeId,
    phase: Phase,
    slots: &mut Vec<Option<Value>>,
) -> std::result::Result<Node, String> {
    let (lhs, rhs) = line.split_once(" = ").ok_or("expected `%N: TYPE = op ...`")?;
    let (call, attr_text) = match rhs.find('{') {
        Some(p) => {
            let a = rhs[p + 1..].trim_end().strip_suffix('}').ok_or("unclosed attribute braces")?;
            (&rhs[..p], a)
        }
        None => (rhs, ""),
    };
    let call = call.trim();
    let (name, args) = call.split_once(' ').unwrap_or((call, ""));
    let inputs = if args.trim().is_empty() {
        vec![]
    } else {
        args.split(',').map(parse_id).collect::<std::result::Result<Vec<_>, _>>()?
    };
    let attrs = Attrs { op: name.to_string(), map: parse_attrs(attr_text)? };
    let op = Op::parse(name, attrs).map_err(|e| e.to_string())?;
    let mut outputs = Vec::new();
    for part in lhs.split(", %") {
        let part = if part.starts_with('%') { part.to_string() } else { format!("%{part}") };
        let (oid, ty) = part.split_once(':').ok_or_else(|| format!("expected `%N: TYPE`, got `{part}`"))?;
        let oid = parse_id(oid)?;
        define(slots, oid, Value { ty: parse_type(ty.trim())?, kind: ValueKind::Node(id) })?;
        outputs.push(oid);
    }
    Ok(Node { op, inputs, outputs, phase })
}

fn parse_attrs(text: &str) -> std::result::Result<BTreeMap<String, Attr>, String> {
    let mut map = BTreeMap::new();
    let mut rest = text.trim();
    while !rest.is_empty() {
        let (key, after) = rest.split_once('=').ok_or_else(|| format!("expected `key=value` in `{rest}`"))?;
        let after = after.trim_start();
        let (value, tail) = if after.starts_with('[') {
            let end = after.find(']').ok_or("unclosed list attribute")?;
            (&after[..=end], &after[end + 1..])
        } else {
            match after.find(',') {
                Some(p) => (&after[..p], &after[p..]),
                None => (after, ""),
            }
        };
        let key = key.trim().to_string();
        if map.insert(key.clone(), parse_attr(value.trim())?).is_some() {
            return Err(format!("attribute `{key}` given twice"));
        }
        rest = tail.trim_start().trim_start_matches(',').trim_start();
    }
    Ok(map)
}

fn parse_attr(s: &str) -> std::result::Result<Attr, String> {
    if let Some(list) = s.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
        if list.trim().is_empty() {
            return Ok(Attr::Ints(vec![]));
        }
        // Integers, or numbers when any entry is not an integer.
        if let Ok(ints) = list.split(',').map(|x| x.trim().parse::<i64>()).collect::<std::result::Result<Vec<_>, _>>() {
            return Ok(Attr::Ints(ints));
        }
        return list
            .split(',')
            .map(|x| x.trim().parse::<f64>().map_err(|_| format!("bad number `{x}` in list")))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map(Attr::Floats);
    }
    match s {
        "true" => return Ok(Attr::Bool(true)),
        "false" => return Ok(Attr::Bool(false)),
        _ => {}
    }
    if let Some(d) = DType::parse(s) {
        return Ok(Attr::DType(d));
    }
    if let Ok(i) = s.parse::<i64>() {
        return Ok(Attr::Int(i));
    }
    s.parse::<f64>().map(Attr::Float).map_err(|_| format!("cannot parse attribute value `{s}`"))
}

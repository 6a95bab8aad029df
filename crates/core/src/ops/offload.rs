//! Copies between device memory and the plan's page-locked host memory
//! ([`crate::plan::Region::Host`]).
//!
//! The offload pass ([`crate::passes::offload`]) moves a value that
//! backward reads out of device memory for the stretch between its last
//! forward reader and its first backward one: `to_host` right after the
//! value is written, `to_device` a little before backward needs it. The
//! planner puts every `to_host` output in the host region (with a lifetime,
//! its bytes reused like the arena's), and the CUDA backend issues both
//! copies on a copy stream that the compute stream forks to and joins
//! ([`HostCopy::to_host`] is the only op whose output is host memory).
//!
//! Optimizer state can live in host memory too: `to_device` brings a state
//! to the device a little before its update, and `to_host` with
//! `into_state` writes the updated value back over the state's own host
//! bytes (its first input, declared in place), which makes it the state's
//! update.
//!
//! **Invariant:** a copy moves bytes and nothing else: the value read back
//! is the value written, bit for bit, whatever its dtype.

use super::kernel::KernelIo;
use super::sample::{normal, Sample};
use super::{expect_inputs, Attr, Attrs, OpDef, VjpArgs};
use crate::error::Result;
use crate::ir::{Builder, DType, TensorType, ValueId};

/// `to_host(x)` (output in page-locked host memory) or `to_device(x)`
/// (output in device memory): the same type, the same bytes. With
/// `into_state`, `to_host(state, x)` writes `x` over `state`'s host bytes.
#[derive(Clone, PartialEq, Debug)]
pub struct HostCopy {
    /// `true`: device to host; `false`: host to device.
    pub to_host: bool,
    /// (`to_host` only) The output takes the storage of input 0, a state
    /// in host memory, and holds input 1's bytes.
    pub into_state: bool,
}

impl HostCopy {
    /// The input whose bytes the copy moves: the last one (after the state
    /// written into).
    pub fn source(&self) -> usize {
        usize::from(self.into_state)
    }
}

impl OpDef for HostCopy {
    /// Both directions, of a scalar, a vector and a matrix whose size is
    /// no multiple of 16 bytes.
    fn samples(d: DType) -> Vec<Sample> {
        let mut v = Vec::new();
        for to_host in [true, false] {
            for shape in [&[][..], &[5], &[17, 61]] {
                v.push(Sample::new(HostCopy { to_host, into_state: false }, vec![normal(d, shape)]));
            }
        }
        let into = HostCopy { to_host: true, into_state: true };
        v.push(Sample::new(into, vec![normal(d, &[3, 7]), normal(d, &[3, 7])]));
        v
    }
    fn name(&self) -> &'static str {
        if self.to_host {
            "to_host"
        } else {
            "to_device"
        }
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        if self.into_state {
            if !self.to_host {
                return Err("only a copy to the host writes into a state".into());
            }
            expect_inputs(inputs, 2)?;
            super::expect_same(inputs[0], inputs[1], "the state and the value written into it")?;
        } else {
            expect_inputs(inputs, 1)?;
        }
        Ok(vec![inputs[self.source()].clone()])
    }
    /// A copy is the identity: its cotangent goes back the other way.
    fn vjp(&self, b: &mut Builder, args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        if self.into_state {
            return super::no_vjp(self.name());
        }
        let Some(g) = args.cotangents[0] else { return Ok(vec![None]) };
        Ok(vec![Some(b.host_copy(g, !self.to_host)?)])
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let bytes = io.out_ty(0).bytes() as usize;
        let src = self.source();
        // SAFETY: input `src` and the output have the same type (the shape
        // rule), so both hold `bytes` bytes, and they never alias: the
        // output is a copy in the other tier, or (into a state) the
        // state's bytes, another value's than the source's.
        unsafe { std::ptr::copy_nonoverlapping(io.inputs[src].ptr, io.outputs[0].ptr, bytes) };
        Ok(())
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        Attr::flag("into_state", self.into_state)
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        let to_host = match name {
            "to_host" => true,
            "to_device" => false,
            _ => return None,
        };
        Some(a.opt_bool("into_state").map(|i| HostCopy { to_host, into_state: i.unwrap_or(false) }))
    }
    fn inplace(&self) -> Vec<(usize, usize)> {
        match self.into_state {
            true => vec![(0, 0)],
            false => Vec::new(),
        }
    }
    fn output_on_host(&self) -> bool {
        self.to_host
    }
}

impl Builder {
    /// `x` copied to page-locked host memory (`to_host`) or back to the
    /// device (`!to_host`).
    pub fn host_copy(&mut self, x: ValueId, to_host: bool) -> Result<ValueId> {
        self.push1(HostCopy { to_host, into_state: false }.into(), &[x])
    }

    /// `x` copied over the host bytes of `state` (an optimizer state that
    /// lives in host memory): the state's new value.
    pub fn host_copy_into(&mut self, state: ValueId, x: ValueId) -> Result<ValueId> {
        self.push1(HostCopy { to_host: true, into_state: true }.into(), &[state, x])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::OutputKind;

    #[test]
    fn copies_print_and_parse_back_in_both_directions() {
        let mut b = Builder::new("t");
        let x = b.input("x", TensorType::new(DType::BF16, [2, 3])).unwrap();
        let h = b.host_copy(x, true).unwrap();
        let y = b.host_copy(h, false).unwrap();
        let s = b.state("s", TensorType::new(DType::BF16, [2, 3])).unwrap();
        let z = b.host_copy_into(s, y).unwrap();
        b.output(OutputKind::Named("y".into()), y);
        b.update(s, z);
        let t = b.finish("build").unwrap();
        let text = t.to_string();
        assert!(text.contains("to_host") && text.contains("to_device") && text.contains("into_state=true"), "{text}");
        assert_eq!(crate::ir::parse::parse(&text).unwrap(), t);
        assert_eq!(t.ty(y), t.ty(x));
    }
}

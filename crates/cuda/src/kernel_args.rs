//! Each kernel's arguments as one named structure, shared by the lowering
//! that launches the kernel and by the host models that emulate it
//! (`ops/host_model.rs`, `ops/decode_model.rs`).
//!
//! A kernel takes its arguments by position, so a lowering that writes
//! `[x, y, n, lo]` and an emulator that reads `args[3]` as `lo` agree only
//! as long as two lists kept by hand do. Declared once with
//! [`kernel_args!`], the field order is the kernel's parameter order, the
//! lowering builds the structure and turns it into [`Arg`]s, and the
//! emulator reads the same structure back from the launch, so a field
//! added, removed or moved changes both sides or neither. Arguments that a
//! kernel takes as a C structure by value (shapes and strides) are declared
//! with [`kernel_struct!`] and travel as one [`Arg::Struct`].

use crate::launch::Arg;

/// A value a kernel takes as one parameter: how it travels as an [`Arg`]
/// and, for the host models, how it is read back. `u64` is a device
/// pointer (`T*`), `i64` a `long long`, `i32` an `int`, `f64` a `double`.
pub(crate) trait ArgValue: Sized {
    fn into_arg(self) -> Arg;
    /// The value `arg` holds, or `None` when `arg` is another kind.
    fn from_arg(arg: &Arg) -> Option<Self>;
}

impl ArgValue for u64 {
    fn into_arg(self) -> Arg {
        Arg::Ptr(self)
    }
    fn from_arg(arg: &Arg) -> Option<Self> {
        match arg {
            Arg::Ptr(p) => Some(*p),
            _ => None,
        }
    }
}

impl ArgValue for i64 {
    fn into_arg(self) -> Arg {
        Arg::I64(self)
    }
    fn from_arg(arg: &Arg) -> Option<Self> {
        match arg {
            Arg::I64(x) => Some(*x),
            _ => None,
        }
    }
}

impl ArgValue for i32 {
    fn into_arg(self) -> Arg {
        Arg::I32(self)
    }
    fn from_arg(arg: &Arg) -> Option<Self> {
        match arg {
            Arg::I32(x) => Some(*x),
            _ => None,
        }
    }
}

impl ArgValue for f64 {
    fn into_arg(self) -> Arg {
        Arg::F64(self)
    }
    fn from_arg(arg: &Arg) -> Option<Self> {
        match arg {
            Arg::F64(x) => Some(*x),
            _ => None,
        }
    }
}

/// A field of a C structure passed by value: a run of 8-byte words (the
/// kernels' structures hold `long long` fields and arrays of them only, so
/// no padding arises).
pub(crate) trait StructWords: Sized {
    fn push_words(&self, out: &mut Vec<i64>);
    /// Takes this field's words off the front of `words`.
    fn take_words(words: &mut &[i64]) -> Option<Self>;
}

impl StructWords for i64 {
    fn push_words(&self, out: &mut Vec<i64>) {
        out.push(*self);
    }
    fn take_words(words: &mut &[i64]) -> Option<Self> {
        let (&first, rest) = words.split_first()?;
        *words = rest;
        Some(first)
    }
}

impl<const N: usize> StructWords for [i64; N] {
    fn push_words(&self, out: &mut Vec<i64>) {
        out.extend_from_slice(self);
    }
    fn take_words(words: &mut &[i64]) -> Option<Self> {
        let head: [i64; N] = words.get(..N)?.try_into().ok()?;
        *words = &words[N..];
        Some(head)
    }
}

/// The bytes of a structure of words, as the driver copies them.
pub(crate) fn words_arg(words: &[i64]) -> Arg {
    Arg::Struct(words.iter().flat_map(|w| w.to_ne_bytes()).collect())
}

/// The words of an [`Arg::Struct`].
pub(crate) fn arg_words(arg: &Arg) -> Option<Vec<i64>> {
    match arg {
        Arg::Struct(bytes) if bytes.len() % 8 == 0 => {
            Some(bytes.chunks_exact(8).map(|c| i64::from_ne_bytes(c.try_into().expect("8 bytes"))).collect())
        }
        _ => None,
    }
}

/// Declares a kernel's parameter list as a structure: its fields in the
/// kernel's parameter order, each an [`ArgValue`]. The structure gets
/// `args(self) -> Vec<Arg>` for the lowering, `try_from_args(&[Arg])` for
/// rules that read a launch back (merges), and `from_args(&[Arg])` for the
/// host models, which panics, naming the structure and the field, when a
/// launch's arguments do not have this shape.
macro_rules! kernel_args {
    ($(#[$meta:meta])* $vis:vis struct $name:ident { $($(#[$fmeta:meta])* $field:ident: $ty:ty),* $(,)? }) => {
        $(#[$meta])*
        #[derive(Clone, Debug, PartialEq)]
        $vis struct $name {
            $($(#[$fmeta])* pub(crate) $field: $ty,)*
        }

        impl $name {
            /// The launch arguments, in the kernel's parameter order.
            pub(crate) fn args(self) -> Vec<$crate::launch::Arg> {
                vec![$($crate::kernel_args::ArgValue::into_arg(self.$field)),*]
            }

            /// The arguments of a launch of this kernel read back, or `None`
            /// when they do not have this shape (a launch of another kernel).
            #[allow(dead_code)]
            pub(crate) fn try_from_args(args: &[$crate::launch::Arg]) -> Option<Self> {
                let mut it = args.iter();
                let parsed = $name {
                    $($field: <$ty as $crate::kernel_args::ArgValue>::from_arg(it.next()?)?,)*
                };
                it.next().is_none().then_some(parsed)
            }

            /// The arguments of a launch of this kernel read back (the host
            /// models); panics, naming the field, when they do not fit.
            #[allow(dead_code)]
            pub(crate) fn from_args(args: &[$crate::launch::Arg]) -> Self {
                let mut it = args.iter();
                let parsed = $name {
                    $($field: it
                        .next()
                        .and_then(|a| <$ty as $crate::kernel_args::ArgValue>::from_arg(a))
                        .unwrap_or_else(|| panic!(
                            "{}: argument `{}` missing or of another kind in {args:?}",
                            stringify!($name),
                            stringify!($field)
                        )),)*
                };
                assert!(it.next().is_none(), "{}: more arguments than fields in {args:?}", stringify!($name));
                parsed
            }
        }
    };
}
pub(crate) use kernel_args;

/// Declares a C structure a kernel takes by value: fields of `long long`
/// ([`i64`]) or arrays of them, in the structure's order. The structure is
/// an [`ArgValue`], so it can be a field of a [`kernel_args!`] list.
macro_rules! kernel_struct {
    ($(#[$meta:meta])* $vis:vis struct $name:ident { $($(#[$fmeta:meta])* $field:ident: $ty:ty),* $(,)? }) => {
        $(#[$meta])*
        #[derive(Clone, Debug, PartialEq)]
        $vis struct $name {
            $($(#[$fmeta])* pub(crate) $field: $ty,)*
        }

        impl $crate::kernel_args::ArgValue for $name {
            fn into_arg(self) -> $crate::launch::Arg {
                let mut words = Vec::new();
                $($crate::kernel_args::StructWords::push_words(&self.$field, &mut words);)*
                $crate::kernel_args::words_arg(&words)
            }

            fn from_arg(arg: &$crate::launch::Arg) -> Option<Self> {
                let words = $crate::kernel_args::arg_words(arg)?;
                let mut rest = &words[..];
                let parsed = $name {
                    $($field: <$ty as $crate::kernel_args::StructWords>::take_words(&mut rest)?,)*
                };
                rest.is_empty().then_some(parsed)
            }
        }
    };
}
pub(crate) use kernel_struct;

#[cfg(test)]
mod tests {
    use super::*;

    kernel_struct! {
        struct Shape {
            rank: i64,
            size: [i64; 3],
        }
    }

    kernel_args! {
        struct Example {
            x: u64,
            n: i64,
            d: i32,
            scale: f64,
            shape: Shape,
        }
    }

    #[test]
    fn arguments_round_trip_in_parameter_order() {
        let e = Example { x: 0x1000, n: 7, d: 3, scale: 0.5, shape: Shape { rank: 2, size: [4, 5, 1] } };
        let args = e.clone().args();
        assert_eq!(args[..4], [Arg::Ptr(0x1000), Arg::I64(7), Arg::I32(3), Arg::F64(0.5)]);
        assert_eq!(args[4], words_arg(&[2, 4, 5, 1]));
        assert_eq!(Example::from_args(&args), e);
        assert_eq!(Example::try_from_args(&args), Some(e));
        assert_eq!(Example::try_from_args(&args[..4]), None);
    }

    #[test]
    #[should_panic(expected = "Example: argument `d` missing or of another kind")]
    fn a_launch_of_another_shape_is_refused_by_name() {
        Example::from_args(&[Arg::Ptr(1), Arg::I64(2), Arg::I64(3), Arg::F64(0.5), words_arg(&[0, 0, 0, 0])]);
    }

    #[test]
    #[should_panic(expected = "more arguments than fields")]
    fn extra_arguments_are_refused() {
        let mut args = Example { x: 1, n: 2, d: 3, scale: 0.5, shape: Shape { rank: 0, size: [0; 3] } }.args();
        args.push(Arg::I64(9));
        Example::from_args(&args);
    }
}

//! A bound on how deeply any decoded value nests, whatever its type.
//!
//! [`super::nesting`] bounds floe's own recursive types, but types from other crates decode
//! through their own serde code: an Arrow `DataType` (in every schema, and a `cast`'s target)
//! nested a hundred thousand levels deep is a few hundred kilobytes, and serde's derived code
//! would recurse once per level until the decoding thread's stack overflows. [`Depth`] wraps
//! the deserializer itself, so every value, of every type, is bounded.
//!
//! A level is entered at every `visit_seq`, `visit_map`, `visit_enum`, `visit_some` and
//! `visit_newtype_struct`: every place serde's generated code can recurse into a nested value.
//! The remaining depth is carried by value in the wrappers, not in the thread-local counter of
//! [`super::nesting`]: that one counts plan and expression levels (a bound stated in plan
//! terms), this one counts serde levels, so the two limits stay independent, and a value
//! needs no cleanup when decoding fails or panics half way.

use std::fmt;

use serde::de::{
    self, DeserializeSeed, Deserializer, EnumAccess, MapAccess, SeqAccess, VariantAccess, Visitor,
};

/// The deepest serde nesting the codec accepts. The deepest plan that can be built
/// ([`super::nesting::MAX_DECODE_NESTING`] levels of plan steps and expressions) nests 261
/// serde levels (measured by `tests::the_deepest_plan_nests_well_within_the_limit`), which
/// leaves 39 for the request or task a plan travels in. A value this deep, of any type,
/// decodes and drops inside a quarter of a tokio worker's 2 MiB stack in a debug build: the
/// costliest known, `DataType::List` of lists (arrow's serde code, about 2 KiB per level,
/// plus 1 KiB for this wrapper, in a debug build), needs under 500 KiB.
pub const MAX_SERDE_DEPTH: u32 = 300;

/// A deserializer that refuses values nesting more than its limit.
pub struct Depth<D> {
    inner: D,
    levels: Levels,
}

impl<D> Depth<D> {
    pub fn new(inner: D, limit: u32) -> Self {
        Self {
            inner,
            levels: Levels { left: limit, limit },
        }
    }
}

/// `T::deserialize` through a [`Depth`] of `limit` levels, as a seed for bincode.
pub(crate) struct Bounded<T> {
    limit: u32,
    value: std::marker::PhantomData<T>,
}

impl<T> Bounded<T> {
    pub(crate) fn new(limit: u32) -> Self {
        Self {
            limit,
            value: std::marker::PhantomData,
        }
    }
}

impl<'de, T: de::Deserialize<'de>> DeserializeSeed<'de> for Bounded<T> {
    type Value = T;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<T, D::Error> {
        T::deserialize(Depth::new(deserializer, self.limit))
    }
}

/// How many levels a value may still nest, and the limit to name when it nests deeper.
#[derive(Clone, Copy)]
struct Levels {
    left: u32,
    limit: u32,
}

impl Levels {
    /// One level down, or the error past the limit.
    fn enter<E: de::Error>(self) -> Result<Self, E> {
        match self.left.checked_sub(1) {
            Some(left) => Ok(Self { left, ..self }),
            None => Err(E::custom(format_args!(
                "the value nests more than {} levels deep",
                self.limit
            ))),
        }
    }
}

macro_rules! forward_deserialize {
    ($($method:ident($($arg:ident: $ty:ty),*)),* $(,)?) => {$(
        fn $method<V: Visitor<'de>>(self, $($arg: $ty,)* visitor: V) -> Result<V::Value, D::Error> {
            let visitor = Bounding { inner: visitor, levels: self.levels };
            self.inner.$method($($arg,)* visitor)
        }
    )*};
}

impl<'de, D: Deserializer<'de>> Deserializer<'de> for Depth<D> {
    type Error = D::Error;

    forward_deserialize!(
        deserialize_any(),
        deserialize_bool(),
        deserialize_i8(),
        deserialize_i16(),
        deserialize_i32(),
        deserialize_i64(),
        deserialize_i128(),
        deserialize_u8(),
        deserialize_u16(),
        deserialize_u32(),
        deserialize_u64(),
        deserialize_u128(),
        deserialize_f32(),
        deserialize_f64(),
        deserialize_char(),
        deserialize_str(),
        deserialize_string(),
        deserialize_bytes(),
        deserialize_byte_buf(),
        deserialize_option(),
        deserialize_unit(),
        deserialize_unit_struct(name: &'static str),
        deserialize_newtype_struct(name: &'static str),
        deserialize_seq(),
        deserialize_tuple(len: usize),
        deserialize_tuple_struct(name: &'static str, len: usize),
        deserialize_map(),
        deserialize_struct(name: &'static str, fields: &'static [&'static str]),
        deserialize_enum(name: &'static str, variants: &'static [&'static str]),
        deserialize_identifier(),
        deserialize_ignored_any(),
    );

    fn is_human_readable(&self) -> bool {
        self.inner.is_human_readable()
    }
}

/// A visitor, or an access or seed of the value it visits, with the depth left below it.
struct Bounding<T> {
    inner: T,
    levels: Levels,
}

impl<T> Bounding<T> {
    fn wrap<U>(&self, inner: U) -> Bounding<U> {
        Bounding {
            inner,
            levels: self.levels,
        }
    }
}

macro_rules! forward_visit {
    ($($method:ident($ty:ty)),* $(,)?) => {$(
                fn $method<E: de::Error>(self, value: $ty) -> Result<V::Value, E> {
            self.inner.$method(value)
        }
    )*};
}

impl<'de, V: Visitor<'de>> Visitor<'de> for Bounding<V> {
    type Value = V::Value;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.expecting(formatter)
    }

    forward_visit!(
        visit_bool(bool),
        visit_i8(i8),
        visit_i16(i16),
        visit_i32(i32),
        visit_i64(i64),
        visit_i128(i128),
        visit_u8(u8),
        visit_u16(u16),
        visit_u32(u32),
        visit_u64(u64),
        visit_u128(u128),
        visit_f32(f32),
        visit_f64(f64),
        visit_char(char),
        visit_str(&str),
        visit_borrowed_str(&'de str),
        visit_string(String),
        visit_bytes(&[u8]),
        visit_borrowed_bytes(&'de [u8]),
        visit_byte_buf(Vec<u8>),
    );

    fn visit_none<E: de::Error>(self) -> Result<V::Value, E> {
        self.inner.visit_none()
    }

    fn visit_unit<E: de::Error>(self) -> Result<V::Value, E> {
        self.inner.visit_unit()
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<V::Value, D::Error> {
        let levels = self.levels.enter()?;
        self.inner.visit_some(Depth {
            inner: deserializer,
            levels,
        })
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> Result<V::Value, D::Error> {
        let levels = self.levels.enter()?;
        self.inner.visit_newtype_struct(Depth {
            inner: deserializer,
            levels,
        })
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<V::Value, A::Error> {
        let levels = self.levels.enter()?;
        self.inner.visit_seq(Bounding { inner: seq, levels })
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<V::Value, A::Error> {
        let levels = self.levels.enter()?;
        self.inner.visit_map(Bounding { inner: map, levels })
    }

    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<V::Value, A::Error> {
        let levels = self.levels.enter()?;
        self.inner.visit_enum(Bounding {
            inner: data,
            levels,
        })
    }
}

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for Bounding<S> {
    type Value = S::Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<S::Value, D::Error> {
        self.inner.deserialize(Depth {
            inner: deserializer,
            levels: self.levels,
        })
    }
}

impl<'de, A: SeqAccess<'de>> SeqAccess<'de> for Bounding<A> {
    type Error = A::Error;

    fn next_element_seed<S: DeserializeSeed<'de>>(
        &mut self,
        seed: S,
    ) -> Result<Option<S::Value>, A::Error> {
        let seed = self.wrap(seed);
        self.inner.next_element_seed(seed)
    }

    fn size_hint(&self) -> Option<usize> {
        self.inner.size_hint()
    }
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for Bounding<A> {
    type Error = A::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, A::Error> {
        let seed = self.wrap(seed);
        self.inner.next_key_seed(seed)
    }

    fn next_value_seed<S: DeserializeSeed<'de>>(&mut self, seed: S) -> Result<S::Value, A::Error> {
        let seed = self.wrap(seed);
        self.inner.next_value_seed(seed)
    }

    fn size_hint(&self) -> Option<usize> {
        self.inner.size_hint()
    }
}

impl<'de, A: EnumAccess<'de>> EnumAccess<'de> for Bounding<A> {
    type Error = A::Error;
    type Variant = Bounding<A::Variant>;

    fn variant_seed<S: DeserializeSeed<'de>>(
        self,
        seed: S,
    ) -> Result<(S::Value, Self::Variant), A::Error> {
        let seed = self.wrap(seed);
        let (value, variant) = self.inner.variant_seed(seed)?;
        Ok((
            value,
            Bounding {
                inner: variant,
                levels: self.levels,
            },
        ))
    }
}

impl<'de, A: VariantAccess<'de>> VariantAccess<'de> for Bounding<A> {
    type Error = A::Error;

    fn unit_variant(self) -> Result<(), A::Error> {
        self.inner.unit_variant()
    }

    fn newtype_variant_seed<S: DeserializeSeed<'de>>(self, seed: S) -> Result<S::Value, A::Error> {
        let seed = self.wrap(seed);
        self.inner.newtype_variant_seed(seed)
    }

    fn tuple_variant<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value, A::Error> {
        let visitor = self.wrap(visitor);
        self.inner.tuple_variant(len, visitor)
    }

    fn struct_variant<V: Visitor<'de>>(
        self,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, A::Error> {
        let visitor = self.wrap(visitor);
        self.inner.struct_variant(fields, visitor)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_schema::{DataType, Field, Schema};

    use super::MAX_SERDE_DEPTH;
    use crate::expr::{Expr, col, lit};
    use crate::fingerprint::FileStamp;
    use crate::job::{JobOptions, JobSpec};
    use crate::plan::{FileFormat, FileScan, LogicalPlan, MAX_EXPR_DEPTH, MAX_PLAN_DEPTH};
    use crate::wire::codec;

    /// A quarter of a tokio worker's stack, as `tests/plan_depth.rs` uses: a debug build needs
    /// about 3 KiB per level of `DataType::List`, so the deepest accepted one fits here.
    const SMALL_STACK: usize = 512 * 1024;

    /// Runs `work` on a thread with a `stack`-byte stack; an overflow aborts the test binary.
    fn on_stack<T: Send + 'static>(stack: usize, work: impl FnOnce() -> T + Send + 'static) -> T {
        std::thread::Builder::new()
            .stack_size(stack)
            .spawn(work)
            .unwrap()
            .join()
            .unwrap()
    }

    /// A Boolean predicate nested `depth` levels: `id + 1 + … > 0`.
    fn predicate(depth: u32) -> Expr {
        (1..depth)
            .fold(col("id"), |expr, _| expr + lit(1i64))
            .gt(lit(0i64))
    }

    /// The deepest plan that can be built (as `tests/plan_depth.rs` builds it), as a job spec.
    fn deepest_job() -> JobSpec {
        let schema = Schema::new(vec![Field::new("id", DataType::Int64, false)]);
        let stamp = FileStamp {
            path: "/data/part-0.parquet".into(),
            size: 100,
            modified_secs: 1_700_000_000,
            modified_nanos: 0,
            version: None,
        };
        let mut scan = FileScan::new(FileFormat::Parquet, vec![stamp], schema);
        scan.predicate = Some(predicate(MAX_EXPR_DEPTH));
        let mut plan = LogicalPlan::read(scan).unwrap();
        for _ in 1..MAX_PLAN_DEPTH {
            plan = plan.filter(predicate(MAX_EXPR_DEPTH)).unwrap();
        }
        JobSpec {
            plan,
            options: JobOptions::default(),
        }
    }

    /// The smallest serde depth limit under which `bytes` decode as a `T`.
    fn serde_depth<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> u32 {
        let decodes = |limit| codec::decode_within::<T>(bytes, "value", limit).is_ok();
        assert!(decodes(MAX_SERDE_DEPTH), "the value does not decode at all");
        let (mut refused, mut accepted) = (0, MAX_SERDE_DEPTH);
        while accepted - refused > 1 {
            let middle = refused + (accepted - refused) / 2;
            if decodes(middle) {
                accepted = middle;
            } else {
                refused = middle;
            }
        }
        accepted
    }

    #[test]
    fn the_deepest_plan_nests_well_within_the_limit() {
        let depth = on_stack(SMALL_STACK, || {
            let job = deepest_job();
            let bytes = job.encode().unwrap();
            let decoded = JobSpec::decode(&bytes).unwrap();
            assert_eq!(decoded.plan.fingerprint(), job.plan.fingerprint());
            serde_depth::<JobSpec>(&bytes)
        });
        eprintln!("the deepest plan nests {depth} serde levels");
        // The margin covers the envelope a plan travels in (a request, a task).
        assert!(depth + 32 <= MAX_SERDE_DEPTH, "{depth}");
    }

    /// The bytes of a `DataType::List` of a list of … `levels` deep around `Null`, made by
    /// hand: a value that deep cannot be encoded (or dropped) without recursing.
    pub(super) fn nested_list_bytes(levels: usize) -> Vec<u8> {
        let list_of = |inner| DataType::List(Arc::new(Field::new("item", inner, true)));
        let null = codec::encode(&list_of(DataType::Null)).unwrap();
        let boolean = codec::encode(&list_of(DataType::Boolean)).unwrap();
        // The two differ only in the inner type's variant, one byte.
        let at = null.iter().zip(&boolean).position(|(a, b)| a != b).unwrap();
        assert_eq!(null.len(), boolean.len());
        let (open, close) = (&null[..at], &null[at + 1..]);
        let mut bytes = open.repeat(levels);
        bytes.push(null[at]);
        bytes.extend(close.repeat(levels));
        bytes
    }

    /// The levels of `DataType::List` around `data_type`.
    fn list_levels(mut data_type: &DataType) -> usize {
        let mut levels = 0;
        while let DataType::List(field) = data_type {
            levels += 1;
            data_type = field.data_type();
        }
        levels
    }

    #[test]
    fn a_data_type_nested_100000_levels_deep_is_refused_on_a_small_stack() {
        let bytes = nested_list_bytes(100_000);
        let message = on_stack(SMALL_STACK, move || {
            codec::decode::<DataType>(&bytes, "data type")
                .unwrap_err()
                .to_string()
        });
        assert!(
            message.contains(&format!(
                "the value nests more than {MAX_SERDE_DEPTH} levels deep"
            )),
            "{message}"
        );
    }

    #[test]
    fn the_deepest_data_type_accepted_decodes_and_drops_on_a_small_stack() {
        // Two serde levels per list (the enum, then the field, a struct), and one for the
        // innermost `Null`.
        let deepest = ((MAX_SERDE_DEPTH - 1) / 2) as usize;
        let outcome = on_stack(SMALL_STACK, move || {
            let decoded = codec::decode::<DataType>(&nested_list_bytes(deepest), "data type")
                .map(|data_type| list_levels(&data_type));
            let refused = codec::decode::<DataType>(&nested_list_bytes(deepest + 1), "data type");
            (decoded.unwrap(), refused.unwrap_err().to_string())
        });
        assert_eq!(outcome.0, deepest);
        assert!(outcome.1.contains("levels deep"), "{}", outcome.1);
    }
}

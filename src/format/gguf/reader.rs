//! A bounds-checked little-endian cursor over a GGUF header: every read
//! says what it was reading when the bytes run out, and every count is
//! checked against the bytes left before anything is allocated for it.

use crate::format::gguf::{GgufArray, GgufError, GgufValue};

/// Arrays of arrays nest at most this deep (real files nest none).
pub(super) const MAX_NESTING: usize = 8;

pub(super) struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(super) fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes, pos: 0 }
    }

    pub(super) fn pos(&self) -> usize {
        self.pos
    }

    pub(super) fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    pub(super) fn take(
        &mut self,
        n: u64,
        what: impl FnOnce() -> String,
    ) -> Result<&'a [u8], GgufError> {
        let available = self.remaining();
        if n > available {
            return Err(GgufError::Truncated {
                what: what(),
                needed: n,
                available,
            });
        }
        // n <= remaining, which fits usize.
        let n = n as usize;
        let out = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn array<const N: usize>(
        &mut self,
        what: impl FnOnce() -> String,
    ) -> Result<[u8; N], GgufError> {
        let b = self.take(N as u64, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(b);
        Ok(out)
    }

    pub(super) fn u32(&mut self, what: impl FnOnce() -> String) -> Result<u32, GgufError> {
        self.array::<4>(what).map(u32::from_le_bytes)
    }

    pub(super) fn u64(&mut self, what: impl FnOnce() -> String) -> Result<u64, GgufError> {
        self.array::<8>(what).map(u64::from_le_bytes)
    }

    /// A count of items each at least `min_bytes` long: refused when the
    /// bytes left could not hold that many, so a lying count never sizes an
    /// allocation.
    pub(super) fn count(
        &mut self,
        min_bytes: u64,
        what: impl Fn() -> String,
    ) -> Result<u64, GgufError> {
        let count = self.u64(&what)?;
        let available = self.remaining();
        match count.checked_mul(min_bytes) {
            Some(n) if n <= available => Ok(count),
            _ => Err(GgufError::ImplausibleCount {
                what: what(),
                count,
                available,
            }),
        }
    }

    /// A GGUF string: u64 length, then UTF-8 bytes.
    pub(super) fn string(&mut self, what: impl Fn() -> String) -> Result<String, GgufError> {
        let len = self.u64(&what)?;
        let bytes = self.take(len, &what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::NotUtf8 { what: what() })
    }

    /// A value of GGUF type `type_id`, for metadata key `key`.
    pub(super) fn value(
        &mut self,
        key: &str,
        type_id: u32,
        depth: usize,
    ) -> Result<GgufValue, GgufError> {
        let what = || format!("the value of metadata key {key}");
        Ok(match type_id {
            0 => GgufValue::U8(self.array::<1>(what)?[0]),
            1 => GgufValue::I8(i8::from_le_bytes(self.array(what)?)),
            2 => GgufValue::U16(u16::from_le_bytes(self.array(what)?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array(what)?)),
            4 => GgufValue::U32(u32::from_le_bytes(self.array(what)?)),
            5 => GgufValue::I32(i32::from_le_bytes(self.array(what)?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array(what)?)),
            7 => GgufValue::Bool(self.bool(key)?),
            8 => GgufValue::String(self.string(what)?),
            9 => GgufValue::Array(self.array_value(key, depth)?),
            10 => GgufValue::U64(u64::from_le_bytes(self.array(what)?)),
            11 => GgufValue::I64(i64::from_le_bytes(self.array(what)?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array(what)?)),
            _ => {
                return Err(GgufError::BadValueType {
                    key: key.to_string(),
                    type_id,
                });
            }
        })
    }

    fn bool(&mut self, key: &str) -> Result<bool, GgufError> {
        match self.array::<1>(|| format!("the value of metadata key {key}"))?[0] {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(GgufError::WrongType {
                key: key.to_string(),
                expected: "a bool (0 or 1)",
                found: format!("byte {b}"),
            }),
        }
    }

    /// An array: element type, u64 count, elements.
    fn array_value(&mut self, key: &str, depth: usize) -> Result<GgufArray, GgufError> {
        if depth >= MAX_NESTING {
            return Err(GgufError::NestingTooDeep {
                key: key.to_string(),
                limit: MAX_NESTING,
            });
        }
        let what = || format!("the array of metadata key {key}");
        let elem = self.u32(what)?;
        let min = match elem {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            8 | 10..=12 => 8,
            9 => 12,
            _ => {
                return Err(GgufError::BadValueType {
                    key: key.to_string(),
                    type_id: elem,
                });
            }
        };
        let n = self.count(min, what)?;
        // n * min <= remaining bytes, so n fits usize.
        let n = n as usize;
        macro_rules! fixed {
            ($variant:ident, $t:ty) => {{
                let bytes = self.take((n * std::mem::size_of::<$t>()) as u64, what)?;
                GgufArray::$variant(
                    bytes
                        .chunks_exact(std::mem::size_of::<$t>())
                        .map(|c| {
                            let mut a = [0u8; std::mem::size_of::<$t>()];
                            a.copy_from_slice(c);
                            <$t>::from_le_bytes(a)
                        })
                        .collect(),
                )
            }};
        }
        Ok(match elem {
            0 => fixed!(U8, u8),
            1 => fixed!(I8, i8),
            2 => fixed!(U16, u16),
            3 => fixed!(I16, i16),
            4 => fixed!(U32, u32),
            5 => fixed!(I32, i32),
            6 => fixed!(F32, f32),
            10 => fixed!(U64, u64),
            11 => fixed!(I64, i64),
            12 => fixed!(F64, f64),
            7 => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.bool(key)?);
                }
                GgufArray::Bool(v)
            }
            8 => {
                let mut v = Vec::with_capacity(n);
                for i in 0..n {
                    v.push(self.string(|| format!("element {i} of metadata key {key}"))?);
                }
                GgufArray::String(v)
            }
            _ => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.array_value(key, depth + 1)?);
                }
                GgufArray::Array(v)
            }
        })
    }
}

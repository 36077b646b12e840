//! GGUF metadata values, with accessors that answer `None` for the wrong
//! type rather than converting lossily.

/// One metadata value. Arrays are typed ([`GgufArray`]), so a 49,152-entry
/// vocabulary costs its strings, not an enum per entry.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(GgufArray),
}

/// A metadata array: every element has the one type the file declares.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum GgufArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F32(Vec<f32>),
    F64(Vec<f64>),
    Bool(Vec<bool>),
    String(Vec<String>),
    /// An array of arrays (each inner array has its own element type).
    Array(Vec<GgufArray>),
}

impl GgufArray {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Self::U8(v) => v.len(),
            Self::I8(v) => v.len(),
            Self::U16(v) => v.len(),
            Self::I16(v) => v.len(),
            Self::U32(v) => v.len(),
            Self::I32(v) => v.len(),
            Self::U64(v) => v.len(),
            Self::I64(v) => v.len(),
            Self::F32(v) => v.len(),
            Self::F64(v) => v.len(),
            Self::Bool(v) => v.len(),
            Self::String(v) => v.len(),
            Self::Array(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The strings of a string array.
    pub fn as_strs(&self) -> Option<&[String]> {
        match self {
            Self::String(v) => Some(v),
            _ => None,
        }
    }

    /// The values of an f32 array (token scores).
    pub fn as_f32s(&self) -> Option<&[f32]> {
        match self {
            Self::F32(v) => Some(v),
            _ => None,
        }
    }

    /// The values of an i32 array (token types).
    pub fn as_i32s(&self) -> Option<&[i32]> {
        match self {
            Self::I32(v) => Some(v),
            _ => None,
        }
    }

    /// A short name of the element type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Self::U8(_) => "array of u8",
            Self::I8(_) => "array of i8",
            Self::U16(_) => "array of u16",
            Self::I16(_) => "array of i16",
            Self::U32(_) => "array of u32",
            Self::I32(_) => "array of i32",
            Self::U64(_) => "array of u64",
            Self::I64(_) => "array of i64",
            Self::F32(_) => "array of f32",
            Self::F64(_) => "array of f64",
            Self::Bool(_) => "array of bool",
            Self::String(_) => "array of string",
            Self::Array(_) => "array of arrays",
        }
    }
}

impl GgufValue {
    /// The string, for a string value.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }

    /// Any integer value that is non-negative, as u64.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U8(v) => Some(v.into()),
            Self::U16(v) => Some(v.into()),
            Self::U32(v) => Some(v.into()),
            Self::U64(v) => Some(v),
            Self::I8(v) => u64::try_from(v).ok(),
            Self::I16(v) => u64::try_from(v).ok(),
            Self::I32(v) => u64::try_from(v).ok(),
            Self::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer value that fits an i64.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Self::I8(v) => Some(v.into()),
            Self::I16(v) => Some(v.into()),
            Self::I32(v) => Some(v.into()),
            Self::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// A float value as f32 (an f64 only when it converts exactly, or is
    /// not finite).
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            Self::F32(v) => Some(v),
            Self::F64(v) => {
                let f = v as f32;
                (f as f64 == v || v.is_nan()).then_some(f)
            }
            _ => None,
        }
    }

    /// A float value as f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(v.into()),
            Self::F64(v) => Some(v),
            _ => None,
        }
    }

    /// A boolean value.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Self::Bool(v) => Some(v),
            _ => None,
        }
    }

    /// The array, for an array value.
    pub fn as_array(&self) -> Option<&GgufArray> {
        match self {
            Self::Array(a) => Some(a),
            _ => None,
        }
    }

    /// The strings of a string array (`tokenizer.ggml.tokens`, `.merges`).
    pub fn as_str_array(&self) -> Option<&[String]> {
        self.as_array().and_then(GgufArray::as_strs)
    }

    /// The values of an f32 array (`tokenizer.ggml.scores`).
    pub fn as_f32_array(&self) -> Option<&[f32]> {
        self.as_array().and_then(GgufArray::as_f32s)
    }

    /// The values of an i32 array (`tokenizer.ggml.token_type`).
    pub fn as_i32_array(&self) -> Option<&[i32]> {
        self.as_array().and_then(GgufArray::as_i32s)
    }

    /// A short name of the value's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Self::U8(_) => "u8",
            Self::I8(_) => "i8",
            Self::U16(_) => "u16",
            Self::I16(_) => "i16",
            Self::U32(_) => "u32",
            Self::I32(_) => "i32",
            Self::U64(_) => "u64",
            Self::I64(_) => "i64",
            Self::F32(_) => "f32",
            Self::F64(_) => "f64",
            Self::Bool(_) => "bool",
            Self::String(_) => "string",
            Self::Array(a) => a.type_name(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accessors_answer_only_for_their_own_kind() {
        assert_eq!(GgufValue::U32(7).as_u64(), Some(7));
        assert_eq!(GgufValue::I32(-1).as_u64(), None);
        assert_eq!(GgufValue::I32(-1).as_i64(), Some(-1));
        assert_eq!(GgufValue::U64(u64::MAX).as_i64(), None);
        assert_eq!(GgufValue::F32(1.5).as_u64(), None);
        assert_eq!(GgufValue::F64(0.1).as_f32(), None, "0.1 is not an f32");
        assert_eq!(GgufValue::F64(0.5).as_f32(), Some(0.5));
        assert_eq!(GgufValue::String("x".into()).as_str(), Some("x"));
        let a = GgufValue::Array(GgufArray::String(vec!["a".into(), "b".into()]));
        assert_eq!(a.as_str_array().map(<[String]>::len), Some(2));
        assert_eq!(a.as_f32_array(), None);
        assert_eq!(a.type_name(), "array of string");
    }
}

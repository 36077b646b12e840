//! Writes GGUF files: for tests, fuzz seeds and tools that make small
//! models. It writes what it is told, malformed files included (that is
//! what the malformed-file tests need), and is not used when loading.

use crate::format::gguf::{GgmlType, GgufArray, GgufValue};

/// A GGUF v3 file under construction.
#[derive(Clone, Debug, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, GgufValue)>,
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
    alignment: usize,
}

impl GgufWriter {
    pub fn new() -> Self {
        GgufWriter {
            alignment: 32,
            ..Default::default()
        }
    }

    /// Adds metadata entry `key` (set `general.alignment` with
    /// [`GgufWriter::alignment`] so the data is laid out to match).
    #[must_use]
    pub fn kv(mut self, key: &str, value: GgufValue) -> Self {
        self.metadata.push((key.to_string(), value));
        self
    }

    /// Lays tensor data out at multiples of `a` and records it in
    /// `general.alignment`.
    #[must_use]
    pub fn alignment(mut self, a: u32) -> Self {
        self.alignment = a.max(1) as usize;
        self.kv("general.alignment", GgufValue::U32(a))
    }

    /// Adds a tensor of type `ty` with GGUF-order dimensions `dims`
    /// (innermost first) and stored bytes `data`.
    #[must_use]
    pub fn tensor(self, name: &str, dims: &[u64], ty: GgmlType, data: Vec<u8>) -> Self {
        self.tensor_raw(name, dims, ty.id(), data)
    }

    /// [`GgufWriter::tensor`] with a raw ggml type id.
    #[must_use]
    pub fn tensor_raw(mut self, name: &str, dims: &[u64], type_id: u32, data: Vec<u8>) -> Self {
        self.tensors
            .push((name.to_string(), dims.to_vec(), type_id, data));
        self
    }

    /// An f32 tensor.
    #[must_use]
    pub fn f32_tensor(self, name: &str, dims: &[u64], values: &[f32]) -> Self {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.tensor(name, dims, GgmlType::F32, data)
    }

    /// The file's bytes.
    pub fn finish(self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            string(&mut out, k);
            out.extend(type_id(v).to_le_bytes());
            value(&mut out, v);
        }
        let a = self.alignment;
        let mut offset = 0usize;
        let mut offsets = Vec::new();
        for (name, dims, ty, data) in &self.tensors {
            string(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(ty.to_le_bytes());
            out.extend((offset as u64).to_le_bytes());
            offsets.push(offset);
            offset = (offset + data.len()).next_multiple_of(a);
        }
        let start = out.len().next_multiple_of(a);
        out.resize(start, 0);
        for ((_, _, _, data), off) in self.tensors.iter().zip(offsets) {
            out.resize(start + off, 0);
            out.extend(data);
        }
        out
    }
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn type_id(v: &GgufValue) -> u32 {
    match v {
        GgufValue::U8(_) => 0,
        GgufValue::I8(_) => 1,
        GgufValue::U16(_) => 2,
        GgufValue::I16(_) => 3,
        GgufValue::U32(_) => 4,
        GgufValue::I32(_) => 5,
        GgufValue::F32(_) => 6,
        GgufValue::Bool(_) => 7,
        GgufValue::String(_) => 8,
        GgufValue::Array(_) => 9,
        GgufValue::U64(_) => 10,
        GgufValue::I64(_) => 11,
        GgufValue::F64(_) => 12,
    }
}

fn array_type(a: &GgufArray) -> u32 {
    match a {
        GgufArray::U8(_) => 0,
        GgufArray::I8(_) => 1,
        GgufArray::U16(_) => 2,
        GgufArray::I16(_) => 3,
        GgufArray::U32(_) => 4,
        GgufArray::I32(_) => 5,
        GgufArray::F32(_) => 6,
        GgufArray::Bool(_) => 7,
        GgufArray::String(_) => 8,
        GgufArray::Array(_) => 9,
        GgufArray::U64(_) => 10,
        GgufArray::I64(_) => 11,
        GgufArray::F64(_) => 12,
    }
}

fn value(out: &mut Vec<u8>, v: &GgufValue) {
    match v {
        GgufValue::U8(x) => out.push(*x),
        GgufValue::I8(x) => out.extend(x.to_le_bytes()),
        GgufValue::U16(x) => out.extend(x.to_le_bytes()),
        GgufValue::I16(x) => out.extend(x.to_le_bytes()),
        GgufValue::U32(x) => out.extend(x.to_le_bytes()),
        GgufValue::I32(x) => out.extend(x.to_le_bytes()),
        GgufValue::U64(x) => out.extend(x.to_le_bytes()),
        GgufValue::I64(x) => out.extend(x.to_le_bytes()),
        GgufValue::F32(x) => out.extend(x.to_le_bytes()),
        GgufValue::F64(x) => out.extend(x.to_le_bytes()),
        GgufValue::Bool(x) => out.push(u8::from(*x)),
        GgufValue::String(s) => string(out, s),
        GgufValue::Array(a) => array(out, a),
    }
}

fn array(out: &mut Vec<u8>, a: &GgufArray) {
    out.extend(array_type(a).to_le_bytes());
    out.extend((a.len() as u64).to_le_bytes());
    macro_rules! each {
        ($v:expr) => {
            for x in $v {
                out.extend(x.to_le_bytes());
            }
        };
    }
    match a {
        GgufArray::U8(v) => out.extend(v),
        GgufArray::I8(v) => each!(v),
        GgufArray::U16(v) => each!(v),
        GgufArray::I16(v) => each!(v),
        GgufArray::U32(v) => each!(v),
        GgufArray::I32(v) => each!(v),
        GgufArray::U64(v) => each!(v),
        GgufArray::I64(v) => each!(v),
        GgufArray::F32(v) => each!(v),
        GgufArray::F64(v) => each!(v),
        GgufArray::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        GgufArray::String(v) => v.iter().for_each(|s| string(out, s)),
        GgufArray::Array(v) => v.iter().for_each(|a| array(out, a)),
    }
}

//! A GGUF file (versions 2 and 3): header, metadata and tensor directory
//! parsed and bounds-checked when it is opened; tensor bytes stay in the
//! mapped file until a loader asks for them.

use std::collections::HashMap;
use std::path::Path;

use crate::format::Mapped;
use crate::format::gguf::reader::Reader;
use crate::format::gguf::{GgmlType, GgufError, GgufValue};

/// ggml's limit on a tensor's dimensions.
const MAX_DIMS: u32 = 4;
/// Alignment of tensor data when `general.alignment` is absent.
const DEFAULT_ALIGNMENT: u64 = 32;

/// One entry of the tensor directory, checked against the file: its bytes
/// lie inside the data section, aligned, and its rows are whole blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    offset: u64,
    bytes: u64,
    elems: usize,
}

impl TensorInfo {
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Dimensions in GGUF order: innermost (contiguous) first, so a matrix
    /// of `rows` rows of `cols` elements is `[cols, rows]`.
    pub fn dims(&self) -> &[u64] {
        &self.dims
    }
    pub fn ggml_type(&self) -> GgmlType {
        self.ty
    }
    /// Offset of the tensor's bytes in the data section.
    pub fn offset(&self) -> u64 {
        self.offset
    }
    /// Bytes the tensor occupies.
    pub fn byte_len(&self) -> u64 {
        self.bytes
    }
    /// Number of elements.
    pub fn elems(&self) -> usize {
        self.elems
    }
}

enum Source {
    Mapped(Mapped),
    Owned(Vec<u8>),
}

impl Source {
    fn bytes(&self) -> &[u8] {
        match self {
            Source::Mapped(m) => m.as_slice(),
            Source::Owned(v) => v,
        }
    }
}

/// A GGUF file, memory-mapped, whose header has been parsed and checked.
pub struct GgufFile {
    source: Source,
    version: u32,
    metadata: Vec<(String, GgufValue)>,
    by_key: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    data_start: usize,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Maps the file at `path` and parses its header, metadata and tensor
    /// directory. Nothing is read from the tensor data.
    ///
    /// ```no_run
    /// let f = handoff::format::gguf::GgufFile::open(std::path::Path::new("model.gguf"))?;
    /// println!("{} with {} tensors", f.architecture()?, f.tensors().len());
    /// # Ok::<(), handoff::format::gguf::GgufError>(())
    /// ```
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let mapped = Mapped::open(path).map_err(|source| GgufError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(Source::Mapped(mapped))
    }

    /// Parses a GGUF file held in memory (fuzzing, tests, hosts that fetch
    /// files themselves). The same checks as [`GgufFile::open`].
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self, GgufError> {
        Self::parse(Source::Owned(bytes))
    }

    fn parse(source: Source) -> Result<Self, GgufError> {
        let bytes = source.bytes();
        let mut r = Reader::new(bytes);
        let magic = r.take(4, || "the magic number".into())?;
        if magic != b"GGUF" {
            return Err(GgufError::BadMagic {
                found: magic.to_vec(),
            });
        }
        let version = r.u32(|| "the version".into())?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion(version));
        }
        // A tensor entry is at least 8 (name) + 4 + 4 + 8 bytes; a metadata
        // entry at least 8 (key) + 4 + 1.
        let n_tensors = r.u64(|| "the tensor count".into())?;
        let n_kv = r.count(13, || "the metadata count".into())?;

        let mut metadata = Vec::with_capacity(n_kv as usize);
        let mut by_key = HashMap::with_capacity(n_kv as usize);
        for i in 0..n_kv {
            let key = r.string(|| format!("metadata key {i}"))?;
            let ty = r.u32(|| format!("the type of metadata key {key}"))?;
            let value = r.value(&key, ty, 0)?;
            if by_key.insert(key.clone(), metadata.len()).is_some() {
                return Err(GgufError::DuplicateKey(key));
            }
            metadata.push((key, value));
        }

        let alignment = match by_key.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(&i) => {
                let v = &metadata[i].1;
                let a = v.as_u64().ok_or_else(|| GgufError::WrongType {
                    key: "general.alignment".into(),
                    expected: "an unsigned integer",
                    found: v.type_name().into(),
                })?;
                if a == 0 || !a.is_power_of_two() || a > 1 << 20 {
                    return Err(GgufError::BadAlignment(a));
                }
                a
            }
        };

        let available = r.remaining();
        if n_tensors.checked_mul(24).is_none_or(|n| n > available) {
            return Err(GgufError::ImplausibleCount {
                what: "the tensor count".into(),
                count: n_tensors,
                available,
            });
        }
        let mut infos = Vec::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            infos.push(entry(&mut r, i)?);
        }
        let data_start = (r.pos() as u64).next_multiple_of(alignment);
        let data_len = (bytes.len() as u64).saturating_sub(data_start);

        let mut tensors = Vec::with_capacity(infos.len());
        let mut by_name = HashMap::with_capacity(infos.len());
        for raw in infos {
            let info = checked(raw, alignment, data_len)?;
            if by_name.insert(info.name.clone(), tensors.len()).is_some() {
                return Err(GgufError::DuplicateTensor(info.name));
            }
            tensors.push(info);
        }
        // data_start <= bytes.len() whenever a tensor exists (each was
        // checked inside the data section); clamp for files with none.
        let data_start = (data_start as usize).min(bytes.len());
        Ok(GgufFile {
            version,
            metadata,
            by_key,
            tensors,
            by_name,
            data_start,
            source,
        })
    }

    /// The GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The value of metadata key `key`.
    pub fn metadata(&self, key: &str) -> Option<&GgufValue> {
        self.by_key.get(key).map(|&i| &self.metadata[i].1)
    }

    /// Every metadata entry, in file order.
    pub fn metadata_entries(&self) -> impl Iterator<Item = (&str, &GgufValue)> {
        self.metadata.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// `general.architecture` (`llama`, `qwen2`, ...).
    pub fn architecture(&self) -> Result<&str, GgufError> {
        self.str("general.architecture")
    }

    /// A required string value.
    pub fn str(&self, key: &str) -> Result<&str, GgufError> {
        let v = self.required(key)?;
        v.as_str().ok_or_else(|| wrong(key, "a string", v))
    }

    /// A required non-negative integer value.
    pub fn u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.required(key)?;
        v.as_u64()
            .ok_or_else(|| wrong(key, "a non-negative integer", v))
    }

    /// A required float value.
    pub fn f32(&self, key: &str) -> Result<f32, GgufError> {
        let v = self.required(key)?;
        v.as_f32().ok_or_else(|| wrong(key, "an f32", v))
    }

    fn required(&self, key: &str) -> Result<&GgufValue, GgufError> {
        self.metadata(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_string()))
    }

    /// The tensor directory, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The directory entry of tensor `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// The stored bytes of a tensor of this file (checked in bounds when
    /// the file was opened).
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        let data = &self.source.bytes()[self.data_start..];
        // offset + bytes <= data.len() was checked at open, for this file's
        // entries; another file's entry gets an empty slice, not a panic.
        let start = info.offset as usize;
        data.get(start..start + info.bytes as usize).unwrap_or(&[])
    }
}

fn wrong(key: &str, expected: &'static str, v: &GgufValue) -> GgufError {
    GgufError::WrongType {
        key: key.to_string(),
        expected,
        found: v.type_name().to_string(),
    }
}

/// A directory entry as the file states it.
struct RawEntry {
    name: String,
    dims: Vec<u64>,
    type_id: u32,
    offset: u64,
}

fn entry(r: &mut Reader<'_>, i: u64) -> Result<RawEntry, GgufError> {
    let name = r.string(|| format!("the name of tensor {i}"))?;
    let n_dims = r.u32(|| format!("the dimension count of tensor {name}"))?;
    if n_dims > MAX_DIMS {
        return Err(GgufError::TooManyDims {
            tensor: name,
            n_dims,
        });
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    for _ in 0..n_dims {
        dims.push(r.u64(|| format!("the dimensions of tensor {name}"))?);
    }
    let type_id = r.u32(|| format!("the type of tensor {name}"))?;
    let offset = r.u64(|| format!("the offset of tensor {name}"))?;
    Ok(RawEntry {
        name,
        dims,
        type_id,
        offset,
    })
}

/// Checks an entry's type, dimensions, alignment and extent.
fn checked(e: RawEntry, alignment: u64, data_len: u64) -> Result<TensorInfo, GgufError> {
    let Some(ty) = GgmlType::from_id(e.type_id) else {
        return Err(GgufError::UnknownType {
            tensor: e.name,
            type_id: e.type_id,
        });
    };
    let elems = e
        .dims
        .iter()
        .try_fold(1u64, |acc, &d| {
            (d > 0).then(|| acc.checked_mul(d)).flatten()
        })
        .and_then(|n| usize::try_from(n).ok().map(|u| (n, u)));
    let Some((elems, elems_usize)) = elems else {
        return Err(GgufError::BadDims {
            tensor: e.name,
            dims: e.dims,
        });
    };
    let cols = e.dims.first().copied().unwrap_or(1);
    if !cols.is_multiple_of(ty.block_elems()) {
        return Err(GgufError::RowNotBlockMultiple {
            tensor: e.name,
            ty,
            cols,
            block: ty.block_elems(),
        });
    }
    let Some(bytes) = (elems / ty.block_elems()).checked_mul(ty.block_bytes()) else {
        return Err(GgufError::BadDims {
            tensor: e.name,
            dims: e.dims,
        });
    };
    if !e.offset.is_multiple_of(alignment) {
        return Err(GgufError::Misaligned {
            tensor: e.name,
            offset: e.offset,
            alignment,
        });
    }
    let end = e.offset.checked_add(bytes);
    if end.is_none_or(|end| end > data_len) {
        return Err(GgufError::OutOfBounds {
            tensor: e.name,
            offset: e.offset,
            end: end.unwrap_or(u64::MAX),
            available: data_len,
        });
    }
    Ok(TensorInfo {
        name: e.name,
        dims: e.dims,
        ty,
        offset: e.offset,
        bytes,
        elems: elems_usize,
    })
}

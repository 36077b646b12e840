//! One `.safetensors` buffer: header checked by the `safetensors` crate's
//! own metadata validation, every tensor bounds-checked before it is read,
//! f32/f16/bf16 converted to f32.

use safetensors::Dtype;
use safetensors::tensor::Metadata;

use crate::model::ModelError;

/// The crate's own header limit (100 MB); anything larger is corrupt.
const MAX_HEADER: usize = 100_000_000;

/// A parsed shard whose data section is known to be exactly as long as its
/// header says.
#[derive(Debug)]
pub(super) struct Shard<'a> {
    pub(super) name: String,
    meta: Metadata,
    data: &'a [u8],
}

impl<'a> Shard<'a> {
    /// Parses the header of `bytes` (the whole file) and checks that the data
    /// section holds every tensor it announces, and nothing more.
    pub(super) fn parse(name: &str, bytes: &'a [u8]) -> Result<Self, ModelError> {
        let bad = |m: String| ModelError::BadHeader(format!("{name}: {m}"));
        let Some((len_bytes, rest)) = bytes.split_first_chunk::<8>() else {
            return Err(ModelError::Truncated {
                tensor: format!("<header length of {name}>"),
                expected: 8,
                available: bytes.len(),
            });
        };
        let header_len = u64::from_le_bytes(*len_bytes);
        let header_len = usize::try_from(header_len)
            .ok()
            .filter(|&n| n <= MAX_HEADER)
            .ok_or_else(|| bad(format!("header length {header_len} is implausible")))?;
        let Some((header, data)) = rest.split_at_checked(header_len) else {
            return Err(ModelError::Truncated {
                tensor: format!("<header of {name}>"),
                expected: header_len,
                available: rest.len(),
            });
        };
        let meta: Metadata = serde_json::from_slice(header)
            .map_err(|e| bad(format!("header is not valid safetensors metadata: {e}")))?;

        let needed = meta.data_len();
        if data.len() < needed {
            // Name the first tensor that does not fit.
            for key in meta.offset_keys() {
                if let Some(info) = meta.info(&key) {
                    let (start, end) = info.data_offsets;
                    if end > data.len() {
                        return Err(ModelError::Truncated {
                            tensor: format!("{key} in {name}"),
                            expected: end - start,
                            available: data.len().saturating_sub(start),
                        });
                    }
                }
            }
            return Err(bad(format!(
                "data section is {} bytes, header needs {needed}",
                data.len()
            )));
        }
        if data.len() > needed {
            return Err(bad(format!(
                "{} bytes follow the last tensor: the file is corrupt",
                data.len() - needed
            )));
        }
        Ok(Self {
            name: name.to_string(),
            meta,
            data,
        })
    }

    /// Names of the tensors this shard holds.
    pub(super) fn names(&self) -> Vec<String> {
        self.meta.offset_keys()
    }

    pub(super) fn contains(&self, tensor: &str) -> bool {
        self.meta.info(tensor).is_some()
    }

    /// Reads `tensor` as f32, checking shape and dtype and rejecting
    /// non-finite values. `None` when this shard does not hold it.
    pub(super) fn read_f32(
        &self,
        tensor: &str,
        expected: &[usize],
    ) -> Option<Result<Vec<f32>, ModelError>> {
        let info = self.meta.info(tensor)?;
        Some(self.convert(tensor, info, expected))
    }

    fn convert(
        &self,
        tensor: &str,
        info: &safetensors::tensor::TensorInfo,
        expected: &[usize],
    ) -> Result<Vec<f32>, ModelError> {
        if !matches!(info.dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16) {
            return Err(ModelError::Dtype {
                tensor: tensor.to_string(),
                dtype: format!("{:?}", info.dtype),
            });
        }
        if info.shape != expected {
            return Err(ModelError::Shape {
                tensor: tensor.to_string(),
                expected: expected.to_vec(),
                got: info.shape.clone(),
            });
        }
        let (start, end) = info.data_offsets;
        // Offsets were validated against the data length in `parse`; `get`
        // keeps a logic slip from turning into a panic.
        let raw = self
            .data
            .get(start..end)
            .ok_or_else(|| ModelError::Truncated {
                tensor: format!("{tensor} in {}", self.name),
                expected: end.saturating_sub(start),
                available: self.data.len().saturating_sub(start),
            })?;
        let out: Vec<f32> = match info.dtype {
            Dtype::F32 => raw
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::F16 => raw
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::BF16 => raw
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => {
                return Err(ModelError::Dtype {
                    tensor: tensor.to_string(),
                    dtype: format!("{other:?}"),
                });
            }
        };
        if let Some(index) = out.iter().position(|x| !x.is_finite()) {
            return Err(ModelError::NonFinite {
                tensor: tensor.to_string(),
                index,
            });
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    fn file(tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
        let views: Vec<(&str, TensorView<'_>)> = tensors
            .iter()
            .map(|(n, d, s, b)| (*n, TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize(views, None).unwrap()
    }

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn f32_f16_bf16_all_read_as_f32() {
        let vals = [1.0f32, -2.5, 0.125, 3.0];
        let f16: Vec<u8> = vals
            .iter()
            .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
            .collect();
        let bf16: Vec<u8> = vals
            .iter()
            .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
            .collect();
        let bytes = file(&[
            ("a", Dtype::F32, vec![2, 2], f32_bytes(&vals)),
            ("b", Dtype::F16, vec![2, 2], f16),
            ("c", Dtype::BF16, vec![4], bf16),
        ]);
        let s = Shard::parse("x.safetensors", &bytes).unwrap();
        assert_eq!(s.read_f32("a", &[2, 2]).unwrap().unwrap(), vals);
        assert_eq!(s.read_f32("b", &[2, 2]).unwrap().unwrap(), vals);
        assert_eq!(s.read_f32("c", &[4]).unwrap().unwrap(), vals);
        assert!(s.read_f32("d", &[4]).is_none());
    }

    #[test]
    fn wrong_shape_and_dtype_name_the_tensor() {
        let bytes = file(&[
            ("w", Dtype::F32, vec![2, 2], f32_bytes(&[0.0; 4])),
            ("i", Dtype::I32, vec![4], vec![0; 16]),
        ]);
        let s = Shard::parse("x.safetensors", &bytes).unwrap();
        match s.read_f32("w", &[4, 1]).unwrap() {
            Err(ModelError::Shape {
                tensor,
                expected,
                got,
            }) => {
                assert_eq!(
                    (tensor.as_str(), expected, got),
                    ("w", vec![4, 1], vec![2, 2])
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            s.read_f32("i", &[4]).unwrap(),
            Err(ModelError::Dtype { ref tensor, ref dtype }) if tensor == "i" && dtype == "I32"
        ));
    }

    #[test]
    fn nan_is_found_with_its_index() {
        let bytes = file(&[("w", Dtype::F32, vec![3], f32_bytes(&[0.0, 1.0, f32::NAN]))]);
        let s = Shard::parse("x.safetensors", &bytes).unwrap();
        assert!(matches!(
            s.read_f32("w", &[3]).unwrap(),
            Err(ModelError::NonFinite { ref tensor, index: 2 }) if tensor == "w"
        ));
    }

    #[test]
    fn truncation_names_the_first_tensor_cut_off() {
        let bytes = file(&[
            ("a", Dtype::F32, vec![4], f32_bytes(&[1.0; 4])),
            ("b", Dtype::F32, vec![4], f32_bytes(&[2.0; 4])),
        ]);
        let cut = &bytes[..bytes.len() - 3];
        match Shard::parse("x.safetensors", cut).unwrap_err() {
            ModelError::Truncated {
                tensor,
                expected,
                available,
            } => assert_eq!(
                (tensor.as_str(), expected, available),
                ("b in x.safetensors", 16, 13)
            ),
            other => panic!("{other:?}"),
        }
        // Every prefix is a typed error, never a panic.
        for n in 0..bytes.len() {
            assert!(Shard::parse("x", &bytes[..n]).is_err(), "prefix {n}");
        }
    }

    #[test]
    fn corrupt_headers_are_bad_header() {
        let bytes = file(&[("a", Dtype::F32, vec![1], f32_bytes(&[1.0]))]);
        let mut trailing = bytes.clone();
        trailing.extend_from_slice(&[0; 4]);
        let mut huge = bytes.clone();
        huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        let mut garbled = bytes.clone();
        garbled[9] = b'#';
        let mut inconsistent =
            b"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}".to_vec();
        let mut f = (inconsistent.len() as u64).to_le_bytes().to_vec();
        f.append(&mut inconsistent);
        f.extend_from_slice(&[0; 4]);
        for (what, b) in [
            ("trailing", trailing),
            ("huge", huge),
            ("garbled", garbled),
            ("inconsistent", f),
        ] {
            assert!(
                matches!(Shard::parse("x", &b), Err(ModelError::BadHeader(_))),
                "{what}: {:?}",
                Shard::parse("x", &b)
            );
        }
    }
}

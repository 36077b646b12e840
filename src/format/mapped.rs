//! A model file's bytes, mapped read-only for the duration of a load, so a
//! loader copies each tensor once, straight into its owned f32 buffer,
//! instead of first reading the whole file into memory.

use std::fs::File;
use std::path::Path;

use memmap2::Mmap;

/// A file's bytes: mapped, or empty (a zero-length file cannot be mapped).
pub(crate) enum Mapped {
    Map(Mmap),
    Empty,
}

impl Mapped {
    pub(crate) fn open(path: &Path) -> std::io::Result<Self> {
        let file = File::open(path)?;
        let len = file.metadata()?.len();
        if len == 0 {
            return Ok(Self::Empty);
        }
        // SAFETY: the map is read-only and lives only while a load copies
        // the tensors out into owned f32 buffers. Mapping is sound as long as
        // no other process truncates or rewrites the file meanwhile; model
        // files are read-only inputs, and the alternative (reading whole
        // multi-GB files into memory) is what the mapping exists to avoid.
        let map = unsafe { Mmap::map(&file) }?;
        Ok(Self::Map(map))
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        match self {
            Self::Map(m) => m,
            Self::Empty => &[],
        }
    }
}

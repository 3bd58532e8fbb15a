//! The header of a clang offload bundle, as `hipcc --genco` writes the copy kernel's code objects:
//! which GPU targets it holds. One reader for build.rs (which checks the bundle it built) and
//! tests/copy_kernel.rs (which checks the one libmori_tp embeds); both include this file by path.
//!
//! Two formats exist. An uncompressed bundle starts with `__CLANG_OFFLOAD_BUNDLE__`, then a
//! little-endian u64 entry count, then per entry a u64 offset, a u64 size, a u64 id length and
//! the id (e.g. `hipv4-amdgcn-amd-amdhsa--gfx90a`). A compressed one (`hipcc
//! --offload-compress`, the default of some ROCm builds) starts with `CCOB`, a u16 format
//! version and a u16 compression method; its entries are inside the compressed payload, which
//! only `clang-offload-bundler --list` reads.

/// The first bytes of an uncompressed bundle.
pub const PLAIN_MAGIC: &[u8] = b"__CLANG_OFFLOAD_BUNDLE__";
/// The first bytes of a compressed bundle.
pub const COMPRESSED_MAGIC: &[u8] = b"CCOB";

/// What a bundle's header says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Bundle {
    /// An uncompressed bundle and the target ids of its entries, in order.
    Plain(Vec<String>),
    /// A compressed bundle: its format version and compression method (1 zlib, 2 zstd).
    Compressed { version: u16, method: u16 },
}

/// Reads the header of the bundle `image` starts with.
pub fn read(image: &[u8]) -> Result<Bundle, String> {
    if let Some(rest) = image.strip_prefix(COMPRESSED_MAGIC) {
        let field = |at: usize| -> Result<u16, String> {
            let bytes = rest
                .get(at..at + 2)
                .ok_or("truncated compressed bundle header")?;
            Ok(u16::from_le_bytes([bytes[0], bytes[1]]))
        };
        return Ok(Bundle::Compressed {
            version: field(0)?,
            method: field(2)?,
        });
    }
    let rest = image
        .strip_prefix(PLAIN_MAGIC)
        .ok_or("neither __CLANG_OFFLOAD_BUNDLE__ nor CCOB magic")?;
    let mut at = 0usize;
    let count = u64_at(rest, &mut at)?;
    let mut ids = Vec::new();
    for _ in 0..count {
        let (_offset, _size) = (u64_at(rest, &mut at)?, u64_at(rest, &mut at)?);
        let len = usize::try_from(u64_at(rest, &mut at)?).map_err(|_| "huge entry id")?;
        let end = at.checked_add(len).ok_or("huge entry id")?;
        let id = rest.get(at..end).ok_or("truncated entry id")?;
        at = end;
        ids.push(String::from_utf8_lossy(id).into_owned());
    }
    Ok(Bundle::Plain(ids))
}

/// The GPU target (e.g. `gfx90a`) of an AMD GPU entry id such as
/// `hipv4-amdgcn-amd-amdhsa--gfx90a:xnack-`, or None for other entries (the host's).
pub fn gpu_target(id: &str) -> Option<&str> {
    let target = id.strip_prefix("hipv4-amdgcn-amd-amdhsa--")?;
    Some(target.split(':').next().unwrap_or(target))
}

/// The little-endian u64 at `*at`, advancing `*at` past it.
fn u64_at(bytes: &[u8], at: &mut usize) -> Result<u64, String> {
    let field = bytes.get(*at..*at + 8).ok_or("truncated header")?;
    *at += 8;
    Ok(u64::from_le_bytes(field.try_into().expect("8 bytes")))
}

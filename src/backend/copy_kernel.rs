//! The copy kernel's table and launch geometry: the Rust side of `hip/copy_kernel.h`.
//!
//! One launch of the kernel copies every (buffer, rect) of a [`CopyJob`]. The host lays out, in
//! one allocation uploaded at once, the rects (64 bytes each, with the prefix sum of heights the
//! kernel searches), then the source base addresses, then the destination base addresses; the
//! kernel's one argument points into it. Everything here mirrors the C header field for field
//! (a test compares the constants), so that the engine and the kernel agree on every byte.

use super::CopyJob;
use crate::error::{Result, checked_product};

/// The kernel's symbol in the code object (`MORI_COPY_KERNEL_NAME`).
pub const KERNEL_NAME: &std::ffi::CStr = c"mori_copy_kernel";
/// Threads per block; the kernel is compiled for exactly this block size.
pub const BLOCK_THREADS: u32 = 256;
/// Grid x cap; the kernel strides over further tiles.
pub const MAX_GRID_X: u32 = 1_048_576;
/// Grid y cap (the hardware's); the kernel strides over further buffers.
pub const MAX_GRID_Y: u32 = 65_535;
/// Bytes of one buffer a tile holds (whole rows).
pub const TILE_BYTES: u64 = 16_384;
/// Most rows in one tile.
pub const MAX_ROWS_PER_BLOCK: u64 = 1024;

/// One rect of the table (`MoriCopyKernelRect`): 8 x u64 = 64 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelRect {
    /// First source row, relative to each source base.
    pub src_offset: u64,
    /// First destination row, relative to each destination base.
    pub dst_offset: u64,
    /// Bytes between source rows.
    pub src_pitch: u64,
    /// Bytes between destination rows.
    pub dst_pitch: u64,
    /// Bytes per row.
    pub width: u64,
    /// Rows.
    pub height: u64,
    /// Rows of all rects before this one.
    pub first_row: u64,
    /// Zero; pads the entry to 64 bytes.
    pub reserved: u64,
}

/// The kernel's one argument (`MoriCopyKernelArgs`), passed by value: 56 bytes. The three
/// pointers are device addresses inside the uploaded table.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelArgs {
    /// Address of the first [`KernelRect`].
    pub rects: u64,
    /// Address of the `num_buffers` source base addresses.
    pub src_bases: u64,
    /// Address of the `num_buffers` destination base addresses.
    pub dst_bases: u64,
    /// Rects in the table.
    pub num_rects: u64,
    /// Buffer pairs.
    pub num_buffers: u64,
    /// Sum of all heights.
    pub total_rows: u64,
    /// Rows of one tile, at least 1.
    pub rows_per_block: u64,
}

/// Rows per tile for rows of at most `max_width` bytes (`mori_copy_rows_per_block`).
pub fn rows_per_block(max_width: u64) -> u64 {
    TILE_BYTES
        .checked_div(max_width)
        .unwrap_or(MAX_ROWS_PER_BLOCK)
        .clamp(1, MAX_ROWS_PER_BLOCK)
}

/// The grid `(x, y)` that gives each (tile, buffer) its own block within the caps
/// (`mori_copy_grid`); `(0, 0)` when there is nothing to copy.
pub fn grid(total_rows: u64, rows_per_block: u64, num_buffers: u64) -> (u32, u32) {
    let tiles = total_rows.div_ceil(rows_per_block.max(1));
    let x = tiles.min(u64::from(MAX_GRID_X)) as u32;
    let y = num_buffers.min(u64::from(MAX_GRID_Y)) as u32;
    if x == 0 || y == 0 { (0, 0) } else { (x, y) }
}

/// A call's table, ready to upload: rects, then source bases, then destination bases, as u64
/// words (so every part is 8-byte aligned, as the kernel reads it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelTable {
    words: Vec<u64>,
    num_rects: u64,
    num_buffers: u64,
    total_rows: u64,
    max_width: u64,
}

/// u64 words per [`KernelRect`].
const RECT_WORDS: usize = std::mem::size_of::<KernelRect>() / 8;

impl KernelTable {
    /// The table of `job`: its rects with their prefix sums of heights, and its base pointers.
    pub fn new(job: &CopyJob<'_>) -> Result<Self> {
        let (num_rects, num_buffers) = (job.num_rects(), job.num_buffers());
        // 64 bytes per rect and 16 per buffer = 16 * (4 * rects + buffers); the sum cannot
        // overflow (both counts are lengths of in-memory arrays), the product is checked.
        checked_product(
            "bytes of the copy kernel's table (16 * (4 * rects + buffers))",
            4 * num_rects as u64 + num_buffers as u64,
            16,
        )?;
        let mut words = Vec::with_capacity(num_rects * RECT_WORDS + 2 * num_buffers);
        let (mut total_rows, mut max_width) = (0u64, 0u64);
        for rect in job.rects() {
            words.extend_from_slice(&[
                rect.src_offset,
                rect.dst_offset,
                rect.src_pitch,
                rect.dst_pitch,
                rect.width,
                rect.height,
                total_rows,
                0,
            ]);
            // Cannot overflow: the job's total bytes (rows x width) fit in u64.
            total_rows += rect.height;
            max_width = max_width.max(rect.width);
        }
        words.extend(job.buffers().map(|(src, _)| src as u64));
        words.extend(job.buffers().map(|(_, dst)| dst as u64));
        Ok(KernelTable {
            words,
            num_rects: num_rects as u64,
            num_buffers: num_buffers as u64,
            total_rows,
            max_width,
        })
    }

    /// The bytes to upload, in the layout the kernel reads.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: any u64 is 8 initialised bytes; u8 has no alignment requirement.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast(), self.words.len() * 8) }
    }

    /// The kernel's argument once the table is at device address `table`.
    pub fn args(&self, table: u64) -> KernelArgs {
        let rects = self.num_rects * std::mem::size_of::<KernelRect>() as u64;
        KernelArgs {
            rects: table,
            src_bases: table + rects,
            dst_bases: table + rects + 8 * self.num_buffers,
            num_rects: self.num_rects,
            num_buffers: self.num_buffers,
            total_rows: self.total_rows,
            rows_per_block: rows_per_block(self.max_width),
        }
    }

    /// The launch's grid (x over tiles, y over buffers).
    pub fn grid(&self) -> (u32, u32) {
        grid(
            self.total_rows,
            rows_per_block(self.max_width),
            self.num_buffers,
        )
    }
}

/// The code objects of the kernel for every GPU target the build's hipcc supports, as one clang
/// offload bundle for `hipModuleLoadData` (built by build.rs from hip/copy_kernel.hip). Aligned
/// like an ELF image, since the loader may read it in place.
#[cfg(feature = "hip")]
pub static IMAGE: &[u8] = {
    #[repr(C, align(4096))]
    struct Aligned<T: ?Sized>(T);
    static BUNDLE: &Aligned<[u8]> = &Aligned(*include_bytes!(concat!(
        env!("OUT_DIR"),
        "/copy_kernel.hsaco"
    )));
    &BUNDLE.0
};

/// The GPU targets [`IMAGE`] holds code objects for, comma-separated (e.g. "gfx90a,gfx942").
#[cfg(feature = "hip")]
pub const ARCHS: &str = env!("MORI_TP_HIP_KERNEL_ARCHS");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_structs_have_the_c_header_sizes() {
        assert_eq!(std::mem::size_of::<KernelRect>(), 64);
        assert_eq!(std::mem::size_of::<KernelArgs>(), 56);
    }

    #[test]
    fn rows_per_block_fills_a_tile_within_its_bounds() {
        assert_eq!(rows_per_block(256), 64);
        assert_eq!(rows_per_block(1), MAX_ROWS_PER_BLOCK);
        assert_eq!(rows_per_block(0), MAX_ROWS_PER_BLOCK);
        assert_eq!(rows_per_block(TILE_BYTES + 1), 1);
    }

    #[test]
    fn the_grid_covers_every_tile_and_buffer_up_to_the_caps() {
        assert_eq!(grid(1000, 64, 70_000), (16, MAX_GRID_Y));
        assert_eq!(grid(1 << 40, 1, 3), (MAX_GRID_X, 3));
        assert_eq!(grid(0, 64, 3), (0, 0));
        assert_eq!(grid(5, 64, 0), (0, 0));
    }
}

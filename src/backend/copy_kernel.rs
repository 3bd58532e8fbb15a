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

/// The kernel's one argument (`MoriCopyKernelArgs`), passed by value: 64 bytes. The three
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
    /// Threads per row, at least 1.
    pub lanes_per_row: u64,
}

/// Rows per tile for rows of at most `max_width` bytes (`mori_copy_rows_per_block`).
pub fn rows_per_block(max_width: u64) -> u64 {
    TILE_BYTES
        .checked_div(max_width)
        .unwrap_or(MAX_ROWS_PER_BLOCK)
        .clamp(1, MAX_ROWS_PER_BLOCK)
}

/// Threads per row for rows of at most `max_width` bytes: one 16-byte unit each
/// (`mori_copy_lanes_per_row`).
pub fn lanes_per_row(max_width: u64) -> u64 {
    max_width.div_ceil(16).clamp(1, u64::from(BLOCK_THREADS))
}

/// The grid `(x, y)` that gives each (tile, buffer) its own block within the caps
/// (`mori_copy_grid`); `(0, 0)` when there is nothing to copy.
pub fn grid(total_rows: u64, rows_per_block: u64, num_buffers: u64) -> (u32, u32) {
    let tiles = total_rows.div_ceil(rows_per_block.max(1));
    let x = tiles.min(u64::from(MAX_GRID_X)) as u32;
    let y = num_buffers.min(u64::from(MAX_GRID_Y)) as u32;
    if x == 0 || y == 0 { (0, 0) } else { (x, y) }
}

/// A call's table, ready to upload: rects, then source bases, then destination bases (every
/// part 8-byte aligned, as the kernel reads it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelTable {
    rects: Vec<KernelRect>,
    src_bases: Vec<u64>,
    dst_bases: Vec<u64>,
    total_rows: u64,
    max_width: u64,
}

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
        let mut rects = Vec::with_capacity(num_rects);
        let (mut total_rows, mut max_width) = (0u64, 0u64);
        for rect in job.rects() {
            rects.push(KernelRect {
                src_offset: rect.src_offset,
                dst_offset: rect.dst_offset,
                src_pitch: rect.src_pitch,
                dst_pitch: rect.dst_pitch,
                width: rect.width,
                height: rect.height,
                first_row: total_rows,
                reserved: 0,
            });
            // Cannot overflow: the job's total bytes (rows x width) fit in u64.
            total_rows += rect.height;
            max_width = max_width.max(rect.width);
        }
        Ok(KernelTable {
            rects,
            src_bases: job.buffers().map(|(src, _)| src as u64).collect(),
            dst_bases: job.buffers().map(|(_, dst)| dst as u64).collect(),
            total_rows,
            max_width,
        })
    }

    /// Buffer pairs in the table.
    pub fn num_buffers(&self) -> usize {
        self.src_bases.len()
    }

    /// Bytes of the table as the kernel reads it.
    pub fn byte_len(&self) -> usize {
        std::mem::size_of_val(self.rects.as_slice()) + 16 * self.num_buffers()
    }

    /// Writes the table into `out` (at least [`KernelTable::byte_len`] bytes), in the kernel's
    /// layout.
    pub fn write_to(&self, out: &mut [u8]) {
        let rects = std::mem::size_of_val(self.rects.as_slice());
        let bases = 8 * self.num_buffers();
        // SAFETY: KernelRect is repr(C) of eight u64s (no padding), so its slice is initialised
        // bytes; u8 has no alignment requirement.
        let rect_bytes = unsafe { std::slice::from_raw_parts(self.rects.as_ptr().cast(), rects) };
        out[..rects].copy_from_slice(rect_bytes);
        for (part, words) in [(rects, &self.src_bases), (rects + bases, &self.dst_bases)] {
            for (at, word) in words.iter().enumerate() {
                out[part + 8 * at..part + 8 * at + 8].copy_from_slice(&word.to_ne_bytes());
            }
        }
    }

    /// The kernel's argument once the table is at device address `table`.
    pub fn args(&self, table: u64) -> KernelArgs {
        let rects = std::mem::size_of_val(self.rects.as_slice()) as u64;
        let num_buffers = self.num_buffers() as u64;
        KernelArgs {
            rects: table,
            src_bases: table + rects,
            dst_bases: table + rects + 8 * num_buffers,
            num_rects: self.rects.len() as u64,
            num_buffers,
            total_rows: self.total_rows,
            rows_per_block: rows_per_block(self.max_width),
            lanes_per_row: lanes_per_row(self.max_width),
        }
    }

    /// The launch's grid (x over tiles, y over buffers).
    pub fn grid(&self) -> (u32, u32) {
        grid(
            self.total_rows,
            rows_per_block(self.max_width),
            self.num_buffers() as u64,
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

/// The kernel as PTX text for `cuModuleLoadData`, NUL-terminated (build.rs compiles
/// hip/copy_kernel.hip with clang for NVPTX and checks the entry).
#[cfg(feature = "cuda")]
pub static PTX: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/copy_kernel.ptx"));

/// The virtual architecture [`PTX`] is written for (e.g. "sm_70").
#[cfg(feature = "cuda")]
pub const PTX_ARCH: &str = env!("MORI_TP_PTX_ARCH");

#[cfg(test)]
mod tests {
    use super::*;

    /// The PTX build.rs embeds (feature `cuda`): NUL-terminated text with the kernel's entry, its
    /// one argument as big as [`KernelArgs`], for the block size the engine launches, written for
    /// [`PTX_ARCH`] (the driver JIT-compiles it for the GPU at hand).
    #[cfg(feature = "cuda")]
    #[test]
    fn the_ptx_declares_the_kernel_with_its_argument_and_block_size() {
        assert_eq!(
            PTX.last(),
            Some(&0),
            "cuModuleLoadData takes NUL-terminated PTX"
        );
        let text = std::str::from_utf8(&PTX[..PTX.len() - 1]).expect("PTX is text");
        assert!(!text.contains('\0'), "one NUL, at the end");
        for part in [
            format!(".target {PTX_ARCH}"),
            ".address_size 64".to_string(),
            format!(".visible .entry {}(", KERNEL_NAME.to_str().unwrap()),
            format!(
                ".param .align 8 .b8 {}_param_0[{}]",
                KERNEL_NAME.to_str().unwrap(),
                std::mem::size_of::<KernelArgs>()
            ),
            format!(".maxntid {BLOCK_THREADS}, 1, 1"),
        ] {
            assert!(text.contains(&part), "the PTX lacks {part:?}");
        }
    }

    #[test]
    fn the_structs_have_the_c_header_sizes() {
        assert_eq!(std::mem::size_of::<KernelRect>(), 64);
        assert_eq!(std::mem::size_of::<KernelArgs>(), 64);
    }

    #[test]
    fn rows_per_block_fills_a_tile_within_its_bounds() {
        assert_eq!(rows_per_block(256), 64);
        assert_eq!(rows_per_block(1), MAX_ROWS_PER_BLOCK);
        assert_eq!(rows_per_block(0), MAX_ROWS_PER_BLOCK);
        assert_eq!(rows_per_block(TILE_BYTES + 1), 1);
    }

    #[test]
    fn lanes_per_row_gives_each_lane_one_16_byte_unit_of_the_widest_row() {
        assert_eq!(lanes_per_row(256), 16);
        assert_eq!(lanes_per_row(1152), 72);
        assert_eq!(lanes_per_row(72), 5);
        assert_eq!(lanes_per_row(0), 1);
        assert_eq!(lanes_per_row(1), 1);
        assert_eq!(lanes_per_row(16_000), u64::from(BLOCK_THREADS));
    }

    #[test]
    fn the_grid_covers_every_tile_and_buffer_up_to_the_caps() {
        assert_eq!(grid(1000, 64, 70_000), (16, MAX_GRID_Y));
        assert_eq!(grid(1 << 40, 1, 3), (MAX_GRID_X, 3));
        assert_eq!(grid(0, 64, 3), (0, 0));
        assert_eq!(grid(5, 64, 0), (0, 0));
    }

    #[test]
    fn the_rust_table_layout_and_grid_rule_match_the_c_header() {
        let header = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("hip/copy_kernel.h"),
        )
        .expect("hip/copy_kernel.h");
        let define = |name: &str| -> u64 {
            let line = header
                .lines()
                .find(|l| l.starts_with(&format!("#define {name} ")))
                .unwrap_or_else(|| panic!("{name} is not defined"));
            line.split_whitespace()
                .nth(2)
                .unwrap()
                .trim_end_matches('u')
                .parse()
                .unwrap()
        };
        use super as k;
        assert_eq!(
            define("MORI_COPY_BLOCK_THREADS"),
            u64::from(k::BLOCK_THREADS)
        );
        assert_eq!(define("MORI_COPY_MAX_GRID_X"), u64::from(k::MAX_GRID_X));
        assert_eq!(define("MORI_COPY_MAX_GRID_Y"), u64::from(k::MAX_GRID_Y));
        assert_eq!(define("MORI_COPY_TILE_BYTES"), k::TILE_BYTES);
        assert_eq!(
            define("MORI_COPY_MAX_ROWS_PER_BLOCK"),
            k::MAX_ROWS_PER_BLOCK
        );
        assert!(header.contains(&format!(
            "#define MORI_COPY_KERNEL_NAME \"{}\"",
            k::KERNEL_NAME.to_str().unwrap()
        )));
        // The struct fields, in order, as the header declares them (one per line).
        let fields = |name: &str| -> Vec<String> {
            let start = header.find(&format!("typedef struct {name} {{")).unwrap();
            let body = &header[start..start + header[start..].find('}').unwrap()];
            body.lines()
                .skip(1)
                .filter_map(|l| {
                    let decl = l.split("/*").next().unwrap().trim().trim_end_matches(';');
                    let field = decl.rsplit(' ').next()?.trim_start_matches('*');
                    (!field.is_empty()).then(|| field.to_string())
                })
                .collect()
        };
        // Every field is 8 bytes, so the header's order fixes each offset.
        use std::mem::offset_of;
        let rect_offsets = [
            ("src_offset", offset_of!(k::KernelRect, src_offset)),
            ("dst_offset", offset_of!(k::KernelRect, dst_offset)),
            ("src_pitch", offset_of!(k::KernelRect, src_pitch)),
            ("dst_pitch", offset_of!(k::KernelRect, dst_pitch)),
            ("width", offset_of!(k::KernelRect, width)),
            ("height", offset_of!(k::KernelRect, height)),
            ("first_row", offset_of!(k::KernelRect, first_row)),
            ("reserved", offset_of!(k::KernelRect, reserved)),
        ];
        let args_offsets = [
            ("rects", offset_of!(KernelArgs, rects)),
            ("src_bases", offset_of!(KernelArgs, src_bases)),
            ("dst_bases", offset_of!(KernelArgs, dst_bases)),
            ("num_rects", offset_of!(KernelArgs, num_rects)),
            ("num_buffers", offset_of!(KernelArgs, num_buffers)),
            ("total_rows", offset_of!(KernelArgs, total_rows)),
            ("rows_per_block", offset_of!(KernelArgs, rows_per_block)),
            ("lanes_per_row", offset_of!(KernelArgs, lanes_per_row)),
        ];
        for (name, offsets) in [
            ("MoriCopyKernelRect", &rect_offsets[..]),
            ("MoriCopyKernelArgs", &args_offsets[..]),
        ] {
            let declared = fields(name);
            assert_eq!(declared.len(), offsets.len(), "{name}: {declared:?}");
            for (index, (field, (rust, offset))) in declared.iter().zip(offsets).enumerate() {
                assert_eq!((field.as_str(), *offset), (*rust, 8 * index), "{name}");
            }
        }
        // The header's formulas, restated: tiles of clamp(16384 / width, 1, 1024) rows, one lane
        // per 16 bytes of the widest row (at most a block), grid x over tiles, y over buffers.
        for (rows, width, buffers) in [
            (1000u64, 256u64, 70_000u64),
            (1 << 40, 1, 3),
            (7, 20_000, 2),
        ] {
            let rpb = (16_384 / width).clamp(1, 1024);
            let x = rows.div_ceil(rpb).min(u64::from(MAX_GRID_X)) as u32;
            let y = buffers.min(u64::from(MAX_GRID_Y)) as u32;
            assert_eq!(k::rows_per_block(width), rpb);
            assert_eq!(k::lanes_per_row(width), width.div_ceil(16).clamp(1, 256));
            assert_eq!(k::grid(rows, rpb, buffers), (x, y));
        }
    }
}

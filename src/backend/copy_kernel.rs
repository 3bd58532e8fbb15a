//! The copy kernel's table and launch geometry: the Rust side of `hip/copy_kernel.h`.
//!
//! One launch of the kernel copies every (buffer, rect) of a [`CopyJob`]. The host plans the
//! whole work split, so that no GPU thread searches: rects of equal shape form runs (a rect and
//! its run whose heights divide one another are cut to the smaller), runs are cut into tiles
//! of at most [`TILE_UNITS`] units of one buffer, grid x walks tiles and grid y groups of buffers,
//! and each thread works out the offsets of its [`SLOTS_PER_THREAD`] units of a tile once and
//! copies them for every buffer of its group. The table (buffer bases, runs, the tiles' runs,
//! rect offsets) travels inside the kernel's argument when it fits in
//! [`INLINE_TABLE_BYTES`], or, where the runtime takes the wide entry's 32,760-byte argument
//! (CUDA 12.1+), in [`WIDE_INLINE_TABLE_BYTES`] ([`KernelTable::launch_wide`]); otherwise the
//! engine uploads it. Everything here mirrors the C header
//! and `hip/copy_table.hpp` field for field and step for step (tests compare the constants, the
//! field offsets and, through the C++ builder, the bytes), so that the engine and the kernel
//! agree on every byte.

use super::CopyJob;
use crate::error::{Error, Result};
use crate::plan::CopyRect;

/// The kernel's symbol in the code object (`MORI_COPY_KERNEL_NAME`).
pub const KERNEL_NAME: &std::ffi::CStr = c"mori_copy_kernel";
/// Threads per block; the kernel is compiled for at most this block size.
pub const BLOCK_THREADS: u32 = 256;
/// Units of a tile each thread of a full block takes.
pub const SLOTS_PER_THREAD: u32 = 4;
/// Units of one buffer a tile holds (1024).
pub const TILE_UNITS: u32 = BLOCK_THREADS * SLOTS_PER_THREAD;
/// Grid x cap; the kernel strides over further tiles.
pub const MAX_GRID_X: u32 = 1_048_576;
/// Grid y cap (the hardware's); the kernel strides over further buffer groups.
pub const MAX_GRID_Y: u32 = 65_535;
/// Blocks the buffer grouping aims at.
pub const TARGET_BLOCKS: u64 = 2048;
/// Most buffers one block copies its tile for.
pub const MAX_BUFFERS_PER_BLOCK: u64 = 16;
/// A rect and its run are cut to the smaller height when that makes at most this many rects of
/// each.
pub const MAX_RUN_SPLIT: u64 = 64;
/// Widest row of a table entry; wider rects are cut into column strips.
pub const MAX_WIDTH: u64 = 1 << 30;
/// Most rows of one run; taller rects are cut.
pub const MAX_RUN_ROWS: u64 = 1 << 30;
/// Bytes of the kernel's argument.
pub const ARGS_BYTES: usize = 4096;
/// Bytes of the table room inside the argument.
pub const INLINE_TABLE_BYTES: usize = 4032;
/// The wide entry's symbol (`MORI_COPY_WIDE_KERNEL_NAME`): the same kernel with a
/// [`WIDE_ARGS_BYTES`]-byte argument, in a module of its own (CUDA 12.1+ drivers only).
pub const WIDE_KERNEL_NAME: &std::ffi::CStr = c"mori_copy_kernel_wide";
/// Bytes of the wide entry's argument ([`WideKernelArgs`]): the largest multiple of 8 within the
/// 32,764 bytes of kernel parameters CUDA 12.1+ drivers take on sm_70 and newer.
pub const WIDE_ARGS_BYTES: usize = 32_760;
/// Bytes of the table room inside the wide argument.
pub const WIDE_INLINE_TABLE_BYTES: usize = 32_696;
/// Bytes of one run entry.
pub const RUN_BYTES: usize = 48;
/// Narrowest piece cut into a head, a 16-byte-unit body and a tail when its rows are equally
/// misaligned on both sides.
pub const SPLIT_MIN_WIDTH: u64 = 128;
/// `args.flags`: rect offsets are two u64 rather than two u32.
pub const WIDE_OFFSETS: u32 = 1;

/// The kernel's one argument (`MoriCopyKernelArgs`), passed by value: [`ARGS_BYTES`] bytes, a
/// 64-byte header and the table room.
pub type KernelArgs = KernelArgsOf<{ INLINE_TABLE_BYTES / 8 }>;

/// The wide entry's argument (`MoriCopyKernelWideArgs`): the same header and
/// [`WIDE_INLINE_TABLE_BYTES`] of table room, [`WIDE_ARGS_BYTES`] in all.
pub type WideKernelArgs = KernelArgsOf<{ WIDE_INLINE_TABLE_BYTES / 8 }>;

/// An argument of the kernel with `WORDS` words of table room: [`KernelArgs`] or
/// [`WideKernelArgs`] (the C structs share their header the same way).
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct KernelArgsOf<const WORDS: usize> {
    /// Address of the table, or 0: the table is `inline_table`.
    pub table: u64,
    /// Bytes of the table.
    pub table_bytes: u32,
    /// Buffer pairs.
    pub num_buffers: u32,
    /// Buffers one block copies its tile for, at least 1.
    pub buffers_per_block: u32,
    /// Runs in the table.
    pub num_runs: u32,
    /// Tiles of all runs.
    pub num_tiles: u32,
    /// Rect offsets in the table.
    pub num_rects: u32,
    /// Byte offset of the runs in the table.
    pub runs_at: u32,
    /// Byte offset of the tiles' runs (when there is more than one run).
    pub tile_runs_at: u32,
    /// Byte offset of the rect offsets.
    pub rects_at: u32,
    /// [`WIDE_OFFSETS`] or 0.
    pub flags: u32,
    /// Rect offsets are stored shifted right by this many bits.
    pub offset_shift: u32,
    /// Zero.
    pub reserved: [u32; 3],
    /// The table when `table` is 0.
    pub inline_table: [u64; WORDS],
}

// The kernel is compiled for exactly these arguments (hip/copy_kernel.h, MORI_COPY_ARGS_BYTES
// and MORI_COPY_WIDE_ARGS_BYTES).
const _: () = assert!(std::mem::size_of::<KernelArgs>() == ARGS_BYTES);
const _: () = assert!(std::mem::size_of::<WideKernelArgs>() == WIDE_ARGS_BYTES);

impl<const WORDS: usize> Default for KernelArgsOf<WORDS> {
    fn default() -> Self {
        KernelArgsOf {
            table: 0,
            table_bytes: 0,
            num_buffers: 0,
            buffers_per_block: 0,
            num_runs: 0,
            num_tiles: 0,
            num_rects: 0,
            runs_at: 0,
            tile_runs_at: 0,
            rects_at: 0,
            flags: 0,
            offset_shift: 0,
            reserved: [0; 3],
            inline_table: [0; WORDS],
        }
    }
}

impl<const WORDS: usize> KernelArgsOf<WORDS> {
    /// The same header with the table room of another size, filled with `table` when it fits
    /// (else left zero and `table` not read).
    fn with_room<const OTHER: usize>(&self, table: &[u8]) -> KernelArgsOf<OTHER> {
        let mut args = KernelArgsOf::<OTHER> {
            table: self.table,
            table_bytes: self.table_bytes,
            num_buffers: self.num_buffers,
            buffers_per_block: self.buffers_per_block,
            num_runs: self.num_runs,
            num_tiles: self.num_tiles,
            num_rects: self.num_rects,
            runs_at: self.runs_at,
            tile_runs_at: self.tile_runs_at,
            rects_at: self.rects_at,
            flags: self.flags,
            offset_shift: self.offset_shift,
            reserved: self.reserved,
            inline_table: [0; OTHER],
        };
        if table.len() <= 8 * OTHER {
            fill_words(&mut args.inline_table, table);
        }
        args
    }
}

/// Little-endian words of `bytes` into `words` (the last one zero-padded).
fn fill_words(words: &mut [u64], bytes: &[u8]) {
    for (word, chunk) in words.iter_mut().zip(bytes.chunks(8)) {
        let mut le = [0u8; 8];
        le[..chunk.len()].copy_from_slice(chunk);
        *word = u64::from_le_bytes(le);
    }
}

impl<const WORDS: usize> std::fmt::Debug for KernelArgsOf<WORDS> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The inline table only as a checksum: kilobytes of words say nothing in a message.
        let inline = self
            .inline_table
            .iter()
            .fold(0u64, |h, w| h.rotate_left(5) ^ w);
        f.debug_struct("KernelArgs")
            .field("table", &format_args!("{:#x}", self.table))
            .field("table_bytes", &self.table_bytes)
            .field("num_buffers", &self.num_buffers)
            .field("buffers_per_block", &self.buffers_per_block)
            .field("num_runs", &self.num_runs)
            .field("num_tiles", &self.num_tiles)
            .field("num_rects", &self.num_rects)
            .field("runs_at", &self.runs_at)
            .field("tile_runs_at", &self.tile_runs_at)
            .field("rects_at", &self.rects_at)
            .field("flags", &self.flags)
            .field("offset_shift", &self.offset_shift)
            .field("inline_table_bytes", &(8 * WORDS))
            .field("inline_table_hash", &format_args!("{inline:#018x}"))
            .finish()
    }
}

/// Rows of a tile for rows of `units` units (`mori_copy_rows_per_tile`).
pub fn rows_per_tile(units: u32) -> u32 {
    if units >= TILE_UNITS {
        1
    } else {
        TILE_UNITS / units.max(1)
    }
}

/// Tiles per row for rows of `units` units (`mori_copy_col_chunks`).
pub fn col_chunks(units: u32) -> u32 {
    units.div_ceil(TILE_UNITS).max(1)
}

/// Buffers per block for `tiles` tiles of `buffers` buffers (`mori_copy_buffers_per_block`):
/// `clamp(tiles * buffers / TARGET_BLOCKS, 1, min(buffers, MAX_BUFFERS_PER_BLOCK))`.
pub fn buffers_per_block(tiles: u64, buffers: u64) -> u32 {
    buffers_per_block_for(tiles, buffers, TARGET_BLOCKS)
}

/// Buffers per block on about `target` blocks (`mori_copy_buffers_per_block_for`).
pub fn buffers_per_block_for(tiles: u64, buffers: u64, target: u64) -> u32 {
    let most = buffers.min(MAX_BUFFERS_PER_BLOCK);
    (tiles.saturating_mul(buffers) / target.max(1))
        .min(most)
        .max(1) as u32
}

/// The grid `(x, y)` for `args` (`mori_copy_grid`): x over tiles, y over buffer groups, within
/// the caps; `(0, 0)` when there is nothing to copy.
pub fn grid(args: &KernelArgs) -> (u32, u32) {
    let per = u64::from(args.buffers_per_block.max(1));
    let groups = u64::from(args.num_buffers).div_ceil(per);
    let x = args.num_tiles.min(MAX_GRID_X);
    let y = groups.min(u64::from(MAX_GRID_Y)) as u32;
    if x == 0 || y == 0 { (0, 0) } else { (x, y) }
}

/// The launch geometry within `max_blocks` blocks (`mori_copy_fit`; 0: no limit beyond the
/// caps): may raise `args.buffers_per_block` (a limit below [`TARGET_BLOCKS`] aims the buffer
/// groups at it), then cuts grid y to the limit when it alone reaches it (grid x = 1), else
/// grid x to `limit / grid y`. `x * y <= max_blocks` always holds, and the kernel strides over
/// the rest, so the bytes do not depend on the limit.
pub fn fit(args: &mut KernelArgs, max_blocks: u32) -> (u32, u32) {
    if max_blocks != 0 && u64::from(max_blocks) < TARGET_BLOCKS {
        args.buffers_per_block = buffers_per_block_for(
            u64::from(args.num_tiles),
            u64::from(args.num_buffers),
            u64::from(max_blocks),
        );
    }
    let (x, y) = grid(args);
    if max_blocks == 0 || x == 0 || u64::from(x) * u64::from(y) <= u64::from(max_blocks) {
        return (x, y);
    }
    if y >= max_blocks {
        (1, max_blocks)
    } else {
        (max_blocks / y, y)
    }
}

/// The most blocks a launch uses: the caller's budget and the device's resident blocks (the
/// persistent grid), the smaller of those given (0: no limit from that side).
pub fn block_limit(budget: u32, resident: Option<u32>) -> u32 {
    match (budget, resident.filter(|&r| r != 0)) {
        (0, None) => 0,
        (0, Some(r)) => r,
        (b, None) => b,
        (b, Some(r)) => b.min(r),
    }
}

/// One piece of a rect, as the table keeps it (step 1 of the builder).
#[derive(Clone, Copy)]
struct Piece {
    src: u64,
    dst: u64,
    src_pitch: u64,
    dst_pitch: u64,
    width: u64,
    height: u64,
    unit_shift: u32,
}

/// A run being built.
struct Run {
    src_pitch: u64,
    dst_pitch: u64,
    width: u64,
    height: u64,
    rows: u64,
    unit_shift: u32,
    first_rect: u64,
}

/// `count` as a u32 field of the table, or [`Error::KernelTableTooLarge`].
fn field(what: &'static str, count: u64) -> Result<u32> {
    u32::try_from(count).map_err(|_| Error::KernelTableTooLarge { what, count })
}

/// A call's table, ready to launch: the kernel's argument (with the table inside when it fits)
/// and the table's bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelTable {
    args: KernelArgs,
    bytes: Vec<u8>,
    inline: bool,
    job_rects: usize,
    rows_per_buffer: u64,
}

impl KernelTable {
    /// The table of `job`: its rects and its buffer pairs.
    pub fn new(job: &CopyJob<'_>) -> Result<Self> {
        let bases: Vec<(u64, u64)> = job
            .buffers()
            .map(|(src, dst)| (src as u64, dst as u64))
            .collect();
        Self::build(job.rects(), &bases)
    }

    /// The table of `rects` for the buffer pairs `bases` (source, destination), step for step
    /// as `hip/copy_table.hpp` builds it.
    pub fn build(rects: impl IntoIterator<Item = CopyRect>, bases: &[(u64, u64)]) -> Result<Self> {
        let num_buffers = field("buffers", bases.len() as u64)?;
        let base_bits = bases.iter().fold(0u64, |bits, &(s, d)| bits | s | d);

        // 1. Pieces: no empty rects, rows of at most MAX_WIDTH bytes, at most MAX_RUN_ROWS rows,
        //    pitches 0 for one row, and each piece's unit. A piece whose unit is below 16 bytes,
        //    at least SPLIT_MIN_WIDTH wide, with every base and both pitches 16-byte aligned and
        //    its source and destination rows equally misaligned, becomes a head (to the next
        //    16-byte boundary), a body of 16-byte units and a tail; the bodies stay in order,
        //    the heads and tails follow every other piece.
        let (mut job_rects, mut rows_per_buffer) = (0usize, 0u64);
        let mut pieces = Vec::new();
        let mut edges = Vec::new();
        for r in rects {
            job_rects += 1;
            rows_per_buffer = rows_per_buffer.saturating_add(r.height);
            if r.width == 0 || r.height == 0 {
                continue;
            }
            let mut row = 0;
            while row < r.height {
                let height = (r.height - row).min(MAX_RUN_ROWS);
                let mut col = 0;
                while col < r.width {
                    let (src_pitch, dst_pitch) = if height == 1 {
                        (0, 0)
                    } else {
                        (r.src_pitch, r.dst_pitch)
                    };
                    let src = r
                        .src_offset
                        .wrapping_add(row.wrapping_mul(r.src_pitch))
                        .wrapping_add(col);
                    let dst = r
                        .dst_offset
                        .wrapping_add(row.wrapping_mul(r.dst_pitch))
                        .wrapping_add(col);
                    let width = (r.width - col).min(MAX_WIDTH);
                    let piece = |src: u64, dst: u64, width: u64| {
                        let bits = base_bits | width | src | dst | src_pitch | dst_pitch;
                        Piece {
                            src,
                            dst,
                            src_pitch,
                            dst_pitch,
                            width,
                            height,
                            unit_shift: bits.trailing_zeros().min(4),
                        }
                    };
                    let whole = piece(src, dst, width);
                    let head = (16 - src % 16) % 16;
                    if whole.unit_shift < 4
                        && width >= SPLIT_MIN_WIDTH
                        && base_bits % 16 == 0
                        && (src_pitch | dst_pitch) % 16 == 0
                        && src % 16 == dst % 16
                    {
                        // Head, 16-byte body, tail: the body in the main list, the edges after
                        // every piece (so that the bodies of like rects still form one run).
                        let body = (width - head) & !15;
                        pieces.push(piece(src + head, dst + head, body));
                        if head > 0 {
                            edges.push(piece(src, dst, head));
                        }
                        let tail = width - head - body;
                        if tail > 0 {
                            let at = head + body;
                            edges.push(piece(src + at, dst + at, tail));
                        }
                    } else {
                        pieces.push(whole);
                    }
                    col += MAX_WIDTH;
                }
                row += MAX_RUN_ROWS;
            }
        }
        pieces.extend(edges);

        // 2. Runs: a piece joins the run before it when it has the run's width and unit and
        //    one height divides the other at most MAX_RUN_SPLIT times: the taller side is cut
        //    into rects of the smaller height (the run's rects, retroactively, when the piece is
        //    the shorter), and for a height above one row their pitches must agree.
        let mut runs: Vec<Run> = Vec::new();
        let mut offsets: Vec<(u64, u64)> = Vec::new();
        for p in pieces {
            let height = runs.last().and_then(|run| {
                let same = p.width == run.width
                    && p.unit_shift == run.unit_shift
                    && run.rows + p.height <= MAX_RUN_ROWS;
                let pitches = p.src_pitch == run.src_pitch && p.dst_pitch == run.dst_pitch;
                if !same {
                    None
                } else if p.height % run.height == 0
                    && p.height / run.height <= MAX_RUN_SPLIT
                    && (run.height == 1 || pitches)
                {
                    Some(run.height)
                } else if run.height % p.height == 0
                    && run.height / p.height <= MAX_RUN_SPLIT
                    && (p.height == 1 || pitches)
                {
                    Some(p.height)
                } else {
                    None
                }
            });
            let Some(height) = height else {
                runs.push(Run {
                    src_pitch: p.src_pitch,
                    dst_pitch: p.dst_pitch,
                    width: p.width,
                    height: p.height,
                    rows: p.height,
                    unit_shift: p.unit_shift,
                    first_rect: offsets.len() as u64,
                });
                offsets.push((p.src, p.dst));
                continue;
            };
            let run = runs.last_mut().expect("a run to join");
            if height < run.height {
                // Cut the run's rects into rects of the piece's height.
                let (k, src_pitch, dst_pitch) = (run.height / height, run.src_pitch, run.dst_pitch);
                let cut: Vec<(u64, u64)> = offsets
                    .drain(run.first_rect as usize..)
                    .flat_map(|(src, dst)| {
                        (0..k).map(move |j| {
                            (
                                src.wrapping_add((j * height).wrapping_mul(src_pitch)),
                                dst.wrapping_add((j * height).wrapping_mul(dst_pitch)),
                            )
                        })
                    })
                    .collect();
                offsets.extend(cut);
                run.height = height;
                if height == 1 {
                    (run.src_pitch, run.dst_pitch) = (0, 0);
                }
            }
            for j in 0..p.height / height {
                offsets.push((
                    p.src.wrapping_add((j * height).wrapping_mul(p.src_pitch)),
                    p.dst.wrapping_add((j * height).wrapping_mul(p.dst_pitch)),
                ));
            }
            run.rows += p.height;
        }
        let num_rects = field("rects", offsets.len() as u64)?;

        // 3. Offsets: shifted right by their common trailing zeros; two u32 when they all fit.
        let all = offsets.iter().fold(0u64, |bits, &(s, d)| bits | s | d);
        let offset_shift = if all == 0 { 0 } else { all.trailing_zeros() };
        let wide = offsets.iter().any(|&(s, d)| {
            (s >> offset_shift) > u64::from(u32::MAX) || (d >> offset_shift) > u64::from(u32::MAX)
        });

        // 4. Tiles of each run, numbered across runs.
        let mut tiles = 0u64;
        let mut first_tiles = Vec::with_capacity(runs.len());
        for run in &runs {
            let units = (run.width >> run.unit_shift) as u32;
            first_tiles.push(tiles);
            tiles +=
                run.rows.div_ceil(u64::from(rows_per_tile(units))) * u64::from(col_chunks(units));
            field("tiles", tiles)?;
        }

        // 5. The layout: bases, runs, the tiles' runs (more than one run), rect offsets.
        let runs_at = 16 * u64::from(num_buffers);
        let tile_runs_at = runs_at + (RUN_BYTES * runs.len()) as u64;
        let tile_runs_bytes = if runs.len() > 1 {
            (4 * tiles).div_ceil(8) * 8
        } else {
            0
        };
        let rects_at = tile_runs_at + tile_runs_bytes;
        let table_bytes = rects_at + if wide { 16 } else { 8 } * offsets.len() as u64;
        let table_bytes32 = field("bytes", table_bytes)?;

        let mut bytes = vec![0u8; table_bytes as usize];
        let put_u64 = |b: &mut [u8], at: u64, v: u64| {
            b[at as usize..at as usize + 8].copy_from_slice(&v.to_le_bytes())
        };
        let put_u32 = |b: &mut [u8], at: u64, v: u32| {
            b[at as usize..at as usize + 4].copy_from_slice(&v.to_le_bytes())
        };
        for (i, &(src, dst)) in bases.iter().enumerate() {
            put_u64(&mut bytes, 8 * i as u64, src);
            put_u64(&mut bytes, 8 * (bases.len() + i) as u64, dst);
        }
        for (i, run) in runs.iter().enumerate() {
            let units = (run.width >> run.unit_shift) as u32;
            let at = runs_at + (RUN_BYTES * i) as u64;
            put_u64(&mut bytes, at, run.src_pitch);
            put_u64(&mut bytes, at + 8, run.dst_pitch);
            put_u32(&mut bytes, at + 16, run.first_rect as u32);
            put_u32(&mut bytes, at + 20, run.rows as u32);
            put_u32(&mut bytes, at + 24, run.height as u32);
            put_u32(&mut bytes, at + 28, units);
            put_u32(&mut bytes, at + 32, rows_per_tile(units));
            put_u32(&mut bytes, at + 36, col_chunks(units));
            put_u32(&mut bytes, at + 40, first_tiles[i] as u32);
            put_u32(&mut bytes, at + 44, run.unit_shift);
            if runs.len() > 1 {
                let end = first_tiles.get(i + 1).copied().unwrap_or(tiles);
                for t in first_tiles[i]..end {
                    put_u32(&mut bytes, tile_runs_at + 4 * t, i as u32);
                }
            }
        }
        for (i, &(src, dst)) in offsets.iter().enumerate() {
            let (src, dst) = (src >> offset_shift, dst >> offset_shift);
            if wide {
                put_u64(&mut bytes, rects_at + 16 * i as u64, src);
                put_u64(&mut bytes, rects_at + 16 * i as u64 + 8, dst);
            } else {
                put_u64(&mut bytes, rects_at + 8 * i as u64, src | dst << 32);
            }
        }

        let inline = bytes.len() <= INLINE_TABLE_BYTES;
        let mut args = KernelArgs {
            table: 0,
            table_bytes: table_bytes32,
            num_buffers,
            buffers_per_block: buffers_per_block(tiles, u64::from(num_buffers)),
            num_runs: runs.len() as u32,
            num_tiles: tiles as u32,
            num_rects,
            runs_at: runs_at as u32,
            tile_runs_at: tile_runs_at as u32,
            rects_at: rects_at as u32,
            flags: if wide { WIDE_OFFSETS } else { 0 },
            offset_shift,
            ..KernelArgs::default()
        };
        if inline {
            fill_words(&mut args.inline_table, &bytes);
        }
        Ok(KernelTable {
            args,
            bytes,
            inline,
            job_rects,
            rows_per_buffer,
        })
    }

    /// Buffer pairs in the table.
    pub fn num_buffers(&self) -> usize {
        self.args.num_buffers as usize
    }

    /// The call's rects per buffer (before the table joins or cuts any).
    pub fn num_rects(&self) -> usize {
        self.job_rects
    }

    /// The call's rows per buffer.
    pub fn rows_per_buffer(&self) -> u64 {
        self.rows_per_buffer
    }

    /// True when the table travels inside the kernel's 4 KiB argument: nothing to upload, and
    /// the launch holds everything the kernel reads besides the caller's buffers. (A bigger
    /// table may still travel inside the wide entry's argument: [`KernelTable::fits_wide`].)
    pub fn is_inline(&self) -> bool {
        self.inline
    }

    /// The whole table as the kernel reads it (inside the argument or uploaded).
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Bytes of the whole table, wherever it travels.
    pub fn table_len(&self) -> usize {
        self.bytes.len()
    }

    /// Bytes to upload before the launch: 0 when the table is inside the argument.
    pub fn byte_len(&self) -> usize {
        if self.inline { 0 } else { self.bytes.len() }
    }

    /// Writes the bytes to upload into `out` (at least [`KernelTable::byte_len`] bytes).
    pub fn write_to(&self, out: &mut [u8]) {
        let len = self.byte_len();
        out[..len].copy_from_slice(&self.bytes[..len]);
    }

    /// The kernel's argument once the uploaded table is at device address `table` (ignored
    /// when the table is inside the argument).
    pub fn args(&self, table: u64) -> KernelArgs {
        KernelArgs {
            table: if self.inline { 0 } else { table },
            ..self.args
        }
    }

    /// The launch's grid (x over tiles, y over buffer groups) with no block limit; `(0, 0)`:
    /// nothing to launch.
    pub fn grid(&self) -> (u32, u32) {
        grid(&self.args)
    }

    /// The kernel's argument and grid for a launch of at most `max_blocks` blocks (0: no limit;
    /// see [`fit`]), with the uploaded table at `table` (ignored when inline).
    pub fn launch(&self, table: u64, max_blocks: u32) -> (KernelArgs, (u32, u32)) {
        let mut args = self.args(table);
        let grid = fit(&mut args, max_blocks);
        (args, grid)
    }

    /// True when the table fits inside the wide entry's argument ([`WIDE_INLINE_TABLE_BYTES`]).
    pub fn fits_wide(&self) -> bool {
        self.bytes.len() <= WIDE_INLINE_TABLE_BYTES
    }

    /// The wide entry's argument, with the whole table inside it, and the grid, for a launch of
    /// at most `max_blocks` blocks (as [`KernelTable::launch`]); None when the table does not fit
    /// ([`KernelTable::fits_wide`]).
    pub fn launch_wide(&self, max_blocks: u32) -> Option<(Box<WideKernelArgs>, (u32, u32))> {
        if !self.fits_wide() {
            return None;
        }
        let mut header = KernelArgs {
            table: 0,
            inline_table: [0; INLINE_TABLE_BYTES / 8],
            ..self.args
        };
        let grid = fit(&mut header, max_blocks);
        Some((Box::new(header.with_room(&self.bytes)), grid))
    }
}

/// One (buffer, rect) of a table as the kernel reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableRect {
    /// Buffer pair index.
    pub buffer: usize,
    /// Source base address.
    pub src_base: u64,
    /// Destination base address.
    pub dst_base: u64,
    /// The rect, relative to the bases.
    pub rect: CopyRect,
}

/// Every (buffer, rect) of the table `table` (`args.table_bytes` bytes: the uploaded copy, or
/// the argument's `inline_table` as bytes) describes, run by run, as the kernel reads them; None
/// when an entry lies outside `table`. (Tests check launches with it.)
pub fn decode<const WORDS: usize>(
    args: &KernelArgsOf<WORDS>,
    table: &[u8],
) -> Option<Vec<TableRect>> {
    let u64_at = |at: u64| -> Option<u64> {
        let at = usize::try_from(at).ok()?;
        Some(u64::from_le_bytes(table.get(at..at + 8)?.try_into().ok()?))
    };
    let u32_at = |at: u64| -> Option<u32> {
        let at = usize::try_from(at).ok()?;
        Some(u32::from_le_bytes(table.get(at..at + 4)?.try_into().ok()?))
    };
    let nb = u64::from(args.num_buffers);
    let mut out = Vec::new();
    for run in 0..u64::from(args.num_runs) {
        let at = u64::from(args.runs_at) + RUN_BYTES as u64 * run;
        let (src_pitch, dst_pitch) = (u64_at(at)?, u64_at(at + 8)?);
        let (first_rect, rows, height) = (u32_at(at + 16)?, u32_at(at + 20)?, u32_at(at + 24)?);
        let (units, unit_shift) = (u32_at(at + 28)?, u32_at(at + 44)?);
        for i in 0..rows.checked_div(height).unwrap_or(0) {
            let rect = u64::from(first_rect) + u64::from(i);
            let (src, dst) = if args.flags & WIDE_OFFSETS != 0 {
                let at = u64::from(args.rects_at) + 16 * rect;
                (u64_at(at)?, u64_at(at + 8)?)
            } else {
                let both = u64_at(u64::from(args.rects_at) + 8 * rect)?;
                (both & 0xffff_ffff, both >> 32)
            };
            for b in 0..nb {
                out.push(TableRect {
                    buffer: b as usize,
                    src_base: u64_at(8 * b)?,
                    dst_base: u64_at(8 * (nb + b))?,
                    rect: CopyRect {
                        src_offset: src << args.offset_shift,
                        dst_offset: dst << args.offset_shift,
                        src_pitch,
                        dst_pitch,
                        width: u64::from(units) << unit_shift,
                        height: u64::from(height),
                    },
                });
            }
        }
    }
    Some(out)
}

/// The inline table of `args` as bytes (what [`decode`] reads when `args.table` is 0).
pub fn inline_bytes<const WORDS: usize>(args: &KernelArgsOf<WORDS>) -> Vec<u8> {
    args.inline_table
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect()
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

/// The kernel as PTX for NVIDIA GPUs (built by build.rs from hip/copy_kernel.hip with clang for
/// NVPTX, feature `cuda`): NUL-terminated text for `cuModuleLoadData`, which JIT-compiles it for
/// the GPU at hand; its entry is [`KERNEL_NAME`] with one [`ARGS_BYTES`]-byte parameter.
#[cfg(feature = "cuda")]
pub(crate) static COPY_KERNEL_PTX: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/copy_kernel.ptx"));

/// The kernel as SASS (cubins from `ptxas` at build time, when build.rs found one) for each
/// `(name, compute capability * 10)`: empty where the build had no ptxas, and then the driver
/// JIT-compiles [`COPY_KERNEL_PTX`] at first use. `LibCuda` loads the cubin of the device's
/// major version with the highest minor version not above the device's.
#[cfg(feature = "cuda")]
pub(crate) static COPY_KERNEL_CUBINS: [(&str, u32, &[u8]); 2] = [
    (
        "sm_90 SASS",
        90,
        include_bytes!(concat!(env!("OUT_DIR"), "/copy_kernel.sm_90.cubin")),
    ),
    (
        "sm_100 SASS",
        100,
        include_bytes!(concat!(env!("OUT_DIR"), "/copy_kernel.sm_100.cubin")),
    ),
];

/// The wide entry ([`WIDE_KERNEL_NAME`], one [`WIDE_ARGS_BYTES`]-byte parameter) as PTX of
/// ISA 8.1, a module of its own that only CUDA 12.1+ drivers load (build.rs,
/// `build_wide_ptx`): NUL-terminated text for `cuModuleLoadData`.
#[cfg(feature = "cuda")]
pub(crate) static COPY_KERNEL_WIDE_PTX: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/copy_kernel_wide.ptx"));

/// The wide entry as SASS, as [`COPY_KERNEL_CUBINS`] holds the main one (empty without ptxas at
/// build time: the driver JIT-compiles [`COPY_KERNEL_WIDE_PTX`]).
#[cfg(feature = "cuda")]
pub(crate) static COPY_KERNEL_WIDE_CUBINS: [(&str, u32, &[u8]); 2] = [
    (
        "sm_90 SASS",
        90,
        include_bytes!(concat!(env!("OUT_DIR"), "/copy_kernel_wide.sm_90.cubin")),
    ),
    (
        "sm_100 SASS",
        100,
        include_bytes!(concat!(env!("OUT_DIR"), "/copy_kernel_wide.sm_100.cubin")),
    ),
];

/// The virtual architecture [`COPY_KERNEL_WIDE_PTX`] targets (sm_70, or `MORI_TP_PTX_ARCH`
/// when that is newer).
#[cfg(feature = "cuda")]
pub(crate) const WIDE_PTX_ARCH: &str = env!("MORI_TP_WIDE_PTX_ARCH");

/// The cubin of `cubins` (name, compute capability * 10, image) for a device of compute
/// capability `cc` (* 10): of the device's major version, the highest minor version not above
/// the device's (SASS runs on GPUs of its major version and a minor version at least its own);
/// empty images (no ptxas at build time) never. None: load the PTX.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub fn pick_cubin<'a>(cc: u32, cubins: &[(&'a str, u32, &'a [u8])]) -> Option<(&'a str, &'a [u8])> {
    cubins
        .iter()
        .filter(|(_, sm, image)| !image.is_empty() && sm / 10 == cc / 10 && *sm <= cc)
        .max_by_key(|(_, sm, _)| *sm)
        .map(|&(name, _, image)| (name, image))
}

/// The virtual architecture [`COPY_KERNEL_PTX`] targets (`sm_70` unless the build set
/// `MORI_TP_PTX_ARCH`).
#[cfg(feature = "cuda")]
pub(crate) const PTX_ARCH: &str = env!("MORI_TP_PTX_ARCH");

#[cfg(test)]
mod tests {
    use super::*;

    /// The embedded PTX: NUL-terminated text (cuModuleLoadData reads a C string), for the
    /// build's architecture, declaring the kernel's entry with its 4 KiB argument and the block
    /// size it is built for, and reading that argument in place: no per-thread copy of it to
    /// local memory (a `__local_depot`), which would cost 4 KiB of stores per thread.
    #[cfg(feature = "cuda")]
    #[test]
    fn the_embedded_ptx_declares_the_kernel_entry_with_its_argument() {
        let ptx = COPY_KERNEL_PTX;
        assert!(ptx.len() > 1000, "{} bytes of PTX", ptx.len());
        assert_eq!(ptx.last(), Some(&0), "NUL-terminated");
        assert_eq!(
            ptx.iter().filter(|&&b| b == 0).count(),
            1,
            "one NUL, at the end"
        );
        let text = std::str::from_utf8(&ptx[..ptx.len() - 1]).expect("PTX is text");
        let name = KERNEL_NAME.to_str().unwrap();
        assert!(text.contains(&format!(".visible .entry {name}(")), "{text}");
        let param = format!(".b8 {name}_param_0[{}]", std::mem::size_of::<KernelArgs>());
        assert!(text.contains(&param), "no {param:?} in the entry");
        assert!(
            !text.contains(&format!("{name}_param_1")),
            "one parameter only"
        );
        assert!(text.contains(&format!(".target {PTX_ARCH}")), "{PTX_ARCH}");
        assert!(text.contains(&format!(".maxntid {BLOCK_THREADS}, 1, 1")));
        assert!(
            !text.contains("__local_depot"),
            "the argument is copied to local memory"
        );
        assert!(text.contains("ld.global.v4.u32") && text.contains("st.global.v4.u32"));
    }

    /// The wide module: the wide entry alone, with its one 32,760-byte parameter, PTX ISA 8.1
    /// (what parameters beyond 4 KiB need), for sm_70 or newer, its argument read in place.
    #[cfg(feature = "cuda")]
    #[test]
    fn the_embedded_wide_ptx_declares_the_wide_entry_alone_with_its_32760_byte_argument() {
        let ptx = COPY_KERNEL_WIDE_PTX;
        assert_eq!(ptx.last(), Some(&0), "NUL-terminated");
        assert_eq!(ptx.iter().filter(|&&b| b == 0).count(), 1, "one NUL");
        let text = std::str::from_utf8(&ptx[..ptx.len() - 1]).expect("PTX is text");
        let name = WIDE_KERNEL_NAME.to_str().unwrap();
        assert!(text.contains(&format!(".visible .entry {name}(")), "{text}");
        let param = format!(
            ".b8 {name}_param_0[{}]",
            std::mem::size_of::<WideKernelArgs>()
        );
        assert!(text.contains(&param), "no {param:?} in the entry");
        assert!(!text.contains(&format!("{name}_param_1")), "one parameter");
        let main = KERNEL_NAME.to_str().unwrap();
        assert!(
            !text.contains(&format!(".entry {main}(")),
            "the main entry is in the main module only"
        );
        let version = text
            .lines()
            .find_map(|l| l.trim().strip_prefix(".version "))
            .expect("a .version line");
        assert_eq!(version.trim(), "8.1");
        assert!(text.contains(&format!(".target {WIDE_PTX_ARCH}")));
        let sm: u32 = WIDE_PTX_ARCH
            .trim_start_matches("sm_")
            .trim_end_matches(|c: char| c.is_ascii_alphabetic())
            .parse()
            .expect("an sm_NN target");
        assert!(sm >= 70, "{WIDE_PTX_ARCH}: large parameters need sm_70");
        assert!(
            !text.contains("__local_depot"),
            "the argument went to local memory"
        );
    }

    /// The cubins build.rs embedded: ELF images of the kernel for their compute capability, or
    /// empty where the build had no ptxas, which MORI_TP_REQUIRE_TOOLS=1 (CI, which installs
    /// PyPI's nvidia-cuda-nvcc-cu12) makes a failure.
    #[cfg(feature = "cuda")]
    #[test]
    fn the_embedded_cubins_are_the_kernel_for_sm_90_and_sm_100_when_ptxas_was_present() {
        use std::io::Write;
        let required = std::env::var_os("MORI_TP_REQUIRE_TOOLS").is_some_and(|v| v == "1");
        let cubins = COPY_KERNEL_CUBINS
            .iter()
            .map(|&(name, sm, image)| (name, sm, image, KERNEL_NAME))
            .chain(
                COPY_KERNEL_WIDE_CUBINS
                    .iter()
                    .map(|&(name, sm, image)| (name, sm, image, WIDE_KERNEL_NAME)),
            );
        for (name, sm, image, entry) in cubins {
            if image.is_empty() {
                assert!(
                    !required,
                    "{name}: no cubin embedded, and MORI_TP_REQUIRE_TOOLS=1 (set MORI_TP_PTXAS \
                     to a ptxas, e.g. from pip install nvidia-cuda-nvcc-cu12)"
                );
                let _ = writeln!(
                    std::io::stderr(),
                    "skipped the {name} cubin check: built without ptxas"
                );
                continue;
            }
            assert!(image.starts_with(b"\x7fELF"), "{name}: not an ELF image");
            // The entry's name with its NUL (the wide name begins with the main one's).
            let kernel = entry.to_bytes_with_nul();
            assert!(
                image.windows(kernel.len()).any(|w| w == kernel),
                "{name}: no {entry:?} in the cubin"
            );
            // The ELF header's e_flags (offset 48) hold the SM number in their low byte (cubins
            // of CUDA 12.x; from CUDA 12.8, sm_100's too).
            let flags = u32::from_le_bytes(image[48..52].try_into().unwrap());
            assert!(
                flags & 0xff == sm || (flags >> 8) & 0xff == sm,
                "{name}: e_flags {flags:#x} name another SM"
            );
        }
    }

    /// `ptxas`: `MORI_TP_PTXAS`, else on PATH, else in a CUDA toolkit's usual places; None
    /// without one.
    #[cfg(feature = "cuda")]
    fn ptxas() -> Option<std::path::PathBuf> {
        if let Some(named) = std::env::var_os("MORI_TP_PTXAS") {
            return Some(named.into());
        }
        let mut dirs: Vec<std::path::PathBuf> = std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).collect())
            .unwrap_or_default();
        if let Some(cuda) = std::env::var_os("CUDA_HOME") {
            dirs.push(std::path::Path::new(&cuda).join("bin"));
        }
        dirs.push("/usr/local/cuda/bin".into());
        dirs.push("/usr/lib/nvidia-cuda-toolkit/bin".into());
        dirs.into_iter()
            .map(|d| d.join("ptxas"))
            .find(|p| p.is_file())
    }

    /// Optional (no CUDA toolkit in CI): the embedded PTX, the main module's and the wide
    /// entry's, assembles with the toolkit's `ptxas` for an H200's sm_90 (and for the PTX's own
    /// target), with the argument read in place: no stack frame and no spills. Without ptxas the test says so on stderr and passes; the
    /// driver's JIT on a GPU does the same assembly at `cuModuleLoadData`.
    #[cfg(feature = "cuda")]
    #[test]
    fn the_embedded_ptx_assembles_for_sm_90_with_ptxas_when_a_toolkit_is_present() {
        use std::io::Write;
        let Some(ptxas) = ptxas() else {
            let _ = writeln!(
                std::io::stderr(),
                "skipped the_embedded_ptx_assembles_for_sm_90_...: no ptxas (set MORI_TP_PTXAS, \
                 or put a CUDA toolkit's bin on PATH)"
            );
            return;
        };
        let dir = std::env::temp_dir().join(format!("mori-tp-ptxas-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        // The main module and the wide one (PTX ISA 8.1, a 32,760-byte parameter).
        for (ptx, name, own_arch) in [
            (COPY_KERNEL_PTX, KERNEL_NAME, PTX_ARCH),
            (COPY_KERNEL_WIDE_PTX, WIDE_KERNEL_NAME, WIDE_PTX_ARCH),
        ] {
            let name = name.to_str().unwrap();
            let source = dir.join(format!("{name}.ptx"));
            // The text without its NUL (ptxas reads a file).
            std::fs::write(&source, &ptx[..ptx.len() - 1]).expect("write");
            for arch in ["sm_90", "sm_100", own_arch] {
                let cubin = dir.join(format!("{name}.{arch}.cubin"));
                let output = std::process::Command::new(&ptxas)
                    .args([&format!("-arch={arch}"), "-v", "-o"])
                    .arg(&cubin)
                    .arg(&source)
                    .output()
                    .unwrap_or_else(|e| panic!("cannot run {}: {e}", ptxas.display()));
                let text = format!(
                    "{}{}",
                    String::from_utf8_lossy(&output.stdout),
                    String::from_utf8_lossy(&output.stderr)
                );
                // sm_100 needs ptxas 12.8 or later: an older one does not know the name.
                if arch == "sm_100" && !output.status.success() && text.contains("not defined") {
                    let _ = writeln!(
                        std::io::stderr(),
                        "skipped sm_100 in the_embedded_ptx_assembles_...: {} predates it",
                        ptxas.display()
                    );
                    continue;
                }
                assert!(
                    output.status.success(),
                    "{} -arch={arch} refused the PTX:\n{text}",
                    ptxas.display()
                );
                assert!(
                    text.contains(&format!("Compiling entry function '{name}' for '{arch}'")),
                    "{text}"
                );
                assert!(
                    text.contains("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"),
                    "the argument or registers went to local memory on {arch}:\n{text}"
                );
                assert!(
                    std::fs::metadata(&cubin).is_ok_and(|m| m.len() > 0),
                    "{arch}: no cubin"
                );
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn rect(src: u64, dst: u64, sp: u64, dp: u64, width: u64, height: u64) -> CopyRect {
        CopyRect {
            src_offset: src,
            dst_offset: dst,
            src_pitch: sp,
            dst_pitch: dp,
            width,
            height,
        }
    }

    /// Every byte a list of (src base, dst base, rect) moves, as (source row start, destination
    /// row start, bytes) segments, sorted and with segments that continue each other joined: the
    /// same for two lists exactly when they move the same bytes to the same places.
    fn segments(rects: impl IntoIterator<Item = (u64, u64, CopyRect)>) -> Vec<(u64, u64, u64)> {
        let mut rows: Vec<(u64, u64, u64)> = Vec::new();
        for (s, d, r) in rects {
            for i in 0..r.height {
                rows.push((
                    s.wrapping_add(r.src_offset + i * r.src_pitch),
                    d.wrapping_add(r.dst_offset + i * r.dst_pitch),
                    r.width,
                ));
            }
        }
        rows.sort_unstable();
        let mut joined: Vec<(u64, u64, u64)> = Vec::new();
        for (s, d, w) in rows.into_iter().filter(|r| r.2 > 0) {
            match joined.last_mut() {
                Some(last) if last.0 + last.2 == s && last.1 + last.2 == d => last.2 += w,
                _ => joined.push((s, d, w)),
            }
        }
        joined
    }

    /// Builds the table of `rects` for `bases`, decodes it as the kernel reads it, and checks
    /// it moves exactly the bytes of the rects; returns the table.
    fn round_trip(rects: &[CopyRect], bases: &[(u64, u64)]) -> KernelTable {
        let table = KernelTable::build(rects.iter().copied(), bases).expect("a table");
        let args = table.args(0x1000);
        let bytes = if table.is_inline() {
            assert_eq!(args.table, 0);
            inline_bytes(&args)
        } else {
            assert_eq!(args.table, 0x1000);
            table.bytes().to_vec()
        };
        let decoded = decode(&args, &bytes).expect("every entry inside the table");
        let want = segments(
            bases
                .iter()
                .flat_map(|&(s, d)| rects.iter().map(move |&r| (s, d, r))),
        );
        let got = segments(decoded.iter().map(|t| (t.src_base, t.dst_base, t.rect)));
        assert_eq!(got, want, "{rects:?}");
        table
    }

    #[test]
    fn a_device_gets_the_cubin_of_its_major_version_not_above_its_minor_or_none() {
        let (a, b, c): (&[u8], &[u8], &[u8]) = (b"90", b"100", b"103");
        let cubins = [("sm_90", 90, a), ("sm_100", 100, b), ("sm_103", 103, c)];
        assert_eq!(pick_cubin(90, &cubins), Some(("sm_90", a)));
        assert_eq!(pick_cubin(100, &cubins), Some(("sm_100", b)));
        assert_eq!(pick_cubin(101, &cubins), Some(("sm_100", b)));
        assert_eq!(pick_cubin(103, &cubins), Some(("sm_103", c)));
        // Another major version (sm_80, sm_120), or a cubin newer than the device: the PTX.
        assert_eq!(pick_cubin(80, &cubins), None);
        assert_eq!(pick_cubin(120, &cubins), None);
        assert_eq!(pick_cubin(89, &cubins), None);
        // A build without ptxas embeds empty cubins: never picked.
        let empty: [(&str, u32, &[u8]); 2] = [("sm_90", 90, b""), ("sm_100", 100, b"")];
        assert_eq!(pick_cubin(90, &empty), None);
    }

    #[test]
    fn the_argument_is_4_kib_with_a_64_byte_header() {
        assert_eq!(std::mem::size_of::<KernelArgs>(), ARGS_BYTES);
        assert_eq!(std::mem::offset_of!(KernelArgs, inline_table), 64);
        assert_eq!(INLINE_TABLE_BYTES, ARGS_BYTES - 64);
        assert_eq!(TILE_UNITS, BLOCK_THREADS * SLOTS_PER_THREAD);
    }

    /// The wide argument: the same 64-byte header, and the largest multiple of 8 bytes within
    /// the 32,764 bytes of parameters CUDA 12.1+ takes.
    #[test]
    fn the_wide_argument_is_the_largest_multiple_of_8_within_32764_bytes() {
        assert_eq!(std::mem::size_of::<WideKernelArgs>(), WIDE_ARGS_BYTES);
        assert_eq!(std::mem::offset_of!(WideKernelArgs, inline_table), 64);
        assert_eq!(WIDE_INLINE_TABLE_BYTES, WIDE_ARGS_BYTES - 64);
        // 32,764 bytes of parameters, rounded down to the argument's 8-byte alignment.
        assert_eq!(WIDE_ARGS_BYTES, 32_764 / 8 * 8);
    }

    /// A table too big for the 4 KiB argument but within the wide one travels whole inside the
    /// wide argument (table 0), with the header and grid of the ordinary launch; one entry past
    /// the wide room has no wide launch.
    #[test]
    fn a_table_between_the_two_rooms_travels_inside_the_wide_argument() {
        // One run of many one-row rects: the table is 16 bytes of bases, a run and 8 bytes a
        // rect; the rects go backwards so that none joins its neighbour.
        let table_of = |rects: u64| {
            let rects: Vec<CopyRect> = (0..rects)
                .map(|i| rect(64 * (rects - i), 64 * i, 0, 0, 32, 1))
                .collect();
            KernelTable::build(rects, &[(0x10_0000, 0x80_0000)]).expect("a table")
        };
        let room = (WIDE_INLINE_TABLE_BYTES - 16 - RUN_BYTES) / 8;
        let table = table_of(2500);
        assert!(
            !table.is_inline() && table.fits_wide(),
            "{}",
            table.table_len()
        );
        let (wide, grid) = table.launch_wide(0).expect("fits");
        let (narrow, narrow_grid) = table.launch(0xdead_0000, 0);
        assert_eq!((wide.table, narrow.table), (0, 0xdead_0000));
        assert_eq!(grid, narrow_grid);
        assert_eq!(
            (
                wide.num_rects,
                wide.num_tiles,
                wide.buffers_per_block,
                wide.table_bytes
            ),
            (
                narrow.num_rects,
                narrow.num_tiles,
                narrow.buffers_per_block,
                narrow.table_bytes
            )
        );
        let bytes = inline_bytes(&*wide);
        assert_eq!(&bytes[..table.table_len()], table.bytes());
        assert!(bytes[table.table_len()..].iter().all(|&b| b == 0));
        assert_eq!(
            decode(&*wide, &bytes),
            decode(&narrow, table.bytes()),
            "the kernel reads the same rects from either"
        );
        // A launch limit fits the wide header as it fits the narrow one.
        let (limited, limited_grid) = table.launch_wide(3).expect("fits");
        assert_eq!(limited_grid, table.launch(0, 3).1);
        assert_eq!(
            limited.buffers_per_block,
            table.launch(0, 3).0.buffers_per_block
        );
        // The last size that fits, and one rect more.
        let full = table_of(room as u64);
        assert_eq!(full.table_len(), WIDE_INLINE_TABLE_BYTES);
        assert!(full.launch_wide(0).is_some());
        let over = table_of(room as u64 + 1);
        assert_eq!(over.table_len(), WIDE_INLINE_TABLE_BYTES + 8);
        assert!(!over.fits_wide() && over.launch_wide(0).is_none());
    }

    #[test]
    fn tiles_hold_whole_rows_up_to_1024_units_and_column_chunks_beyond() {
        assert_eq!((rows_per_tile(16), col_chunks(16)), (64, 1));
        assert_eq!((rows_per_tile(9), col_chunks(9)), (113, 1));
        assert_eq!((rows_per_tile(1000), col_chunks(1000)), (1, 1));
        assert_eq!((rows_per_tile(1024), col_chunks(1024)), (1, 1));
        assert_eq!((rows_per_tile(1250), col_chunks(1250)), (1, 2));
        assert_eq!((rows_per_tile(1 << 30), col_chunks(1 << 30)), (1, 1 << 20));
    }

    #[test]
    fn blocks_take_several_buffers_when_tiles_times_buffers_exceed_the_target() {
        assert_eq!(buffers_per_block(64, 64), 2);
        assert_eq!(buffers_per_block(512, 64), 16);
        assert_eq!(buffers_per_block(3, 5), 1);
        assert_eq!(buffers_per_block(100_000, 3), 3);
        assert_eq!(buffers_per_block(0, 0), 1);
        let args = |tiles, buffers, per| KernelArgs {
            num_tiles: tiles,
            num_buffers: buffers,
            buffers_per_block: per,
            ..KernelArgs::default()
        };
        assert_eq!(grid(&args(5, 140_000, 1)), (5, MAX_GRID_Y));
        assert_eq!(grid(&args(1 << 31, 140_000, 16)), (MAX_GRID_X, 8750));
        assert_eq!(grid(&args(0, 3, 1)), (0, 0));
        assert_eq!(grid(&args(7, 0, 1)), (0, 0));
    }

    /// The shapes at 4096 tokens and 64 buffers: the table fits in the argument for
    /// contiguous pages and for 256 rects of 16 rows (nothing to upload), one run each, 64 tiles
    /// of 16 KiB, 2 buffers per block.
    #[test]
    fn the_common_shapes_are_one_run_and_fit_in_the_argument_when_small() {
        let bases: Vec<(u64, u64)> = (0..64u64)
            .map(|b| ((b + 1) << 30, (b + 100) << 30))
            .collect();
        let contiguous = [rect(0, 0, 1024, 256, 256, 4096)];
        let pages: Vec<CopyRect> = (0..256u64)
            .map(|i| {
                rect(
                    (i * 37 % 512) * 16384,
                    (i * 91 % 512) * 4096,
                    1024,
                    256,
                    256,
                    16,
                )
            })
            .collect();
        let rows: Vec<CopyRect> = (0..4096u64)
            .map(|i| {
                rect(
                    (i * 37 % 8192) * 1024,
                    (i * 91 % 8192) * 256,
                    1024,
                    256,
                    256,
                    1,
                )
            })
            .collect();
        for (name, rects, inline, bytes) in [
            ("contiguous", &contiguous[..], true, 1024 + 48 + 8),
            ("pages of 16", &pages[..], true, 1024 + 48 + 256 * 8),
            ("page size 1", &rows[..], false, 1024 + 48 + 4096 * 8),
        ] {
            let table = round_trip(rects, &bases);
            let args = table.args(0xdead_0000);
            assert_eq!(table.is_inline(), inline, "{name}");
            assert_eq!(table.bytes().len(), bytes, "{name}");
            assert_eq!(table.byte_len(), if inline { 0 } else { bytes }, "{name}");
            assert_eq!(
                (args.num_runs, args.num_tiles, args.buffers_per_block),
                (1, 64, 2),
                "{name}"
            );
            assert_eq!(table.grid(), (64, 32), "{name}");
            assert_eq!(table.num_rects(), rects.len(), "{name}");
            assert_eq!(table.rows_per_buffer(), 4096, "{name}");
            assert_eq!(args.flags, 0, "{name}: offsets fit in u32");
        }
    }

    #[test]
    fn heights_that_divide_each_other_join_one_run_as_rects_of_the_smaller_height() {
        let rects = [
            rect(0, 0, 64, 32, 32, 16),
            rect(4096, 8192, 64, 32, 32, 32),
            rect(16384, 32768, 64, 32, 32, 48),
            // Too many pieces (65 x 16 rows): a run of its own.
            rect(1 << 20, 1 << 20, 64, 32, 32, 16 * 65),
            // A partial page: its own run.
            rect(1 << 22, 1 << 22, 64, 32, 32, 5),
        ];
        let table = round_trip(&rects, &[(1 << 24, 1 << 25)]);
        let args = table.args(0);
        assert_eq!((args.num_runs, args.num_rects), (3, 6 + 1 + 1));
        // One-row rects take a taller rect of any pitch as one-row rects.
        let rows = [
            rect(0, 0, 0, 0, 48, 1),
            rect(96, 96, 0, 0, 48, 1),
            rect(1024, 2048, 96, 64, 48, 3),
        ];
        let table = round_trip(&rows, &[(1 << 24, 1 << 25)]);
        assert_eq!((table.args(0).num_runs, table.args(0).num_rects), (1, 5));
        // A shorter rect after a taller one cuts the run's rects to its height: 48, 16, 32 and
        // 16 rows (pages in runs of 3, 1, 2, 1) are one run of seven 16-row rects; then 5 rows
        // (a partial page) start a run, 3 rows another, and a one-row rect after the 3-row one
        // makes both one-row rects (four of them).
        let shrinking = [
            rect(0, 0, 64, 32, 32, 48),
            rect(1 << 16, 1 << 16, 64, 32, 32, 16),
            rect(1 << 17, 1 << 17, 64, 32, 32, 32),
            rect(3 << 16, 3 << 16, 64, 32, 32, 16),
            rect(1 << 18, 1 << 18, 64, 32, 32, 5),
            rect(1 << 19, 1 << 19, 64, 32, 32, 3),
            rect(1 << 20, 1 << 20, 0, 0, 32, 1),
        ];
        let table = round_trip(&shrinking, &[(1 << 24, 1 << 25)]);
        let args = table.args(0);
        assert_eq!((args.num_runs, args.num_rects), (3, 7 + 1 + 4));
    }

    #[test]
    fn units_follow_the_alignment_of_rows_pitches_and_every_base() {
        // The unit of the table's one run.
        let unit = |rects: &[CopyRect], bases: &[(u64, u64)]| {
            let table = round_trip(rects, bases);
            assert_eq!(table.args(0).num_runs, 1);
            let at = table.args(0).runs_at as usize + 44;
            u32::from_le_bytes(table.bytes()[at..at + 4].try_into().unwrap())
        };
        let aligned = [(1 << 20, 1 << 21)];
        assert_eq!(unit(&[rect(0, 0, 512, 256, 256, 4)], &aligned), 4);
        assert_eq!(unit(&[rect(0, 0, 72, 72, 72, 4)], &aligned), 3);
        assert_eq!(unit(&[rect(4, 0, 512, 256, 256, 4)], &aligned), 2);
        // Below SPLIT_MIN_WIDTH an odd width keeps the whole row in its narrow unit.
        assert_eq!(unit(&[rect(0, 0, 126, 256, 256, 4)], &aligned), 1);
        assert_eq!(unit(&[rect(0, 0, 256, 256, 3, 4)], &aligned), 0);
        // A one-row rect ignores its pitches; a misaligned base of any buffer lowers the unit.
        assert_eq!(unit(&[rect(0, 0, 3, 5, 256, 1)], &aligned), 4);
        assert_eq!(
            unit(
                &[rect(0, 0, 512, 256, 256, 4)],
                &[(1 << 20, 1 << 21), (8, 16)]
            ),
            3
        );
    }

    /// (unit, width, rows) of each run of a table.
    fn run_shapes(table: &KernelTable) -> Vec<(u32, u64, u32)> {
        let args = table.args(0);
        (0..args.num_runs as usize)
            .map(|i| {
                let at = args.runs_at as usize + RUN_BYTES * i;
                let word = |o: usize| {
                    u32::from_le_bytes(table.bytes()[at + o..at + o + 4].try_into().unwrap())
                };
                let (units, unit) = (word(28), word(44));
                (unit, u64::from(units) << unit, word(20))
            })
            .collect()
    }

    /// Rows equally misaligned on both sides, or of an odd width, move in 16-byte units but
    /// for a head and a tail strip; the bodies of like rects stay one run, the strips follow.
    #[test]
    fn equally_misaligned_rows_and_odd_widths_move_in_16_byte_units_but_for_their_edges() {
        let aligned = [(1 << 20, 1 << 21), (1 << 22, 1 << 23)];
        // One-row rects at offsets 4 mod 16, 1000 bytes: heads of 12, bodies of 976, tails of
        // 12; page-size-1 rects of one shape stay one run of bodies.
        let rows: Vec<CopyRect> = (0..40u64)
            .map(|i| rect(4 + 2048 * i, 4 + 4096 * i, 0, 0, 1000, 1))
            .collect();
        let table = round_trip(&rows, &aligned);
        assert_eq!(
            run_shapes(&table),
            [(4, 976, 40), (2, 12, 80)],
            "bodies, then heads and tails (12 bytes each: one run of 4-byte units)"
        );
        // A tall rect of an odd width, pitches aligned: body and tail strips.
        let table = round_trip(&[rect(0, 0, 512, 1024, 510, 8)], &aligned);
        assert_eq!(run_shapes(&table), [(4, 496, 8), (1, 14, 8)]);
        // Different misalignment on the two sides, a misaligned pitch, a misaligned base, or a
        // row narrower than SPLIT_MIN_WIDTH: no split (the whole row in its common unit).
        for (rects, bases, unit) in [
            (vec![rect(4, 8, 0, 0, 1000, 1)], &aligned[..], 2),
            (vec![rect(0, 0, 1000, 1024, 512, 3)], &aligned[..], 3),
            (vec![rect(0, 0, 0, 0, 1000, 1)], &[(1 << 20, 3)][..], 0),
            (vec![rect(4, 4, 0, 0, 124, 1)], &aligned[..], 2),
        ] {
            let table = round_trip(&rects, bases);
            assert_eq!(run_shapes(&table).len(), 1, "{rects:?}");
            assert_eq!(run_shapes(&table)[0].0, unit, "{rects:?}");
        }
        // Odd sizes and offsets of every residue, seeded: always exactly the rects' bytes.
        let mut rng = mori_tp_testkit::Rng::new(45);
        for _ in 0..200 {
            let off = rng.range(0, 16);
            let rects: Vec<CopyRect> = (0..rng.range(0, 12))
                .map(|i| {
                    let width = rng.range(1, 700);
                    let height = rng.range(0, 5);
                    let pitch = width.div_ceil(16) * 16 * rng.range(1, 3);
                    rect(
                        off + (i << 16),
                        off + (i << 17),
                        pitch,
                        pitch,
                        width,
                        height,
                    )
                })
                .collect();
            round_trip(&rects, &aligned);
        }
    }

    /// A table of exactly INLINE_TABLE_BYTES travels in the argument; the next size a table
    /// can have (tables grow by 8 bytes) is uploaded.
    #[test]
    fn a_table_at_exactly_the_inline_limit_is_inline_and_one_entry_more_is_uploaded() {
        // 16 bytes of bases, one 48-byte run, 8 bytes per one-row rect: 496 rects is 4032.
        let rows = |n: u64| -> Vec<CopyRect> {
            (0..n)
                .map(|i| rect(512 * i, 1024 * i, 0, 0, 256, 1))
                .collect()
        };
        let bases = [(1 << 30, 1 << 31)];
        let at = round_trip(&rows(496), &bases);
        assert_eq!((at.table_len(), at.is_inline()), (INLINE_TABLE_BYTES, true));
        assert_eq!(at.byte_len(), 0, "nothing to upload");
        let over = round_trip(&rows(497), &bases);
        assert_eq!(
            (over.table_len(), over.is_inline()),
            (INLINE_TABLE_BYTES + 8, false)
        );
        assert_eq!(over.byte_len(), INLINE_TABLE_BYTES + 8);
    }

    #[test]
    fn the_launch_geometry_never_exceeds_the_block_limit() {
        assert_eq!(block_limit(0, None), 0);
        assert_eq!(block_limit(0, Some(264)), 264);
        assert_eq!(block_limit(4, Some(264)), 4);
        assert_eq!(block_limit(1000, Some(264)), 264);
        assert_eq!(block_limit(7, None), 7);
        assert_eq!(block_limit(7, Some(0)), 7);
        let args = |tiles, buffers| {
            let mut a = KernelArgs {
                num_tiles: tiles,
                num_buffers: buffers,
                ..KernelArgs::default()
            };
            a.buffers_per_block = buffers_per_block(u64::from(tiles), u64::from(buffers));
            a
        };
        // No limit: the table's own geometry.
        let mut a = args(64, 64);
        assert_eq!(fit(&mut a, 0), (64, 32));
        assert_eq!(a.buffers_per_block, 2);
        // A budget of 4: 16 buffers a block, 4 groups, one column of blocks.
        let mut a = args(64, 64);
        assert_eq!(fit(&mut a, 4), (1, 4));
        assert_eq!(a.buffers_per_block, 16);
        // A budget of 1: one block does everything.
        let mut a = args(64, 64);
        assert_eq!(fit(&mut a, 1), (1, 1));
        // The persistent grid of an H100-like device (132 SMs x 2 blocks): 15 buffers a block
        // (64 x 64 / 264), 5 groups, 52 columns.
        let mut a = args(64, 64);
        assert_eq!(fit(&mut a, 264), (52, 5));
        assert_eq!(a.buffers_per_block, 15);
        // A limit above what the table asks for changes nothing.
        let mut a = args(5, 3);
        assert_eq!(fit(&mut a, 70_000), (5, 3));
        // Seeded: x * y <= limit, and never 0 while there is something to copy.
        let mut rng = mori_tp_testkit::Rng::new(8);
        for _ in 0..2000 {
            let mut a = args(rng.range(0, 5000) as u32, rng.range(0, 200) as u32);
            let limit = rng.range(0, 3000) as u32;
            let (x, y) = fit(&mut a, limit);
            if a.num_tiles == 0 || a.num_buffers == 0 {
                assert_eq!((x, y), (0, 0));
                continue;
            }
            assert!(x >= 1 && y >= 1);
            if limit != 0 {
                assert!(u64::from(x) * u64::from(y) <= u64::from(limit));
            }
            assert!(a.buffers_per_block >= 1 && a.buffers_per_block <= 16);
        }
    }

    #[test]
    fn offsets_beyond_32_bits_after_the_shift_use_wide_entries() {
        let table = round_trip(&[rect(1 << 40, 3, 0, 0, 1, 1)], &[(1, 1)]);
        assert_eq!(table.args(0).flags, WIDE_OFFSETS);
        let table = round_trip(
            &[rect(1 << 40, 1 << 36, 0, 0, 16, 1)],
            &[(1 << 12, 1 << 12)],
        );
        assert_eq!((table.args(0).flags, table.args(0).offset_shift), (0, 36));
    }

    /// Rows wider than a table entry takes and rects taller than a run takes are cut; the
    /// table still moves exactly their bytes (decoded, never run: no such memory here).
    #[test]
    fn huge_rects_are_cut_into_entries_that_move_the_same_bytes() {
        let huge = [
            rect(0, 0, 0, 0, 3 * MAX_WIDTH + 16, 1),
            rect(1 << 40, 1 << 41, 64, 32, 32, MAX_RUN_ROWS + 5),
        ];
        let table = KernelTable::build(huge, &[(0, 1 << 44)]).expect("a table");
        let args = table.args(0x1000);
        let decoded = decode(&args, table.bytes()).expect("entries inside");
        assert!(decoded.iter().all(|t| t.rect.width <= MAX_WIDTH));
        let bytes: u64 = decoded.iter().map(|t| t.rect.width * t.rect.height).sum();
        assert_eq!(bytes, 3 * MAX_WIDTH + 16 + 32 * (MAX_RUN_ROWS + 5));
        // The same cut, small enough to compare byte for byte.
        round_trip(
            &[rect(7, 9, 0, 0, 100, 1), rect(0, 0, 512, 256, 256, 3)],
            &[(1 << 20, 1 << 21), (1 << 22, 1 << 23)],
        );
    }

    #[test]
    fn a_table_beyond_its_32_bit_fields_is_refused_with_the_count() {
        // 2^30-byte rows in bytes (misaligned base): 2^20 tiles a row, 2^13 rows.
        match KernelTable::build([rect(0, 0, 1 << 30, 1 << 30, 1 << 30, 1 << 13)], &[(1, 1)]) {
            Err(Error::KernelTableTooLarge { what, count }) => {
                assert_eq!((what, count), ("tiles", 1 << 33));
                let message = Error::KernelTableTooLarge { what, count }.to_string();
                assert!(message.contains("8589934592 tiles"), "{message}");
            }
            other => panic!("expected KernelTableTooLarge, got {other:?}"),
        }
    }

    #[test]
    fn empty_rects_and_empty_calls_launch_nothing() {
        let table = round_trip(&[rect(0, 0, 8, 8, 8, 0), rect(0, 0, 8, 8, 0, 4)], &[(8, 8)]);
        assert_eq!((table.grid(), table.args(0).num_runs), ((0, 0), 0));
        let table = round_trip(&[rect(0, 0, 8, 8, 8, 4)], &[]);
        assert_eq!(table.grid(), (0, 0));
    }

    /// Seeded random rect lists of every kind (widths 1..=300 and wide ones, any alignment,
    /// heights 0..=40 with repeats, one-row rects, many buffers) decode to exactly their bytes.
    #[test]
    fn random_tables_decode_to_exactly_the_rects_bytes() {
        let mut rng = mori_tp_testkit::Rng::new(31);
        for _ in 0..150 {
            let n = rng.range(0, 40) as usize;
            let shape = (rng.range(1, 300), rng.range(0, 3));
            let mut rects = Vec::new();
            for _ in 0..n {
                let same = rng.range(0, 3) != 0;
                let width = if same { shape.0 } else { rng.range(1, 2000) };
                let height = if same {
                    16 * rng.range(1, 3)
                } else {
                    rng.range(0, 40)
                };
                let align = 1u64 << shape.1;
                rects.push(rect(
                    rng.range(0, 1 << 24) * align,
                    rng.range(0, 1 << 24) * align,
                    width + rng.range(0, 64) * align,
                    width + rng.range(0, 64) * align,
                    width,
                    height,
                ));
            }
            let buffers = rng.range(0, 70);
            let bases: Vec<(u64, u64)> = (0..buffers)
                .map(|_| {
                    (
                        rng.range(1, 1 << 30) << rng.range(0, 5),
                        rng.range(1, 1 << 30) << 4,
                    )
                })
                .collect();
            round_trip(&rects, &bases);
        }
    }

    /// The header's `#define`s and struct fields, with their C offsets, against this module.
    #[test]
    fn the_rust_table_layout_matches_the_c_header() {
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
        for (name, value) in [
            ("MORI_COPY_BLOCK_THREADS", u64::from(BLOCK_THREADS)),
            ("MORI_COPY_SLOTS_PER_THREAD", u64::from(SLOTS_PER_THREAD)),
            ("MORI_COPY_TILE_UNITS", u64::from(TILE_UNITS)),
            ("MORI_COPY_MAX_GRID_X", u64::from(MAX_GRID_X)),
            ("MORI_COPY_MAX_GRID_Y", u64::from(MAX_GRID_Y)),
            ("MORI_COPY_TARGET_BLOCKS", TARGET_BLOCKS),
            ("MORI_COPY_MAX_BUFFERS_PER_BLOCK", MAX_BUFFERS_PER_BLOCK),
            ("MORI_COPY_MAX_RUN_SPLIT", MAX_RUN_SPLIT),
            ("MORI_COPY_MAX_WIDTH", MAX_WIDTH),
            ("MORI_COPY_MAX_RUN_ROWS", MAX_RUN_ROWS),
            ("MORI_COPY_ARGS_BYTES", ARGS_BYTES as u64),
            ("MORI_COPY_INLINE_TABLE_BYTES", INLINE_TABLE_BYTES as u64),
            ("MORI_COPY_WIDE_ARGS_BYTES", WIDE_ARGS_BYTES as u64),
            (
                "MORI_COPY_WIDE_INLINE_TABLE_BYTES",
                WIDE_INLINE_TABLE_BYTES as u64,
            ),
            ("MORI_COPY_RUN_BYTES", RUN_BYTES as u64),
            ("MORI_COPY_SPLIT_MIN_WIDTH", SPLIT_MIN_WIDTH),
            ("MORI_COPY_WIDE_OFFSETS", u64::from(WIDE_OFFSETS)),
        ] {
            assert_eq!(define(name), value, "{name}");
        }
        assert!(header.contains(&format!(
            "#define MORI_COPY_KERNEL_NAME \"{}\"",
            KERNEL_NAME.to_str().unwrap()
        )));
        assert!(header.contains(&format!(
            "#define MORI_COPY_WIDE_KERNEL_NAME \"{}\"",
            WIDE_KERNEL_NAME.to_str().unwrap()
        )));
        // The shared header of both argument structs, a macro's lines without their `\`.
        let shared: String = {
            let start = header
                .find("#define MORI_COPY_KERNEL_ARGS_HEADER")
                .expect("the argument header macro");
            let mut lines = Vec::new();
            for line in header[start..].lines().skip(1) {
                let continued = line.trim_end().ends_with('\\');
                lines.push(line.trim_end().trim_end_matches('\\').to_string());
                if !continued {
                    break;
                }
            }
            lines.join("\n")
        };
        // The struct's fields, in order, with their C offsets (natural alignment).
        let fields = |name: &str| -> Vec<(String, usize)> {
            let start = header.find(&format!("typedef struct {name} {{")).unwrap();
            let body = header[start..start + header[start..].find('}').unwrap()]
                .replace("MORI_COPY_KERNEL_ARGS_HEADER", &shared);
            let mut at = 0usize;
            body.lines()
                .skip(1)
                .filter_map(|l| {
                    let decl = l.split("/*").next().unwrap().trim().trim_end_matches(';');
                    let (ty, rest) = decl.split_once(' ')?;
                    let size = match ty {
                        "uint64_t" => 8,
                        "uint32_t" => 4,
                        other => panic!("{name}: type {other}"),
                    };
                    let (field, count) = match rest.trim().split_once('[') {
                        Some((field, count)) => {
                            let count = count.trim_end_matches(']');
                            let count = match count.split_once(" / ") {
                                Some((a, b)) => define(a.trim()) / b.trim().parse::<u64>().unwrap(),
                                None => count.parse().unwrap(),
                            };
                            (field.to_string(), count as usize)
                        }
                        None => (rest.trim().to_string(), 1),
                    };
                    at = at.div_ceil(size) * size;
                    let offset = at;
                    at += size * count;
                    Some((field, offset))
                })
                .collect()
        };
        use std::mem::offset_of;
        let args = [
            ("table", offset_of!(KernelArgs, table)),
            ("table_bytes", offset_of!(KernelArgs, table_bytes)),
            ("num_buffers", offset_of!(KernelArgs, num_buffers)),
            (
                "buffers_per_block",
                offset_of!(KernelArgs, buffers_per_block),
            ),
            ("num_runs", offset_of!(KernelArgs, num_runs)),
            ("num_tiles", offset_of!(KernelArgs, num_tiles)),
            ("num_rects", offset_of!(KernelArgs, num_rects)),
            ("runs_at", offset_of!(KernelArgs, runs_at)),
            ("tile_runs_at", offset_of!(KernelArgs, tile_runs_at)),
            ("rects_at", offset_of!(KernelArgs, rects_at)),
            ("flags", offset_of!(KernelArgs, flags)),
            ("offset_shift", offset_of!(KernelArgs, offset_shift)),
            ("reserved", offset_of!(KernelArgs, reserved)),
            ("inline_table", offset_of!(KernelArgs, inline_table)),
        ];
        let declared = fields("MoriCopyKernelArgs");
        let rust: Vec<(String, usize)> = args.iter().map(|(n, o)| (n.to_string(), *o)).collect();
        assert_eq!(declared, rust);
        // The wide argument: the same fields at the same offsets (one header), the table room
        // bigger.
        assert_eq!(fields("MoriCopyKernelWideArgs"), rust);
        assert_eq!(offset_of!(WideKernelArgs, inline_table), 64);
        assert_eq!(
            offset_of!(WideKernelArgs, offset_shift),
            offset_of!(KernelArgs, offset_shift)
        );
        // The run entry the builder writes: these offsets, 48 bytes.
        let run: Vec<(String, usize)> = [
            ("src_pitch", 0),
            ("dst_pitch", 8),
            ("first_rect", 16),
            ("rows", 20),
            ("height", 24),
            ("units", 28),
            ("rows_per_tile", 32),
            ("col_chunks", 36),
            ("first_tile", 40),
            ("unit_shift", 44),
        ]
        .iter()
        .map(|(n, o)| (n.to_string(), *o))
        .collect();
        assert_eq!(fields("MoriCopyKernelRun"), run);
    }
}

//! What plans hand out: strided 2D copies (rects), contiguous segments, and the output
//! entries they are written into.

#![forbid(unsafe_code)]

use std::mem::MaybeUninit;

/// One strided 2D copy, exactly the arguments of one hipMemcpy2DAsync: height rows of width
/// bytes, row r read at src_offset + r * src_pitch and written at dst_offset + r * dst_pitch.
/// Offsets are relative to each buffer's base.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CopyRect {
    /// Byte offset of the first source row.
    pub src_offset: u64,
    /// Byte offset of the first destination row.
    pub dst_offset: u64,
    /// Bytes between source rows (bytes_per_token_src for mori_tp_plan).
    pub src_pitch: u64,
    /// Bytes between destination rows (bytes_per_token_dst for mori_tp_plan).
    pub dst_pitch: u64,
    /// Bytes per row (heads_bytes_per_token_to_send for mori_tp_plan).
    pub width: u64,
    /// Rows (for mori_tp_plan: tokens in the run of pages, run length * page_size).
    pub height: u64,
}

impl CopyRect {
    /// True when the rows are back to back on both sides, so the rect is one contiguous block.
    pub fn is_contiguous(&self) -> bool {
        self.width == self.src_pitch && self.width == self.dst_pitch
    }

    /// Bytes the rect moves. Cannot overflow for a rect of a plan: its rows lie inside pages
    /// whose ends were checked to fit in `u64`.
    pub fn bytes(&self) -> u64 {
        self.width * self.height
    }
}

/// One contiguous copy, for RDMA batch writes; offsets relative to each buffer's base.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Segment {
    /// Byte offset in the source buffer.
    pub src_offset: u64,
    /// Byte offset in the destination buffer.
    pub dst_offset: u64,
    /// Bytes to copy.
    pub length: u64,
}

/// An entry of an output array that [`Walk::fill_segments`] writes: a plain value, or an
/// uninitialised slot of caller memory (a C array, a numpy `empty` buffer, spare `Vec`
/// capacity), which must only ever be written.
pub trait OutputEntry<T> {
    /// Stores `value`.
    fn put(&mut self, value: T);
}

impl<T> OutputEntry<T> for T {
    fn put(&mut self, value: T) {
        *self = value;
    }
}

impl<T> OutputEntry<T> for MaybeUninit<T> {
    fn put(&mut self, value: T) {
        self.write(value);
    }
}

//! The domain's small vocabulary, shared by every other module: which engine a value belongs
//! to, what a rank pair does, and which sides of a transfer are staged.

#![forbid(unsafe_code)]

use std::fmt;
use std::ops::{Index, IndexMut};

/// Which engine of the disaggregated pair a value belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    /// The engine that computes the KV cache and sends it (`src`).
    Prefill,
    /// The engine that receives the KV cache (`dst`).
    Decode,
}

impl Side {
    /// Both engines, prefill first.
    pub const BOTH: [Side; 2] = [Side::Prefill, Side::Decode];

    /// The other engine.
    pub fn other(self) -> Side {
        match self {
            Side::Prefill => Side::Decode,
            Side::Decode => Side::Prefill,
        }
    }

    /// `"prefill"` or `"decode"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Side::Prefill => "prefill",
            Side::Decode => "decode",
        }
    }

    /// The C config's name for this side's item length.
    pub(crate) fn item_len_field(self) -> &'static str {
        match self {
            Side::Prefill => "src_item_len",
            Side::Decode => "dst_item_len",
        }
    }

    /// The C config's name for this side's bytes per token.
    pub(crate) fn bytes_per_token_field(self) -> &'static str {
        match self {
            Side::Prefill => "bytes_per_token_src",
            Side::Decode => "bytes_per_token_dst",
        }
    }

    /// The C config's name for this side's head slice offset.
    pub(crate) fn slice_offset_field(self) -> &'static str {
        match self {
            Side::Prefill => "src_head_slice_offset",
            Side::Decode => "dst_head_slice_offset",
        }
    }

    /// The name of this side's buffer capacity.
    pub(crate) fn capacity_field(self) -> &'static str {
        match self {
            Side::Prefill => "src_capacity",
            Side::Decode => "dst_capacity",
        }
    }

    /// The name of this side's buffer array.
    pub(crate) fn buffers_field(self) -> &'static str {
        match self {
            Side::Prefill => "src",
            Side::Decode => "dst",
        }
    }

    /// What this side's buffers are to a copy: `"source"` or `"destination"`.
    pub(crate) fn buffer_role(self) -> &'static str {
        match self {
            Side::Prefill => "source",
            Side::Decode => "destination",
        }
    }
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} side", self.as_str())
    }
}

/// One value per engine, indexed by [`Side`]: what each side of a pair or a request has, in
/// place of paired `src_`/`dst_` fields.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Sides<T> {
    /// The prefill side's.
    pub prefill: T,
    /// The decode side's.
    pub decode: T,
}

impl<T> Sides<T> {
    /// The prefill side's value and the decode side's.
    pub fn new(prefill: T, decode: T) -> Sides<T> {
        Sides { prefill, decode }
    }

    /// Each side's value of `f`, prefill first.
    pub fn from_fn(mut f: impl FnMut(Side) -> T) -> Sides<T> {
        let prefill = f(Side::Prefill);
        Sides {
            prefill,
            decode: f(Side::Decode),
        }
    }

    /// Each side's value of a fallible `f`, prefill first; the first error.
    pub fn try_from_fn<E>(mut f: impl FnMut(Side) -> Result<T, E>) -> Result<Sides<T>, E> {
        let prefill = f(Side::Prefill)?;
        Ok(Sides {
            prefill,
            decode: f(Side::Decode)?,
        })
    }

    /// `f` of each side and its value.
    pub fn map<U>(self, mut f: impl FnMut(Side, T) -> U) -> Sides<U> {
        let prefill = f(Side::Prefill, self.prefill);
        Sides {
            prefill,
            decode: f(Side::Decode, self.decode),
        }
    }

    /// References to both values.
    pub fn as_ref(&self) -> Sides<&T> {
        Sides {
            prefill: &self.prefill,
            decode: &self.decode,
        }
    }
}

impl<T> Index<Side> for Sides<T> {
    type Output = T;

    fn index(&self, side: Side) -> &T {
        match side {
            Side::Prefill => &self.prefill,
            Side::Decode => &self.decode,
        }
    }
}

impl<T> IndexMut<Side> for Sides<T> {
    fn index_mut(&mut self, side: Side) -> &mut T {
        match side {
            Side::Prefill => &mut self.prefill,
            Side::Decode => &mut self.decode,
        }
    }
}

/// What a (prefill rank, decode rank) pair does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// The two ranks share no head.
    NotPaired,
    /// The prefill rank is the designated sender of the heads it shares with the decode rank.
    Send,
    /// The ranks share heads, but another prefill rank (a replica) sends them.
    SkipReplica,
}

impl Action {
    /// Every action, in the order of their C values (`MoriTpAction`).
    pub const ALL: [Action; 3] = [Action::NotPaired, Action::Send, Action::SkipReplica];

    /// `"not_paired"`, `"send"` or `"skip_replica"`: the spelling of the CLI's JSON and of the
    /// C names' suffix in lower case.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::NotPaired => "not_paired",
            Action::Send => "send",
            Action::SkipReplica => "skip_replica",
        }
    }
}

/// Which sides of a transfer go through a staging area (`MoriTpStaging`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Staging {
    /// Pages to pages.
    #[default]
    None,
    /// The prefill rank packs into its staging region; segments go from it to the decode pages.
    Src,
    /// Segments go from the prefill pages into a staging region on the decode rank, which
    /// unpacks it.
    Dst,
    /// Both: one segment per buffer.
    Both,
}

impl Staging {
    /// Every mode, in the order of their C values.
    pub const ALL: [Staging; 4] = [Staging::None, Staging::Src, Staging::Dst, Staging::Both];

    /// The mode that stages the sides named.
    pub fn from_sides(src: bool, dst: bool) -> Staging {
        match (src, dst) {
            (false, false) => Staging::None,
            (true, false) => Staging::Src,
            (false, true) => Staging::Dst,
            (true, true) => Staging::Both,
        }
    }

    /// True when the prefill rank packs.
    pub fn stages_src(self) -> bool {
        matches!(self, Staging::Src | Staging::Both)
    }

    /// True when the decode rank unpacks.
    pub fn stages_dst(self) -> bool {
        matches!(self, Staging::Dst | Staging::Both)
    }

    /// True when `side` is staged.
    pub fn stages(self, side: Side) -> bool {
        match side {
            Side::Prefill => self.stages_src(),
            Side::Decode => self.stages_dst(),
        }
    }

    /// `"none"`, `"src"`, `"dst"` or `"both"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Staging::None => "none",
            Staging::Src => "src",
            Staging::Dst => "dst",
            Staging::Both => "both",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_is_distinct_and_lower_case() {
        let names: Vec<&str> = Action::ALL
            .iter()
            .map(|a| a.as_str())
            .chain(Staging::ALL.iter().map(|s| s.as_str()))
            .collect();
        for name in &names {
            assert_eq!(*name, name.to_lowercase());
        }
        let mut unique = names.clone();
        unique.sort();
        unique.dedup();
        // "none" is only a staging name; the action names never collide with it.
        assert_eq!(unique.len(), names.len());
    }

    #[test]
    fn sides_are_indexed_by_engine() {
        let mut sides = Sides::from_fn(|side| side.as_str().len());
        assert_eq!((sides[Side::Prefill], sides[Side::Decode]), (7, 6));
        sides[Side::Decode] += 1;
        assert_eq!(sides.map(|side, n| (side, n)).decode, (Side::Decode, 7));
        assert_eq!(
            Side::BOTH.map(|side| side.other()),
            [Side::Decode, Side::Prefill]
        );
    }

    #[test]
    fn staging_modes_round_trip_through_their_sides() {
        for staging in Staging::ALL {
            assert_eq!(
                Staging::from_sides(staging.stages_src(), staging.stages_dst()),
                staging
            );
            assert_eq!(staging.stages(Side::Prefill), staging.stages_src());
            assert_eq!(staging.stages(Side::Decode), staging.stages_dst());
        }
    }
}

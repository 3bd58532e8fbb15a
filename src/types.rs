//! The domain's small vocabulary, shared by every other module: which engine a value belongs
//! to, what a rank pair does, and which sides of a transfer are staged.

#![forbid(unsafe_code)]

use std::fmt;

/// Which engine of the disaggregated pair a value belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    /// The engine that computes the KV cache and sends it (`src`).
    Prefill,
    /// The engine that receives the KV cache (`dst`).
    Decode,
}

impl Side {
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
        self.pick("src_item_len", "dst_item_len")
    }

    /// The C config's name for this side's bytes per token.
    pub(crate) fn bytes_per_token_field(self) -> &'static str {
        self.pick("bytes_per_token_src", "bytes_per_token_dst")
    }

    /// The C config's name for this side's head slice offset.
    pub(crate) fn slice_offset_field(self) -> &'static str {
        self.pick("src_head_slice_offset", "dst_head_slice_offset")
    }

    /// The name of this side's buffer capacity.
    pub(crate) fn capacity_field(self) -> &'static str {
        self.pick("src_capacity", "dst_capacity")
    }

    /// The name of this side's buffer array.
    pub(crate) fn buffers_field(self) -> &'static str {
        self.pick("src", "dst")
    }

    /// `prefill` on the prefill side, `decode` on the decode side.
    pub(crate) fn pick<T>(self, prefill: T, decode: T) -> T {
        match self {
            Side::Prefill => prefill,
            Side::Decode => decode,
        }
    }
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} side", self.as_str())
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

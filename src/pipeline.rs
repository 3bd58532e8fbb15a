//! Pipeline parallelism: which layers a prefill stage and a decode stage share when the two
//! engines split the model's layers into different, possibly uneven, pipeline stages.
//!
//! A partition lists the layers of each stage in order: `[10, 12, 10]` puts layers 0-9 on stage
//! 0, 10-21 on stage 1 and 22-31 on stage 2 (vLLM's `VLLM_PP_LAYER_PARTITION` and SGLang's
//! `SGLANG_PP_LAYER_PARTITION` give the same lists). A prefill stage and a decode stage share a
//! run of consecutive layers (possibly none); each shared layer has a local index on each side,
//! its position among its stage's layers, which is how both engines number their per-layer KV
//! buffers. The partitions are the caller's: serving engines choose them, and the even split
//! of each engine's own default is not this library's to guess.

#![forbid(unsafe_code)]

use crate::error::{Error, Result};
use crate::types::Side;

/// The layers a prefill stage and a decode stage share (`MoriTpLayerRange`): layers
/// `first_layer .. first_layer + num_layers` of the model; layer `first_layer + i` is local
/// layer `prefill_first_local + i` of the prefill stage and `decode_first_local + i` of the
/// decode stage. When the stages share no layer, `num_layers` is 0, `first_layer` is where the
/// later of the two stages starts, and both local indices are 0. 16 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LayerRange {
    /// The first shared layer of the model (global index).
    pub first_layer: u32,
    /// Shared layers (0: the stages share none).
    pub num_layers: u32,
    /// `first_layer`'s index among the prefill stage's layers (0 when none are shared).
    pub prefill_first_local: u32,
    /// `first_layer`'s index among the decode stage's layers (0 when none are shared).
    pub decode_first_local: u32,
}

impl LayerRange {
    /// `(global layer, prefill local index, decode local index)` of every shared layer.
    pub fn layers(&self) -> impl ExactSizeIterator<Item = (u32, u32, u32)> + '_ {
        (0..self.num_layers).map(|i| {
            (
                self.first_layer + i,
                self.prefill_first_local + i,
                self.decode_first_local + i,
            )
        })
    }
}

/// Checks a side's partition; returns its layers and where `stage` starts and ends.
fn stage_span(side: Side, partition: &[u32], stage: u32) -> Result<(u64, u64, u64)> {
    if partition.is_empty() {
        return Err(Error::EmptyPartition { side });
    }
    if let Some(empty) = partition.iter().position(|&layers| layers == 0) {
        return Err(Error::ZeroLayerStage {
            side,
            stage: empty,
            partition: partition.to_vec(),
        });
    }
    // A sum of u32s in a u64 cannot overflow for any slice that fits in memory.
    let total: u64 = partition.iter().map(|&layers| u64::from(layers)).sum();
    if total > u64::from(u32::MAX) {
        return Err(Error::PartitionTooLarge {
            side,
            layers: total,
        });
    }
    let index = stage as usize;
    if index >= partition.len() {
        return Err(Error::StageOutOfRange {
            side,
            stage,
            stages: partition.len(),
        });
    }
    let start: u64 = partition[..index].iter().map(|&l| u64::from(l)).sum();
    Ok((total, start, start + u64::from(partition[index])))
}

/// The layers that prefill stage `prefill_stage` (of the partition `prefill`, layers per stage)
/// and decode stage `decode_stage` (of `decode`) share, with their local indices on both sides.
///
/// Refused (`MORI_ERR_INVALID_ARGUMENT`, the message naming the partitions and numbers): an
/// empty partition, a stage of 0 layers (a stage without layers holds no KV cache, and an
/// engine that lists one has a partition to fix), partitions that hold different numbers of
/// layers, a stage out of range, more than `u32::MAX` layers. Prefill is checked first.
pub fn shared_layers(
    prefill: &[u32],
    decode: &[u32],
    prefill_stage: u32,
    decode_stage: u32,
) -> Result<LayerRange> {
    let (p_total, p_start, p_end) = stage_span(Side::Prefill, prefill, prefill_stage)?;
    let (d_total, d_start, d_end) = stage_span(Side::Decode, decode, decode_stage)?;
    if p_total != d_total {
        return Err(Error::PartitionsDiffer {
            prefill: p_total,
            decode: d_total,
            prefill_partition: prefill.to_vec(),
            decode_partition: decode.to_vec(),
        });
    }
    let (start, end) = (p_start.max(d_start), p_end.min(d_end));
    // Every value is at most the total, which fits in u32.
    if start >= end {
        return Ok(LayerRange {
            first_layer: start as u32,
            ..LayerRange::default()
        });
    }
    Ok(LayerRange {
        first_layer: start as u32,
        num_layers: (end - start) as u32,
        prefill_first_local: (start - p_start) as u32,
        decode_first_local: (start - d_start) as u32,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uneven_stages_share_the_overlap_of_their_spans() {
        // Prefill PP 2 [20, 12], decode PP 3 [10, 12, 10]: prefill stage 0 (0-19) and decode
        // stage 1 (10-21) share layers 10-19.
        let shared = shared_layers(&[20, 12], &[10, 12, 10], 0, 1).unwrap();
        assert_eq!(
            shared,
            LayerRange {
                first_layer: 10,
                num_layers: 10,
                prefill_first_local: 10,
                decode_first_local: 0
            }
        );
        let none = shared_layers(&[20, 12], &[10, 12, 10], 0, 2).unwrap();
        assert_eq!((none.first_layer, none.num_layers), (22, 0));
        assert_eq!(none.layers().len(), 0);
    }

    #[test]
    fn partitions_that_disagree_are_refused_with_their_numbers() {
        let message = shared_layers(&[4, 2], &[3, 4], 0, 0)
            .unwrap_err()
            .to_string();
        assert!(message.contains("[4, 2] holds 6") && message.contains("[3, 4] holds 7"));
        assert!(matches!(
            shared_layers(&[4, 0, 2], &[6], 0, 0),
            Err(Error::ZeroLayerStage {
                side: Side::Prefill,
                stage: 1,
                ..
            })
        ));
        assert!(matches!(
            shared_layers(&[6], &[3, 3], 0, 2),
            Err(Error::StageOutOfRange {
                side: Side::Decode,
                stage: 2,
                stages: 2
            })
        ));
    }
}

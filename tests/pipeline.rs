//! Pipeline-parallel layer maps through the C ABI (mori_tp_pp_layers), against an oracle that
//! assigns every layer to its stage one by one: every partition of 1 to 7 layers into 1 to 4
//! stages on each side, every (prefill stage, decode stage); and every refusal with its
//! numbers.

use std::ffi::CStr;
use std::ptr::{null, null_mut};

use mori_tp::ffi::*;

fn last_error() -> String {
    // SAFETY: the library returns a valid NUL-terminated string, never NULL.
    unsafe { CStr::from_ptr(mori_tp_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

fn pp_layers(
    prefill: &[u32],
    decode: &[u32],
    p: u32,
    d: u32,
) -> Result<MoriTpLayerRange, (MoriStatus, String)> {
    let mut out = MoriTpLayerRange {
        first_layer: 77,
        num_layers: 77,
        prefill_first_local: 77,
        decode_first_local: 77,
    };
    let before = out;
    // SAFETY: arrays of the stated lengths and a valid out-pointer.
    let status = unsafe {
        mori_tp_pp_layers(
            prefill.as_ptr(),
            prefill.len(),
            decode.as_ptr(),
            decode.len(),
            p,
            d,
            &mut out,
        )
    };
    if status == MORI_OK {
        Ok(out)
    } else {
        assert_eq!(out, before, "a refused call wrote its output");
        Err((status, last_error()))
    }
}

/// Every way to split `layers` layers into `stages` stages of at least one layer each.
fn compositions(layers: u32, stages: u32) -> Vec<Vec<u32>> {
    if stages == 1 {
        return vec![vec![layers]];
    }
    (1..layers.saturating_sub(stages - 2))
        .flat_map(|first| {
            compositions(layers - first, stages - 1)
                .into_iter()
                .map(move |mut rest| {
                    rest.insert(0, first);
                    rest
                })
        })
        .collect()
}

/// The oracle: the stage of every layer, counted one by one.
fn stage_of(partition: &[u32]) -> Vec<(u32, u32)> {
    let mut out = Vec::new();
    for (stage, &count) in partition.iter().enumerate() {
        for local in 0..count {
            out.push((stage as u32, local));
        }
    }
    out
}

#[test]
fn every_pair_of_stages_of_every_small_partition_shares_exactly_the_layers_both_hold() {
    let mut checked = 0;
    for layers in 1..=7u32 {
        let partitions: Vec<Vec<u32>> = (1..=4.min(layers))
            .flat_map(|stages| compositions(layers, stages))
            .collect();
        for prefill in &partitions {
            for decode in &partitions {
                let (p_stage, d_stage) = (stage_of(prefill), stage_of(decode));
                for p in 0..prefill.len() as u32 {
                    for d in 0..decode.len() as u32 {
                        let shared: Vec<(u32, u32, u32)> = (0..layers)
                            .filter(|&l| p_stage[l as usize].0 == p && d_stage[l as usize].0 == d)
                            .map(|l| (l, p_stage[l as usize].1, d_stage[l as usize].1))
                            .collect();
                        let got = pp_layers(prefill, decode, p, d).unwrap_or_else(|(s, m)| {
                            panic!("{prefill:?} {decode:?} ({p}, {d}) refused {s}: {m}")
                        });
                        let listed: Vec<(u32, u32, u32)> = (0..got.num_layers)
                            .map(|i| {
                                (
                                    got.first_layer + i,
                                    got.prefill_first_local + i,
                                    got.decode_first_local + i,
                                )
                            })
                            .collect();
                        assert_eq!(listed, shared, "{prefill:?} {decode:?} ({p}, {d})");
                        if shared.is_empty() {
                            // No layer in common: where the later stage starts, no locals.
                            let start = |partition: &[u32], s: u32| -> u32 {
                                partition[..s as usize].iter().sum()
                            };
                            assert_eq!(
                                (
                                    got.first_layer,
                                    got.prefill_first_local,
                                    got.decode_first_local
                                ),
                                (start(prefill, p).max(start(decode, d)), 0, 0),
                                "{prefill:?} {decode:?} ({p}, {d})"
                            );
                        }
                        checked += 1;
                    }
                }
            }
        }
    }
    assert!(checked > 10_000, "{checked} stage pairs");
}

/// (prefill partition, decode partition, prefill stage, decode stage, the message).
type Refusal = (&'static [u32], &'static [u32], u32, u32, &'static str);

#[test]
fn partitions_that_cannot_describe_one_model_are_refused_with_their_numbers() {
    let cases: [Refusal; 6] = [
        (
            &[4, 2],
            &[3, 4],
            0,
            0,
            "mori_tp_pp_layers: invalid argument: the prefill pipeline partition [4, 2] holds 6 \
             layers but the decode partition [3, 4] holds 7 (both split the model's layers)",
        ),
        (
            &[4, 0, 2],
            &[6],
            0,
            0,
            "mori_tp_pp_layers: invalid argument: prefill side: stage 1 of the pipeline partition \
             [4, 0, 2] holds no layer (every stage holds at least one)",
        ),
        (
            &[6],
            &[3, 3],
            0,
            2,
            "mori_tp_pp_layers: invalid argument: decode side: pipeline stage 2 is out of range \
             for 2 stages (stages are 0..1)",
        ),
        (
            &[3, 3],
            &[6],
            5,
            0,
            "mori_tp_pp_layers: invalid argument: prefill side: pipeline stage 5 is out of range \
             for 2 stages (stages are 0..1)",
        ),
        (
            &[],
            &[6],
            0,
            0,
            "mori_tp_pp_layers: invalid argument: prefill side: the pipeline partition is empty \
             (give the layers of each stage)",
        ),
        (
            &[u32::MAX, 1],
            &[u32::MAX, 1],
            0,
            0,
            "mori_tp_pp_layers: invalid argument: prefill side: the pipeline partition holds \
             4294967296 layers, more than 4294967295",
        ),
    ];
    for (prefill, decode, p, d, message) in cases {
        assert_eq!(
            pp_layers(prefill, decode, p, d),
            Err((MORI_ERR_INVALID_ARGUMENT, message.to_string()))
        );
    }
    let mut out = MoriTpLayerRange::default();
    // SAFETY: NULL arrays with lengths and a NULL out are refused before any access.
    unsafe {
        assert_eq!(
            mori_tp_pp_layers(null(), 2, [6].as_ptr(), 1, 0, 0, &mut out),
            MORI_ERR_NULL_POINTER
        );
        assert_eq!(
            last_error(),
            "mori_tp_pp_layers: null pointer: prefill_layers is NULL but its length is 2"
        );
        assert_eq!(
            mori_tp_pp_layers([6].as_ptr(), 1, [6].as_ptr(), 1, 0, 0, null_mut()),
            MORI_ERR_NULL_POINTER
        );
    }
}

#[test]
fn prefill_pp_2_to_decode_pp_1_sends_each_stage_its_own_layers() {
    // 61 layers (DeepSeek V3.2) split unevenly over two prefill stages, one decode stage.
    let first = pp_layers(&[31, 30], &[61], 0, 0).unwrap();
    let second = pp_layers(&[31, 30], &[61], 1, 0).unwrap();
    assert_eq!(
        (
            first.first_layer,
            first.num_layers,
            first.prefill_first_local,
            first.decode_first_local
        ),
        (0, 31, 0, 0)
    );
    assert_eq!(
        (
            second.first_layer,
            second.num_layers,
            second.prefill_first_local,
            second.decode_first_local
        ),
        (31, 30, 0, 31)
    );
}

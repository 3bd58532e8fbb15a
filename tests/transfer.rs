//! Whole transfers in host memory, every rank pair, byte for byte: each decode rank must end
//! with exactly its heads of exactly the requested pages, and nothing else may change.

mod common;

use common::{MODELS, Request, every_model_deployment, odd_deployments, transfer};
use mori_tp::{SendReport, SlicePlan, send_host};

fn host(
    plan: &SlicePlan<'_>,
    _: &Request,
    src: &[&[u8]],
    dst: &mut [&mut [u8]],
) -> Option<SendReport> {
    Some(send_host(plan, src, dst).unwrap())
}

#[test]
fn every_model_tp_pair_page_size_and_dtype_lands_byte_exact() {
    assert_eq!(every_model_deployment(&mut host), MODELS.len() * 2 * 2 * 25);
}

#[test]
fn non_integer_ratios_and_replication_on_both_sides_land_byte_exact() {
    odd_deployments(&mut host);
}

#[test]
fn a_run_of_pages_contiguous_on_both_sides_is_one_copy_per_buffer() {
    let request = Request {
        src_pages: (10..20).collect(),
        dst_pages: (3..13).collect(),
        src_capacity_pages: 20,
        dst_capacity_pages: 13,
    };
    // Qwen2.5-7B, prefill TP 2, decode TP 8: four heads, two per prefill rank, one per decode
    // pair of ranks. Each decode rank has exactly one sender and one rect per buffer.
    let outcome = transfer(4, 256, 4, 2, 8, 16, &request, &mut host);
    assert_eq!(outcome.pages, 10);
    assert_eq!(outcome.copies, 8 * 4, "one rect per buffer per decode rank");
}

#[test]
fn an_empty_request_changes_nothing() {
    let request = Request {
        src_pages: vec![],
        dst_pages: vec![],
        src_capacity_pages: 2,
        dst_capacity_pages: 2,
    };
    let outcome = transfer(8, 256, 2, 2, 4, 16, &request, &mut host);
    assert_eq!(outcome.copies, 0);
}

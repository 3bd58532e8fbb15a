"""plan() and plan_segments() against independent statements of what they must return: the
contract's run rule for rects, and the per-token list serving stacks build today for segments."""

from __future__ import annotations

import array
import unittest

import mori_tp
from layouts import (
    SEND,
    Layout,
    byte_map,
    fragmented_request,
    per_token_segments,
    stack_head_slice,
)

# Heterogeneous layouts where the serving stacks' arithmetic is right (both TP sizes at most H,
# one dividing the other) and at least one side's slice is narrower than its token.
NARROW_LAYOUTS = [
    Layout(heads=8, p_tp=p_tp, d_tp=d_tp, page_size=page_size, bytes_per_head=bph)
    for (p_tp, d_tp) in [(1, 2), (2, 1), (2, 4), (4, 2), (1, 8), (8, 1), (2, 8), (8, 4)]
    for (page_size, bph) in [(1, 4), (16, 6)]
] + [
    Layout(heads=4, p_tp=1, d_tp=4, page_size=4, bytes_per_head=256),
    Layout(heads=32, p_tp=4, d_tp=8, page_size=2, bytes_per_head=16),
]


def contract_rects(config, src_pages, dst_pages):
    """The header's rule: one rect per maximal run of pairs where both indices go up by one."""
    rects, start = [], 0
    for i in range(1, len(src_pages) + 1):
        if (i == len(src_pages) or src_pages[i] != src_pages[i - 1] + 1
                or dst_pages[i] != dst_pages[i - 1] + 1):
            rects.append(mori_tp.CopyRect(
                src_offset=src_pages[start] * config.src_item_len + config.src_head_slice_offset,
                dst_offset=dst_pages[start] * config.dst_item_len + config.dst_head_slice_offset,
                src_pitch=config.bytes_per_token_src,
                dst_pitch=config.bytes_per_token_dst,
                width=config.heads_bytes_per_token_to_send,
                height=(i - start) * config.page_size,
            ))
            start = i
    return rects


class PlanTest(unittest.TestCase):
    def test_a_run_of_pages_adjacent_on_both_sides_is_one_rect(self):
        layout = Layout(heads=8, p_tp=2, d_tp=4, page_size=16, bytes_per_head=256)
        config = layout.config(1, 3)
        # Runs: 3,4,5 -> 7,8,9 | 9,10 -> 1,2 | 2 -> 3 | 3 -> 5 (source adjacent, not destination)
        src, dst = [3, 4, 5, 9, 10, 2, 3], [7, 8, 9, 1, 2, 3, 5]
        rects = mori_tp.plan(config, src, dst)
        self.assertEqual([r.height // 16 for r in rects], [3, 2, 1, 1])
        self.assertEqual(rects, contract_rects(config, src, dst))

    def test_fragmented_requests_follow_the_run_rule_for_every_pair(self):
        for layout in NARROW_LAYOUTS[:6]:
            request = fragmented_request(seed=layout.p_tp * 10 + layout.d_tp, runs=6)
            for p, d in layout.pairs():
                config = layout.config(p, d)
                rects = mori_tp.plan(config, request.src_pages, request.dst_pages)
                want = (contract_rects(config, request.src_pages, request.dst_pages)
                        if config.action is SEND else [])
                self.assertEqual(rects, want, f"{layout} p={p} d={d}")

    def test_page_inputs_of_every_kind_give_the_same_plan(self):
        layout = Layout(heads=4, p_tp=2, d_tp=8, page_size=4, bytes_per_head=8)
        config = layout.config(1, 5)
        src, dst = [4, 5, 0, 9], [1, 2, 3, 0]
        want = mori_tp.plan_segments(config, src, dst)
        self.assertEqual(len(want[0]), 4 * 4)
        inputs = [
            (tuple(src), tuple(dst)),
            (array.array("i", src), array.array("i", dst)),
            (array.array("l", src), array.array("q", dst)),
            (range(4, 6), range(1, 3)),
        ]
        for src_in, dst_in in inputs[:3]:
            self.assertEqual(mori_tp.plan_segments(config, src_in, dst_in), want)
        ranged = mori_tp.plan_segments(config, *inputs[3])
        self.assertEqual(ranged, tuple(column[:8] for column in want))

    def test_pairs_that_do_not_send_plan_nothing(self):
        layout = Layout(heads=2, p_tp=8, d_tp=2, page_size=4, bytes_per_head=8)
        actions = set()
        for p, d in layout.pairs():
            config = layout.config(p, d)
            actions.add(config.action)
            if config.action is not SEND:
                self.assertEqual(mori_tp.plan(config, [0, 1], [2, 3]), [])
                self.assertEqual(mori_tp.plan_segments(config, [0, 1], [2, 3]), ([], [], []))
        self.assertEqual(actions, set(mori_tp.Action))


class PlanSegmentsMatchTheServingStacksPerTokenListTest(unittest.TestCase):
    def test_narrow_slices_equal_the_per_token_list_offset_for_offset(self):
        checked = 0
        for layout in NARROW_LAYOUTS:
            request = fragmented_request(seed=layout.heads + 100 * layout.d_tp, runs=5)
            for p, d in layout.pairs():
                config = layout.config(p, d)
                paired, src_offset, dst_offset, width = stack_head_slice(layout, p, d)
                self.assertEqual(config.action is SEND, paired, f"{layout} p={p} d={d}")
                got = mori_tp.plan_segments(config, request.src_pages, request.dst_pages)
                if not paired:
                    self.assertEqual(got, ([], [], []))
                    continue
                self.assertTrue(width < config.bytes_per_token_src
                                or width < config.bytes_per_token_dst)
                want = per_token_segments(config, request.src_pages, request.dst_pages,
                                          src_offset, dst_offset, width)
                self.assertEqual(got, want, f"{layout} p={p} d={d}")
                checked += 1
        self.assertGreater(checked, 50)

    def test_whole_token_slices_move_the_same_bytes_in_one_segment_per_run(self):
        layouts = [
            Layout(heads=8, p_tp=2, d_tp=2, page_size=4, bytes_per_head=6),
            Layout(heads=8, p_tp=8, d_tp=8, page_size=16, bytes_per_head=4),
            # Replicated on both sides: every rank holds exactly one head, so the slice is the
            # whole token although the TP sizes differ.
            Layout(heads=4, p_tp=8, d_tp=4, page_size=2, bytes_per_head=10),
        ]
        for layout in layouts:
            request = fragmented_request(seed=layout.p_tp + layout.page_size, runs=6)
            runs = mori_tp.plan(layout.config(0, 0), request.src_pages, request.dst_pages)
            for p, d in layout.pairs():
                config = layout.config(p, d)
                if config.action is not SEND:
                    continue
                width = config.heads_bytes_per_token_to_send
                self.assertEqual(width, config.bytes_per_token_src)
                self.assertEqual(width, config.bytes_per_token_dst)
                got = mori_tp.plan_segments(config, request.src_pages, request.dst_pages)
                per_token = per_token_segments(config, request.src_pages, request.dst_pages,
                                               0, 0, width)
                self.assertEqual(byte_map(*got), byte_map(*per_token), f"{layout} p={p} d={d}")
                self.assertEqual(len(got[0]), len(runs))
                self.assertLess(len(got[0]), len(per_token[0]))
                self.assertEqual(got[2], [r.height // config.page_size * config.src_item_len
                                          for r in runs])


if __name__ == "__main__":
    unittest.main()

"""slice_config() over every valid (H, P, D) up to TP 16, against the contract restated in
Python: who sends, which heads, and the byte offsets of the slice on both sides."""

from __future__ import annotations

import unittest

import mori_tp
from layouts import (
    NOT_PAIRED,
    SEND,
    SKIP_REPLICA,
    Layout,
    owned_heads,
    sender,
    valid_tp_sizes,
)

HEAD_COUNTS = [1, 2, 3, 4, 6, 8, 12, 16]


def expected(layout: Layout, p: int, d: int):
    """(action, first_head, num_heads, src_offset, dst_offset, width), from the header's rule."""
    src = owned_heads(layout.heads, layout.p_tp, p)
    dst = owned_heads(layout.heads, layout.d_tp, d)
    shared = [h for h in src if h in dst]
    if not shared:
        return NOT_PAIRED, 0, 0, 0, 0, 0
    senders = {sender(layout.heads, layout.p_tp, layout.d_tp, d, h) for h in shared}
    if p not in senders:
        return SKIP_REPLICA, 0, 0, 0, 0, 0
    bph = layout.bytes_per_head
    return (SEND, shared[0], len(shared), (shared[0] - src.start) * bph,
            (shared[0] - dst.start) * bph, len(shared) * bph)


class SliceConfigTest(unittest.TestCase):
    def test_every_valid_layout_matches_the_contract_for_every_pair(self):
        layouts = 0
        for heads in HEAD_COUNTS:
            for p_tp in valid_tp_sizes(heads):
                for d_tp in valid_tp_sizes(heads):
                    layout = Layout(heads, p_tp, d_tp, page_size=2, bytes_per_head=6)
                    writers = {}
                    for p, d in layout.pairs():
                        config = layout.config(p, d)
                        got = (config.action, config.first_head, config.num_heads,
                               config.src_head_slice_offset, config.dst_head_slice_offset,
                               config.heads_bytes_per_token_to_send)
                        self.assertEqual(got, expected(layout, p, d), f"{layout} p={p} d={d}")
                        self.assertIsInstance(config.action, mori_tp.Action)
                        self.assertEqual(config.bytes_per_token_src,
                                         layout.bytes_per_token(p_tp))
                        self.assertEqual(config.bytes_per_token_dst,
                                         layout.bytes_per_token(d_tp))
                        if config.action is SEND:
                            for head in range(config.first_head,
                                              config.first_head + config.num_heads):
                                writers.setdefault((d, head), []).append(p)
                    # Exactly one prefill rank writes each (decode rank, owned head).
                    owned = {(d, h) for d in range(d_tp)
                             for h in owned_heads(heads, d_tp, d)}
                    self.assertEqual(set(writers), owned, str(layout))
                    self.assertTrue(all(len(w) == 1 for w in writers.values()), str(layout))
                    layouts += 1
        self.assertEqual(layouts, sum(len(valid_tp_sizes(h)) ** 2 for h in HEAD_COUNTS))

    def test_the_case_todays_stacks_get_wrong_sends_each_decode_rank_its_own_head(self):
        # 4 KV heads, prefill TP 2, decode TP 8: decode rank d owns head d // 2.
        layout = Layout(heads=4, p_tp=2, d_tp=8, page_size=16, bytes_per_head=256)
        for d in range(8):
            sends = [(p, layout.config(p, d)) for p in range(2)]
            sends = [(p, c) for p, c in sends if c.action is SEND]
            self.assertEqual(len(sends), 1)
            p, config = sends[0]
            self.assertEqual((p, config.first_head, config.num_heads), (d // 4, d // 2, 1))
            self.assertEqual(config.src_head_slice_offset, (d // 2 % 2) * 256)

    def test_configs_compare_by_value_and_hash(self):
        layout = Layout(heads=8, p_tp=2, d_tp=4, page_size=16, bytes_per_head=256)
        self.assertEqual(layout.config(1, 3), layout.config(1, 3))
        self.assertNotEqual(layout.config(1, 3), layout.config(1, 2))
        self.assertEqual(len({layout.config(1, 3), layout.config(1, 3)}), 1)


if __name__ == "__main__":
    unittest.main()

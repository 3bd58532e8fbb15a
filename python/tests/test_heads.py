"""mori_tp.rank_heads and mori_tp.head_sender (mori_tp_rank_heads, mori_tp_head_sender) against
slice_config's results over every valid (H, P, D) with H up to 16 and P, D up to 16."""

import unittest

import mori_tp
from mori_tp import Action


def _valid(h: int, tp: int) -> bool:
    return h % tp == 0 or tp % h == 0


class HeadsTest(unittest.TestCase):
    def test_the_wrappers_agree_with_slice_config(self):
        bph, page = 6, 2
        for h in (1, 2, 3, 4, 6, 8, 12, 16):
            for p_tp in (t for t in range(1, 17) if _valid(h, t)):
                for d_tp in (t for t in range(1, 17) if _valid(h, t)):
                    def item(tp: int) -> int:
                        first, end = mori_tp.rank_heads(h, tp, 0)
                        return page * (end - first) * bph
                    for d in range(d_tp):
                        lo, hi = mori_tp.rank_heads(h, d_tp, d)
                        senders = {}
                        for p in range(p_tp):
                            c = mori_tp.slice_config(
                                prefill_tp_size=p_tp, prefill_tp_rank=p, decode_tp_size=d_tp,
                                decode_tp_rank=d, total_kv_heads=h, page_size=page,
                                src_item_len=item(p_tp), dst_item_len=item(d_tp))
                            plo, phi = mori_tp.rank_heads(h, p_tp, p)
                            shared = range(max(lo, plo), min(hi, phi))
                            if c.action is Action.SEND:
                                self.assertEqual((c.first_head, c.num_heads),
                                                 (shared.start, len(shared)))
                                senders.update({x: p for x in shared})
                            else:
                                self.assertEqual(c.action is Action.NOT_PAIRED, not shared)
                        got = {x: mori_tp.head_sender(h, p_tp, d_tp, d, x) for x in range(lo, hi)}
                        self.assertEqual(got, senders, (h, p_tp, d_tp, d))

    def test_refusals_raise_with_the_values(self):
        with self.assertRaisesRegex(mori_tp.TopologyError, "tp_size 3 and total_kv_heads 8"):
            mori_tp.rank_heads(8, 3, 0)
        with self.assertRaisesRegex(mori_tp.InvalidArgumentError, "tp_rank 4 is out of range"):
            mori_tp.rank_heads(8, 4, 4)
        with self.assertRaisesRegex(mori_tp.InvalidArgumentError,
                                    "decode side: tp_rank 1 holds heads 2..3, not head 0"):
            mori_tp.head_sender(8, 2, 4, 1, 0)
        with self.assertRaisesRegex(mori_tp.InvalidArgumentError, "head 8 is out of range"):
            mori_tp.head_sender(8, 2, 4, 1, 8)
        with self.assertRaisesRegex(mori_tp.InvalidArgumentError, "does not fit in uint32_t"):
            mori_tp.head_sender(8, 2, 4, 1, -1)


if __name__ == "__main__":
    unittest.main()

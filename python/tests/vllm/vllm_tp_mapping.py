"""mori-tp's pair plans against vLLM 0.34.0's own TP mappings, over every (H, P, D) of H in
1..32 KV heads and TP sizes P, D in 1..16 (8,192 combinations; on 2026-12-07: 565 layouts and
18,475 rank pairs compared with the WRITE mapping, 3,250 decode ranks with the READ mapping):

- MoRIIO WRITE (``moriio_tp_mapping.compute_write_tp_mapping``, what the prefill rank writes):
  where vLLM accepts the layout, mori-tp's action for every (prefill rank, decode rank) is SEND
  exactly where vLLM writes heads, with the same heads (``num_heads``, ``src_first_local`` =
  ``local_head``, ``dst_first_local`` = ``remote_head``), SKIP_REPLICA where vLLM leaves the
  copy to another producer, and NOT_PAIRED where the ranks share no head; the senders into each
  decode rank are vLLM's ``num_writers``. Where vLLM refuses (``validate_write_tp_topology``),
  mori-tp, for TP sizes that are not multiples of each other, still sends every head of every
  decode rank exactly once, from a rank that holds it.
- NIXL READ (``nixl/tp_mapping.compute_tp_mapping``, what the decode rank reads): the prefill
  ranks a decode rank reads attention from are exactly mori-tp's senders to it, and where the
  heads sit in the blocks (``rank_offset_factor``, ``rank_to_attention_slot``) is mori-tp's
  ``src_first_local`` and ``dst_first_local``.
- MLA (one latent every rank holds whole): each decode rank gets it from exactly one prefill
  rank in both, the same one where vLLM's WRITE mapping names it.

    <venv>/bin/python python/tests/vllm/vllm_tp_mapping.py

Exit status: 0 passed, 1 failed, 77 skipped (no vLLM).
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Dict, List, Set

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from vllm_common import require_vllm  # noqa: E402

require_vllm()

from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology  # noqa: E402
from vllm.distributed.utils import divide  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_tp_mapping import (  # noqa
    compute_write_tp_mapping,
    validate_write_tp_topology,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import (  # noqa: E402
    compute_tp_mapping,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

import mori_tp  # noqa: E402
from mori_tp import Action, Layout, TopologyError  # noqa: E402

HEADS = list(range(1, 33))
TP_SIZES = list(range(1, 17))
PAGE, HEAD_BYTES = 16, 64


def layouts(heads: int, tp: int) -> List[Layout]:
    return [Layout.nhd(heads, tp, r, PAGE, HEAD_BYTES) for r in range(tp)]


def owned(heads: int, tp: int, rank: int) -> Set[int]:
    if tp <= heads:
        per = heads // tp
        return set(range(rank * per, (rank + 1) * per))
    return {rank * heads // tp}


def check(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


def vllm_splits(heads: int, tp: int) -> bool:
    """Whether vLLM 0.34.0's QKVParallelLinear takes ``heads`` KV heads on ``tp`` ranks
    (``model_executor/layers/linear.py``: ``divide(tp_size, total_num_kv_heads)`` when
    ``tp_size >= total_num_kv_heads``, else ``divide(total_num_kv_heads, tp_size)``)."""
    try:
        if tp >= heads:
            divide(tp, heads)
        else:
            divide(heads, tp)
        return True
    except (AssertionError, ValueError):
        return False


def mori_valid(heads: int, tp: int) -> bool:
    try:
        Layout.nhd(heads, tp, 0, PAGE, HEAD_BYTES)
        return True
    except TopologyError:
        return False


def test_write_mapping() -> str:
    agreed = refused_both = covered = pairs = 0
    for heads in HEADS:
        for P in TP_SIZES:
            for D in TP_SIZES:
                name = f"H={heads} P={P} D={D}"
                try:
                    validate_write_tp_topology(P, D, heads, False)
                    vllm_ok = True
                except ValueError:
                    vllm_ok = False
                ok = mori_valid(heads, P) and mori_valid(heads, D)
                if not ok:
                    # Refused by vLLM too: its QKVParallelLinear splits the KV heads with
                    # divide() (the larger by the smaller) and asserts that it divides, so no
                    # such engine exists (its WRITE check alone lets P == D through).
                    bad = P if not mori_valid(heads, P) else D
                    check(not vllm_splits(heads, bad),
                          f"{name}: vLLM splits {heads} KV heads over TP {bad}, mori-tp refuses")
                    refused_both += 1
                    continue
                prefill, decode = layouts(heads, P), layouts(heads, D)
                configs = [[mori_tp.pair_config(prefill[p], decode[d]) for d in range(D)]
                           for p in range(P)]
                if not vllm_ok:
                    # vLLM's WRITE mode refuses TP sizes that are not multiples of each other;
                    # mori-tp moves them: every head of every decode rank exactly once.
                    for d in range(D):
                        got: Dict[int, int] = {}
                        for p in range(P):
                            c = configs[p][d]
                            if c.action is Action.SEND:
                                for h in range(c.first_head, c.first_head + c.num_heads):
                                    check(h not in got and h in owned(heads, P, p),
                                          f"{name}: head {h} of decode {d} twice or unowned")
                                    got[h] = p
                        check(set(got) == owned(heads, D, d),
                              f"{name}: decode {d} gets {sorted(got)}")
                    covered += 1
                    continue
                writers = [0] * D
                for p in range(P):
                    mapping = compute_write_tp_mapping(p, P, D, heads, False, False)
                    targets = {t.tp_rank: t for t in mapping.targets}
                    for d in range(D):
                        pairs += 1
                        c, t = configs[p][d], targets.get(d)
                        where = f"{name} p={p} d={d}: mori {c.action.name} {c.first_head}+" \
                                f"{c.num_heads}, vLLM {t}"
                        if t is not None and t.num_heads > 0:
                            check(c.action is Action.SEND and c.num_heads == t.num_heads
                                  and c.src_first_local == t.local_head
                                  and c.dst_first_local == t.remote_head, where)
                            writers[d] += 1
                        elif owned(heads, P, p) & owned(heads, D, d):
                            check(c.action is Action.SKIP_REPLICA, where)
                        else:
                            check(c.action is Action.NOT_PAIRED, where)
                    for t in mapping.targets:
                        if t.num_heads:
                            sends = sum(configs[q][t.tp_rank].action is Action.SEND
                                        for q in range(P))
                            check(sends == t.num_writers,
                                  f"{name}: {sends} senders into {t.tp_rank}, vLLM "
                                  f"{t.num_writers}")
                agreed += 1
    return (f"MoRIIO WRITE: {agreed} layouts ({pairs} rank pairs) identical, {covered} that "
            f"vLLM refuses moved whole by mori-tp, {refused_both} refused by both")


def test_read_mapping() -> str:
    compared = pairs = 0
    for heads in HEADS:
        for P in TP_SIZES:
            for D in TP_SIZES:
                if not (mori_valid(heads, P) and mori_valid(heads, D)):
                    continue
                if max(P, D) % min(P, D):
                    continue  # NIXL's heterogeneous TP needs one size to divide the other
                prefill, decode = layouts(heads, P), layouts(heads, D)
                for d in range(D):
                    topology = TransferTopology(tp_rank=d, tp_size=D, block_size=PAGE,
                                                engine_id="decode", is_mla=False,
                                                is_mamba=False, total_num_kv_heads=heads,
                                                attn_backends=[])
                    mapping = compute_tp_mapping(topology, P, (FullAttentionSpec,))
                    sources = list(mapping.source_ranks_per_group[0])
                    configs = {p: mori_tp.pair_config(prefill[p], decode[d]) for p in range(P)}
                    senders = [p for p in range(P) if configs[p].action is Action.SEND]
                    name = f"H={heads} P={P} D={D} d={d}"
                    check(sorted(sources) == senders,
                          f"{name}: vLLM reads from {sources}, mori-tp's senders {senders}")
                    local = max(1, heads // D)
                    remote = max(1, heads // P)
                    for p in senders:
                        pairs += 1
                        c = configs[p]
                        if D > P:
                            # One remote rank: the local heads start at rank_offset_factor
                            # local-head chunks into the remote block (heads when D > H).
                            offset = mapping.rank_offset_factor * (1 if D > heads else local)
                            check(c.src_first_local == offset and c.dst_first_local == 0,
                                  f"{name} p={p}: offset {offset}, mori {c}")
                        else:
                            slot = mapping.rank_to_attention_slot[p]
                            check(c.src_first_local == 0 and c.dst_first_local == slot * remote,
                                  f"{name} p={p}: slot {slot} of {remote} heads, mori {c}")
                    compared += 1
    return f"NIXL READ: {compared} decode ranks ({pairs} reads) identical"


def test_mla() -> str:
    compared = 0
    for P in TP_SIZES:
        for D in TP_SIZES:
            if max(P, D) % min(P, D):
                continue
            prefill, decode = layouts(1, P), layouts(1, D)
            for p in range(P):
                mapping = compute_write_tp_mapping(p, P, D, 1, True, False)
                writes = {t.tp_rank for t in mapping.targets if t.num_heads}
                for d in range(D):
                    c = mori_tp.pair_config(prefill[p], decode[d])
                    check((c.action is Action.SEND) == (d in writes),
                          f"MLA P={P} D={D} p={p} d={d}: mori {c.action.name}, vLLM writes "
                          f"{sorted(writes)}")
                    compared += 1
    return f"MLA: {compared} rank pairs identical to MoRIIO WRITE"


def main() -> int:
    failed = 0
    tests = (test_write_mapping, test_read_mapping, test_mla)
    for test in tests:
        try:
            print(f"ok: {test()}")
        except Exception:  # noqa: BLE001 - reported, the next test runs
            failed += 1
            print(f"FAIL: {test.__name__}")
            traceback.print_exc()
    print(f"{len(tests) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""mori_tp.models: the facts of each family from config fields (the expected numbers worked out
here from the formulas the module cites), the plan of a TP pairing, and the engine-given
layouts of state slots moved byte for byte through the library: a Mamba2 conv state whose x, B
and C parts shard differently, between TP 2 and TP 4, in both orientations and across them, and
an SSM state. (``cli/tests/models.rs`` checks that this module and ``mori-tp plan --config``
agree on every config the repository ships.)"""

from __future__ import annotations

import ctypes
import json
import os
import tempfile
import unittest
from typing import Dict, List, Tuple

import mori_tp
from mori_tp import Action, Request, models

NEMOTRON_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"

#: The fields mori-tp reads of nvidia/Nemotron-H-8B-Base-8K's config.json.
NEMOTRON = {
    "model_type": "nemotron_h", "num_hidden_layers": 52, "hidden_size": 4096,
    "num_attention_heads": 32, "num_key_value_heads": 8, "attention_head_dim": 128,
    "conv_kernel": 4, "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8,
    "ssm_state_size": 128, "hybrid_override_pattern": NEMOTRON_PATTERN,
    "torch_dtype": "bfloat16",
}

#: The fields mori-tp reads of Qwen/Qwen3-Next-80B-A3B-Instruct's config.json.
QWEN3_NEXT = {
    "model_type": "qwen3_next", "num_hidden_layers": 48, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_value_head_dim": 128, "torch_dtype": "bfloat16",
}

#: The fields of deepseek-ai's DeepSeek-V3.2 config.json.
DEEPSEEK_V32 = {
    "model_type": "deepseek_v32", "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
    "index_head_dim": 128, "index_n_heads": 64, "torch_dtype": "bfloat16",
}


#: A Falcon-H1 config's fields (transformers' ``FalconH1Config``: ``mamba_*`` names, attention
#: and Mamba2 side by side on every layer), with the figures of the 0.5B model in transformers'
#: Falcon-H1 documentation (36 layers, 8 attention heads, 2 KV heads, 24 Mamba heads of 64,
#: d_state 128) and one group (``mamba_n_groups`` 1, the default and Falcon-H1's, vLLM #55208).
FALCON_H1 = {
    "model_type": "falcon_h1", "architectures": ["FalconH1ForCausalLM"],
    "num_hidden_layers": 36, "hidden_size": 1024, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 64, "mamba_n_heads": 24, "mamba_d_head": 64,
    "mamba_d_ssm": 1536, "mamba_n_groups": 1, "mamba_d_state": 128, "mamba_d_conv": 4,
    "torch_dtype": "bfloat16",
}

#: Granite-4.0-H-Tiny's layer kinds: attention on layers 5, 15, 25 and 35 of 40.
GRANITE_LAYERS = (["mamba"] * 5 + ["attention"] + ["mamba"] * 9 + ["attention"] + ["mamba"] * 9
                  + ["attention"] + ["mamba"] * 9 + ["attention"] + ["mamba"] * 4)

#: A Granite-4.0-H config's fields (transformers' ``GraniteMoeHybridConfig``: ``layer_types`` of
#: mamba and attention, ``mamba_d_head`` auto = ``mamba_expand * hidden_size / mamba_n_heads``),
#: shaped as Granite-4.0-H-Tiny: 40 layers, hidden 1536, 12 attention heads, 4 KV heads, 48 Mamba
#: heads, d_state 128, one group.
GRANITE_4_H = {
    "model_type": "granitemoehybrid", "architectures": ["GraniteMoeHybridForCausalLM"],
    "num_hidden_layers": 40, "hidden_size": 1536, "num_attention_heads": 12,
    "num_key_value_heads": 4, "mamba_n_heads": 48, "mamba_d_head": "auto", "mamba_expand": 2,
    "mamba_n_groups": 1, "mamba_d_state": 128, "mamba_d_conv": 4, "layer_types": GRANITE_LAYERS,
    "torch_dtype": "bfloat16",
}

#: Nemotron-H with one group, as vLLM's Nemotron-H model class names it.
NEMOTRON_G1 = dict(NEMOTRON, n_groups=1, architectures=["NemotronHForCausalLM"])


def gpt_oss(layers: int = 24) -> dict:
    return {"model_type": "gpt_oss", "num_hidden_layers": layers, "num_attention_heads": 64,
            "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128,
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                            for i in range(layers)]}


class FamilyTest(unittest.TestCase):
    def test_a_dense_model_is_one_full_attention_group_on_every_layer(self):
        facts = models.from_config({"hidden_size": 3584, "num_attention_heads": 28,
                                    "num_key_value_heads": 4, "num_hidden_layers": 28})
        self.assertEqual((facts.family, len(facts.groups)), ("dense", 1))
        (group,) = facts.groups
        self.assertEqual(group.layers, tuple(range(28)))
        (kv,) = group.parts
        self.assertEqual((kv.units, kv.unit_bytes("bf16", "bf16")), (4, 3584 // 28 * 2))
        self.assertEqual((group.storage, group.buffers_per_layer), ("paged", 2))

    def test_glm_reads_query_groups_and_kv_channels(self):
        facts = models.from_config({"num_layers": 40, "hidden_size": 4096,
                                    "num_attention_heads": 32, "multi_query_attention": True,
                                    "multi_query_group_num": 2, "kv_channels": 128})
        (kv,) = facts.groups[0].parts
        self.assertEqual((kv.units, kv.elements, facts.total_layers), (2, 128, 40))

    def test_deepseek_v32_adds_a_132_byte_indexer_record_held_whole(self):
        facts = models.from_config(DEEPSEEK_V32)
        self.assertEqual(facts.family, "mla_indexer")
        latent, indexer = facts.groups
        self.assertEqual((latent.name, indexer.name), ("mla_latent", "indexer"))
        self.assertEqual(indexer.layers, tuple(range(61)))
        (record,) = indexer.parts
        # index_head_dim fp8 bytes + one 4-byte fp32 scale per 128 of them, any cache dtype.
        for dtype in ("bf16", "fp8"):
            self.assertEqual(record.unit_bytes(dtype, dtype), 128 + 128 // 128 * 4)
        self.assertEqual(record.units, 1)
        (part,) = latent.parts
        self.assertEqual(part.unit_bytes("bf16", "bf16"), (512 + 64) * 2)
        self.assertEqual(part.unit_bytes("fp8", "fp8"), 512 + 512 // 128 * 4 + 64 * 2)
        with self.assertRaisesRegex(models.ConfigError, "index_head_dim.*100"):
            models.from_config(dict(DEEPSEEK_V32, index_head_dim=100))

    def test_gpt_oss_layer_types_make_a_full_and_a_sliding_group(self):
        facts = models.from_config(gpt_oss())
        full, sliding = facts.groups
        self.assertEqual(full.layers, tuple(range(1, 24, 2)))
        self.assertEqual(sliding.layers, tuple(range(0, 24, 2)))
        self.assertEqual((sliding.window, full.window), (128, None))
        self.assertEqual(facts.main_group(), full)

    def test_gemma3_follows_its_sliding_window_pattern_without_layer_types(self):
        facts = models.from_config({"text_config": {
            "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16,
            "head_dim": 128, "sliding_window": 1024, "sliding_window_pattern": 6}})
        full, sliding = facts.groups
        self.assertEqual(full.layers, tuple(i for i in range(62) if (i + 1) % 6 == 0))
        self.assertEqual(len(full.layers) + len(sliding.layers), 62)
        self.assertEqual(sliding.window, 1024)

    def test_qwen3_next_keeps_q_k_v_conv_and_recurrent_state_on_linear_layers(self):
        facts = models.from_config(QWEN3_NEXT)
        full, conv, recurrent = facts.groups
        linear = tuple(i for i in range(48) if (i + 1) % 4)
        self.assertEqual(full.layers, tuple(i for i in range(48) if (i + 1) % 4 == 0))
        self.assertEqual((conv.layers, recurrent.layers), (linear, linear))
        self.assertEqual(conv.slot_steps, 4 - 1)
        self.assertEqual([(p.name, p.units, p.elements) for p in conv.parts],
                         [("q", 16, 128), ("k", 16, 128), ("v", 32, 128)])
        (state,) = recurrent.parts
        self.assertEqual(state.unit_bytes("bf16", "fp32"), 128 * 128 * 4)

    def test_nemotron_h_reads_its_pattern_into_attention_conv_and_ssm_groups(self):
        facts = models.from_config(NEMOTRON)
        full, conv, ssm = facts.groups
        at = lambda c: tuple(i for i, x in enumerate(NEMOTRON_PATTERN) if x == c)  # noqa: E731
        self.assertEqual((full.layers, conv.layers, ssm.layers), (at("*"), at("M"), at("M")))
        self.assertEqual([(p.name, p.unit, p.units, p.elements) for p in conv.parts],
                         [("x", "head", 128, 64), ("B", "group", 8, 128),
                          ("C", "group", 8, 128)])
        (kv,) = full.parts
        self.assertEqual((kv.units, kv.elements), (8, 128))
        (state,) = ssm.parts
        self.assertEqual(state.unit_bytes("bf16", "bf16"), 64 * 128 * 2)
        single = models.from_config(dict(NEMOTRON, n_groups=1)).group("conv_state")
        self.assertEqual((single.parts[1].units, single.parts[1].must_divide), (1, False))

    def test_falcon_h1_keeps_attention_and_mamba2_on_every_layer_with_one_group(self):
        facts = models.from_config(FALCON_H1)
        full, conv, ssm = facts.groups
        every = tuple(range(36))
        self.assertEqual((full.layers, conv.layers, ssm.layers), (every, every, every))
        self.assertEqual([(p.name, p.units, p.elements, p.must_divide) for p in conv.parts],
                         [("x", 24, 64, True), ("B", 1, 128, False), ("C", 1, 128, False)])
        self.assertEqual((full.parts[0].units, full.parts[0].elements), (2, 64))
        self.assertEqual(conv.slot_steps, 4 - 1)
        # mamba_d_head "auto" is mamba_d_ssm / mamba_n_heads; a d_ssm the heads do not make is
        # refused.
        auto = models.from_config(dict(FALCON_H1, mamba_d_head="auto")).group("conv_state")
        self.assertEqual(auto.parts[0].elements, 1536 // 24)
        with self.assertRaisesRegex(models.ConfigError, "mamba_d_ssm` 1000 is not"):
            models.from_config(dict(FALCON_H1, mamba_d_ssm=1000))

    def test_granite_4_h_reads_its_layer_types_and_an_auto_head_dim(self):
        facts = models.from_config(GRANITE_4_H)
        full, conv, ssm = facts.groups
        self.assertEqual(full.layers, (5, 15, 25, 35))
        self.assertEqual(conv.layers, tuple(i for i in range(40) if i not in (5, 15, 25, 35)))
        self.assertEqual(ssm.layers, conv.layers)
        # mamba_expand 2 x hidden 1536 over 48 heads: 64 channels a head.
        self.assertEqual([(p.name, p.units, p.elements) for p in conv.parts],
                         [("x", 48, 64), ("B", 1, 128), ("C", 1, 128)])
        (kv,) = full.parts
        self.assertEqual((kv.units, kv.elements), (4, 1536 // 12))
        with self.assertRaisesRegex(models.ConfigError, "layer_types.*`linear_attention`"):
            models.from_config(dict(GRANITE_4_H, layer_types=["linear_attention"] * 40))
        # A mamba_n_heads config whose layers mori-tp cannot tell is refused, not read as dense.
        unknown = {k: v for k, v in GRANITE_4_H.items() if k not in ("layer_types",
                                                                     "model_type")}
        with self.assertRaisesRegex(models.ConfigError, "which layers keep which state"):
            models.from_config(unknown)

    def test_bad_fields_are_named(self):
        for config, says in [
            (dict(NEMOTRON, hybrid_override_pattern="M*"), "hybrid_override_pattern"),
            (dict(NEMOTRON, mamba_num_heads=-1), "mamba_num_heads"),
            (dict(gpt_oss(), layer_types=["sliding_attention"]), "layer_types"),
            ({k: v for k, v in gpt_oss().items() if k != "sliding_window"}, "sliding_window"),
            ({"num_attention_heads": 4}, "num_layers"),
        ]:
            with self.assertRaisesRegex(models.ConfigError, says):
                models.from_config(config)

    def test_read_config_takes_a_file_or_a_model_directory(self):
        with tempfile.TemporaryDirectory() as folder:
            with open(os.path.join(folder, "config.json"), "w") as f:
                json.dump(NEMOTRON, f)
            for path in (folder, os.path.join(folder, "config.json")):
                self.assertEqual(models.read_config(path).family, "mamba2")
            empty = os.path.join(folder, "empty")
            os.mkdir(empty)
            with self.assertRaisesRegex(models.ConfigError, "without a config.json"):
                models.read_config(empty)


def rank_of(plan: List[dict], group: str) -> List[dict]:
    return next(g for g in plan if g["name"] == group)["decode_ranks"]


class PlanTest(unittest.TestCase):
    def test_a_mamba2_plan_moves_each_part_by_its_own_units(self):
        facts = models.from_config(NEMOTRON)
        plan = models.plan(facts, 2, 4, 1000)
        mamba = NEMOTRON_PATTERN.count("M")
        attention = NEMOTRON_PATTERN.count("*")
        for d, rank in enumerate(rank_of(plan, "conv_state")):
            x, g = 128 // 4, 8 // 4
            self.assertEqual(rank["owned_units"], {"x": [d * x, (d + 1) * x],
                                                   "B": [d * g, (d + 1) * g],
                                                   "C": [d * g, (d + 1) * g]})
            per_step = x * 64 * 2 + 2 * g * 128 * 2
            self.assertEqual(rank["bytes_per_request"], per_step * 3 * mamba)
            self.assertIsNone(rank["bytes_per_token"])
        for rank in rank_of(plan, "ssm_state"):
            self.assertEqual(rank["bytes_per_request"], 128 // 4 * 64 * 128 * 2 * mamba)
        for rank in rank_of(plan, "full_attention"):
            self.assertEqual(rank["bytes_per_token"], 8 // 4 * 128 * 2 * 2 * attention)
        # The SSM dtype doubles only the SSM state.
        fp32 = models.plan(facts, 2, 4, 1000, ssm_dtype="float32")
        self.assertEqual(rank_of(fp32, "ssm_state")[0]["bytes_per_request"],
                         2 * rank_of(plan, "ssm_state")[0]["bytes_per_request"])
        self.assertEqual(rank_of(fp32, "conv_state"), rank_of(plan, "conv_state"))

    def test_replicas_of_a_record_held_whole_skip_and_name_their_sender(self):
        facts = models.from_config(DEEPSEEK_V32)
        indexer = next(g for g in models.plan(facts, 4, 2, 10) if g["name"] == "indexer")
        for d in range(2):
            # REFERENCE.md section 3 with H = 1: decode rank d's one sender is prefill rank
            # d * P / D; the other prefill ranks skip, condensed into runs of consecutive ranks.
            pairs = [p for p in indexer["pairs"] if p["decode_rank"] == d]
            self.assertEqual([p["prefill_rank"] for p in pairs], [d * 4 // 2])
            self.assertEqual(pairs[0]["parts"][0]["action"], "send")
            runs = [r for r in indexer["replicas"] if r["decode_rank"] == d]
            skipping = [p for r in runs for p in range(*r["prefill_ranks"])]
            self.assertEqual(skipping, [p for p in range(4) if p != d * 4 // 2])
            for run in runs:
                self.assertEqual(run["parts"], [{"part": "index_k", "shared_units": [0, 1],
                                                 "sent_by": d * 4 // 2}])
            self.assertEqual(indexer["decode_ranks"][d]["bytes_per_token"], 132 * 61)
        # Decode rank 0 (sender 0): one run 1-3; decode rank 1 (sender 2): runs 0-1 and 3.
        self.assertEqual([r["prefill_ranks"] for r in indexer["replicas"]],
                         [[1, 4], [0, 2], [3, 4]])

    def test_a_sliding_group_moves_its_window_and_a_tp_the_engines_refuse_is_refused(self):
        plan = models.plan(models.from_config(gpt_oss()), 1, 4, 1000)
        sliding = next(g for g in plan if g["name"] == "sliding_attention")
        self.assertEqual(sliding["tokens_moved"], 128)
        rank = sliding["decode_ranks"][0]
        self.assertEqual(rank["bytes_per_request"], rank["bytes_per_token"] * 128)
        with self.assertRaisesRegex(ValueError, "TP 16 does not divide the 8 B groups"):
            models.plan(models.from_config(NEMOTRON), 2, 16, 10)
        with self.assertRaises(mori_tp.TopologyError):
            models.plan(models.from_config(gpt_oss()), 3, 1, 10)


    def test_a_window_moves_from_a_page_of_both_sides_as_the_library_requires(self):
        """tokens_moved is what the library moves: the window's start rounded down to a page of
        both sides. Each count is checked against the library itself: it refuses the unrounded
        start and names the rounded one, and takes a request of that many tokens from it."""
        facts = models.from_config(gpt_oss())
        group = next(g for g in facts.groups if g.name == "sliding_attention")
        cases = [  # (prefill page size, decode page size, tokens, tokens the library moves)
            (16, 64, 1000, 168), (64, 16, 1000, 168), (48, 32, 1000, 136), (16, 16, 1000, 136),
            (1, 1, 1000, 128), (16, 64, 100, 100), (16, 64, 192, 128), (16, 64, 150, 150), (64, 64, 1024, 128),
        ]
        for p_page, d_page, tokens, want in cases:
            label = f"pages {p_page}/{d_page}, {tokens} tokens"
            plan = models.plan(facts, 1, 4, tokens, prefill_page_size=p_page,
                               decode_page_size=d_page)
            sliding = next(g for g in plan if g["name"] == "sliding_attention")
            self.assertEqual(sliding["tokens_moved"], want, label)
            self.assertEqual(models.window_tokens(tokens, 128, p_page, d_page), want, label)
            for rank in sliding["decode_ranks"]:
                self.assertEqual(rank["bytes_per_request"], rank["bytes_per_token"] * want)
            part = group.parts[0]
            config = mori_tp.pair_config(
                models.paged_layout(group, part, 1, 0, p_page, "nhd", "bf16", "bf16"),
                models.paged_layout(group, part, 4, 0, d_page, "nhd", "bf16", "bf16"))

            def window(first: int, count: int) -> mori_tp.Group:
                return mori_tp.Group(config, Request(list(range(-(-count // p_page))),
                                                     list(range(-(-count // d_page))), count),
                                     first_token=first, num_buffers=1)

            start = tokens - want
            mori_tp.groups_info([window(start, want)])  # the library takes it
            if tokens > 128 and (tokens - 128) != start:
                with self.assertRaises(mori_tp.InvalidArgumentError) as caught:
                    mori_tp.groups_info([window(tokens - 128, 128)])
                self.assertIn(f"round it down to {start},", str(caught.exception), label)


# --- state slots through the library, byte for byte ----------------------------------------

#: A small Mamba2 layer: 8 heads of 2 channels (x), 4 groups of 3 channels (B, C), kernel 4.
SMALL = dict(NEMOTRON, mamba_num_heads=8, mamba_head_dim=2, n_groups=4, ssm_state_size=3,
             hybrid_override_pattern="M*", num_hidden_layers=2)
SLOTS = 3  # slots per buffer; the request's slot is 1
#: A small Gated DeltaNet (Qwen3-Next) layer: 4 key heads of 2 channels (q, k), 8 value heads
#: of 3 channels (v), kernel 3; q and k split by key heads, v by value heads.
SMALL_GDN = dict(QWEN3_NEXT, num_hidden_layers=4, linear_num_key_heads=4, linear_key_head_dim=2,
                 linear_num_value_heads=8, linear_value_head_dim=3, linear_conv_kernel_dim=3)


def value(part: int, channel: int, step: int) -> bytes:
    """The two bytes of global channel ``channel`` of part ``part`` at time step ``step``."""
    return ((part << 12) | (channel << 3) | step).to_bytes(2, "little")


def owned_channels(part: models.Part, tp: int, rank: int) -> range:
    units = part.units
    lo = rank * (units // tp) if tp <= units else rank // (tp // units)
    n = units // tp if tp <= units else 1
    return range(lo * part.elements, (lo + n) * part.elements)


def slot_bytes(group: models.Group, tp: int, rank: int, orientation: str,
               num_spec: int = 0) -> Dict[int, bytes]:
    """Offset -> the two bytes the engine's slot holds there, for a rank's own channels: vLLM's
    conv state of ``kernel - 1 + num_spec`` rows, every part's local channels in order (a group
    held whole, ``n_groups == 1``, is on every rank: ``extra_groups_for_head_shards``)."""
    channels = [(i, c) for i, p in enumerate(group.parts) for c in owned_channels(p, tp, rank)]
    steps = group.slot_steps + num_spec
    out = {}
    for local, (part, channel) in enumerate(channels):
        for t in range(steps):
            element = t * len(channels) + local if orientation == "sd" else local * steps + t
            out[element * 2] = value(part, channel, t)
    return out


def filled(size: int, at: Dict[int, bytes], base: int, fill: int) -> ctypes.Array:
    buf = (ctypes.c_ubyte * size)(*([fill] * size))
    for offset, data in at.items():
        buf[base + offset:base + offset + 2] = data
    return buf


def move_conv_state(self: unittest.TestCase, prefill: Tuple[int, str],
                    decode: Tuple[int, str], per_channel: bool, pad: int, config: dict = SMALL,
                    num_spec: int = 0) -> Dict[Tuple[int, str], List[int]]:
    """Moves the conv state from every prefill rank to every decode rank, checks each decode
    rank's slot byte for byte (padding and other slots kept), and returns the prefill ranks that
    sent each (decode rank, part)."""
    group = models.from_config(config).group("conv_state")
    (p_size, p_orient), (d_size, d_orient) = prefill, decode
    steps = group.slot_steps + num_spec
    whole = any(p.units == 1 for p in group.parts)
    extra = {"prefill_tp": p_size} if per_channel and whole else {}

    def slot_of(tp: int) -> int:
        return sum(len(owned_channels(p, tp, 0)) for p in group.parts) * steps * 2

    src_stride, dst_stride = slot_of(p_size), slot_of(d_size) + pad
    srcs = [filled(SLOTS * src_stride, slot_bytes(group, p_size, p, p_orient, num_spec),
                   src_stride, 0xAA) for p in range(p_size)]
    senders: Dict[Tuple[int, str], List[int]] = {}
    for d in range(d_size):
        dst = filled(SLOTS * dst_stride, {}, 0, 0x55)
        dst_layouts = models.conv_state_layouts(group, d_size, d, d_orient, "bf16",
                                                slot_stride=dst_stride,
                                                per_channel=per_channel,
                                                num_spec=num_spec, **extra)
        moved = 0
        for p in range(p_size):
            src_layouts = models.conv_state_layouts(group, p_size, p, p_orient, "bf16",
                                                    slot_stride=src_stride,
                                                    per_channel=per_channel,
                                                    num_spec=num_spec, **extra)
            for name in (part.name for part in group.parts):
                config = mori_tp.pair_config(src_layouts[name], dst_layouts[name])
                if config.action is not Action.SEND:
                    continue
                senders.setdefault((d, name), []).append(p)
                tokens = config.src.page_size
                request = Request([1], [1], tokens)
                mori_tp.send_kvcache_pair(
                    config, [ctypes.addressof(srcs[p])], [ctypes.addressof(dst)],
                    src_capacity=len(srcs[p]), dst_capacity=len(dst), request=request,
                    backend="host")
                moved += 1
        self.assertGreater(moved, 0)
        want = filled(SLOTS * dst_stride, slot_bytes(group, d_size, d, d_orient, num_spec),
                      dst_stride, 0x55)
        # The padding after the slot and the other slots keep their bytes.
        self.assertEqual(bytes(dst), bytes(want), f"decode rank {d} of {decode}")
    return senders


class StateSlotTransferTest(unittest.TestCase):
    def move(self, prefill: Tuple[int, str], decode: Tuple[int, str], per_channel: bool,
             pad: int, config: dict = SMALL, num_spec: int = 0) -> Dict[Tuple[int, str], List[int]]:
        return move_conv_state(self, prefill, decode, per_channel, pad, config, num_spec)

    def test_a_conv_state_of_three_parts_moves_tp2_to_tp4_and_back(self):
        for orientation in ("sd", "ds"):
            self.move((2, orientation), (4, orientation), False, 0)
            self.move((4, orientation), (2, orientation), False, 16)

    def test_across_orientations_per_channel_units_move_it(self):
        self.move((2, "sd"), (4, "ds"), True, 8)
        self.move((4, "ds"), (1, "sd"), True, 0)

    def test_a_gated_deltanet_conv_state_moves_q_and_k_by_key_heads_and_v_by_value_heads(self):
        # Channels q, k, v in that order; q and k in key heads, v in value heads (the facts the
        # byte check below builds on, pinned here against SMALL_GDN's numbers).
        self.assertEqual([(p.name, p.units, p.elements)
                          for p in models.from_config(SMALL_GDN).group("conv_state").parts],
                         [("q", 4, 2), ("k", 4, 2), ("v", 8, 3)])
        for orientation in ("sd", "ds"):
            self.move((2, orientation), (4, orientation), False, 0, SMALL_GDN)
            self.move((4, orientation), (1, orientation), False, 8, SMALL_GDN)
        self.move((1, "sd"), (2, "ds"), True, 0, SMALL_GDN)

    def test_a_gated_deltanet_recurrent_state_moves_by_value_heads(self):
        recurrent = models.from_config(SMALL_GDN).group("recurrent_state")
        (part,) = recurrent.parts
        head = part.unit_bytes("bf16", "fp32")
        self.assertEqual(head, 3 * 2 * 4)  # v_dim x k_dim fp32 values per value head

        def state(tp: int, rank: int, stride: int) -> ctypes.Array:
            per = 8 // tp
            data = {(h - rank * per) * head + i: bytes([0x80 | h, i])
                    for h in range(rank * per, (rank + 1) * per) for i in range(0, head, 2)}
            return filled(SLOTS * stride, data, stride, 0x33)

        for p_size, d_size in ((2, 4), (4, 2), (1, 8)):
            for d in range(d_size):
                stride = 8 // d_size * head + 16
                dst = filled(SLOTS * stride, {}, 0, 0x33)
                layout = models.state_layout(recurrent, d_size, d, "fp32", slot_stride=stride)
                senders = 0
                for p in range(p_size):
                    src_stride = 8 // p_size * head
                    config = mori_tp.pair_config(
                        models.state_layout(recurrent, p_size, p, "fp32",
                                            slot_stride=src_stride), layout)
                    if config.action is Action.SEND:
                        senders += 1
                        src = state(p_size, p, src_stride)
                        mori_tp.send_kvcache_pair(
                            config, [ctypes.addressof(src)], [ctypes.addressof(dst)],
                            src_capacity=len(src), dst_capacity=len(dst),
                            request=Request([1], [1], 1), backend="host")
                self.assertGreater(senders, 0)
                self.assertEqual(bytes(dst), bytes(state(d_size, d, stride)),
                                 f"TP {p_size} -> {d_size}, decode rank {d}")

    def test_one_group_is_held_whole_and_every_decode_rank_gets_it(self):
        group = models.from_config(dict(SMALL, n_groups=1)).group("conv_state")
        self.assertEqual([p.units for p in group.parts], [8, 1, 1])
        plan = models.plan(models.from_config(dict(SMALL, n_groups=1)), 2, 4, 1)
        conv = next(g for g in plan if g["name"] == "conv_state")
        for rank in conv["decode_ranks"]:
            self.assertEqual(rank["owned_units"]["B"], [0, 1])

    def test_an_ssm_state_moves_by_heads(self):
        ssm = models.from_config(SMALL).group("ssm_state")
        (part,) = ssm.parts
        head = part.unit_bytes("fp32", "fp32")
        self.assertEqual(head, 2 * 3 * 4)

        def state(tp: int, rank: int, stride: int) -> ctypes.Array:
            per = 8 // tp
            data = {(h - rank * per) * head + i: bytes([h * 16 + i % 16, i // 16])
                    for h in range(rank * per, (rank + 1) * per) for i in range(0, head, 2)}
            return filled(SLOTS * stride, data, stride, 0x11)

        for d in range(4):
            stride = 8 // 4 * head + 32
            dst = filled(SLOTS * stride, {}, 0, 0x11)
            layout = models.state_layout(ssm, 4, d, "fp32", slot_stride=stride)
            for p in range(2):
                config = mori_tp.pair_config(
                    models.state_layout(ssm, 2, p, "fp32", slot_stride=8 // 2 * head), layout)
                if config.action is Action.SEND:
                    src = state(2, p, 8 // 2 * head)
                    mori_tp.send_kvcache_pair(
                        config, [ctypes.addressof(src)], [ctypes.addressof(dst)],
                        src_capacity=len(src), dst_capacity=len(dst),
                        request=Request([1], [1], 1), backend="host")
            self.assertEqual(bytes(dst), bytes(state(4, d, stride)))

    def test_reference_section_15_slot_conv_state_then_ssm_state_offsets(self):
        """REFERENCE.md section 15's example (Nemotron-H: 128 heads of 64, 8 groups, d_state
        128, conv kernel 4): a bf16 DS conv state followed in the slot by an fp32 SSM state."""
        facts = models.from_config(NEMOTRON)
        conv, ssm = facts.group("conv_state"), facts.group("ssm_state")
        for tp, conv_bytes, b, c in ((2, 30720, 24576, 27648), (4, 15360, 12288, 13824)):
            stride = conv_bytes + 128 // tp * 32768 + 4096  # an engine's padding
            layouts = models.conv_state_layouts(conv, tp, 0, "ds", "bf16", slot_stride=stride)
            self.assertEqual([layouts[n].offset for n in ("x", "B", "C")], [0, b, c])
            self.assertEqual([layouts[n].head_bytes for n in ("x", "B", "C")], [384, 768, 768])
            state = models.state_layout(ssm, tp, 0, "fp32", slot_stride=stride,
                                        offset=conv_bytes)
            self.assertEqual((state.offset, state.head_bytes, state.page_stride),
                             (conv_bytes, 32768, stride))

    def test_a_slot_of_conv_then_ssm_state_moves_both_byte_for_byte(self):
        """One slot per request holding the conv state (SD) and, after it, the SSM state, with
        each side's own padding: both move into place, the padding and other slots kept."""
        facts = models.from_config(SMALL)
        conv, ssm = facts.group("conv_state"), facts.group("ssm_state")
        (part,) = ssm.parts
        head = part.unit_bytes("fp32", "fp32")

        def conv_len(tp: int) -> int:
            return sum(len(owned_channels(p, tp, 0)) for p in conv.parts) * conv.slot_steps * 2

        def slot(tp: int, rank: int, stride: int) -> Dict[int, bytes]:
            at = dict(slot_bytes(conv, tp, rank, "sd"))
            per = 8 // tp
            for h in range(rank * per, (rank + 1) * per):
                for i in range(0, head, 2):
                    at[conv_len(tp) + (h - rank * per) * head + i] = bytes([h * 16 + i % 16,
                                                                            0x80 | i // 16])
            return at

        p_size, d_size = 2, 4
        src_stride = conv_len(p_size) + 8 // p_size * head + 8
        dst_stride = conv_len(d_size) + 8 // d_size * head + 40
        srcs = [filled(SLOTS * src_stride, slot(p_size, p, src_stride), src_stride, 0xAA)
                for p in range(p_size)]
        for d in range(d_size):
            dst = filled(SLOTS * dst_stride, {}, 0, 0x55)
            dst_layouts = dict(models.conv_state_layouts(conv, d_size, d, "sd", "bf16",
                                                         slot_stride=dst_stride))
            dst_layouts["ssm"] = models.state_layout(ssm, d_size, d, "fp32",
                                                     slot_stride=dst_stride,
                                                     offset=conv_len(d_size))
            for p in range(p_size):
                src_layouts = dict(models.conv_state_layouts(conv, p_size, p, "sd", "bf16",
                                                             slot_stride=src_stride))
                src_layouts["ssm"] = models.state_layout(ssm, p_size, p, "fp32",
                                                         slot_stride=src_stride,
                                                         offset=conv_len(p_size))
                for name in ("x", "B", "C", "ssm"):
                    config = mori_tp.pair_config(src_layouts[name], dst_layouts[name])
                    if config.action is not Action.SEND:
                        continue
                    mori_tp.send_kvcache_pair(
                        config, [ctypes.addressof(srcs[p])], [ctypes.addressof(dst)],
                        src_capacity=len(srcs[p]), dst_capacity=len(dst),
                        request=Request([1], [1], config.src.page_size), backend="host")
            want = filled(SLOTS * dst_stride, slot(d_size, d, dst_stride), dst_stride, 0x55)
            self.assertEqual(bytes(dst), bytes(want), f"decode rank {d}")

    def test_layouts_refuse_what_they_cannot_describe(self):
        facts = models.from_config(SMALL)
        conv, full = facts.group("conv_state"), facts.group("full_attention")
        ssm = facts.group("ssm_state")
        with self.assertRaisesRegex(ValueError, "orientation 'nhd'"):
            models.conv_state_layouts(conv, 2, 0, "nhd", "bf16", slot_stride=1 << 16)
        with self.assertRaisesRegex(ValueError, "slot_stride 8 is smaller than offset 0 \\+ "
                                    "the state's 120 bytes \\(20 channels x 3 time steps"):
            models.conv_state_layouts(conv, 2, 0, "sd", "bf16", slot_stride=8)
        with self.assertRaisesRegex(ValueError, "slot_stride 128 is smaller than offset 16 "):
            models.conv_state_layouts(conv, 2, 0, "sd", "bf16", slot_stride=128, offset=16)
        with self.assertRaisesRegex(ValueError, "not a conv state"):
            models.conv_state_layouts(full, 2, 0, "sd", "bf16", slot_stride=1 << 16)
        # The slot stride is the engine's: there is no default to guess it.
        with self.assertRaisesRegex(TypeError, "slot_stride"):
            models.conv_state_layouts(conv, 2, 0, "sd", "bf16")  # type: ignore[call-arg]
        with self.assertRaisesRegex(TypeError, "slot_stride"):
            models.state_layout(ssm, 2, 0, "fp32")  # type: ignore[call-arg]
        with self.assertRaisesRegex(ValueError, "slot_stride 100 is smaller than offset 8 \\+ "
                                    "the state's 96 bytes \\(4 heads x 24 B\\)"):
            models.state_layout(ssm, 2, 0, "fp32", slot_stride=100, offset=8)
        for bad in (-1, 1.5, None, True):
            with self.assertRaisesRegex(ValueError, "offset must be a non-negative int"):
                models.state_layout(ssm, 2, 0, "fp32", slot_stride=1 << 16, offset=bad)
            with self.assertRaisesRegex(ValueError, "slot_stride must be a non-negative int"):
                models.state_layout(ssm, 2, 0, "fp32", slot_stride=bad)
        with self.assertRaisesRegex(ValueError, "one slot per request"):
            models.paged_layout(conv, conv.parts[0], 2, 0, 16, "nhd", "bf16")
        layout = models.paged_layout(full, full.parts[0], 2, 0, 16, "hnd", "bf16")
        self.assertEqual(layout, mori_tp.Layout.hnd(8, 2, 0, 16, 128 * 2))


# --- issue 34: one group, speculative tokens, state dtypes -----------------------------------

#: Small Mamba2 layers of one group (8 heads of 2 channels, d_state 3, kernel 4) in the three
#: spellings: Nemotron-H's, Falcon-H1's (every layer both), Granite-4.0-H's (layer_types).
SMALL_G1 = {
    "Nemotron-H": dict(SMALL, n_groups=1),
    "Falcon-H1": dict(FALCON_H1, num_hidden_layers=2, mamba_n_heads=8, mamba_d_head=2,
                      mamba_d_ssm=16, mamba_d_state=3),
    "Granite-4.0-H": dict(GRANITE_4_H, num_hidden_layers=2, layer_types=["mamba", "attention"],
                          hidden_size=8, num_attention_heads=4, num_key_value_heads=2,
                          mamba_n_heads=8, mamba_d_head=2, mamba_d_state=3),
}

#: TP pairings the engines take with 8 heads and one group.
G1_PAIRS = ((1, 2), (2, 4), (1, 4), (4, 1), (4, 2), (8, 2), (2, 8), (2, 2))


class OneGroupTest(unittest.TestCase):
    """n_groups = 1: B and C are held whole by every rank (vLLM's
    extra_groups_for_head_shards), and each decode rank must receive them whole from exactly one
    prefill rank: REFERENCE.md section 3's sender for a unit held whole, d * P / D."""

    def test_the_three_families_read_one_group_held_whole(self):
        for name, config in SMALL_G1.items():
            conv = models.from_config(config).group("conv_state")
            self.assertEqual([(p.name, p.units, p.elements) for p in conv.parts],
                             [("x", 8, 2), ("B", 1, 3), ("C", 1, 3)], name)

    def test_per_channel_across_orientations_moves_b_and_c_whole_from_one_sender(self):
        for name, config in SMALL_G1.items():
            for p_size, d_size in G1_PAIRS:
                for orients in (("sd", "ds"), ("ds", "sd")):
                    label = f"{name} {p_size}{orients[0]} -> {d_size}{orients[1]}"
                    with self.subTest(label):
                        senders = self.move_with((p_size, orients[0]), (d_size, orients[1]),
                                                 config)
                        for d in range(d_size):
                            for part in ("B", "C"):
                                self.assertEqual(senders[(d, part)], [d * p_size // d_size],
                                                 f"{label}: decode rank {d}, {part}")

    def move_with(self, prefill: Tuple[int, str], decode: Tuple[int, str],
                  config: dict) -> Dict[Tuple[int, str], List[int]]:
        return move_conv_state(self, prefill, decode, True, 6, config)

    def test_per_channel_without_the_prefill_tp_is_refused_with_the_numbers(self):
        conv = models.from_config(SMALL_G1["Falcon-H1"]).group("conv_state")
        with self.assertRaisesRegex(ValueError, "B and C of conv_state are 1 group of 3 "
                                    "channels held whole by every rank.*prefill_tp="):
            models.conv_state_layouts(conv, 2, 1, "ds", "bf16", slot_stride=1 << 12,
                                      per_channel=True)
        # Whole units of a group per rank need no prefill TP: the pairing is REFERENCE.md
        # section 3's.
        models.conv_state_layouts(conv, 2, 1, "ds", "bf16", slot_stride=1 << 12)
        with self.assertRaisesRegex(ValueError, "prefill_tp must be a positive int"):
            models.conv_state_layouts(conv, 2, 1, "ds", "bf16", slot_stride=1 << 12,
                                      per_channel=True, prefill_tp=0)
        # A TP size the engines cannot split the heads by is refused here too.
        with self.assertRaisesRegex(ValueError, "TP 3 does not divide the 8 x heads"):
            models.conv_state_layouts(conv, 3, 0, "ds", "bf16", slot_stride=1 << 12)

    def test_unit_layouts_of_one_group_move_in_either_orientation(self):
        for name, config in SMALL_G1.items():
            for p_size, d_size in G1_PAIRS:
                for orient in ("sd", "ds"):
                    with self.subTest(f"{name} {p_size} -> {d_size} {orient}"):
                        senders = move_conv_state(self, (p_size, orient), (d_size, orient),
                                                  False, 0, config)
                        for d in range(d_size):
                            self.assertEqual(senders[(d, "B")], [d * p_size // d_size])

    def test_the_plan_of_real_sized_one_group_models(self):
        for name, config in (("Falcon-H1", FALCON_H1), ("Granite-4.0-H", GRANITE_4_H),
                             ("Nemotron-H", NEMOTRON_G1)):
            facts = models.from_config(config)
            conv = facts.group("conv_state")
            heads = conv.parts[0].units
            for p_size, d_size in ((1, 2), (2, 4), (4, 2), (8, 1)):
                label = f"{name} {p_size} -> {d_size}"
                plan = models.plan(facts, p_size, d_size, 100)
                group = next(g for g in plan if g["name"] == "conv_state")
                for rank in group["decode_ranks"]:
                    self.assertEqual(rank["owned_units"]["B"], [0, 1], label)
                    x = heads // d_size
                    per_step = (x * conv.parts[0].elements + 2 * conv.parts[1].elements) * 2
                    self.assertEqual(rank["bytes_per_request"],
                                     per_step * 3 * len(conv.layers), label)
                for d in range(d_size):
                    b_senders = [pair["prefill_rank"] for pair in group["pairs"]
                                 if pair["decode_rank"] == d
                                 for part in pair["parts"]
                                 if part["part"] == "B" and part["action"] == "send"]
                    self.assertEqual(b_senders, [d * p_size // d_size], label)
                # The other prefill ranks that share x heads with a decode rank skip B and C.
                if p_size > d_size:
                    skips = [part for pair in group["pairs"] for part in pair["parts"]
                             if part["action"] == "skip_replica"]
                    self.assertTrue(skips, label)
                    self.assertTrue(all(part["part"] in ("B", "C") for part in skips), label)


class SpeculativeTokensTest(unittest.TestCase):
    """vLLM sizes a conv state kernel - 1 + num_spec rows (mamba2_state_shape and
    gated_delta_net_state_shape), for Mamba2 and Gated DeltaNet alike; an SSM state keeps one."""

    def test_qwen3_next_conv_state_layout_with_two_speculative_tokens(self):
        conv = models.from_config(QWEN3_NEXT).group("conv_state")
        for num_spec, rows in ((0, 3), (2, 5)):
            # DS, TP 2: q then k then v, each head's rows back to back (vLLM's (dim, state_len)).
            q_local, v_local = 16 * 128 // 2, 32 * 128 // 2
            stride = (2 * q_local + v_local) * rows * 2
            layouts = models.conv_state_layouts(conv, 2, 0, "ds", "bf16", slot_stride=stride,
                                                num_spec=num_spec)
            self.assertEqual(layouts["k"].offset, q_local * rows * 2)
            self.assertEqual(layouts["v"].offset, 2 * q_local * rows * 2)
            self.assertEqual(layouts["k"].head_bytes, 128 * rows * 2)
        self.assertEqual((conv.steps(2), conv.steps()), (5, 3))
        with self.assertRaisesRegex(ValueError, "num_spec must be a non-negative int"):
            models.conv_state_layouts(conv, 2, 0, "ds", "bf16", slot_stride=1 << 20, num_spec=-1)

    def test_a_conv_state_with_speculative_rows_moves_byte_for_byte(self):
        for orient in ("sd", "ds"):
            move_conv_state(self, (2, orient), (4, orient), False, 8, SMALL, num_spec=2)
            move_conv_state(self, (4, orient), (1, orient), False, 0, SMALL_GDN, num_spec=1)
        move_conv_state(self, (2, "sd"), (4, "ds"), True, 0, SMALL_G1["Granite-4.0-H"],
                        num_spec=3)

    def test_the_plan_lengthens_only_the_conv_state(self):
        for config in (QWEN3_NEXT, NEMOTRON):
            facts = models.from_config(config)
            base = models.plan(facts, 2, 2, 100)
            spec = models.plan(facts, 2, 2, 100, num_spec=2)
            for g0, g2 in zip(base, spec):
                if g0["name"] == "conv_state":
                    self.assertEqual((g0["slot_steps"], g2["slot_steps"]), (3, 5))
                    self.assertEqual(g2["decode_ranks"][0]["bytes_per_request"] * 3,
                                     g0["decode_ranks"][0]["bytes_per_request"] * 5)
                else:
                    self.assertEqual(g0, g2, g0["name"])


class StateDtypeTest(unittest.TestCase):
    """An fp8 KV cache leaves the states in their own dtypes: the conv state in
    mamba_cache_dtype (the model's dtype by default), the SSM state in mamba_ssm_cache_dtype (the
    config's, else fp32 for Nemotron-H, else the conv state's)."""

    def part_bytes(self, plan: List[dict], group: str, part: str) -> Tuple[int, str]:
        g = next(g for g in plan if g["name"] == group)
        p = next(p for p in g["parts"] if p["name"] == part)
        return p["unit_bytes"], p["dtype"]

    def test_an_fp8_cache_keeps_a_bf16_conv_state_and_the_ssm_state_vllm_chooses(self):
        # The Nemotron-H: x at 128 B, not 64; the SSM state at fp32 (vLLM's
        # Nemotron-H default: its config names none), not 8,192 B.
        facts = models.from_config(dict(NEMOTRON, architectures=["NemotronHForCausalLM"]))
        plan = models.plan(facts, 1, 2, 100, dtype="fp8")
        self.assertEqual(self.part_bytes(plan, "full_attention", "kv"), (128, "fp8"))
        self.assertEqual(self.part_bytes(plan, "conv_state", "x"), (64 * 2, "bf16"))
        self.assertEqual(self.part_bytes(plan, "ssm_state", "state"), (64 * 128 * 4, "fp32"))
        conv = next(g for g in plan if g["name"] == "conv_state")
        # x 64 heads of 64, B and C 4 groups of 128, 3 rows, 24 layers, bf16: 737,280 B.
        self.assertEqual(conv["decode_ranks"][0]["bytes_per_request"],
                         (64 * 64 + 2 * 4 * 128) * 3 * 24 * 2)
        # Without the architecture (another Mamba2 model), the SSM state follows the conv state.
        plain = models.plan(models.from_config(NEMOTRON), 1, 2, 100, dtype="fp8")
        self.assertEqual(self.part_bytes(plain, "ssm_state", "state"), (64 * 128 * 2, "bf16"))
        # Qwen3-Next with an fp8 cache: conv and recurrent state in the model's bf16.
        qwen = models.plan(models.from_config(QWEN3_NEXT), 2, 2, 100, dtype="fp8")
        self.assertEqual(self.part_bytes(qwen, "full_attention", "kv"), (256, "fp8"))
        self.assertEqual(self.part_bytes(qwen, "conv_state", "v"), (256, "bf16"))
        self.assertEqual(self.part_bytes(qwen, "recurrent_state", "state"),
                         (128 * 128 * 2, "bf16"))

    def test_the_engine_dtypes_override_the_defaults_one_by_one(self):
        facts = models.from_config(QWEN3_NEXT)
        plan = models.plan(facts, 2, 2, 10, mamba_cache_dtype="float32",
                           mamba_ssm_cache_dtype="fp16")
        self.assertEqual(self.part_bytes(plan, "conv_state", "q"), (128 * 4, "fp32"))
        self.assertEqual(self.part_bytes(plan, "recurrent_state", "state"),
                         (128 * 128 * 2, "fp16"))
        self.assertEqual(self.part_bytes(plan, "full_attention", "kv"), (256 * 2, "bf16"))
        # ssm_dtype is mamba_ssm_cache_dtype's older name; the two must not disagree.
        self.assertEqual(models.plan(facts, 2, 2, 10, ssm_dtype="fp32"),
                         models.plan(facts, 2, 2, 10, mamba_ssm_cache_dtype="float32"))
        with self.assertRaisesRegex(ValueError, "disagree"):
            models.plan(facts, 2, 2, 10, ssm_dtype="fp32", mamba_ssm_cache_dtype="bf16")
        self.assertEqual(models.state_dtypes(facts), ("bf16", "bf16"))
        self.assertEqual(models.state_dtypes(facts, "auto", "auto"), ("bf16", "bf16"))
        self.assertEqual(models.state_dtypes(models.from_config(NEMOTRON_G1)), ("bf16", "fp32"))
        named = dict(QWEN3_NEXT, mamba_ssm_dtype="float32", torch_dtype="float16")
        self.assertEqual(models.state_dtypes(models.from_config(named)), ("fp16", "fp32"))


if __name__ == "__main__":
    unittest.main()

"""vLLM 0.34.0's real Scheduler with MoriTpConnector loaded by module path
(``kv_connector_module_path="mori_tp.vllm.connector"``), on CPU, the hybrid KV cache manager on
(the factory then refuses a connector that is not SupportsHMA, checked here too):

- decode (kv_consumer): a ``do_remote_prefill`` request waits for remote KV
  (WAITING_FOR_REMOTE_KVS) with its blocks in the step's metadata (``reqs_to_recv``), is not
  loaded twice, is scheduled once a worker reports ``finished_recving`` (its last prompt token
  recomputed), runs to its end and frees every block; a failed receive (``failed_recving``)
  releases the request too;
- prefill (kv_producer): a ``do_remote_decode`` request with a chunked prompt appears in
  ``reqs_to_send`` only in the step that computes its last prompt token, with all its blocks;
  when it finishes its blocks are held (request_finished_all_groups returned True) until a
  worker reports ``finished_sending``, then freed.

    <venv>/bin/python python/tests/vllm/vllm_scheduler.py

Exit status: 0 passed, 1 failed, 77 skipped (no vLLM; with MORI_TP_REQUIRE_TOOLS=1 that is a
failure, decided by tests/vllm.rs).
"""

from __future__ import annotations

import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from vllm_common import require_vllm, vllm_config  # noqa: E402

require_vllm()

from vllm import SamplingParams  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

import torch  # noqa: E402

from mori_tp.vllm.connector import MoriTpConnector, MoriTpMetadata  # noqa: E402

BLOCK = 16
NUM_BLOCKS = 100
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def check(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


def make_scheduler(role: str) -> Scheduler:
    # The hybrid manager on (vllm_config): the scheduler calls request_finished_all_groups.
    config = vllm_config(role, side_port=47000)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=4, head_size=32,
                             dtype=torch.bfloat16)
    kv_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                              kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    return Scheduler(vllm_config=config, kv_cache_config=kv_config,
                     structured_output_manager=StructuredOutputManager(config),
                     block_size=BLOCK, log_stats=True)


def make_request(req_id: str, tokens: int, max_tokens: int, params: dict,
                 first: int = 3) -> Request:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sampling.update_from_generation_config({}, 2)
    request = Request(request_id=req_id, prompt_token_ids=list(range(first, first + tokens)),
                      sampling_params=sampling, pooling_params=None, mm_features=None,
                      block_hasher=get_request_block_hasher(BLOCK, sha256))
    request.kv_transfer_params = dict(params)
    return request


def free_blocks(scheduler: Scheduler) -> int:
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def output(scheduled, sampled=None, finished_sending=(), finished_recving=(),
           failed_recving=()) -> ModelRunnerOutput:
    """What the workers would return for ``scheduled``: one sampled token per scheduled request
    that finished its prompt (``sampled``), and the connector's transfer results."""
    sampled = sampled or {}
    req_ids = list(scheduled.num_scheduled_tokens)
    kv = KVConnectorOutput(finished_sending=set(finished_sending) or None,
                           finished_recving=set(finished_recving) or None,
                           failed_recving=set(failed_recving))
    return ModelRunnerOutput(req_ids=req_ids,
                             sampled_token_ids=[sampled.get(r, []) for r in req_ids],
                             kv_connector_output=kv)


def test_factory_needs_hma() -> None:
    config = vllm_config("kv_consumer")
    check(config.scheduler_config.disable_hybrid_kv_cache_manager is False, "HMA is off")
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, None)
    check(isinstance(connector, MoriTpConnector), f"the factory made {type(connector)}")
    # The same config naming a connector that is not SupportsHMA is refused.
    config.kv_transfer_config.kv_connector = "NotHma"
    sys.modules["mori_tp_not_hma"] = type(sys)("mori_tp_not_hma")

    class NotHma(MoriTpConnector.__mro__[1]):  # KVConnectorBase_V1 alone
        pass

    sys.modules["mori_tp_not_hma"].NotHma = NotHma
    config.kv_transfer_config.kv_connector_module_path = "mori_tp_not_hma"
    try:
        KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, None)
    except ValueError as error:
        check("does not support HMA" in str(error), f"refused with {error}")
    else:
        raise AssertionError("the factory took a connector without SupportsHMA")
    print("ok: the factory makes MoriTpConnector with HMA on and refuses one without SupportsHMA")


def test_decode() -> None:
    scheduler = make_scheduler("kv_consumer")
    check(isinstance(scheduler.connector, MoriTpConnector), "scheduler has no MoriTpConnector")
    initial = free_blocks(scheduler)
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 47000,
              "remote_tp_size": 2, "transfer_id": "t-1"}
    request = make_request("r1", 40, 3, params)
    scheduler.add_request(request)
    step = scheduler.schedule()
    meta = step.kv_connector_metadata
    check(isinstance(meta, MoriTpMetadata), f"metadata {type(meta)}")
    check(list(meta.reqs_to_recv) == ["r1"] and not meta.reqs_to_send, f"metadata {meta}")
    spec = meta.reqs_to_recv["r1"]
    blocks = scheduler.kv_cache_manager.get_block_ids("r1")[0]
    check(spec.block_ids == blocks and len(blocks) == 3, f"blocks {spec.block_ids} vs {blocks}")
    check((spec.num_tokens, spec.num_computed_tokens, spec.transfer_id, spec.remote_port,
           spec.remote_tp_size) == (40, 0, "t-1", 47000, 2), f"spec {spec}")
    check(request.status == RequestStatus.WAITING_FOR_REMOTE_KVS, f"status {request.status}")
    check("r1" not in step.num_scheduled_tokens, "a waiting request was scheduled")
    check(free_blocks(scheduler) == initial - 3, "blocks not held while loading")
    scheduler.update_from_output(step, output(step))
    # Still loading: nothing scheduled, not asked to load again.
    step = scheduler.schedule()
    check(not step.kv_connector_metadata.reqs_to_recv, "the request was loaded twice")
    check("r1" not in step.num_scheduled_tokens, "scheduled before its KV arrived")
    scheduler.update_from_output(step, output(step, finished_recving={"r1"}))
    step = scheduler.schedule()
    check(step.num_scheduled_tokens.get("r1") == 1,
          f"after the load, scheduled {step.num_scheduled_tokens} (the last token recomputed)")
    check(not step.kv_connector_metadata.reqs_to_recv, "loaded again after finishing")
    tokens = 0
    while request.status == RequestStatus.RUNNING and tokens < 10:
        scheduler.update_from_output(step, output(step, sampled={"r1": [7]}))
        tokens += 1
        step = scheduler.schedule()
    check(request.is_finished() and tokens == 3, f"status {request.status} after {tokens}")
    scheduler.update_from_output(step, output(step))
    check(free_blocks(scheduler) == initial, f"{initial - free_blocks(scheduler)} blocks leaked")

    # A failed receive: reported in failed_recving and finished_recving; vLLM 0.34.0's default
    # policy (kv_load_failure_policy "fail") ends the request with an error, and nothing
    # leaks.
    failed = make_request("r2", 40, 1, dict(params, transfer_id="t-2"))
    scheduler.add_request(failed)
    step = scheduler.schedule()
    check(list(step.kv_connector_metadata.reqs_to_recv) == ["r2"], "r2 not in the metadata")
    scheduler.update_from_output(step, output(step, finished_recving={"r2"},
                                              failed_recving={"r2"}))
    step = scheduler.schedule()
    check(failed.status == RequestStatus.FINISHED_ERROR and "r2" not in step.num_scheduled_tokens,
          f"a failed load left {failed.status}, scheduled {step.num_scheduled_tokens}")
    scheduler.update_from_output(step, output(step))
    check(free_blocks(scheduler) == initial,
          f"{failed.status}, {initial - free_blocks(scheduler)} blocks leaked")
    print("ok: decode: waits for remote KV, loads once, runs after finished_recving, frees "
          "every block; a failed receive ends the request and frees its blocks")


def test_prefill() -> None:
    scheduler = make_scheduler("kv_producer")
    initial = free_blocks(scheduler)
    request = make_request("p1", 300, 1, {"do_remote_decode": True, "transfer_id": "t-9"})
    scheduler.add_request(request)
    step = scheduler.schedule()
    check(step.num_scheduled_tokens.get("p1") == 256, f"first chunk {step.num_scheduled_tokens}")
    check(not step.kv_connector_metadata.reqs_to_send, "sent before the prompt was computed")
    scheduler.update_from_output(step, output(step))
    step = scheduler.schedule()
    meta = step.kv_connector_metadata
    check(list(meta.reqs_to_send) == ["p1"], f"last chunk metadata {meta}")
    spec = meta.reqs_to_send["p1"]
    blocks = scheduler.kv_cache_manager.get_block_ids("p1")[0]
    check(spec.block_ids == blocks and len(blocks) == 19 and spec.num_tokens == 300
          and spec.transfer_id == "t-9", f"send spec {spec} vs blocks {blocks}")
    scheduler.update_from_output(step, output(step, sampled={"p1": [9]}))
    check(request.is_finished(), f"status {request.status}")
    check(free_blocks(scheduler) == initial - 19,
          f"blocks freed before the send finished: {initial - free_blocks(scheduler)} held")
    step = scheduler.schedule()
    check(not step.kv_connector_metadata.reqs_to_send, "sent twice")
    scheduler.update_from_output(step, output(step, finished_sending={"p1"}))
    check(free_blocks(scheduler) == initial, f"{initial - free_blocks(scheduler)} blocks leaked")

    # A request that finishes before its prompt is computed (aborted) holds nothing (other
    # tokens than p1's: no prefix hit).
    aborted = make_request("p2", 300, 1, {"do_remote_decode": True}, first=400)
    scheduler.add_request(aborted)
    step = scheduler.schedule()
    check(not step.kv_connector_metadata.reqs_to_send, "p2 sent before its prompt was computed")
    scheduler.update_from_output(step, output(step))
    scheduler.finish_requests("p2", RequestStatus.FINISHED_ABORTED)
    check(free_blocks(scheduler) == initial, "an aborted request kept its blocks")
    print("ok: prefill: sent in the step of its last prompt token with every block; blocks "
          "held until finished_sending, then freed; an aborted request holds nothing")


def main() -> int:
    init_none_hash(sha256)
    failed = 0
    for test in (test_factory_needs_hma, test_decode, test_prefill):
        try:
            test()
        except Exception:  # noqa: BLE001 - reported, the next test runs
            failed += 1
            print(f"FAIL: {test.__name__}")
            traceback.print_exc()
    passed = 3 - failed
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

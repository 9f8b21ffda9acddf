"""The CPU-checkable parts of the NCCL weight sync: bucket planning, packing, checksum, and the
names/shapes the learner sends against what the server's validator expects.

The broadcasts themselves need two GPUs (tests/gpu/test_nccl_sync.py).
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

from learner.sync.nccl_buckets import fill_bucket, plan_buckets
from learner.sync.zero3 import iter_gathered_params, param_specs, strip_wrappers
from rollout_server.engine.vllm_engine import hf_weight_metadata
from rollout_server.nccl_wire import bucket_layout, unflatten
from rollout_server.protocol import NcclUpdateRequest, TensorSpec
from rollout_server.weight_digest import flat_checksum, name_weight
from rollout_server.weights.validation import validate_nccl_announce

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def spec(name: str, dtype: str, *shape: int) -> TensorSpec:
    return TensorSpec(name=name, dtype=dtype, shape=list(shape))


def test_plan_buckets_by_hand() -> None:
    specs = [
        spec("a", "bfloat16", 10, 10),  # 200 B
        spec("b", "bfloat16", 100),  # 200 B -> a+b = 400 B fits in 400
        spec("c", "bfloat16", 1),  # 2 B -> would make 402: new bucket
        spec("d", "float32", 3),  # dtype change: new bucket
        spec("e", "float32", 1000),  # 4000 B > 400: a bucket of its own
        spec("f", "float32", 2),
    ]
    plan = plan_buckets(specs, bucket_bytes=400)
    assert plan.buckets == [[0, 1], [2], [3], [4], [5]]
    assert plan.dtypes == ["bfloat16", "bfloat16", "float32", "float32", "float32"]
    assert plan_buckets(specs, 1 << 30).buckets == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(specs, 0)
    with pytest.raises(ValueError, match=r"'x'.*complex64"):
        plan_buckets([spec("x", "complex64", 2)], 100)


def test_layout_offsets_and_round_trip_through_a_flat_bucket() -> None:
    torch.manual_seed(0)
    specs = [spec("w", "bfloat16", 3, 4), spec("b", "bfloat16", 4), spec("v", "bfloat16", 2, 2)]
    tensors = [torch.randn(3, 4), torch.randn(4), torch.randn(2, 2)]  # float32: cast on copy
    plan = plan_buckets(specs, 1 << 20)
    (bucket,) = bucket_layout([s.model_dump() for s in specs], plan.buckets, plan.dtypes)
    assert [(e.offset, e.numel) for e in bucket.entries] == [(0, 12), (12, 4), (16, 4)]
    assert bucket.numel == 20 and bucket.dtype == torch.bfloat16 and bucket.nbytes == 40
    flat = torch.empty(bucket.numel, dtype=bucket.dtype)
    fill_bucket(flat, bucket, iter(zip(["w", "b", "v"], tensors, strict=True)))
    for (name, view), want_name, want in zip(unflatten(flat, bucket), "wbv", tensors, strict=True):
        assert name == want_name
        assert torch.equal(view, want.to(torch.bfloat16))
        assert view.data_ptr() >= flat.data_ptr()  # a view into the bucket, not a copy


def test_segments_by_hand() -> None:
    """Runs of whole tensors of at most segment_bytes; a larger tensor alone; in order."""
    specs = [
        spec("a", "bfloat16", 50),  # 100 B
        spec("b", "bfloat16", 50),  # 100 B: a+b = 200 fits in 200
        spec("c", "bfloat16", 150),  # 300 B > 200: alone
        spec("d", "bfloat16", 5),  # 10 B
        spec("e", "bfloat16", 5),
    ]
    plan = plan_buckets(specs, 1 << 20)
    (bucket,) = bucket_layout([s.model_dump() for s in specs], plan.buckets, plan.dtypes)
    segs = bucket.segments(200)
    assert [(g.first, g.stop, g.offset, g.numel) for g in segs] == [
        (0, 2, 0, 100),
        (2, 3, 100, 150),
        (3, 5, 250, 10),
    ]
    assert [(g.first, g.stop) for g in bucket.segments(1 << 20)] == [(0, 5)]
    assert [(g.first, g.stop) for g in bucket.segments(1)] == [(k, k + 1) for k in range(5)]
    with pytest.raises(ValueError, match="segment_bytes"):
        bucket.segments(0)


def test_segments_tile_every_bucket_of_a_real_model(tiny_model_dir) -> None:
    """For a Qwen3 model's layout, at any segment size: the segments cover each bucket's flat
    buffer exactly, back to back, and only single tensors exceed segment_bytes; the packed
    segments hold exactly the tensors a whole-bucket fill would put there."""
    from transformers import AutoModelForCausalLM

    from learner.sync.nccl_buckets import segment_views, take_tensors
    from rollout_server.nccl_wire import copy_all

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    specs = param_specs(model, dtype=torch.bfloat16)
    plan = plan_buckets(specs, bucket_bytes=256 * 1024)
    layout = bucket_layout([s.model_dump() for s in specs], plan.buckets, plan.dtypes)
    for segment_bytes in (1 << 10, 40 * 1024, 1 << 20):
        it = iter_gathered_params(model)
        whole = iter_gathered_params(model)
        for bucket in layout:
            segs = bucket.segments(segment_bytes)
            assert segs[0].first == 0 and segs[-1].stop == len(bucket.entries)
            assert all(a.stop == b.first for a, b in itertools.pairwise(segs))
            assert all(a.offset + a.numel == b.offset for a, b in itertools.pairwise(segs))
            assert segs[-1].offset + segs[-1].numel == bucket.numel
            assert all(g.numel * 2 <= segment_bytes for g in segs if g.stop - g.first > 1)
            flat = torch.empty(bucket.numel, dtype=bucket.dtype)
            for g in segs:
                parts = take_tensors(bucket.entries[g.first : g.stop], it)
                views = segment_views(flat.narrow(0, g.offset, g.numel), bucket, g)
                assert [tuple(v.shape) for v in views] == [tuple(t.shape) for t in parts]
                copy_all(views, parts)
            expected = torch.empty_like(flat)
            fill_bucket(expected, bucket, whole)
            assert torch.equal(flat, expected)
        assert next(it, None) is None


def test_segment_bytes_has_a_floor() -> None:
    from pydantic import ValidationError

    specs = [spec("a", "bfloat16", 4)]
    assert (
        NcclUpdateRequest(tensors=specs, buckets=[[0]], bucket_dtypes=["bfloat16"]).segment_bytes
        == 64 << 20
    )
    with pytest.raises(ValidationError, match="segment_bytes"):
        NcclUpdateRequest(
            tensors=specs, buckets=[[0]], bucket_dtypes=["bfloat16"], segment_bytes=1024
        )


def test_fill_refuses_a_stream_that_disagrees_with_the_specs() -> None:
    specs = [spec("w", "float32", 2), spec("b", "float32", 2)]
    plan = plan_buckets(specs, 1 << 20)
    (bucket,) = bucket_layout([s.model_dump() for s in specs], plan.buckets, plan.dtypes)
    flat = torch.empty(4)
    with pytest.raises(ValueError, match=r"yielded 'b' \[2\] where the specs announced 'w'"):
        fill_bucket(flat, bucket, iter([("b", torch.ones(2))]))
    with pytest.raises(ValueError, match=r"'w' \[3\] where the specs announced 'w' \[2\]"):
        fill_bucket(flat, bucket, iter([("w", torch.ones(3))]))
    with pytest.raises(ValueError, match="ended before 'b'"):
        fill_bucket(flat, bucket, iter([("w", torch.ones(2))]))


def test_flat_checksum_by_hand_and_independent_of_chunking() -> None:
    x = torch.tensor([1.0, 2.0, 3.0, -0.5])

    def by_hand(values: list[float], bucket: int, start: int) -> float:
        total = 0.0
        for i, v in enumerate(values, start):
            a, b = i * 0.6180339887498949, i * 0.41421356237309515
            total += v * (1 + a - math.floor(a)) + v * v * (1 + b - math.floor(b))
        return total * name_weight(f"bucket {bucket}")

    want = by_hand(x.tolist(), 0, 0)
    assert flat_checksum(x).item() == pytest.approx(want, rel=1e-15)
    assert flat_checksum(x, chunk=3).item() == pytest.approx(want, rel=1e-15)
    assert flat_checksum(x.to(torch.bfloat16), chunk=1).item() == pytest.approx(want, rel=1e-15)
    # the learner sums segments, the server whole buckets: the same number
    segments = flat_checksum(x[:3], 2, 0) + flat_checksum(x[3:], 2, 3)
    assert segments.item() == pytest.approx(flat_checksum(x, 2).item(), rel=1e-12)
    assert flat_checksum(x, 2).item() == pytest.approx(by_hand(x.tolist(), 2, 0), rel=1e-15)
    y = torch.randn(1000, dtype=torch.float64)
    ref = by_hand(y.tolist(), 0, 0)
    assert flat_checksum(y.float(), chunk=128).item() == pytest.approx(
        by_hand(y.float().double().tolist(), 0, 0), rel=1e-12
    )
    assert flat_checksum(y, chunk=7).item() == pytest.approx(ref, rel=1e-12)


def test_flat_checksum_sees_moved_values() -> None:
    """A plain sum cannot tell a permuted bucket, or the same bytes in another bucket."""
    x = torch.randn(64)
    same = flat_checksum(x.clone()).item()
    assert flat_checksum(x).item() == same
    assert flat_checksum(x.flip(0)).item() != pytest.approx(same, rel=1e-9)
    assert flat_checksum(x, 1).item() != pytest.approx(same, rel=1e-9)


def test_strip_wrappers() -> None:
    assert strip_wrappers("module._orig_mod.model.norm.weight") == "model.norm.weight"
    assert strip_wrappers("_orig_mod.module.lm_head.weight") == "lm_head.weight"
    assert strip_wrappers("model.module_list.0") == "model.module_list.0"


class Wrapper(torch.nn.Module):
    """What DeepSpeed/DDP do to names: the model under ``module``."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


def test_learner_specs_match_the_servers_metadata(tiny_model_dir) -> None:
    """What the learner announces for a wrapped model passes the server's own validator against
    the vLLM engine's metadata, and the stream yields exactly the announced tensors."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    wrapped = Wrapper(torch.compile(model))  # names: module._orig_mod.model...
    specs = param_specs(wrapped, dtype=torch.bfloat16)
    stream = list(iter_gathered_params(wrapped))
    assert [s.name for s in specs] == [n for n, _ in stream]
    assert [n for n, _ in stream] == [n for n, _ in model.named_parameters()]
    assert all(list(t.shape) == s.shape for s, (_, t) in zip(specs, stream, strict=True))
    assert {s.dtype for s in specs} == {"bfloat16"}

    metadata = hf_weight_metadata(str(tiny_model_dir), "bfloat16")
    # The metadata also has the tied alias, as the HF checkpoint does.
    assert set(metadata) == set(model.state_dict())
    assert all(metadata[k].shape == tuple(v.shape) for k, v in model.state_dict().items())
    plan = plan_buckets(specs, bucket_bytes=64 * 1024)
    request = NcclUpdateRequest(tensors=specs, buckets=plan.buckets, bucket_dtypes=plan.dtypes)
    assert len(plan.buckets) > 1
    nbytes = validate_nccl_announce(request, metadata, ITEMSIZE)
    assert nbytes == sum(2 * p.numel() for p in model.parameters())
    wrong = param_specs(wrapped)  # float32: the server serves bfloat16 and refuses casts
    bad = NcclUpdateRequest(
        tensors=wrong, buckets=[list(range(len(wrong)))], bucket_dtypes=["float32"]
    )
    from rollout_server.engine.base import WeightsError

    with pytest.raises(WeightsError, match="dtype float32, the model's is bfloat16"):
        validate_nccl_announce(bad, metadata, ITEMSIZE)


def test_the_parameter_stream_is_lazy(tiny_model_dir) -> None:
    """A sync starts sending the first tensor before the rest are even listed."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    listed = []

    def named_parameters(*args, **kwargs):
        for name, p in type(model).named_parameters(model, *args, **kwargs):
            listed.append(name)
            yield name, p

    model.named_parameters = named_parameters  # type: ignore[method-assign]
    stream = iter_gathered_params(model)
    first = next(stream)
    assert len(listed) == 1 and first[0] == strip_wrappers(listed[0])
    rest = list(stream)
    assert [n for n, _ in [first, *rest]] == [strip_wrappers(n) for n in listed]
    assert len(listed) == len(list(type(model).named_parameters(model)))


def test_the_engine_queues_updates_with_the_workers_argument_order() -> None:
    """``begin_update_args`` feeds ``grpo_begin_update`` positionally: its order must be
    the worker's, or a field (``ack``, ``prepared``) would land in another's place."""
    import inspect

    from rollout_server.engine.vllm_updates import begin_update_args
    from rollout_server.engine.vllm_worker import WeightSyncWorkerExtension
    from rollout_server.settings import ServerSettings

    settings = ServerSettings(model="/m", engine="vllm", direct_weight_copy=False)
    request = NcclUpdateRequest(
        tensors=[spec("w", "bfloat16", 4)],
        buckets=[[0]],
        bucket_dtypes=["bfloat16"],
        checksum=True,
        segment_bytes=1 << 20,
        ack=True,
    )
    names = list(inspect.signature(WeightSyncWorkerExtension.grpo_begin_update).parameters)
    queued = begin_update_args(request, settings.direct_weight_copy, True, "/tmp/flag")
    args = dict(zip(names[2:], queued, strict=True))
    assert args == {
        "buckets": [[0]],
        "bucket_dtypes": ["bfloat16"],
        "checksum": True,
        "direct": False,
        "segment_bytes": 1 << 20,
        "prepared": True,
        "ack": True,
        "cancel_path": "/tmp/flag",
        "adapter_dir": None,
    }
    # an adapter is written where the engine loads it from, never copied into the parameters
    adapter = dict(zip(names[2:], begin_update_args(request, True, False, None, "/a"), strict=True))
    assert adapter["adapter_dir"] == "/a" and adapter["direct"] is False
    # the worker hands them on to the receiver in the same order
    from rollout_server.engine.nccl_receiver import NcclReceiver

    assert list(inspect.signature(NcclReceiver.begin).parameters)[1:] == names[1:]
    assert NcclUpdateRequest(tensors=[], buckets=[], bucket_dtypes=[]).ack is False


def test_the_sender_runs_its_broadcasts_on_one_kept_thread() -> None:
    """No thread starts on a sync's critical path: one daemon thread runs every job in turn
    and survives a failing one."""
    import asyncio
    import threading

    from learner.sync.nccl_broadcast import DaemonWorker

    worker = DaemonWorker()

    async def main() -> list:
        first = await worker.submit(threading.get_ident)
        with pytest.raises(ValueError, match="boom"):
            await worker.submit(lambda: (_ for _ in ()).throw(ValueError("boom")))
        after = await asyncio.gather(*(worker.submit(threading.get_ident) for _ in range(3)))
        return [first, *after]

    idents = asyncio.run(main())
    assert len(set(idents)) == 1 and idents[0] != threading.get_ident()
    assert worker._thread is not None and worker._thread.daemon


def test_a_cancel_flag_ends_a_wait_from_another_process(tmp_path) -> None:
    """What the server's init does to a commit its workers wait in: the flag's file, made by
    another process, ends ``wait_event`` with the flag's reason (the group aborted), within
    the flag's check interval; unset, the wait runs to its own timeout."""
    import subprocess
    import sys
    import threading
    import time

    from rollout_server.nccl_wire import CancelFlag, NcclGroupError, wait_event

    class Never:  # a CUDA event whose work never completes (the bytes never come)
        def query(self) -> bool:
            return False

    flag = CancelFlag(str(tmp_path / "cancel"), "cancelled by the server", check_every_s=0.01)
    assert not flag.is_set()
    setter = threading.Timer(
        0.3, subprocess.run, [[sys.executable, "-c", f"open({flag.path!r}, 'a').close()"]]
    )
    setter.start()
    t0 = time.monotonic()
    with pytest.raises(NcclGroupError, match="commit word: cancelled by the server; the weight"):
        wait_event(Never(), None, 30.0, "commit word", flag)
    assert 0.3 <= time.monotonic() - t0 < 10
    setter.join()
    flag.remove()
    flag.remove()  # twice: nothing to remove is fine
    unset = CancelFlag.new("never raised")
    assert not unset.is_set() and not Path(unset.path).exists()
    t0 = time.monotonic()
    with pytest.raises(NcclGroupError, match="no progress for 0 s"):
        wait_event(Never(), None, 0.2, "segment 1/1", unset)
    assert time.monotonic() - t0 >= 0.2

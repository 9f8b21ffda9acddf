"""Prepared NCCL updates through a real server: ``/weights/nccl/prepare`` holds generation paused
until ``/weights/nccl/commit`` (or expiry, a new init, a failed commit), and refuses what would
collide with it.

NCCL cannot run on CPU, so the service is driven with the transformers engine plus a stand-in
transport: the "broadcast" is a safetensors file the test writes, and the commit loads it with
the engine's real ``load_weights``. The vLLM path (real NCCL) is ``tests/gpu/test_nccl_sync.py``.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file, save_file

from rollout_server.engine.base import EngineError, ReceivedUpdate
from rollout_server.engine.transformers_engine import TransformersEngine
from rollout_server.settings import ServerSettings
from rollout_server.tiny import save_tiny_model
from rollout_server.weight_digest import params_checksum

PROBE = {"prompts": ["probe"], "max_tokens": 4, "seed": 0, "ignore_eos": True}


class FileTransportEngine(TransformersEngine):
    """The transformers engine with the prepare/commit half of the NCCL interface, its bytes
    arriving in ``inbox`` instead of over NCCL."""

    def __init__(self, settings: ServerSettings, inbox: Path) -> None:
        super().__init__(settings)
        self.inbox = inbox
        self.prepared = None
        self.dropped = 0
        self.cancel = asyncio.Event()  # as vLLM's workers' CancelFlag: ends a waiting commit

    async def init_weight_group(self, request) -> None:  # no group to form on CPU
        pass

    async def prepare_nccl_update(self, request) -> None:
        self.prepared = request

    async def commit_nccl_update(self, request) -> ReceivedUpdate:
        assert self.prepared is request
        self.prepared = None
        self.cancel.clear()
        while not self.inbox.exists():  # a commit posted before the broadcast: wait for it
            if self.cancel.is_set():
                raise EngineError("cancelled: the weight-sync group is being formed again")
            await asyncio.sleep(0.01)
        tensors = load_file(self.inbox)
        missing = {t.name for t in request.tensors} - tensors.keys()
        if missing:
            raise EngineError(f"the broadcast lacked {sorted(missing)[:2]}")
        await self.load_weights(tensors.items())
        return ReceivedUpdate(loader="load_weights", prefix_cache_reset=True)

    async def cancel_nccl_commit(self) -> bool:
        self.cancel.set()
        return True

    async def drop_prepared_update(self) -> None:
        self.dropped += 1
        self.prepared = None


@pytest.fixture(scope="module")
def model_b(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-b"), seed=1)


def _announce(engine: TransformersEngine, model_dir: Path) -> dict:
    """An announce of every tensor of the checkpoint (a tied ``lm_head`` is not one)."""
    names = load_file(model_dir / "model.safetensors").keys()
    meta = engine.weight_metadata()
    tensors = [{"name": n, "dtype": meta[n].dtype, "shape": list(meta[n].shape)} for n in names]
    dtypes = sorted({t["dtype"] for t in tensors})
    buckets = [[i for i, t in enumerate(tensors) if t["dtype"] == d] for d in dtypes]
    return {"tensors": tensors, "buckets": buckets, "bucket_dtypes": dtypes}


def _init(timeout_s: float) -> dict:
    return {"master_address": "127.0.0.1", "master_port": 29999, "world_size": 2,
            "timeout_s": timeout_s}  # fmt: skip


def test_engines_without_nccl_refuse_to_prepare(start_server, tiny_model_dir) -> None:
    with start_server(ServerSettings(model=str(tiny_model_dir))) as server:
        r = httpx.post(
            f"{server.url}/weights/nccl/prepare",
            json=_announce(server.core.engine, tiny_model_dir),
        )
        assert r.status_code == 501 and "NCCL" in r.json()["detail"]
        # nothing is held: generation and sleep go on
        assert httpx.post(f"{server.url}/generate", json=PROBE, timeout=60).status_code == 200
        r = httpx.post(f"{server.url}/weights/nccl/commit", json={"prepared_id": "nope"})
        assert r.status_code == 409 and "prepare the update again" in r.json()["detail"]


async def test_prepare_holds_generation_until_commit_expiry_or_init(
    start_server, tiny_model_dir, model_b, tmp_path
) -> None:
    settings = ServerSettings(model=str(tiny_model_dir))
    inbox = tmp_path / "broadcast.safetensors"
    engine = FileTransportEngine(settings, inbox)
    with start_server(settings, engine) as server:
        announce = _announce(engine, model_b)
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            assert (await http.post("/weights/nccl/init", json=_init(1.5))).status_code == 200

            # 1. prepare, then a generation waits; updates, sleep and another prepare are refused
            r = await http.post("/weights/nccl/prepare", json=announce)
            assert r.status_code == 200, r.text
            pid = r.json()["prepared_id"]
            assert r.json()["expires_s"] == 1.5
            waiting = asyncio.ensure_future(http.post("/generate", json=PROBE))
            await asyncio.sleep(0.5)
            assert not waiting.done(), "a generation ran while an update was prepared"
            for path, body in [("/sleep", {"level": 1}), ("/weights/nccl/prepare", announce),
                               ("/weights/load_file", {"path": str(model_b)})]:  # fmt: skip
                refused = await http.post(path, json=body)
                assert refused.status_code == 409, (path, refused.text)
                assert pid in refused.json()["detail"], refused.text
            save_file(load_file(model_b / "model.safetensors"), inbox)  # the "broadcast"
            r = await http.post("/weights/nccl/commit", json={"prepared_id": pid})
            assert r.status_code == 200, r.text
            assert r.json()["weight_version"] == 1
            generated = await waiting
            assert generated.json()["results"][0]["samples"][0]["weight_version"] == 1
            served = (await http.get("/weights/checksum")).json()["checksum"]
            assert served == pytest.approx(params_checksum(engine.model), rel=1e-12)
            r = await http.post("/weights/nccl/commit", json={"prepared_id": pid})
            assert r.status_code == 409  # committed once

            # 2. never committed: dropped after the group's timeout, generation resumes
            start = time.monotonic()
            pid = (await http.post("/weights/nccl/prepare", json=announce)).json()["prepared_id"]
            generated = await http.post("/generate", json=PROBE)
            assert time.monotonic() - start >= 1.0, "the generation did not wait for the expiry"
            assert generated.json()["results"][0]["samples"][0]["weight_version"] == 1
            assert engine.dropped == 1
            r = await http.post("/weights/nccl/commit", json={"prepared_id": pid})
            assert r.status_code == 409 and "expiry" in r.json()["detail"]

            # 3. a learner that restarts: its init drops the stale prepared update at once
            await http.post("/weights/nccl/prepare", json=announce)
            assert (await http.post("/weights/nccl/init", json=_init(30))).status_code == 200
            assert engine.dropped == 2
            assert (await http.post("/generate", json=PROBE)).status_code == 200

            # 4. a failed commit: nothing loads, the update is dropped, generation resumes
            pid = (await http.post("/weights/nccl/prepare", json=announce)).json()["prepared_id"]
            partial = load_file(model_b / "model.safetensors")
            partial.pop(next(iter(partial)))
            save_file(partial, inbox)
            r = await http.post("/weights/nccl/commit", json={"prepared_id": pid})
            assert r.status_code == 500 and "lacked" in r.json()["detail"]
            assert engine.dropped == 3
            assert (await http.get("/info")).json()["weight_version"] == 1
            generated = await http.post("/generate", json=PROBE)
            assert generated.json()["results"][0]["samples"][0]["weight_version"] == 1

            # 5. the commit posted right after prepare, before the "broadcast": it waits for the
            # bytes; meanwhile other updates, sleep and a second commit are refused, and
            # generation waits for the new weights
            inbox.unlink()
            pid = (await http.post("/weights/nccl/prepare", json=announce)).json()["prepared_id"]
            commit = asyncio.ensure_future(
                http.post("/weights/nccl/commit", json={"prepared_id": pid})
            )
            await asyncio.sleep(0.3)
            assert not commit.done()
            for path, body in [("/sleep", {"level": 1}), ("/weights/nccl/prepare", announce),
                               ("/weights/load_file", {"path": str(model_b)}),
                               ("/weights/nccl/commit", {"prepared_id": pid})]:  # fmt: skip
                refused = await http.post(path, json=body)
                assert refused.status_code == 409, (path, refused.text)
                assert "being committed" in refused.json()["detail"], refused.text
            waiting = asyncio.ensure_future(http.post("/generate", json=PROBE))
            await asyncio.sleep(0.3)
            assert not waiting.done()
            save_file(load_file(model_b / "model.safetensors"), inbox)  # the bytes arrive
            r = await commit
            assert r.status_code == 200 and r.json()["weight_version"] == 2, r.text
            generated = await waiting
            assert generated.json()["results"][0]["samples"][0]["weight_version"] == 2

            # 6. the learner restarts after posting the commit, before broadcasting: the new
            # init cancels the commit at once (not after the group's timeout, 30 s here), the
            # commit fails, and generation resumes on the weights it had
            inbox.unlink()
            pid = (await http.post("/weights/nccl/prepare", json=announce)).json()["prepared_id"]
            commit = asyncio.ensure_future(
                http.post("/weights/nccl/commit", json={"prepared_id": pid})
            )
            waiting = asyncio.ensure_future(http.post("/generate", json=PROBE))
            await asyncio.sleep(0.3)
            assert not commit.done() and not waiting.done()
            start = time.monotonic()
            assert (await http.post("/weights/nccl/init", json=_init(30))).status_code == 200
            assert time.monotonic() - start < 5
            r = await commit
            assert r.status_code == 500 and "cancelled" in r.json()["detail"], r.text
            assert engine.dropped == 4  # the failed commit's receives dropped
            generated = await waiting
            assert generated.json()["results"][0]["samples"][0]["weight_version"] == 2
            # the new group takes the next update
            pid = (await http.post("/weights/nccl/prepare", json=announce)).json()["prepared_id"]
            save_file(load_file(model_b / "model.safetensors"), inbox)
            r = await http.post("/weights/nccl/commit", json={"prepared_id": pid})
            assert r.status_code == 200 and r.json()["weight_version"] == 3, r.text

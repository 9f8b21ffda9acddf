"""Faults injected into real processes (the demo learner, rollout servers on loopback) at chosen
moments: a server killed while a weight sync waits inside it (each CPU transport), the learner
killed there (then ``--resume``), a server frozen for longer than the learner's request timeout.
Each asserts that no step is lost, that the logged weight_version never goes down, and that the
learner's log says what happened.

A weight load on a server waits for the generations in flight (``rollout_server.gate``): a long
generation of the test's own holds it, so the kill lands while the sync is inside the server,
not by luck of timing. The learner is paused (SIGSTOP) between its step's generation and its
training so that this generation starts before the sync does."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from grpo_common.net import free_port
from learner.run.metrics import read_metrics
from tests.learner.demo_runs import (
    DEMO,
    ROOT,
    learner_cmd,
    learner_env,
    run_ok,
    serve_cmd,
    spawn_learner,
    wait_for_step,
)
from tests.server_metrics import metric

QUIET = ("run.progress_bar=false", "run.save_final=false", "run.tensorboard=false")
# Eight optimizer passes a step: the learner trains long enough between a step's generation
# and its sync for the test to pause it there on a loaded machine (_sync_held_in_server).
SHORT = ("sampling.max_tokens=8", "run.steps=3", "grpo.num_iterations=8")
HOLD_TOKENS = 1536  # the test's own generation that holds the servers' weight loads back (the
# tiny model has 2048 positions); long enough for the learner to train a step under load


def _learner(run_dir: Path, model: Path, port: int, *overrides: str) -> subprocess.Popen:
    sets = [*QUIET, *SHORT, f'model.name_or_path="{model}"']
    sets += [f'rollout.servers=["http://127.0.0.1:{port}"]', *overrides]
    return spawn_learner(run_dir, *sets)


def _serve(model: Path, port: int, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen(serve_cmd(model, port, *args), env=learner_env())
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "the server never got ready"
        time.sleep(0.1)


def _gauge(url: str, name: str) -> float:
    return metric(httpx.get(f"{url}/metrics", timeout=5).text, name)


def _generates(url: str) -> float:
    """``/generate`` requests the server answered."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return metric(text, "rollout_http_requests_total", route="/generate")


def _wait(cond, what: str, proc: subprocess.Popen | None = None, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert proc is None or proc.poll() is None, f"the learner exited before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g} s"
        time.sleep(0.005)


@contextmanager
def _sync_held_in_server(url: str, learner: subprocess.Popen) -> Iterator[None]:
    """Yield once the learner's next weight sync waits inside the server at ``url``.

    Called once step 1 is written. Once the learner's step-2 generation answered (its second
    ``/generate``: no evaluation comes before it), the learner is paused while it scores and
    trains step 2, a long generation of the test's own starts, and the learner goes on: its
    weight load must wait for that generation; a probe generation queued behind the load
    (``rollout_generate_waiting``) shows that it does. (Counting answered requests cannot miss a
    short generation the way watching the in-flight gauge can.)"""
    _wait(
        lambda: _generates(url) >= 2 and _gauge(url, "rollout_generate_in_flight") == 0,
        "step 2's generation",
        learner,
    )
    learner.send_signal(signal.SIGSTOP)

    def generate(tokens: int) -> None:
        body = {"prompts": ["hold"], "max_tokens": tokens, "ignore_eos": True}
        with contextlib.suppress(httpx.TransportError):  # the server is killed under it
            httpx.post(f"{url}/generate", json=body, timeout=600)

    threads = [threading.Thread(target=generate, args=(HOLD_TOKENS,), daemon=True)]
    threads[0].start()
    try:
        _wait(lambda: _gauge(url, "rollout_generate_in_flight") >= 1, "held generation")
    finally:
        learner.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 60
    while _gauge(url, "rollout_generate_waiting") < 1:
        assert learner.poll() is None and time.monotonic() < deadline, "the sync never waited"
        assert threads[0].is_alive(), "the held generation ended before the sync came"
        # A probe that came before the load waits in the engine behind the held generation,
        # not at the gate: only one sent after it queues there.
        threads.append(threading.Thread(target=generate, args=(1,), daemon=True))
        threads[-1].start()
        time.sleep(0.3)
    yield


def _versions_rise(run_dir: Path, steps: int) -> list[int]:
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    versions = [int(r["weight_version"]) for r in records]
    assert versions == sorted(versions) and len(set(versions)) == steps, versions
    return versions


@pytest.mark.parametrize("transport", ["http", "file"])
def test_a_server_killed_while_a_sync_waits_in_it_is_synced_again(
    tmp_path, tiny_model_dir, transport
):
    """Killed with the sync inside it (http: the staged update's commit; file: the load of the
    written file), started again on its port: the learner logs the failed sync, waits for the
    server, pushes the same weights again under its own next version (the fresh server serves
    0), and trains every step once."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    sync, flags = [f'rollout.sync="{transport}"'], []
    if transport == "file":
        (tmp_path / "sync").mkdir()
        sync.append(f'rollout.sync.dir="{tmp_path / "sync"}"')
        flags = ["--weights-dir", str(tmp_path / "sync")]
    server = _serve(tiny_model_dir, port, *flags)
    run_dir = tmp_path / "run"
    learner = _learner(run_dir, tiny_model_dir, port, *sync)
    try:
        wait_for_step(run_dir, learner, 1)
        with _sync_held_in_server(url, learner):
            server.kill()
            server.wait()
        assert len(read_metrics(run_dir)) == 1  # step 2's sync was cut off
        server = _serve(tiny_model_dir, port, *flags)
        _, err = learner.communicate(timeout=300)
    finally:
        learner.kill()
        server.kill()
        server.wait()
    assert learner.returncode == 0, err[-3000:]
    assert "weight sync failed" in err and "waiting for the rollout servers" in err, err[-3000:]
    assert _versions_rise(run_dir, 3) == [1, 2, 3]


@pytest.mark.slow
@pytest.mark.timeout(600)  # a learner killed, then resumed: 178 s on two cores busy with other jobs
def test_a_learner_killed_while_its_sync_waits_leaves_the_server_whole_and_resumes(
    tmp_path, tiny_model_dir
):
    """SIGKILLed with step 2's staged update committed but waiting inside the server: the
    server loads all of it (version 2; /info and the weights' checksum agree), and ``--resume``
    from step 1's checkpoint gives it step 1's weights again under a higher version (3) and
    trains steps 2 and 3 once more, on versions above every one the server served; the final
    weights' checksum is the server's."""
    from transformers import AutoModelForCausalLM

    from rollout_server.weight_digest import params_checksum

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = _serve(tiny_model_dir, port)
    run_dir = tmp_path / "run"
    learner = _learner(run_dir, tiny_model_dir, port, "run.checkpoint_every=1")
    try:
        wait_for_step(run_dir, learner, 1)
        with _sync_held_in_server(url, learner):
            learner.kill()
        learner.wait()
        _wait(lambda: _gauge(url, "rollout_generate_in_flight") == 0, "held generation's end")
        info = httpx.get(f"{url}/info", timeout=10).json()
        digest = httpx.get(f"{url}/weights/checksum", timeout=10).json()
        # the update whose sender died is applied whole once the generation ends
        # (rollout_server.disconnect never cuts a weight update off)
        assert digest["weight_version"] == info["weight_version"] == 2, (info, digest)
        before = _versions_rise(run_dir, 1)
        sets = [*QUIET, *SHORT, "run.save_final=true", f'model.name_or_path="{tiny_model_dir}"']
        sets.append(f'rollout.servers=["{url}"]')
        done = run_ok(run_dir, *sets, resume=True)
        assert "resumed from" in done.stderr
        versions = _versions_rise(run_dir, 3)
        assert versions[0] == before[0] and min(versions[1:]) > info["weight_version"]
        assert versions == [1, 4, 5]  # 3: step 1's weights again, given on resume
        final = httpx.get(f"{url}/weights/checksum", timeout=10).json()
        assert final["weight_version"] == versions[-1]
    finally:
        learner.kill()
        server.kill()
        server.wait()
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final", torch_dtype="float32")
    assert final["checksum"] == pytest.approx(params_checksum(model), rel=1e-6)


@pytest.mark.slow
def test_a_frozen_server_times_out_the_learners_requests_and_the_run_goes_on(
    tmp_path, tiny_model_dir
):
    """SIGSTOPped for longer than rollout.timeout_s while the learner generates, then SIGCONTed:
    each timed-out request is logged and retried; the run trains every step once."""
    port = free_port()
    server = _serve(tiny_model_dir, port)
    run_dir = tmp_path / "run"
    learner = _learner(
        run_dir, tiny_model_dir, port, "rollout.timeout_s=4", "rollout.max_retries=5"
    )
    try:
        wait_for_step(run_dir, learner, 1)
        server.send_signal(signal.SIGSTOP)
        time.sleep(9)
        server.send_signal(signal.SIGCONT)
        _, err = learner.communicate(timeout=300)
    finally:
        server.send_signal(signal.SIGCONT)
        learner.kill()
        server.kill()
        server.wait()
    assert learner.returncode == 0, err[-3000:]
    assert "timed out (ReadTimeout) (attempt 1/6)" in err, err[-3000:]
    assert _versions_rise(run_dir, 3) == [1, 2, 3]


ENV_SERVER = """
import asyncio, sys
from pathlib import Path
import uvicorn
from pydantic import BaseModel
from openreward.environments import Environment, Server, TextBlock, ToolOutput, terminal, tool

class Answer(BaseModel):
    answer: str

class Echo(Environment):
    @classmethod
    def list_splits(cls):
        return ["train", "test"]

    @classmethod
    def list_tasks(cls, split):
        return [{"key": f"t{i}"} for i in range(8)]

    def get_prompt(self):
        return [TextBlock(text="Say something.")]

    @terminal
    @tool
    async def submit(self, params: Answer) -> ToolOutput:
        '''Grade the final answer (a moment's work: a kill can land in it).'''
        Path(sys.argv[2]).touch()
        await asyncio.sleep(0.2)
        reward = min(len(params.answer), 20) / 20
        return ToolOutput(blocks=[TextBlock(text="graded")], reward=reward, finished=True)

uvicorn.run(Server([Echo]).app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def _env_server(port: int, marker: Path) -> subprocess.Popen:
    argv = [sys.executable, "-c", ENV_SERVER, str(port), str(marker)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}/", timeout=2)
            return proc
        except httpx.TransportError:
            assert proc.poll() is None and time.monotonic() < deadline, "no environment server"
            time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.timeout(600)  # a run stopped, then resumed: 178 s on two cores busy with other jobs
def test_an_environment_server_killed_mid_episode_stops_the_run_and_resume_goes_on(tmp_path):
    """The Open Reward Standard server dies while it grades step 2's episodes: they all fail, so
    the run stops naming the environment and the first error (training on their zeros would
    teach noise); started again, ``--resume`` trains steps 2 and 3 once, versions rising."""
    pytest.importorskip("openreward")
    port, marker, run_dir = free_port(), tmp_path / "graded", tmp_path / "run"
    env = _env_server(port, marker)
    sets = [*QUIET, "run.steps=3", "run.checkpoint_every=1", "sampling.max_tokens=8"]
    sets += [f'environment.name="openreward:http://127.0.0.1:{port}/echo"']
    sets += ["environment.max_turns=1", "eval.max_prompts=2", "eval.num_generations=1"]
    cmd = learner_cmd(run_dir, *(a for s in sets for a in ("--set", s)))
    cmd[cmd.index(str(DEMO))] = str(ROOT / "learner" / "configs" / "calculator.toml")
    learner = subprocess.Popen(
        cmd, env=learner_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_for_step(run_dir, learner, 1)
        marker.unlink()
        _wait(marker.exists, "step 2's grading", learner)
        env.kill()
        env.wait()
        _, err = learner.communicate(timeout=120)
        assert learner.returncode == 1, err[-3000:]
        last = err[err.rindex("error: environment ") :]
        assert "every episode of the step failed" in last, err[-3000:]
        assert f"openreward:http://127.0.0.1:{port}/echo" in last and "first error: " in last
        assert f"Cannot connect to host 127.0.0.1:{port}" in last
        assert [r["step"] for r in read_metrics(run_dir)] == [1]
        env = _env_server(port, marker)
        done = subprocess.run(
            [*cmd, "--resume"], env=learner_env(), capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
    finally:
        learner.kill()
        env.kill()
        env.wait()
    _versions_rise(run_dir, 3)

"""How the learner starts an embedded server: its environment, and what the learner says while
it waits for it.

An embedded server started by a learner under ``accelerate launch`` of several processes is
outside the launcher's process group: none of torchrun's variables reach it. With them, the
one-process group its engine forms (vLLM's workers do, on ``tcp://``) waits as a store client
for a store nobody serves: on 2 GPUs a per-rank vLLM server hung at start until it was killed."""

from __future__ import annotations

import logging
import subprocess
import sys

import httpx

from grpo_common.net import free_port
from learner.servers import embedded
from learner.servers.embedded import API_KEY_ENV, rank_env, server_env

# what torchrun sets in each learner process (rank 1 of 2, the agent's store elsewhere)
TORCHRUN = {
    "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "0", "ROLE_RANK": "1", "ROLE_NAME": "default", "ROLE_WORLD_SIZE": "2",
    "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555",
    "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "none",
    "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
}  # fmt: skip

# what a one-process engine does at start: its own group on a tcp:// address
ENGINE_GROUP = """
import datetime, sys
import torch.distributed as dist
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0,
                        world_size=1, timeout=datetime.timedelta(seconds=4))
dist.destroy_process_group()
"""


def _engine_group(env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", ENGINE_GROUP, str(free_port())]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)


def test_the_launchers_variables_do_not_reach_the_server(monkeypatch) -> None:
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(API_KEY_ENV, "the-learners-key-for-external-servers")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    env = server_env({"CUDA_VISIBLE_DEVICES": "3"}, api_key="embedded-key")
    assert not set(TORCHRUN) & set(env)
    assert env[API_KEY_ENV] == "embedded-key" and env["CUDA_VISIBLE_DEVICES"] == "3"
    assert rank_env("cpu") == {}  # on the CPU: nothing but what server_env does
    # the engine's own group forms in the server's environment, and not in the learner's
    formed = _engine_group(env)
    assert formed.returncode == 0, formed.stderr[-2000:]
    agent_store = server_env({"TORCHELASTIC_USE_AGENT_STORE": "True"}, api_key=None)
    waited = _engine_group(agent_store)  # as it was: a store client, timed out
    assert waited.returncode != 0 and "timeout" in waited.stderr.lower(), waited.stderr[-2000:]


def test_a_slow_start_is_reported_while_the_learner_waits(
    tiny_model_dir, tmp_path, caplog, monkeypatch
):
    """A server that takes long to start (a hung vLLM engine stayed silent for 8 minutes in the
    learner's log) is reported every WAIT_NOTE_S: how long, of which setting, and the last line
    of its log. Here a real embedded server, with the note every 0.2 s."""
    monkeypatch.setattr(embedded, "WAIT_NOTE_S", 0.2)
    log_path = tmp_path / "server.log"
    with (
        caplog.at_level(logging.INFO, logger="learner.servers.embedded"),
        embedded.embedded_server(str(tiny_model_dir), log_path=log_path) as url,
    ):
        assert httpx.get(url + "/health", timeout=10).status_code == 200
    notes = [r.getMessage() for r in caplog.records if "waiting for the embedded" in r.message]
    assert notes, "no note while the server started"
    assert "rollout.embedded.startup_timeout_s" in notes[0] and str(log_path) in notes[0]
    assert not notes[-1].endswith("(nothing yet)"), notes[-1]  # the log's own last line

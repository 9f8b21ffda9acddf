"""The learner's console: its own INFO lines, but no httpx line per request to a server."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rollout_server.settings import ServerSettings

SCRIPT = """
import logging, sys
import httpx
from learner.cli import setup_logging

setup_logging()
for _ in range(3):
    httpx.get(sys.argv[1] + "/health", timeout=30).raise_for_status()
logging.getLogger("learner").info("step 1 done")
"""


@pytest.fixture(scope="module")
def server(start_server, tiny_model_dir):
    with start_server(ServerSettings(model=str(tiny_model_dir)), wait_ready=False) as s:
        yield s


def test_no_httpx_request_lines_on_the_console(server):
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, server.url],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "step 1 done" in out.stderr  # the learner's own INFO lines still show
    assert "HTTP Request:" not in out.stderr, out.stderr


CHECKPOINT_SCRIPT = """
import logging, sys
import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM
from learner.cli import setup_logging

setup_logging()
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
assert model.config.tie_word_embeddings  # the case the notice is about
accelerator = Accelerator(cpu=True)
model = accelerator.prepare(model)
accelerator.save_state(sys.argv[2], safe_serialization=True)
logging.getLogger("learner").info("checkpoint written")
"""


def test_a_checkpoint_of_a_tied_model_writes_no_console_lines(tiny_model_dir, tmp_path):
    """accelerate logs a line per file of a checkpoint and warns that the tied output embedding
    was not written (loading ties it again): neither reaches the learner's console."""
    out = subprocess.run(
        [sys.executable, "-c", CHECKPOINT_SCRIPT, str(tiny_model_dir), str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()
    assert "checkpoint written" in out.stderr
    assert "accelerate" not in out.stderr, out.stderr


def test_other_shared_tensors_still_warn():
    import logging

    from learner.cli import not_a_tied_embedding_notice

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("accelerate.utils.other", logging.WARNING, "", 0, msg, (), None)

    tied = "[RANK 0] Removed shared tensor {'model.lm_head.weight'} while saving. This should be OK"
    assert not not_a_tied_embedding_notice(record(tied))
    other = "Removed shared tensor {'model.lm_head.weight', 'layers.0.mlp.up.weight'} while saving"
    assert not_a_tied_embedding_notice(record(other))
    assert not_a_tied_embedding_notice(record("something else entirely"))

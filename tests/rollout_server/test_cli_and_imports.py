"""The ``rollout-server`` CLI, the tiny-model helper, and what importing the contract pulls in."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from grpo_common.net import free_port
from rollout_server import tiny
from rollout_server.cli import build_parser, main, settings_from_args
from tests.rollout_server.cli_process import wait_ready


def _python(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return out.stdout.strip()


def test_importing_the_contract_pulls_in_no_engine_torch_or_vllm():
    heavy = ["vllm", "torch", "transformers", "rollout_server.engine.transformers_engine",
             "rollout_server.engine.vllm_engine", "rollout_server.app"]  # fmt: skip
    code = (
        "import sys, json\n"
        "import rollout_server.protocol, rollout_server.client, rollout_server.settings\n"
        "import rollout_server.cli\n"
        f"print(json.dumps([m for m in {heavy!r} if m in sys.modules]))"
    )
    assert json.loads(_python(code)) == []


def test_help_is_instant_and_imports_no_torch():
    code = (
        "import sys\nfrom rollout_server.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules)"
    )
    assert _python(code).splitlines()[-1] == "False"


def test_flags_become_settings():
    args = build_parser().parse_args(
        ["--model", "m", "--max-n", "3", "--max-tokens", "9", "--port", "9001", "--api-key", "k",
         "--no-enable-sleep-mode", "--dtype", "bfloat16", "--no-gc-freeze"]
    )  # fmt: skip
    s = settings_from_args(args)
    assert s.gc_freeze is False
    assert settings_from_args(build_parser().parse_args(["--model", "m"])).gc_freeze is True
    assert (s.limits.max_n, s.limits.max_tokens, s.limits.max_batch_size) == (3, 9, 512)
    assert (s.port, s.api_key, s.enable_sleep_mode, s.dtype) == (9001, "k", False, "bfloat16")
    assert s.host == "127.0.0.1" and s.engine == "transformers"


def test_refuses_to_start_unauthenticated_off_loopback(capsys, monkeypatch):
    monkeypatch.delenv("ROLLOUT_API_KEY", raising=False)
    assert main(["--model", "m", "--host", "0.0.0.0"]) == 2
    assert "--api-key" in capsys.readouterr().err
    assert main(["--model", "m", "--max-n", "0"]) == 2
    assert "--max-n" in capsys.readouterr().err


def test_the_cli_serves_a_model_and_enforces_its_limits(tiny_model_dir):
    port = free_port()
    env = {**os.environ, "ROLLOUT_API_KEY": ""}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout_server", "--model", str(tiny_model_dir), "--port",
         str(port), "--max-n", "2", "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url) as http:
            wait_ready(proc, http)
        r = httpx.post(f"{url}/generate", json={"prompts": ["hi"], "n": 3}, timeout=30)
        assert r.status_code == 400 and "limit of 2" in r.json()["detail"]
        r = httpx.post(f"{url}/generate", json={"prompts": ["hi"], "n": 2, "max_tokens": 3})
        assert r.status_code == 200 and len(r.json()["results"][0]["samples"]) == 2
    finally:
        proc.terminate()
        # uvicorn shuts down gracefully, then re-raises the SIGTERM it caught
        assert proc.wait(timeout=30) in (0, -15)
        assert "Traceback" not in proc.stdout.read()


def _serve(model: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollout_server", "--model", model,
         "--port", str(free_port()), "--log-level", "error"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_cli_exits_nonzero_when_the_model_cannot_load(tmp_path):
    proc = _serve(str(tmp_path))  # a directory, but no model in it
    assert proc.returncode == 1
    assert "the engine failed to start" in proc.stderr


def test_the_cli_refuses_a_model_path_that_does_not_exist(tmp_path):
    proc = _serve(str(tmp_path / "missing"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--model: " in proc.stderr and "missing': no such model directory" in proc.stderr


def test_tiny_cli_writes_a_loadable_model(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    tiny.main([str(tmp_path), "--hidden", "32", "--layers", "1", "--heads", "2",
               "--kv-heads", "1", "--vocab-size", "300"])  # fmt: skip
    config = AutoConfig.from_pretrained(tmp_path)
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (32, 1, 300)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == 265 and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    text = "héllo <think>x</think>"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text  # byte-level: exact


def test_the_tiny_chat_template_renders_tools_like_qwen():
    tokenizer = tiny.make_tiny_tokenizer()
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "add"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": "2"},
    ]  # fmt: skip
    tools = [{"type": "function", "function": {"name": "add"}}]
    text = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\nsys\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "add"}}\n</tools>' in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call><|im_end|>'
        in text
    )
    # consecutive tool results share one user turn
    assert (
        "<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>"
        in text
    )
    assert text.endswith("<|im_start|>assistant\n")
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.convert_tokens_to_ids("<tool_call>") in ids  # one token, as in Qwen


def test_the_qwen3_0_6b_shape_has_its_parameter_count():
    import torch
    from transformers import Qwen3ForCausalLM

    with torch.device("meta"):
        model = Qwen3ForCausalLM(tiny.tiny_qwen3_config(**tiny.QWEN3_0_6B_SHAPE))
    total = sum(p.numel() for p in model.parameters())
    embedding = 151936 * 1024
    assert total == pytest.approx(0.596e9, rel=0.005)  # Qwen3-0.6B: 0.6B, 0.44B non-embedding
    assert total - embedding == pytest.approx(0.44e9, rel=0.01)

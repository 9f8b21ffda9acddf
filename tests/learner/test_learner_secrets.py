"""The learner's secrets: the embedded server takes a random key that no other local process
knows (and ``ps`` does not show), the configured key is masked in the run directory, and a key
comes from a file or the environment rather than the config."""

from __future__ import annotations

import stat
from pathlib import Path

import httpx
import pytest
from accelerate import Accelerator

from learner.config import ConfigError, load_config
from learner.run.runtime import start_run
from learner.servers.pool import servers
from tests.conftest import pids_mentioning
from tests.learner.demo_runs import DEMO


def test_the_embedded_server_takes_a_random_key_that_ps_does_not_show(tmp_path, tiny_model_dir):
    cfg = load_config(DEMO)
    with servers(cfg, str(tiny_model_dir), tmp_path, Accelerator(cpu=True)) as (urls, key):
        assert key and len(key) >= 32
        (url,) = urls
        assert httpx.post(f"{url}/sleep", json={"level": 1}).status_code == 401
        assert httpx.get(f"{url}/info").status_code == 401
        info = httpx.get(f"{url}/info", headers={"Authorization": f"Bearer {key}"})
        assert info.status_code == 200, info.text
        pids = pids_mentioning(url.rsplit(":", 1)[1])
        assert pids, "no embedded server process found"
        for pid in pids:
            assert key not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    with servers(cfg, str(tiny_model_dir), tmp_path, Accelerator(cpu=True)) as (_, again):
        assert again != key  # a fresh one for every server started


def test_the_run_dirs_config_masks_the_api_key_and_only_its_owner_reads_it(tmp_path):
    cfg = load_config(DEMO, ['rollout.api_key="s3cret-key"'])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text("{}")
    (run_dir / "config.json").chmod(0o644)  # left by an earlier run: resumed, it is rewritten
    start_run(Accelerator(cpu=True), run_dir, cfg, 0, 8, "grpo.prompts_per_step", resume=True)
    written = (run_dir / "config.json").read_text()
    assert "s3cret-key" not in written and '"api_key": "***"' in written
    assert stat.S_IMODE((run_dir / "config.json").stat().st_mode) == 0o600


def test_the_api_key_comes_from_a_file_and_a_blank_one_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("ROLLOUT_API_KEY", raising=False)
    key_file = tmp_path / "key"
    key_file.write_text("from-the-file\n")
    cfg = load_config(DEMO, [f'rollout.api_key_file="{key_file}"'])
    assert cfg.rollout.key() == "from-the-file"
    monkeypatch.setenv("ROLLOUT_API_KEY", "from-the-env")
    assert load_config(DEMO).rollout.key() == "from-the-env"

    with pytest.raises(ConfigError, match=r"rollout\.api_key: is blank"):
        load_config(DEMO, ['rollout.api_key="  \t "'])
    key_file.write_text(" \n")
    with pytest.raises(ConfigError, match=r"rollout\.api_key_file: .*key is blank"):
        load_config(DEMO, [f'rollout.api_key_file="{key_file}"'])
    with pytest.raises(ConfigError, match=r"rollout\.api_key_file: cannot read"):
        load_config(DEMO, [f'rollout.api_key_file="{tmp_path / "missing"}"'])
    with pytest.raises(ConfigError, match=r"rollout\.api_key_file: set api_key or api_key_file"):
        load_config(DEMO, ['rollout.api_key="k"', f'rollout.api_key_file="{key_file}"'])

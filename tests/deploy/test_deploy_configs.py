"""The shipped deployment files, checked without a Docker engine or a GPU.

docker-compose.yml is parsed with PyYAML and its interpolation resolved as Compose does; the
commands it runs are fed to the real argument parsers and settings models of the rollout server,
accelerate and the learner. The accelerate configs go through accelerate's own loader, launcher
validation and DeepSpeed plugin, and the resulting DeepSpeed config is checked. ``docker compose
config`` validates the file as well: skipped where no Compose CLI is installed, a failure under
CI (``CI=true``), where ``.ci/run`` installs it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
ACCELERATE = ROOT / "deploy" / "accelerate"
REQUIRED = {"MODEL", "ROLLOUT_API_KEY", "LEARNER_CONFIG"}
ENV = {
    "MODEL": "Qwen/Qwen3-0.6B",
    "ROLLOUT_API_KEY": "secret",
    "LEARNER_CONFIG": str(ROOT / "learner" / "configs" / "demo.toml"),
}

_VAR = re.compile(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}")


class MissingVariable(ValueError):
    pass


def interpolate(value: object, env: dict[str, str]) -> object:
    """Compose's ``${VAR}``, ``${VAR:-default}`` and ``${VAR:?error}`` rules, recursively."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        got = env.get(name)
        if op in (":-", "-"):
            return got if got else arg
        if op in (":?", "?"):
            if not got:
                raise MissingVariable(f"{name}: {arg}")
            return got
        return got or ""

    return _VAR.sub(one, value)


def load_compose(env: dict[str, str], profiles: frozenset[str] = frozenset()) -> dict:
    """The file as Compose resolves it with ``profiles`` active: a service with ``profiles``
    exists only when one of them is active (YAML merge keys resolved by PyYAML, as Compose)."""
    raw = yaml.safe_load(COMPOSE.read_text())
    for key in [k for k in raw if k.startswith("x-")]:
        raw.pop(key)  # anchor holders; Compose ignores x- keys
    raw["services"] = {
        name: svc
        for name, svc in raw["services"].items()
        if not svc.get("profiles") or set(svc["profiles"]) & profiles
    }
    return interpolate(raw, env)


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose(ENV)


def gpu_ids(service: dict) -> list[str]:
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1
    dev = devices[0]
    assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
    assert "count" not in dev, "count and device_ids are mutually exclusive in Compose"
    return dev["device_ids"]


def test_services_gpus_and_images(compose: dict) -> None:
    services = compose["services"]
    assert set(services) == {"rollout", "learner", "learner-check"}
    assert gpu_ids(services["rollout"]) == ["1"]
    assert gpu_ids(services["learner"]) == ["0"]
    for svc in (services["rollout"], services["learner"]):
        build = svc["build"]
        assert (ROOT / build["context"] / build["dockerfile"]).is_file()
        assert svc["environment"]["NCCL_NVLS_ENABLE"] == "0"
        assert svc["environment"]["NCCL_CUMEM_ENABLE"] == "0"
        assert svc["environment"]["ROLLOUT_API_KEY"] == "secret"
        assert svc["ipc"] == "host" and svc["network_mode"] == "host"


def test_shared_volume_for_models_and_runs(compose: dict) -> None:
    declared = set(compose["volumes"])
    for svc in compose["services"].values():
        named = {v.split(":")[0] for v in svc["volumes"]}
        assert named & declared == {"data"}, svc["volumes"]
        assert "data:/data" in svc["volumes"]
        assert svc["environment"]["HF_HOME"].startswith("/data/")
    learner = compose["services"]["learner"]["command"]
    assert any(a.startswith("--run-dir=/data/") for a in learner)


def test_healthcheck_and_startup_order(compose: dict) -> None:
    rollout, learner = compose["services"]["rollout"], compose["services"]["learner"]
    test = rollout["healthcheck"]["test"]
    assert test[0] == "CMD" and test[-1] == "http://127.0.0.1:8000/ready"
    script = test[2].removeprefix("/app/")
    assert (ROOT / script).is_file(), "the healthcheck script must ship in the image"
    assert learner["depends_on"] == {
        "rollout": {"condition": "service_healthy"},
        "learner-check": {"condition": "service_completed_successfully"},
    }
    # time for the SIGTERM path (step, checkpoint) within torchrun's 30 s, not docker's 10 s
    assert learner["stop_grace_period"] == "45s"


@pytest.mark.parametrize("missing", sorted(REQUIRED))
def test_required_settings_fail_with_a_message(missing: str) -> None:
    env = {k: v for k, v in ENV.items() if k != missing}
    with pytest.raises(MissingVariable, match=missing):
        load_compose(env)
    text = COMPOSE.read_text()
    assert re.search(r"\$\{" + missing + r":\?[^}]{10,}\}", text), f"{missing} needs :?message"


def test_data_dir_puts_a_host_directory_at_data_in_every_service() -> None:
    compose = load_compose({**ENV, "DATA_DIR": "/srv/grpo"})
    for svc in compose["services"].values():
        assert svc["volumes"] == ["/srv/grpo:/data"]


def _check_config(argv: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUT_API_KEY"}
    return subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "check_config.py"), *argv],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_config_error_stops_the_learner_before_it_starts(compose: dict) -> None:
    """learner-check runs the learner's own command through the learner's config loader: exit 2
    on a bad setting, which compose's service_completed_successfully turns into no learner start
    (the learner's restart policy would otherwise retry a config error three times)."""
    services = compose["services"]
    check, learner = services["learner-check"], services["learner"]
    assert check["command"] == learner["command"]
    assert check["build"] == learner["build"] and check["image"] == learner["image"]
    assert check["restart"] == "no" and "deploy" not in check  # one-shot, no GPU
    script = check["entrypoint"][1]
    assert check["entrypoint"][0] == "python" and (ROOT / script).is_file()
    dockerfile = (ROOT / "deploy" / "learner.Dockerfile").read_text()
    assert re.search(r"^COPY deploy/ deploy/", dockerfile, re.M)

    ok = _check_config(learner["command"])
    assert ok.returncode == 0, ok.stderr
    bad = _check_config([*learner["command"], "--set=grpo.no_such_field=1"])
    assert bad.returncode == 2 and "grpo.no_such_field" in bad.stderr
    gone = _check_config([*learner["command"], "--config=/nonexistent/my.toml"])
    assert gone.returncode == 2 and "/nonexistent/my.toml" in gone.stderr


def test_rollout_command_is_valid_server_settings(
    compose: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compose flags after the image's entrypoint parse into valid ServerSettings."""
    from rollout_server.cli import build_parser, settings_from_args

    entrypoint = _dockerfile_json("rollout.Dockerfile", "ENTRYPOINT")
    assert entrypoint[0] == "rollout-server" and _console_script("rollout-server")
    argv = entrypoint[1:] + compose["services"]["rollout"]["command"]
    monkeypatch.delenv("ROLLOUT_API_KEY", raising=False)
    settings = settings_from_args(build_parser().parse_args(argv))
    assert settings.engine == "vllm" and settings.model == ENV["MODEL"]
    assert settings.host == "127.0.0.1" and settings.port == 8000
    assert 0 < settings.gpu_memory_utilization < 1


def test_learner_command_parses_with_accelerate_and_learner(compose: dict) -> None:
    from accelerate.commands.launch import launch_command_parser

    from learner.cli import train_parser
    from learner.config import load_config

    command = compose["services"]["learner"]["command"]
    assert command[:2] == ["accelerate", "launch"]
    args = launch_command_parser().parse_args(command[2:])
    assert args.module and args.training_script == "learner"
    assert (ROOT / args.config_file).is_file()
    learner_args = train_parser().parse_args(args.training_script_args)
    cfg = load_config(learner_args.config, learner_args.overrides)
    assert cfg.model.name_or_path == ENV["MODEL"]
    assert cfg.rollout.servers == ["http://127.0.0.1:8000"]
    assert cfg.rollout.sync.type == "nccl"
    # a crashed learner restarts (compose) and resumes from its last checkpoint
    assert learner_args.resume and compose["services"]["learner"]["restart"].startswith(
        "on-failure"
    )


def _dockerfile_json(name: str, instruction: str) -> list[str]:
    import json

    for line in (ROOT / "deploy" / name).read_text().splitlines():
        if line.startswith(instruction + " "):
            return json.loads(line[len(instruction) + 1 :])
    raise AssertionError(f"{name} has no {instruction}")


def _console_script(name: str) -> bool:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return name in pyproject["project"]["scripts"]


@pytest.mark.parametrize(
    ("name", "extras"), [("rollout", {"vllm"}), ("learner", {"vllm", "deepspeed"})]
)
def test_dockerfiles_copy_existing_paths_and_install_real_extras(name: str, extras: set) -> None:
    text = (ROOT / "deploy" / f"{name}.Dockerfile").read_text()
    assert re.search(r"^FROM \S+", text, re.M) and "ARG CUDA_IMAGE=nvidia/cuda:" in text
    for src in re.findall(r"^COPY (\S+) ", text, re.M):
        assert (ROOT / src).exists(), f"{name}.Dockerfile copies {src}, which does not exist"
    installs = re.findall(r'pip install "\.\[([\w,]+)\]"', text)
    assert len(installs) == 1 and set(installs[0].split(",")) == extras
    defined = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert extras <= set(defined["optional-dependencies"])
    assert "NCCL_NVLS_ENABLE=0" in text and "NCCL_CUMEM_ENABLE=0" in text
    ignore = (ROOT / "deploy" / f"{name}.Dockerfile.dockerignore").read_text()
    assert ignore.splitlines()[1] == "**", "the build context must not ship .venv or .dev"


def _deepspeed_env(path: Path) -> tuple[dict[str, str], object]:
    """What ``accelerate launch --config_file path`` puts in the training processes' env."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    parser = launch_command_parser()
    args = parser.parse_args(["--config_file", str(path), "--main_process_port", "0", "x.py"])
    args, defaults, _ = _validate_launch_command(args)
    assert args.use_deepspeed
    args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
    _, env = prepare_deepspeed_cmd_env(args)
    return {k: v for k, v in env.items() if k.startswith("ACCELERATE_")}, defaults


@pytest.mark.parametrize(("name", "stage"), [("zero3", 3), ("zero2", 2)])
def test_deepspeed_configs_through_accelerate(
    name: str, stage: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils import DeepSpeedPlugin, DistributedType

    path = ACCELERATE / f"{name}.yaml"
    cfg = ClusterConfig.from_yaml_file(str(path))  # unknown keys and bad enums raise here
    assert cfg.distributed_type == DistributedType.DEEPSPEED and cfg.mixed_precision == "bf16"
    known = {a.dest: a for a in launch_command_parser()._actions}
    for key, value in cfg.deepspeed_config.items():
        assert key in known, f"{name}.yaml: deepspeed_config.{key} is not an accelerate option"
        if known[key].choices:
            assert value in known[key].choices, f"{name}.yaml: {key}={value!r}"
    env, _ = _deepspeed_env(path)
    assert env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == str(stage)
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    for key in list(os.environ):
        if key.startswith("ACCELERATE_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    plugin = DeepSpeedPlugin()  # what accelerate builds inside each training process
    plugin.set_mixed_precision("bf16")
    ds = plugin.deepspeed_config
    assert ds["zero_optimization"]["stage"] == stage
    assert ds["bf16"]["enabled"] is True
    assert not ds.get("fp16", {}).get("enabled", False)
    assert ds["gradient_clipping"] == 1.0
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "none"
    if stage == 3:
        assert plugin.zero3_init_flag is True
        assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


def test_single_gpu_config_through_accelerate() -> None:
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import DistributedType

    path = ACCELERATE / "single_gpu.yaml"
    cfg = ClusterConfig.from_yaml_file(str(path))
    assert cfg.distributed_type == DistributedType.NO and cfg.num_processes == 1
    args = launch_command_parser().parse_args(["--config_file", str(path), "x.py"])
    args, _, _ = _validate_launch_command(args)
    assert not (args.use_deepspeed or args.multi_gpu or args.use_fsdp)
    assert args.mixed_precision == "bf16" and args.num_processes == 1


def test_every_shipped_accelerate_config_is_tested() -> None:
    assert {p.stem for p in ACCELERATE.glob("*.yaml")} == {"zero3", "zero2", "single_gpu"}


def test_healthcheck_script_against_a_real_server(start_server, tiny_model_dir) -> None:
    """Exit 0 on a ready server with the right key; 1 with a wrong key or nothing listening."""
    from rollout_server.settings import ServerSettings

    script = ROOT / "deploy" / "healthcheck.py"

    def run(url: str, key: str | None) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k != "ROLLOUT_API_KEY"}
        if key is not None:
            env["ROLLOUT_API_KEY"] = key
        return subprocess.run(
            [sys.executable, str(script), url], env=env, capture_output=True, text=True, timeout=30
        )

    settings = ServerSettings(model=str(tiny_model_dir), api_key="k3y")
    with start_server(settings) as server:
        assert run(f"{server.url}/ready", "k3y").returncode == 0
        bad = run(f"{server.url}/ready", "wrong")
        assert bad.returncode == 1 and "HTTP 401" in bad.stderr
    gone = run(f"{server.url}/ready", "k3y")
    assert gone.returncode == 1 and "unreachable" in gone.stderr


def _compose_cli() -> list[str] | None:
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) is None:
            continue
        probe = subprocess.run([*cmd, "version"], capture_output=True, text=True)
        if probe.returncode == 0:
            return cmd
    return None


def _launch(command: list[str]):
    from accelerate.commands.launch import launch_command_parser

    assert command[:2] == ["accelerate", "launch"]
    return launch_command_parser().parse_args(command[2:])


def test_learner_accelerate_config_fits_its_gpus(compose: dict) -> None:
    """One learner GPU: single_gpu (ZeRO-3 would partition nothing); gpu4's two: ZeRO-3 with a
    process per GPU. The default follows the layout, ACCELERATE_CONFIG still overrides it."""
    one = _launch(compose["services"]["learner"]["command"])
    assert Path(one.config_file).name == "single_gpu.yaml" and one.num_processes == 1
    assert gpu_ids(compose["services"]["learner"]) == ["0"]
    four = load_compose(ENV, frozenset({"gpu4"}))["services"]
    two = _launch(four["learner-gpu4"]["command"])
    assert Path(two.config_file).name == "zero3.yaml" and two.num_processes == 2
    (ids,) = gpu_ids(four["learner-gpu4"])
    assert len(ids.split(",")) == two.num_processes
    forced = load_compose({**ENV, "ACCELERATE_CONFIG": "zero2"})["services"]["learner"]["command"]
    assert Path(_launch(forced).config_file).name == "zero2.yaml"


def test_gpu4_profile_learner_and_tensor_parallel_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--profile gpu4``: the learner on GPUs 0,1 and a TP-2 server on 2,3 by default, every GPU
    from LEARNER_GPUS / SERVER_GPUS; its learner waits for its own server and config check."""
    from rollout_server.cli import build_parser, settings_from_args

    default = load_compose(ENV)["services"]
    assert not {"rollout-gpu4", "learner-gpu4", "learner-gpu4-check"} & set(default)
    four = load_compose(ENV, frozenset({"gpu4"}))["services"]
    rollout, learner, check = four["rollout-gpu4"], four["learner-gpu4"], four["learner-gpu4-check"]
    assert gpu_ids(rollout) == ["2,3"] and gpu_ids(learner) == ["0,1"]
    assert check["command"] == learner["command"] and check["restart"] == "no"
    assert learner["depends_on"] == {
        "rollout-gpu4": {"condition": "service_healthy"},
        "learner-gpu4-check": {"condition": "service_completed_successfully"},
    }
    for svc in (rollout, learner):
        assert svc["network_mode"] == "host" and svc["ipc"] == "host"
        assert svc["environment"]["NCCL_NVLS_ENABLE"] == "0" and "data:/data" in svc["volumes"]
    assert rollout["healthcheck"] == default["rollout"]["healthcheck"]
    entrypoint = _dockerfile_json("rollout.Dockerfile", "ENTRYPOINT")
    monkeypatch.delenv("ROLLOUT_API_KEY", raising=False)
    settings = settings_from_args(build_parser().parse_args(entrypoint[1:] + rollout["command"]))
    assert settings.tensor_parallel_size == 2 and settings.model == ENV["MODEL"]
    assert _check_config(learner["command"]).returncode == 0

    env = {**ENV, "LEARNER_GPUS": "1", "SERVER_GPUS": "2,3,4,5", "SERVER_TP": "4"}
    moved = load_compose(env, frozenset({"gpu4"}))["services"]
    assert gpu_ids(moved["learner-gpu4"]) == ["1"] and gpu_ids(moved["rollout-gpu4"]) == ["2,3,4,5"]
    assert "--tensor-parallel-size=4" in moved["rollout-gpu4"]["command"]
    base = load_compose(env)["services"]
    assert gpu_ids(base["learner"]) == ["1"] and gpu_ids(base["rollout"]) == ["2,3,4,5"]


def test_docker_compose_config_validates() -> None:
    """``docker compose config`` runs client-side (no engine needed) when the plugin exists."""
    cmd = _compose_cli()
    if cmd is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("CI=true but no docker compose CLI: .ci/run installs docker-compose")
        pytest.skip("no docker compose CLI here (the Compose plugin is not installed)")
    env = {**os.environ, **ENV}
    ok = subprocess.run([*cmd, "-f", str(COMPOSE), "config", "-q"], env=env, capture_output=True)
    assert ok.returncode == 0, ok.stderr
    gpu4 = subprocess.run(
        [*cmd, "-f", str(COMPOSE), "--profile", "gpu4", "config"],
        env={**env, "LEARNER_GPUS": "0,1", "SERVER_GPUS": "2,3"},
        capture_output=True,
        text=True,
    )
    assert gpu4.returncode == 0, gpu4.stderr
    resolved = yaml.safe_load(gpu4.stdout)["services"]
    assert {"rollout-gpu4", "learner-gpu4", "learner-gpu4-check"} <= set(resolved)
    assert "--num_processes=2" in resolved["learner-gpu4"]["command"]
    env.pop("MODEL")
    missing = subprocess.run(
        [*cmd, "-f", str(COMPOSE), "config", "-q"], env=env, capture_output=True, text=True
    )
    assert missing.returncode != 0 and "MODEL" in missing.stderr

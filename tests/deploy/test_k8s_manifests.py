"""deploy/k8s: every manifest against the Kubernetes schemas (kubernetes-validate, strict: an
unknown or misplaced field fails), and the wiring between them: the rollout pods' DNS names in
the learner's servers list, the Indexed Job's rendezvous on its index-0 pod, the API key from a
Secret, the probes, the GPUs. The learner's command goes through accelerate's parser and the
learner's config loader, and the servers' through the rollout server's CLI.

kubernetes-validate is in the ``dev`` extra: without it this module fails to import (an error,
never a skip).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30"  # the oldest release whose Job API has everything used here
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def resources() -> dict[tuple[str, str], dict]:
    out = {}
    for path in manifest_files():
        for doc in yaml.safe_load_all(path.read_text()):
            out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


@pytest.fixture(scope="module")
def res() -> dict[tuple[str, str], dict]:
    return resources()


@pytest.mark.parametrize("version", [KUBERNETES_VERSION, kubernetes_validate.latest_version()])
@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
def test_manifest_validates_against_the_kubernetes_schemas(path: Path, version: str) -> None:
    docs = list(yaml.safe_load_all(path.read_text()))
    assert docs and all(docs)
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_rejects_an_unknown_field() -> None:
    sts = next(
        d
        for d in yaml.safe_load_all((K8S / "rollout.yaml").read_text())
        if d["kind"] == "StatefulSet"
    )
    sts = {**sts, "spec": {**sts["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, KUBERNETES_VERSION, strict=True)


def test_kustomization_lists_every_manifest() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kust["kind"] == "Kustomization"
    assert sorted(kust["resources"]) == [p.name for p in manifest_files()]


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion in command and args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], value)


def container_env(container: dict, res: dict) -> dict[str, str]:
    """Literal values and ConfigMap references resolved; Secrets and fieldRefs as markers."""
    env = {}
    for var in container["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        src = var["valueFrom"]
        if "configMapKeyRef" in src:
            ref = src["configMapKeyRef"]
            env[var["name"]] = res[("ConfigMap", ref["name"])]["data"][ref["key"]]
        elif "secretKeyRef" in src:
            env[var["name"]] = f"secret:{src['secretKeyRef']['name']}/{src['secretKeyRef']['key']}"
        else:
            env[var["name"]] = f"field:{src['fieldRef']['fieldPath']}"
    return env


def headless(res: dict, name: str, pod_labels: dict) -> dict:
    svc = res[("Service", name)]["spec"]
    assert svc["clusterIP"] == "None" and svc["publishNotReadyAddresses"] is True
    assert svc["selector"].items() <= pod_labels.items()
    return svc


def test_rollout_statefulset_probes_key_and_gpu(res: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    from rollout_server.cli import build_parser, settings_from_args

    sts = res[("StatefulSet", "grpo-rollout")]["spec"]
    pod = sts["template"]
    assert sts["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    svc = headless(res, sts["serviceName"], pod["metadata"]["labels"])
    (c,) = pod["spec"]["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    env = container_env(c, res)
    assert env["ROLLOUT_API_KEY"] == "secret:grpo-rollout-key/key"
    probes = {"startupProbe": "/ready", "readinessProbe": "/ready", "livenessProbe": "/health"}
    for probe, path in probes.items():
        cmd = c[probe]["exec"]["command"]
        assert cmd[1] == "/app/deploy/healthcheck.py" and cmd[2].endswith(f":8000{path}")
    assert "COPY deploy/healthcheck.py deploy/healthcheck.py" in (
        (ROOT / "deploy" / "rollout.Dockerfile").read_text()
    )
    args = [expand(a, env) for a in c["args"]]
    monkeypatch.setenv("ROLLOUT_API_KEY", "k3y")  # the Secret's: off loopback it is required
    settings = settings_from_args(build_parser().parse_args(["--engine", "vllm", *args]))
    assert settings.model == env["MODEL"] and settings.host == "0.0.0.0"
    assert settings.port == svc["ports"][0]["port"] == c["ports"][0]["containerPort"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["data"] == "/data" and mounts["shm"] == "/dev/shm"


def learner_job(res: dict) -> tuple[dict, dict, dict]:
    job = res[("Job", "grpo-learner")]
    pod = job["spec"]["template"]["spec"]
    (init,), (main,) = pod["initContainers"], pod["containers"]
    return job, init, main


def launch_args(command: list[str]) -> argparse.Namespace:
    from accelerate.commands.launch import launch_command_parser

    assert command[:2] == ["accelerate", "launch"]
    return launch_command_parser().parse_args(command[2:])


def test_learner_indexed_job_rendezvous_on_index_zero(res: dict) -> None:
    job, _, main = learner_job(res)
    spec, pod = job["spec"], job["spec"]["template"]
    assert spec["completionMode"] == "Indexed"
    env = container_env(main, res)
    assert env["MACHINE_RANK"] == f"field:{COMPLETION_INDEX}"
    assert "--machine_rank=$(MACHINE_RANK)" in main["command"]
    args = launch_args([expand(a, {**env, "MACHINE_RANK": "0"}) for a in main["command"]])
    assert spec["completions"] == spec["parallelism"] == args.num_machines >= 2
    gpus = main["resources"]["limits"]["nvidia.com/gpu"]
    assert args.num_processes == args.num_machines * gpus
    svc = headless(res, pod["spec"]["subdomain"], pod["metadata"]["labels"])
    # an Indexed Job's pod i has hostname <job>-<i>: index 0 hosts the rendezvous
    assert args.main_process_ip == f"{job['metadata']['name']}-0.{pod['spec']['subdomain']}"
    assert args.main_process_port in {p["port"] for p in svc["ports"]}
    assert (ROOT / args.config_file).is_file()


def test_learner_config_error_fails_the_job_at_once(res: dict) -> None:
    job, init, main = learner_job(res)
    assert init["command"] == ["python", "deploy/check_config.py"]
    assert init["args"] == main["command"] and init["env"] == main["env"]
    assert init["volumeMounts"] == main["volumeMounts"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    rules = job["spec"]["podFailurePolicy"]["rules"]
    fail = [r for r in rules if r["action"] == "FailJob"]
    assert fail == [
        {
            "action": "FailJob",
            "onExitCodes": {"containerName": init["name"], "operator": "In", "values": [2]},
        }
    ]


def test_learner_config_names_the_servers_and_the_sync_rendezvous(
    res: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mounted TOML, with the Job's own arguments, through the learner's config loader and
    through deploy/check_config.py as the init container runs it."""
    from learner.cli import train_parser
    from learner.config import load_config

    job, _, main = learner_job(res)
    pod = job["spec"]["template"]["spec"]
    (cm_volume,) = [v for v in pod["volumes"] if "configMap" in v]
    (mount,) = [m for m in main["volumeMounts"] if m["name"] == cm_volume["name"]]
    data = res[("ConfigMap", cm_volume["configMap"]["name"])]["data"]
    for name, text in data.items():
        (tmp_path / name).write_text(text)
    env = {**container_env(main, res), "MACHINE_RANK": "1"}
    command = [expand(a, env).replace(mount["mountPath"], str(tmp_path)) for a in main["command"]]
    args = launch_args(command)
    assert args.machine_rank == 1
    learner_args = train_parser().parse_args(args.training_script_args)
    monkeypatch.delenv("ROLLOUT_API_KEY", raising=False)
    cfg = load_config(learner_args.config, learner_args.overrides)
    assert learner_args.resume and learner_args.run_dir == f"/data/runs/{env['RUN_NAME']}"
    assert cfg.model.name_or_path == env["MODEL"]

    sts = res[("StatefulSet", "grpo-rollout")]["spec"]
    port = res[("Service", sts["serviceName"])]["spec"]["ports"][0]["port"]
    assert cfg.rollout.servers == [
        f"http://grpo-rollout-{i}.{sts['serviceName']}:{port}" for i in range(sts["replicas"])
    ]
    assert cfg.rollout.sync.type == "nccl"
    assert cfg.rollout.sync.master_address == args.main_process_ip
    learner_ports = {p["port"] for p in res[("Service", pod["subdomain"])]["spec"]["ports"]}
    assert cfg.rollout.sync.master_port in learner_ports - {args.main_process_port}

    check = subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "check_config.py"), *command],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0, check.stderr

"""Secrets on the server: the key stays out of ``ps`` (a file or the environment), a blank key
is refused, TLS serves HTTPS, and /weights/load_file reads only where the server loads weights
from, without telling a caller which other paths exist."""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from grpo_common.net import free_port
from rollout_server.cli import build_parser, main, settings_from_args
from rollout_server.settings import ServerSettings
from tests.rollout_server.cli_process import wait_ready

KEY = "file-key-7c1d"


def test_the_key_file_gives_the_key(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(f"{KEY}\n")
    args = build_parser().parse_args(["--model", "m", "--api-key-file", str(key_file)])
    assert settings_from_args(args).api_key == KEY


@pytest.mark.parametrize("source", ["flag", "file", "env"])
def test_a_blank_key_is_refused_in_one_line_naming_the_flag(tmp_path, capsys, monkeypatch, source):
    monkeypatch.delenv("ROLLOUT_API_KEY", raising=False)
    argv = ["--model", "m"]
    if source == "flag":
        argv += ["--api-key", "   "]
    elif source == "file":
        (tmp_path / "key").write_text(" \n\t\n")
        argv += ["--api-key-file", str(tmp_path / "key")]
    else:
        monkeypatch.setenv("ROLLOUT_API_KEY", "  ")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rollout-server: error: --api-key")
    assert "whitespace" in err


def test_a_key_file_open_to_other_users_is_warned_about(tmp_path, capsys):
    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    args = ["--model", "m", "--api-key-file", str(key_file)]
    key_file.chmod(0o644)
    assert settings_from_args(build_parser().parse_args(args)).api_key == KEY
    err = capsys.readouterr().err
    assert err.startswith("rollout-server: warning: --api-key-file") and err.count("\n") == 1
    assert "mode 0644" in err and f"chmod 600 {key_file}" in err, err
    key_file.chmod(0o600)
    assert settings_from_args(build_parser().parse_args(args)).api_key == KEY
    assert capsys.readouterr().err == ""


def test_a_missing_key_file_or_two_keys_are_refused(tmp_path, capsys):
    assert main(["--model", "m", "--api-key-file", str(tmp_path / "nope")]) == 2
    assert "--api-key-file: cannot read" in capsys.readouterr().err
    (tmp_path / "key").write_text(KEY)
    assert main(["--model", "m", "--api-key-file", str(tmp_path / "key"), "--api-key", "k"]) == 2
    assert "give the key once" in capsys.readouterr().err


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key (the cryptography package, else openssl)."""
    key_path, cert_path = tmp_path / "key.pem", tmp_path / "cert.pem"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1", "-addext",
             "subjectAltName=IP:127.0.0.1", "-keyout", str(key_path), "-out", str(cert_path)],
            check=True, capture_output=True,
        )  # fmt: skip
        return key_path, cert_path
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


def test_https_with_a_key_file_that_ps_never_shows(tiny_model_dir, tmp_path):
    key_pem, cert_pem = _self_signed(tmp_path)
    key_file = tmp_path / "api-key"
    key_file.write_text(KEY + "\n")
    port = free_port()
    env = {**os.environ, "ROLLOUT_API_KEY": ""}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout_server", "--model", str(tiny_model_dir), "--port",
         str(port), "--api-key-file", str(key_file), "--ssl-keyfile", str(key_pem),
         "--ssl-certfile", str(cert_pem), "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert KEY.encode() not in cmdline
        url = f"https://127.0.0.1:{port}"
        auth = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(base_url=url, verify=str(cert_pem), timeout=10) as http:
            wait_ready(proc, http, auth)
            assert http.get("/info").status_code == 401
            r = http.post("/generate", json={"prompts": ["hi"], "max_tokens": 2}, headers=auth)
            assert r.status_code == 200
        with pytest.raises(httpx.TransportError):  # plain HTTP is not served
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tiny_model_dir):
    """allowed/ (the --weights-dir) and outside/, each with a copy of the model's weights."""
    root = tmp_path_factory.mktemp("load-file")
    for sub in ("allowed", "outside"):
        (root / sub).mkdir()
        shutil.copy(tiny_model_dir / "model.safetensors", root / sub / "model.safetensors")
    (root / "allowed" / "link.safetensors").symlink_to(root / "outside" / "model.safetensors")
    (root / "allowed" / "linked-dir").symlink_to(root / "outside")
    return root


@pytest.fixture(scope="module")
def server(start_server, tiny_model_dir, dirs):
    settings = ServerSettings(model=str(tiny_model_dir), weights_dir=str(dirs / "allowed"))
    with start_server(settings) as s:
        yield s


def _load(server, path: Path | str) -> httpx.Response:
    return httpx.post(f"{server.url}/weights/load_file", json={"path": str(path)}, timeout=60)


def test_load_file_reads_the_weights_dir_and_the_models_own(server, dirs, tiny_model_dir):
    assert _load(server, dirs / "allowed" / "model.safetensors").status_code == 200
    assert _load(server, tiny_model_dir).status_code == 200


@pytest.mark.parametrize(
    "outside",
    [
        "outside/model.safetensors",  # an existing file elsewhere
        "outside",  # an existing directory elsewhere
        "allowed/../outside/model.safetensors",  # '..' out of the directory
        "allowed/link.safetensors",  # a link inside, to a file outside
        "allowed/linked-dir",  # a link inside, to a directory outside
        "/etc/passwd",
        "allowed/model\0.safetensors",  # a NUL byte: no file has one in its name
        "allowed/" + "x" * 5000,  # a name longer than a file system allows
    ],
)
def test_load_file_answers_a_path_outside_as_a_missing_one(server, dirs, outside):
    path = outside if outside.startswith("/") else f"{dirs}/{outside}"
    missing = f"{Path(path).parent}/no-such-file"
    refused, absent = _load(server, path), _load(server, missing)
    assert refused.status_code == absent.status_code == 400
    detail = refused.json()["detail"]
    assert detail == absent.json()["detail"].replace(missing, path)
    assert "no such file" in detail

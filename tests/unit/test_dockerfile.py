"""The Dockerfile installs what the README installs and runs what the README runs: a multi-stage build of this
project's wheel with the `server` extra (the README's set-up command), kvbrokerd as the entry point, a non-root
user, only the runtime environment in the final stage, and a HEALTHCHECK that really asks the gRPC health service
(run here against a real daemon).

Building the image needs a container engine and the base image: with KVBROKER_IMAGE_TEST=1 (and podman or docker
on PATH) the last test builds the image, runs it, checks health, the user and a clean SIGTERM exit. Extra
engine flags: KVBROKER_ENGINE_BUILD_ARGS / KVBROKER_ENGINE_RUN_ARGS (shell words), e.g. a base image mirror with
`--build-arg PYTHON_IMAGE=...`."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvbroker._local import LocalDaemon
from kvbrokerd import config
from tests.helpers import wait_until

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


@dataclass
class Instruction:
    op: str
    args: str


@dataclass
class Stage:
    base: str
    name: str
    steps: list[Instruction]

    def all(self, op: str) -> list[str]:
        return [i.args for i in self.steps if i.op == op]


def parse(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Global ARGs (with defaults) and the stages, line continuations joined, comments dropped."""
    logical: list[str] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        logical.append(buf + line)
        buf = ""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        op, _, rest = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            words = rest.split()
            stages.append(Stage(words[0], words[2] if len(words) > 2 and words[1].upper() == "AS" else "", []))
        elif op == "ARG" and not stages:
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip()
        else:
            assert stages, f"{op} before FROM"
            stages[-1].steps.append(Instruction(op, rest.strip()))
    return args, stages


ARGS, STAGES = parse(DOCKERFILE.read_text())
FINAL = STAGES[-1]


def readme_setup_extra() -> str:
    """The extra the README's set-up command installs: `pip install ... -e '.[server]'` -> "server"."""
    m = re.search(r"pip install[^\n`]*'\.\[(\w+)\]'", (ROOT / "README.md").read_text())
    assert m, "the README's set-up command installs '.[EXTRA]'"
    return m.group(1)


def test_multi_stage_on_a_slim_python_base() -> None:
    assert len(STAGES) >= 2
    assert ARGS["PYTHON_IMAGE"] == "python:3.11-slim"
    assert all(s.base == "${PYTHON_IMAGE}" for s in STAGES)
    assert STAGES[0].name == "build"


def test_build_stage_installs_the_readme_extra_from_a_wheel_of_this_project() -> None:
    extra = readme_setup_extra()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert extra in project["optional-dependencies"]
    run = " ".join(STAGES[0].all("RUN"))
    assert re.search(r"pip wheel --no-deps --wheel-dir (\S+) \.(\s|$)", run), "builds the wheel of ."
    assert f"'{project['name']}[{extra}]'" in run and "--find-links /wheels" in run
    assert "-e " not in run  # an image installs, it does not develop
    copied = {Path(w).name for c in STAGES[0].all("COPY") for w in c.split()[:-1]}
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert {"pyproject.toml", project["readme"], *packages["where"]} <= copied


def test_runtime_stage_has_only_the_environment_and_runs_kvbrokerd_as_non_root() -> None:
    assert not any("pip" in r for r in FINAL.all("RUN")), "no installs in the runtime stage"
    assert any(c.startswith("--from=build /opt/kvbroker ") for c in FINAL.all("COPY"))
    (user,) = FINAL.all("USER")
    assert user.split(":")[0] not in ("root", "0")
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    (entry,) = FINAL.all("ENTRYPOINT")
    assert json.loads(entry) == ["kvbrokerd"] and "kvbrokerd" in scripts
    assert json.loads(FINAL.all("CMD")[-1]) == []


def test_env_defaults_are_valid_daemon_settings(tmp_path: Path) -> None:
    env: dict[str, str] = {}
    for line in FINAL.all("ENV"):
        env.update((k, v) for k, v in (w.split("=", 1) for w in shlex.split(line)))
    daemon = {k: v for k, v in env.items() if k.startswith("KVBROKER_")}
    fields = {f"KVBROKER_{n.upper()}" for n in config.Config.__dataclass_fields__}
    assert set(daemon) <= fields
    assert daemon["KVBROKER_LISTEN"] == "unix:///run/kvbroker/kvbroker.sock"
    token = tmp_path / "token"  # the operator mounts the peer token (README: docker run ... -v token)
    token.write_text("a-token-of-thirty-two-characters")
    token.chmod(0o600)
    cfg, _ = config.load([], {**daemon, "KVBROKER_CLUSTER_ID": "1", "KVBROKER_PEER_TOKEN_FILE": str(token)})
    assert cfg.peer_listen.endswith(":7100") and "7100" in " ".join(FINAL.all("EXPOSE"))


def healthcheck_command() -> list[str]:
    (hc,) = FINAL.all("HEALTHCHECK")
    _, _, cmd = hc.partition(" CMD ")
    assert "--interval=" in hc and "--timeout=" in hc
    command: list[str] = json.loads(cmd)
    return command


def test_healthcheck_asks_the_grpc_health_service_of_a_real_daemon(tmp_path: Path) -> None:
    cmd = healthcheck_command()
    assert cmd[0] == "python3" and "grpc_health" in cmd[-1]
    exe = [sys.executable, *cmd[1:]]  # python3 of the image = the venv's python, which has grpc_health
    with LocalDaemon(tmp_path, 1) as d:
        ok = subprocess.run(exe, env={**os.environ, "KVBROKER_LISTEN": d.target}, capture_output=True, timeout=30)
        assert ok.returncode == 0, ok.stderr
    down = subprocess.run(exe, env={**os.environ, "KVBROKER_LISTEN": f"unix://{tmp_path}/gone.sock"},
                          capture_output=True, timeout=30)
    assert down.returncode != 0


def _engine() -> str | None:
    return shutil.which("podman") or shutil.which("docker")


@pytest.mark.skipif(os.environ.get("KVBROKER_IMAGE_TEST") != "1",
                    reason="building the image needs a container engine and the base image: KVBROKER_IMAGE_TEST=1")
@pytest.mark.timeout(900)
def test_image_builds_runs_healthy_and_stops_cleanly(tmp_path: Path) -> None:
    engine = _engine()
    assert engine, "KVBROKER_IMAGE_TEST=1 but neither podman nor docker is on PATH"
    tag = f"localhost/kvbroker-test:{uuid.uuid4().hex[:8]}"
    name = f"kvbroker-test-{uuid.uuid4().hex[:8]}"
    build_args = shlex.split(os.environ.get("KVBROKER_ENGINE_BUILD_ARGS", ""))
    run_args = shlex.split(os.environ.get("KVBROKER_ENGINE_RUN_ARGS", ""))
    built = subprocess.run([engine, "build", *build_args, "-t", tag, str(ROOT)], capture_output=True, text=True,
                           timeout=800)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    try:
        started = subprocess.run([engine, "run", "-d", *run_args, "--name", name, "-e", "KVBROKER_CLUSTER_ID=7",
                                  "-e", "KVBROKER_PEER_LISTEN=127.0.0.1:0", "--read-only", tag],
                                 capture_output=True, text=True, timeout=60)
        assert started.returncode == 0, started.stderr
        said: list[str] = []

        def healthy() -> bool:  # the HEALTHCHECK command itself, run by the engine inside the container
            health = subprocess.run([engine, "healthcheck", "run", name] if "podman" in engine else
                                    [engine, "exec", name, *healthcheck_command()],
                                    capture_output=True, text=True, timeout=30)
            said[:] = [health.stdout + health.stderr]
            return health.returncode == 0

        try:
            wait_until(healthy, timeout=30, poll=1, what="the container's HEALTHCHECK passing")
        except AssertionError as e:
            raise AssertionError(f"{e}: {said}") from None
        uid = subprocess.run([engine, "exec", name, "id", "-u"], capture_output=True, text=True, timeout=30)
        assert uid.stdout.strip() == "10001"
        pkgs = subprocess.run([engine, "exec", name, "pip", "list", "--format=freeze"], capture_output=True,
                              text=True, timeout=60)
        names = {ln.split("==")[0].lower() for ln in pkgs.stdout.splitlines()}
        assert "kvbroker" in names and "grpcio-health-checking" in names
        assert not names & {"pytest", "mypy", "ruff", "grpcio-tools", "hypothesis"}, "test tools in the image"
        stopped = subprocess.run([engine, "stop", "-t", "20", name], capture_output=True, text=True, timeout=60)
        assert stopped.returncode == 0, stopped.stderr
        code = subprocess.run([engine, "inspect", name, "--format", "{{.State.ExitCode}}"], capture_output=True,
                              text=True, timeout=30)
        assert code.stdout.strip() == "0", "SIGTERM drains and exits 0"
    finally:
        subprocess.run([engine, "rm", "-f", name], capture_output=True, timeout=60)
        subprocess.run([engine, "rmi", "-f", tag], capture_output=True, timeout=60)

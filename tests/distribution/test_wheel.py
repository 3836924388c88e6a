"""The wheel: `pip wheel . --no-deps` builds it (scikit-build-core, build isolation from the package index) in a
build folder of its own, it holds the package and the compiled psrl._kvx and nothing of the checkout besides,
and it installs and imports in fresh virtual environments: `[client]` (numpy and httpx, no torch) and
`[gateway]` (torch taken first from the local CPU build), whose two commands answer --help."""

from __future__ import annotations

import email.parser
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The local CPU build (docs/development.md); a plain `torch` would download multi-GB CUDA builds.
TORCH_SPEC = "torch==2.13.0"

pytestmark = [pytest.mark.slow, pytest.mark.procs]


def _run(argv: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run outside the checkout (so `import psrl` cannot find the source tree) with no PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(argv)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # A build folder of its own: the default (build/{wheel_tag}) is the editable install's, and reusing it
    # would test that build, not a clean one.
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(ROOT),
            "--no-deps",
            "--wheel-dir",
            str(out / "dist"),
            f"--config-settings=build-dir={out / 'build'}",
        ],
        cwd=out,
    )
    (found,) = (out / "dist").glob("psrl_gateway-*.whl")
    return found


def _venv(path: Path) -> Path:
    _run([sys.executable, "-m", "venv", str(path)], cwd=path.parent, timeout=120)
    return path / "bin" / "python"


@pytest.fixture(scope="module")
def client_python(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("client-venv")
    python = _venv(root / "venv")
    _run([str(python), "-m", "pip", "install", "--quiet", f"{wheel}[client]"], cwd=root)
    yield python
    shutil.rmtree(root, ignore_errors=True)


def test_wheel_contents(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"psrl", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}, top
    assert any(n.startswith("psrl/_kvx.") and n.endswith(".so") for n in names), "no compiled psrl/_kvx"
    assert "psrl/tito/__init__.py" in names and "psrl/gateway/__main__.py" in names
    unwanted = [n for n in names if "__pycache__" in n or n.endswith(".pyc") or n.startswith(("tests/", ".venv/"))]
    assert not unwanted, unwanted


def test_wheel_metadata_lists_the_extras(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        (meta_name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        meta = email.parser.Parser().parsestr(z.read(meta_name).decode())
    extras = set(meta.get_all("Provides-Extra") or [])
    assert {"vllm", "ray", "client", "gateway"} <= extras, extras
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras == set(declared), f"the wheel's extras {extras} differ from pyproject's {set(declared)}"
    base = [r for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r]
    assert sorted(r.split(">")[0].split("=")[0].strip() for r in base) == ["httpx", "numpy"], base


def test_client_install_imports_without_torch(client_python: Path, tmp_path: Path) -> None:
    code = (
        "import importlib.util, sys, psrl, psrl.tito, psrl._kvx as k\n"
        "from psrl.tito import build_training_arrays\n"
        "assert psrl.__file__.startswith(sys.prefix), psrl.__file__\n"
        "assert importlib.util.find_spec('torch') is None, 'the client install pulled torch'\n"
        "assert importlib.util.find_spec('grpc') is None, 'the client install pulled grpc'\n"
        "assert 'torch' not in sys.modules\n"
        "print(k.HAS_CUDA)\n"
    )
    out = _run([str(client_python), "-c", code], cwd=tmp_path).stdout.strip()
    assert out in ("True", "False"), out
    if shutil.which("nvcc"):
        assert out == "True", "nvcc is on PATH, yet the wheel's psrl._kvx has no CUDA path"


def test_gateway_install_runs_the_commands(wheel: Path, tmp_path: Path) -> None:
    python = _venv(tmp_path / "venv")
    _run([str(python), "-m", "pip", "install", "--quiet", TORCH_SPEC], cwd=tmp_path)
    _run([str(python), "-m", "pip", "install", "--quiet", f"{wheel}[gateway]"], cwd=tmp_path)
    torch_version = _run([str(python), "-c", "import torch; print(torch.__version__)"], cwd=tmp_path).stdout
    assert torch_version.startswith(TORCH_SPEC.split("==")[1]), f"[gateway] replaced torch: {torch_version}"
    gateway = _run([str(python), "-m", "psrl.gateway", "--help"], cwd=tmp_path, timeout=120).stdout
    assert "--worker-urls" in gateway and "--replica-token-file" in gateway
    worker = _run([str(python), "-m", "psrl.worker", "--help"], cwd=tmp_path, timeout=120).stdout
    assert "--engine" in worker and "--advertise-host" in worker

"""CPU tier: `pip install .` finds the headers the README has the user install first (nvidia-cutlass, the cuDNN
frontend) although pip builds in an isolated environment. Under pip's build isolation the interpreter is the user's,
but a sitecustomize on PYTHONPATH hides the user's site-packages; the same hiding is emulated here and CMake's
configure step must still find both (a full `pip wheel .` in a fresh virtualenv is the same check end to end, minus
the ~20-minute compile)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _isolated_env(tmp_path: Path) -> dict:
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "sitecustomize.py").write_text(
        "import sys\nsys.path[:] = [p for p in sys.path if 'site-packages' not in p]\n")
    return dict(os.environ, PYTHONPATH=str(overlay), PYTHONNOUSERSITE="1")


def _cmake() -> str | None:
    """The CMake binary itself: the PyPI wrapper script on PATH imports its package, which the isolation hides."""
    try:
        import cmake
        return os.path.join(cmake.CMAKE_BIN_DIR, "cmake")
    except ImportError:
        return shutil.which("cmake")


def _has_module(name: str, env: dict) -> bool:
    code = f"import importlib.util as u; print(u.find_spec({name!r}) is not None)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip() == "True"


@pytest.mark.skipif(_cmake() is None or shutil.which("nvcc") is None and
                    not Path("/usr/local/cuda/bin/nvcc").exists(), reason="needs CMake and the CUDA toolkit")
def test_configure_finds_cutlass_under_pip_build_isolation(tmp_path):
    if not _has_module("cutlass_library", dict(os.environ)):
        pytest.skip("nvidia-cutlass is not installed in this environment (scripts/setup.sh installs it)")
    env = _isolated_env(tmp_path)
    assert not _has_module("cutlass_library", env), "the emulated isolation must hide the user's packages"
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    out = subprocess.run(
        [_cmake(), "-S", str(ROOT), "-B", str(tmp_path / "build"), f"-DPython3_EXECUTABLE={sys.executable}",
         f"-DCMAKE_CUDA_COMPILER={nvcc}", "-DKFUSE_BUILD_TESTS=OFF", "-DKFUSE_BUILD_PYTHON=OFF",
         "-DKFUSE_BUILD_EXAMPLES=OFF"],
        env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "kfuse: CUTLASS headers in" in out.stdout
    frontend = Path(sysconfig.get_paths()["purelib"]) / "include" / "cudnn_frontend.h"
    if frontend.exists() and "cudnn.h not found" not in out.stdout:
        assert "cuDNN graph API (frontend) headers in" in out.stdout

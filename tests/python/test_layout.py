"""CPU tier: the source tree keeps its layering rules, checked on the files themselves. Kernels include only kernels,
CUTLASS/CuTe and the public headers (never the engines above them); the C++ core includes no PyTorch or Python;
environment variables are read only where the user's three are handled and in the developer-override file; no
source file grows past ~600 lines."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("*.cpp", "*.h", "*.cu", "*.cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def _files(folder: str):
    return sorted(p for pattern in SOURCES for p in (ROOT / folder).rglob(pattern))


def test_kernels_include_no_engine_code():
    allowed = ("kernels/", "kfuse/", "cutlass/", "cute/")
    bad = [f"{p.relative_to(ROOT)}: {inc}" for p in _files("src/kernels") for inc in INCLUDE.findall(p.read_text())
           if not inc.startswith(allowed)]
    assert not bad, "kernels must not include the engines above them:\n" + "\n".join(bad)


def test_the_core_does_not_depend_on_pytorch_or_python():
    pattern = re.compile(r'#\s*include\s+[<"](torch/|ATen/|c10/|Python\.h|pybind11/|nanobind/)')
    bad = [str(p.relative_to(ROOT)) for folder in ("src", "include") for p in _files(folder)
           if pattern.search(p.read_text())]
    assert not bad, bad


def test_environment_variables_are_read_in_known_places_only():
    # The user's three (cuDNN on/off, tuning mode, cache directory, with XDG/HOME for the default location) and the
    # developer A/B overrides, parsed in one file.
    allowed = {"src/kernels/conv/cudnn_conv.cpp", "src/tuner/tuner.cpp", "src/tuner/tuning_cache.cpp",
               "src/core/dev_overrides.cpp"}
    readers = {str(p.relative_to(ROOT)) for p in _files("src") if "getenv" in p.read_text()}
    assert readers <= allowed, sorted(readers - allowed)


def test_no_source_file_is_over_600_lines():
    long = [f"{p.relative_to(ROOT)}: {n}" for folder in ("src", "include", "python/kfuse", "python/src")
            for p in _files(folder) + sorted((ROOT / folder).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 600]
    assert not long, long

#!/usr/bin/env bash
# One set-up step for both README commands: a local virtualenv (.venv) with what kfuse builds and tests with,
# plus the Debian packages the C++ build uses. Idempotent: a stamp records what was installed, so a second run
# returns in well under a second.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

venv="$root/.venv"
stamp="$venv/.kfuse-setup-stamp"
want="$(cat scripts/setup.sh scripts/requirements.txt | sha256sum | cut -c1-16)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi

# Debian: ccache (rebuilds of CUTLASS instantiations cost ~60 s each), nlohmann-json (safetensors headers, tuner
# cache), GoogleTest. Only as root and only what is missing.
need=()
command -v ccache >/dev/null || need+=(ccache)
[[ -f /usr/include/nlohmann/json.hpp ]] || need+=(nlohmann-json3-dev)
[[ -f /usr/include/gtest/gtest.h ]] || need+=(libgtest-dev)
command -v ninja >/dev/null || need+=(ninja-build)
if ((${#need[@]})); then
  if [[ $(id -u) == 0 ]]; then
    echo "[setup] apt-get install ${need[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "[setup] missing Debian packages: ${need[*]} (run as root or install them)" >&2
    exit 1
  fi
fi

[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q -r scripts/requirements.txt
# CUTLASS ships its C++ headers only inside this wheel; its Python dependencies are not wanted.
"$py" -m pip install -q --no-deps nvidia-cutlass==4.2.0.0
# cuDNN's graph API frontend, header-only C++ (its include/ folder; the wheel's Python part is not used).
"$py" -m pip install -q --no-deps nvidia-cudnn-frontend==1.32.0
# The in-tree package (python/kfuse, its extension built into it by CMake) is importable from the venv.
site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$root/python" > "$site/kfuse-dev.pth"
# The `kfuse` command, as `pip install .` would create it.
cat > "$venv/bin/kfuse" <<EOS
#!/usr/bin/env bash
exec "$py" -m kfuse "\$@"
EOS
chmod +x "$venv/bin/kfuse"
echo "$want" > "$stamp"
echo "[setup] done: $venv"

#!/usr/bin/env bash
# Packs what the GPU machine needs from this machine's build into .kfuse-dist/ (git-ignored; name it in the device
# tool's `carry`): the compiled CUTLASS kernel objects (the expensive part: ~60 s per sm90 instantiation), the
# header-only JSON library, and the C++ GPU test binaries. scripts/gpu_run.sh then compiles only the plain C++ core
# and the Python extension there, with that machine's compiler for that machine's Python.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/build.sh
rm -rf .kfuse-dist
mkdir -p .kfuse-dist/objects .kfuse-dist/bin .kfuse-dist/include
# Only the objects the current build graph names: a source removed since (a reverted kernel) leaves its stale .o in
# build/, and the GPU machine links every object of the bundle.
ninja -C build -t targets all | sed -n 's|^\(src/kernels/CMakeFiles/\(kfuse_kernels_[^/]*\)\.dir/.*\.o\): .*|\2 \1|p' |
  while read -r lib obj; do
    mkdir -p ".kfuse-dist/objects/$lib"
    cp "build/$obj" ".kfuse-dist/objects/$lib/"
  done
for inc in /usr/include /usr/local/include; do
  [[ -f "$inc/nlohmann/json.hpp" ]] && { cp -r "$inc/nlohmann" .kfuse-dist/include/; break; }
done
# cuDNN's headers (the toolkit's here; the GPU machine's cuDNN may have come with PyTorch's wheels, without them): kfuse
# loads cuDNN at run time and needs only its declarations to build (kernels/conv/cudnn_conv.h).
cudnn_inc=$(dirname "$(find /usr/local/cuda/include /usr/include -maxdepth 1 -name cudnn.h 2>/dev/null | head -1)" 2>/dev/null || true)
if [[ -n "$cudnn_inc" && -f "$cudnn_inc/cudnn.h" ]]; then
  mkdir -p .kfuse-dist/include/cudnn && cp "$cudnn_inc"/cudnn*.h .kfuse-dist/include/cudnn/
fi
# cuDNN's graph API frontend (header-only; kernels/conv/cudnn_fused.cpp is compiled there). Its headers include
# "../include/...": the folder must be named include.
cfe=$(.venv/bin/python -c 'import sysconfig,os;d=os.path.join(sysconfig.get_paths()["purelib"],"include");print(d if os.path.isfile(d+"/cudnn_frontend.h") else "")' 2>/dev/null || true)
if [[ -n "$cfe" ]]; then
  mkdir -p .kfuse-dist/cudnn_frontend/include
  cp -r "$cfe"/cudnn_frontend* "$cfe"/cudnn_backend_base.h .kfuse-dist/cudnn_frontend/include/
fi
cp build/tests/cpp/test_*_gpu .kfuse-dist/bin/
{ git rev-parse --short HEAD 2>/dev/null || echo unknown; } | tr -d '\n' > .kfuse-dist/COMMIT
if git status --porcelain --untracked-files=no | grep -q .; then echo -n "+dirty" >> .kfuse-dist/COMMIT; fi
echo "[bundle] .kfuse-dist: $(du -sh .kfuse-dist | cut -f1), commit $(cat .kfuse-dist/COMMIT)"

"""The main job runs on a machine without a GPU: it says so and runs the CPU reference."""

import os
import subprocess
import sys

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of `kfuse bench` runs only without a GPU")
def test_bench_without_gpu_runs_the_cpu_reference():
    out = subprocess.run([sys.executable, "-m", "kfuse", "bench", "--batch", "1", "--channels", "3"],
                         capture_output=True, text=True, check=True, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert "need an NVIDIA GPU" in out.stdout
    assert "checksum" in out.stdout and "output (1, 512, 2, 2)" in out.stdout


def test_info():
    out = subprocess.run([sys.executable, "-m", "kfuse", "info"], capture_output=True, text=True, check=True)
    assert "kfuse" in out.stdout and "torch" in out.stdout

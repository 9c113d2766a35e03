"""GPU tier, two GPUs: the DD-PPO loop (kfuse.rl) data-parallel over two processes with NCCL, fp16 on CUDA, as
test_rl_ddp.py checks it on the CPU with gloo: every rank holds the same weights after each update (rank 0's
broadcast into every rank's parameter storage, then all-reduced gradients), with kfuse's encoder and with plain
PyTorch's, eager and compiled as the rl benchmark compiles them (the update through the DDP wrapper). Skipped without
two CUDA GPUs."""

import pytest
import torch

import kfuse
from test_rl_ddp import check_ranks_agree

pytestmark = pytest.mark.skipif(not kfuse.cuda_available() or torch.cuda.device_count() < 2,
                                reason="needs two CUDA GPUs and a CUDA build of kfuse")


@pytest.mark.parametrize("impl", ["kfuse", "torch", "torch-jit-fp16", "kfuse-compile"])
def test_every_rank_holds_the_same_weights_after_each_update_on_two_gpus(impl, tmp_path):
    check_ranks_agree(impl, tmp_path, device_type="cuda")

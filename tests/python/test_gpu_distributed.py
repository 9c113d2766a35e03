"""GPU tier: kfuse.DistributedDataParallel on two GPUs (NCCL) with the CUDA encoder in fp16, against torch's
DistributedDataParallel: the checks of test_distributed.py (rank 0's parameters everywhere, the same averaged
gradients on both wrappers and ranks, fresh, accumulated and after no_sync()). fp16 gradients: the two runs' local
gradients may differ by one fp16 rounding (the cuDNN graphs' sums vary in order), so 2e-3 normwise. Skipped
without two CUDA GPUs."""

import pytest
import torch

import kfuse
from test_distributed import WORLD, assert_same_gradients, run_workers

pytestmark = pytest.mark.skipif(not kfuse.cuda_available() or torch.cuda.device_count() < WORLD,
                                reason="needs two CUDA GPUs and a CUDA build of kfuse")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_workers(tmp_path_factory.mktemp("ddp_gpu"), "cuda")


@pytest.mark.parametrize("kind", ["with_head", "encoder"])
@pytest.mark.parametrize("stage", ["start", "fresh", "accumulated", "after_no_sync"])
def test_same_as_torch_ddp_on_every_rank(results, kind, stage):
    reference = results[0][kind, "torch"][stage]
    for rank in range(WORLD):
        assert_same_gradients(results[rank][kind, "kfuse"][stage], reference, f"rank {rank} {stage}", tol=2e-3)
    # NCCL gives every rank the same sums
    assert all(torch.equal(a, b) for a, b in zip(results[0][kind, "kfuse"][stage], results[1][kind, "kfuse"][stage])
               if a is not None)

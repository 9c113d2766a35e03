"""GPU tier: kfuse's encoder inside a CUDA graph its caller captured (torch.cuda.graph, torch.compile's reduce-overhead
mode, kfuse.rl.GraphedActor) stays correct after what the caller does between replays: a new input normalization,
and calls of other geometries that make kfuse replace its device memory with larger allocations. Such a graph holds
the addresses it was captured with and runs no Python at replay (skipped without a CUDA GPU)."""

import pytest
import torch
from conftest import captured_by_caller, rel_err
from test_gpu_inference import TOL, normalized_uint8, reference64

import kfuse

pytestmark = pytest.mark.skipif(not kfuse.cuda_available(), reason="needs a CUDA GPU and a CUDA build of kfuse")


def test_a_new_input_normalization_reaches_the_callers_graph(make_reference):
    """set_input_normalization between two replays: the next replay normalizes with the new values, though no Python
    of the module runs in it (the new map is written to the device at once)."""
    ref = make_reference(in_channels=3, seed=51)
    enc = kfuse.ResNetEncoder.from_torch(ref).cuda().half().eval()
    img = torch.randint(0, 256, (8, 64, 64, 4), generator=torch.Generator().manual_seed(51), dtype=torch.uint8)
    first = (torch.tensor([0.4, 0.5, 0.6]), torch.tensor([0.05, 0.02, 0.2]))
    second = (torch.tensor([0.1, 0.8, 0.3]), torch.tensor([0.3, 0.01, 0.08]))
    enc.set_input_normalization(*first)
    graph, y = captured_by_caller(enc, img.cuda())
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(y, reference64(ref, normalized_uint8(img, first))) <= TOL, "before the change"
    want = reference64(ref, normalized_uint8(img, second))
    assert rel_err(want, reference64(ref, normalized_uint8(img, first))) > 10 * TOL, "the change would not show"
    enc.set_input_normalization(*second)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(y, want) <= TOL, "the caller's graph kept the old normalization"


def test_the_callers_graph_survives_larger_geometries_and_training(make_reference):
    """After the capture (batch 8), inference and training calls of larger batches and other image sizes may need a
    larger convolution workspace, training scratch or job table; kfuse then recaptures its own graphs, but the caller's
    still holds the old addresses, so they must stay allocated. Then a large tensor filled with NaN takes whatever
    memory was given back: the replay must be right and must leave that tensor alone."""
    ref = make_reference(in_channels=3, seed=52)
    enc = kfuse.ResNetEncoder.from_torch(ref).cuda().half().eval()
    gen = torch.Generator().manual_seed(52)
    x = torch.rand(8, 3, 64, 64, generator=gen)
    graph, y = captured_by_caller(enc, x.cuda().half())
    for n, h, w in ((128, 64, 64), (1024, 64, 64), (64, 96, 128)):
        xb = torch.rand(n, 3, h, w, device="cuda", dtype=torch.float16)
        with torch.no_grad():
            enc(xb)
        enc.train()
        enc(xb[: min(n, 256)]).float().sum().backward()
        enc.eval()
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    trap = torch.full((max(free // 2 - (1 << 30), 1 << 20),), float("nan"), device="cuda", dtype=torch.float16)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(y, reference64(ref, x)) <= TOL, "the caller's graph after the encoder's memory grew"
    assert torch.isnan(trap).all(), "the caller's graph wrote into memory the encoder had given back"

"""GPU checks of the L2 prefetch kernel (the interpreter check is in interp_extras.py)."""

import pytest
import torch

from kdaserve.kernels.linear.prefetch import prefetch_checksum_reference, prefetch_l2

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


@pytest.mark.parametrize("shape", [(2304, 4096), (7, 1000)])
def test_prefetch_checksum_gpu(shape):
    t = torch.randn(shape, device="cuda").to(torch.bfloat16)
    sink = prefetch_l2(t)
    ref = prefetch_checksum_reference(t.cpu(), sink.numel())
    assert torch.equal(sink.cpu(), ref)


def test_prefetch_side_stream_in_graph_gpu():
    """layers/prefetch.py's fork/join inside a CUDA-graph capture: the branch runs on replay and
    the main stream's result is unchanged."""
    from kdaserve.layers.prefetch import WeightPrefetch

    w = torch.randn(2304, 4096, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    pf = WeightPrefetch(enabled=True)

    def step():
        with pf(1, w):
            y = torch.relu(x) * 2
        return y @ w.T

    expect = step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    pf._sink.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expect)
    n = pf._sink.numel()
    assert torch.equal(pf._sink.cpu(), prefetch_checksum_reference(w.cpu(), n))

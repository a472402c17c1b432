"""`kernels.device_tensor`: host lists as device tensors without the host waiting for queued GPU work."""

from __future__ import annotations

import pytest
import torch

from kernels.device_tensors import device_tensor


def test_on_cpu_it_is_torch_tensor() -> None:
    cpu = torch.device("cpu")
    flat = device_tensor([3, 1, 2], torch.int64, cpu)
    assert flat.dtype == torch.int64 and flat.device == cpu and flat.tolist() == [3, 1, 2]
    nested = device_tensor([[1, 2], [3, 0]], torch.int32, cpu)
    assert nested.shape == (2, 2) and nested.dtype == torch.int32
    assert device_tensor([0.5, 2.0], torch.float32, cpu).tolist() == [0.5, 2.0]
    assert device_tensor([], torch.int64, cpu).shape == (0,)


@pytest.mark.gpu
def test_on_cuda_the_copy_does_not_wait_for_queued_kernels_and_arrives_in_stream_order() -> None:
    cuda = torch.device("cuda")
    big = torch.randn(4096, 4096, device=cuda)
    for _ in range(40):  # ~100 ms of queued work
        big = big @ big / 64
    queued = torch.cuda.Event()
    queued.record()
    values = list(range(1000))
    out = device_tensor(values, torch.int64, cuda)
    # The host came back before the queued work finished (a pageable copy would have waited for it).
    assert not queued.query()
    # Stream order: a kernel queued after the copy sees the copied values.
    total = out.sum()
    assert out.device.type == "cuda" and out.dtype == torch.int64
    assert int(total) == sum(values) and out.tolist() == values
    # Many in flight at once: each staging block stays valid until its own copy is done.
    outs = [device_tensor([i] * 64, torch.int32, cuda) for i in range(64)]
    torch.cuda.synchronize()
    assert all(o.tolist() == [i] * 64 for i, o in enumerate(outs))

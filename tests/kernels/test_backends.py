"""Every attention entry point resolves its backend in one table (`kernels.resolve_backend`): for each op,
device kind and backend, the module it resolves to has the op, so no entry point can fall through to a
module without it. CUDA is simulated (only the device kind and triton's presence are read): the check runs
on CPU CI."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

import kernels

OPS = (
    "paged_decode_attention",
    "shared_prefix_decode_attention",
    "merge_attention_states",
    "paged_prefill_attention",
)
DEVICES = (torch.device("cpu"), torch.device("cuda", 0))


def test_the_table_covers_every_public_op() -> None:
    public = {n for n in kernels.__all__ if n.endswith(("_attention", "_states")) and n != "resolve_backend"}
    assert public == set(OPS)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("device", DEVICES, ids=str)
@pytest.mark.parametrize("has_triton", [True, False])
@pytest.mark.parametrize("backend", ["auto", "triton", "torch", "reference"])
def test_each_op_resolves_to_a_module_that_has_it(
    op: str, device: torch.device, has_triton: bool, backend: kernels.Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kernels, "triton_available", lambda: has_triton)
    try:
        concrete, module = kernels.resolve_backend(op, backend, device)
    except ValueError as e:  # only a backend the op lacks, named with the ones it has
        assert backend == "torch" and op == "paged_prefill_attention"
        assert "has no torch path" in str(e) and "reference" in str(e)
        return
    if backend == "auto":
        want = "triton" if device.type == "cuda" and has_triton else "torch"
        assert concrete == (want if want != "torch" or op != "paged_prefill_attention" else "reference")
    else:
        assert concrete == backend
    if concrete == "triton":
        pytest.importorskip("triton")
    assert callable(getattr(importlib.import_module(module), op))


def test_auto_on_cuda_takes_triton_for_the_prefill_kernel_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "triton_available", lambda: True)
    cuda = torch.device("cuda", 0)
    assert kernels.resolve_backend("paged_prefill_attention", "auto", cuda) == (
        "triton",
        "kernels.triton_prefill",
    )
    assert kernels.resolve_backend("paged_decode_attention", "auto", cuda) == (
        "triton",
        "kernels.triton_kernels",
    )


def test_entry_points_take_backend_and_dispatch_through_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each public op calls the function its resolved module holds, with its own arguments."""
    calls: list[tuple[str, str]] = []

    def resolved(op: str, backend: kernels.Backend, device: torch.device) -> tuple[kernels.Backend, str]:
        calls.append((op, backend))
        return "reference", "kernels.reference"

    monkeypatch.setattr(kernels, "resolve_backend", resolved)
    reference = importlib.import_module("kernels.reference")
    for op in OPS:
        monkeypatch.setattr(reference, op, lambda *args, _op=op: (_op, len(args)))
        params = inspect.signature(getattr(kernels, op)).parameters
        assert params["backend"].default == "auto"
        args = [torch.zeros(1)] * (len(params) - 1)
        assert getattr(kernels, op)(*args, backend="triton") == (op, len(params) - 1)
    assert calls == [(op, "triton") for op in OPS]


def test_unknown_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown attention backend 'cudnn'"):
        kernels.resolve_backend("paged_decode_attention", "cudnn", torch.device("cpu"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown attention op"):
        kernels.resolve_backend("flash", "auto", torch.device("cpu"))

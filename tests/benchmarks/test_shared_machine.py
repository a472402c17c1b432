"""shared_machine: the co-tenant's processes and the ratios the figures are made of."""

from __future__ import annotations

import time

import pytest

from benchmarks import shared_machine as sm


def test_the_co_tenant_runs_for_the_block_only() -> None:
    with sm.co_tenant(2) as loops:
        assert len(loops) == 2 and all(loop.poll() is None for loop in loops)
        time.sleep(0.2)
        assert all(loop.poll() is None for loop in loops)  # still running: a loop, not a process that ends
    assert all(loop.returncode is not None for loop in loops)  # killed and reaped


def test_fair_share_is_the_busy_rate_over_the_idle_rate_on_the_cores_left() -> None:
    cfg = sm.Config(batches=(1,), co_tenant_cores=1)
    rates = {"ours": {"idle": {1: 20.0}, "busy": {1: 9.0}}, "vllm": {"idle": {1: 10.0}, "busy": {1: 6.0}}}
    got = sm.metrics(cfg, rates, cores=2)
    assert got["fair_share_b1"] == pytest.approx(9.0 / (20.0 * 0.5))
    assert got["busy_vs_vllm_b1"] == pytest.approx(1.5) and got["idle_vs_vllm_b1"] == pytest.approx(2.0)
    assert "busy_vs_vllm_b1" not in sm.metrics(cfg, {"ours": rates["ours"]}, cores=2)

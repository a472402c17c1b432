"""The physical model behind `server.sim.disagg`: a GPU's step times, the KV cache's size, the exchange of
attention parallelism and the links between instances.

Step times come from a `LatencyModel` profile (``a100-llama13b``: Llama-2-13B fp16 on one A100-80GB, derived
from the datasheet roofline; its ``source`` says how). The rest follows from the model's shape:

* KV per token: layers x 2 (K and V) x hidden x 2 bytes = 800 KiB for 13B;
* attention parallelism: per decode step, per layer and per request, the decode instance sends the last
  token's query (heads x head_dim x 2 bytes) and gets back a partial output of the same size plus one fp32
  log-sum-exp per head; one message each way per layer, so ``layers x 2`` message latencies per step;
* links: PCIe 4.0 x16 (31.5 GB/s raw per direction, ~25 GB/s effective for large copies, ~10 us per
  message: the paper's setting), or NVLink between GPUs (A100 NVLink 3: 300 GB/s per direction, ~250
  GB/s effective, ~5 us) with host traffic still on PCIe. Each instance's port is full duplex.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.cluster.mutel import CostModel
from server.sim.latency import LatencyModel, load_profile

__all__ = ["LINKS", "LLAMA_13B", "NVLINK", "PCIE4_X16", "ClusterCost", "Link", "ModelShape", "a100_llama13b"]


@dataclass(frozen=True)
class Link:
    """A GPU's connection to its peers (``peer_*``) and to host memory (``host_*``): bytes per second each
    way, seconds per message. ``shared``: peer and host traffic use the same wires (one PCIe port)."""

    name: str
    peer_bytes_per_s: float
    peer_latency_s: float
    host_bytes_per_s: float = 25e9
    host_latency_s: float = 10e-6
    shared: bool = True


PCIE4_X16 = Link("pcie4", 25e9, 10e-6)
NVLINK = Link("nvlink", 250e9, 5e-6, shared=False)
LINKS = {link.name: link for link in (PCIE4_X16, NVLINK)}


@dataclass(frozen=True)
class ModelShape:
    """The transformer shape that sets KV and exchange sizes."""

    layers: int
    hidden: int
    heads: int
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.hidden * self.dtype_bytes

    @property
    def exchange_bytes_per_layer(self) -> int:
        """One request's query out plus partial output and fp32 log-sum-exp back, for one layer."""
        return 2 * self.hidden * self.dtype_bytes + 4 * self.heads


LLAMA_13B = ModelShape(layers=40, hidden=5120, heads=40)


@dataclass(frozen=True)
class ClusterCost:
    """Everything the simulator charges time for, on one kind of instance and link."""

    latency: LatencyModel
    shape: ModelShape
    link: Link

    @property
    def kv_bytes_per_token(self) -> int:
        return self.shape.kv_bytes_per_token

    def transfer_s(self, tokens: int, host: bool) -> float:
        """One bulk KV copy of ``tokens`` tokens to or from a peer GPU or host memory."""
        bw, lat = (
            (self.link.host_bytes_per_s, self.link.host_latency_s)
            if host
            else (self.link.peer_bytes_per_s, self.link.peer_latency_s)
        )
        return lat + tokens * self.kv_bytes_per_token / bw

    def exchange_s(self, requests: int) -> float:
        """The link time of one decode step's attention-parallel exchange for ``requests`` requests: per
        layer, a message each way (latency) and the bytes through the decode instance's port."""
        per_layer = 2 * self.link.peer_latency_s + requests * self.shape.exchange_bytes_per_layer / (
            self.link.peer_bytes_per_s
        )
        return self.shape.layers * per_layer

    def exchange_bytes(self, requests: int) -> int:
        return self.shape.layers * requests * self.shape.exchange_bytes_per_layer

    def decode_s(self, seqs: int, kv_tokens: int) -> float:
        """A decode step of ``seqs`` sequences reading ``kv_tokens`` of KV (base included)."""
        m = self.latency
        return m.base + m.decode_seq * seqs + m.kv_token * kv_tokens

    def costs(self, host: bool = False) -> CostModel:
        """The coefficients `server.cluster.mutel`'s decisions take (the link to a peer, or to host
        memory)."""
        m = self.latency
        bw, lat = (
            (self.link.host_bytes_per_s, self.link.host_latency_s)
            if host
            else (self.link.peer_bytes_per_s, self.link.peer_latency_s)
        )
        return CostModel(
            m.base,
            m.prefill_token,
            m.prefill_pair,
            m.decode_seq,
            m.kv_token,
            self.kv_bytes_per_token,
            bw,
            lat,
        )


def a100_llama13b(link: Link = PCIE4_X16) -> ClusterCost:
    """The paper's setting: Llama-13B fp16, one A100-80GB per instance (profile ``a100-llama13b``)."""
    return ClusterCost(load_profile("a100-llama13b"), LLAMA_13B, link)

"""Simulated engines on a virtual clock, driving the real serving code at cluster scale.

* `server.sim.clock` — `VirtualTimeLoop` / `run`: asyncio on virtual time;
* `server.sim.latency` — `LatencyModel` (per-step time from step features), fitted to the real engine's
  step trace or loaded from a profile shipped as data;
* `server.sim.engine` — `SimEngine`: the real engine's bookkeeping and scheduler with the model replaced by
  the latency model;
* `server.sim.cluster` — `sim_cluster`: the real manager and HTTP app over N simulated engines, with an
  in-process client.
"""

from server.sim.clock import SimulationStalledError, VirtualTimeLoop, run
from server.sim.cluster import SIM_URL, SimCluster, sim_cluster, tiny_tokenizer
from server.sim.engine import SimEngine, SimRunner
from server.sim.latency import LatencyModel, fit_latency_model, load_profile, profile_names

__all__ = [
    "SIM_URL",
    "LatencyModel",
    "SimCluster",
    "SimEngine",
    "SimRunner",
    "SimulationStalledError",
    "VirtualTimeLoop",
    "fit_latency_model",
    "load_profile",
    "profile_names",
    "run",
    "sim_cluster",
    "tiny_tokenizer",
]

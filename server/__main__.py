"""`python -m server`: the manager with N in-process engines, serving the Parrot API over HTTP.

python -m server --engines 1 --port 9000      # SmolLM2-135M-Instruct, the default model
python -m server --engines 0 --port 9000      # only remote engines: python -m server.engine --manager URL
"""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn
from starlette.types import ASGIApp

from server.app import create_app
from server.engine import EngineConfig
from server.engine.model_names import DEFAULT_MODEL, MODEL_HELP
from server.launcher import build_engines
from server.netdelay import NetworkDelayMiddleware
from server.serve.manager import Manager, ManagerConfig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m server", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    p.add_argument("--engines", type=int, default=1, help="in-process engines (remote ones may also join)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--session-ttl", type=float, default=600.0)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "float16", "bfloat16"],
        help="weights and activations (default: per device, see EngineConfig.dtype)",
    )
    p.add_argument(
        "--max-running-tokens",
        type=int,
        default=None,
        help="each engine's FIFO token cap on its running batch (the latency-capped baseline; default: none)",
    )
    p.add_argument(
        "--network-delay",
        type=float,
        nargs=2,
        metavar=("LOW", "HIGH"),
        default=None,
        help="simulate client network delay: each request waits U(LOW, HIGH) seconds (benchmarks)",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = EngineConfig(
        num_kv_blocks=args.num_kv_blocks, max_running_tokens=args.max_running_tokens, dtype=args.dtype
    )
    engines = build_engines(args.model, args.engines, config)
    try:
        app: ASGIApp = create_app(Manager(engines, ManagerConfig(session_ttl=args.session_ttl)))
        if args.network_delay is not None:
            app = NetworkDelayMiddleware(app, *args.network_delay)
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        for engine in engines:
            engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

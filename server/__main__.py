"""`python -m server`: the manager with N in-process engines, serving the Parrot API over HTTP.

python -m server --engines 1 --port 9000      # SmolLM2-135M-Instruct, the default model
python -m server --engines 0 --port 9000      # only remote engines: python -m server.engine --manager URL
python -m server --api-key KEY                # the OpenAI routes then need "Authorization: Bearer KEY"
python -m server --engines 0 --openai-backend http://127.0.0.1:8000   # a vLLM (or SGLang) server as engine
python -m server --engines 4 --ray auto --host 0.0.0.0   # engines placed on a Ray cluster (parrot-serve[ray])

Remote engines join with the cluster token: --cluster-token-file, else $PARROT_CLUSTER_TOKEN, else a token
generated into $PARROT_CACHE_DIR/cluster_token (or ~/.cache/parrot-serve/cluster_token), readable only by you.
"""

from __future__ import annotations

from server.common.server_env import restart_with_server_env

if __name__ == "__main__":  # first thing: the imports below would otherwise be paid twice
    restart_with_server_env()

import argparse
import functools
import logging
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

# The command line is parsed with light modules only (no torch, no web framework): a mistake in it is
# answered at once; the server's own modules load after (`_serve`).
from server.cli import (
    DefaultsHelpFormatter,
    add_listen_args,
    bind_listener,
    connection_limits,
    exit_if_extra_missing,
    exit_with_error,
    program_name,
    ready_lines,
    serve,
)
from server.common.config_flags import add_config_flags, config_values
from server.common.settings import BACKEND_API_KEY, epilog
from server.engine.config import SERVER_ENGINE_FLAGS, EngineConfig
from server.engine.model_names import DEFAULT_MODEL, MODEL_HELP

if TYPE_CHECKING:
    from server.cluster.ray_engines import RayEngines


def main(argv: list[str] | None = None) -> int:
    """``python -m server`` / ``parrot-serve``: parse ``argv`` (default: the command line) and serve until a
    signal. A wrong model or a port in use is one line on stderr and exit status 2, before any model loads."""
    if argv is None:  # the process's own command line (`parrot-serve`): the server environment, as with -m
        restart_with_server_env()
    prog = program_name("server", "parrot-serve")
    p = _parser(prog)
    args = p.parse_args(argv)
    if args.ray_vllm is not None and args.ray is None:
        p.error("--ray-vllm places vLLM servers with Ray: give --ray [ADDRESS] too")
    return _serve(args, p, prog)


def _parser(prog: str) -> argparse.ArgumentParser:
    """The server's command line."""
    p = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n")[0],
        formatter_class=DefaultsHelpFormatter,
        epilog=epilog(),
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    p.add_argument("--engines", type=int, default=1, help="in-process engines (remote ones may also join)")
    p.add_argument(
        "--slo",
        nargs=2,
        type=float,
        metavar=("TTFT_S", "TPOT_S"),
        default=None,
        help="refuse OpenAI requests at once (503 slo_rejected) whose engine would miss these P90 objectives "
        "(Mutel's early rejection; default: admit everything)",
    )
    p.add_argument(
        "--disaggregate",
        action="store_true",
        help="in-process engines serve in prefill + decode pairs (Mutel's attention parallelism; --engines "
        "even)",
    )
    backends = p.add_argument_group("OpenAI-compatible servers as engines")
    backends.add_argument(
        "--openai-backend",
        action="append",
        default=[],
        metavar="URL",
        help="an OpenAI-compatible completions server (vLLM, SGLang, another Parrot) serving as an engine; "
        f"repeat for several (API key: ${BACKEND_API_KEY.name})",
    )
    backends.add_argument(
        "--openai-backend-tokenizer",
        default=None,
        metavar="NAME_OR_PATH",
        help="the backends' tokenizer, as a model name or path (default: the served model's id)",
    )
    backends.add_argument(
        "--openai-backend-capacity",
        type=int,
        default=16384,
        metavar="TOKENS",
        help="tokens each backend runs at once (its KV cache): the scheduler's capacity",
    )
    backends.add_argument(
        "--openai-backend-latency-cap",
        type=int,
        default=None,
        metavar="TOKENS",
        help="at most this many tokens on a backend running latency-critical work (default: the manager's)",
    )
    backends.add_argument(
        "--openai-backend-priority",
        action="store_true",
        help="send priorities (the backends schedule by priority: vLLM --scheduling-policy priority)",
    )
    p.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="place the --engines engines on a Ray cluster as actors (ADDRESS: the cluster's, e.g. 'auto'; "
        "none: a local Ray or $RAY_ADDRESS); needs parrot-serve[ray]",
    )
    p.add_argument(
        "--ray-vllm",
        default=None,
        metavar="PYTHON",
        help="with --ray: each actor serves vLLM (its OpenAI server, started with this interpreter of a "
        "virtualenv that has vLLM) instead of our engine; --model must be a model vLLM loads",
    )
    p.add_argument(
        "--ray-vllm-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an argument for each vLLM server (repeat: --ray-vllm-arg=--dtype --ray-vllm-arg=bfloat16)",
    )
    add_listen_args(p, port=9000)
    p.add_argument("--session-ttl", type=float, default=600.0, help="seconds an idle session is kept")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM: new sessions and calls get 503; running steps get this long to finish",
    )
    add_config_flags(p, EngineConfig, SERVER_ENGINE_FLAGS)
    p.add_argument(
        "--length-predictor",
        metavar="PATH",
        default=None,
        help="file the output-length predictor (SSJF priorities) is loaded from and saved to at shutdown "
        "(default: it learns afresh each start)",
    )
    p.add_argument(
        "--no-length-prediction",
        action="store_true",
        help="send engines no predicted-length priorities (their SJF queue then falls back to arrival order)",
    )
    p.add_argument(
        "--network-delay",
        type=float,
        nargs=2,
        metavar=("LOW", "HIGH"),
        default=None,
        help="simulate client network delay: each request waits U(LOW, HIGH) seconds (benchmarks)",
    )
    security = p.add_argument_group("security")
    security.add_argument(
        "--cluster-token-file",
        default=None,
        metavar="PATH",
        help="file with the cluster token remote engines join with (created with a new token if missing; "
        "default: $PARROT_CLUSTER_TOKEN, else $PARROT_CACHE_DIR or ~/.cache/parrot-serve/cluster_token)",
    )
    security.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="an API key the OpenAI routes and the opening of sessions require; a key is a tenant "
        "(repeat for several; default: $PARROT_API_KEY, else none)",
    )
    security.add_argument("--max-engines", type=int, default=64, help="remote engines in service at once")
    return p


def _serve(args: argparse.Namespace, p: argparse.ArgumentParser, prog: str) -> int:
    """Serve what the parsed command line ``args`` asks for until a signal."""
    try:  # without the server extra (a client-only install) this is one line naming the pip command to run
        from starlette.types import ASGIApp

        from server.cluster.mutel import Slo
        from server.cluster.ray_engines import RayEngines
        from server.common.netdelay import NetworkDelayMiddleware
        from server.common.security import SecurityConfig, api_keys_from, load_cluster_token
        from server.http.app import create_app
        from server.serve.length_predictor import LengthPredictorStateError
        from server.serve.manager import Manager, ManagerConfig
    except ModuleNotFoundError as missing:
        exit_if_extra_missing(missing, prog)
        raise

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request to an OpenAI backend
    try:
        token = load_cluster_token(args.cluster_token_file)
        settings = SecurityConfig(
            token.value, api_keys_from(args.api_key), max_remote_engines=args.max_engines
        )
    except (OSError, ValueError) as e:
        p.error(str(e))
    log = logging.getLogger("server")
    log.info("cluster token from %s (remote engines need it)", token.source)
    if settings.api_keys:
        log.info("the OpenAI routes require an API key (%d configured)", len(settings.api_keys))
    config = EngineConfig(**config_values(EngineConfig, args, SERVER_ENGINE_FLAGS))
    limits = connection_limits(prog, args)
    listener = bind_listener(prog, args.host, args.port)  # before any model loads: a port in use fails now
    try:
        engines = _engines(args, p, prog, config)
    except BaseException:
        listener.close()
        raise
    ray_actors: list[Any] = []  # engines Ray placed, kept until the server stops
    try:
        slo = None if args.slo is None else Slo(*args.slo)
        manager_config = ManagerConfig(
            session_ttl=args.session_ttl,
            length_prediction=not args.no_length_prediction,
            length_predictor_path=args.length_predictor,
            slo=slo,
        )
        try:
            manager = Manager(engines, manager_config)
        except LengthPredictorStateError as e:
            p.error(str(e))
        app: ASGIApp = create_app(manager, security=settings)
        if args.ray is not None:
            spec = RayEngines(
                args.engines,
                address=args.ray or None,
                vllm_python=args.ray_vllm,
                vllm_args=tuple(args.ray_vllm_arg),
                tokenizer=args.openai_backend_tokenizer,
            )
            port = listener.getsockname()[1]  # the port bound (--port 0 picks one)
            placer = threading.Thread(
                target=_place_on_ray,
                args=(spec, args.model, config, args.host, port, settings.cluster_token, ray_actors),
                name="ray-placer",
                daemon=True,
            )
            placer.start()
        if args.network_delay is not None:
            app = NetworkDelayMiddleware(app, *args.network_delay)
        drain = functools.partial(manager.drain, args.drain_timeout)
        ready = functools.partial(
            ready_lines,
            models=manager.openai.models(),
            api_keys=bool(settings.api_keys),
            token_source=str(token.source),
        )
        serve(app, listener, args.drain_timeout, drain, log, limits, ready)
    finally:
        listener.close()
        for engine in engines:
            engine.shutdown()
        if ray_actors:
            from server.cluster.ray_engines import stop_ray_engines

            stop_ray_engines(ray_actors)
    return 0


def _engines(
    args: argparse.Namespace, p: argparse.ArgumentParser, prog: str, config: EngineConfig
) -> list[Any]:
    """The OpenAI backends (connected and checked) and the in-process engines (their model loaded). A backend
    that cannot serve is argparse's error; a model that is not there or cannot run, one line; both exit 2."""
    from server.cluster.openai_backend import OpenAIBackendConfig
    from server.engine import EngineError
    from server.launcher import build_engines, connect_openai_backends

    try:
        backend_configs = [
            OpenAIBackendConfig(
                url,
                tokenizer=args.openai_backend_tokenizer,
                capacity_tokens=args.openai_backend_capacity,
                latency_cap_tokens=args.openai_backend_latency_cap,
                priority=args.openai_backend_priority,
            )
            for url in args.openai_backend
        ]
        backends = connect_openai_backends(backend_configs)
    except (ValueError, EngineError) as e:
        p.error(str(e))
    in_process = 0 if args.ray is not None else args.engines
    try:
        # `from_pretrained` raises FileNotFoundError for a model that is not there (a name, file, folder or
        # package) and ValueError for one it cannot run; both are the user's to fix, not a traceback.
        return build_engines(args.model, in_process, config, args.disaggregate) + backends
    except (FileNotFoundError, ValueError) as e:
        for backend in backends:
            backend.shutdown()
        exit_with_error(prog, str(e))


def _place_on_ray(
    spec: RayEngines, model: str, config: EngineConfig, host: str, port: int, token: str, placed: list[Any]
) -> None:
    """Once the manager answers, have Ray start the engines, which then register with it; their handles go
    to ``placed`` (an actor whose handles are all gone is ended)."""
    from server.cluster.ray_engines import manager_url_for, start_ray_engines

    local = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    while True:
        try:
            socket.create_connection((local, port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    try:
        placed.extend(start_ray_engines(spec, model, config, manager_url_for(host, port), token))
    except Exception:
        logging.getLogger("server").exception("Ray could not place the engines")


if __name__ == "__main__":
    sys.exit(main())

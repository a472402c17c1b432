"""`python -m server.engine`: serve one engine over HTTP, or answer one prompt and exit.

python -m server.engine --port 9100                                   # SmolLM2-135M-Instruct, the default
python -m server.engine --port 9100 --manager http://127.0.0.1:9000   # join a manager
python -m server.engine --model tiny --prompt "Once upon a time" --max-tokens 32

The HTTP API (all but /health) and the manager accept only the cluster token: --cluster-token-file, else
$PARROT_CLUSTER_TOKEN, else the default file the manager writes ($PARROT_CACHE_DIR or ~/.cache/parrot-serve).
"""

from __future__ import annotations

from server.common.server_env import restart_with_server_env

if __name__ == "__main__":  # first thing: the imports below would otherwise be paid twice
    restart_with_server_env()

import argparse
import asyncio
import contextlib
import functools
import logging
import sys
from typing import TYPE_CHECKING

# The command line is parsed with light modules only (no torch, no web framework): a mistake in it is
# answered at once; the engine's own modules load after.
from server.cli import (
    DefaultsHelpFormatter,
    add_listen_args,
    bind_listener,
    connection_limits,
    exit_if_extra_missing,
    exit_with_error,
    program_name,
    serve,
)
from server.common.config_flags import add_config_flags, config_values
from server.common.settings import epilog
from server.engine.config import ENGINE_FLAGS, EngineConfig
from server.engine.model_names import DEFAULT_MODEL, MODEL_HELP

if TYPE_CHECKING:
    from server.engine.engine import LLMEngine


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The engine's command line (``argv``, default: ``sys.argv[1:]``)."""
    p = argparse.ArgumentParser(
        prog=_prog(),
        description=__doc__.split("\n")[0],
        formatter_class=DefaultsHelpFormatter,
        epilog=epilog(),
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    add_listen_args(p, port=9100)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    add_config_flags(p, EngineConfig, ENGINE_FLAGS)
    join = p.add_argument_group("joining a manager")
    join.add_argument("--manager", default=None, help="register with the manager at this URL and heartbeat")
    join.add_argument("--name", default=None, help="the engine's name at the manager (default: host:port)")
    join.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM: seconds running requests get to finish after the manager is told",
    )
    join.add_argument(
        "--cluster-token-file",
        default=None,
        metavar="PATH",
        help="file with the manager's cluster token (default: $PARROT_CLUSTER_TOKEN, else the manager's "
        "default file; a missing file is created with a new token)",
    )
    join.add_argument(
        "--public-url",
        default=None,
        help="the URL the manager reaches this engine at (default: http://host:port)",
    )
    one = p.add_argument_group("one-shot mode")
    one.add_argument("--prompt", default=None, help="generate a completion of this text, print it, exit")
    one.add_argument("--chat", action="store_true", help="wrap --prompt in the model's chat template")
    one.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    one.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    one.add_argument("--seed", type=int, default=None, help="sampling seed (default: none, not reproducible)")
    return p.parse_args(argv)


def _prog() -> str:
    return program_name("server.engine", "parrot-engine")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    extra = {} if args.device is None else {"device": args.device}
    return EngineConfig(**config_values(EngineConfig, args, ENGINE_FLAGS), **extra)


async def one_shot(engine: LLMEngine, args: argparse.Namespace) -> str:
    """The completion (or, with ``--chat``, the answer) of ``--prompt``."""
    from server.engine.sampling import SamplingParams

    tok = engine.tokenizer
    if args.chat:
        ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    else:
        ids = tok.encode(args.prompt)
    await engine.fill(0, ids)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    result = await engine.generate(0, sampling)
    await engine.free_context(0)
    return result.text


def main(argv: list[str] | None = None) -> int:
    """``python -m server.engine`` / ``parrot-engine``: serve one engine over HTTP until a signal, or answer
    ``--prompt`` and exit. A wrong model or a port in use is one line on stderr and exit status 2, before
    the model loads."""
    if argv is None:  # the process's own command line (`parrot-engine`): the server environment, as with -m
        restart_with_server_env()
    args = parse_args(argv)
    prog = _prog()
    try:  # without the server extra (a client-only install) this is one line naming the pip command to run
        from server.common.security import load_cluster_token
        from server.engine.engine import LLMEngine
        from server.engine.manager_link import ManagerLink
    except ModuleNotFoundError as missing:
        exit_if_extra_missing(missing, prog)
        raise
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per heartbeat
    log = logging.getLogger(__name__)
    with contextlib.ExitStack() as cleanup:
        token, listener = None, None
        if args.prompt is None:  # before loading the model: a bad token file or a port in use fails at once
            try:
                token = load_cluster_token(args.cluster_token_file)
            except (OSError, ValueError) as e:
                raise SystemExit(f"{prog}: {e}") from None
            log.info("cluster token from %s", token.source)
            limits = connection_limits(prog, args)
            listener = cleanup.enter_context(bind_listener(prog, args.host, args.port))
        try:
            engine = LLMEngine.from_pretrained(args.model, engine_config(args))
        except (FileNotFoundError, ValueError) as e:  # not there, or not a model this engine runs
            exit_with_error(prog, str(e))
        cleanup.callback(engine.shutdown)
        if args.prompt is not None:
            text = asyncio.run(one_shot(engine, args))
            print(args.prompt + text if not args.chat else text)
            return 0

        from server.engine.api import create_engine_app

        assert token is not None and listener is not None
        link = None
        if args.manager is not None:
            port = listener.getsockname()[1]  # the port actually bound (--port 0 picks one)
            url = args.public_url or f"http://{args.host}:{port}"
            name = args.name or f"{args.host}:{port}"
            link = ManagerLink(args.manager, url, name, engine.stats, cluster_token=token.value)
        app = create_engine_app(engine, link, cluster_token=token.value)
        drain = None if link is None else functools.partial(link.drain, args.drain_timeout)
        serve(app, listener, args.drain_timeout, drain, log, limits)
        return 0


if __name__ == "__main__":
    sys.exit(main())

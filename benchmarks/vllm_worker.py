"""vLLM's side of ``benchmarks/engine_throughput.py``: a long-lived process that times ``LLM.generate``.

The benchmark runs it with the interpreter of a separate virtualenv that has vLLM (its CPU build here), so
this file imports only the standard library and, inside `main`, ``vllm``: none of this repository's
modules, which that environment cannot import. It loads the model once, then answers timing requests,
one JSON object per line on stdin / stdout:

* on start-up it writes ``{"ready": true, "protocol": 1, "vllm": VERSION, "dtype": ..., ...}`` once the
  engine is loaded (or ``{"ready": false, "error": ...}`` and exits 1);
* ``{"op": "generate", "prompts": [[ids...], ...], "max_tokens": N}`` -> ``{"ok": true, "seconds": S,
  "token_ids": [[ids...], ...]}``: every prompt generated at once by one ``LLM.generate`` call, greedy,
  exactly ``N`` tokens each (``min_tokens = max_tokens = N``, ``ignore_eos``), token ids in and out;
  ``S`` is that call's wall time, measured here so the pipe's cost is not in it;
* ``{"op": "quit"}`` -> ``{"ok": true}``, then the process exits;
* anything else -> ``{"ok": false, "error": ...}``, and the worker keeps serving.

Everything vLLM (and the libraries under it) prints goes to stderr: file descriptor 1 is pointed at
stderr before vLLM is imported, and the protocol is written to a private duplicate of the original
stdout, so no log line can corrupt it.

    python benchmarks/vllm_worker.py --model FOLDER [--dtype bfloat16] [--max-model-len L]
        [--max-num-seqs B] [--engine-args JSON]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

PROTOCOL = 1

# The script's own folder (benchmarks/) would be first on sys.path, where `kernels.py`, `plotting.py` and
# friends would shadow unrelated packages that vLLM or transformers may import by those names. The
# worker needs nothing from it; vLLM's spawned engine processes inherit the cleaned path.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

# (seconds, token ids per prompt) for a batch of prompts and a number of new tokens.
Generate = Callable[[Sequence[list[int]], int], tuple[float, list[list[int]]]]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The worker's command line (what `benchmarks.harness.vllm_generate.VLLMWorker` passes)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="a local Hugging Face model folder")
    parser.add_argument("--dtype", default="bfloat16", help="vLLM's dtype (bfloat16, float32, ...)")
    parser.add_argument("--max-model-len", type=int, help="longest prompt + output (default: the model's)")
    parser.add_argument("--max-num-seqs", type=int, help="most requests in one batch (vLLM's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--engine-args",
        type=json.loads,
        default={},
        help="more keyword arguments of vllm.LLM as a JSON object, e.g. '{\"enforce_eager\": true}'",
    )
    args = parser.parse_args(argv)
    if not isinstance(args.engine_args, dict):
        parser.error("--engine-args must be a JSON object")
    return args


def llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM``: vLLM's defaults except what the comparison needs fixed."""
    kwargs: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "seed": args.seed,
        # The benchmark times T(1) and then T(N) on the same prompts: with vLLM's automatic prefix cache
        # (on by default) the second run would skip its prefill. Our engine computes every prompt token of
        # every run (contexts are freed in between), and so does HF.
        "enable_prefix_caching": False,
    }
    if args.max_model_len:
        kwargs["max_model_len"] = args.max_model_len
    if args.max_num_seqs:
        kwargs["max_num_seqs"] = args.max_num_seqs
    kwargs.update(args.engine_args)
    return kwargs


def handle(request: Any, generate: Generate) -> tuple[dict[str, Any], bool]:
    """The reply to one request, and whether the worker should stop after sending it."""
    if not isinstance(request, dict):
        return {"ok": False, "error": "a request must be a JSON object"}, False
    op = request.get("op")
    if op == "quit":
        return {"ok": True}, True
    if op != "generate":
        return {"ok": False, "error": f"unknown op {op!r}"}, False
    prompts, max_tokens = request.get("prompts"), request.get("max_tokens")
    if (
        not isinstance(prompts, list)
        or not prompts
        or not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts)
    ):
        return {"ok": False, "error": "prompts must be a non-empty list of non-empty token id lists"}, False
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        return {"ok": False, "error": "max_tokens must be a positive integer"}, False
    seconds, token_ids = generate(prompts, max_tokens)
    return {"ok": True, "seconds": seconds, "token_ids": token_ids}, False


def serve(generate: Generate, hello: dict[str, Any], infile: IO[str], outfile: IO[str]) -> None:
    """Announce readiness with ``hello``, then answer request lines until ``quit`` or end of input."""
    send(outfile, {"ready": True, "protocol": PROTOCOL, **hello})
    for line in infile:
        if not line.strip():
            continue
        try:
            reply, stop = handle(json.loads(line), generate)
        except Exception as e:  # a bad line or a failed generate: report it, keep serving
            print(traceback.format_exc(), file=sys.stderr, flush=True)
            reply, stop = {"ok": False, "error": f"{type(e).__name__}: {e}"}, False
        send(outfile, reply)
        if stop:
            return


def send(outfile: IO[str], message: dict[str, Any]) -> None:
    """One protocol line, flushed at once (the benchmark is waiting for it)."""
    outfile.write(json.dumps(message) + "\n")
    outfile.flush()


def protocol_stdout() -> IO[str]:
    """A private handle on the original stdout for the protocol; fd 1 then points at stderr.

    Done at the file-descriptor level, so prints of vLLM, of C/C++ extensions and of the engine processes
    vLLM spawns (which inherit fd 1) all land on stderr.
    """
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return out


def make_generate(llm: Any) -> Generate:
    """``LLM.generate`` over token-id prompts, greedy, exactly ``n`` new tokens each, timed."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def generate(prompts: Sequence[list[int]], n: int) -> tuple[float, list[list[int]]]:
        params = SamplingParams(
            temperature=0.0,
            max_tokens=n,
            min_tokens=n,
            ignore_eos=True,
            # Token ids in, token ids out, as our engine and HF are driven; text is not needed.
            detokenize=False,
        )
        inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return seconds, [list(o.outputs[0].token_ids) for o in outputs]

    return generate


def describe(llm: Any, kwargs: dict[str, Any], load_s: float) -> dict[str, Any]:
    """What the benchmark reports about the vLLM side: version, dtype, effective scheduler limits."""
    import vllm

    info: dict[str, Any] = {
        "vllm": vllm.__version__,
        "load_s": load_s,
        "llm_kwargs": kwargs,
        "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "OMP_", "KMP_"))},
    }
    try:  # internal attributes: report them where this vLLM version has them
        config = llm.llm_engine.vllm_config
        info["dtype"] = str(config.model_config.dtype).removeprefix("torch.")
        info["max_num_batched_tokens"] = config.scheduler_config.max_num_batched_tokens
        info["max_num_seqs"] = config.scheduler_config.max_num_seqs
        info["enforce_eager"] = config.model_config.enforce_eager
    except AttributeError:
        info["dtype"] = kwargs.get("dtype")
    return info


def main(argv: Sequence[str] | None = None) -> None:
    out = protocol_stdout()
    args = parse_args(argv)
    kwargs = llm_kwargs(args)
    try:
        from vllm import LLM

        start = time.perf_counter()
        llm = LLM(**kwargs)
        hello = describe(llm, kwargs, time.perf_counter() - start)
    except Exception as e:
        print(traceback.format_exc(), file=sys.stderr, flush=True)
        send(out, {"ready": False, "error": f"{type(e).__name__}: {e}"})
        sys.exit(1)
    serve(make_generate(llm), hello, sys.stdin, out)
    out.close()


# vLLM starts its engine processes with multiprocessing's spawn, which re-imports this file: only the
# guarded call may start anything.
if __name__ == "__main__":
    main()

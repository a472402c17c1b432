"""A served model scored by lm-evaluation-harness: our ``/v1`` against transformers and vLLM, same weights.

lm-eval's ``local-completions`` model — the standard way to evaluate a served model — sends each choice of a
multiple-choice question as ``echo=True, logprobs=1, max_tokens=1`` over token ids and reads the prompt's
log-probabilities back. One task of our own (``benchmarks/workloads/multiple_choice.jsonl``: 40 questions,
4 choices), three runs on the weights our engine loaded (exported as a Hugging Face folder, float32):
transformers in process (lm-eval's ``hf`` model), our server's ``/v1`` and, when ``$PARROT_VLLM_PYTHON``
names its interpreter, vLLM's CPU build's ``/v1``. Printed: each one's acc / acc_norm, and how far each
choice's loglikelihood is from transformers' (the largest absolute difference over all 160).

    PARROT_LMEVAL_PYTHON=.../bin/python python -m benchmarks.lm_eval_parity [--model smollm2] [--json PATH]

lm-eval runs from its own virtualenv (``$PARROT_LMEVAL_PYTHON``: ``pip install torch==2.13.0 lm-eval==0.4.9
"transformers<5" "datasets<4" tenacity aiohttp``), offline. The last line is
``RESULT lm_eval_parity acc_parrot=...``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from benchmarks.harness.hf_generate import hf_folder
from benchmarks.harness.machine import machine_info
from benchmarks.harness.openai_servers import Backend, parrot_backend, vllm_backend
from benchmarks.harness.output import log, result_line, write_json
from benchmarks.harness.vllm_settings import vllm_env
from server.engine import EngineConfig

NAME = "lm_eval_parity"
TASK = "parrot_multiple_choice"
DATA = Path(__file__).parent / "workloads" / "multiple_choice.jsonl"
MAX_MODEL_LEN = 2048


def task_yaml(data: Path) -> str:
    """lm-eval's task: the question, each choice scored as its continuation (acc and acc_norm)."""
    return "\n".join(
        [
            f"task: {TASK}",
            "dataset_path: json",
            "dataset_kwargs:",
            "  data_files:",
            f"    test: {data}",
            "test_split: test",
            "output_type: multiple_choice",
            'doc_to_text: "Question: {{question}}\\nAnswer:"',
            'doc_to_choice: "{{choices}}"',
            "doc_to_target: answer",
            "metric_list:",
            "  - metric: acc",
            "  - metric: acc_norm",
            "",
        ]
    )


def run_lm_eval(python: str, model: str, model_args: str, workdir: Path, label: str) -> dict[str, object]:
    """One lm-eval run: its acc, acc_norm and every (question, choice)'s loglikelihood in order."""
    out = workdir / label
    command = [python, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", TASK]
    command += ["--include_path", str(workdir / "tasks"), "--output_path", str(out), "--log_samples"]
    command += ["--batch_size", "1", "--device", "cpu"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    log(f"lm-eval ({label}) ...")
    with (workdir / f"{label}.log").open("w") as stream:
        done = subprocess.run(command, env=env, stdout=stream, stderr=subprocess.STDOUT, check=False)
    if done.returncode:
        tail = "\n".join((workdir / f"{label}.log").read_text().splitlines()[-25:])
        raise SystemExit(f"lm-eval ({label}) failed; the end of its log:\n{tail}")
    [results] = out.rglob("results_*.json")
    metrics = json.loads(results.read_text())["results"][TASK]
    [samples] = out.rglob(f"samples_{TASK}_*.jsonl")
    rows = sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda r: r["doc_id"])
    logliks = [float(resp[0]) for row in rows for resp in row["filtered_resps"]]
    return {"acc": metrics["acc,none"], "acc_norm": metrics["acc_norm,none"], "logliks": logliks}


def tokenizer_copy(folder: Path, workdir: Path) -> Path:
    """The folder's tokenizer files where lm-eval's transformers (< 5) reads them: a tokenizer saved by
    transformers 5 names its class ``TokenizersBackend``, which 4.x calls ``PreTrainedTokenizerFast``."""
    out = workdir / "tokenizer"
    out.mkdir()
    for path in folder.glob("*.json"):
        if path.name.startswith(("tokenizer", "special_tokens", "config", "generation")):
            shutil.copy(path, out / path.name)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config))
    return out


def completions_args(backend: Backend, model_name: str, tokenizer: Path) -> str:
    return (
        f"model={model_name},base_url={backend.url}/v1/completions,tokenizer={tokenizer},"
        "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1"
    )


@contextlib.contextmanager
def vllm_server(python: str, folder: Path, model_config: object, workdir: Path) -> Iterator[Backend]:
    env = vllm_env(model_config, "float32", MAX_MODEL_LEN, 4)
    log_path = workdir / "vllm.log"
    with vllm_backend(
        python,
        folder,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=4,
        env=env,
        log_path=log_path,
    ) as backend:
        yield backend


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="smollm2", help='"smollm2" (default), "tiny", a .gguf or a HF folder'
    )
    parser.add_argument("--lm-eval-python", default=os.environ.get("PARROT_LMEVAL_PYTHON"), metavar="PATH")
    parser.add_argument("--vllm-python", default=os.environ.get("PARROT_VLLM_PYTHON") or None, metavar="PATH")
    parser.add_argument("--json", metavar="PATH", help="write the figures here")
    args = parser.parse_args(argv)
    if not args.lm_eval_python:
        raise SystemExit("name lm-eval's interpreter: --lm-eval-python or $PARROT_LMEVAL_PYTHON")
    runs: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory(prefix="lm-eval-") as tmp:
        workdir = Path(tmp)
        (workdir / "tasks").mkdir()
        (workdir / "tasks" / f"{TASK}.yaml").write_text(task_yaml(DATA.resolve()))
        config = EngineConfig(dtype="float32")
        with parrot_backend(args.model, engines=1, engine_config=config) as ours:
            assert ours.server is not None
            engine = ours.server.engines[0]
            folder = hf_folder(args.model, engine, workdir, config.seed)  # type: ignore[arg-type]
            model_config, model_name = engine.model_config, engine.model_name  # type: ignore[attr-defined]
            tokenizer = tokenizer_copy(folder, workdir)
            runs["parrot"] = run_lm_eval(
                args.lm_eval_python,
                "local-completions",
                completions_args(ours, model_name, tokenizer),
                workdir,
                "parrot",
            )
        hf_args = f"pretrained={folder},tokenizer={tokenizer},dtype=float32"
        runs["hf"] = run_lm_eval(args.lm_eval_python, "hf", hf_args, workdir, "hf")
        if args.vllm_python:
            with vllm_server(args.vllm_python, folder, model_config, workdir) as theirs:
                vllm_args = completions_args(theirs, str(folder), tokenizer)
                runs["vllm"] = run_lm_eval(
                    args.lm_eval_python, "local-completions", vllm_args, workdir, "vllm"
                )
    reference = runs["hf"]["logliks"]
    metrics: dict[str, float | int] = {"questions": sum(1 for _ in DATA.open())}
    for label, run in runs.items():
        metrics[f"acc_{label}"] = float(run["acc"])  # type: ignore[arg-type]
        metrics[f"acc_norm_{label}"] = float(run["acc_norm"])  # type: ignore[arg-type]
        print(f"{label:>7}: acc {run['acc']:.3f}  acc_norm {run['acc_norm']:.3f}")
        if label != "hf":
            diffs = [abs(a - b) for a, b in zip(run["logliks"], reference, strict=True)]  # type: ignore[call-overload]
            metrics[f"max_abs_loglik_diff_{label}_hf"] = max(diffs)
            print(f"{'':>9}loglikelihoods vs transformers': max |diff| {max(diffs):.2e} over {len(diffs)}")
    if args.json:
        payload = {"benchmark": NAME, "model": args.model, "metrics": metrics, "machine": machine_info()}
        write_json(args.json, payload)
    print(result_line(NAME, metrics))


if __name__ == "__main__":
    main()

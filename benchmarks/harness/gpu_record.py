"""The GPU run's record (`benchmarks.gpu`): the machine, each step's status and figures gathered from the
step files, a short summary, the archive that carries partial results back, and the packages a bare CUDA
image lacks."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

# What the server, the engine tests and the benchmarks import that a torch + transformers CUDA image lacks
# (found on an H100 image: torch 2.11, triton 3.6, transformers 5.17, fastapi absent).
WHEELS = (
    "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions",
    "fastapi", "starlette", "opentelemetry-api", "uvicorn", "pytest-asyncio", "google-re2",
    "langchain-core", "langchain-protocol", "langsmith", "jsonpatch", "jsonpointer", "tenacity", "uuid-utils",
    "orjson", "requests-toolbelt", "zstandard", "httpx2", "httpcore2", "distro", "websockets", "sniffio",
)  # fmt: skip


def wheel_commands() -> str:
    """The ``pip download`` line (here, into ``.whl``) and the install line (there) for `WHEELS`, pinned to
    the versions installed here."""
    from importlib.metadata import PackageNotFoundError, version

    pins = []
    for name in WHEELS:
        try:
            pins.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            pins.append(name)
    platforms = " ".join(
        f"--platform {p}"
        for p in (
            "manylinux_2_28_x86_64",
            "manylinux_2_17_x86_64",
            "manylinux2014_x86_64",
            "manylinux_2_5_x86_64",
        )
    )
    return (
        "python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "
        f"{platforms} -d .whl {' '.join(pins)}\n"
        "python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && "
        "export PYTHONPATH=/tmp/site:$PWD:$PWD/integrations"
    )


def archive(folder: Path, path: Path) -> None:
    """``folder`` as a .tar.gz at ``path`` (written aside, then moved), without model folders."""
    import tarfile

    partial = path.with_suffix(".partial")
    with tarfile.open(partial, "w:gz") as tar:
        tar.add(folder, arcname=folder.name, filter=lambda m: None if m.name.endswith("-random") else m)
    partial.replace(path)


def env_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info |= {
            "gpu": props.name,
            "sm_count": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}",
        }
    try:  # paged varlen flash attention (a lead for prefill over the block cache without gathering)
        import inspect

        from torch.nn.attention import varlen

        info["varlen_attn"] = str(inspect.signature(varlen.varlen_attn))
    except (ImportError, AttributeError) as e:
        info["varlen_attn"] = f"unavailable: {e}"
    try:
        smi = ["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem", "--format=csv"]
        info["nvidia_smi"] = subprocess.run(smi, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        info["nvidia_smi"] = None
    return info


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def gather(out: Path, statuses: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``DIR/gpu.json``: the GPU, every step's status, the headline metrics and each step's payload."""
    env = _load(out / "env.json") or {}
    metrics: dict[str, float] = {}
    for short in ("bf16", "fp16"):
        payload = _load(out / f"kernels_{short}.json") or {}
        for row in payload.get("rows", []):
            key = f"b{row['batch']}_p{row['prefix']}"
            metrics[f"kernel_speedup_{key}" + ("" if short == "bf16" else "_fp16")] = row["speedup"]
            if short == "bf16":
                metrics[f"kernel_frac_of_ceiling_{key}"] = row["frac_of_ceiling"]
                if row.get("speedup_vs_private") is not None:  # null (`write_json`'s NaN): not measured
                    metrics[f"kernel_speedup_vs_private_{key}"] = row["speedup_vs_private"]
    metrics |= result_metrics(out / "engine.log")
    metrics |= {f"shared_prompt_{k}": v for k, v in result_metrics(out / "shared_prompt.log").items()}
    metrics |= {f"tuning_{k}": v for k, v in result_metrics(out / "kernel_tuning.log").items()}
    metrics |= {f"steps_{k}": v for k, v in result_metrics(out / "steps.log").items()}
    metrics |= {f"layer_diff_{k}": v for k, v in result_metrics(out / "layer_diff.log").items()}
    tests = _junit_counts(out / "tests.xml") or _log_counts(out / "tests.log")
    return {
        "benchmark": "gpu",
        "gpu": env.get("gpu"),
        "env": env,
        "steps": statuses,
        "tests": tests,
        "metrics": metrics,
        "payloads": {
            name: _load(out / f"{name}.json")
            for name in (
                "kernels_bf16",
                "kernels_fp16",
                "kernel_tuning",
                "engine",
                "steps",
                "layer_diff",
                "shared_prompt",
            )
        },
    }


def result_metrics(log_path: Path) -> dict[str, float]:
    """The figures of the ``RESULT`` line a step's log ends with (none: empty)."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    line = next((x for x in reversed(lines) if x.startswith("RESULT ")), "")
    out: dict[str, float] = {}
    for item in line.split()[2:]:
        key, _, value = item.partition("=")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def _log_counts(path: Path) -> dict[str, Any] | None:
    """Outcomes read from pytest's ``-v`` lines when it wrote no report (stopped at the time limit): what
    ran before it stopped."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    outcome = {word: [ln.split()[0] for ln in lines if f" {word}" in ln and "::" in ln] for word in
               ("PASSED", "FAILED", "ERROR", "SKIPPED")}  # fmt: skip
    if not any(outcome.values()):
        return None
    return {
        "tests": sum(map(len, outcome.values())),
        "failures": len(outcome["FAILED"]),
        "errors": len(outcome["ERROR"]),
        "skipped": len(outcome["SKIPPED"]),
        "failed": outcome["FAILED"] + outcome["ERROR"],
        "incomplete": True,  # no junit report: the run stopped before the end
    }


def _junit_counts(path: Path) -> dict[str, Any] | None:
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return None
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return counts | {"failed": failed}


def summary(record: dict[str, Any]) -> str:
    lines = [f"GPU: {record['gpu']}"]
    for name, s in record["steps"].items():
        lines.append(f"  {name:<14} {s['status']:<22} {s['seconds']:>6.0f} s")
    if record["tests"]:
        t = record["tests"]
        lines.append(
            f"tests: {t['tests']} run, {t['failures']} failed, {t['errors']} errors, {t['skipped']} skipped"
        )
        lines += [f"  FAILED {name}" for name in t["failed"][:10]]
    for key, value in sorted(record["metrics"].items()):
        if key.startswith(
            (
                "kernel_speedup_b32_p4096",
                "kernel_speedup_b64_p4096",
                "decode_ratio_vs_hf",
                "floor_ratio",
                "shared_prompt",
            )
        ):
            lines.append(f"  {key} = {value:.3g}")
    return "\n".join(lines)

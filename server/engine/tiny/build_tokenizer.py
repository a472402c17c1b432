"""Build the byte-level BPE tokenizer of the embedded ``"tiny"`` model, offline and deterministically.

Run ``python -m server.engine.tiny.build_tokenizer`` to (re)write ``tokenizer.json``,
``tokenizer_config.json`` and ``special_tokens_map.json`` next to this file. The training corpus is the
docstrings of a fixed list of Python standard library modules, so nothing is downloaded and two runs on the
same interpreter produce byte-identical files. (A different Python version has different docstrings and so
may learn different merges; the files are committed, so this only matters when rebuilding.)
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import pathlib
import warnings
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

OUTPUT_DIR = pathlib.Path(__file__).parent
VOCAB_SIZE = 4096  # special tokens and the 256 byte symbols included
MODEL_MAX_LENGTH = 4096

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
END_OF_TURN_TOKEN = "<|end|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
# Order fixes the ids: bos=0, eos=1, pad=2, then the chat-role markers and the end-of-turn marker.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, *ROLE_TOKENS, END_OF_TURN_TOKEN)

# Every message is "<|role|>\n{content}<|end|>\n"; the rendered conversation starts with bos, and a generation
# prompt opens an assistant turn. The template emits bos itself, so HF encodes its output without adding
# special tokens again.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Explicit and sorted, so the corpus does not depend on what happens to be installed or on import order.
# Modules with import-time side effects (this, antigravity, idlelib, tkinter, turtle) are deliberately absent.
CORPUS_MODULES = (
    "abc",
    "argparse",
    "array",
    "ast",
    "asyncio",
    "base64",
    "bisect",
    "calendar",
    "cmath",
    "codecs",
    "collections",
    "concurrent.futures",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "dis",
    "email",
    "enum",
    "fractions",
    "functools",
    "gettext",
    "glob",
    "gzip",
    "hashlib",
    "heapq",
    "hmac",
    "html",
    "http.client",
    "imaplib",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "locale",
    "logging",
    "lzma",
    "math",
    "mimetypes",
    "multiprocessing",
    "numbers",
    "operator",
    "os",
    "pathlib",
    "pickle",
    "pprint",
    "queue",
    "random",
    "re",
    "sched",
    "secrets",
    "selectors",
    "shlex",
    "shutil",
    "smtplib",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "time",
    "timeit",
    "tokenize",
    "traceback",
    "types",
    "typing",
    "unittest",
    "urllib.parse",
    "uuid",
    "warnings",
    "weakref",
    "xml.etree.ElementTree",
    "zipfile",
    "zlib",
)


def _clean(doc: object) -> str | None:
    """Return a dedented docstring, or None when ``doc`` is not a non-empty string."""
    if not isinstance(doc, str):
        return None
    text = inspect.cleandoc(doc).strip()
    return text or None


def _own_doc(obj: object) -> str | None:
    """The object's own docstring; ``inspect.getdoc`` would also pull inherited ones and repeat them."""
    try:
        return _clean(obj.__doc__)
    except Exception:  # some objects raise on attribute access; they just contribute nothing
        return None


def _module_docstrings(module: ModuleType) -> Iterator[str]:
    """Docstrings of a module, its public classes and functions, and their public methods, in name order.

    Only objects defined in the module itself count, so re-exported names (``os.path`` inside ``os``) are
    not visited twice.
    """
    doc = _own_doc(module)
    if doc:
        yield doc
    namespace: dict[str, Any] = vars(module)
    for name in sorted(namespace):
        if name.startswith("_"):
            continue
        obj = namespace[name]
        if not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        doc = _own_doc(obj)
        if doc:
            yield doc
        if inspect.isclass(obj):
            members: dict[str, Any] = dict(vars(obj))
            for member_name in sorted(members):
                if member_name.startswith("_"):
                    continue
                member = members[member_name]
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if inspect.isroutine(member) or isinstance(member, property):
                    doc = _own_doc(member)
                    if doc:
                        yield doc


def build_corpus(module_names: tuple[str, ...] = CORPUS_MODULES) -> list[str]:
    """Collect the docstrings of ``module_names`` (in sorted order), each distinct text kept once."""
    seen: set[str] = set()
    corpus: list[str] = []
    # Deprecated modules and attributes (typing.io, typing.re) warn when touched; that is not our concern.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module_name in sorted(module_names):
            try:
                module = importlib.import_module(module_name)
            except Exception:  # a build without e.g. sqlite3 or lzma: skip rather than fail
                continue
            for doc in _module_docstrings(module):
                if doc not in seen:  # the set only filters; list order carries the determinism
                    seen.add(doc)
                    corpus.append(doc)
    return corpus


def train_tokenizer(corpus: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train a byte-level BPE on ``corpus``; special tokens get the first ids, in ``SPECIAL_TOKENS`` order."""
    tokenizer = Tokenizer(models.BPE())
    # No normalizer: any normalization (NFC, lowercasing) would break exact byte-level round trips.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols, even ones the corpus never contains, so every input string is encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer, length=len(corpus))

    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(add_prefix_space=False, trim_offsets=True),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    return tokenizer


def tokenizer_config(tokenizer: Tokenizer) -> dict[str, Any]:
    """HF ``tokenizer_config.json`` for ``tokenizer``: fast tokenizer class, special tokens, chat template."""
    added_tokens_decoder = {
        str(tokenizer.token_to_id(token)): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token in SPECIAL_TOKENS
    }
    return {
        "added_tokens_decoder": added_tokens_decoder,
        "additional_special_tokens": [*ROLE_TOKENS, END_OF_TURN_TOKEN],
        "bos_token": BOS_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        # Spaces are bytes like any other here; "cleaning" them up would break exact round trips.
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": PAD_TOKEN,
        "padding_side": "left",  # decoder-only model: batched prompts are padded on the left
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def special_tokens_map() -> dict[str, Any]:
    """The HF ``special_tokens_map.json`` contents."""
    return {
        "additional_special_tokens": [*ROLE_TOKENS, END_OF_TURN_TOKEN],
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
    }


def _write_json(path: pathlib.Path, data: dict[str, Any]) -> None:
    """Write sorted, indented JSON with a trailing newline, so reruns and diffs are stable."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def build(output_dir: pathlib.Path = OUTPUT_DIR) -> Tokenizer:
    """Train the tokenizer and write its three files into ``output_dir``."""
    # The library reads this at call time. Training is deterministic either way; one thread just removes any
    # doubt, and the corpus is small enough that it costs a second or two.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tokenizer = train_tokenizer(build_corpus())
    output_dir.mkdir(parents=True, exist_ok=True)
    # Compact JSON: the pretty form spreads every merge over several lines and roughly doubles the size.
    (output_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=False) + "\n", encoding="utf-8")
    _write_json(output_dir / "tokenizer_config.json", tokenizer_config(tokenizer))
    _write_json(output_dir / "special_tokens_map.json", special_tokens_map())
    return tokenizer


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description="Build the tiny model's tokenizer files.")
    parser.add_argument("--output-dir", type=pathlib.Path, default=OUTPUT_DIR)
    args = parser.parse_args(argv)
    tokenizer = build(args.output_dir)
    print(f"wrote {args.output_dir} (vocab size {tokenizer.get_vocab_size()})")


if __name__ == "__main__":
    main()

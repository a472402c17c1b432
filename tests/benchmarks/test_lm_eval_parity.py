"""The lm-eval parity run's own parts (lm-eval itself runs from its own virtualenv, outside the suite)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from benchmarks.lm_eval_parity import DATA, TASK, task_yaml, tokenizer_copy


def test_the_task_reads_its_questions() -> None:
    task = yaml.safe_load(task_yaml(DATA))
    assert task["task"] == TASK and task["output_type"] == "multiple_choice"
    assert task["dataset_kwargs"]["data_files"]["test"] == str(DATA)
    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    assert len(rows) == 40 and all(0 <= r["answer"] < len(r["choices"]) == 4 for r in rows)


def test_the_tokenizer_copy_names_a_class_transformers_4_knows(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend"}))
    (folder / "tokenizer.json").write_text("{}")
    (folder / "model.safetensors").write_text("")
    work = tmp_path / "work"
    work.mkdir()
    out = tokenizer_copy(folder, work)
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert (
        json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"]
        == "PreTrainedTokenizerFast"
    )

"""The local files: what a line holds, non-finite values, histograms, and what a resume keeps."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hookexp.run.sinks import LocalFiles


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_lines_hold_exact_floats_and_name_non_finite_values(tmp_path: Path):
    files = LocalFiles(tmp_path)
    files.log({"a": 0.1 + 0.2, "b": 1e-300, "n": 7, "np": np.float64(2.5)}, step=3)
    files.log({"a": float("nan"), "b": float("-inf"), "c": 1.0}, step=4,
              histograms={"null/hist": (np.array([1.0, 2.0]), np.array([0.0, 0.5, 1.0]))})  # "null": json's way
    files.close()
    first, second = lines(tmp_path / "metrics.jsonl")
    assert first == {"trainer/step": 3, "a": 0.1 + 0.2, "b": 1e-300, "n": 7, "np": 2.5}  # round-trips bit for bit
    assert second == {"trainer/step": 4, "a": "nan", "b": "-inf", "c": 1.0}
    assert lines(tmp_path / "histograms.jsonl") == [
        {"trainer/step": 4, "null/hist": {"bins": [0.0, 0.5, 1.0], "values": [1.0, 2.0]}}]  # arrays as lists
    with pytest.raises(TypeError, match="not JSON serializable: object"):
        LocalFiles(tmp_path).log({"x": object()}, step=5)


def test_histograms_get_their_own_file_and_a_resume_keeps_the_counted_lines(tmp_path: Path):
    (tmp_path / "a").mkdir()
    files = LocalFiles(tmp_path / "a")
    for step in range(3):
        hist = {"grad/w/hist": (np.array([1.0, step]), np.array([0.0, 0.5, 1.0]))}  # as the probes give them
        files.log({"x": float(step)}, step, hist if step != 1 else None)
    # lines count once they are on the disk
    assert files.lines == {"metrics.jsonl": 0, "histograms.jsonl": 0, "spikes.jsonl": 0}
    counted = files.state_dict()["lines"]  # what a checkpoint keeps: flushed and synced first
    files.log({"x": 9.0}, 3, {"grad/w/hist": ([0.0, 2.0], [0.0, 1.0, 2.0])})  # after the checkpoint: dropped
    files.close()
    assert counted == {"metrics.jsonl": 3, "histograms.jsonl": 2, "spikes.jsonl": 0}
    assert lines(tmp_path / "a" / "histograms.jsonl")[1] == {
        "trainer/step": 2, "grad/w/hist": {"bins": [0.0, 0.5, 1.0], "values": [1.0, 2.0]}}

    (tmp_path / "b").mkdir()
    LocalFiles.keep(tmp_path / "a", tmp_path / "b", counted)
    assert [r["trainer/step"] for r in lines(tmp_path / "b" / "metrics.jsonl")] == [0, 1, 2]
    assert [r["trainer/step"] for r in lines(tmp_path / "b" / "histograms.jsonl")] == [0, 2]
    LocalFiles.keep(tmp_path / "a", tmp_path / "a", {"metrics.jsonl": 1})  # an old checkpoint: no histogram lines
    assert len(lines(tmp_path / "a" / "metrics.jsonl")) == 1 and lines(tmp_path / "a" / "histograms.jsonl") == []
    resumed = LocalFiles(tmp_path / "b")
    assert resumed.lines == counted


def test_a_resume_in_place_keeps_the_counted_lines_and_drops_a_torn_one(tmp_path: Path):
    files = LocalFiles(tmp_path)
    for step in range(4):
        files.log({"x": float(step)}, step)
    state = files.state_dict()
    files.log({"x": 9.0}, 4)
    files.close()
    with open(tmp_path / "metrics.jsonl", "ab") as f:
        f.write(b'{"trainer/step": 5, "x": 1.')  # what a kill inside a write leaves
    resumed = LocalFiles(tmp_path)
    resumed.load_state_dict(state)
    resumed.log({"x": 4.5}, 4)
    resumed.close()
    assert [r["x"] for r in lines(tmp_path / "metrics.jsonl")] == [0.0, 1.0, 2.0, 3.0, 4.5]
    assert resumed.lines["metrics.jsonl"] == 5

"""``hf_disk``: a HF ``datasets`` folder (``save_to_disk``) or local json/csv/text/parquet files."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from hookexp.errors import ConfigError, did_you_mean
from hookexp.workloads.data.collate import PadCollate
from hookexp.workloads.data.local import _base_dir, _existing, _hf_tokenizer, _import
from hookexp.workloads.data.splits import Splits, _split_one, check_count
from hookexp.workloads.data.text import CharTokenizer, TokenWindows


def _is_text_feature(feature: Any) -> bool:
    dtype = getattr(feature, "dtype", None)
    if dtype in ("string", "large_string"):
        return True
    inner = getattr(feature, "feature", None)
    return inner is not None and _is_text_feature(inner)


def _load_hf(datasets: Any, path: Any, builder: str | None, data_files: Any) -> Any:
    if builder is None:
        folder = _existing(path, "data.path", "a folder written by save_to_disk")
        try:
            return datasets.load_from_disk(str(folder))
        except FileNotFoundError as e:
            raise ConfigError(f"{folder} is not a folder written by Dataset.save_to_disk ({e}). For json, csv, text "
                              "or parquet files set data.builder (e.g. json) and data.data_files.",
                              key="data.path") from None
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    local = sorted(_PACKAGED_DATASETS_MODULES)
    if builder not in local:
        raise ConfigError(f"unknown builder {builder!r}.{did_you_mean(str(builder), local)} hf_disk reads local "
                          f"files only; use one of {', '.join(local)}.", key="data.builder")
    files = data_files if data_files is not None else path
    if files is None:
        raise ConfigError("is not set; with data.builder give the files to read (or data.path).", key="data.data_files")
    named = files.values() if isinstance(files, Mapping) else [files]
    for entry in named:
        for pattern in [entry] if isinstance(entry, str) else entry:
            if not any(c in str(pattern) for c in "*?[") and not (_base_dir() / str(pattern)).exists():
                _existing(pattern, "data.data_files", f"the {builder} file(s) to read")
    try:
        return datasets.load_dataset(builder, data_files=files)
    except Exception as e:
        raise ConfigError(f"the {builder} builder could not read {files!r}: {type(e).__name__}: {e}.",
                          key="data.data_files") from None


def hf_disk(path: str | None = None, builder: str | None = None, data_files: Any = None, text_column: str = "text",
            tokenizer: str | None = None, block_size: int | None = None, max_length: int | None = None,
            val_fraction: float = 0.1, split_seed: int = 0) -> Splits:
    """A HF ``datasets`` folder written by ``save_to_disk`` (``path``), or local files read by a packaged builder
    (``builder``: json, csv, text, parquet, ...; ``data_files``, default ``path``). Nothing is downloaded.

    Splits: ``train``, and ``validation``, ``val`` or ``test`` (the first present) to validate; without one,
    ``val_fraction`` of train (seeded by ``split_seed``). With ``tokenizer`` (``char`` or a local HF tokenizer
    folder) the ``text_column`` is tokenized: with ``block_size`` the texts are joined and cut into windows
    ``{"input_ids": [block_size]}`` (language modelling, as transformers' run_clm does); without it each row is
    one sequence (cut to ``max_length``), padded per batch by :func:`pad_collate`. A ``label`` column becomes
    ``labels`` (the HF name). Text columns are left out of the tensors. ``info``: vocab_size, block_size, pad_id,
    num_classes (from a ClassLabel or integer labels), vocab (char).
    """
    datasets = _import("datasets", "data", "data=hf_disk")
    if block_size is not None:
        check_count("block_size", block_size)
    if max_length is not None:
        check_count("max_length", max_length)
    loaded = _load_hf(datasets, path, builder, data_files)
    if isinstance(loaded, Mapping):
        if "train" not in loaded:
            raise ConfigError(f"the data has splits {sorted(loaded)} but no 'train'.", key="data.path")
        held_out = next((k for k in ("validation", "val", "test") if k in loaded), None)
        train, val = loaded["train"], loaded[held_out] if held_out else None
    else:
        train, val = loaded, None
    if val is None:
        split = _split_one(train, val_fraction, split_seed, "data.val_fraction")
        train, val = split.train, split.val
    train, val = train.with_format(None), val.with_format(None)
    info: dict[str, Any] = {}
    collate: Callable | None = None
    if "label" in train.column_names and "labels" not in train.column_names:
        train, val = train.rename_column("label", "labels"), val.rename_column("label", "labels")
    if "labels" in train.column_names:
        feature = train.features["labels"]
        if hasattr(feature, "num_classes"):
            info["num_classes"] = feature.num_classes
        elif isinstance(feature, datasets.Value) and feature.dtype.startswith(("int", "uint")):
            info["num_classes"] = max(max(train["labels"]), max(val["labels"])) + 1
    if tokenizer is not None:
        if text_column not in train.column_names:
            raise ConfigError(f"no column {text_column!r}; the data has {', '.join(train.column_names)}."
                              f"{did_you_mean(text_column, train.column_names)}", key="data.text_column")
        if tokenizer == "char":
            chars = CharTokenizer.from_text("".join(train[text_column]) + "".join(val[text_column]))
            info.update(vocab_size=len(chars), vocab=chars.vocab)

            def encode(batch: dict[str, list]) -> dict[str, list]:
                return {"input_ids": [chars.encode(t)[:max_length].tolist() for t in batch[text_column]]}
            pad_id = 0
        else:
            tok = _hf_tokenizer(tokenizer, "data.tokenizer")
            info.update(vocab_size=len(tok), tokenizer=str(tokenizer))
            pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
            if tok.pad_token_id is not None:
                info["pad_id"] = tok.pad_token_id

            def encode(batch: dict[str, list]) -> dict[str, list]:
                cut = {"truncation": True, "max_length": max_length} if max_length else {}
                return dict(tok(batch[text_column], verbose=False, **cut))
        train, val = (d.map(encode, batched=True, remove_columns=[text_column]) for d in (train, val))
        if block_size is not None:
            info["block_size"] = block_size
            windows = []
            for d in (train, val):
                tokens = torch.cat([torch.as_tensor(ids, dtype=torch.int32) for ids in d["input_ids"]])
                if len(tokens) < block_size:
                    raise ConfigError(f"a split has {len(tokens)} tokens, fewer than one window of "
                                      f"block_size={block_size}.", key="data.block_size")
                windows.append(TokenWindows(tokens, block_size, block_size))
            return Splits(windows[0], windows[1], info)
        collate = PadCollate(pad_id)
    texts = [c for c in train.column_names if _is_text_feature(train.features[c])]
    columns = [c for c in train.column_names if c not in texts]
    if texts and tokenizer is None and "input_ids" not in columns:  # else batches would silently lack the text
        raise ConfigError(f"the data has text columns ({', '.join(texts)}) and no input_ids; set data.tokenizer "
                          "(char or a local tokenizer folder) and data.text_column to train on the text, or give "
                          "tokenized data.", key="data.tokenizer")
    if "input_ids" in columns:
        lengths = [len(ids) for d in (train, val) for ids in d["input_ids"]]
        info.setdefault("block_size", max(lengths))
        if "vocab_size" not in info:  # pre-tokenized: the largest id tells the embedding's size
            info["vocab_size"] = max(max(ids) for d in (train, val) for ids in d["input_ids"] if len(ids)) + 1
        if collate is None and len(set(lengths)) > 1:
            collate = PadCollate(0)
    train, val = (d.with_format("torch", columns=columns) for d in (train, val))
    return Splits(train, val, info, collate)

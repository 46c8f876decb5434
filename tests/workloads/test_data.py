"""hookexp.workloads.data: every factory's examples by content against the same thing computed by hand, as_splits on
each accepted form and its error for anything else, pad_collate, and every conf/data option composed as a
user selects it."""

from __future__ import annotations

import json
import re
import sys
import types
from importlib import resources
from pathlib import Path

import pytest
import torch
from conftest import has_module, options
from hydra import compose
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, IterableDataset, Subset, TensorDataset

from hookexp.errors import ConfigError
from hookexp.workloads.data import (
    CharTokenizer,
    PadCollate,
    Splits,
    TensorSet,
    TokenWindows,
    as_splits,
    digits,
    hf_disk,
    modular_addition,
    pad_collate,
    synthetic,
    synthetic_regression,
    text_file,
    torchvision,
    whole_batch,
)

needs_datasets = pytest.mark.skipif(not has_module("datasets"), reason="extra .[hf] (datasets) not installed")
needs_transformers = pytest.mark.skipif(not has_module("transformers"), reason="extra .[hf] not installed")


def torchvision_imports() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:
        return False
    return True


def hand_split(n: int, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train indices, val indices): the first round(n * fraction) of a seeded permutation validate."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val = round(n * fraction)
    return perm[n_val:], perm[:n_val]


# -- images and tabular data --------------------------------------------------------------------------------


def test_digits_keeps_its_values_and_split():
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16
    y = torch.tensor(bunch.target)
    train_idx, val_idx = hand_split(1797, 0.2, 0)
    splits = digits()
    assert torch.equal(splits.train.x, x[train_idx]) and torch.equal(splits.train.y, y[train_idx])
    assert torch.equal(splits.val.x, x[val_idx]) and torch.equal(splits.val.y, y[val_idx])
    assert len(splits.val) == 359 and splits.collate_fn is whole_batch
    assert splits.info == {"num_classes": 10, "in_channels": 1, "image_size": 8, "input_dim": 64, "output_dim": 10}
    other = digits(val_fraction=0.5, split_seed=3)
    assert torch.equal(other.val.y, y[hand_split(1797, 0.5, 3)[1]])


def test_digits_read_sklearns_file_without_importing_sklearn_datasets_or_fall_back_to_it(monkeypatch):
    """``sklearn.datasets`` takes ~1.4 s to import, in every run's start: the file it reads is read directly."""
    import importlib.util
    import subprocess
    import sys

    code = ("import sys; from hookexp.workloads.data.arrays import digits; digits(); "
            "print('sklearn.datasets' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False"
    direct = digits()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sklearn" else real(name, *a))
    fallback = digits()  # where the file is not found: load_digits itself
    assert torch.equal(fallback.train.x, direct.train.x) and torch.equal(fallback.val.y, direct.val.y)


def test_synthetic_images_are_labelled_by_their_teacher():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(100, 2, 6, 6, generator=gen)
    y = (x.flatten(1) @ torch.randn(72, 3, generator=gen)).argmax(1)
    train_idx, val_idx = hand_split(100, 0.25, 4)
    splits = synthetic(n=100, channels=2, image_size=6, num_classes=3, val_fraction=0.25, split_seed=4)
    assert torch.equal(splits.train.x, x[train_idx]) and torch.equal(splits.val.y, y[val_idx])
    assert splits.info == {"num_classes": 3, "in_channels": 2, "image_size": 6, "input_dim": 72, "output_dim": 3}


def test_synthetic_regression_has_float_targets_from_a_tanh_teacher():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(50, 4, generator=gen)
    hidden = torch.tanh(x @ torch.randn(4, 32, generator=gen) / 2)
    y = hidden @ torch.randn(32, 2, generator=gen) / 32**0.5 + 0.5 * torch.randn(50, 2, generator=gen)
    train_idx, val_idx = hand_split(50, 0.2, 1)
    splits = synthetic_regression(n=50, input_dim=4, output_dim=2, noise=0.5, split_seed=1)
    assert splits.train.y.dtype == torch.float32 and splits.train.y.shape == (40, 2)
    torch.testing.assert_close(splits.train.y, y[train_idx])
    torch.testing.assert_close(splits.val.x, x[val_idx])
    assert splits.info == {"input_dim": 4, "output_dim": 2}
    xb, yb = next(iter(DataLoader(splits.train, batch_size=8, collate_fn=splits.collate_fn)))
    assert xb.shape == (8, 4) and yb.shape == (8, 2)


@pytest.mark.parametrize(("call", "key", "text"), [
    (lambda: digits(val_fraction=1.5), "data.val_fraction", "strictly between 0 and 1, got 1.5"),
    (lambda: digits(val_fraction=0), "data.val_fraction", "strictly between 0 and 1, got 0"),
    (lambda: synthetic(n=0), "data.n", "at least 1, got 0"),
    (lambda: synthetic(num_classes=1), "data.num_classes", "at least 2, got 1"),
    (lambda: synthetic_regression(noise=-1), "data.noise", "at least 0, got -1"),
    (lambda: synthetic(n=3, val_fraction=0.1), "data.val_fraction", "leaves 0 for validation"),
])
def test_bad_factory_arguments_name_their_key(call, key, text):
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: .*{re.escape(text)}"):
        call()


# -- the grokking task --------------------------------------------------------------------------------------


def by_hand(op: str, x: int, y: int, p: int) -> int:
    if op == "add":
        return (x + y) % p
    if op == "sub":
        return (x - y) % p
    if op == "mul":
        return (x * y) % p
    return (x * pow(y, -1, p)) % p  # the modular inverse, not Fermat's power the factory uses


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
def test_modular_arithmetic_holds_every_equation_once_with_its_answer(op):
    p = 11
    splits = modular_addition(p=p, op=op, train_fraction=0.3, split_seed=5)
    tokens = torch.cat([splits.train.x, splits.val.x])
    labels = torch.cat([splits.train.y, splits.val.y])
    y_range = range(p) if op in ("add", "sub") else range(1, p)  # Power et al. 2022; Grokfast (mul)
    expected = {(x, y): by_hand(op, x, y, p) for x in range(p) for y in y_range}
    pairs = [(int(t[0]), int(t[2])) for t in tokens]
    assert len(pairs) == len(set(pairs)) == len(expected) and set(pairs) == set(expected)
    assert [int(v) for v in labels] == [expected[pair] for pair in pairs]
    assert (tokens[:, 1] == p).all() and (tokens[:, 3] == p + 1).all()  # OP = p, EQ = p+1
    assert tokens.dtype == labels.dtype == torch.long
    n = len(expected)
    assert len(splits.train) == int(n * 0.3)
    assert splits.info == {"vocab_size": p + 2, "num_classes": p + 2, "block_size": 4}
    assert splits.collate_fn is whole_batch


def test_modular_addition_split_is_fixed_by_its_seed_and_batches_in_one_index():
    a, b = modular_addition(p=97), modular_addition(p=97)
    assert len(a.train) == 97 * 97 // 2 and torch.equal(a.train.x, b.train.x)
    assert not torch.equal(a.train.x, modular_addition(p=97, split_seed=1).train.x)
    order = torch.randperm(len(a.train), generator=torch.Generator().manual_seed(0))[:512]
    x, y = next(iter(DataLoader(a.train, batch_size=512, sampler=order.tolist(), collate_fn=a.collate_fn)))
    assert torch.equal(x, a.train.x[order]) and torch.equal(y, a.train.y[order]) and x.shape == (512, 4)


@pytest.mark.parametrize(("kwargs", "key", "text"), [
    ({"op": "ad"}, "data.op", "unknown operation 'ad'. Did you mean 'add'?"),
    ({"op": "div", "p": 12}, "data.p", "op=div needs a prime p"),
    ({"train_fraction": 1.0}, "data.train_fraction", "strictly between 0 and 1"),
    ({"p": 1}, "data.p", "at least 2, got 1"),
])
def test_modular_addition_errors(kwargs, key, text):
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: .*{re.escape(text)}"):
        modular_addition(**kwargs)


# -- text ---------------------------------------------------------------------------------------------------

TEXT = "To be, or not to be: that is the question.\nÜber Größe — naïve café 😀!\n" * 4


def test_char_tokenizer_round_trips_and_is_sorted():
    chars = CharTokenizer.from_text(TEXT)
    assert chars.vocab == "".join(sorted(set(TEXT)))
    ids = chars.encode(TEXT)
    assert ids.dtype == torch.long and ids.tolist() == [chars.vocab.index(c) for c in TEXT]
    assert chars.decode(ids) == TEXT
    assert CharTokenizer(chars.vocab).decode(CharTokenizer(chars.vocab).encode("café")) == "café"
    with pytest.raises(ValueError, match="character 'Z' is not in the vocabulary"):
        chars.encode("Z")


def test_text_file_windows_are_the_files_slices(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text(TEXT, encoding="utf-8")
    splits = text_file(str(path), block_size=16, val_fraction=0.25, stride=5)
    chars = CharTokenizer(splits.info["vocab"])
    assert splits.info == {"block_size": 16, "vocab_size": len(set(TEXT)), "vocab": "".join(sorted(set(TEXT)))}
    cut = int(len(TEXT) * 0.75)
    assert len(splits.train) == (cut - 16) // 5 + 1 and len(splits.val) == (len(TEXT) - cut - 16) // 16 + 1
    for i in range(len(splits.train)):
        window = splits.train[i]["input_ids"]
        assert window.dtype == torch.long and chars.decode(window) == TEXT[5 * i:5 * i + 16]
    for i in range(len(splits.val)):  # validation: after the training text, never overlapping
        assert chars.decode(splits.val[i]["input_ids"]) == TEXT[cut + 16 * i:cut + 16 * i + 16]
    assert 5 * (len(splits.train) - 1) + 16 <= cut
    batch = next(iter(DataLoader(splits.train, batch_size=4, collate_fn=splits.collate_fn)))
    assert set(batch) == {"input_ids"} and batch["input_ids"].shape == (4, 16)
    with pytest.raises(IndexError):
        splits.train[len(splits.train)]


def test_text_file_reads_relative_paths_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("abcdefgh" * 10)
    monkeypatch.chdir(tmp_path)
    splits = text_file("a.txt", block_size=8)
    assert CharTokenizer(splits.info["vocab"]).decode(splits.train[1]["input_ids"]) == "abcdefgh"


def test_text_file_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=rf"^data\.path: 'nope/x\.txt' does not exist \(looked in "
                                          rf"{re.escape(str(tmp_path / 'nope'))}\)"):
        text_file("nope/x.txt")
    (tmp_path / "short.txt").write_text("abcdefghij")
    with pytest.raises(ConfigError, match=r"^data\.path: .*has 10 tokens: .*training part has 9 and the validation "
                                          r"part 1.*block_size=8"):
        text_file("short.txt", block_size=8)
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1") * 100)
    with pytest.raises(ConfigError, match=r"^data\.path: .*is not UTF-8 text \(byte 0xe9 at offset 3\)"):
        text_file("latin1.txt", block_size=4)
    with pytest.raises(ConfigError, match=r"^data\.path: .*is a folder"):
        text_file(".")
    (tmp_path / "ok.txt").write_text("abc" * 100)
    with pytest.raises(ConfigError, match=r"^data\.tokenizer: 'chr' is neither 'char' nor an existing folder.*"
                                          r"Did you mean 'char'\?"):
        text_file("ok.txt", tokenizer="chr")
    with pytest.raises(ConfigError, match=r"^data\.block_size: must be an integer of at least 1, got 0"):
        text_file("ok.txt", block_size=0)


def word_tokenizer(folder: Path) -> Path:
    """A tiny word-level HF tokenizer saved to ``folder`` (built locally: nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "the": 2, "cat": 3, "sat": 4, "on": 5, "mat": 6, ".": 7}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]").save_pretrained(folder)
    return folder


@needs_transformers
def test_text_file_with_a_local_hf_tokenizer(tmp_path):
    folder = word_tokenizer(tmp_path / "tok")
    path = tmp_path / "t.txt"
    path.write_text("the cat sat on the mat . " * 20)
    splits = text_file(str(path), block_size=6, tokenizer=str(folder))
    ids = [2, 3, 4, 5, 2, 6, 7] * 20
    cut = int(len(ids) * 0.9)
    assert splits.info == {"block_size": 6, "vocab_size": 8, "tokenizer": str(folder), "pad_id": 0}
    assert [splits.train[i]["input_ids"].tolist() for i in range(len(splits.train))] == \
        [ids[i:i + 6] for i in range(0, cut - 5, 6)]
    assert splits.val[0]["input_ids"].tolist() == ids[cut:cut + 6]


# -- as_splits ----------------------------------------------------------------------------------------------


def tensors(n: int = 10) -> TensorDataset:
    return TensorDataset(torch.arange(n).float()[:, None], torch.arange(n))


class Stream(IterableDataset):
    def __iter__(self):
        yield from range(3)


def test_as_splits_accepts_every_documented_form():
    a, b = tensors(6), tensors(4)
    given = Splits(a, b, {"num_classes": 3})
    assert as_splits(given).info == {"num_classes": 3} and as_splits(given).train is a
    for obj in [(a, b), [a, b], {"train": a, "val": b}, {"train": a, "validation": b, "test": tensors()}]:
        splits = as_splits(obj)
        assert splits.train is a and splits.val is b and splits.info == {} and splits.collate_fn is None
    streams = as_splits((Stream(), Stream()))
    assert list(streams.train) == [0, 1, 2]
    lists = as_splits(([1, 2, 3], [4]))
    assert lists.train == [1, 2, 3]
    sets = as_splits((TensorSet(torch.zeros(3, 2), torch.zeros(3)), TensorSet(torch.zeros(1, 2), torch.zeros(1))))
    assert sets.collate_fn is whole_batch
    assert as_splits(Splits(sets.train, sets.val)).collate_fn is whole_batch
    assert as_splits(Splits(sets.train, sets.val, {}, collate_fn=print)).collate_fn is print


def test_as_splits_splits_one_data_set_by_a_fixed_seed():
    data = tensors(20)
    train_idx, val_idx = hand_split(20, 0.25, 7)
    splits = as_splits(data, val_fraction=0.25, seed=7)
    assert isinstance(splits.train, Subset) and splits.train.dataset is data
    assert splits.train.indices == train_idx.tolist() and splits.val.indices == val_idx.tolist()
    one = as_splits({"train": data}, val_fraction=0.25, seed=7)
    assert one.val.indices == val_idx.tolist()
    x, y = torch.randn(20, 3), torch.arange(20)
    kept = as_splits(TensorSet(x, y), val_fraction=0.25, seed=7)
    assert isinstance(kept.val, TensorSet) and torch.equal(kept.val.x, x[val_idx]) and kept.collate_fn is whole_batch


ACCEPTED_TEXT = "Return one of: a hookexp.workloads.data.Splits(train, val, info); a pair (train, val) of data sets"


@pytest.mark.parametrize(("obj", "pattern"), [
    (None, r"^data\.dataset: returned None, which is not training and validation data\. Return one of: "),
    (3, r"^data\.dataset: returned a builtins\.int \(3\), which is not training and validation data"),
    ("digits", r"returned a builtins\.str \('digits'\)"),
    ({"train": [1], "test": [2]}, r"^data\.dataset: returned a mapping with keys \['test', 'train'\]; hookexp needs "
                                  r"'train' and 'val' or 'validation'"),
    ((torch.zeros(3, 2), torch.zeros(3)),
     r"returned a pair of tensors .* return hookexp\.workloads\.data\.TensorSet\(x, y\)"),
    (Stream(), r"returned one iterable data set \(Stream\), which cannot be split by data\.val_fraction"),
    ((tensors(), []), r"^data\.dataset: the val set is empty"),
    (Splits(tensors(), 5), r"^data\.dataset: the val set is a builtins\.int \(5\), not a data set"),
])
def test_as_splits_refuses_anything_else_naming_the_key_and_the_accepted_forms(obj, pattern):
    with pytest.raises(ConfigError, match=pattern) as e:
        as_splits(obj)
    assert "a pair (train, val)" in str(e.value) or "iterable" in str(e.value) or "empty" in str(e.value)


def test_as_splits_names_the_key_it_is_given_and_checks_val_fraction():
    with pytest.raises(ConfigError, match=r"^my\.key: returned None"):
        as_splits(None, key="my.key")
    with pytest.raises(ConfigError, match=r"^data\.val_fraction: must be a number strictly between 0 and 1, got 1\.5"):
        as_splits(tensors(), val_fraction=1.5)


@needs_datasets
def test_as_splits_takes_hf_data_sets_as_torch_tensors():
    import datasets

    table = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3, 4], [5, 6], [7, 8]], "labels": [0, 1, 0, 1]})
    pair = as_splits(datasets.DatasetDict({"train": table, "validation": table.select([0])}))
    assert torch.equal(pair.train[1]["input_ids"], torch.tensor([3, 4])) and len(pair.val) == 1
    one = as_splits(table, val_fraction=0.25, seed=0)
    train_idx, val_idx = hand_split(4, 0.25, 0)
    assert one.val[0]["labels"].item() == table[int(val_idx[0])]["labels"]
    assert torch.equal(one.train[:]["input_ids"], torch.tensor(table["input_ids"])[train_idx])
    with pytest.raises(ConfigError, match="returned one iterable data set"):
        as_splits(table.to_iterable_dataset())


# -- pad_collate --------------------------------------------------------------------------------------------


def test_pad_collate_pads_each_key_as_its_meaning_needs():
    collate = pad_collate(pad_id=9)
    assert isinstance(collate, PadCollate)
    batch = collate([{"input_ids": torch.tensor([1, 2, 3]), "labels": [1, 2, 3], "y": 4, "text": "a"},
                     {"input_ids": torch.tensor([5]), "labels": [5], "y": 6, "text": "b"}])
    assert batch["input_ids"].tolist() == [[1, 2, 3], [5, 9, 9]]
    assert batch["labels"].tolist() == [[1, 2, 3], [5, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["y"].tolist() == [4, 6] and batch["text"] == ["a", "b"]
    given = collate([{"input_ids": [1, 2], "attention_mask": [1, 1]}, {"input_ids": [3], "attention_mask": [1]}])
    assert given["attention_mask"].tolist() == [[1, 1], [1, 0]]
    import pickle

    assert pickle.loads(pickle.dumps(collate)).pad_id == 9  # DataLoader workers can take it
    with pytest.raises(TypeError, match="pad_collate batches mappings"):
        collate([(1, 2)])


# -- torchvision (fake and absent modules; the real one where it imports) -----------------------------------


def fake_torchvision() -> types.ModuleType:
    """torchvision's interface as hookexp uses it: datasets.<Name>(root, train, transform, download)."""
    tv = types.ModuleType("torchvision")
    tv.transforms = types.SimpleNamespace(ToTensor=lambda: "to_tensor", Normalize=lambda m, s: ("normalize", m, s),
                                          Compose=lambda steps: ("compose", steps))

    class FakeSet:
        folder = "FAKE"

        def __init__(self, root, train=True, transform=None, download=False):
            if not (Path(root) / self.folder).is_dir():
                raise RuntimeError("Dataset not found. You can use download=True to download it")
            self.root, self.train, self.transform = root, train, transform

    tv.datasets = types.SimpleNamespace(**{name: type(name, (FakeSet,), {"folder": name})
                                           for name in ("MNIST", "FashionMNIST", "CIFAR10", "CIFAR100")})
    return tv


def test_torchvision_without_the_package_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", None)  # import torchvision -> ImportError
    with pytest.raises(ConfigError, match=r"^data: data=torchvision needs torchvision, which does not import here "
                                          r"\((ModuleNotFound|Import)Error.*pip install 'hookexp\[vision\]'.*"
                                          r"download\.pytorch\.org/whl/cpu"):
        torchvision("mnist", root=".")
    with pytest.raises(ConfigError, match=r"^data\.name: unknown data set 'cifar'\. Did you mean 'cifar10' or "):
        torchvision("cifar", root=".")


def test_torchvision_names_the_missing_folder_and_the_layout(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torchvision", fake_torchvision())
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=rf"^data\.root: 'data' does not exist \(looked in {re.escape(str(tmp_path))}"
                                          r"\)\. Give the folder that holds MNIST \(ROOT/MNIST/raw/"):
        torchvision("mnist", root="data")
    (tmp_path / "data").mkdir()
    with pytest.raises(ConfigError, match=rf"^data\.root: {re.escape(str(tmp_path / 'data'))} does not hold CIFAR10 "
                                          r"\(Dataset not found.*Expected layout: .*/data/cifar-10-batches-py/"):
        torchvision("cifar10", root="data")


def test_torchvision_builds_train_and_test_sets_with_their_info(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torchvision", fake_torchvision())
    (tmp_path / "CIFAR100").mkdir()
    splits = torchvision("cifar100", root=str(tmp_path))
    assert splits.train.train is True and splits.val.train is False and splits.train.root == str(tmp_path)
    assert splits.train.transform == ("compose", ["to_tensor", ("normalize", (0.5071, 0.4865, 0.4409),
                                                                (0.2673, 0.2564, 0.2762))])
    assert splits.info == {"num_classes": 100, "in_channels": 3, "image_size": 32, "input_dim": 3072,
                           "output_dim": 100}
    assert torchvision("cifar100", root=str(tmp_path), normalize=False).val.transform == ("compose", ["to_tensor"])


@pytest.mark.skipif(not torchvision_imports(), reason="torchvision does not import beside this torch")
def test_torchvision_reads_a_local_mnist_folder(tmp_path):
    import struct

    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    images = torch.randint(0, 256, (5, 28, 28), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for split in ("train", "t10k"):
        (raw / f"{split}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, 5, 28, 28) +
                                                         images.numpy().tobytes())
        (raw / f"{split}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, 5) + bytes([3, 1, 4, 1, 5]))
    splits = torchvision("mnist", root=str(tmp_path), normalize=False)
    x, y = next(iter(DataLoader(splits.train, batch_size=5)))
    assert x.shape == (5, 1, 28, 28) and y.tolist() == [3, 1, 4, 1, 5]
    torch.testing.assert_close(x[:, 0], images.float() / 255)


# -- hf_disk ------------------------------------------------------------------------------------------------


def saved(tmp_path: Path, with_val: bool = True) -> Path:
    import datasets

    features = datasets.Features({"text": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["neg", "pos", "meh"])})
    train = datasets.Dataset.from_dict({"text": ["the cat", "sat on the mat", "the mat ."], "label": [0, 1, 2]},
                                       features=features)
    val = datasets.Dataset.from_dict({"text": ["cat sat"], "label": [1]}, features=features)
    folder = tmp_path / "ds"
    (datasets.DatasetDict({"train": train, "validation": val}) if with_val else train).save_to_disk(str(folder))
    return folder


@needs_datasets
def test_hf_disk_char_windows_are_the_joined_texts(tmp_path):
    splits = hf_disk(str(saved(tmp_path)), tokenizer="char", block_size=4)
    chars = CharTokenizer(splits.info["vocab"])
    assert splits.info["vocab"] == "".join(sorted(set("the catsat on the matthe mat .cat sat")))
    assert splits.info["num_classes"] == 3 and splits.info["block_size"] == 4
    joined = "the catsat on the matthe mat ."
    assert [chars.decode(w["input_ids"]) for w in splits.train] == [joined[i:i + 4] for i in range(0, 27, 4)]
    assert [chars.decode(w["input_ids"]) for w in splits.val] == ["cat "]


@needs_datasets
def test_hf_disk_rows_are_padded_sequences_with_labels(tmp_path):
    splits = hf_disk(str(saved(tmp_path)), tokenizer="char", max_length=5)
    chars = CharTokenizer(splits.info["vocab"])
    assert isinstance(splits.collate_fn, PadCollate) and splits.info["block_size"] == 5
    batch = next(iter(DataLoader(splits.train, batch_size=3, collate_fn=splits.collate_fn)))
    assert set(batch) == {"input_ids", "labels", "attention_mask"}
    assert batch["labels"].tolist() == [0, 1, 2]
    assert batch["attention_mask"].tolist() == [[1] * 5, [1] * 5, [1] * 5]
    assert [chars.decode(row) for row in batch["input_ids"]] == ["the c", "sat o", "the m"]


@needs_datasets
@needs_transformers
def test_hf_disk_with_a_local_hf_tokenizer(tmp_path):
    folder = word_tokenizer(tmp_path / "tok")
    splits = hf_disk(str(saved(tmp_path)), tokenizer=str(folder))
    batch = next(iter(DataLoader(splits.train, batch_size=3, collate_fn=splits.collate_fn)))
    assert batch["input_ids"].tolist() == [[2, 3, 0, 0], [4, 5, 2, 6], [2, 6, 7, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]]
    assert splits.info["vocab_size"] == 8 and splits.info["pad_id"] == 0 and splits.info["block_size"] == 4


@needs_datasets
def test_hf_disk_reads_local_files_with_a_builder_and_splits_them(tmp_path):
    rows = [{"input_ids": list(range(i % 3 + 1)), "labels": i % 2} for i in range(10)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    splits = hf_disk(builder="json", data_files=str(tmp_path / "rows.jsonl"), val_fraction=0.2, split_seed=1)
    val_idx = hand_split(10, 0.2, 1)[1]
    assert [splits.val[i]["labels"].item() for i in range(2)] == [rows[int(i)]["labels"] for i in val_idx]
    assert splits.info == {"num_classes": 2, "block_size": 3, "vocab_size": 3}
    batch = next(iter(DataLoader(splits.train, batch_size=8, collate_fn=splits.collate_fn)))
    assert batch["input_ids"].shape == (8, 3) and len(splits.train) == 8


@needs_datasets
def test_hf_disk_splits_a_single_saved_data_set(tmp_path):
    splits = hf_disk(str(saved(tmp_path, with_val=False)), tokenizer="char", val_fraction=0.34)
    assert len(splits.train) == 2 and len(splits.val) == 1


@needs_datasets
def test_hf_disk_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^data\.path: 'missing' does not exist \(looked in "):
        hf_disk("missing")
    (tmp_path / "plain").mkdir()
    with pytest.raises(ConfigError, match=r"^data\.path: .*plain is not a folder written by Dataset\.save_to_disk"):
        hf_disk("plain")
    with pytest.raises(ConfigError, match=r"^data\.builder: unknown builder 'jsn'\. Did you mean 'json'"):
        hf_disk("x.json", builder="jsn")
    with pytest.raises(ConfigError, match=r"^data\.data_files: 'x\.json' does not exist"):
        hf_disk("x.json", builder="json")
    folder = saved(tmp_path)
    with pytest.raises(ConfigError, match=r"^data\.text_column: no column 'txt'; .*Did you mean 'text'"):
        hf_disk(str(folder), tokenizer="char", text_column="txt")
    with pytest.raises(ConfigError, match=r"^data\.tokenizer: the data has text columns \(text\) and no input_ids"):
        hf_disk(str(folder))
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ConfigError, match=r"^data: data=hf_disk needs the `datasets` package.*hookexp\[hf\]"):
        hf_disk(str(folder))


def test_token_windows_need_one_window():
    with pytest.raises(ValueError, match="3 tokens hold no window of block_size=4"):
        TokenWindows(torch.arange(3), 4, 4)


# -- conf/data: every option as a user selects it -----------------------------------------------------------

COMMON = {"batch_size", "eval_batch_size", "num_workers", "collate_fn", "dataset"}




def test_the_shipped_data_options():
    assert options("data") == ["digits", "hf_disk", "modular_addition", "synthetic", "synthetic_regression",
                              "text_file", "torchvision"]


@pytest.mark.parametrize("option", options("data"))
def test_every_data_key_is_commented_and_reaches_the_factory(option, hydra_conf):
    text = (resources.files("hookexp.conf") / "data" / f"{option}.yaml").read_text()
    top = [line for line in text.splitlines() if re.match(r"^[a-z_]+:", line)]
    assert all("#" in line for line in top if not line.startswith("dataset:")), top
    cfg = OmegaConf.load(resources.files("hookexp.conf") / "data" / f"{option}.yaml")
    assert set(cfg) >= COMMON and cfg.collate_fn is None
    for key in set(cfg) - COMMON:  # the option's own keys, interpolated into dataset: (a stray key is a typo)
        assert f"${{..{key}}}" in [str(v) for v in OmegaConf.to_container(cfg.dataset).values()], key
    assert not {"channels", "image_size", "num_classes"} & set(cfg) or option == "synthetic"


def hf_folder(tmp_path: Path) -> Path:
    return saved(tmp_path)


@pytest.mark.parametrize(("option", "overrides", "kind"), [
    ("digits", [], "pair"),
    ("synthetic", ["data.channels=1"], "pair"),
    ("synthetic_regression", ["data.output_dim=2"], "pair"),
    ("modular_addition", ["data.p=5", "data.op=sub"], "pair"),
    ("text_file", ["data.path=PATH", "data.block_size=8"], "tokens"),
    pytest.param("hf_disk", ["data.path=HF", "data.tokenizer=char", "data.block_size=4"], "tokens",
                 marks=needs_datasets),
])
def test_every_data_option_builds_batches_of_its_documented_format(option, overrides, kind, hydra_conf, tmp_path):
    (tmp_path / "t.txt").write_text(TEXT)
    folder = hf_folder(tmp_path) if option == "hf_disk" else tmp_path
    overrides = [o.replace("PATH", str(tmp_path / "t.txt")).replace("HF", str(folder)) for o in overrides]
    cfg = compose("config", overrides=[f"data={option}", *overrides])
    splits = as_splits(instantiate(cfg.data.dataset), cfg.data.get("val_fraction", 0.2), cfg.data.get("split_seed", 0))
    loader = DataLoader(splits.train, batch_size=cfg.data.batch_size, collate_fn=splits.collate_fn)
    batch = next(iter(loader))
    if kind == "pair":
        x, y = batch
        assert len(x) == len(y) > 0
    else:
        assert batch["input_ids"].dtype == torch.long and batch["input_ids"].shape[1] == splits.info["block_size"]
        assert int(batch["input_ids"].max()) < splits.info["vocab_size"]
    if option == "modular_addition":
        assert x.shape[1:] == (4,) and splits.info["vocab_size"] == 7


def test_torchvision_option_reaches_the_factory(hydra_conf, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torchvision", fake_torchvision())
    (tmp_path / "FashionMNIST").mkdir()
    cfg = compose("config", overrides=["data=torchvision", "data.name=fashion_mnist", f"data.root={tmp_path}"])
    splits = instantiate(cfg.data.dataset)
    assert splits.info["image_size"] == 28 and splits.train.root == str(tmp_path)


def test_text_file_needs_a_path(hydra_conf):
    cfg = compose("config", overrides=["data=text_file"])
    assert OmegaConf.is_missing(cfg.data, "path")


def test_classes_in_reads_the_labels_of_map_style_sets_only():
    """What model.num_classes=auto reads from a user's own data (largest label + 1)."""
    from torch.utils.data import Subset

    from hookexp.workloads.data import classes_in

    pairs = TensorDataset(torch.zeros(6, 2), torch.tensor([0, 2, 1, 7, 0, 1]))
    assert classes_in(pairs) == 8
    assert classes_in(Subset(pairs, [0, 1, 2])) == 3
    assert classes_in([{"x": torch.zeros(2), "labels": 3}, {"x": torch.zeros(2), "labels": 1}], pairs) == 8
    assert classes_in([(torch.zeros(2), torch.tensor(4))]) == 5
    assert classes_in(TensorDataset(torch.zeros(2, 2), torch.tensor([0.5, 1.0]))) is None  # regression targets
    assert classes_in(Stream()) is None  # iterable: cannot be known without reading it
    assert classes_in(TensorDataset(torch.zeros(2, 2))) is None  # no labels

"""Data loading: the order of an epoch is a function of (seed, epoch), so a resumed run restarts exactly."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import IterableDataset, TensorDataset

from hookexp.errors import ConfigError
from hookexp.run.distributed import Dist
from hookexp.run.loaders import EpochSampler, Loaders, check_data_config, to_device


def test_an_epoch_is_torch_randperm_seeded_with_seed_plus_epoch():
    sampler = EpochSampler(10, seed=3, train=True)
    sampler.set_epoch(2)
    assert list(sampler) == torch.randperm(10, generator=torch.Generator().manual_seed(5)).tolist()
    sampler.set_epoch(2, start=4)
    assert list(sampler) == torch.randperm(10, generator=torch.Generator().manual_seed(5)).tolist()[4:]
    assert len(sampler) == 6


def test_ranks_take_equal_disjoint_shares_and_validation_sees_every_example_once():
    perm = torch.randperm(11, generator=torch.Generator().manual_seed(0)).tolist()
    shares = []
    for rank in range(3):
        s = EpochSampler(11, seed=0, train=True, rank=rank, world_size=3)
        shares.append(list(s))
        assert len(s) == len(shares[-1]) == 3
    assert sorted(i for share in shares for i in share) == sorted(perm[:9])  # trimmed to a multiple of the world size
    val = [list(EpochSampler(11, seed=0, train=False, rank=r, world_size=3)) for r in range(3)]
    assert sorted(i for v in val for i in v) == list(range(11)) and [len(v) for v in val] == [4, 4, 3]


def loaders(workers: int = 0, ranks: Dist | None = None) -> Loaders:
    x = torch.arange(100, dtype=torch.float32).reshape(50, 2)
    data = TensorDataset(x, torch.arange(50))
    return Loaders(data, data, {}, None, batch_size=8, eval_batch_size=16, num_workers=workers, seed=1,
                   ranks=ranks or Dist())


@pytest.mark.parametrize("workers", [0, 2])
def test_an_epoch_restarted_at_a_batch_gives_the_remaining_batches_exactly(workers):
    data = loaders(workers)
    full = [y.tolist() for _, y in data.epoch(3)]
    assert len(full) == data.batches_per_epoch() == 7
    assert [y.tolist() for _, y in data.epoch(3, start_batch=4)] == full[4:]
    assert sorted(i for batch in full for i in batch) == list(range(50))
    assert full != [y.tolist() for _, y in data.epoch(4)]
    assert data.total_steps(epochs=2, max_steps=None, accumulate=3) == (2 * 3, "trainer.epochs=2")  # ceil(7/3) an epoch
    assert data.total_steps(epochs=2, max_steps=5, accumulate=1) == (5, "trainer.max_steps=5")


def test_an_explicit_max_steps_lifts_the_default_epoch_limit_and_both_explicit_the_first_reached_ends():
    """7 batches an epoch; epochs=None is the default of 10 epochs (70 steps)."""
    data = loaders(0)
    assert data.total_steps(epochs=None, max_steps=None, accumulate=1) == (70, "the default 10 epochs")
    assert data.total_steps(epochs=None, max_steps=4000, accumulate=1) == (4000, "trainer.max_steps=4000")
    assert data.total_steps(epochs=None, max_steps=3, accumulate=1) == (3, "trainer.max_steps=3")
    assert data.total_steps(epochs=10, max_steps=4000, accumulate=1) == (70, "trainer.epochs=10")
    assert data.total_steps(epochs=10, max_steps=30, accumulate=1) == (30, "trainer.max_steps=30")


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(20))


def test_an_iterable_set_is_read_as_it_streams_and_skipped_on_resume():
    data = Loaders(Stream(), None, {}, None, batch_size=4, eval_batch_size=4, num_workers=0, seed=0, ranks=Dist())
    assert data.batches_per_epoch() is None
    assert [b.tolist() for b in data.epoch(0, start_batch=3)] == [[12, 13, 14, 15], [16, 17, 18, 19]]
    assert data.validation() is None
    with pytest.raises(ConfigError, match=r"^trainer\.max_steps: is needed with an iterable data set"):
        data.total_steps(epochs=1, max_steps=None, accumulate=1)
    assert data.total_steps(epochs=1, max_steps=30, accumulate=1) == (30, "trainer.max_steps=30")


def test_batches_move_to_the_device_keeping_their_types():
    Pair = namedtuple("Pair", "x y")
    batch = {"a": Pair(torch.ones(1), [torch.zeros(1), 3]), "b": "text"}
    moved = to_device(batch, torch.device("cpu"))
    assert isinstance(moved["a"], Pair) and moved["a"].y[1] == 3 and moved["b"] == "text"


@pytest.mark.parametrize(("change", "message"), [
    ({"pth": "x"}, r"^data\.pth: unknown data key 'pth': the data option does not use it\. Did you mean 'path'\?"),
    ({"batch_size": 0}, r"^data\.batch_size: expected an integer >= 1, got 0\."),
    ({"num_workers": -1}, r"^data\.num_workers: expected an integer >= 0, got -1\."),
    ({"val_fraction": 1.5}, r"^data\.val_fraction: expected a fraction in \[0, 1\)"),
])
def test_data_config_mistakes_name_the_key(change, message):
    data = OmegaConf.create({"path": "a.txt", "batch_size": 4, "num_workers": 0,
                             "dataset": {"_target_": "x.y", "path": "${..path}"}, **change})
    with pytest.raises(ConfigError, match=message):
        check_data_config(data)

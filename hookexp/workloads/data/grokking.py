"""The grokking task: ``modular_addition``, every equation ``x op y = (x op y) mod p``."""

from __future__ import annotations

import math

import torch

from hookexp.errors import ConfigError, did_you_mean
from hookexp.workloads.data.splits import Splits, TensorSet, check_count, check_fraction, whole_batch

OPS = ("add", "sub", "mul", "div")


def _is_prime(p: int) -> bool:
    return p >= 2 and all(p % d for d in range(2, math.isqrt(p) + 1))


def modular_addition(p: int = 97, op: str = "add", train_fraction: float = 0.5, split_seed: int = 0) -> Splits:
    """The grokking task: every equation ``x op y = (x op y) mod p``, a random ``train_fraction`` of them to train.

    Each example is ``(tokens, label)``: tokens ``[x, OP, y, EQ]`` (numbers are tokens 0..p-1, OP = p,
    EQ = p+1, so the vocabulary has p+2 tokens) and the answer ``(x op y) mod p`` as the label; a model reads
    the answer at the last position, as the papers do. The operands follow the papers:

    - add, sub: x, y in [0, p), p*p equations (Power et al. 2022: x+y, x-y mod p);
    - div: x in [0, p), y in [1, p), x / y = x * y^(p-2) mod p; p must be prime (Power et al. 2022);
    - mul: x in [0, p), y in [1, p), p*(p-1) equations (Grokfast, Lee et al. 2024).

    The split is a permutation seeded by ``split_seed`` (fixed across training seeds); every equation is in
    exactly one of train and val. ``info``: vocab_size = num_classes = p+2 (the head predicts a token),
    block_size = 4.
    """
    check_count("p", p, 2)
    if op not in OPS:
        raise ConfigError(f"unknown operation {op!r}.{did_you_mean(op, OPS)} Use one of {', '.join(OPS)}.",
                          key="data.op")
    if op == "div" and not _is_prime(p):
        raise ConfigError(f"op=div needs a prime p (y must have an inverse mod p), got {p}; e.g. data.p=97.",
                          key="data.p")
    train_fraction = check_fraction(train_fraction, "data.train_fraction")
    x = torch.arange(p)
    y = torch.arange(p) if op in ("add", "sub") else torch.arange(1, p)
    x, y = torch.cartesian_prod(x, y).unbind(1)
    if op == "add":
        label = (x + y) % p
    elif op == "sub":
        label = (x - y) % p  # torch's % takes the sign of the divisor: always in [0, p)
    elif op == "mul":
        label = (x * y) % p
    else:
        inverse = torch.tensor([0] + [pow(int(v), p - 2, p) for v in range(1, p)])  # Fermat: y^(p-2) = 1/y
        label = (x * inverse[y]) % p
    tokens = torch.stack([x, torch.full_like(x, p), y, torch.full_like(x, p + 1)], dim=1)
    perm = torch.randperm(len(label), generator=torch.Generator().manual_seed(split_seed))
    n_train = int(len(label) * train_fraction)  # floor, as Grokfast's 50% split of p*(p-1) equations
    if not 0 < n_train < len(label):
        raise ConfigError(f"{train_fraction} of {len(label)} equations leaves {n_train} to train and "
                          f"{len(label) - n_train} to validate; both need at least one.", key="data.train_fraction")
    train_idx, val_idx = perm[:n_train], perm[n_train:]
    info = {"vocab_size": p + 2, "num_classes": p + 2, "block_size": 4}
    return Splits(TensorSet(tokens[train_idx], label[train_idx]), TensorSet(tokens[val_idx], label[val_idx]), info,
                  whole_batch)

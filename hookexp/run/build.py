"""Everything a run builds from its config before the first step: seed, device, data, model, task,
optimizer and schedule, each from a ``_target_`` node, with errors that name the config key.

:func:`instantiate` checks a node against its target's signature before calling it (an unknown key gets
a did-you-mean, a number given as text is refused) and turns what the constructor raises into one
paragraph naming ``<group>.<key>``: ``optim.lr: Invalid learning rate: -1`` rather than torch's traceback.
A model key whose value is ``auto`` is taken from what the data says (``Splits.info``: vocab_size,
num_classes, ...), so model configs do not repeat the data's shape.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from hookexp.config import TrainerConfig, typed
from hookexp.errors import ConfigError, did_you_mean
from hookexp.goals import Reach
from hookexp.run.distributed import Dist, shard
from hookexp.run.instantiate import (
    check_arguments,
    drop_inherited,
    fill_auto,
    instantiate,
    parameters_of,
    target_of,
    unpartial,
)
from hookexp.run.loaders import Loaders, make_loaders
from hookexp.run.precision import DTYPES
from hookexp.workloads.tasks import Classification, Task

log = logging.getLogger("hookexp.build")


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed python, numpy and torch, and switch torch's deterministic algorithms on or off.

    Set either way: Hydra's basic launcher runs a multirun's jobs in one process, so a job must not
    inherit the setting of the job before it.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(deterministic)


def pick_device(name: str) -> torch.device:
    """``trainer.device``: auto (cuda, else mps, else cpu), cpu, cuda, cuda:N or mps, checked against the machine."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        kind = str(name).split(":", 1)[0]
        hint = " (a GPU is cuda here)." if kind.lower() in ("gpu", "nvidia", "rocm") else "." + did_you_mean(
            kind, ["auto", "cpu", "cuda", "mps"])
        raise ConfigError(f"{name!r} is not a device hookexp trains on{hint} Use auto, cpu, cuda, cuda:N or mps.",
                          key="trainer.device") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("CUDA is not available on this machine. Use trainer.device=auto or cpu.",
                          key="trainer.device")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        have = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        raise ConfigError(f"there is no {device}: this machine has {len(have)} CUDA device(s) ({', '.join(have)}). "
                          "Use trainer.device=auto, cuda or one of those.", key="trainer.device")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("MPS (Apple's GPU backend) is not available on this machine. Use trainer.device=auto or "
                          "cpu.", key="trainer.device")
    if device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"hookexp trains on cpu, cuda or mps, not {device.type}. Use trainer.device=auto.",
                          key="trainer.device")
    return device


def set_threads(num_threads: int | None) -> None:
    """``trainer.num_threads``: torch's intra-op threads (None keeps torch's default, one per core)."""
    if num_threads is not None:  # checked by TrainerConfig
        torch.set_num_threads(num_threads)


# ----------------------------------------------------------------------------------------------------
# The parts of a run.


def derived_from_examples(loaders: Loaders, task: Task) -> dict[str, Callable[[], tuple[Any, str]]]:
    """What a model's ``auto`` sizes are when the data does not say them: read from a user's own map-style sets
    (``input_dim`` from one example's input, ``in_channels`` and ``image_size`` from a ``(C, H, W)`` one; for
    classification, ``num_classes`` / ``output_dim`` / ``num_labels`` from the data's ``num_classes`` or the
    labels)."""
    from hookexp.workloads.data import classes_in, input_shape

    @functools.cache
    def classes() -> tuple[int | None, str]:
        if "num_classes" in loaders.info:
            return loaders.info["num_classes"], "the data's num_classes"
        found = classes_in(loaders.train, loaders.val)
        return (found, "the largest label of the training and validation sets + 1") if found is not None else (
            None, "Its labels cannot be read: the data set is iterable (it streams) or its examples carry no "
                  "integer class labels.")

    @functools.cache
    def shape() -> tuple[tuple[int, ...] | None, str]:
        found = input_shape(loaders.train)
        return found, "" if found is not None else (
            "One example's input cannot be read: the data set is iterable, or its examples are not (input, label) "
            "pairs of tensors.")

    def inputs() -> tuple[int | None, str]:
        found, why = shape()
        return (math.prod(found), "the number of elements of one training example's input") if found is not None \
            else (None, why)

    def image(part: str) -> tuple[int | None, str]:
        found, why = shape()
        if found is None:
            return None, why
        last = len(found) == 3 and found[0] == found[1] != found[2]  # [H, W, C] with H = W, as numpy images are
        if len(found) != 3 or last or (part == "size" and found[1] != found[2]):
            hint = (" It looks channels-last [size, size, channels]: permute it to [channels, size, size] (torch's "
                    "layout), or set the model's sizes.") if last else ""
            return None, (f"One training example's input has shape {list(found)}, not a square image "
                          f"[channels, size, size].{hint}")
        return (found[0], "the first dimension of one training example's [C, H, W] input") if part == "channels" \
            else (found[1], "the height (= width) of one training example's [C, H, W] input")

    derive: dict[str, Callable[[], tuple[Any, str]]] = {
        "input_dim": inputs, "in_channels": functools.partial(image, "channels"),
        "image_size": functools.partial(image, "size")}
    if isinstance(task, Classification):
        derive.update(num_classes=classes, output_dim=classes, num_labels=classes)
    return derive


@dataclass
class Parts:
    """What a job trains: built once, wired by the loop."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    task: Task
    loaders: Loaders
    model_config: dict[str, Any]  # the model's arguments as built (``auto`` filled from the data)
    device: torch.device
    ranks: Dist
    total_steps: int
    accumulate: int
    limit: str = ""  # what sets total_steps, e.g. "trainer.max_steps=4000" (the final log line says it)
    goal: Reach | None = None  # trainer.stop_when


def build_task(cfg: DictConfig, overrides: list[str] | None = None, *, quiet: bool = False) -> Task:
    """``cfg.task`` built and checked to be a :class:`Task`; ``quiet``: log nothing (a check before the build,
    which logs the keys a user's task does not take)."""
    task = instantiate(drop_inherited(cfg.task, "task", overrides, quiet=quiet), "task")
    if not isinstance(task, Task):
        raise ConfigError(f"{cfg.task._target_} built a {type(task).__name__}, not a hookexp.workloads.tasks.Task. "
                          "Subclass hookexp.workloads.tasks.Task (override loss, and sums/metric_names for more "
                          "metrics).", key="task")
    return task


def check_targets(cfg: DictConfig, overrides: list[str] | None = None) -> None:
    """The model's and the optimizer's keys against their targets' signatures (unknown names, text for numbers),
    before the data is loaded and anything is built: a typo fails in a second, not after the data."""
    model = drop_inherited(cfg.model, "model", overrides, only_written=True, quiet=True)  # build() logs it
    check_arguments(target_of(model, "model"), {str(k): v for k, v in model.items() if not str(k).startswith("_")
                                                and v != "auto"}, "model")
    optim = drop_inherited(cfg.optim, "optim", overrides, quiet=True)
    check_arguments(target_of(optim, "optim"), {str(k): v for k, v in optim.items() if not str(k).startswith("_")},
                    "optim", ["params"])


def logged_metrics(task: Task) -> list[str]:
    """The metrics the task logs for every rank alike: ``val/<name>`` and ``train/<name>``."""
    names = task.finish(dict.fromkeys(task.metric_names, 1.0))
    return [f"{split}/{name}" for split in ("val", "train") for name in names]


def stop_goal(cfg: DictConfig, task: Task) -> Reach | None:
    """``trainer.stop_when`` as a target on a ``train/`` or ``val/`` metric of the task: values every rank has
    the same of (summed over the ranks), so that every rank stops at the same step."""
    if not cfg.trainer.stop_when:
        return None
    goal = Reach.parse(cfg.trainer.stop_when, "trainer.stop_when")
    logged = logged_metrics(task)
    if goal.metric not in logged:
        raise ConfigError(f"{goal.metric!r} is not a metric of this task.{did_you_mean(goal.metric, logged)} A run "
                          f"can stop on what the task logs for every rank alike: {', '.join(logged)}.",
                          key="trainer.stop_when")
    return goal


def build_optimizer(cfg: DictConfig, model: torch.nn.Module, overrides: list[str] | None = None
                    ) -> torch.optim.Optimizer:
    node = drop_inherited(cfg.optim, "optim", overrides)
    if node.get("_partial_"):
        optimizer = instantiate(node, "optim", later=("params",))(params=model.parameters())
    else:
        optimizer = instantiate(node, "optim", params=model.parameters())
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"{cfg.optim._target_} did not give a torch optimizer (got {type(optimizer).__name__}). "
                          "Use a torch.optim class with _partial_: true (the trainer passes params).", key="optim")
    return optimizer


def build_scheduler(cfg: DictConfig, optimizer: torch.optim.Optimizer, total_steps: int,
                    overrides: list[str] | None = None) -> Any:
    node = cfg.get("scheduler")
    if node is None or node.get("_target_") is None:
        if keys := [str(k) for k in node or {} if k != "_target_"]:
            raise ConfigError(f"a constant learning rate (scheduler=none) takes no keys, got {', '.join(keys)}. "
                              "Pick a schedule first (scheduler=constant, cosine or step), or drop the key.",
                              key=f"scheduler.{keys[0]}")
        return None
    node = drop_inherited(node, "scheduler", overrides)
    fn = unpartial(target_of(node, "scheduler"))
    params, any_kw = parameters_of(fn)
    given = {"optimizer": optimizer}
    if "total_steps" in params or any_kw:
        given["total_steps"] = total_steps
    return instantiate(node, "scheduler", **given)


def model_context(model: torch.nn.Module) -> tuple[str, int] | None:
    """The longest sequence the model takes and its config key: the package GPT's ``block_size``, a transformers
    model's ``n_positions`` or ``max_position_embeddings``; None when the model does not say."""
    if isinstance(getattr(model, "block_size", None), int):
        return "model.block_size", model.block_size
    config = getattr(model, "config", None)
    for name in ("n_positions", "max_position_embeddings"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return f"model.config.{name}", value
    return None


def check_context(model: torch.nn.Module, length: int | None) -> None:
    """Sequences longer than the model's context fail deep in its forward (a position embedding out of range):
    refused before training, naming both keys."""
    found = model_context(model) if isinstance(length, int) else None
    if found is not None and length > found[1]:
        key, context = found
        raise ConfigError(f"the data's windows have {length} tokens, more than the model takes ({key}={context}). "
                          f"Give data.block_size={context} or less, or the model a longer context ({key}={length}).",
                          key="data.block_size")


def build(cfg: DictConfig, ranks: Dist, device: torch.device, overrides: list[str] | None = None) -> Parts:
    """Seed, then build data, model, task, optimizer and schedule on ``device``."""
    typed(TrainerConfig, cfg.trainer, lambda name: f"trainer.{name}")  # its checks, before anything is built
    seed_everything(cfg.seed, cfg.repro.deterministic)
    set_threads(cfg.trainer.num_threads)
    task = build_task(cfg, overrides)
    goal = stop_goal(cfg, task)
    loaders = make_loaders(cfg.data, cfg.seed, ranks, device, overrides)
    model_cfg = fill_auto(drop_inherited(cfg.model, "model", overrides, only_written=True), loaders.info, "model",
                          derived_from_examples(loaders, task))
    model = instantiate(model_cfg, "model")
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"{model_cfg._target_} built a {type(model).__name__}, not a torch.nn.Module.", key="model")
    check_context(model, loaders.info.get("block_size"))
    if ranks.sharded:  # FSDP replaces the parameters by their shards: before the optimizer (and the hooks) take them
        model = shard(model, cfg.trainer, ranks, device, DTYPES.get(cfg.trainer.precision))
    else:
        model = model.to(device)
    optimizer = build_optimizer(cfg, model, overrides)
    accumulate = cfg.trainer.accumulate
    total_steps, limit = loaders.total_steps(cfg.trainer.epochs, cfg.trainer.max_steps, accumulate)
    scheduler = build_scheduler(cfg, optimizer, total_steps, overrides)
    return Parts(model, optimizer, scheduler, task, loaders, OmegaConf.to_container(model_cfg),  # type: ignore[arg-type]
                 device, ranks, total_steps, accumulate, limit, goal)

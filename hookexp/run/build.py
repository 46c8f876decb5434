"""Everything a run builds from its config before the first step: seed, device, data, model, task,
optimizer and schedule, each from a ``_target_`` node, with errors that name the config key.

:func:`instantiate` checks a node against its target's signature before calling it (an unknown key gets
a did-you-mean, a number given as text is refused) and turns what the constructor raises into one
paragraph naming ``<group>.<key>``: ``optim.lr: Invalid learning rate: -1`` rather than torch's traceback.
A model key whose value is ``auto`` is taken from what the data says (``Splits.info``: vocab_size,
num_classes, ...), so model configs do not repeat the data's shape.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import random
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from hydra.utils import get_object
from hydra.utils import instantiate as hydra_instantiate
from omegaconf import DictConfig, OmegaConf

from hookexp.errors import ConfigError, did_you_mean
from hookexp.goals import Reach
from hookexp.run.distributed import Dist, shard
from hookexp.run.loaders import Loaders, make_loaders
from hookexp.tasks import Classification, Task

log = logging.getLogger("hookexp.build")

# torch's optimizer messages name their argument in words: which config key they are about
_MESSAGE_KEYS = {"learning rate": "lr", "beta parameter": "betas", "epsilon": "eps", "momentum": "momentum",
                 "weight_decay": "weight_decay", "dampening": "dampening"}


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
    except RuntimeError as e:
        raise ConfigError(f"{e}. Use auto, cpu, cuda, cuda:N or mps.", key="trainer.device") from None
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
    if num_threads is not None:
        if num_threads < 1:
            raise ConfigError(f"must be at least 1 (or null for torch's default), got {num_threads}.",
                              key="trainer.num_threads")
        torch.set_num_threads(num_threads)


# ----------------------------------------------------------------------------------------------------
# Instantiating config nodes with errors that name the key.


def _target(node: Mapping[str, Any], key: str) -> Callable[..., Any]:
    path = node.get("_target_")
    if not isinstance(path, str) or not path:
        raise ConfigError(f"needs a '_target_': the dotted path of a class or function to build, e.g. "
                          f"{key}._target_=my_pkg.MyThing.", key=key)
    try:
        return get_object(path)
    except Exception as e:
        cause = e.__cause__ or e
        raise ConfigError(f"cannot import {path!r} ({type(cause).__name__}: {str(cause).splitlines()[0]}). Give the "
                          "full dotted path of something importable; your own modules are found from the current "
                          "directory or PYTHONPATH.", key=f"{key}._target_") from None


def _parameters(fn: Callable[..., Any]) -> tuple[dict[str, inspect.Parameter], bool]:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}, True
    named = {n: p for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return named, any(p.kind is p.VAR_KEYWORD for p in params.values())


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_arguments(fn: Callable[..., Any], args: Mapping[str, Any], key: str, given: Iterable[str] = ()) -> None:
    """Refuse keys ``fn`` does not take (did you mean) and text where its default is a number or a flag."""
    params, any_kw = _parameters(fn)
    names = [n for n in params if n not in given and n != "self"]
    for name, value in args.items():
        if name not in params:
            if not any_kw:
                raise ConfigError(f"{_name(fn)} has no parameter {name!r}.{did_you_mean(name, names)} Its parameters: "
                                  f"{', '.join(names) or 'none'}.", key=f"{key}.{name}")
            continue
        default = params[name].default
        if _is_number(default) and not _is_number(value) and value is not None:
            raise ConfigError(f"expected a number, got {value!r}.", key=f"{key}.{name}")
        if isinstance(default, bool) and not isinstance(value, bool) and value is not None:
            raise ConfigError(f"expected true or false, got {value!r}.", key=f"{key}.{name}")


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _blame(message: str, keys: Iterable[str]) -> str | None:
    """The argument an error message is about: one whose name it starts with or mentions."""
    text = message.lower()
    for words, name in _MESSAGE_KEYS.items():
        if words in text and name in keys:
            return name
    for name in sorted(keys, key=len, reverse=True):
        if re.search(rf"(^|[^\w.]){re.escape(name.lower())}([^\w]|$)", text):
            return name
    return None


def _refused(error: BaseException, fn: Callable[..., Any], args: Mapping[str, Any], key: str) -> ConfigError:
    """What a target raised, as one paragraph naming the argument it is about (or the group)."""
    cause = error.__cause__ if error.__cause__ is not None and type(error).__name__ == "InstantiationException" \
        else error
    if isinstance(cause, ConfigError):
        return cause
    text = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
    blamed = _blame(text, args)
    where = f"{key}.{blamed}" if blamed else key
    return ConfigError(f"{_name(fn)} refused its arguments: {type(cause).__name__}: {text}. Fix {where} "
                       "(print the config with --cfg job).", key=where)


class _Partial:
    """A ``_partial_`` node's result: called later (the optimizer with the model's parameters), it still names
    the config key when the target refuses its arguments."""

    def __init__(self, made: Callable[..., Any], fn: Callable[..., Any], args: Mapping[str, Any], key: str):
        self.made, self.fn, self.args, self.key = made, fn, args, key

    def __call__(self, *a: Any, **kw: Any) -> Any:
        try:
            return self.made(*a, **kw)
        except ConfigError:
            raise
        except Exception as e:
            raise _refused(e, self.fn, self.args, self.key) from None


def instantiate(node: DictConfig | Mapping[str, Any], key: str, *, later: Iterable[str] = (), **given: Any) -> Any:
    """Build ``node`` (a ``_target_`` mapping) with ``given`` added, naming ``key`` in every error: an unknown
    or ill-typed argument before the call, what the target raises after it (also when a ``_partial_`` result
    is called later, with the arguments named in ``later``)."""
    fn = _target(node, key)
    args = {str(k): v for k, v in node.items() if not str(k).startswith("_")}
    check_arguments(fn, args, key, [*given, *later])
    try:
        made = hydra_instantiate(node, **given)
    except ConfigError:
        raise
    except Exception as e:
        raise _refused(e, fn, args, key) from None
    return _Partial(made, fn, args, key) if node.get("_partial_", False) else made


def _unpartial(fn: Any) -> Any:
    while hasattr(fn, "func") and hasattr(fn, "keywords"):  # functools.partial
        fn = fn.func
    return fn


def fill_auto(node: DictConfig, info: Mapping[str, Any], key: str,
              derive: Mapping[str, Callable[[], tuple[Any, str]]] | None = None) -> DictConfig:
    """A copy of ``node`` with every ``auto`` value (also in nested mappings, e.g. ``model.config.vocab_size``)
    taken from the data's ``info``. ``derive``: for a name the data does not give, a function returning
    ``(value, how it was found)``, logged, or ``(None, why it cannot be known)``, called once and only when a value
    asks for it."""
    known = dict(info)
    why: dict[str, str] = {}

    def lookup(name: str, where: str) -> Any:
        if name not in known and name not in why and derive and name in derive:
            value, how = derive[name]()
            if value is None:
                why[name] = how
            else:
                known[name] = value
                log.info("%s.%s=auto: %s, %s", where, name, value, how)
        if name not in known:
            given = ", ".join(f"{k}={v}" for k, v in info.items() if not isinstance(v, (list, dict))) or "nothing"
            reason = f" {why[name]}" if why.get(name) else ""
            raise ConfigError(f"is 'auto', but the data does not say it (the data gives: {given}).{reason} "
                              f"Set it: {where}.{name}=<value>.", key=f"{where}.{name}")
        return known[name]

    def fill(values: dict[str, Any], where: str) -> None:
        for name, value in values.items():
            if isinstance(value, dict):
                fill(value, f"{where}.{name}")
            elif value == "auto":
                values[name] = lookup(name, where)

    values = OmegaConf.to_container(node, resolve=True)
    assert isinstance(values, dict)
    fill(values, key)
    return OmegaConf.create(values)


def derived_from_examples(loaders: Loaders, task: Task) -> dict[str, Callable[[], tuple[Any, str]]]:
    """What a model's ``auto`` sizes are when the data does not say them: read from a user's own map-style sets
    (``input_dim`` from one example's input; for classification, ``num_classes`` / ``output_dim`` from the labels)."""
    from hookexp.data import classes_in, input_size

    @functools.cache
    def classes() -> tuple[int | None, str]:
        found = classes_in(loaders.train, loaders.val)
        return (found, "the largest label of the training and validation sets + 1") if found is not None else (
            None, "Its labels cannot be read: the data set is iterable (it streams) or its examples carry no "
                  "integer class labels.")

    def inputs() -> tuple[int | None, str]:
        found = input_size(loaders.train)
        return (found, "the number of elements of one training example's input") if found is not None else (
            None, "One example's input cannot be read: the data set is iterable, or its examples are not "
                  "(input, label) pairs of tensors.")

    derive: dict[str, Callable[[], tuple[Any, str]]] = {"input_dim": inputs}
    if isinstance(task, Classification):
        derive.update(num_classes=classes, output_dim=classes)
    return derive


def drop_inherited(node: DictConfig, key: str, overrides: Iterable[str] | None) -> DictConfig:
    """When the command line replaced a node's ``_target_`` (``model._target_=mynet.Net``,
    ``data.dataset._target_=mynet.make``), keys the new target does not take that came from the group's config
    file are dropped (logged); keys the user set stay and are checked. Without a command line, nothing is dropped."""
    if overrides is None:
        return node
    set_here = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    if f"{key}._target_" not in set_here:
        return node
    fn = _unpartial(_target(node, key))
    params, any_kw = _parameters(fn)
    if any_kw:
        return node
    dropped = [k for k in node if not str(k).startswith("_") and k not in params and f"{key}.{k}" not in set_here]
    if not dropped:
        return node
    log.info("%s: %s does not take %s (from the default %s config): not passed", key, node.get("_target_"),
             ", ".join(map(str, dropped)), key)
    out = OmegaConf.create(OmegaConf.to_container(node, resolve=False))
    for k in dropped:
        del out[k]
    return out


# ----------------------------------------------------------------------------------------------------
# The parts of a run.


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


def build_task(cfg: DictConfig, overrides: list[str] | None = None) -> Task:
    task = instantiate(drop_inherited(cfg.task, "task", overrides), "task")
    if not isinstance(task, Task):
        raise ConfigError(f"{cfg.task._target_} built a {type(task).__name__}, not a hookexp.tasks.Task. Subclass "
                          "hookexp.tasks.Task (override loss, and sums/metric_names for more metrics).", key="task")
    return task


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
    fn = _unpartial(_target(node, "scheduler"))
    params, any_kw = _parameters(fn)
    given = {"optimizer": optimizer}
    if "total_steps" in params or any_kw:
        given["total_steps"] = total_steps
    return instantiate(node, "scheduler", **given)


def build(cfg: DictConfig, ranks: Dist, device: torch.device, overrides: list[str] | None = None) -> Parts:
    """Seed, then build data, model, task, optimizer and schedule on ``device``."""
    seed_everything(cfg.seed, cfg.repro.deterministic)
    set_threads(cfg.trainer.num_threads)
    task = build_task(cfg, overrides)
    goal = stop_goal(cfg, task)
    loaders = make_loaders(cfg.data, cfg.seed, ranks, device, overrides)
    model_cfg = fill_auto(drop_inherited(cfg.model, "model", overrides), loaders.info, "model",
                          derived_from_examples(loaders, task))
    model = instantiate(model_cfg, "model")
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"{model_cfg._target_} built a {type(model).__name__}, not a torch.nn.Module.", key="model")
    if ranks.sharded:  # FSDP replaces the parameters by their shards: before the optimizer (and the hooks) take them
        model = shard(model, cfg.trainer, ranks, device, MixedPrecision.DTYPES.get(cfg.trainer.precision))
    else:
        model = model.to(device)
    optimizer = build_optimizer(cfg, model, overrides)
    accumulate = cfg.trainer.accumulate
    if accumulate < 1:
        raise ConfigError(f"must be at least 1, got {accumulate}.", key="trainer.accumulate")
    total_steps, limit = loaders.total_steps(cfg.trainer.epochs, cfg.trainer.max_steps, accumulate)
    scheduler = build_scheduler(cfg, optimizer, total_steps, overrides)
    return Parts(model, optimizer, scheduler, task, loaders, OmegaConf.to_container(model_cfg),  # type: ignore[arg-type]
                 device, ranks, total_steps, accumulate, limit, goal)


class MixedPrecision:
    """``trainer.precision``: autocast in bf16 or fp16; fp16 scales the loss with a GradScaler and unscales the
    gradients before ``optimizer.step()``, so that ``pre_step`` hooks, the guard and the statistics see true
    gradients. ``grad``-kind hooks run inside backward and see scaled ones: a value-dependent transform there gets
    a warning naming ``pre_step``. The scaler's state (its scale) is part of a checkpoint."""

    DTYPES: ClassVar[dict[str, torch.dtype | None]] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}

    def __init__(self, precision: str, device: torch.device, hooks: Any):
        if precision not in self.DTYPES:
            raise ConfigError(f"unknown precision {precision!r}.{did_you_mean(str(precision), self.DTYPES)} Use fp32, "
                              "bf16 or fp16.", key="trainer.precision")
        self.device_type = device.type
        self.dtype = self.DTYPES[precision]
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        if self.scaler is not None:
            for b in hooks.bindings:
                if b.kind.stage == "backward" and b.transform.value_dependent and b.spec.enabled:
                    log.warning("hooks.%s: with trainer.precision=fp16 the gradients a %r hook sees are multiplied by "
                                "the GradScaler's scale, so %r acts on scaled values. Use kind 'pre_step' to act on "
                                "the unscaled gradient.", b.spec.name, b.spec.kind, b.transform.name)

    def autocast(self) -> Any:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)  # skips the update (and the hooks' step) when gradients overflowed
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])

"""The structured-config schema of ``conf/``: Hydra checks every override against it at compose time.

``conf/config.yaml`` lists ``hookexp_schema`` first in its defaults, so the composed config is typed:
``trainer.epoch=3`` (a misspelled key) or ``trainer.epochs=abc`` (a wrong type) fail before anything
runs, with Hydra's message naming the key. Every default, and what it means, is written once: in the
dataclasses below (their field comments are the documentation), each value check beside its field
(``__post_init__``; :func:`typed` builds a checked group from a node); a yaml option holds only what it changes.
``model``, ``optim`` and ``data.dataset`` are ``_target_`` mappings for ``hydra.utils.instantiate``; their
arguments are checked when instantiated, and a wrong one is reported by :mod:`hookexp.run.instantiate` with the
constructor's real parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, make_dataclass
from typing import Any, Optional, TypeVar

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from hookexp.engine.schema import config_fields, help_list
from hookexp.errors import ConfigError, did_you_mean

# -- hook specs (engine): every field and default comes from hookexp.engine.schema.HookSpec, written once there.
HookSpecConfig = make_dataclass("HookSpecConfig", config_fields(MISSING))
HookSpecConfig.__doc__ = """Every field of a hook spec with its default, derived from hookexp.engine.schema.HookSpec.

Hook files inherit it (``- /hook_spec@<name>`` in their defaults list), so every field of a shipped spec
can be overridden (``hooks.clamp_conv.every=5``) and is type-checked at compose time.
"""
if not OmegaConf.has_resolver("hookexp_help"):  # the kind and alias lists of `python -m hookexp --help`
    OmegaConf.register_new_resolver("hookexp_help", help_list)


def at_least(value: Any, least: int, key: str) -> None:
    """A whole number of at least ``least``, or a :class:`ConfigError` naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"must be a whole number of at least {least}, got {value!r}.", key=key)


@dataclass
class FsdpConfig:
    """``trainer.fsdp``: how ``trainer.strategy=fsdp`` shards the model (FSDP2, ``fully_shard``)."""

    # modules sharded as their own unit (target grammar: name, glob, re:, @alias); null: the root only
    wrap: Optional[str] = "@blocks"  # noqa: UP045
    # free each unit's gathered parameters after its forward (false: faster, more memory)
    reshard_after_forward: bool = True


@dataclass
class TrainerConfig:
    """``trainer``: how long and how a job trains. How long: ``epochs`` passes over the data (null: 10), or
    ``max_steps`` optimizer steps; an explicit max_steps lifts the default epoch limit (as transformers and
    Lightning do); both set: the first reached ends the run."""

    epochs: Optional[int] = None  # noqa: UP045 - passes over the data; null: 10, unless max_steps is set
    max_steps: Optional[int] = None  # noqa: UP045 - stop after this many optimizer steps (lifts the default epochs)
    accumulate: int = 1  # micro-batches per optimizer step (gradient accumulation; DDP syncs on the last one)
    # e.g. 1.0: clip the global gradient norm, after the pre_step hooks (logs grad/pre_clip_norm)
    clip_grad_norm: Optional[float] = None  # noqa: UP045
    eval_every: Optional[int] = None  # noqa: UP045 - also validate every N steps (validation always runs at the last step)
    eval_every_epochs: int = 1  # validate at the end of every N-th epoch; 0: only every eval_every steps and at the end
    # e.g. val/acc=0.95 or val/loss<=0.1: stop once a logged metric reaches it (on the command line quote the
    # value: "trainer.stop_when='val/acc=0.95'")
    stop_when: Optional[str] = None  # noqa: UP045
    device: str = "auto"  # auto (cuda if available, else mps, else cpu) | cpu | cuda | cuda:N | mps
    # torch's intra-op CPU threads; null: one per core (docs/training.md, "CPU threads")
    num_threads: Optional[int] = 1  # noqa: UP045
    progress: bool = True  # a tqdm progress bar on stderr
    save_records: bool = True  # `record` transforms: save what they kept to records/<spec>.pt
    precision: str = "fp32"  # fp32 | bf16 | fp16 (autocast; fp16 uses a GradScaler, unscaled before pre_step hooks)
    compile: bool = False  # torch.compile the model, after the hooks are attached (they keep working)
    compile_backend: str = "inductor"  # torch.compile's backend
    # steps between checkpoints (checkpoints/last.pt), and the last step; SIGTERM/SIGINT always save one
    checkpoint_every: Optional[int] = None  # noqa: UP045
    # auto: one process, or DDP under torchrun | ddp | fsdp (FSDP2: shard parameters, gradients and optimizer
    # state over the ranks; docs/scale.md, "Going past one machine")
    strategy: str = "auto"
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)

    def __post_init__(self) -> None:
        at_least(self.accumulate, 1, "trainer.accumulate")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ConfigError(f"must be a positive norm (or null: no clipping), got {self.clip_grad_norm}.",
                              key="trainer.clip_grad_norm")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"must be at least 1 (or null for torch's default), got {self.num_threads}.",
                              key="trainer.num_threads")


SPIKE_ACTIONS = ("log", "rollback")


@dataclass
class SpikeConfig:
    """``guard.spike``: the spike recorder (hookexp/telemetry/spike.py). Every step, ``metric`` is compared with the
    median of its last ``window`` steps; on a spike: log every step for ``steps`` steps, turn on the ``record``
    specs for them, save a checkpoint and write the steps and batches to spikes.jsonl."""

    metric: Optional[str] = None  # noqa: UP045 - e.g. train/loss or grad/global_norm; null: off
    window: int = 20  # steps of history the metric is compared with (judged from the 5th value on)
    threshold: float = 3.0  # a spike: the metric above threshold x the median of its window ...
    min_value: float = 0.0  # ... and above this
    steps: int = 10  # log every step for this many steps after a spike
    # hook specs with transform: record that act only in a spike's window
    record: list[str] = field(default_factory=list)
    checkpoint: bool = True  # save a checkpoint at each spike
    # log: record the spike and go on | rollback: restore the snapshot before its onset, skip its batches, go on
    # (guard.rollback; docs/rollback.md)
    action: str = "log"

    def __post_init__(self) -> None:
        at_least(self.window, 1, "guard.spike.window")
        at_least(self.steps, 1, "guard.spike.steps")
        if not self.threshold > 1:
            raise ConfigError(f"must be above 1 (a spike is the metric above threshold x its recent median), got "
                              f"{self.threshold!r}.", key="guard.spike.threshold")
        if self.action not in SPIKE_ACTIONS:
            raise ConfigError(f"unknown action {self.action!r}.{did_you_mean(str(self.action), SPIKE_ACTIONS)} Use one "
                              f"of: {', '.join(SPIKE_ACTIONS)} (rollback: restore the snapshot before the spike, skip "
                              "its batches and go on).", key="guard.spike.action")


@dataclass
class ForensicsConfig:
    """``guard.forensics``: which layer went wrong first (hookexp/telemetry/forensics.py). On wherever the guard
    (nan_policy other than off) or the spike recorder is on: a ring buffer on the device keeps, every step, the
    norm of each module's output and input and of each parameter's gradient, optimizer state and weight (and update);
    a spike or a non-finite step ranks them by the step each left its own recent range."""

    window: int = 32  # steps kept (at least 4); 0: off
    z: float = 8.0  # the robust z-score of log(norm) against its earlier steps that counts as leaving the range
    top: int = 10  # targets listed in spikes.jsonl's "first"
    # also the update norms: costs one copy of the weights on the device (memory) and three passes over them a step
    updates: bool = False

    def __post_init__(self) -> None:
        if self.window != 0:
            at_least(self.window, 4, "guard.forensics.window")
        at_least(self.top, 1, "guard.forensics.top")
        if isinstance(self.z, bool) or not isinstance(self.z, (int, float)) or not self.z > 0:
            raise ConfigError(f"must be a positive z-score, got {self.z!r}.", key="guard.forensics.z")


@dataclass
class RollbackConfig:
    """``guard.rollback``: host-memory snapshots of the whole training state, and what a rollback skips
    (hookexp/run/rollback.py). Snapshots are taken while the spike recorder is on or ``nan_policy=rollback``;
    ``guard.spike.action=rollback`` / ``guard.nan_policy=rollback`` restore them."""

    every: int = 10  # steps between snapshots (a snapshot holds the state before that step)
    keep: int = 3  # snapshots kept in host memory (each: the model, the optimizer state and the rest, on the host)
    # batches skipped after a rollback: null: every batch from the restored snapshot to the event; N: N batches
    skip: Optional[int] = None  # noqa: UP045
    max: int = 5  # rollbacks in a run; one more event stops the run with an error naming the steps

    def __post_init__(self) -> None:
        for key, least in (("every", 1), ("keep", 1), ("max", 0)):
            at_least(getattr(self, key), least, f"guard.rollback.{key}")
        if self.skip is not None and (isinstance(self.skip, bool) or not isinstance(self.skip, int) or self.skip < 0):
            raise ConfigError(f"must be null (skip every batch from the restored snapshot to the event) or a whole "
                              f"number of batches of at least 0, got {self.skip!r}.", key="guard.rollback.skip")


@dataclass
class GuardConfig:
    """``guard``: what a NaN/Inf loss or gradient does, the spike recorder, and first-divergence forensics."""

    # raise (stop, naming the step, the parameters and the hooks touching them) | skip_step (skip that update) |
    # warn (go on) | off | rollback (restore the snapshot before it, skip its batches: guard.rollback). See
    # hookexp/telemetry/guard.py for what each costs.
    nan_policy: str = "raise"
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    forensics: ForensicsConfig = field(default_factory=ForensicsConfig)
    rollback: RollbackConfig = field(default_factory=RollbackConfig)


@dataclass
class StatsConfig:
    """``stats``: what the trainer logs on every ``every``-th step (and only then: no extra work on other steps)."""

    every: int = 10  # log period in optimizer steps: metrics, gradient statistics and hook effects
    grads: Optional[str] = "*"  # noqa: UP045 - parameters whose gradient statistics are logged (target grammar); null: none
    activations: Optional[str] = None  # noqa: UP045 - modules whose activation statistics are logged; null: none
    hist_bins: int = 0  # >0: also a histogram per parameter (and per module in `activations`)
    # a histogram counts at most this many elements of a tensor (a fixed uniform subset, counts scaled to the
    # tensor's size; min/max stay exact); null: all
    hist_sample: Optional[int] = 4096  # noqa: UP045
    params: Optional[str] = None  # noqa: UP045 - parameters whose weight norm is logged (param/<name>/norm); e.g. "*"
    # parameters whose update norm and update/weight ratio are logged (update/<name>/...)
    updates: Optional[str] = None  # noqa: UP045
    # parameters whose optimizer state norms are logged (opt/<name>/exp_avg_norm, ...: Adam's moments)
    optimizer: Optional[str] = None  # noqa: UP045
    # e.g. 're:^blocks\.\d+': also one norm per group of parameters ({grad,param,update}/group/<g>/norm)
    group_by: Optional[str] = None  # noqa: UP045
    # the gradient noise scale per group_by group and globally (gns/<group>/b_simple, gns/b_simple; McCandlish et
    # al. 2018, App. A.1), from the micro-batches: needs trainer.accumulate >= 2 or DDP ranks (docs/statistics.md)
    gns: bool = False
    gns_ema: float = 0.95  # the weight of the past in the moving averages of |G|^2 and tr(Sigma); 0: no smoothing
    # describe a log step's tensors with torch.compile's fused kernels (two or three reads of each element instead
    # of ~15 passes; a compile per dtype, dynamic sizes); null (auto): on CUDA unless repro.deterministic; true: also
    # on the CPU
    compile: Optional[bool] = None  # noqa: UP045

    def __post_init__(self) -> None:
        at_least(self.every, 1, "stats.every")
        ema = self.gns_ema
        if isinstance(ema, bool) or not isinstance(ema, (int, float)) or not 0 <= ema < 1:
            raise ConfigError(f"must be a number in [0, 1) (the weight of the past in the moving averages; 0: no "
                              f"smoothing), got {ema!r}.", key="stats.gns_ema")


@dataclass
class LoggerConfig:
    # the backend (hookexp.run.sinks.Sink): hookexp.run.sinks.WandbSink | hookexp.run.sinks.TensorBoardSink |
    # null (none); local files are always written. The keys below are W&B's; a backend gets those its constructor names.
    _target_: Optional[str] = "hookexp.run.sinks.WandbSink"  # noqa: UP045
    # offline needs no account and writes the run under the run directory (wandb/offline-run-*); `wandb sync`
    # uploads it later. online: log live. disabled: no W&B. WANDB_MODE in the environment wins over this.
    mode: str = "offline"  # offline | online | disabled
    project: str = "hookexp"
    entity: Optional[str] = None  # noqa: UP045
    group: Optional[str] = None  # noqa: UP045 - e.g. the study name, to group an ablation's runs
    job_type: str = "train"
    name: Optional[str] = None  # noqa: UP045 - null: W&B picks a name
    tags: list[str] = field(default_factory=list)  # the names of the enabled hooks are added
    init_timeout: float = 30.0  # seconds to reach the W&B server in online mode before logging offline
    quiet: bool = True  # W&B's quiet setting: no history and summary printed at the end of each run


@dataclass
class ReproConfig:
    deterministic: bool = False  # true: torch.use_deterministic_algorithms(True)


@dataclass
class HookexpConfig:
    """The whole config. Every default of every typed key is written here, once; the yaml files of ``conf/`` hold
    the group choices and only what an option changes (``python -m hookexp --cfg job`` prints the result)."""

    seed: int = 0  # seeds python, numpy and torch
    model: dict[str, Any] = MISSING
    task: dict[str, Any] = MISSING
    # the data options differ in their keys (path, p, root, ...): checked by hookexp.run.loaders.check_data_config
    data: dict[str, Any] = MISSING
    optim: dict[str, Any] = MISSING
    scheduler: Optional[dict[str, Any]] = None  # noqa: UP045
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    # Specs stay untyped here so that a new one can be added from the command line
    # (+hooks.name={target: fc1, kind: forward}); hookexp.engine checks every field of every spec,
    # before anything runs, with the key and the fix in the message.
    hooks: dict[str, Any] = field(default_factory=dict)
    stats: StatsConfig = field(default_factory=StatsConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    repro: ReproConfig = field(default_factory=ReproConfig)
    # true: continue this run directory's checkpoint (same hydra.run.dir); or a checkpoint / run dir path
    resume: Any = None
    # The sweep objective: the metric each job returns to the sweeper (Optuna), from its summary.json, negated
    # when lower is better (a name ending in loss, ppl, perplexity or mse: hookexp.goals), so that a sweeper
    # always maximizes. null: val/acc when the task logs it, else val/loss. A name the task does not log is
    # refused before the job trains, e.g. optimized_metric=val/loss or optimized_metric=val/acc_best.
    optimized_metric: Optional[str] = None  # noqa: UP045


Typed = TypeVar("Typed")


def typed(cls: type[Typed], node: Any, key: Callable[[str], str]) -> Typed:
    """``node`` (a config node, a mapping or None) as the dataclass ``cls``, its checks run: a missing key takes
    its default, an unknown one is refused with a did-you-mean (``key`` names a field in errors), and a field that
    is itself a config dataclass is built the same way."""
    if isinstance(node, cls):
        return node
    values = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for name in values:
        if name not in fields:
            raise ConfigError(f"unknown setting.{did_you_mean(name, fields)} The settings are: {', '.join(fields)}.",
                              key=key(str(name)))
    for name, f in fields.items():
        inner = f.default_factory  # type: ignore[misc]
        if name in values and dataclasses.is_dataclass(inner) and isinstance(values[name], (Mapping, DictConfig)):
            values[name] = typed(inner, values[name], lambda sub, name=name: key(f"{name}.{sub}"))
    return cls(**values)


# Keys that may be added on the command line with `+key=value` (they are not part of the schema).
EXTRA_KEYS = {
    "dry_run": "validate the hooks on one batch, print the table, and exit without training",
    "ablate": "disable one hook spec by name (none: keep all, all: disable all), for leave-one-out studies",
    "overwrite": "start a fresh run in a run directory that holds an earlier run's results (they are deleted)",
}
# Typed groups: a key added to them with +group.key=value must be one of their fields.
TYPED_GROUPS = {"trainer": TrainerConfig, "stats": StatsConfig, "logger": LoggerConfig, "repro": ReproConfig,
                "guard": GuardConfig}


def register_configs() -> None:
    store = ConfigStore.instance()
    store.store(name="hookexp_schema", node=HookexpConfig)
    store.store(name="hook_spec", node=HookSpecConfig)

"""The structured-config schema of ``conf/``: Hydra checks every override against it at compose time.

``conf/config.yaml`` lists ``hookexp_schema`` first in its defaults, so the composed config is typed:
``trainer.epoch=3`` (a misspelled key) or ``trainer.epochs=abc`` (a wrong type) fail before anything
runs, with Hydra's message naming the key. ``model``, ``optim`` and ``data.dataset`` are ``_target_``
mappings for ``hydra.utils.instantiate``; their arguments are checked when instantiated, and a wrong
one is reported by :func:`hookexp.run.build.instantiate` with the constructor's real parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from hookexp.engine.schema import config_fields, help_list

# -- hook specs (engine): every field and default comes from hookexp.engine.schema.HookSpec, written once there.
HookSpecConfig = make_dataclass("HookSpecConfig", config_fields(MISSING))
HookSpecConfig.__doc__ = """Every field of a hook spec with its default, derived from hookexp.engine.schema.HookSpec.

Hook files inherit it (``- /hook_spec@<name>`` in their defaults list), so every field of a shipped spec
can be overridden (``hooks.clamp_conv.every=5``) and is type-checked at compose time.
"""
if not OmegaConf.has_resolver("hookexp_help"):  # the kind and alias lists of `python -m hookexp --help`
    OmegaConf.register_new_resolver("hookexp_help", help_list)


@dataclass
class FsdpConfig:
    """``trainer.fsdp``: how ``trainer.strategy=fsdp`` shards the model (FSDP2, ``fully_shard``)."""

    wrap: Optional[str] = "@blocks"  # noqa: UP045 - modules sharded as their own unit (target grammar); null: root only
    reshard_after_forward: bool = True  # free each unit's gathered parameters after its forward (less memory)


@dataclass
class TrainerConfig:
    epochs: Optional[int] = None  # noqa: UP045 - passes over the data; null: 10, unless max_steps is set
    max_steps: Optional[int] = None  # noqa: UP045 - stop after this many optimizer steps (lifts the default epochs)
    accumulate: int = 1  # micro-batches per optimizer step (gradient accumulation; DDP syncs on the last)
    clip_grad_norm: Optional[float] = None  # noqa: UP045 - global gradient-norm clip, after the pre_step specs
    eval_every: Optional[int] = None  # noqa: UP045 - also validate every N steps (besides each epoch's end)
    eval_every_epochs: int = 1  # validate at the end of every N-th epoch; 0: only by eval_every and at the end
    stop_when: Optional[str] = None  # noqa: UP045 - e.g. val/acc=0.95: stop once a logged metric reaches it
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    num_threads: Optional[int] = 1  # noqa: UP045 - torch's intra-op CPU threads; null: torch's default
    progress: bool = True  # a tqdm progress bar on stderr
    save_records: bool = True  # write what `record` transforms kept to records/<spec>.pt
    precision: str = "fp32"  # fp32 | bf16 | fp16: autocast dtype; fp16 adds a GradScaler
    compile: bool = False  # torch.compile the model after the hooks are attached
    compile_backend: str = "inductor"
    checkpoint_every: Optional[int] = None  # noqa: UP045 - steps between checkpoints (and always on SIGTERM)
    strategy: str = "auto"  # auto | ddp | fsdp: auto is one process, or DDP under torchrun
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)


@dataclass
class SpikeConfig:
    """``guard.spike``: the spike recorder (hookexp.telemetry.spike)."""

    metric: Optional[str] = None  # noqa: UP045 - e.g. train/loss or grad/global_norm; null: off
    window: int = 20  # log steps of history the metric is compared with
    threshold: float = 3.0  # a spike: the metric above threshold x the median of its window
    min_value: float = 0.0  # ... and above this
    steps: int = 10  # after a spike: log every step for this many steps
    record: list[str] = field(default_factory=list)  # record specs that act only in a spike's window
    checkpoint: bool = True  # save a checkpoint at each spike


@dataclass
class GuardConfig:
    nan_policy: str = "raise"  # raise | skip_step | warn | off: what a NaN/Inf loss or gradient does
    spike: SpikeConfig = field(default_factory=SpikeConfig)


@dataclass
class StatsConfig:
    every: int = 10  # log step period: metrics, gradient statistics and hook effects
    grads: Optional[str] = "*"  # noqa: UP045 - parameters to describe (target grammar); null: none
    activations: Optional[str] = None  # noqa: UP045 - modules whose outputs to describe; null: none
    hist_bins: int = 0  # >0: a histogram per parameter (and per described module) on log steps
    hist_sample: Optional[int] = 4096  # noqa: UP045 - histograms count at most this many elements per tensor; null: all
    params: Optional[str] = None  # noqa: UP045 - parameters whose weight norm is logged; null: none
    updates: Optional[str] = None  # noqa: UP045 - parameters whose update norm and update/weight ratio are logged
    optimizer: Optional[str] = None  # noqa: UP045 - parameters whose optimizer state norms are logged (Adam's moments)
    group_by: Optional[str] = None  # noqa: UP045 - 're:^blocks\.\d+': also one norm per group of parameters


@dataclass
class LoggerConfig:
    # the backend (hookexp.sinks.Sink): hookexp.sinks.WandbSink | hookexp.sinks.TensorBoardSink | null (none);
    # local files are always written. The keys below are W&B's; a backend gets those its constructor names.
    _target_: Optional[str] = "hookexp.sinks.WandbSink"  # noqa: UP045
    mode: str = "offline"  # offline | online | disabled
    project: str = "hookexp"
    entity: Optional[str] = None  # noqa: UP045
    group: Optional[str] = None  # noqa: UP045
    job_type: str = "train"
    name: Optional[str] = None  # noqa: UP045
    tags: list[str] = field(default_factory=list)
    init_timeout: float = 30.0  # seconds to reach the W&B server in online mode before logging offline
    quiet: bool = True  # W&B's quiet setting: no history and summary printed at the end of each run


@dataclass
class ReproConfig:
    deterministic: bool = False


@dataclass
class HookexpConfig:
    seed: int = 0
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
    resume: Any = None  # true: continue from this run directory's checkpoint; or a checkpoint / run dir path


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

"""The structured-config schema of ``conf/``: Hydra checks every override against it at compose time.

``conf/config.yaml`` lists ``hookexp_schema`` first in its defaults, so the composed config is typed:
``trainer.epoch=3`` (a misspelled key) or ``trainer.epochs=abc`` (a wrong type) fail before anything
runs, with Hydra's message naming the key. Every default, and what it means, is written once: in the
dataclasses below (their field comments are the documentation); a yaml option holds only what it changes.
``model``, ``optim`` and ``data.dataset`` are ``_target_`` mappings for ``hydra.utils.instantiate``; their
arguments are checked when instantiated, and a wrong one is reported by :mod:`hookexp.run.instantiate` with the
constructor's real parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from hookexp.engine.schema import config_fields, help_list
from hookexp.telemetry.settings import ForensicsConfig, SpikeConfig

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


@dataclass
class GuardConfig:
    """``guard``: what a NaN/Inf loss or gradient does, the spike recorder, and first-divergence forensics."""

    # raise (stop, naming the step, the parameters and the hooks touching them) | skip_step (skip that update) |
    # warn (go on) | off. See hookexp/telemetry/guard.py for what each costs.
    nan_policy: str = "raise"
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    forensics: ForensicsConfig = field(default_factory=ForensicsConfig)


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

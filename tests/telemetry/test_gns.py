"""The gradient noise scale (stats.gns): one step against the paper's formulas written by hand from per-micro-batch
gradients, the moving averages, the same figures from the trainer, watch() and both callbacks, and the errors.
Under DDP: tests/run/test_distributed.py."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import pytest
import torch
from conftest import has_module, read_jsonl
from frameworks import capture_logger, hf_model, hf_trainer, lightning_module

import hookexp
from hookexp import ConfigError
from hookexp.config import StatsConfig
from hookexp.run import compose
from hookexp.run.build import build
from hookexp.run.distributed import Dist
from hookexp.run.loaders import to_device
from hookexp.run.loop import run_job as train
from hookexp.telemetry.gns import GradientNoiseScale
from hookexp.telemetry.observer import Observers

CPU = torch.device("cpu")
GROUP_BY = r"re:^fc\d"


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()


def micro_batches(k: int, b: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, 5, generator=gen, dtype=torch.float64), torch.randint(0, 3, (b,), generator=gen))
            for _ in range(k)]


def by_hand(model: torch.nn.Module, batches, groups: dict[str, list[str]]) -> dict[str, tuple[float, float]]:
    """(|G|^2, tr(Sigma)) of one step, per group: McCandlish et al. App. A.1 from each micro-batch's own gradient
    (a separate backward pass on a copy of the model) and their mean (the big batch's)."""
    model = copy.deepcopy(model)
    names = [n for n, _ in model.named_parameters()]
    grads = []
    for x, y in batches:
        g = torch.autograd.grad(torch.nn.functional.cross_entropy(model(x), y), list(model.parameters()))
        grads.append(dict(zip(names, g, strict=True)))
    k, b = len(batches), len(batches[0][0])
    b_small, b_big = b, k * b
    out = {}
    for group, members in groups.items():
        small = sum(sum(g[n].square().sum() for n in members) for g in grads).item() / k  # |G_small|^2, averaged
        big = sum(sum(g[n] for g in grads).div(k).square().sum() for n in members).item()  # |G_big|^2
        grad_sq = (b_big * big - b_small * small) / (b_big - b_small)
        trace = (small - big) / (1 / b_small - 1 / b_big)
        out[group] = (grad_sq, trace)
    return out


GROUPS = {"": ["0.weight", "0.bias", "2.weight", "2.bias"], "0": ["0.weight", "0.bias"], "2": ["2.weight", "2.bias"]}


def run_steps(model, steps: list[list], ema: float) -> list[dict]:
    """Train ``steps`` (each a list of micro-batches, losses divided by their number) with the noise scale as the
    trainer drives it (Observers with the optimizer's hooks); every step's read-back."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gns = GradientNoiseScale(model, StatsConfig(group_by=r"re:^\d", gns_ema=ema))
    observers = Observers({"gns": gns}, optimizer)
    rows = []
    for step, batches in enumerate(steps):
        observers.start(step, True)
        optimizer.zero_grad(set_to_none=True)
        for x, y in batches:
            (torch.nn.functional.cross_entropy(model(x), y) / len(batches)).backward()
        optimizer.step()
        rows.append(observers.read())
        observers.end(step)
    observers.close()
    return rows


def keys(group: str) -> str:
    return "gns" if not group else f"gns/{group}"


def test_one_step_is_the_papers_estimate_from_the_micro_batch_gradients():
    model = mlp()
    batches = micro_batches(k=4, b=8, seed=1)
    want = by_hand(model, batches, GROUPS)
    (got,) = run_steps(model, [batches], ema=0.0)
    assert sorted(got) == sorted(f"{keys(g)}/{s}" for g in GROUPS for s in ("b_simple", "grad_sq", "trace"))
    for group, (grad_sq, trace) in want.items():
        assert got[f"{keys(group)}/grad_sq"] == pytest.approx(grad_sq, rel=1e-10)
        assert got[f"{keys(group)}/trace"] == pytest.approx(trace, rel=1e-10)
        assert got[f"{keys(group)}/b_simple"] == pytest.approx(trace / grad_sq, rel=1e-10)
    assert want[""][0] == pytest.approx(want["0"][0] + want["2"][0])  # the groups add up to the whole


def test_numerator_and_denominator_are_averaged_separately_and_debiased():
    model = mlp()
    steps = [micro_batches(k=2, b=4, seed=s) for s in range(4)]
    got = run_steps(copy.deepcopy(model), steps, ema=0.8)
    # by hand: each step's estimate on the model as that step found it (SGD lr 0.1 on the mean gradient)
    hand_model, optimizer = copy.deepcopy(model), None
    optimizer = torch.optim.SGD(hand_model.parameters(), lr=0.1)
    estimates = []
    for batches in steps:
        estimates.append(by_hand(hand_model, batches, {"": GROUPS[""]})[""])
        optimizer.zero_grad()
        for x, y in batches:
            (torch.nn.functional.cross_entropy(hand_model(x), y) / len(batches)).backward()
        optimizer.step()
    for t in range(len(steps)):
        weights = [0.2 * 0.8 ** (t - s) for s in range(t + 1)]
        norm = 1 - 0.8 ** (t + 1)
        grad_sq = sum(w * e[0] for w, e in zip(weights, estimates, strict=False)) / norm
        trace = sum(w * e[1] for w, e in zip(weights, estimates, strict=False)) / norm
        assert got[t]["gns/grad_sq"] == pytest.approx(grad_sq, rel=1e-9)
        assert got[t]["gns/trace"] == pytest.approx(trace, rel=1e-9)
        assert got[t]["gns/b_simple"] == pytest.approx(trace / grad_sq, rel=1e-9)
    ratios = [e[1] / e[0] for e in estimates]
    assert got[-1]["gns/b_simple"] != pytest.approx(sum(ratios) / len(ratios), rel=1e-3)  # not a mean of ratios


def test_a_loop_without_small_batches_is_refused_naming_the_setting():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    (x, y), = micro_batches(k=1, b=4, seed=0)
    with hookexp.watch(model, optimizer, gns=True):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        with pytest.raises(ConfigError) as e:
            optimizer.step()
    assert str(e.value).startswith("watch(gns=...): the gradient noise scale needs two small batches or more per "
                                   "optimizer step, and this step had 1 backward pass(es) on 1 rank(s).")
    with pytest.raises(ConfigError, match=r"^watch\(gns_ema=...\): must be a number in \[0, 1\)"):
        hookexp.watch(model, optimizer, gns=True, gns_ema=1.0)


def test_the_trainer_refuses_stats_gns_without_accumulation_or_ranks(tmp_path: Path):
    with pytest.raises(ConfigError) as e:
        train(compose("logger=none", "trainer.progress=false", "trainer.max_steps=1", "stats.gns=true"), tmp_path / "r")
    assert str(e.value) == (
        "stats.gns: the gradient noise scale compares small batches with the big batch they make up, and this run has "
        "one batch per optimizer step (trainer.accumulate=1, one process). Set trainer.accumulate=2 or more (the same "
        "samples per step: divide data.batch_size by it), or train several DDP ranks under torchrun; or set "
        "stats.gns=false.")


def test_fsdp_is_refused_naming_the_strategy_that_works():

    from hookexp.telemetry.assemble import Wiring, check_noise_scale

    with pytest.raises(ConfigError) as e:
        check_noise_scale(StatsConfig(gns=True), Wiring(ranks=Dist(world_size=2, strategy="fsdp"), accumulate=4))
    assert str(e.value) == (
        "stats.gns: the gradient noise scale needs each rank's own micro-batch gradients, and FSDP2 never holds them "
        "(every micro-batch's gradient is reduce-scattered over the ranks at once). Train with trainer.strategy=ddp, "
        "or set stats.gns=false.")


# -- the same figures from the trainer, watch() and both callbacks ---------------------------------------------------
STEPS, ACCUMULATE = 4, 2
TRAINER = ["logger=none", "trainer.progress=false", f"trainer.max_steps={STEPS}", "stats.every=1",
           f"trainer.accumulate={ACCUMULATE}", "stats.gns=true", "stats.gns_ema=0.5", f"stats.group_by='{GROUP_BY}'",
           "stats.grads=null"]


@pytest.fixture(scope="module")
def trainer_rows(tmp_path_factory) -> dict[int, dict]:
    run = tmp_path_factory.mktemp("trainer") / "run"
    train(compose(*TRAINER), run)
    return {r["trainer/step"]: {k: v for k, v in r.items() if k.startswith("gns/")}
            for r in read_jsonl(run / "metrics.jsonl") if "train/loss" in r}


def the_same_model_and_micro_batches():
    parts = build(compose(*TRAINER), Dist(), CPU)
    batches = [to_device(b, CPU) for b in itertools.islice(parts.loaders.epoch(0), STEPS * ACCUMULATE)]
    return parts, batches


def assert_same(got: dict[int, dict], want: dict[int, dict]) -> None:
    assert sorted(got) == sorted(want) == list(range(STEPS))
    for step, row in want.items():
        assert sorted(row) == sorted(f"gns{g}/{s}" for g in ("", "/fc1", "/fc2") for s in ("b_simple", "grad_sq",
                                                                                         "trace"))
        for key, value in row.items():
            assert got[step][key] == pytest.approx(value, rel=1e-6), (step, key)


def test_a_resumed_run_goes_on_with_the_moving_averages_it_saved(trainer_rows, tmp_path: Path):
    from hookexp.run import train as run_train

    def cfg(steps: int):
        return compose(*TRAINER, f"trainer.max_steps={steps}", "trainer.checkpoint_every=2")

    run_train(cfg(2), tmp_path / "run")
    run_train(cfg(STEPS), tmp_path / "run", resume=True)
    rows = {r["trainer/step"]: {k: v for k, v in r.items() if k.startswith("gns/")}
            for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r}
    assert_same(rows, trainer_rows)  # steps 2 and 3 average in steps 0 and 1, as the uninterrupted run did


def test_the_loss_scale_is_divided_out_of_the_micro_batch_gradients():
    """fp16's GradScaler: the backward passes see the loss times the scale, the update the unscaled gradient."""
    model = mlp()
    batches = micro_batches(k=3, b=5, seed=2)
    want = by_hand(model, batches, {"": GROUPS[""]})[""]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scale = torch.tensor(1024.0, dtype=torch.float64)
    gns = GradientNoiseScale(model, StatsConfig(gns_ema=0.0), grad_scale=lambda: scale)
    observers = Observers({"gns": gns}, optimizer)
    observers.start(0, True)
    for x, y in batches:
        (torch.nn.functional.cross_entropy(model(x), y) / 3 * scale).backward()
    for p in model.parameters():  # the unscale before the update
        p.grad /= scale
    optimizer.step()
    got = observers.read()
    observers.close()
    assert got["gns/grad_sq"] == pytest.approx(want[0], rel=1e-10)
    assert got["gns/trace"] == pytest.approx(want[1], rel=1e-10)


def test_the_trainer_logs_the_estimate_of_its_micro_batches_by_hand(trainer_rows):
    parts, batches = the_same_model_and_micro_batches()
    model = parts.model.double()
    first = [(x.double(), y) for x, y in batches[:ACCUMULATE]]
    want = by_hand(model, first, {"": [n for n, _ in model.named_parameters()],
                                  "fc1": ["fc1.weight", "fc1.bias"], "fc2": ["fc2.weight", "fc2.bias"]})
    for group, (grad_sq, trace) in want.items():  # step 0: its own estimate (debiased: the weights cancel)
        assert trainer_rows[0][f"{keys(group)}/grad_sq"] == pytest.approx(grad_sq, rel=1e-4)
        assert trainer_rows[0][f"{keys(group)}/trace"] == pytest.approx(trace, rel=1e-4)
    assert trainer_rows[0]["gns/b_simple"] > 0


def test_watch_in_a_hand_loop_counts_the_backward_passes_and_logs_what_the_trainer_logs(trainer_rows):
    parts, batches = the_same_model_and_micro_batches()
    model, optimizer, task = parts.model, parts.optimizer, parts.task
    got: dict[int, dict] = {}
    with hookexp.watch(model, optimizer, every=1, grads=None, group_by=GROUP_BY, gns=True, gns_ema=0.5,
                       log=lambda metrics, step: got.__setitem__(step, metrics)):
        model.train()
        for step in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            for batch in batches[step * ACCUMULATE:(step + 1) * ACCUMULATE]:
                (task.loss(task.forward(model, batch), batch) / ACCUMULATE).backward()
            optimizer.step()
    assert_same(got, trainer_rows)
    assert not model._forward_pre_hooks and not model.fc1.weight._backward_hooks  # all removed


@pytest.mark.skipif(not has_module("lightning"), reason="needs the extra .[lightning]")
def test_the_lightning_callback_logs_what_the_trainer_logs(trainer_rows, tmp_path: Path):
    import lightning.pytorch as pl

    from hookexp.integrations.lightning import HookexpCallback

    parts, batches = the_same_model_and_micro_batches()
    net, task = parts.model, parts.task
    module = lightning_module(net, lambda m, batch: task.loss(task.forward(m, batch), batch),
                              lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.0))
    logger = capture_logger()
    stats = {"every": 1, "grads": None, "group_by": GROUP_BY, "gns": True, "gns_ema": 0.5}
    trainer = pl.Trainer(max_steps=STEPS, logger=logger, callbacks=[HookexpCallback(stats=stats)],
                         accumulate_grad_batches=ACCUMULATE, accelerator="cpu", devices=1, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    assert_same(logger.rows, trainer_rows)


@pytest.mark.skipif(not has_module("transformers") or not has_module("accelerate"), reason="needs the extra .[hf]")
def test_the_hf_callback_logs_what_the_trainer_logs(trainer_rows, tmp_path: Path):
    import transformers

    from hookexp.integrations.hf import HookexpCallback

    parts, batches = the_same_model_and_micro_batches()
    net, task, optimizer = parts.model, parts.task, parts.optimizer
    model = hf_model(net, lambda out, x, labels: task.loss(out, (x, labels)))
    got: dict[int, dict] = {}
    stats = {"every": 1, "grads": None, "group_by": GROUP_BY, "gns": True, "gns_ema": 0.5}
    callback = HookexpCallback(stats=stats, log=lambda metrics, step: got.__setitem__(step, metrics))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=STEPS, max_grad_norm=0.0,
                                          gradient_accumulation_steps=ACCUMULATE, lr_scheduler_type="constant",
                                          report_to=[], use_cpu=True, logging_strategy="no", save_strategy="no",
                                          disable_tqdm=True)
    hf_trainer(batches, model=model, args=args, optimizers=(optimizer, None), callbacks=[callback]).train()
    assert_same(got, trainer_rows)

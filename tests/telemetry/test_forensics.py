"""guard.forensics: the ring buffer holds the norms plain torch gives, and a spike or a non-finite step names the
target that left its range first (the producer) before those it spread to."""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import FORENSICS_ON, HELPERS, config, has_module, read_jsonl
from frameworks import hf_model, hf_trainer, lightning_module
from torch import nn

import hookexp
from hookexp.config import ForensicsConfig
from hookexp.errors import ConfigError, NonFiniteError
from hookexp.run.loop import run_job as train
from hookexp.telemetry.forensics import Forensics, Series, draw
from hookexp.telemetry.observer import Observers

AT = 30  # the step the anomaly is injected at
# the MLP has no normalisation: a module's output scaled x50 reaches the loss
RUN = [FORENSICS_ON, "model=mlp", "model.depth=4", "model.width=32", f"trainer.max_steps={AT + 3}", "stats.every=1",
       "guard.spike.metric=train/loss", "guard.spike.window=8", "guard.spike.threshold=2",
       "guard.spike.checkpoint=false"]


@pytest.fixture(autouse=True)
def user_transforms(monkeypatch):
    monkeypatch.syspath_prepend(str(HELPERS))


def at_step(target: str, kind: str, transform: str, **args) -> str:
    spec = f"{{target: {target}, kind: {kind}, transform: {transform}, args: {json.dumps(args)}, " \
           f"start_step: {AT}, end_step: {AT + 1}}}"
    return f"+hooks.boom={spec}".replace('"', "")


def the_spike(run_dir: Path) -> dict:
    (spike,) = read_jsonl(run_dir / "spikes.jsonl")
    return spike


@pytest.mark.parametrize("module", ["fc2", "fc3"])
def test_an_output_scaled_x50_puts_that_module_first(tmp_path: Path, module: str):
    summary = train(config(*RUN, at_step(module, "forward", "scale", factor=50.0)), tmp_path)
    spike = the_spike(tmp_path)
    assert spike["trainer/step"] == AT and summary["guard/spikes"] == 1
    first = spike["first"]
    assert first[0]["target"] == module and first[0]["family"] == "output" and first[0]["step"] == AT
    assert first[0]["input"] == "normal" and first[0]["score"] > 20  # the producer: its input is as before
    after = [e for e in first[1:] if e["family"] == "output"]
    assert after and all(e["step"] == AT and e["input"] == "abnormal" for e in after)  # propagators, downstream
    n = int(module[2:])
    assert {e["target"] for e in after} <= {f"relu{n}", *(f"{m}{k}" for m in ("fc", "relu") for k in range(n + 1, 5))}
    assert all(e["target"] not in ("fc1", "relu1", "flatten") for e in first)  # upstream stayed in range
    assert len(first) == 10 and len(spike["first"]) == 10  # guard.forensics.top
    assert (tmp_path / "forensics" / f"step_{AT}.png").stat().st_size > 10_000


def test_a_gradient_scaled_before_the_update_is_first_though_the_loss_spikes_a_step_later(tmp_path: Path):
    boom = at_step("fc2.weight", "pre_step", "scale", factor=1e4)
    summary = train(config(*RUN, "guard.forensics.updates=true", boom), tmp_path)
    spike = the_spike(tmp_path)
    assert spike["trainer/step"] == AT + 1 and summary["guard/spikes"] == 1  # the loss sees the update a step later
    first = spike["first"]
    # the scaled gradient first, then what it moved at the same step: its momentum, its update; then the weight and
    # the outputs of the next step's forward
    assert [(e["target"], e["family"], e["step"]) for e in first[:3]] == [
        ("fc2.weight", "grad", AT), ("fc2.weight", "momentum_buffer", AT), ("fc2.weight", "update", AT)]
    later = [e for e in first[3:]]
    assert all(e["step"] == AT + 1 or e["target"] == "fc2.weight" for e in later)
    assert not any(e["family"] == "output" and e["step"] == AT for e in first)  # step AT's forward was normal


def test_a_nan_made_inside_a_module_names_it_the_producer_and_the_next_a_propagator(tmp_path: Path):
    run = [*RUN[:-4], at_step("fc2", "forward", "add", value=float("nan")).replace("NaN", "nan")]
    with pytest.raises(NonFiniteError) as err:
        train(config(*run), tmp_path)
    message = str(err.value)
    assert f"First non-finite module output: fc2 at step {AT} (its input finite: it produced" in message
    assert "then relu2, fc3, relu3." in message
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["guard/first_nonfinite_module"] == "fc2" and summary["guard/first_nonfinite_step"] == AT
    assert summary["guard/first_nonfinite_inputs_finite"] is True
    assert (tmp_path / "forensics" / f"step_{AT}.png").exists()


def test_the_docs_recipe_names_fc2_first(tmp_path: Path):
    """docs/statistics.md's forensics command, run in full as a user pastes it."""
    from docblocks import DOCS, run, section, shell_blocks, user_env

    (block, *_) = shell_blocks(section(DOCS / "statistics.md", "Which layer went first: forensics"))
    (command,) = block.commands
    done = run(command, tmp_path, user_env(WANDB_MODE="disabled"))
    assert done.returncode == 0, done.stderr[-2000:]
    spike = the_spike(tmp_path / "runs" / "forensics_demo")
    assert [(e["target"], e["family"], e["step"], e.get("input")) for e in spike["first"][:3]] == [
        ("fc2", "output", 25, "normal"), ("relu2", "output", 25, "abnormal"), ("fc3", "output", 25, "abnormal")]
    assert spike["trainer/step"] == spike["onset"] == 25  # between log steps, at the default cadence
    assert (tmp_path / "runs" / "forensics_demo" / "forensics" / "step_25.png").exists()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_the_buffer_holds_what_plain_torch_gives():
    """Output and input RMS per module, gradient, Adam's moments, update and weight norms, step by step."""
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    forensics = Forensics(net, opt, ForensicsConfig(window=4, updates=True))
    observers = Observers({"forensics": forensics}, opt)
    xs = [torch.randn(5, 3) for _ in range(3)]
    want = []
    for step, x in enumerate(xs):
        observers.start(step, False)
        a = nn.functional.linear(x, net.a.weight, net.a.bias)  # not net.a(x): a second call would be recorded
        out = net(x)
        out.square().mean().backward()
        params = dict(net.named_parameters())
        grads = {n: p.grad.norm() for n, p in params.items()}
        before = {n: p.detach().clone() for n, p in params.items()}
        opt.step()
        rms = lambda t: t.norm() / math.sqrt(t.numel())  # noqa: E731
        row = {Series("a", "output"): rms(a), Series("b", "output"): rms(out)}
        row.update({Series(n, "grad"): g for n, g in grads.items()})
        for n, p in params.items():
            row[Series(n, "exp_avg")] = opt.state[p]["exp_avg"].norm()
            row[Series(n, "exp_avg_sq")] = opt.state[p]["exp_avg_sq"].norm()
            row[Series(n, "update")] = (before[n] - p.detach()).norm()
            row[Series(n, "weight")] = p.detach().norm()
        want.append((row, {"a": rms(x), "b": rms(torch.relu(a))}))
        opt.zero_grad()
        observers.end(step)
    assert forensics.layout[:2] == [Series("a", "output"), Series("b", "output")]
    # gradients in backward order: b's parameters first
    assert forensics.layout[2:6] == [Series(n, "grad") for n in ("b.weight", "b.bias", "a.weight", "a.bias")]
    steps, norms, ins = forensics.history()
    assert steps == [0, 1, 2]
    for k, (row, inputs) in enumerate(want):
        for j, target in enumerate(forensics.layout):
            torch.testing.assert_close(torch.tensor(norms[k, j], dtype=torch.float32), row[target].float())
        torch.testing.assert_close(torch.tensor(ins[k], dtype=torch.float32), torch.stack([inputs["a"], inputs["b"]]))
    observers.close()
    assert not net.a._forward_hooks and not net.b._forward_hooks


def test_the_ring_keeps_the_last_window_steps_and_validation_is_not_recorded():
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    forensics = Forensics(net, opt, ForensicsConfig(window=4))
    observers = Observers({"forensics": forensics}, opt)
    for step in range(7):
        observers.start(step, False)
        net(torch.randn(2, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            net(torch.full((2, 3), 1e6))  # an evaluation forward: not a training step, not recorded
        observers.end(step)
    steps, norms, _ = forensics.history()
    assert steps == [3, 4, 5, 6] and (norms[:, :2] < 1e3).all()
    observers.close()


def test_a_blip_before_the_cause_can_be_or_a_small_one_is_noise_not_the_onset():
    import numpy as np

    from hookexp.telemetry.forensics import _onset

    def onset(bad: str, since: int, far: str | None = None) -> int | None:
        return _onset(np.array([c == "x" for c in bad]), since, None if far is None else
                      np.array([c == "x" for c in far]))

    assert onset("-x----x", since=5) == 6  # the run that reaches the event
    assert onset("-xx-xx", since=4) == 4  # one normal step ends a run (an early-training trend is no part of it)
    assert onset("x----", since=3) is None  # a blip before the cause can be
    assert onset("-----", since=3) is None
    # a cause of a step or two whose effect lasts, from `since` on: its onset when it went far
    assert onset("-x----x", since=1) == 1
    assert onset("-x----x", since=1, far="-------") == 6  # a small blip is noise
    assert onset("--xx----", since=2, far="---x----") == 2


@pytest.mark.parametrize(("key", "value", "message"), [
    ("window", 2, "must be a whole number of at least 4, got 2"),
    ("top", 0, "must be a whole number of at least 1, got 0"),
    ("z", -1.0, "must be a positive z-score, got -1.0"),
])
def test_bad_settings_are_refused_naming_the_key(tmp_path: Path, key: str, value, message: str):
    with pytest.raises(ConfigError, match=f"guard.forensics.{key}") as err:
        train(config("trainer.max_steps=1", FORENSICS_ON, f"guard.forensics.{key}={value}"), tmp_path)
    assert message in str(err.value)


@pytest.mark.parametrize(("settings", "built"), [([], True), (["guard.forensics.window=0"], False),
                                                   (["guard.nan_policy=off"], False),
                                                   (["guard.nan_policy=off", "guard.spike.metric=train/loss"], True)])
def test_it_is_on_wherever_the_guard_or_the_spike_recorder_is(tmp_path: Path, monkeypatch, settings, built):
    import hookexp.telemetry.assemble as observers

    made = []
    monkeypatch.setattr(observers, "Forensics", lambda *a, **k: made.append(Forensics(*a, **k)) or made[-1])
    train(config("trainer.max_steps=2", FORENSICS_ON, *settings), tmp_path)  # the default window, then the settings
    assert bool(made) == built


def test_draw_writes_a_heatmap(tmp_path: Path):
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    forensics = Forensics(net, opt, ForensicsConfig(window=8))
    observers = Observers({"forensics": forensics}, opt)
    for step in range(8):
        observers.start(step, False)
        net(torch.randn(4, 3) * (100 if step == 7 else 1)).sum().backward()
        opt.step()
        opt.zero_grad()
        observers.end(step)
    report = forensics.report(7)
    assert report.first[0]["target"] == "a" and report.first[0]["input"] == "abnormal"  # the data itself jumped
    path = draw(report, tmp_path / "f" / "step_7.png")
    assert path.stat().st_size > 5_000
    observers.close()


# -- watch() and the callbacks ----------------------------------------------------------------------------------
LOOP_AT = 20
SCALE_FC2 = {"boom": {"target": "fc2", "kind": "forward", "transform": "scale", "args": {"factor": 50.0},
                      "start_step": LOOP_AT, "end_step": LOOP_AT + 1}}
GUARD = {"spike": {"metric": "grad/global_norm", "window": 8, "threshold": 2.0}}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(fc1=nn.Linear(8, 32), relu1=nn.ReLU(), fc2=nn.Linear(32, 32), relu2=nn.ReLU(),
                                     fc3=nn.Linear(32, 4)))


def batches(n: int = LOOP_AT + 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(n)]


def assert_fc2_first(spikes: list[dict]) -> None:
    (spike,) = spikes
    first = spike["first"]
    assert spike["trainer/step"] == LOOP_AT and spike["metric"] == "grad/global_norm"
    assert (first[0]["target"], first[0]["family"], first[0]["step"], first[0]["input"]) == \
        ("fc2", "output", LOOP_AT, "normal")
    assert first[1]["target"] == "relu2" and first[1]["input"] == "abnormal"


def test_watch_names_the_module_that_went_first(tmp_path: Path):
    import hookexp

    net = mlp()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    with hookexp.watch(net, opt, every=1, hooks=SCALE_FC2, spike=GUARD["spike"], forensics_dir=tmp_path) as w:
        for x, y in batches():
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
            opt.zero_grad()
        asked = w.report(LOOP_AT)
    assert_fc2_first(w.spikes)
    assert asked.first == w.spikes[0]["first"]  # by hand, the same answer
    assert (tmp_path / f"step_{LOOP_AT}.png").exists()
    assert not net.fc2._forward_hooks  # removed with the watch


def test_watch_refuses_an_unknown_forensics_key_and_report_without_forensics():
    import hookexp

    net = mlp()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    with pytest.raises(ConfigError, match=r"guard.forensics.windw: unknown setting. Did you mean 'window'\?"):
        hookexp.watch(net, opt, forensics={"windw": 8})
    with pytest.raises(ConfigError, match=r"grad/global_nrm"):
        hookexp.watch(net, opt, spike={"metric": "grad/global_nrm"})
    with hookexp.watch(net, opt) as w, pytest.raises(ConfigError, match=r"watch\(forensics=...\): forensics is off"):
        w.report()


@pytest.mark.skipif(not has_module("lightning"), reason="needs the extra .[lightning]")
def test_the_lightning_callback_names_the_module_that_went_first(tmp_path: Path):
    import lightning.pytorch as pl

    from hookexp.integrations.lightning import HookexpCallback

    net = mlp()
    module = lightning_module(net, lambda m, batch: nn.functional.cross_entropy(m(batch[0]), batch[1]),
                              lambda params: torch.optim.SGD(params, lr=0.05))
    callback = HookexpCallback(hooks=SCALE_FC2, stats={"every": 1}, guard=GUARD)
    trainer = pl.Trainer(max_steps=LOOP_AT + 3, logger=False, callbacks=[callback], accelerator="cpu", devices=1,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path))
    trainer.fit(module, torch.utils.data.DataLoader(batches(), batch_size=None))
    assert_fc2_first(callback.spikes)
    assert (tmp_path / "forensics" / f"step_{LOOP_AT}.png").exists()


@pytest.mark.skipif(not has_module("transformers") or not has_module("accelerate"), reason="needs the extra .[hf]")
def test_the_hf_callback_names_the_module_that_went_first(tmp_path: Path):
    import transformers

    from hookexp.integrations.hf import HookexpCallback

    net = mlp()
    model = hf_model(net, lambda out, x, labels: nn.functional.cross_entropy(out, labels))
    callback = HookexpCallback(hooks=SCALE_FC2, stats={"every": 1}, guard=GUARD, log=lambda m, s: None)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=LOOP_AT + 3, max_grad_norm=0.0,
                                          lr_scheduler_type="constant", report_to=[], use_cpu=True,
                                          logging_strategy="no", save_strategy="no", disable_tqdm=True)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    hf_trainer(batches(), model=model, args=args, optimizers=(optimizer, None), callbacks=[callback]).train()
    assert_fc2_first(callback.spikes)
    assert (tmp_path / "forensics" / f"step_{LOOP_AT}.png").exists()


def test_an_in_place_activation_gets_its_own_norm_not_its_inputs():
    """ReLU(inplace=True) overwrites fc's output: fc's norm is taken before it runs."""
    torch.manual_seed(0)
    net = nn.Sequential(OrderedDict(fc=nn.Linear(4, 8), relu=nn.ReLU(inplace=True), out=nn.Linear(8, 2)))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    forensics = Forensics(net, opt, ForensicsConfig(window=4))
    observers = Observers({"forensics": forensics}, opt)
    x = torch.randn(16, 4)
    observers.start(0, False)
    h = nn.functional.linear(x, net.fc.weight, net.fc.bias)
    net(x).sum().backward()
    opt.step()
    observers.end(0)
    _, norms, ins = forensics.history()
    rms = lambda t: float(t.norm() / math.sqrt(t.numel()))  # noqa: E731
    assert forensics.layout[:3] == [Series(m, "output") for m in ("fc", "relu", "out")]
    assert norms[0, :2].tolist() == pytest.approx([rms(h), rms(h.relu())], rel=1e-6)
    assert ins[0].tolist() == pytest.approx([rms(x), rms(h), rms(h.relu())], rel=1e-6)  # relu's input as it came
    observers.close()


def test_every_norm_list_is_one_dtype_and_dense_and_a_container_reuses_its_last_childs_norm(monkeypatch):
    """CUDA's ``_foreach_norm`` runs a few kernels for a list of one dtype of dense tensors and a kernel per tensor
    for any other list. A GPT under bf16 autocast mixes float32 (LayerNorm) and bf16 (Linear) outputs: forensics
    hands it one list per dtype. A module returning its last child's output (``blocks.0.mlp``) gets that norm."""
    from hookexp.workloads.models import GPT

    torch.manual_seed(0)
    net = GPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, d_model=16)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    forensics = Forensics(net, opt, ForensicsConfig(window=4))
    observers = Observers({"forensics": forensics}, opt)
    lists: list[list[tuple[torch.dtype, bool]]] = []
    real = torch._foreach_norm

    def spy(tensors, *args, **kwargs):
        lists.append([(t.dtype, t.is_contiguous()) for t in tensors])
        return real(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_norm", spy)
    outputs: dict[str, torch.Tensor] = {}
    keep = [net.get_submodule(n).register_forward_hook(lambda m, a, o, n=n: outputs.__setitem__(n, o.detach()))
            for n in ("blocks.0.mlp", "blocks.0.mlp.proj")]
    observers.start(0, False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = net(torch.randint(0, 32, (2, 8)))
    logits.float().square().mean().backward()
    opt.step()
    observers.end(0)
    assert all(len(set(kinds)) == 1 and kinds[0][1] for kinds in lists), lists  # one dtype, contiguous, per call
    assert {kinds[0][0] for kinds in lists} == {torch.float32, torch.bfloat16}  # the forward mixed both
    assert outputs["blocks.0.mlp"] is not None and torch.equal(outputs["blocks.0.mlp"], outputs["blocks.0.mlp.proj"])
    _, norms, _ = forensics.history()
    column = {s: j for j, s in enumerate(forensics.layout)}
    mlp, proj = column[Series("blocks.0.mlp", "output")], column[Series("blocks.0.mlp.proj", "output")]
    out = outputs["blocks.0.mlp.proj"].float()
    assert norms[0, mlp] == norms[0, proj] == pytest.approx(float(out.norm() / math.sqrt(out.numel())), rel=1e-5)
    for h in keep:
        h.remove()
    observers.close()


def test_nested_containers_each_hold_their_own_output_and_input_norms():
    """A stage returns its last block's output, which returns its last layer's: one norm serves the three, and each
    container's input column holds its own input's norm, not the norm taken last."""
    torch.manual_seed(0)
    block = nn.Sequential(OrderedDict(fc=nn.Linear(4, 6), act=nn.Tanh()))
    net = nn.Sequential(OrderedDict(stage=nn.Sequential(OrderedDict(block=block)), head=nn.Linear(6, 2)))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    forensics = Forensics(net, opt, ForensicsConfig(window=4))
    observers = Observers({"forensics": forensics}, opt)
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    names = ("stage", "stage.block", "stage.block.fc", "stage.block.act", "head")
    keep = [net.get_submodule(n).register_forward_hook(
        lambda m, a, o, n=n: seen.__setitem__(n, (a[0].detach().clone(), o.detach().clone()))) for n in names]
    x = torch.randn(8, 4) * 3
    observers.start(0, False)
    net(x).sum().backward()
    opt.step()
    observers.end(0)
    rms = lambda t: float(t.norm() / math.sqrt(t.numel()))  # noqa: E731
    assert rms(seen["stage"][0]) != pytest.approx(rms(seen["stage"][1]), rel=1e-2)  # input and output differ
    _, norms, ins = forensics.history()
    column = {s.name: j for j, s in enumerate(forensics.layout) if s.family == "output"}
    for name in names:
        inp, out = seen[name]
        assert norms[0, column[name]] == pytest.approx(rms(out), rel=1e-5), name
        assert ins[0, column[name]] == pytest.approx(rms(inp), rel=1e-5), name
    for h in keep:
        h.remove()
    observers.close()


# -- at the default cadence (stats.every=10): a cause between log steps -----------------------------------------
BETWEEN = 25  # between the log steps 20 and 30
GPT_TEXT = ["task=causal_lm", "model=gpt", "data=text_file", f"data.path={Path(__file__).parents[2] / 'benchmarks'}/"
            "corpus.txt", "data.block_size=16", "model.d_model=32", "model.n_head=2"]


def injected(target: str, kind: str, factor: float, steps: int) -> str:
    return f"+hooks.boom={{target: {target}, kind: {kind}, transform: scale, args: {{factor: {factor}}}, " \
           f"start_step: {BETWEEN}, end_step: {BETWEEN + steps}}}"


@pytest.mark.parametrize(("model", "target", "kind", "factor", "steps", "spiked", "first"), [
    (["model=small_cnn"], "conv1", "forward", 50, 2, BETWEEN, ("conv1", "output")),
    (["model=small_cnn"], "conv2", "forward", 50, 1, BETWEEN, ("conv2", "output")),
    (["model=small_cnn"], "fc1", "forward", 50, 2, BETWEEN, ("fc1", "output")),
    (["model=small_cnn"], "fc2", "forward", 50, 1, BETWEEN, ("fc2", "output")),
    # the gradient x50 moves the weight (and its momentum) at step 25; the loss spikes two steps later
    (["model=small_cnn"], "fc1.weight", "pre_step", 50, 1, BETWEEN + 2, ("fc1.weight", "grad")),
    (["model=mlp"], "fc1", "forward", 50, 2, BETWEEN, ("fc1", "output")),
    (["model=mlp"], "fc3", "forward", 50, 1, BETWEEN, ("fc3", "output")),
    (GPT_TEXT, "norm", "forward", 50, 2, BETWEEN, ("norm", "output")),
], ids=lambda v: v if isinstance(v, str) else None)
def test_a_cause_between_log_steps_at_the_default_cadence_is_first(tmp_path: Path, model, target, kind, factor,
                                                                     steps, spiked, first):
    """Defaults (stats.every=10, guard.spike.window=20): the spike is seen at its step, 5 steps before the next
    log step, and forensics names the injected layer first."""
    train(config(*model, FORENSICS_ON, "trainer.max_steps=32", "guard.spike.metric=train/loss",
                 injected(target, kind, factor, steps)), tmp_path)
    spike = the_spike(tmp_path)
    assert spike["trainer/step"] == spiked and spike["onset"] == BETWEEN
    assert (spike["first"][0]["target"], spike["first"][0]["family"], spike["first"][0]["step"]) == (*first, BETWEEN)
    logged = [r["trainer/step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert logged[:4] == [0, 10, 20, spiked + 1]  # then every step of the spike's window


def test_a_run_resumed_a_few_steps_before_a_spike_writes_the_uninterrupted_runs_row(tmp_path: Path):
    """The ring buffer and the steps since the last log step go into the checkpoint: stopped after step 21 and
    resumed, the run ranks the spike at step 25 against the steps before the stop and lists them in its row, as the
    uninterrupted run does (before: "first" was empty, the onset None, and step 21 was missing from "steps")."""
    stop = "+hooks.stop={target:'',kind:forward,transform:{_target_:user_transforms.signal_at,step:%d}}"
    common = ["model=mlp", FORENSICS_ON, "trainer.max_steps=27", "guard.spike.metric=train/loss",
              injected("fc3", "forward", 50, 1)]
    train(config(*common, stop % 10_000), tmp_path / "straight")
    assert train(config(*common, stop % 21), tmp_path / "cut")["status"] == "interrupted"
    assert train(config(*common, stop % 21, "resume=true"), tmp_path / "cut")["status"] == "finished"
    straight, resumed = (the_spike(tmp_path / name) for name in ("straight", "cut"))
    assert resumed == straight
    assert (straight["onset"], straight["first"][0]["target"]) == (BETWEEN, "fc3")
    assert [s["step"] for s in straight["steps"]] == list(range(21, BETWEEN + 2))


@pytest.mark.parametrize("target", ["blocks.0.attn.qkv", "blocks.1.mlp.fc"])
def test_watch_names_a_gpt_block_layer_scaled_for_a_step(target: str):
    """Inside a pre-norm GPT a x50 output moves the loss little (the layer norms): no spike, but forensics'
    ranking at that step names the layer, before its block and everything after it."""
    from hookexp.workloads.models import GPT

    torch.manual_seed(0)
    net = GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, d_model=32)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    hooks = {"boom": {"target": target, "kind": "forward", "transform": "scale", "args": {"factor": 50.0},
                      "start_step": BETWEEN, "end_step": BETWEEN + 1}}
    ids = torch.randint(0, 32, (BETWEEN + 1, 8, 17), generator=torch.Generator().manual_seed(1))
    with hookexp.watch(net, opt, hooks=hooks, forensics=True) as w:
        for x in ids:
            loss = nn.functional.cross_entropy(net(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
        report = w.report(BETWEEN)
    assert (report.first[0]["target"], report.first[0]["family"], report.first[0]["step"]) == (target, "output",
                                                                                                  BETWEEN)
    assert report.first[0]["input"] == "normal" and report.onset == BETWEEN


# -- cost and torch.compile ---------------------------------------------------------------------------------------
def detect_ops() -> Any:
    """benchmarks/detect_ops.py: its workloads (the small CNN, a 2-block GPT) and its op counter."""
    import importlib.util

    path = Path(__file__).parents[2] / "benchmarks" / "detect_ops.py"
    spec = importlib.util.spec_from_file_location("detect_ops", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.mark.parametrize("name", ["small_cnn", "gpt"])
def test_a_step_costs_a_few_aten_ops_whatever_the_number_of_modules(name: str):
    """benchmarks/detect_ops.py's counts (a hand SGD loop with and without each observer): forensics, the spike
    recorder (the gradients' norm) and the guard."""
    ops_per_step = detect_ops().ops_per_step

    base, _ = ops_per_step(name, "none")
    assert ops_per_step(name, "forensics")[0] - base <= 20
    assert ops_per_step(name, "spike")[0] - base <= 8
    assert ops_per_step(name, "guard")[0] - base <= 12


def compiled_buffers(name: str, compiled: bool) -> tuple[list[int], Any, dict, dict]:
    from torch._dynamo.utils import counters, guard_failures

    torch._dynamo.reset()
    counters.clear()
    guard_failures.clear()
    model, loss_of = detect_ops().workload(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    forensics = Forensics(model, opt, ForensicsConfig(window=4))
    observers = Observers({"forensics": forensics}, opt)
    run = torch.compile(model) if compiled else model
    for step in range(4):
        observers.start(step, False)
        loss_of(run).backward()
        opt.step()
        opt.zero_grad()
        observers.end(step)
    observers.close()
    return *forensics.history()[:2], dict(counters["graph_break"]), dict(guard_failures)


def test_under_compile_forensics_records_what_eager_does_with_no_graph_break_nor_recompile():
    """The hooks run inside the compiled graph (torch._dynamo's counters: no graph break, no guard failure)."""
    steps, eager, _, _ = compiled_buffers("small_cnn", False)
    steps_c, compiled, breaks, failures = compiled_buffers("small_cnn", True)
    assert breaks == {} and failures == {}
    assert steps_c == steps == [0, 1, 2, 3]
    np.testing.assert_allclose(compiled, eager, rtol=1e-5)


@pytest.mark.slow
def test_trainer_compile_with_forensics_and_spikes_breaks_no_graph_and_recompiles_for_torch_only(tmp_path: Path):
    """Past an epoch's end: dynamo recompiles for the smaller last batch and for validation's no_grad (torch's own
    guards, with forensics off alike), never for hookexp's hooks."""
    from torch._dynamo.utils import counters, guard_failures

    torch._dynamo.reset()
    counters.clear()
    guard_failures.clear()
    summary = train(config(FORENSICS_ON, "trainer.compile=true", "trainer.max_steps=30", "trainer.accumulate=2",
                           "guard.spike.metric=train/loss"), tmp_path)
    assert summary["status"] == "finished" and dict(counters["graph_break"]) == {}
    reasons = [str(r) for failures in guard_failures.values() for r in failures]
    assert reasons and all("grad_mode" in r or "tensor 'args[0]' size mismatch at index 0" in r for r in reasons)


def test_watch_at_its_default_cadence_sees_the_spike_at_its_step_between_log_steps(tmp_path: Path):
    """watch(every=10): the gradients' norm is judged every step, so the x50 at step 25 is the spike, named."""
    net = mlp()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    boom = {"boom": {**SCALE_FC2["boom"], "start_step": BETWEEN, "end_step": BETWEEN + 1}}
    logged: list[int] = []
    with hookexp.watch(net, opt, hooks=boom, spike={"metric": "grad/global_norm"}, forensics_dir=tmp_path,
                       log=lambda metrics, step: logged.append(step)) as w:
        for x, y in batches(BETWEEN + 4):
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
            opt.zero_grad()
    (spike,) = w.spikes
    assert spike["trainer/step"] == spike["onset"] == BETWEEN and spike["first"][0]["target"] == "fc2"
    assert logged == [0, 10, 20, BETWEEN + 1, BETWEEN + 2, BETWEEN + 3]  # every step after the spike
    assert (tmp_path / f"step_{BETWEEN}.png").exists()

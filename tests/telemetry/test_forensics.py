"""guard.forensics: the ring buffer holds the norms plain torch gives, and a spike or a non-finite step names the
target that left its range first (the producer) before those it spread to."""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from conftest import FORENSICS_ON, HELPERS, config, has_module, read_jsonl
from frameworks import hf_model, hf_trainer, lightning_module
from torch import nn

from hookexp.errors import ConfigError, NonFiniteError
from hookexp.run.loop import train
from hookexp.telemetry.forensics import Forensics, Target, draw
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
        ("fc2", "output", 30, "normal"), ("relu2", "output", 30, "abnormal"), ("fc3", "output", 30, "abnormal")]
    assert (tmp_path / "runs" / "forensics_demo" / "forensics" / "step_30.png").exists()


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
    forensics = Forensics(net, opt, window=4, updates=True)
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
        row = {Target("a", "output"): rms(a), Target("b", "output"): rms(out)}
        row.update({Target(n, "grad"): g for n, g in grads.items()})
        for n, p in params.items():
            row[Target(n, "exp_avg")] = opt.state[p]["exp_avg"].norm()
            row[Target(n, "exp_avg_sq")] = opt.state[p]["exp_avg_sq"].norm()
            row[Target(n, "update")] = (before[n] - p.detach()).norm()
            row[Target(n, "weight")] = p.detach().norm()
        want.append((row, {"a": rms(x), "b": rms(torch.relu(a))}))
        opt.zero_grad()
        observers.end(step)
    assert forensics.layout[:2] == [Target("a", "output"), Target("b", "output")]
    # gradients in backward order: b's parameters first
    assert forensics.layout[2:6] == [Target(n, "grad") for n in ("b.weight", "b.bias", "a.weight", "a.bias")]
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
    forensics = Forensics(net, opt, window=4)
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


def test_a_blip_long_before_the_event_is_noise_not_the_onset():
    from hookexp.telemetry.forensics import _onset

    assert _onset([False, True, False, False, False, False, True]) == 6
    assert _onset([False, True, True, False, True, True]) == 1  # one normal step inside a run keeps it one run
    assert _onset([True, False, False, True]) == 3  # two end it
    assert _onset([True, False, False, False, False]) is None
    assert _onset([False] * 5) is None


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
    import hookexp.run.observers as observers

    made = []
    monkeypatch.setattr(observers, "Forensics", lambda *a, **k: made.append(Forensics(*a, **k)) or made[-1])
    train(config("trainer.max_steps=2", FORENSICS_ON, *settings), tmp_path)  # the default window, then the settings
    assert bool(made) == built


def test_draw_writes_a_heatmap(tmp_path: Path):
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    forensics = Forensics(net, opt, window=8)
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
    """A tensor's norm is reused while it is unchanged; ReLU(inplace=True) changes it in place."""
    torch.manual_seed(0)
    net = nn.Sequential(OrderedDict(fc=nn.Linear(4, 8), relu=nn.ReLU(inplace=True), out=nn.Linear(8, 2)))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    forensics = Forensics(net, opt, window=4)
    observers = Observers({"forensics": forensics}, opt)
    x = torch.randn(16, 4)
    observers.start(0, False)
    h = nn.functional.linear(x, net.fc.weight, net.fc.bias)
    net(x).sum().backward()
    opt.step()
    observers.end(0)
    _, norms, ins = forensics.history()
    rms = lambda t: float(t.norm() / math.sqrt(t.numel()))  # noqa: E731
    assert forensics.layout[:3] == [Target(m, "output") for m in ("fc", "relu", "out")]
    assert norms[0, :2].tolist() == pytest.approx([rms(h), rms(h.relu())], rel=1e-6)
    assert ins[0].tolist() == pytest.approx([rms(x), rms(h.relu()), rms(h.relu())], rel=1e-6)
    observers.close()

"""hookexp.telemetry.probes against the same quantities computed by hand with plain torch: gradients, activations,
weights, updates and optimizer state over two SGD-momentum and two AdamW steps, group norms, and nothing on
steps that do not log."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from hookexp import ConfigError, TargetError
from hookexp.config import StatsConfig
from hookexp.telemetry.observer import Observers
from hookexp.telemetry.probes import Probes
from hookexp.telemetry.readback import read


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(6, 8), nn.Linear(8, 8)])
        self.act = nn.ReLU(inplace=True)  # the probe must see blocks.N's output before this changes it
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for block in self.blocks:
            x = self.act(block(x))
        return self.head(x)


def data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)


def reference(t: torch.Tensor) -> dict[str, float]:
    g = t.detach().double().reshape(-1)
    return {"norm": g.norm().item(), "mean": g.mean().item(), "std": g.std().item(), "min": g.min().item(),
            "max": g.max().item(), "frac_zero": (g == 0).double().mean().item(),
            "frac_neg": (g < 0).double().mean().item(), "abs_mean": g.abs().mean().item(),
            "kurtosis": ((g - g.mean()).pow(4).mean() / (g - g.mean()).square().mean().square()).item()}


def close(a: float, b: float, rel: float = 1e-9) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


def probes_on(model, opt, **settings):
    """Probes driven as the trainer and watch() drive them: by an Observers' optimizer hooks."""
    probes = Probes(model, opt, StatsConfig(**settings))
    return probes, Observers({"stats": probes}, opt)


def make(optim: str):
    torch.manual_seed(0)
    model = Net()
    if optim == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    return model, opt


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_every_family_equals_a_hand_computation_over_two_steps(optim: str):
    model, opt = make(optim)
    hand_model, hand_opt = copy.deepcopy(model), None
    hand_opt = (torch.optim.SGD(hand_model.parameters(), lr=0.1, momentum=0.9) if optim == "sgd"
                else torch.optim.AdamW(hand_model.parameters(), lr=0.01, weight_decay=0.1))
    probes, observers = probes_on(model, opt, grads="*", activations="blocks.?", params="*", updates="*",
                                  optimizer="*", group_by=r"re:^blocks\.\d+")
    states = ["momentum_buffer"] if optim == "sgd" else ["exp_avg", "exp_avg_sq"]
    for step in range(2):
        x, y = data(step)
        # by hand: forward hooks that copy the output, the gradients before the step, the update after it
        outs: dict[str, torch.Tensor] = {}
        handles = [hand_model.blocks[i].register_forward_hook(
            lambda m, a, out, i=i, outs=outs: outs.__setitem__(f"blocks.{i}", out.detach().clone()))
            for i in range(2)]
        nn.functional.cross_entropy(hand_model(x), y).backward()
        for h in handles:
            h.remove()
        grads = {n: p.grad.detach().clone() for n, p in hand_model.named_parameters()}
        before = {n: p.detach().clone() for n, p in hand_model.named_parameters()}
        hand_opt.step()
        hand_opt.zero_grad()

        probes.active = True
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        got = read([probes.pending()])
        probes.active = False

        for name, g in grads.items():
            for stat, want in reference(g).items():
                if stat in ("abs_mean", "kurtosis"):  # activations only
                    assert f"grad/{name}/{stat}" not in got
                else:
                    assert close(got[f"grad/{name}/{stat}"], want), (name, stat)
        assert close(got["grad/global_norm"], math.sqrt(sum(g.double().norm().item() ** 2 for g in grads.values())))
        for name, out in outs.items():
            want = reference(out)
            assert want["frac_zero"] < 0.2  # the output before the in-place ReLU, not after it
            for stat in ("mean", "std", "abs_mean", "kurtosis", "frac_zero"):
                assert close(got[f"act/{name}/{stat}"], want[stat]), (name, stat)
            assert f"act/{name}/norm" not in got
        # weights, updates and optimizer state: their norm alone, in their own dtype (float32: rel 1e-6)
        for name, p in hand_model.named_parameters():
            update = (p.detach() - before[name]).double().norm().item()
            assert close(got[f"param/{name}/norm"], p.detach().double().norm().item(), 1e-6), name
            assert close(got[f"update/{name}/norm"], update, 1e-6), name
            assert close(got[f"update/{name}/ratio"], update / before[name].double().norm().item(), 1e-6), name
            for state in states:
                want = hand_opt.state[p][state].double().norm().item()
                assert close(got[f"opt/{name}/{state}_norm"], want, 1e-6), (name, state)
        for i in range(2):
            members = [f"blocks.{i}.weight", f"blocks.{i}.bias"]
            assert close(got[f"grad/group/blocks.{i}/norm"],
                         math.sqrt(sum(grads[m].double().norm().item() ** 2 for m in members)))
            assert close(got[f"param/group/blocks.{i}/norm"],
                         math.sqrt(sum(dict(hand_model.named_parameters())[m].double().norm().item() ** 2
                                       for m in members)), 1e-6)
        assert not any("group/head" in k for k in got)  # head is in no group
    observers.close()


def test_nothing_is_kept_or_described_on_steps_that_do_not_log():
    model, opt = make("sgd")
    probes, _observers = probes_on(model, opt, grads="*", activations="blocks.?", updates="*")
    x, y = data()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert probes.pending()[0] is None and read([probes.pending()]) == {}
    probes.active = True
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    probes.active = False
    values, decode = probes.pending()
    got = decode(values.numpy())
    assert {k.split("/")[0] for k in got} == {"grad", "act", "update"}
    assert probes.pending()[0] is None  # each log step starts over


def test_removing_the_probes_removes_their_hooks():
    model, opt = make("sgd")
    probes, observers = probes_on(model, opt, grads="*", activations="blocks.?")
    observers.close()
    probes.active = True
    x, y = data()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert probes.pending()[0] is None
    assert not model.blocks[0]._forward_hooks and not opt._optimizer_step_pre_hooks


def test_histograms_only_for_gradients_and_activations():
    model, opt = make("sgd")
    probes, _observers = probes_on(model, opt, grads="head.*", activations="blocks.0", params="*", hist_bins=4)
    probes.active = True
    x, y = data()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    got = read([probes.pending()])
    assert sorted(k for k in got if k.endswith("/hist")) == ["act/blocks.0/hist", "grad/head.bias/hist",
                                                             "grad/head.weight/hist"]
    counts, edges = got["grad/head.weight/hist"]
    assert counts.sum() == 24 and len(edges) == 5


def test_bad_settings_name_their_key():
    model, opt = make("sgd")
    with pytest.raises(ConfigError, match=r"^stats\.group_by: expected a 're:' regular expression"):
        Probes(model, opt, StatsConfig(group_by="blocks.*"))
    with pytest.raises(ConfigError, match=r"^stats\.group_by: 're:\(' is not a valid regular expression"):
        Probes(model, opt, StatsConfig(group_by="re:("))
    with pytest.raises((ConfigError, TargetError), match=r"stats\.activations.*Did you mean 'blocks\.0'"):
        Probes(model, opt, StatsConfig(activations="block.0"))
    with pytest.raises((ConfigError, TargetError), match=r"stats\.updates"):
        Probes(model, opt, StatsConfig(updates="nothing_here"))
    with pytest.raises(ConfigError, match=r"^Probes\(optimizer=\.\.\.\): .*pass the optimizer"):
        Probes(model, None, StatsConfig(grads="*"))


def test_observers_hook_the_optimizer_only_for_observers_that_act_around_the_update():
    from hookexp.telemetry.observer import Observer

    model, opt = make("sgd")
    quiet = Observers({"nothing": Observer()}, opt)
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    _probes, observers = probes_on(model, opt, grads="*")
    assert len(opt._optimizer_step_pre_hooks) == 1 and len(opt._optimizer_step_post_hooks) == 1
    observers.close()
    quiet.close()
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_activation_statistics_under_torch_compile_equal_eager_and_break_no_graph(backend):
    """Attached before compiling, the activation probes are traced into the graph (the output reaches Python through
    an operator when the graph runs): no graph break, no recompile as log steps come and go, and the values equal
    the eager model's, bit for bit, also where an in-place ReLU changes the output right after."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    logged = []
    for compiled in (False, True):
        model, opt = make("sgd")
        probes, observers = probes_on(model, opt, grads="*", activations="blocks.?", hist_bins=4)
        torch._dynamo.reset()
        counters.clear()
        forward = torch.compile(model, backend=backend) if compiled else model
        x, y = data()
        got = []
        for log in (True, False, True):
            probes.active = log
            nn.functional.cross_entropy(forward(x), y).backward()
            opt.step()
            opt.zero_grad()
            got.append(read([probes.pending()]))
        observers.close()
        logged.append(got)
    assert sum(counters["graph_break"].values()) == 0 and counters["stats"]["unique_graphs"] == 1
    eager, compiled = logged
    assert compiled[1] == {} and "act/blocks.0/kurtosis" in compiled[0] and "act/blocks.1/hist" in compiled[2]
    assert repr(compiled) == repr(eager)  # histograms are arrays: compared by their printed values

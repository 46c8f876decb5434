"""Gradient and activation statistics against plain torch references on known tensors."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from hookexp.stats import GRAD_STATS, ActivationStats, GradStats, Packed, StepStats, _read, bin_edges


def reference(g: torch.Tensor) -> list[float]:
    g = g.float()
    std = g.std().item() if g.numel() > 1 else math.nan  # (torch warns, then gives NaN, for one element)
    return [g.norm().item(), g.mean().item(), std, g.min().item(), g.max().item(),
            (g == 0).float().mean().item(), (g < 0).float().mean().item()]


def model_with_grads(grads: dict[str, torch.Tensor], device: torch.device | str = "cpu") -> nn.Module:
    m = nn.Module()
    for name, g in grads.items():
        p = nn.Parameter(torch.zeros_like(g, device=device))
        p.grad = g.to(device, copy=True)
        m.register_parameter(name, p)
    return m


def close(a: float, b: float) -> bool:
    if math.isnan(b):
        return math.isnan(a)
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_stats_equal_torch_reference(dtype, device):
    torch.manual_seed(0)
    grads = {
        "w": torch.randn(64, 32).to(dtype),
        "zeros": torch.zeros(10).to(dtype),
        "relu_like": torch.randn(100).clamp(min=0).to(dtype),
        "single": torch.tensor([3.0]).to(dtype),
    }
    res = GradStats(model_with_grads(grads, device), "*", hist_bins=4).compute()
    assert res.names == list(grads)
    for name, row in zip(res.names, res.values, strict=True):
        for stat, got, want in zip(GRAD_STATS, row, reference(grads[name]), strict=True):
            assert close(got, want), (name, stat, got, want)
    total = torch.cat([g.float().reshape(-1) for g in grads.values()]).norm().item()
    assert math.isclose(res.global_norm, total, rel_tol=1e-5)
    metrics = res.metrics()
    assert metrics["grad/w/norm"] == res.values[0][0] and "grad/global_norm" in metrics
    assert [sum(h) for h in res.hist] == [64 * 32, 10, 100, 1]
    expected = torch.histc(grads["w"].float(), bins=4, min=res.hist_range[0][0], max=res.hist_range[0][1])
    assert res.hist[0] == expected.tolist()


def test_non_finite_grads_are_reported_not_hidden(device):
    grads = {"nan": torch.tensor([1.0, float("nan")]), "inf": torch.tensor([1.0, float("inf")])}
    res = GradStats(model_with_grads(grads, device), "*").compute()
    nan_row, inf_row = res.values
    assert math.isnan(nan_row[0]) and math.isnan(nan_row[1])
    assert inf_row[0] == math.inf and inf_row[4] == math.inf
    assert nan_row[5:] == inf_row[5:] == [0.0, 0.0]  # NaN is neither zero nor negative; Inf is not zero
    assert math.isnan(res.global_norm)


def test_a_tensor_without_a_finite_range_has_no_histogram(device):
    inf = float("inf")
    grads = {"nan": torch.tensor([1.0, float("nan")]), "inf": torch.tensor([1.0, inf]),
             "both_infs": torch.tensor([-inf, inf]), "all_inf": torch.tensor([inf, inf]),  # inf - inf in the edges
             "ok": torch.tensor([1.0, 3.0, 2.0])}
    stats = StepStats(model_with_grads(grads, device), "*", hist_bins=2)
    stats.capture_grads()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the ranges left out warn nothing either
        result = stats.finish()
        hists = {k: (c.tolist(), e.tolist()) for k, (c, e) in result.histograms().items()}
    assert hists == {"grad/ok/hist": ([1.0, 2.0], [1.0, 2.0, 3.0])}  # NaN/Inf: their min/max statistics say why


def test_bin_edges_are_equal_bins_from_min_to_max_exactly():
    import numpy as np

    lo, hi = np.array([-0.3, 2.0, 1e-8]), np.array([0.7, 2.0, 3e-8])
    edges = bin_edges(lo, hi, 4)
    assert edges.shape == (3, 5)
    assert (edges[:, 0] == [-0.3, 1.5, 1e-8]).all() and (edges[:, -1] == [0.7, 2.5, 3e-8]).all()
    for row, a, b in zip(edges, [-0.3, 1.5, 1e-8], [0.7, 2.5, 3e-8], strict=True):
        assert np.allclose(row, np.linspace(a, b, 5), rtol=1e-15, atol=0)  # one value: a unit-wide range around it


def test_pattern_and_missing_grads():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    m[0].weight.grad = torch.ones(2, 2)
    res = GradStats(m, "*.weight").compute()
    assert res.names == ["0.weight"]  # 1.weight has no grad yet: skipped
    assert GradStats(m, None).compute() is None


def test_a_pattern_that_matches_nothing_names_the_stats_key():
    from hookexp import ConfigError

    with pytest.raises(ConfigError) as e:
        GradStats(nn.Sequential(nn.Linear(2, 2)), "fc9.*")
    assert str(e.value).startswith("stats.grads: target 'fc9.*' matches no parameter of Sequential. Its parameters")
    assert "optional" not in str(e.value) and "kind" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^stats\.activations: target 'rleu\*' matches no module"):
        ActivationStats(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), "rleu*")


def test_activation_stats_only_while_begun(device):
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).to(device)
    acts = ActivationStats(m, "1")
    x = torch.randn(16, 4, device=device)
    m(x)
    assert acts.end() == {}
    acts.begin()
    out = m(x)
    got = acts.end()
    assert not m[1]._forward_hooks
    assert close(got["act/1/mean"], out.mean().item()) and close(got["act/1/std"], out.std().item())
    assert close(got["act/1/frac_zero"], (out == 0).float().mean().item())


def test_mean_and_std_stay_exact_when_the_mean_dominates(device):
    """Sums of squares in float32 would lose std entirely here; the shifted sums keep it."""
    torch.manual_seed(0)
    g = 1000 + 1e-3 * torch.randn(5000)
    (row,) = GradStats(model_with_grads({"g": g}, device), "*").compute().values
    want = g.double()
    assert math.isclose(row[1], want.mean().item(), rel_tol=1e-9)
    assert math.isclose(row[2], want.std().item(), rel_tol=1e-3)
    assert math.isclose(row[0], want.norm().item(), rel_tol=1e-6)


def test_histograms_sample_large_tensors_and_keep_small_ones_exact(device):
    torch.manual_seed(0)
    grads = {"big": torch.randn(10_000), "small": torch.randn(300)}
    exact = GradStats(model_with_grads(grads, device), "*", hist_bins=16).compute()
    sampled = GradStats(model_with_grads(grads, device), "*", hist_bins=16, hist_sample=1000).compute()
    assert sampled.values == exact.values  # only the histogram counts are sampled
    big, small = sampled.hist
    assert small == exact.hist[1] == torch.histc(grads["small"], 16, *exact.hist_range[1]).tolist()
    assert sum(big) == 10_000 and all(c % 10 == 0 for c in big)  # 1,000 of 10,000 counted, scaled by 10
    assert max(abs(a - b) for a, b in zip(big, exact.hist[0], strict=True)) < 0.03 * 10_000
    assert big != exact.hist[0]


def test_activation_stats_follow_shape_changes_and_see_the_output_before_inplace_ops(device):
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True)).to(device)
    acts = ActivationStats(m, "0", hist_bins=4)
    for batch in (16, 5, 16):
        x = torch.randn(batch, 4, device=device)
        acts.begin()
        m(x)
        got = acts.end()
        ref = m[0](x).detach()  # what the Linear returned, before the in-place ReLU overwrote it
        assert close(got["act/0/mean"], ref.mean().item()) and close(got["act/0/std"], ref.std().item())
        counts, lo, hi = acts.hists["0"]
        assert (lo, hi) == (ref.min().item(), ref.max().item())
        assert counts == torch.histc(ref.cpu(), 4, lo, hi).tolist()


def test_one_step_reads_gradients_activations_and_extra_values_in_one_transfer(device):
    m = nn.Sequential(nn.Linear(3, 2), nn.ReLU()).to(device)
    stats = StepStats(m, "*.weight", "1", hist_bins=2)
    stats.begin()
    out = m(torch.randn(8, 3, device=device))
    out.sum().backward()
    stats.capture_grads()
    read = stats.finish(torch.tensor([1.5, 2.5], device=device), None, torch.tensor([7], device=device), [0.25])
    assert read.extra == [[1.5, 2.5], [], [7.0], [0.25]] and type(read.extra[2][0]) is float
    assert read.grads.names == ["0.weight"] and read.grads.values[0] == pytest.approx(reference(m[0].weight.grad))
    assert read.activations["act/1/mean"] == pytest.approx(out.mean().item())
    assert sum(read.act_hists["1"][0]) == 16 and sum(read.grads.hist[0]) == 6
    assert read.metrics() == {**read.activations, **read.grads.metrics()}
    assert set(read.metrics()) == {"act/1/mean", "act/1/std", "act/1/frac_zero", "grad/global_norm",
                                   *(f"grad/0.weight/{s}" for s in GRAD_STATS)}
    (a_lo, a_hi), (g_lo, g_hi) = read.act_hists["1"][1:], read.grads.hist_range[0]
    hists = {k: (c.tolist(), e.tolist()) for k, (c, e) in read.histograms().items()}
    assert hists == {"act/1/hist": (read.act_hists["1"][0], [a_lo, (a_lo + a_hi) / 2, a_hi]),
                     "grad/0.weight/hist": (read.grads.hist[0], [g_lo, (g_lo + g_hi) / 2, g_hi])}
    assert not m[1]._forward_hooks


@pytest.mark.parametrize("with_stats", [True, False])
def test_reading_joined_for_one_transfer_and_reading_each_where_it_lies_give_the_same_values(with_stats):
    reduced = torch.tensor([0.1, -2.0, 3.5], dtype=torch.float64) if with_stats else None
    extra = (torch.tensor([[1.5, float("nan")], [float("inf"), 0.1]]), None, torch.tensor([3, -1]), [0.5, 2.0],
             torch.tensor(0.2, dtype=torch.bfloat16))
    want = [[1.5, math.nan, math.inf, float(torch.tensor(0.1))], [], [3.0, -1.0], [0.5, 2.0], [0.2001953125]]
    for join in (True, False):
        stats_host, values = _read(reduced, extra, join=join)
        assert stats_host is None if reduced is None else stats_host.tolist() == reduced.tolist()
        assert [[str(v) for v in row] for row in values] == [[str(v) for v in row] for row in want], join
        assert all(type(v) is float for row in values for v in row), join


def test_gradients_are_read_afresh_every_step_and_a_missing_one_is_skipped(device):
    m = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2)).to(device)
    stats = StepStats(m, "*")
    for step in range(4):
        m.zero_grad(set_to_none=True)
        m(torch.randn(4, 3, device=device) * (step + 1)).sum().backward()
        if step == 2:
            m[1].bias.grad = None
        stats.capture_grads()
        grads = stats.finish().grads
        present = [(n, p.grad) for n, p in m.named_parameters() if p.grad is not None]
        assert grads.names == [n for n, _ in present]
        for row, (_, g) in zip(grads.values, present, strict=True):
            assert row == pytest.approx(reference(g), rel=1e-5, abs=1e-6), step


@pytest.mark.skipif(not __import__("conftest").has_module("numba"), reason="needs numba (hookexp[fast])")
@pytest.mark.parametrize("hist_sample", [None, 300])
def test_fused_cpu_kernels_equal_the_torch_ops(monkeypatch, hist_sample):
    import numpy as np

    from hookexp import fused
    torch.manual_seed(0)
    tensors = [torch.randn(37, 11) * 1e3 + 5e4, torch.zeros(5), torch.randn(1000).clamp(min=0), torch.tensor([2.0]),
               torch.tensor([1.0, float("nan"), -3.0]), torch.tensor([-float("inf"), 0.0, 4.0]), torch.randn(3, 3, 5)]
    out = {}
    for enabled in (True, False):
        monkeypatch.setattr(fused, "ENABLED", enabled)
        packed = Packed([t.shape for t in tensors], torch.device("cpu"), hist_sample)
        assert (packed._fused is not None) == enabled
        torch._foreach_copy_(packed.slots, tensors)
        host = packed.reduce(8)
        assert isinstance(host, np.ndarray) == enabled  # the kernels' own array: no torch round trip
        host = host if enabled else host.numpy()
        out[enabled] = (*packed.decode(host, 8), packed.kernel_edges(host, 8))
        if enabled:  # 10 bins too: a width (hi - lo) / 10 is rounded, so only the same float64 ops give the same edges
            ten = packed.reduce(10)
            ten_table, ten_edges = packed.decode(ten, 10)[0], packed.kernel_edges(ten, 10)
    (table, counts, edges), (ref_table, ref_counts, no_edges) = out[True], out[False]
    np.testing.assert_allclose(table, ref_table, rtol=2e-6, atol=0, equal_nan=True)
    finite = np.isfinite(table[:, 3]) & np.isfinite(table[:, 4])  # ranges with NaN/Inf are not logged
    assert finite.sum() == 5 and (counts[finite] == ref_counts[finite]).all()  # the same bins, element for element
    # the kernels' bin edges are bin_edges' to the last bit (zeros(5): a one-value range), NaN where not finite
    assert no_edges is None and edges.shape == (len(tensors), 9)
    assert (edges[finite] == bin_edges(table[finite, 3], table[finite, 4], 8)).all() and np.isnan(edges[~finite]).all()
    assert (ten_edges[finite] == bin_edges(ten_table[finite, 3], ten_table[finite, 4], 10)).all()
    for t, row in zip(tensors, table, strict=True):  # and both equal torch itself
        if torch.isfinite(t).all():
            assert all(close(a, b) for a, b in zip(row, reference(t), strict=True)), (row, reference(t))


def test_a_broken_numba_falls_back_to_the_torch_ops_with_one_warning(monkeypatch, caplog):
    from hookexp import fused
    def broken():
        raise ImportError("numba needs numpy < 2.5\nsecond line")

    monkeypatch.setattr(fused, "_kernels", broken)
    monkeypatch.setattr(fused, "_installed", lambda: True)
    fused._working.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="hookexp.stats"):
            packed = Packed([torch.Size([3])], torch.device("cpu"))
            Packed([torch.Size([4])], torch.device("cpu"))
        assert packed._fused is None and packed.width == 64  # the torch ops' rows
        assert [r.getMessage() for r in caplog.records] == [
            "statistics: numba is installed but unusable (ImportError: numba needs numpy < 2.5); using torch ops on "
            "the CPU instead"]
    finally:
        fused._working.cache_clear()


def test_prepare_loads_the_kernels_before_the_first_log_step_and_only_when_something_is_described(monkeypatch):
    from hookexp import fused

    calls = []
    monkeypatch.setattr(fused, "usable", lambda device_type: calls.append(device_type) or False)
    model = nn.Sequential(nn.Linear(3, 2), nn.ReLU())
    StepStats(model, "*").prepare(torch.device("cpu"))
    StepStats(model, None, "1").prepare(torch.device("cpu"))
    assert calls == ["cpu", "cpu"]
    StepStats(model, None, None).prepare(torch.device("cpu"))  # statistics off: numba is never imported
    assert calls == ["cpu", "cpu"]

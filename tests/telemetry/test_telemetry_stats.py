"""hookexp.telemetry.stats against plain float64 references written here, one read-back, no host sync, and
sharded (DTensor, FSDP2) statistics that equal the unsharded ones on 2 gloo ranks."""

from __future__ import annotations

import copy
import math
import os
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hookexp import ConfigError
from hookexp.telemetry.readback import read
from hookexp.telemetry.stats import STATS, TensorStats, bin_edges

NAN, INF = math.nan, math.inf


def reference(t: torch.Tensor) -> dict[str, float]:
    """Every statistic of one tensor, in float64 from the values it holds (bf16/fp16 exactly widened)."""
    g = t.detach().double().reshape(-1)
    return {"norm": g.norm().item(), "mean": g.mean().item(),
            "std": g.std().item() if g.numel() > 1 else NAN,  # torch warns, then gives NaN, for one element
            "min": g.min().item(), "max": g.max().item(),
            "frac_zero": (g == 0).double().mean().item(), "frac_neg": (g < 0).double().mean().item(),
            "abs_mean": g.abs().mean().item(), "kurtosis": kurtosis(g)}


def kurtosis(g: torch.Tensor) -> float:
    """Pearson's: the mean 4th power of the deviations over the squared mean 2nd power; NaN without spread."""
    c = g - g.mean()
    m2 = c.square().mean()
    return (c.pow(4).mean() / m2.square()).item() if g.isfinite().all() and m2 > 0 else NAN


def describe(tensors: dict[str, torch.Tensor], **kwargs) -> dict:
    return read([TensorStats(**kwargs).describe(tensors)])


def same(got: float, want: float, rel: float = 1e-9) -> bool:
    if math.isnan(want) or math.isinf(want):
        return str(got) == str(want)
    return math.isclose(got, want, rel_tol=rel, abs_tol=1e-15)


def assert_stats(got: dict, tensors: dict[str, torch.Tensor], rel: float = 1e-9) -> None:
    """Norm, mean and std within ``rel`` of the reference; min, max and the fractions exactly."""
    for key, t in tensors.items():
        for stat, want in reference(t).items():
            value = got[f"{key}/{stat}"]
            if stat in ("norm", "mean", "std", "abs_mean", "kurtosis"):
                assert same(value, want, rel), (key, stat, value, want)
            else:
                assert str(value) == str(want), (key, stat, value, want)


def mixed(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    out = {f"randn_{n}": torch.randn(n) * 3 + 0.5 for n in (1, 2, 3, 63, 64, 65, 1000, 4097, 100_000)}
    out.update({"matrix": torch.randn(37, 11).t(),  # not contiguous
                "zeros": torch.zeros(10), "relu": torch.randn(300).clamp(min=0), "single": torch.tensor([3.0]),
                "negative": -torch.rand(17), "offset": 1000 + 1e-3 * torch.randn(5000)})  # |mean| >> std
    return {k: v.to(dtype) for k, v in out.items()}


@pytest.fixture(params=["two_pass", "fused", "compiled"])
def path(request, monkeypatch):
    """Each device's path on the CPU: the two-pass partials (CPU, MPS), the single-pass rows (CUDA with
    stats.compile=false) and those rows in torch.compile's kernels (CUDA's default)."""
    from hookexp.telemetry import stats

    monkeypatch.setattr(stats, "FUSED", frozenset({"cpu"} if request.param == "fused" else ()))
    monkeypatch.setattr(stats, "COMPILED", frozenset({"cpu"} if request.param == "compiled" else ()))
    yield request.param
    if request.param == "compiled":  # the kernel compiled (a failure would fall back to the eager rows)
        assert stats.ROW_KERNEL.failed is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_statistic_equals_a_float64_reference(dtype, path):
    tensors = mixed(dtype)
    got = describe(tensors)
    assert_stats(got, tensors)
    assert set(got) == {f"{k}/{s}" for k in tensors for s in STATS}


def test_zeros_and_negatives_of_wide_bf16_rows_are_counted_exactly(path):
    """bf16 tensors that fill whole rows of 512 (no pad, so no float32 in the join): each row holds more zeros
    and negatives than bf16 counts exactly (above 256, only even numbers)."""
    g = torch.Generator().manual_seed(0)
    n = 1 << 18
    tensors = {"mostly_zero": torch.randn(n, generator=g).where(torch.rand(n, generator=g) < 0.4, 0.0).bfloat16(),
               "mostly_negative": (-0.1 - torch.rand(n, generator=g)).where(torch.rand(n, generator=g) < 0.9, 0.0)
               .bfloat16()}
    got = describe(tensors)
    for key, t in tensors.items():
        assert got[f"{key}/frac_zero"] == (t == 0).double().mean().item()
        assert got[f"{key}/frac_neg"] == (t < 0).double().mean().item()
    assert_stats(got, tensors)


def test_abs_mean_and_kurtosis_of_known_distributions(path):
    """Pearson's kurtosis (not excess): 3 for a normal, 1.8 for a uniform, 1 for two equally likely values."""
    torch.manual_seed(0)
    got = describe({"normal": torch.randn(200_000), "uniform": torch.rand(200_000) * 2 - 1,
                    "two": torch.tensor([-2.0, 2.0] * 50), "constant": torch.full((9,), 4.0)})
    assert got["normal/kurtosis"] == pytest.approx(3.0, abs=0.05)
    assert got["normal/abs_mean"] == pytest.approx(math.sqrt(2 / math.pi), rel=0.01)
    assert got["uniform/kurtosis"] == pytest.approx(1.8, abs=0.01)
    assert got["uniform/abs_mean"] == pytest.approx(0.5, rel=0.01)
    assert got["two/kurtosis"] == pytest.approx(1.0, rel=1e-12) and got["two/abs_mean"] == 2.0
    assert math.isnan(got["constant/kurtosis"]) and got["constant/abs_mean"] == 4.0


def test_only_the_tensors_named_higher_pay_for_kurtosis_and_the_rest_is_unchanged(path):
    """``higher`` (the activations, in the probes): their kurtosis as with every tensor described; the others get
    NaN for it, and every other statistic of every tensor is what describing them all gives."""
    from hookexp.telemetry.stats import STATS, TensorStats

    torch.manual_seed(1)
    tensors = {"grad/w": torch.randn(3000), "act/a": torch.rand(1000) ** 3, "grad/b": torch.randn(7) + 2}
    describer = TensorStats(STATS)
    every = read([describer.describe(tensors)])
    some = read([describer.describe(tensors, higher=["act/a"])])
    assert some["act/a/kurtosis"] == every["act/a/kurtosis"]
    x = tensors["act/a"].double()
    d = x - x.mean()
    assert some["act/a/kurtosis"] == pytest.approx(((d ** 4).mean() / (d ** 2).mean() ** 2).item(), rel=1e-9)
    assert math.isnan(some["grad/w/kurtosis"]) and math.isnan(some["grad/b/kurtosis"])
    for key, value in every.items():
        if not key.endswith("/kurtosis"):
            assert some[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key


def test_the_spread_stays_exact_when_the_mean_dominates(path):
    """Sums of squares would lose the spread entirely here; the deviations from the mean keep it."""
    torch.manual_seed(0)
    g = (1e4 + 1e-3 * torch.randn(20_000)).double()  # float64 input stays float64
    got = describe({"g": g})
    assert math.isclose(got["g/std"], g.std().item(), rel_tol=1e-9)
    assert math.isclose(got["g/mean"], g.mean().item(), rel_tol=1e-12)


def test_a_row_led_by_an_outlier_keeps_every_statistic_exact(path):
    """Each row's first element is an outlier (the single-pass rows copy it into a padded row's pads, then
    take the copies out): the spread and the higher moments stay at float64's rounding."""
    torch.manual_seed(0)
    spiky = (torch.randn(1000) * 1e-3).index_fill_(0, torch.arange(0, 1000, 8), 1e4)
    tensors = {"spiky": spiky, "sparse": torch.zeros(999).index_fill_(0, torch.arange(0, 999, 16), -3.0),
               "offset": 1e4 + 1e-3 * torch.randn(777, dtype=torch.float64)}
    got = describe(tensors)
    assert_stats(got, tensors)


def test_a_float64_tensor_of_one_element_has_its_mean_and_no_spread(path):
    """Its one row is that element and its 15 copies (the pads): the mean is the element exactly and there is no
    spread, so std and kurtosis are NaN, as for one float32 element."""
    tensors = {"one": torch.tensor([0.1], dtype=torch.float64), "pair": torch.tensor([0.1, 0.3], dtype=torch.float64)}
    got = describe(tensors)
    assert got["one/mean"] == 0.1 and got["one/norm"] == 0.1
    assert math.isnan(got["one/std"]) and math.isnan(got["one/kurtosis"]), got
    assert_stats(got, tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # float64: widened in place, no copy
def test_nan_and_inf_are_reported_as_torch_reports_them(dtype, path):
    tensors = {"nan": torch.tensor([1.0, NAN]), "inf": torch.tensor([1.0, INF]), "neg_inf": torch.tensor([-INF, 1.0]),
               "both_infs": torch.tensor([-INF, INF]), "all_inf": torch.tensor([INF, INF]),
               "all_nan": torch.full((70,), NAN), "nan_zero_neg": torch.tensor([NAN, 0.0, -1.0]),
               "nan_inf": torch.tensor([INF, NAN, 2.0]), "ok": torch.tensor([1.0, 3.0, 2.0]),
               "inf_row": torch.tensor([INF] + [0.5] * 15)}  # a whole row (no pad) led by an Inf
    tensors = {k: v.to(dtype) for k, v in tensors.items()}
    got = describe(tensors, hist_bins=2)
    assert_stats(got, tensors)
    assert got["nan_zero_neg/frac_zero"] == 1 / 3 and got["nan_zero_neg/frac_neg"] == 1 / 3  # NaN: nonzero, not < 0
    hists = {k: (v[0].tolist(), v[1].tolist()) for k, v in got.items() if k.endswith("/hist")}
    assert hists == {"ok/hist": ([1.0, 2.0], [1.0, 2.0, 3.0])}  # NaN/Inf: no histogram; min/max say why


def test_histograms_are_torch_histc_over_min_max_with_linspace_edges(path):
    tensors = mixed()
    tensors["constant"] = torch.full((5,), 2.5)
    got = describe(tensors, hist_bins=7)
    for key, t in tensors.items():
        counts, edges = got[f"{key}/hist"]
        lo, hi = t.min().item(), t.max().item()
        if lo == hi:  # one value: a unit-wide range around it, where torch.histc puts it too
            lo, hi = lo - 0.5, hi + 0.5
            assert counts.tolist() == torch.histc(t, 7, t.min().item(), t.max().item()).tolist()
        assert counts.tolist() == torch.histc(t.float(), 7, lo, hi).tolist(), key
        assert edges[0] == lo and edges[-1] == hi and np.allclose(edges, np.linspace(lo, hi, 8), rtol=1e-15, atol=0)


def test_without_float64_as_on_mps_the_same_path_sums_in_float32(monkeypatch):
    from hookexp.telemetry import stats

    monkeypatch.setattr(stats, "wide_dtype", lambda device: torch.float32)
    tensors = mixed()
    got = describe(tensors, hist_bins=7)
    assert_stats(got, tensors, rel=1e-5)
    for key, t in tensors.items():
        if t.min() < t.max():
            assert got[f"{key}/hist"][0].tolist() == torch.histc(t, 7, t.min().item(), t.max().item()).tolist(), key


def test_bin_edges_are_equal_bins_from_min_to_max_exactly():
    lo, hi = np.array([-0.3, 2.0, 1e-8]), np.array([0.7, 2.0, 3e-8])
    edges = bin_edges(lo, hi, 4)
    assert (edges[:, 0] == [-0.3, 1.5, 1e-8]).all() and (edges[:, -1] == [0.7, 2.5, 3e-8]).all()
    for row, a, b in zip(edges, [-0.3, 1.5, 1e-8], [0.7, 2.5, 3e-8], strict=True):
        assert np.allclose(row, np.linspace(a, b, 5), rtol=1e-15, atol=0)


def test_histograms_of_large_tensors_count_a_fixed_subset_scaled_to_the_size(path):
    torch.manual_seed(0)
    tensors = {"big": torch.randn(100, 100), "small": torch.randn(300)}
    exact = describe(tensors, hist_bins=16)
    sampled = describe(tensors, hist_bins=16, hist_sample=1000)
    assert {k: v for k, v in sampled.items() if not k.endswith("hist")} == \
        {k: v for k, v in exact.items() if not k.endswith("hist")}  # only the counts are sampled
    picks = torch.randint(10_000, (1000,), generator=torch.Generator().manual_seed(0))  # the documented subset
    big = tensors["big"].reshape(-1)
    want = torch.histc(big[picks], 16, big.min().item(), big.max().item()).double() * 10
    assert sampled["big/hist"][0].tolist() == want.tolist() and sampled["big/hist"][0].sum() == 10_000
    assert sampled["small/hist"][0].tolist() == exact["small/hist"][0].tolist()
    assert (sampled["big/hist"][1] == exact["big/hist"][1]).all()


def test_only_empty_tensors_describe_to_nothing_without_a_warning(path):
    """Every described tensor empty (e.g. a rank's shards of small tensors): no statistic, and no warning from
    a reduction over no rows."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert describe({"act/empty": torch.zeros(0, 3), "act/none": torch.zeros(0)}) == {}


def test_the_decoder_gives_the_asked_statistics_and_skips_empty_tensors(path):
    tensors = {"act/relu": torch.randn(8, 4).clamp(min=0), "act/empty": torch.zeros(0, 3), "act/one": torch.ones(1)}
    got = describe(tensors, stats=("frac_zero", "mean"), hist_bins=3)
    assert sorted(got) == ["act/one/frac_zero", "act/one/hist", "act/one/mean",
                           "act/relu/frac_zero", "act/relu/hist", "act/relu/mean"]
    assert TensorStats().describe({})[0] is None and describe({}) == {}


def test_bad_settings_name_the_setting():
    with pytest.raises(ValueError, match=r"^unknown statistic 'nrom'; the statistics are norm, .* mean 'norm'\?$"):
        TensorStats(stats=("nrom",))
    with pytest.raises(ConfigError, match=r"^stats\.hist_sample: must be at least 1 \(or null: count every element\)"):
        TensorStats(hist_sample=0)
    with pytest.raises(ConfigError, match=r"^stats\.hist_bins: must be 0 \(no histograms\) or more, got -1"):
        TensorStats(hist_bins=-1)


def test_layouts_follow_changing_shapes_and_leave_the_tensors_as_they_were(path):
    describer = TensorStats(hist_bins=4, hist_sample=50)
    for batch in (16, 5, 16, 70):
        t = {"act/x": torch.randn(batch, 3), "grad/w": torch.randn(7)}
        got = read([describer.describe(t)])
        assert_stats(got, t)
        assert got["act/x/hist"][0].sum() == pytest.approx(batch * 3, rel=1e-12)
    fill_rows = {"w": torch.randn(64, 64), "b": torch.randn(64)}  # whole rows: no pads at all
    before = {k: v.clone() for k, v in fill_rows.items()}
    got = describe(fill_rows, hist_bins=5)
    assert_stats(got, fill_rows)
    assert got["b/hist"][0].tolist() == torch.histc(fill_rows["b"], 5, got["b/min"], got["b/max"]).tolist()
    assert all(torch.equal(before[k], v) for k, v in fill_rows.items())


def test_describe_does_not_read_anything_back(monkeypatch, path):
    """No host sync: nothing in describe asks a tensor for its values; read() copies once."""
    tensors = {**mixed(), "bf16": torch.randn(50).bfloat16()}
    describer = TensorStats(hist_bins=8, hist_sample=500)
    want = read([describer.describe(tensors)])
    read([TensorStats(stats=("norm",)).describe({"p": torch.ones(3)})])  # compiled: its first call compiles
    calls = Counter()

    def forbidden(name):
        def fail(self, *args, **kwargs):
            raise AssertionError(f"describe called Tensor.{name}")
        return fail
    for name in ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden(name))
    pending = [describer.describe(tensors), TensorStats(stats=("norm",)).describe({"p": torch.ones(3)})]
    monkeypatch.undo()
    cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: calls.update(["cpu"]) or cpu(self, *a, **k))
    got = read([*pending, (None, lambda host: {"meter/none": len(host)}),
                (torch.tensor([2.5, 4.0]), lambda host: {"meter/loss": host[0] / host[1]})])
    assert calls["cpu"] == 1  # one transfer for every producer
    assert {k: str(v) for k, v in got.items() if not k.endswith("/hist")} == {
        **{k: str(v) for k, v in want.items() if not k.endswith("/hist")}, "p/norm": str(3 ** 0.5), "meter/none": "0",
        "meter/loss": "0.625"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_describe_never_syncs_and_equals_the_cpu():
    tensors = {**mixed(), "bf16": torch.randn(5000).bfloat16(), "nan": torch.tensor([1.0, NAN])}
    on_gpu = {k: v.cuda() for k, v in tensors.items()}
    from hookexp.telemetry import stats

    describer = TensorStats(hist_bins=8, hist_sample=500)
    read([describer.describe(on_gpu)])  # a new layout copies its index tensors to the GPU once, and compiles
    assert stats.ROW_KERNEL.failed is None and all(layout.compiled for layout in describer._layouts.values())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = describer.describe(on_gpu)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    got, want = read([pending]), describe(tensors, hist_bins=8, hist_sample=500)
    assert got.keys() == want.keys()
    for k, v in want.items():
        if k.endswith("/hist"):
            assert got[k][0].tolist() == v[0].tolist() and got[k][1].tolist() == v[1].tolist(), k
        else:
            assert same(got[k], v, 1e-9), (k, got[k], v)


# -- 2 ranks (gloo): sharded statistics equal the unsharded ones ------------------------------------------

def _counting(counts: Counter) -> None:
    for name in ("all_gather_single", "all_gather_into_tensor", "all_reduce", "all_gather", "broadcast",
                 "reduce_scatter_tensor"):
        real = getattr(dist, name)

        def wrapped(*args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)
        setattr(dist, name, wrapped)


def _rank(rank: int, world: int, init: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    full = {**mixed(), "nan": torch.tensor([[1.0, 2.0], [NAN, 0.0], [3.0, -1.0]]), "rows3": torch.randn(3, 5),
            "row1": torch.randn(1, 6), "cols": torch.randn(4, 9), "replica": torch.randn(40),
            "plain_shard": torch.randn(10, 3), "plain_replica": torch.randn(21), "bf16": torch.randn(33, 2).bfloat16()}
    place = {"rows3": [Shard(0)], "row1": [Shard(0)], "cols": [Shard(1)], "replica": [Replicate()]}
    inputs = {k: distribute_tensor(v, mesh, place.get(k, [Shard(0)])) if k not in ("plain_shard", "plain_replica")
              else v for k, v in full.items() if v.dim() > 0}
    inputs["plain_shard"] = full["plain_shard"].chunk(world)[rank]
    counts: Counter = Counter()
    _counting(counts)
    result = {}
    for bins, sample in ((0, None), (6, None), (6, 7)):
        describer = TensorStats(hist_bins=bins, hist_sample=sample)
        counts.clear()
        pending = describer.describe(inputs, sharded={"plain_shard"})
        result[bins, sample] = (dict(counts), read([pending]))
    result["reference"] = read([TensorStats(hist_bins=6).describe(full)])
    counts.clear()
    replicas = {"r": distribute_tensor(torch.randn(9), mesh, [Replicate()]), "p": torch.randn(4)}
    result["replicated"] = (read([TensorStats().describe(replicas)]), dict(counts),
                            read([TensorStats().describe({"r": replicas["r"].full_tensor(), "p": replicas["p"]})]))
    try:
        TensorStats().describe({"grad/w": DTensor.from_local(torch.ones(2), mesh, [Partial()])})
    except ValueError as e:
        result["partial"] = str(e)
    # a 2-D mesh (HSDP's layout): replicated over the first dimension, sharded over the second (of size 1)
    mesh2 = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    hsdp = {"w": distribute_tensor(full["cols"], mesh2, [Replicate(), Shard(0)])}
    result["hsdp"] = read([TensorStats(hist_bins=6).describe(hsdp)])

    # FSDP2: the gradients of a fully_shard model equal those of the same model unsharded, on the same batch
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    plain = copy.deepcopy(model)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in (model, plain):
        torch.nn.functional.cross_entropy(m(x), y).backward()
    counts.clear()
    sharded = read([TensorStats(hist_bins=6).describe({f"grad/{n}": p.grad for n, p in model.named_parameters()})])
    result["fsdp"] = (sharded, dict(counts), read([TensorStats(hist_bins=6).describe(
        {f"grad/{n}": p.grad for n, p in plain.named_parameters()})]),
        [type(p.grad).__name__ for p in model.parameters()])
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def _assert_equal(got: dict, want: dict, keys: set | None = None) -> None:
    assert set(got) == (keys if keys is not None else set(want))
    for k, v in got.items():
        if k.endswith("/hist"):
            assert v[0].tolist() == want[k][0].tolist() and v[1].tolist() == want[k][1].tolist(), k
        elif k.rsplit("/", 1)[1] in ("norm", "mean", "std", "abs_mean", "kurtosis"):
            assert same(v, want[k], 1e-6), (k, v, want[k])
        else:
            assert str(v) == str(want[k]), (k, v, want[k])  # min, max, fractions: exact


@pytest.fixture(scope="module")
def two_ranks():
    with tempfile.TemporaryDirectory() as out:
        init = f"file://{os.path.join(out, 'init')}"
        mp.start_processes(_rank, args=(2, init, out), nprocs=2, join=True, start_method="spawn")
        yield [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_two_ranks_describe_dtensors_as_one_process_describes_the_full_tensors(two_ranks):
    for result in two_ranks:  # both ranks read the same values
        ref = result["reference"]
        for (bins, sample), want_calls in {(0, None): {"all_gather_single": 1},
                                           (6, None): {"all_gather_single": 1, "all_reduce": 1},
                                           (6, 7): {"all_gather_single": 1, "all_reduce": 1}}.items():
            calls, got = result[bins, sample]
            assert calls == want_calls  # a fixed number of collectives for every tensor together
            metrics = {k: v for k, v in got.items() if not k.endswith("/hist")}
            _assert_equal(metrics, {k: v for k, v in ref.items() if k in metrics},
                          {k for k in ref if not k.endswith("/hist")})
            if bins and sample is None:
                _assert_equal(got, ref)
            elif bins:  # each rank counts up to 7 elements of its shard, scaled: every element is counted once
                for k, (counts, edges) in ((k, v) for k, v in got.items() if k.endswith("/hist")):
                    assert counts.sum() == pytest.approx(ref[k][0].sum(), rel=1e-12) and (edges == ref[k][1]).all()
    assert two_ranks[0]["reference"]["nan/min"] != two_ranks[0]["reference"]["nan/min"]  # NaN, on a shard


def test_two_ranks_count_a_replicated_tensor_once_and_refuse_partial(two_ranks):
    for result in two_ranks:
        got, calls, want = result["replicated"]
        assert calls == {} and got == want  # nothing sharded: no collective, every rank its own values
        assert result["partial"].startswith("cannot describe 'grad/w': its DTensor placement is Partial")
        _assert_equal(result["hsdp"], {k.replace("cols", "w"): v for k, v in result["reference"].items()
                                       if k.startswith("cols/")})


def test_two_ranks_fsdp2_gradient_statistics_equal_the_unsharded_model(two_ranks):
    for result in two_ranks:
        sharded, calls, plain, kinds = result["fsdp"]
        assert kinds == ["DTensor"] * 4
        assert calls == {"all_gather_single": 1, "all_reduce": 1}
        _assert_equal(sharded, plain)
        assert len(sharded) == 4 * (len(STATS) + 1)

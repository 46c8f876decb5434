"""``hookexp report`` on hand-made sweeps (no training): steps to reach, the spread on log axes,
torn metrics files, the output folder, and the gradient-norm plot at 40+ layers."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from hookexp.analysis.plots import (
    HEATMAP_ROWS_MAX,
    LINE_PLOT_MAX,
    block_of,
    curves_figure,
    grad_norm_figure,
    plot_grad_norms,
    read_metrics,
    short_labels,
    spread,
)
from hookexp.analysis.report import Reach, main, parse_reach, plot, report
from hookexp.errors import ConfigError

STEPS = [0, 10, 20, 30, 40, 50, 60]
# val/acc and val/loss per job, logged at STEPS; the answers the tests expect are written beside them
SWEEP = {
    ("hooks=none", 0): ([0.10, 0.30, 0.50, 0.70, 0.95, 0.97, 0.99], [2.0, 1.0, 0.5, 0.2, 0.08, 0.05, 0.03]),  # 40, 40
    ("hooks=none", 1): ([0.10, 0.20, 0.30, 0.50, 0.80, 0.94, 0.96], [2.0, 1.5, 1.0, 0.5, 0.3, 0.12, 0.09]),  # 60, 60
    ("hooks=none", 2): ([0.10, 0.20, 0.30, 0.40, 0.50, 0.70, 0.90], [2.0, 1.8, 1.6, 1.4, 1.2, 1.0, 0.8]),  # never
    ("hooks=ema", 0): ([0.20, 0.96, 0.97, 0.98, 0.99, 0.99, 0.99], [1.0, 0.10, 0.05, 0.04, 0.03, 0.02, 0.01]),  # 10
    ("hooks=ema", 1): ([0.20, 0.50, 0.95, 0.97, 0.98, 0.99, 0.99], [1.0, 0.5, 0.09, 0.05, 0.04, 0.03, 0.02]),  # 20
    ("hooks=ema", 2): ([0.20, 0.40, 0.60, 0.95, 0.98, 0.99, 0.99], [1.0, 0.6, 0.3, 0.10, 0.05, 0.04, 0.03]),  # 30
    ("hooks=ma", 0): ([0.10, 0.20, 0.40, 0.60, 0.70, 0.80, 0.80], [2.0, 1.9, 1.8, 1.7, 1.6, 1.5, 1.4]),  # never
    ("hooks=ma", 1): ([0.10, 0.20, 0.30, 0.40, 0.50, 0.60, 0.70], [2.0, 1.9, 1.8, 1.7, 1.6, 1.5, 1.4]),  # never
}


def write_job(job: Path, overrides: list[str], rows: list[dict], status: str | None = "finished",
              torn: bytes = b"") -> Path:
    """A job directory as a hookexp run leaves it: overrides, manifest, metrics.jsonl and (when the job
    ended) summary.json; ``torn`` is appended as a last line without its newline (a killed writer)."""
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (job / "manifest.json").write_text(json.dumps({"command": ["hookexp", *overrides]}))
    (job / "metrics.jsonl").write_bytes("".join(json.dumps(r) + "\n" for r in rows).encode() + torn)
    if status is not None:
        last = {k: v for r in rows for k, v in r.items() if k.startswith(("val/", "train/"))}
        best = max((r["val/acc"] for r in rows if "val/acc" in r), default=None)
        (job / "summary.json").write_text(json.dumps({**last, "val/acc_best": best, "status": status}))
    return job


def make_sweep(root: Path, sweep: dict = SWEEP, common: tuple[str, ...] = ("trainer.max_steps=60",)) -> Path:
    for i, ((group, seed), (acc, loss)) in enumerate(sweep.items()):
        rows = []
        for s, a, v in zip(STEPS, acc, loss, strict=True):
            rows.append({"trainer/step": s, "train/loss": v * 1.1, "train/acc": a})
            rows.append({"trainer/step": s, "val/acc": a, "val/loss": v, "epoch": 1})
        write_job(root / str(i), [group, f"seed={seed}", *common], rows)
    return root


def test_the_header_counts_jobs_and_groups_in_words(tmp_path, capsys):
    """8 jobs in 3 groups; one group's sweep says "1 group", not "1 groups"."""
    main([str(make_sweep(tmp_path / "sweep"))])
    assert "8 finished jobs in 3 groups (overrides minus the seed)" in capsys.readouterr().out
    one = {k: v for k, v in SWEEP.items() if k[0] == "hooks=ema"}
    main([str(make_sweep(tmp_path / "one", one))])
    assert "3 finished jobs in 1 group (overrides minus the seed)" in capsys.readouterr().out


def test_steps_to_reach_per_job_and_per_group(tmp_path, capsys):
    sweep = make_sweep(tmp_path / "sweep")
    main([str(sweep), "--reach", "val/acc=0.95"])
    markdown = capsys.readouterr().out
    assert markdown.strip() == (sweep / "report.md").read_text().strip()
    rows = {line.split(" | ")[0].lstrip("| "): line for line in markdown.splitlines()
            if line.startswith("| hooks=") and "`" not in line}  # the main table's rows (the per-job rows name a job)
    # the main table: one reach column; per group mean ± sample std over the jobs that reached it
    assert "| group | n | val/acc | val/acc_best | val/loss | train/loss | train/acc | steps to val/acc>=0.95 |" \
        in markdown
    std_none = math.sqrt(((40 - 50) ** 2 + (60 - 50) ** 2) / (2 - 1))  # 14.142...: the never-reaching job left out
    assert rows["hooks=none"].endswith(f"| 50.0 ± {std_none:.1f} (2 of 3 reached) |")
    assert rows["hooks=ema"].endswith(f"| 20.0 ± {math.sqrt((100 + 0 + 100) / 2):.1f} (3 of 3 reached) |")
    assert rows["hooks=ma"].endswith("| never (0 of 2 reached) |")
    # groups in natural order of their names, common overrides shown once
    assert [line.split(" | ")[0] for line in markdown.splitlines() if line.startswith("| hooks=") and "`" not in line] \
        == ["| hooks=ema", "| hooks=ma", "| hooks=none"]
    assert "Common to every job: `trainer.max_steps=60`" in markdown
    # the per-job table: the step, or never with the best value the job got
    assert "| hooks=none | 0 | `0` | 40 |" in markdown and "| hooks=none | 1 | `1` | 60 |" in markdown
    assert "| hooks=none | 2 | `2` | never (best 0.9) |" in markdown
    assert "| hooks=ma | 1 | `7` | never (best 0.7) |" in markdown


def test_reach_of_a_falling_metric_and_the_explicit_forms(tmp_path):
    sweep = make_sweep(tmp_path / "sweep")
    assert Reach.parse("val/loss=0.1") == Reach("val/loss", "<=", 0.1)  # a name ending in loss falls
    assert Reach.parse("val/ppl=3") == Reach("val/ppl", "<=", 3.0) and Reach.parse("val/mse=1e-3").op == "<="
    assert Reach.parse("val/acc=0.9") == Reach("val/acc", ">=", 0.9)
    assert Reach.parse(" val/loss >= 1.5 ") == Reach("val/loss", ">=", 1.5)  # the explicit form wins
    assert parse_reach(["val/acc=0.95,val/loss<=0.1", "val/acc>=0.95"]) == [Reach("val/acc", ">=", 0.95),
                                                                           Reach("val/loss", "<=", 0.1)]
    markdown, groups, _ = report([sweep], reach=["val/loss=0.1", "val/loss>=1.5"])
    by = {g.name: g for g in groups}
    falling, rising = Reach("val/loss", "<=", 0.1), Reach("val/loss", ">=", 1.5)
    assert by["hooks=none"].steps_to(falling) == [40, 60, None]
    assert by["hooks=ema"].steps_to(falling) == [10, 20, 30]
    assert by["hooks=ma"].steps_to(falling) == [None, None]
    assert by["hooks=none"].steps_to(rising) == [0, 0, 0] and by["hooks=ma"].steps_to(rising) == [0, 0]
    assert "| steps to val/loss<=0.1 | steps to val/loss>=1.5 |" in markdown
    assert "| 50.0 ± 14.1 (2 of 3 reached) | 0.0 ± 0.0 (3 of 3 reached) |" in markdown
    assert "| hooks=none | 2 | `2` | never (best 0.8) | 0 |" in markdown  # the best of a falling metric: its min


@pytest.mark.parametrize("bad", ["val/acc~0.9", "val/acc=abc", "val/acc=", "=0.9", "val/acc=nan"])
def test_a_malformed_reach_target_names_the_forms(bad):
    with pytest.raises(ConfigError, match=r"^--reach: .* is not a target. Write METRIC=VALUE .* e\.g\. --reach "
                                          r"val/acc=0\.95 or --reach val/loss<=0\.1\.$"):
        parse_reach([bad])


def test_a_reach_metric_no_job_logged_is_an_error_with_did_you_mean(tmp_path, capsys):
    sweep = make_sweep(tmp_path / "sweep")
    with pytest.raises(SystemExit) as exit_:
        main([str(sweep), "--reach", "val/ac=0.95"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "error: --reach: no job under the given directories logged a metric named 'val/ac'. Did you mean " \
           "'val/acc'" in err
    assert "The jobs logged: epoch, train/acc, train/loss, trainer/step, val/acc, val/loss." in err
    assert not (sweep / "report.md").exists()
    with pytest.raises(ConfigError, match=r"^--curves: .*'val/los'. Did you mean 'val/loss'"):
        report([sweep], curves=("val/los",))


def test_a_torn_last_line_is_skipped_and_a_killed_job_listed(tmp_path):
    sweep = make_sweep(tmp_path / "sweep", {k: v for k, v in SWEEP.items() if k[0] == "hooks=ema"})
    # a finished job whose file ends in half a line, and a job killed mid-write (no summary.json)
    rows = [{"trainer/step": s, "val/acc": a} for s, a in zip(STEPS, [0.1, 0.5, 0.9, 0.96, 0.97, 0.98, 0.99],
                                                               strict=True)]
    rows.append({"trainer/step": 65, "val/acc": math.nan})  # json.dumps writes NaN (orjson would write null)
    write_job(sweep / "8", ["hooks=ema", "seed=3", "trainer.max_steps=60"], rows, torn=b'{"trainer/step": 70, "val/a')
    write_job(sweep / "9", ["hooks=ema", "seed=4", "trainer.max_steps=60"], rows[:3], status=None,
              torn='{"trainer/step": 30, "note": "é'.encode()[:-1])  # cut inside a two-byte character
    torn = read_metrics(sweep / "8" / "metrics.jsonl")
    assert torn.skipped == 1 and len(torn.rows) == 8 and math.isnan(torn.series("val/acc")[65])
    assert read_metrics(sweep / "9" / "metrics.jsonl").skipped == 1
    markdown, groups, left_out = report([sweep], reach=["val/acc=0.95"])
    (group,) = groups
    assert group.steps_to(Reach("val/acc", ">=", 0.95)) == [10, 20, 30, 30]
    assert f"| 22.5 ± {statistics.stdev([10, 20, 30, 30]):.1f} (4 of 4 reached) |" in markdown
    assert "- `8/metrics.jsonl`: 1 line(s)" in markdown and "- `9/metrics.jsonl`: 1 line(s)" in markdown
    assert [j.path.name for j in left_out] == ["9"]
    assert "- `9` (seed 4): no summary.json: the job did not finish (killed, or still running) (last logged " \
           "trainer/step 20)" in markdown


def test_a_sweep_where_no_job_finished_is_reported_and_exits_1(tmp_path, capsys):
    """Every job killed before its end: the report still lists them, and the exit status tells a script that
    nothing finished (it was 0, with an empty table)."""
    sweep = tmp_path / "sweep"
    rows = [{"trainer/step": s, "val/acc": 0.1} for s in STEPS[:3]]
    for i in range(2):
        write_job(sweep / str(i), ["hooks=ema", f"seed={i}"], rows, status=None)
    with pytest.raises(SystemExit) as e:
        main([str(sweep)])
    assert e.value.code == ("hookexp report: no job finished (2 jobs failed or unfinished, listed in report.md with "
                            "their errors): nothing to compare.")
    assert "- `0` (seed 0): no summary.json: the job did not finish" in (sweep / "report.md").read_text()
    assert "0 finished jobs in 0 groups" in capsys.readouterr().out


def run_report(args: list[str], cwd: Path, command: tuple[str, ...] = ("hookexp", "report")
               ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *command, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("command", [("hookexp", "report"), ("hookexp.report",)])
def test_out_creates_missing_folders(tmp_path, command):
    """``hookexp report`` and ``python -m hookexp.report`` (the design's spelling) are one command."""
    make_sweep(tmp_path / "sweep")
    done = run_report(["sweep", "--out", "missing/dir", "--reach", "val/acc=0.95", "--logx"], tmp_path, command)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "missing" / "dir"
    assert (out / "report.md").read_text() in done.stdout + "\n"
    assert (out / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "sweep" / "report.md").exists()
    assert "wrote missing/dir/report.md and report.png" in done.stderr


def error_of(args: list[str], capsys) -> str:
    """What ``hookexp report ARGS`` says on stderr; it must exit 2 as argparse does."""
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: hookexp report") and "Traceback" not in err
    return err.splitlines()[-1]


def test_bad_input_is_one_paragraph(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_sweep(tmp_path / "sweep")
    (tmp_path / "a_file").write_text("")
    assert error_of(["sweep", "--out", "a_file/dir"], capsys) == (
        "hookexp report: error: --out: cannot write the report to 'a_file/dir': Not a directory. Pass a "
        "folder you can write to (it is created if missing), e.g. --out reports/my_sweep.")
    (tmp_path / "empty").mkdir()
    assert error_of(["empty"], capsys) == (
        "hookexp report: error: DIR: no job directories under empty: a job directory holds manifest.json "
        "(or failure.json for a job that failed). Pass a multirun directory (multirun/DATE/TIME) or the run "
        "directories themselves.")
    assert error_of(["nowhere"], capsys) == ("hookexp report: error: DIR: nowhere is not a directory. Pass "
                                             "a multirun directory (multirun/DATE/TIME) or run directories.")
    assert "error: --reach: 'val/acc' is not a target." in error_of(["sweep", "--reach", "val/acc"], capsys)
    assert not (tmp_path / "sweep" / "report.md").exists()


def test_spread_on_a_log_axis_is_geometric_and_on_a_linear_axis_stays_in_range():
    losses = np.array([[0.01, 1.0], [1.0, 1.1], [0.02, 1.2]])  # jobs x steps
    centre, low, high = spread(losses, log=True)
    logs = [math.log(v) for v in losses[:, 0]]
    m, s = statistics.mean(logs), statistics.stdev(logs)
    assert centre[0] == pytest.approx(math.exp(m)) and low[0] == pytest.approx(math.exp(m - s))
    assert high[0] == pytest.approx(math.exp(m + s))
    assert statistics.mean(losses[:, 0]) - statistics.stdev(losses[:, 0]) < 0  # mean - std would cross zero
    assert (low > 0).all()
    acc = np.array([[0.5, 0.2], [1.0, 0.3], [1.0, 0.4]])
    centre, low, high = spread(acc, log=False)
    assert centre == pytest.approx([2.5 / 3, 0.3])
    assert high[0] == 1.0 and low[0] == pytest.approx(2.5 / 3 - statistics.stdev([0.5, 1.0, 1.0]))  # clipped at max
    assert low[1] == pytest.approx(0.2) and high[1] == pytest.approx(0.4)  # 0.3 ± 0.1: inside the range
    assert spread(np.array([[0.1, 0.2]]), log=True)[1:] == (None, None)  # one job: no band


def test_curves_on_log_axes_draw_no_band_at_or_below_zero(tmp_path):
    wide = {**SWEEP, ("hooks=solo", 0): SWEEP[("hooks=ema", 0)]}
    wide[("hooks=none", 2)] = (SWEEP[("hooks=none", 2)][0], [2.0, 1e-4, 1e-4, 1e-4, 1e-4, 1e-4, 1e-4])  # a far outlier
    sweep = make_sweep(tmp_path / "sweep", wide)
    _, groups, _ = report([sweep], out_dir=tmp_path / "out")
    panels = plot(groups, tmp_path / "out" / "report.png", ("val/loss", "val/acc"), logx=True,
                  reach=[Reach("val/acc", ">=", 0.95)])
    loss, acc = panels
    assert (loss.metric, loss.xscale, loss.yscale) == ("val/loss", "log", "log")
    assert (acc.xscale, acc.yscale) == ("log", "linear")
    assert all((b.x > 0).all() for p in panels for b in p.bands)  # log x: step 0 not drawn
    bands = {b.label.split(" (n=")[0]: b for b in loss.bands}
    assert bands["hooks=solo"].low is None and bands["hooks=solo"].high is None  # one job: no band
    none = bands["hooks=none"]
    assert (none.low > 0).all() and (none.low < none.centre).all() and (none.high > none.centre).all()
    arithmetic = np.array([[0.3, 0.12, 1e-4]]).mean() - np.array([0.3, 0.12, 1e-4]).std(ddof=1)
    assert arithmetic < 0  # at step 40 the arithmetic band would have crossed zero
    assert all(b.high is None or (b.high <= 1.0 + 1e-12).all() for b in acc.bands)  # no accuracy above 1

    # and what matplotlib drew: every filled band on the log axis lies above zero, one per group of 2+ jobs
    data = {"val/loss": [(g.name, [j.curve("val/loss") for j in g.jobs]) for g in groups]}
    fig, _ = curves_figure(data, logx=True)
    (ax,) = fig.axes
    assert ax.get_yscale() == "log" and ax.get_xscale() == "log"
    polys = ax.collections
    assert len(polys) == 3
    assert all((p.get_paths()[0].vertices[:, 1] > 0).all() for p in polys)
    (legend,) = fig.legends
    fig.canvas.draw()
    assert legend.get_window_extent().y1 < ax.get_window_extent().y0  # the legend lies below the axes
    assert [t.get_text() for t in legend.get_texts()] == ["hooks=ema", "hooks=ma", "hooks=none", "hooks=solo"]
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_a_value_logged_once_per_job_is_a_point_with_its_spread():
    """A short run's val/acc, logged once: each group a point (a one-point line draws nothing), with the spread's
    bar (mean ± std clipped to the jobs' range) for a group of several jobs, and a legend entry."""
    import matplotlib.pyplot as plt

    fig, (panel,) = curves_figure({"val/acc": [("hooks=ema", [{20: 0.9}, {20: 0.8}]), ("hooks=ma", [{20: 0.5}])]})
    (ax,) = fig.axes
    points = [line for line in ax.lines if line.get_marker() == "o"]
    assert [(list(p.get_xdata()), list(p.get_ydata())) for p in points] == [([20.0], [pytest.approx(0.85)]),
                                                                            ([20.0], [0.5])]
    (bar,) = [c for c in ax.collections if len(c.get_segments())]  # hooks=ma, one job: no bar
    assert bar.get_segments()[0][:, 1].tolist() == [pytest.approx(0.8), pytest.approx(0.9)]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["hooks=ema", "hooks=ma"]
    assert [b.label for b in panel.bands] == ["hooks=ema", "hooks=ma"]
    plt.close(fig)


def test_long_group_names_are_shortened_for_the_legend():
    names = ["hooks=grokfast_ema optim.weight_decay=0.005 hooks.grokfast_ema.args.lamb=2.0",
             "hooks=grokfast_ma optim.weight_decay=0.01 hooks.grokfast_ma.args.lamb=5.0",
             "model.lr=0.1 optim.lr=0.2"]
    short = short_labels(names)
    assert short[0] == "hooks=grokfast_ema\nweight_decay=0.005 lamb=2.0"
    assert short[1] == "hooks=grokfast_ma\nweight_decay=0.01 lamb=5.0"
    assert short[2] == "model.lr=0.1 optim.lr=0.2"  # two keys ending in lr: kept whole
    long = short_labels(["a=" + "x" * 200])[0]
    assert len(long) < 40 and "…" in long


def grad_rows(names: list[str], steps: list[int], norm) -> list[dict]:
    return [{"trainer/step": s, "train/loss": 1.0, **{f"grad/{n}/norm": norm(i, s) for i, n in enumerate(names)},
             "grad/global_norm": 1.0} for s in steps]


def write_metrics(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_grad_norms_at_forty_layers_are_a_heatmap_in_model_order(tmp_path):
    from matplotlib.collections import QuadMesh
    from matplotlib.colors import LogNorm

    names = [f"layers.{i}.weight" for i in range(40)]
    steps = [0, 10, 20, 30]

    def norm(i, s):
        return None if (i, s) == (5, 20) else 0.0 if i == 7 else 10.0 ** (-i / 10) * (s + 1)

    rows = grad_rows(names, steps, norm)
    del rows[1]["grad/layers.9.weight/norm"]  # not logged at step 10
    fig = grad_norm_figure(write_metrics(tmp_path / "metrics.jsonl", rows))
    heat = next(ax for ax in fig.axes if any(isinstance(c, QuadMesh) for c in ax.collections))
    (mesh,) = [c for c in heat.collections if isinstance(c, QuadMesh)]
    assert isinstance(mesh.norm, LogNorm)
    cells = mesh.get_array().reshape(40, 4)
    assert [t.get_text() for t in heat.get_yticklabels()] == names  # one row per parameter, in model order
    assert heat.get_ylim() == (40, 0)  # the first layer on top
    assert cells[0, 3] == pytest.approx(31.0) and cells[39, 0] == pytest.approx(10 ** -3.9)
    assert mesh.norm.vmin == pytest.approx(10 ** -3.9) and mesh.norm.vmax == pytest.approx(31.0)
    assert (cells[7] < mesh.norm.vmin).all()  # zeros: the colour map's "under" colour (white)
    assert cells[5, 2] > mesh.norm.vmax  # NaN/Inf (null in the file): the "over" colour (red)
    assert np.ma.is_masked(cells[9, 1]) and not np.ma.is_masked(cells[9, 0])  # not logged: the "bad" colour
    assert [p.get_label() for p in fig.legends[0].get_patches()] == ["zero", "NaN/Inf", "not logged"]
    assert tuple(mesh.cmap.get_under()[:3]) == (1.0, 1.0, 1.0)
    import matplotlib.pyplot as plt

    plt.close(fig)
    out = plot_grad_norms(tmp_path / "metrics.jsonl", tmp_path / "plots" / "grad_norms.png")
    assert out == tmp_path / "plots" / "grad_norms.png" and out.read_bytes()[:4] == b"\x89PNG"


def test_grad_norms_of_a_deep_model_are_grouped_by_block(tmp_path):
    from matplotlib.collections import QuadMesh

    per_block = ["ln1.weight", "attn.qkv.weight", "attn.proj.weight", "ln2.weight", "mlp.fc.weight", "mlp.proj.weight"]
    names = ["embed.weight", "pos_embed.weight", *(f"blocks.{b}.{p}" for b in range(48) for p in per_block),
             "norm.weight", "norm.bias", "head.weight"]
    assert len(names) > HEATMAP_ROWS_MAX
    dead = names.index("blocks.7.attn.proj.weight")
    rows = grad_rows(names, [0, 5], lambda i, s: 0.0 if i == dead else 0.1 * (i + 1) + s)
    fig = grad_norm_figure(write_metrics(tmp_path / "metrics.jsonl", rows))
    heat = next(ax for ax in fig.axes if any(isinstance(c, QuadMesh) for c in ax.collections))
    (mesh,) = [c for c in heat.collections if isinstance(c, QuadMesh)]
    cells = mesh.get_array().reshape(-1, 2)
    labels = [t.get_text() for t in heat.get_yticklabels()]
    assert labels == ["embed", "pos_embed", *(f"blocks.{b} (6)" for b in range(7)), "blocks.7 (6, 1 zero)",
                      *(f"blocks.{b} (6)" for b in range(8, 48)), "norm (2)", "head"]
    # a block's row is the L2 norm of its whole gradient: sqrt of the sum of its parameters' squared norms
    block3 = [0.1 * (names.index(f"blocks.3.{p}") + 1) + 5 for p in per_block]
    assert cells[2 + 3, 1] == pytest.approx(math.sqrt(sum(v * v for v in block3)))
    assert block_of("transformer.h.11.mlp.c_fc.weight") == "transformer.h.11" and block_of("0.weight") == "0"
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_few_parameters_keep_the_line_plot_with_the_legend_outside(tmp_path):
    names = ["fc1.weight", "fc1.bias", "fc2.weight"]
    assert len(names) <= LINE_PLOT_MAX
    rows = grad_rows(names, [0, 10, 20], lambda i, s: 0.0 if i == 1 else None if (i, s) == (2, 10) else 0.5 + i)
    fig = grad_norm_figure(write_metrics(tmp_path / "metrics.jsonl", rows))
    (ax,) = fig.axes
    assert not [c for c in ax.collections]  # no heatmap
    assert ax.get_yscale() == "log"
    legend = ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == [
        "fc1.weight", "fc1.bias (0 at 3 of 3 steps)", "fc2.weight (NaN/Inf at 1 of 3 steps)",
        "zero (bottom edge)", "NaN/Inf (top edge)"]
    fig.canvas.draw()
    assert legend.get_window_extent().x0 > ax.get_window_extent().x1  # right of the data
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines["fc2.weight (NaN/Inf at 1 of 3 steps)"].get_xdata()) == [0, 20]  # the NaN is a gap ...
    markers = [line for line in ax.get_lines() if line.get_marker() in ("v", "X")]
    assert [(m.get_marker(), list(m.get_xdata())) for m in markers] == [("v", [0, 10, 20]), ("X", [10])]  # ... marked
    import matplotlib.pyplot as plt

    plt.close(fig)
    assert grad_norm_figure(write_metrics(tmp_path / "empty.jsonl", [{"trainer/step": 0, "train/loss": 1.0}])) is None


def test_the_same_overrides_in_another_order_are_one_group_named_as_given(tmp_path):
    rows = [{"trainer/step": 0, "val/acc": 0.5}, {"trainer/step": 10, "val/acc": 0.97}]
    write_job(tmp_path / "a" / "0", ["optim.lr=0.1", "hooks=ema", "seed=0"], rows)
    write_job(tmp_path / "b" / "0", ["hooks=ema", "seed=1", "optim.lr=0.1"], rows)
    write_job(tmp_path / "b" / "1", ["hooks=ema", "seed=0", "optim.lr=0.01"], rows)
    _, groups, _ = report([tmp_path / "a", tmp_path / "b"], out_dir=tmp_path / "out")
    assert [(g.name, [j.seed for j in g.jobs]) for g in groups] == [("optim.lr=0.01", ["0"]),
                                                                    ("optim.lr=0.1", ["0", "1"])]
    write_job(tmp_path / "c" / "0", ["optim.lr=0.1", "hooks=ema", "seed=0"], rows)
    write_job(tmp_path / "c" / "1", ["optim.lr=0.1", "hooks=ma", "seed=0"], rows)
    _, groups, _ = report([tmp_path / "c", tmp_path / "b" / "0"], out_dir=tmp_path / "out")
    assert [g.name for g in groups] == ["hooks=ema", "hooks=ma"] and len(groups[0].jobs) == 2
    _, groups, _ = report([tmp_path / "b", tmp_path / "b" / "0"], out_dir=tmp_path / "out")  # a job given twice
    assert sum(len(g.jobs) for g in groups) == 2


def test_a_resumed_or_overwritten_job_stays_in_its_group(tmp_path):
    """A job of a sweep resumed after an interruption (``resume=true`` joins its overrides), or re-run over its
    directory (``+overwrite=true``), is one more job of its group, not a group of its own."""
    rows = [{"trainer/step": 0, "val/acc": 0.5}, {"trainer/step": 10, "val/acc": 0.97}]
    write_job(tmp_path / "s" / "0", ["hooks=ema", "seed=0"], rows)
    write_job(tmp_path / "s" / "1", ["hooks=ema", "seed=1", "resume=true"], rows)
    write_job(tmp_path / "s" / "2", ["hooks=ema", "seed=2", "+overwrite=true"], rows)
    write_job(tmp_path / "s" / "3", ["hooks=ma", "seed=0", "resume=/runs/elsewhere"], rows)
    _, groups, _ = report([tmp_path / "s"], out_dir=tmp_path / "out")
    assert [(g.name, [j.seed for j in g.jobs]) for g in groups] == [("hooks=ema", ["0", "1", "2"]),
                                                                    ("hooks=ma", ["0"])]


@pytest.mark.parametrize(("metric", "lower"), [("val/perplexity", True), ("val/token_loss", True), ("val/loss", True),
                                               ("val/acc", False), ("val/f1", False)])
def test_the_summary_best_and_the_report_rank_a_metric_alike(tmp_path, metric, lower):
    """One direction rule (hookexp.goals) for the run summary's ``*_best`` and the report: val/perplexity and
    val/token_loss were ranked as rising by the summary's old exact-name rule and as falling by the report's."""
    from hookexp.analysis.plots import log_y
    from hookexp.run.loop import summarize

    values = [8.0, 3.0, 5.0]
    job = write_job(tmp_path / "sweep" / "0", ["seed=0"], [{"trainer/step": s, metric: v}
                                                          for s, v in zip((10, 20, 30), values, strict=True)], None)
    (job / "summary.json").write_text(json.dumps({**summarize(job / "metrics.jsonl"), "status": "finished"}))
    best = 3.0 if lower else 8.0
    assert json.loads((job / "summary.json").read_text())[f"{metric}_best"] == best
    target = 1.0 if lower else 10.0  # never reached: the report shows the best value the job got
    markdown, _, _ = report([tmp_path / "sweep"], metrics=(f"{metric}_best",), curves=(metric,),
                            reach=[f"{metric}={target}"])
    assert f"steps to {metric}{'<=' if lower else '>='}{target:g} |" in markdown
    row = next(line for line in markdown.splitlines() if line.startswith("| (common overrides only) | 0 |"))
    assert row.endswith(f"| never (best {best:g}) |")
    assert f"| (common overrides only) | 1 | {best:.4f} |" in markdown  # the summary's *_best, as the report shows it
    assert log_y(metric) is lower


def test_runs_with_the_spike_recorder_get_a_spikes_column_counted_from_spikes_jsonl(tmp_path):
    rows = [{"trainer/step": 0, "train/loss": 1.0}, {"trainer/step": 9, "val/loss": 1.0, "val/acc": 0.5}]
    for i, (action, spikes) in enumerate([("log", 3), ("log", 1), ("rollback", 2), ("rollback", 0)]):
        job = write_job(tmp_path / str(i), [f"guard.spike.action={action}", f"seed={i}"], rows)
        (job / "spikes.jsonl").write_text("".join(json.dumps({"trainer/step": s}) + "\n" for s in range(spikes)))
    write_job(tmp_path / "0" / "replay" / "step_5", ["guard.spike.action=log"], rows)  # a replay: not a job
    markdown, groups, _ = report([tmp_path])
    header = next(line for line in markdown.splitlines() if line.startswith("| group"))
    assert header.split(" | ")[-1] == "spikes |"
    assert [g.values("spikes") for g in groups] == [[3.0, 1.0], [2.0, 0.0]]
    assert "| guard.spike.action=log | 2 |" in markdown and "| 2.0000 ± 1.4142 |" in markdown
    (tmp_path / "3" / "spikes.jsonl").unlink()  # a run whose recorder found no spike writes no file ...
    summary = json.loads((tmp_path / "3" / "summary.json").read_text())
    (tmp_path / "3" / "summary.json").write_text(json.dumps({**summary, "guard/spikes": 0}))
    assert report([tmp_path])[1][1].values("spikes") == [2.0, 0.0]  # ... and counts 0 (its summary says it was on)
    (tmp_path / "3" / "summary.json").write_text(json.dumps(summary))
    for i in range(3):
        (tmp_path / str(i) / "spikes.jsonl").unlink()
    again = report([tmp_path])[0]
    assert "spikes" not in next(line for line in again.splitlines() if line.startswith("| group"))  # no recorder

"""The report of ``tfmath reproduce``, its registry, and the command line."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tfmath import cli
from tfmath.report import (
    ExperimentResult,
    ReportError,
    RunSettings,
    Table,
    _registry,
    _writer,
    build_report,
    registered_experiments,
)


def test_worked_examples_are_registered():
    names = [e.name for e in registered_experiments()]
    assert "worked_examples" in names


def test_report_has_figures_data_and_index(tmp_path):
    out = tmp_path / "report"
    index = build_report(out, RunSettings(backend="cpu"), only=["worked_examples"])
    assert index == out / "index.html"
    folder = out / "worked_examples"
    for stem in ("attention_weights", "causal_attention_weights"):
        assert (folder / f"{stem}.png").read_bytes().startswith(b"\x89PNG")
        assert b"<svg" in (folder / f"{stem}.svg").read_bytes()
    data = json.loads((folder / "worked_examples.json").read_text())
    assert data["projection"]["largest_printed_error"]["A"] <= 0.02
    causal = json.loads((folder / "causal_projection_example.json").read_text())
    assert causal["max_difference_between_formulas"] == 0.0
    csv_lines = (folder / "projection_matrices.csv").read_text().splitlines()
    assert csv_lines[0] == "matrix,row,column,computed,printed,abs_difference"
    page = index.read_text()
    assert "worked_examples/attention_weights.png" in page and "0.05, 0.78, 0.17" in page


@pytest.fixture
def broken_experiment():
    @_registry.experiment("zz_broken", title="fails on purpose", order=10**6)
    def broken(settings):
        raise RuntimeError("experiment failed")

    yield "zz_broken"
    del _registry._EXPERIMENTS["zz_broken"]


def test_failure_leaves_previous_report_untouched(tmp_path, broken_experiment):
    out = tmp_path / "report"
    build_report(out, only=["worked_examples"])
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    with pytest.raises(RuntimeError, match="experiment failed"):
        build_report(out, only=["worked_examples", broken_experiment])
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    assert [p.name for p in tmp_path.iterdir()] == ["report"]  # no staging folder left


def test_rerun_replaces_the_report_cleanly(tmp_path):
    out = tmp_path / "report"
    build_report(out, only=["worked_examples"])
    (out / "stale.txt").write_text("from an older run")
    build_report(out, only=["worked_examples"])
    assert not (out / "stale.txt").exists()
    assert (out / "index.html").exists()


def test_refuses_to_overwrite_a_folder_that_is_not_a_report(tmp_path):
    (tmp_path / "precious.txt").write_text("mine")
    with pytest.raises(ReportError, match="not a tfmath report"):
        build_report(tmp_path, only=["worked_examples"])
    assert (tmp_path / "precious.txt").read_text() == "mine"


def test_unknown_experiment_is_refused(tmp_path):
    with pytest.raises(ReportError, match="unknown experiment"):
        build_report(tmp_path / "r", only=["no_such_thing"])


def test_table_columns_must_have_equal_length():
    with pytest.raises(ValueError, match="differ in length"):
        Table({"a": [1, 2], "b": [1]})


def test_experiment_result_defaults_are_empty():
    result = ExperimentResult(caption="nothing")
    assert result.figures == {} and result.tables == {} and result.data == {}


def test_cli_reproduce_and_info(tmp_path, capsys):
    out = str(tmp_path / "r")
    assert (
        cli.main(["reproduce", "--out", out, "--backend", "cpu", "--only", "worked_examples"]) == 0
    )
    assert (tmp_path / "r" / "index.html").exists()
    assert "done in" in capsys.readouterr().err
    assert cli.main(["reproduce", "--out", str(tmp_path / "r"), "--list"]) == 0
    assert "worked_examples" in capsys.readouterr().out
    assert cli.main(["info"]) == 0
    printed = capsys.readouterr().out
    assert "threading layer" in printed and "reference" in printed


def test_cli_reports_bad_output_folder(tmp_path, capsys):
    (tmp_path / "precious.txt").write_text("mine")
    assert cli.main(["reproduce", "--out", str(tmp_path)]) == 2
    assert "not a tfmath report" in capsys.readouterr().err


def test_cli_reports_a_folder_it_cannot_create_before_any_experiment(tmp_path, capsys, monkeypatch):
    _only_an_experiment_that_must_not_run(monkeypatch)
    (tmp_path / "a-file").write_text("mine")
    out = str(tmp_path / "a-file" / "report")
    assert cli.main(["reproduce", "--out", out, "--only", "worked_examples"]) == 2
    error = capsys.readouterr().err
    assert "cannot write" in error and "a-file" in error and "Traceback" not in error
    assert (tmp_path / "a-file").read_text() == "mine"


@pytest.mark.parametrize("seed", ["-1", str(2**63)])
def test_cli_refuses_a_seed_no_generator_takes(tmp_path, capsys, monkeypatch, seed):
    _only_an_experiment_that_must_not_run(monkeypatch)
    out = tmp_path / "r"
    assert cli.main(["reproduce", "--out", str(out), "--seed", seed]) == 2
    assert "seed" in capsys.readouterr().err
    assert not out.exists()


def _only_an_experiment_that_must_not_run(monkeypatch):
    def must_not_run(settings):
        raise AssertionError("an experiment ran although the arguments were refused")

    tripwire = _registry.Experiment("worked_examples", "a tripwire", 1, must_not_run)
    monkeypatch.setattr(_writer, "registered_experiments", lambda: [tripwire])


_HOLD_A_STAGING_FOLDER = """
import sys, time
from pathlib import Path
from tfmath.report._staging import staging_folder
with staging_folder(Path(sys.argv[1]), ".tfmath-report", "tfmath\\n") as staging:
    (staging / "half-written.txt").write_text("...")
    print(staging, flush=True)
    time.sleep(600)
"""


def test_staging_folders_of_killed_runs_are_removed_and_live_ones_kept(tmp_path):
    out = tmp_path / "report"
    mine = tmp_path / ".report.mine"  # the user's own folder, which merely looks like one
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", _HOLD_A_STAGING_FOLDER, str(out)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    killed, live = runs
    staged = [Path(run.stdout.readline().strip()) for run in runs]
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        build_report(out, RunSettings(backend="cpu"), only=["worked_examples"])
        assert not staged[0].exists(), "a killed run's staging folder was left"
        assert staged[1].exists(), "a live run's staging folder was removed"
        assert (mine / "notes.txt").read_text() == "keep me"
    finally:
        live.kill()
        live.wait()
    build_report(out, RunSettings(backend="cpu"), only=["worked_examples"])
    leftovers = sorted(p.name for p in tmp_path.iterdir())
    assert leftovers == [".report.mine", "report"]


def test_only_tfmaths_own_leftovers_are_removed(tmp_path):
    # A user's copy of a report named like a staging folder (it holds the report marker)
    # and an empty folder of theirs were removed; a retired report whose deletion was
    # interrupted after its marker went was never removed.
    from tfmath.report._staging import remove_abandoned

    out = tmp_path / "report"
    copy = tmp_path / ".report.2026-11-29"  # a dated copy of yesterday's report
    copy.mkdir()
    (copy / ".tfmath-report").write_text("tfmath\n")
    lookalike = tmp_path / ".report.abcd1234"  # tempfile's form, but no lock file beside it
    lookalike.mkdir()
    killed = tmp_path / ".report.k1ll3d_x"  # a killed run's staging folder and its lock
    killed.mkdir()
    (killed / ".tfmath-report").write_text("tfmath\n")
    (tmp_path / ".report.k1ll3d_x.lock").write_text("")
    retired = tmp_path / ".report.old.r3t1r3d_"  # half deleted: no marker left
    (retired / "report" / "figures").mkdir(parents=True)
    removed = remove_abandoned(out, ".tfmath-report")
    assert sorted(p.name for p in removed) == [".report.k1ll3d_x", ".report.old.r3t1r3d_"]
    assert copy.exists() and lookalike.exists()
    assert not (tmp_path / ".report.k1ll3d_x.lock").exists()


def test_cli_output_read_in_part_ends_quietly():
    """``tfmath info | head -1``: the reader closes the pipe, and tfmath stops without a
    BrokenPipeError traceback."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tfmath", "info"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,
    )
    assert process.stdout.read(1)
    process.stdout.close()
    error = process.stderr.read().decode()
    assert process.wait(timeout=120) == 0, error
    assert "Traceback" not in error

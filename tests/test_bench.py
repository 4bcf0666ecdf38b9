"""tfmath.tools.bench: the benchmark runs end to end (its numbers are never asserted)."""

import numpy as np
import pytest

import tfmath
from tfmath import _cuda, cli
from tfmath.analysis import timing
from tfmath.tools import bench


@pytest.fixture(autouse=True)
def no_settling(monkeypatch):
    monkeypatch.setattr(timing, "SETTLE_SECONDS", 0)


def test_interleaved_best_times_take_the_contenders_in_turn(monkeypatch):
    order = []
    durations = iter([5.0, 4.0, 9.0, 8.0, 3.0, 6.0, 7.0, 1.0])

    def fake_timed(call):
        call()
        return next(durations)

    monkeypatch.setattr(timing, "_timed", fake_timed)
    calls = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    best = timing.interleaved_best_times(calls, repeats=2, rounds=2)
    # One untimed warm-up per contender in the first round only.
    assert order == ["a"] * 3 + ["b"] * 3 + ["a"] * 2 + ["b"] * 2
    assert best == {"a": 3.0, "b": 1.0}


def test_attention_rows_time_every_contender_on_the_cpu():
    rows = bench.attention_rows([16], heads=1, head_dim=4, repeats=1)
    names = {name for _, _, name, _, _ in rows}
    assert {"tfmath flash", "tfmath naive", "numpy"} <= names
    assert {causal for _, causal, *_ in rows} == {False, True}
    assert all(seconds > 0 and np.isfinite(rate) for *_, seconds, rate in rows)


def test_training_step_rows_time_tfmath_and_torch_when_present():
    rows = bench.training_step_rows(n=16, heads=1, head_dim=4, repeats=1)
    assert rows[0][0] == "tfmath flash fwd+bwd" and rows[0][1] > 0
    assert len(rows) == (2 if bench.optional_torch() is not None else 1)


def test_numpy_attention_is_attention():
    rng = np.random.default_rng(0)
    query, key, value = (rng.standard_normal((2, 5, 3)) for _ in range(3))
    for is_causal in (False, True):
        expected = tfmath.scaled_dot_product_attention(
            query, key, value, is_causal=is_causal, backend="reference"
        )
        np.testing.assert_allclose(
            bench.numpy_attention(query, key, value, is_causal), expected, rtol=1e-12
        )


def test_bench_on_cuda_without_a_gpu_says_why(monkeypatch, capsys):
    monkeypatch.setattr(_cuda, "status", lambda: _cuda.CudaStatus(False, False, "no GPU here"))
    assert cli.main(["bench", "attention", "--backend", "cuda"]) == 2
    assert "no GPU here" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("arguments", "words"),
    [
        (["training", "--calls"], "--calls is for dropin"),
        (["dropin", "--anatomy"], "--anatomy is for training"),
        (["attention", "--threads", "1"], "--threads is for training, not attention"),
        (["dropin", "--threads", "1"], "--threads is for training, not dropin"),
        (["training", "--backend", "cuda"], "--backend is for attention"),
        (["training", "--matrix"], "--matrix is for attention"),
        (["attention", "--matrix", "--small"], "one report at a time: --matrix or --small"),
        (["attention", "--variants", "--quick"], "--variants has no --quick form"),
        (["training", "--anatomy", "--quick"], "--anatomy has no --quick form"),
        (["training", "--threads", "0"], "--threads must be from 1"),
        (["training", "--threads", "999"], "NUMBA_NUM_THREADS"),
    ],
)
def test_bench_refuses_options_that_make_no_report_before_any_work(
    arguments, words, capsys, monkeypatch
):
    """Every option either shapes the report or is refused: they were ignored (the
    training report on its own threads with --threads 999 gave PyTorch 999 threads and
    tfmath 2, and printed ratios of 400)."""
    monkeypatch.setattr(cli, "_print_machine", lambda: pytest.fail("work started"))
    assert cli.main(["bench", *arguments]) == 2
    assert words in capsys.readouterr().err


def test_bench_dropin_without_pytorch_says_so_and_fails(capsys, monkeypatch):
    monkeypatch.setattr(bench, "optional_torch", lambda backend="cpu": None)
    monkeypatch.setattr(cli, "_print_machine", lambda: pytest.fail("work started"))
    assert cli.main(["bench", "dropin"]) == 2
    assert "needs PyTorch" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.skipif(not _cuda.status().real_gpu, reason="timings on the simulator mean nothing")
def test_attention_rows_on_a_gpu():
    rows = bench.attention_rows([64], heads=1, head_dim=8, repeats=1, backend="cuda")
    assert all(seconds > 0 for *_, seconds, _ in rows)


def test_matrix_rows_time_tfmath_and_torch_on_every_kind_of_workload():
    from tfmath.tools import workloads as w

    tiny = [
        w.Workload("forward", w.forward(1, 2, 32, 8, mask=w.key_padding)),
        w.Workload("alibi", w.forward(1, 2, 32, 8, mask=w.alibi)),
        w.Workload("decode", w.decoding(1, 4, 2, 64, 8)),
        w.Workload("step", w.training_step(1, 2, 32, 8, mask=w.additive)),
    ]
    rows = list(bench.matrix_rows(tiny, repeats=1, rounds=1))
    assert [row[0].name for row in rows] == [w.name for w in tiny]
    has_torch = bench.optional_torch() is not None
    for _, case, times in rows:
        assert times["tfmath"] > 0 and ("torch" in times) == has_torch
        assert (case.flops is None) != (case.bytes_read is None)


def test_matrix_workload_names_are_unique():
    from tfmath.tools.workloads import MATRIX

    names = [w.name for w in MATRIX]
    assert len(names) == len(set(names))


@pytest.mark.parametrize(
    "name", ["causal", "window", "alibi", "sinks", "varlen", "flex score_mod", "flex block_mask"]
)
def test_each_variants_peer_computes_the_same_attention(name):
    """The rows of ``tfmath bench attention --variants`` time like against like: the
    SDPA call with the dense mask or bias gives the variant's output (float32)."""
    torch = pytest.importorskip("torch")
    from tfmath.tools.variant_workloads import variant

    case = variant(name, length=320)(np.random.default_rng(0), torch)
    expected = case.torch().numpy()
    np.testing.assert_allclose(np.asarray(case.tfmath()), expected, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_each_user_score_mod_computes_its_built_in_modification(dtype):
    """The user-against-built-in rows of ``tfmath bench attention --variants`` time
    like against like (outputs, and gradients for the fwd+bwd row)."""
    from tfmath.tools.variant_workloads import user_and_built_in_pairs

    pairs = user_and_built_in_pairs(dtype, np.random.default_rng(0), length=96)
    assert len(pairs) == 4
    # Attention tolerance for E = 64, S = 96 (tests/_tolerances.py), the soft cap's
    # tanh being a few ulp.
    tolerance = 8 * np.finfo(dtype).eps * (64 + 96 + 8)
    for built_in, user in pairs.values():
        expected, actual = built_in(), user()
        if not isinstance(expected, tuple):  # a forward's output; else the gradients
            expected, actual = (expected,), (actual,)
        for a, e in zip(actual, expected, strict=True):
            if e is None:  # a gradient neither has (sinks, a bias table)
                assert a is None
            else:
                np.testing.assert_allclose(a, e, rtol=tolerance, atol=tolerance)


def test_variant_rows_without_a_peer_are_listed():
    from tfmath.tools.variant_workloads import VARIANTS, has_peer

    names = [w.name for w in VARIANTS]
    assert len(names) == len(set(names))
    assert [n for n in names if not has_peer(n)] == ["softcap fwd", "softcap fwd+bwd"]


def test_every_variant_row_runs_without_pytorch():
    """Without PyTorch (asv's environment) the fwd+bwd rows time tfmath's NumPy gradient
    functions; they raised AttributeError (``.detach()`` of an array) instead."""
    from tfmath.tools.variant_workloads import VARIANT_NAMES, variant

    for name in VARIANT_NAMES:
        forward = variant(name, length=64)(np.random.default_rng(0), None)
        backward = variant(name, backward=True, length=64)(np.random.default_rng(0), None)
        assert forward.torch is None and backward.torch is None
        output = np.asarray(forward.tfmath())
        grads = backward.tfmath()
        assert output.shape == (1, 8, 64, 64)
        assert [np.shape(g) for g in grads[:3]] == [(1, 8, 64, 64)] * 3
        assert all(np.isfinite(g).all() for g in grads[:3])


def test_key_padding_rows_count_only_the_attended_pairs():
    """The padded quarter of the keys is never computed, so it is not counted: the row
    read 127% of the GEMM roof with it counted."""
    from tfmath.tools.workloads import workload

    rng = np.random.default_rng(0)
    for plain, padded in [
        ("d=64 L=2048", "key padding (B,1,1,S) L=2048"),
        ("fwd+bwd L=2048", "fwd+bwd key padding L=2048"),
    ]:
        ratio = workload(padded).build(rng, None).flops / workload(plain).build(rng, None).flops
        assert ratio == 0.75


@pytest.mark.parametrize(
    ("variable", "value", "words"),
    [
        ("TFMATH_THREADING_LAYER", "bogus", "TFMATH_THREADING_LAYER must be one of"),
        ("NUMBA_NUM_THREADS", "0", "NUMBA_NUM_THREADS must be a positive integer"),
    ],
)
def test_an_environment_no_command_can_run_in_is_refused_before_any_work(
    variable, value, words, capsys, monkeypatch
):
    """Half a report and a traceback came out before."""
    monkeypatch.setenv(variable, value)
    monkeypatch.setattr(cli, "_print_machine", lambda: pytest.fail("work started"))
    assert cli.main(["bench", "attention", "--quick"]) == 2
    assert words in capsys.readouterr().err


def test_a_threading_layer_numba_cannot_load_is_refused_before_any_work(capsys, monkeypatch):
    """TBB named but not installed: the first parallel kernel failed, partway through a
    report or a benchmark."""
    from tfmath import _jit

    monkeypatch.setitem(_jit._LAYER_MODULES, "tbb", "tfmath_tests_no_such_layer")
    monkeypatch.setenv("TFMATH_THREADING_LAYER", "tbb")
    monkeypatch.setattr(cli, "_print_machine", lambda: pytest.fail("work started"))
    assert cli.main(["bench", "attention", "--quick"]) == 2
    assert "which Numba cannot load here" in capsys.readouterr().err


def test_the_cli_writes_to_a_terminal_that_is_not_utf8():
    """reproduce --list on an ASCII stdout raised UnicodeEncodeError at its first "·"."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    completed = subprocess.run(
        [sys.executable, "-m", "tfmath", "reproduce", "--list"],
        env=env, capture_output=True, text=True, encoding="ascii", errors="replace",
    )  # fmt: skip
    assert completed.returncode == 0 and "Traceback" not in completed.stderr
    assert "worked_examples" in completed.stdout

"""``tfmath bench``: side-by-side timings of tfmath's kernels and their peers.

Speed claims live here and in the asv suite, never in pass/fail tests. Every
number is measured in the same process and run as a ratio against a peer
(PyTorch, when importable) or against the machine's roof (NumPy's float32
GEMM rate), so runs on different machines stay comparable.
"""

import math
import os
import subprocess
import sys
import warnings

import numpy as np

from tfmath.analysis.timing import ROUNDS, best_time, interleaved_best_times
from tfmath.attention import attention_grad, scaled_dot_product_attention


def gemm_roof(size=2048, repeats=5):
    """Float32 GEMM rate of NumPy's BLAS on this machine, in GFLOP/s (best of ``repeats``)."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((size, size), dtype=np.float32) for _ in range(2))
    a @ b
    best = best_time(lambda: a @ b, repeats)
    return 2 * size**3 / best / 1e9


def _synchronizer(backend, torch):
    """A call that waits for queued GPU work, so a timing covers the kernels, not their launch."""
    if backend != "cuda":
        return lambda: None
    from tfmath import _cuda

    cuda = _cuda.numba_cuda()
    if torch is None:
        return cuda.synchronize
    return lambda: (cuda.synchronize(), torch.cuda.synchronize())


def numpy_attention(query, key, value, is_causal):
    """Attention in plain NumPy, the way most people first write it."""
    scores = query @ np.swapaxes(key, -1, -2) / query.dtype.type(math.sqrt(query.shape[-1]))
    if is_causal:
        n_query, n_key = scores.shape[-2:]
        scores = np.where(np.tril(np.ones((n_query, n_key), bool)), scores, -np.inf)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (scores / scores.sum(axis=-1, keepdims=True)) @ value


def optional_torch(backend="cpu"):
    """torch, when importable (and built with CUDA when ``backend="cuda"``), else ``None``."""
    try:
        import torch
    except ImportError:
        return None
    if backend == "cuda" and not torch.cuda.is_available():
        return None
    return torch


def _contenders(query, key, value, is_causal, torch, backend):
    """The forward implementations to time on ``backend``, by name.

    On ``cuda`` the inputs already live in GPU memory (as torch tensors when
    torch is importable, which tfmath reads in place); every call ends by
    synchronising the device.
    """
    synchronize = _synchronizer(backend, torch)

    def tfmath_method(method):
        def call():
            scaled_dot_product_attention(
                query, key, value, is_causal=is_causal, method=method, backend=backend
            )
            synchronize()

        return call

    contenders = {"tfmath flash": tfmath_method("flash"), "tfmath naive": tfmath_method("naive")}
    if backend == "cpu":
        contenders["numpy"] = lambda: numpy_attention(query, key, value, is_causal)
    if torch is not None:
        sdpa = torch.nn.functional.scaled_dot_product_attention
        tensors = [torch.as_tensor(a) for a in (query, key, value)]

        def torch_call():
            sdpa(*tensors, is_causal=is_causal)
            synchronize()

        contenders["torch sdpa"] = torch_call
    return contenders


def _inputs(rng, shape, backend, torch, count):
    """``count`` float32 standard-normal arrays of ``shape`` placed where ``backend`` runs."""
    arrays = [rng.standard_normal(shape, dtype=np.float32) for _ in range(count)]
    if backend != "cuda":
        return arrays
    if torch is not None:
        return [torch.from_numpy(a).cuda() for a in arrays]
    from tfmath import _cuda

    return [_cuda.to_device(a) for a in arrays]


def attention_rows(lengths, heads=8, head_dim=64, repeats=2, backend="cpu", rounds=ROUNDS):
    """Forward timings of every contender: rows ``(L, causal, name, seconds, GFLOP/s)``,
    each the best of ``rounds * repeats`` calls (:func:`interleaved_best_times`)."""
    torch = optional_torch(backend)
    rng = np.random.default_rng(0)
    rows = []
    for n in lengths:
        shape = (1, heads, n, head_dim)
        query, key, value = _inputs(rng, shape, backend, torch, 3)
        for is_causal in (False, True):
            flops = 4 * n * n * head_dim * heads / (2 if is_causal else 1)
            contenders = _contenders(query, key, value, is_causal, torch, backend)
            times = interleaved_best_times(contenders, repeats, rounds)
            rows.extend((n, is_causal, name, s, flops / s / 1e9) for name, s in times.items())
    return rows


def training_step_rows(n=2048, heads=8, head_dim=64, repeats=3, backend="cpu", rounds=ROUNDS):
    """Forward + backward timings at one length, tfmath flash against torch autograd,
    as ``(name, seconds)`` rows (:func:`interleaved_best_times`)."""
    torch = optional_torch(backend)
    synchronize = _synchronizer(backend, torch)
    rng = np.random.default_rng(1)
    shape = (1, heads, n, head_dim)
    query, key, value, grad = _inputs(rng, shape, backend, torch, 4)

    def tfmath_step():
        # As autograd does, the backward reuses what the forward saved.
        output, log_sum_exp = scaled_dot_product_attention(
            query, key, value, return_log_sum_exp=True, backend=backend
        )
        attention_grad(
            query, key, value, grad, output=output, log_sum_exp=log_sum_exp, backend=backend
        )
        synchronize()

    steps = {"tfmath flash fwd+bwd": tfmath_step}
    if torch is not None:
        tensors = [torch.as_tensor(a).clone().requires_grad_() for a in (query, key, value)]
        torch_grad = torch.as_tensor(grad)

        def torch_step():
            out = torch.nn.functional.scaled_dot_product_attention(*tensors)
            out.backward(torch_grad)
            synchronize()

        steps["torch sdpa fwd+bwd"] = torch_step
    return list(interleaved_best_times(steps, repeats, rounds).items())


_FIRST_CALL = """
import time
import numpy as np
q = np.random.default_rng(0).standard_normal((1, 8, 1024, 64), dtype=np.float32)
import tfmath
start = time.perf_counter()
tfmath.scaled_dot_product_attention(q, q, q, backend="cpu")
first = time.perf_counter() - start
start = time.perf_counter()
tfmath.scaled_dot_product_attention(q, q, q, backend="cpu")
print(first, time.perf_counter() - start)
"""


def first_call_seconds(cache=True):
    """First and second call of attention in a fresh process: ``(first, second)`` seconds.

    With the on-disk kernel cache (``cache=True``, after any earlier run) the
    first call only loads the compiled kernels; with ``cache=False``
    (``TFMATH_CACHE=0``) it compiles them, as the very first run on a machine does.
    """
    environment = dict(os.environ, TFMATH_CACHE="1" if cache else "0")
    result = subprocess.run(
        [sys.executable, "-c", _FIRST_CALL],
        capture_output=True, text=True, check=True, env=environment,
    )  # fmt: skip
    first, second = (float(x) for x in result.stdout.split())
    return first, second


def gpu_gemm_roof(torch, size=8192, repeats=5):
    """Float32 GEMM rate of the GPU through torch (TF32 off), in GFLOP/s, or ``None``."""
    if torch is None:
        return None
    generator = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(size, size, device="cuda", generator=generator) for _ in range(2))
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        seconds = best_time(lambda: (a @ b, torch.cuda.synchronize()), repeats)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    return 2 * size**3 / seconds / 1e9


def print_attention_report(quick=False, backend="cpu", out=print):
    """Run the attention benchmark and print its tables (``tfmath bench attention``)."""
    lengths = [512, 1024] if quick else [512, 1024, 2048, 4096]
    if backend == "cuda":
        roof = gpu_gemm_roof(optional_torch(backend))
        roof_name = "torch matmul 8192x8192 on the GPU, TF32 off"
    else:
        roof = gemm_roof()
        roof_name = "NumPy matmul 2048x2048"
    if roof is None:
        out("float32 GEMM roof: not measured (needs torch built with CUDA)")
    else:
        out(f"float32 GEMM roof ({roof_name}): {roof:.1f} GFLOP/s")
    out(f"backend={backend}, B=1, H=8, d=64, float32; FLOPs = 4*L*S*d*H (half when causal); "
        f"best of {ROUNDS} rounds that take the contenders in turn, 2 forward calls or "
        "3 forward + backward steps each")  # fmt: skip
    with warnings.catch_warnings():
        # Numba flags grids smaller than the GPU for the short sequences; for a
        # benchmark that sweeps lengths on purpose, that is expected, not news.
        warnings.filterwarnings("ignore", message=".*will likely result in GPU under-utilization")
        rows = attention_rows(lengths, backend=backend)
    out(f"{'L':>6} {'causal':>6}  {'contender':<14} {'time (ms)':>10} {'GFLOP/s':>8} "
        f"{'% roof':>7} {'flash speed-up':>15}")  # fmt: skip
    flash_times = {(n, c): s for n, c, name, s, _ in rows if name == "tfmath flash"}
    for n, is_causal, name, seconds, rate in rows:
        speedup = seconds / flash_times[(n, is_causal)]
        share = "" if roof is None else f"{100 * rate / roof:.0f}%"
        out(f"{n:>6} {is_causal!s:>6}  {name:<14} {seconds * 1e3:>10.2f} {rate:>8.1f} "
            f"{share:>7} {speedup:>14.2f}x")  # fmt: skip
    gains = ", ".join(f"L={n}: {flash_times[(n, False)] / flash_times[(n, True)]:.2f}x"
                      for n in lengths)  # fmt: skip
    out(f"flash causal speed-up over non-causal: {gains}")
    steps = training_step_rows(1024 if quick else 2048, backend=backend)
    out("forward + backward at L=" + ("1024" if quick else "2048") + ":")
    for name, seconds in steps:
        out(f"  {name:<22} {seconds * 1e3:>10.2f} ms")
    if len(steps) == 2:
        out(f"  torch time / tfmath time: {steps[1][1] / steps[0][1]:.2f}")
    if backend == "cpu":
        cold, _ = first_call_seconds(cache=False)
        warm, second = first_call_seconds(cache=True)
        out(f"first call in a fresh process (L=1024, H=8): {cold * 1e3:.0f} ms compiling "
            f"(cold), {warm * 1e3:.0f} ms from the kernel cache (warm); "
            f"any later call: {second * 1e3:.0f} ms")  # fmt: skip


def matrix_rows(workloads, repeats=2, rounds=ROUNDS):
    """Time every workload, tfmath against its peers in alternating rounds: yields rows
    ``(workload, case, {contender: seconds per call})`` one by one, as they are
    measured (a report prints each at once)."""
    torch = optional_torch()
    rng = np.random.default_rng(0)
    for item in workloads:
        case = item.build(rng, torch)
        times = interleaved_best_times(case.repeated().contenders(), repeats, rounds)
        yield item, case, {name: t / case.calls for name, t in times.items()}
        del case  # free this row's inputs before the next row's


def print_matrix_report(out=print):
    """``tfmath bench attention --matrix``: every workload of
    :data:`tfmath.tools.workloads.MATRIX`, tfmath against PyTorch, with the roofs."""
    from tfmath.tools.workloads import MATRIX, read_bandwidth

    roof = gemm_roof()
    bandwidth = read_bandwidth()
    out(f"float32 GEMM roof (NumPy matmul 2048x2048): {roof:.1f} GFLOP/s; read "
        f"bandwidth (NumPy sum over 512 MB, one core): {bandwidth / 1e9:.1f} GB/s")  # fmt: skip
    out(
        f"backend=cpu; best of {ROUNDS} rounds that take tfmath and torch in turn, "
        "2 calls each; ratio = torch time / tfmath time (> 1: tfmath faster)"
    )
    out(f"{'workload':<34} {'tfmath ms':>10} {'torch ms':>10} {'ratio':>6}  rate")
    for item, case, times in matrix_rows(MATRIX):
        seconds, torch_seconds = times["tfmath"], times.get("torch")
        if case.flops is not None:
            rate = case.flops / seconds / 1e9
            share = 100 * rate / (roof * case.roof_multiple)
            roof_text = "GEMM roof" if case.roof_multiple == 1 else "2x GEMM roof, vdpbf16ps"
            rate_text = f"{rate:7.1f} GFLOP/s ({share:.0f}% of {roof_text})"
        else:
            rate = case.bytes_read / seconds
            rate_text = f"{rate / 1e9:7.1f} GB/s ({100 * rate / bandwidth:.0f}% of read bandwidth)"
        torch_text = "n/a" if torch_seconds is None else f"{torch_seconds * 1e3:.2f}"
        ratio = "" if torch_seconds is None else f"{torch_seconds / seconds:.2f}"
        out(f"{item.name:<34} {seconds * 1e3:>10.2f} {torch_text:>10} {ratio:>6}  {rate_text}")


#: Rounds of the small rows. A small row's timing lasts milliseconds, and this shared
#: machine switches between a fast and a slow state for seconds at a time (the same
#: 256-value softmax took 1.7 and 2.7 microseconds in runs minutes apart): rounds
#: spread over a few seconds let the best of each contender come from the fast state.
SMALL_ROUNDS = 10

_ALONE = """
import sys, numpy as np
from tfmath.analysis.timing import interleaved_best_times
from tfmath.tools.workloads import workload
name, contender, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch = None
if contender == "torch":
    import torch
case = workload(name).build(np.random.default_rng(0), torch)
call = case.repeated().contenders()[contender]
print(interleaved_best_times({"call": call}, 3, rounds)["call"] / case.calls)
"""


def alone_seconds(name, contender):
    """Seconds per call of one contender of a workload, in a fresh process that loads only
    its own library (so no other library's thread pool is there to interfere)."""
    result = subprocess.run(
        [sys.executable, "-c", _ALONE, name, contender, str(SMALL_ROUNDS)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return float(result.stdout.split()[-1])


def print_small_report(out=print):
    """``tfmath bench attention --small``: the per-call cost of small problems, tfmath
    against PyTorch (and NumPy where it is the peer), each library alone in its own
    process, then both loaded and called in turn in one process."""
    from tfmath.tools.workloads import SMALL

    has_torch = optional_torch() is not None
    out("per-call times in microseconds; ratio = tfmath time / peer time (the goal: <= 1.5 "
        "against torch; for softmax, <= 1 against NumPy)")  # fmt: skip
    header = ["alone: tfmath", "torch", "ratio", "together: tfmath", "torch", "ratio", "numpy"]
    widths = [13, 8, 6, 17, 8, 6, 8, 6]
    columns = [f"{title:>{width}}" for title, width in zip([*header, "ratio"], widths, strict=True)]
    out(f"{'workload':<22} " + " ".join(columns))
    together = {
        item.name: times for item, _, times in matrix_rows(SMALL, repeats=3, rounds=SMALL_ROUNDS)
    }
    for item in SMALL:
        alone = {"tfmath": alone_seconds(item.name, "tfmath")}
        if has_torch:
            alone["torch"] = alone_seconds(item.name, "torch")
        both = together[item.name]
        cells = [f"{item.name:<22}", _microseconds(alone, "tfmath", 13)]
        cells += [_microseconds(alone, "torch", 8), _ratio(alone, "torch")]
        cells += [_microseconds(both, "tfmath", 17), _microseconds(both, "torch", 8)]
        cells += [_ratio(both, "torch"), _microseconds(both, "numpy", 8), _ratio(both, "numpy")]
        out(" ".join(cells))


def print_variants_report(out=print):
    """``tfmath bench attention --variants``: every variant of
    :data:`tfmath.tools.variant_workloads.VARIANTS` against PyTorch's SDPA with the
    equivalent dense mask or bias, the sliding window's cost against L, and user
    score_mods against the same modification built in."""
    from tfmath.tools.variant_workloads import VARIANTS, user_against_built_in, window_scaling

    out(
        f"backend=cpu; best of {ROUNDS} rounds that take tfmath and torch in turn, "
        "2 calls each; ratio = torch time / tfmath time (> 1: tfmath faster); the peer is "
        "SDPA with the equivalent dense mask or bias (n/a: none exists)"
    )
    title = "variant (B=1 H=8 L=2048 d=64 float32)"
    out(f"{title:<40} {'tfmath ms':>10} {'torch ms':>10} {'ratio':>6}")
    for item, _, times in matrix_rows(VARIANTS):
        seconds, torch_seconds = times["tfmath"], times.get("torch")
        torch_text = "n/a" if torch_seconds is None else f"{torch_seconds * 1e3:.2f}"
        ratio = "" if torch_seconds is None else f"{torch_seconds / seconds:.2f}"
        out(f"{item.name:<40} {seconds * 1e3:>10.2f} {torch_text:>10} {ratio:>6}")
    out("")
    out("sliding window of 512 keys against full causal attention (H=1, d=64, float32)")
    out(f"{'L':>6} {'causal ms':>10} {'window ms':>10} {'causal / window':>16}")
    for length, causal, window in window_scaling():
        out(f"{length:>6} {causal * 1e3:>10.1f} {window * 1e3:>10.2f} {causal / window:>16.1f}")
    out("")
    out("a score_mod written by the user against the same modification built in")
    out(f"{'modification':<48} {'built-in ms':>12} {'score_mod ms':>13} {'ratio':>6}")
    for name, built_in, user in user_against_built_in():
        out(f"{name:<48} {built_in * 1e3:>12.1f} {user * 1e3:>13.1f} {user / built_in:>6.2f}")


def _microseconds(times, name, width):
    return f"{times[name] * 1e6:>{width}.1f}" if name in times else f"{'n/a':>{width}}"


def _ratio(times, peer):
    return f"{times['tfmath'] / times[peer]:>6.2f}" if peer in times else f"{'':>6}"

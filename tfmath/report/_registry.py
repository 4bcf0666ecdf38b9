"""The experiment registry behind ``tfmath reproduce``."""

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field

from tfmath._contract.checks import boolean_flag, integer
from tfmath.errors import ArgumentError

_EXPERIMENTS = {}


@dataclass(frozen=True)
class RunSettings:
    """How the report is being run, handed to every experiment.

    Attributes
    ----------
    quick : bool
        Small sizes that finish in seconds (the default run), or the full,
        publication-quality sizes.
    backend : str
        Backend for the experiment's tfmath calls.
    seed : int
        Seed for any randomness, so that a re-run reproduces the numbers.
    scheduler : str or None
        Address of a Dask scheduler for experiments whose independent runs
        can be farmed out (the scaling-law sweeps); None runs them in-process.
    corpus : str or None
        A UTF-8 text file for the compute-optimal sweep to train on as bytes;
        None trains on a synthetic language of known entropy.
    """

    quick: bool = True
    backend: str = "auto"
    seed: int = 0
    scheduler: str | None = None
    corpus: str | None = None

    def __post_init__(self):
        boolean_flag("quick", self.quick)
        # Experiments seed tfmath's random streams, which take [0, 2**64), with it and
        # with small offsets from it (one seed per run of a sweep).
        if integer("seed", self.seed, minimum=0) >= 2**63:
            raise ArgumentError(f"seed must lie in [0, 2**63), got {self.seed}")


@dataclass(frozen=True)
class Table:
    """A table of named columns, written as CSV and shown in the report.

    Attributes
    ----------
    columns : dict of str to sequence
        Column name to values; every column has the same length.
    """

    columns: dict

    def __post_init__(self):
        lengths = {len(values) for values in self.columns.values()}
        if len(lengths) > 1:
            raise ValueError(f"table columns differ in length: {sorted(lengths)}")

    @property
    def n_rows(self):
        return len(next(iter(self.columns.values()), ()))

    def rows(self):
        return zip(*self.columns.values(), strict=True)


@dataclass
class ExperimentResult:
    """What an experiment contributes to the report.

    Attributes
    ----------
    caption : str
        What the reader should see in the figures, in a sentence or three.
    figures : dict of str to matplotlib.figure.Figure
        Each saved as ``<name>.png`` and ``<name>.svg``.
    tables : dict of str to Table
        Each saved as ``<name>.csv`` and shown in the page.
    data : dict of str to object
        JSON-serialisable numbers behind the figures, each saved as ``<name>.json``.
    pages : dict of str to str
        Standalone HTML documents, each saved as ``<name>.html`` and shown in an
        ``<iframe>`` with a link to open it on its own.
    claims : list of tfmath.analysis.claims.Claim
        The seeds' claims this experiment computes; the report gathers them into
        its ledger, each linked to this experiment's section.
    """

    caption: str
    figures: dict = field(default_factory=dict)
    tables: dict = field(default_factory=dict)
    data: dict = field(default_factory=dict)
    pages: dict = field(default_factory=dict)
    claims: list = field(default_factory=list)


@dataclass(frozen=True)
class Experiment:
    """A registered experiment: a name, a title, an order in the report, and its function."""

    name: str
    title: str
    order: int
    run: Callable


def experiment(name, *, title, order=100):
    """Register the decorated function as a report experiment.

    Parameters
    ----------
    name : str
        Identifier, also the experiment's folder in the report; letters,
        digits and underscores.
    title : str
        Heading in the report.
    order : int, optional
        Experiments appear in increasing order, then by name.
    """
    if not name.replace("_", "").isalnum():
        raise ValueError(f"experiment name must be letters, digits and '_', got {name!r}")

    def decorate(function):
        if name in _EXPERIMENTS and _EXPERIMENTS[name].run is not function:
            raise RuntimeError(f"experiment {name!r} is registered twice")
        _EXPERIMENTS[name] = Experiment(name, title, order, function)
        return function

    return decorate


def registered_experiments():
    """Every experiment in :mod:`tfmath.experiments`, in report order."""
    import tfmath.experiments as package

    for module in pkgutil.iter_modules(package.__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{package.__name__}.{module.name}")
    return sorted(_EXPERIMENTS.values(), key=lambda e: (e.order, e.name))

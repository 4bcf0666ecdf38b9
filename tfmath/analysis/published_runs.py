"""Published training runs, shipped with tfmath for refitting: their C, N, D and loss,
and the authors' own numbers to compare a refit with.

:func:`porian2024` gives the IsoFLOP runs of Porian et al. (2024), 15 configurations
of one sweep that move from Kaplan et al.'s setup to Hoffmann et al.'s one choice at a
time, each with the exponent of :math:`N_{opt} \\propto C^a` the authors found. The
data, their provenance and licence are in ``tfmath/analysis/data/porian2024/``.
"""

import csv
from dataclasses import dataclass
from importlib import resources

import numpy as np

from tfmath._contract.checks import choice

__all__ = ["PORIAN2024_CONFIGURATIONS", "PublishedFit", "PublishedRuns", "porian2024"]


@dataclass(frozen=True)
class PublishedFit:
    """The authors' compute-optimal fit to a table of runs.

    Attributes
    ----------
    a, b : float
        :math:`N_{opt} \\propto C^a`, :math:`D_{opt} \\propto C^b`.
    a_interval, b_interval : tuple of float
        Their 95% intervals.
    left_out : tuple of float
        The budgets they left out.
    """

    a: float
    b: float
    a_interval: tuple
    b_interval: tuple
    left_out: tuple


@dataclass(frozen=True)
class PublishedRuns:
    """One table of published runs.

    Attributes
    ----------
    name : str
        ``"<source>:<configuration>"``.
    description : str
        What the configuration is, in the authors' words where they gave them.
    citation : str
    compute, n, d, loss : numpy.ndarray
        Each run's budget :math:`C` (FLOPs), parameters, tokens and final loss (nats).
    loss_std : float
        The loss noise of one run the authors' bootstrap drew.
    published : PublishedFit
        The authors' fit, to set beside a refit.
    """

    name: str
    description: str
    citation: str
    compute: np.ndarray
    n: np.ndarray
    d: np.ndarray
    loss: np.ndarray
    loss_std: float
    published: PublishedFit


_PORIAN_CITATION = (
    "T. Porian, M. Wortsman, J. Jitsev, L. Schmidt and Y. Carmon, Resolving discrepancies "
    "in compute-optimal scaling of language models, NeurIPS 2024 (arXiv:2406.19146); runs "
    "from github.com/formll/resolving-scaling-law-discrepancies, MIT licence"
)


def _read(name):
    path = resources.files("tfmath.analysis") / "data" / "porian2024" / name
    with path.open(encoding="utf-8", newline="") as handle:
        return list(csv.DictReader(handle))


#: The configurations of :func:`porian2024`, in the authors' order: RefinedWeb, then
#: OpenWebText2, then the appendix's attention-FLOP and tuned-Kaplan variants.
PORIAN2024_CONFIGURATIONS = tuple(row["configuration"] for row in _read("fits.csv"))


def porian2024(configuration):
    """The IsoFLOP runs of one of Porian et al.'s (2024) configurations.

    Parameters
    ----------
    configuration : str
        One of :data:`PORIAN2024_CONFIGURATIONS`, named
        ``<dataset>_<hyperparameters>_<warm-up>_<decay>_<N counted>_<loss>``: for
        example ``"rw_base_long_kaplan_kaplan_train"`` reproduces Kaplan et al.'s
        setup on RefinedWeb, ``"rw_tuned_short_const_standard_val"`` is the last step
        towards Hoffmann et al.'s.

    Returns
    -------
    PublishedRuns
        Every run at every budget (12 budgets from 1.25e16 to 2.56e19 FLOPs, 5 to 16
        sizes each), with the authors' exponents. Each run's loss is read off its
        training curve at exactly its budget, so budgets are equal within a curve.

    Examples
    --------
    >>> from tfmath.analysis.published_runs import porian2024
    >>> runs = porian2024("rw_tuned_short_const_standard_val")
    >>> runs.compute.size, runs.published.a
    (121, 0.4969)
    """
    configuration = choice("configuration", configuration, PORIAN2024_CONFIGURATIONS)
    fit = next(row for row in _read("fits.csv") if row["configuration"] == configuration)
    rows = [row for row in _read("isoflop_runs.csv") if row["configuration"] == configuration]
    compute, n, d, loss = (
        np.array([float(row[key]) for row in rows]) for key in ("compute", "n", "d", "loss")
    )
    left_out = tuple(float(c) for c in fit["left_out"].split(";") if c)
    return PublishedRuns(
        name=f"porian2024:{configuration}",
        description=(
            f"{fit['label']}: {fit['dataset']}, {fit['loss']} loss, N counted as "
            f"'{fit['parameters']}'"
        ),
        citation=_PORIAN_CITATION,
        compute=compute,
        n=n,
        d=d,
        loss=loss,
        loss_std=float(fit["loss_std"]),
        published=PublishedFit(
            a=float(fit["a"]),
            b=float(fit["b"]),
            a_interval=(float(fit["a_low"]), float(fit["a_high"])),
            b_interval=(float(fit["b_low"]), float(fit["b_high"])),
            left_out=left_out,
        ),
    )

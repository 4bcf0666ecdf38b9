"""Published training runs, shipped with tfmath for refitting: their C, N, D and loss,
and the authors' own numbers to compare a refit with.

* :func:`porian2024` gives the IsoFLOP runs of Porian et al. (2024), 15 configurations
  of one sweep that move from Kaplan et al.'s setup to Hoffmann et al.'s one choice at
  a time, each with the exponent of :math:`N_{opt} \\propto C^a` the authors found
  (approach 2 applies).
* :func:`gadre2024` gives the runs of Gadre et al. (2024) on three datasets, a grid of
  sizes and tokens per parameter (no two runs share a budget, so approach 3 applies),
  with the loss law the authors fitted to five of them and the larger runs it predicts.

The data, their provenance and licences are in ``tfmath/analysis/data/<source>/``.
"""

import csv
from dataclasses import dataclass
from importlib import resources

import numpy as np

from tfmath._contract.checks import choice
from tfmath.formulas.scaling import ChinchillaLaw

__all__ = [
    "GADRE2024_DATASETS",
    "PORIAN2024_CONFIGURATIONS",
    "PublishedFit",
    "PublishedLaw",
    "PublishedRuns",
    "gadre2024",
    "porian2024",
]


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
class PublishedLaw:
    """The loss law the authors fitted to some of the runs (approach 3's form).

    Attributes
    ----------
    law : ChinchillaLaw
        :math:`L = E + A/N^\\alpha + B/D^\\beta`.
    fitted : numpy.ndarray of bool
        The runs they fitted it to; the others are what it predicts.
    method : str
        How they fitted it.
    """

    law: ChinchillaLaw
    fitted: np.ndarray
    method: str


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
    loss_std : float or None
        The loss noise of one run the authors' bootstrap drew (None where they drew
        none).
    published : PublishedFit or PublishedLaw
        The authors' fit, to set beside a refit: their compute-optimal exponents, or
        their loss law.
    """

    name: str
    description: str
    citation: str
    compute: np.ndarray
    n: np.ndarray
    d: np.ndarray
    loss: np.ndarray
    loss_std: float | None
    published: PublishedFit | PublishedLaw


_PORIAN_CITATION = (
    "T. Porian, M. Wortsman, J. Jitsev, L. Schmidt and Y. Carmon, Resolving discrepancies "
    "in compute-optimal scaling of language models, NeurIPS 2024 (arXiv:2406.19146); runs "
    "from github.com/formll/resolving-scaling-law-discrepancies, MIT licence"
)


def _read(name, source="porian2024"):
    path = resources.files("tfmath.analysis") / "data" / source / name
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


_GADRE_CITATION = (
    "S. Y. Gadre, G. Smyrnis, V. Shankar, S. Gururangan, M. Wortsman, R. Shao, J. Mercat, "
    "A. Fang, J. Li, S. Keh et al., Language models scale reliably with over-training and "
    "on downstream tasks, arXiv:2403.08540 (2024); runs from github.com/mlfoundations/scaling, "
    "MIT licence"
)
#: The training sets of :func:`gadre2024`, and their names in the authors' files.
_GADRE_NAMES = {"c4": "c4_original", "redpajama": "rpj", "refinedweb": "rw_original"}
GADRE2024_DATASETS = tuple(_GADRE_NAMES)


def gadre2024(dataset):
    """The runs of Gadre et al. (2024) trained on one dataset.

    Parameters
    ----------
    dataset : {"c4", "redpajama", "refinedweb"}
        The training set. Every loss is measured on C4's validation set, as the
        authors fit it.

    Returns
    -------
    PublishedRuns
        34 or 35 runs: four small models (11M to 412M parameters, every parameter
        counted) at 5 to 640 tokens per parameter, and the 1.4B and 6.9B models the
        authors' law predicts; ``published`` is that law (a :class:`PublishedLaw`)
        with the five runs it was fitted to.

    Examples
    --------
    >>> from tfmath.analysis.published_runs import gadre2024
    >>> runs = gadre2024("redpajama")
    >>> runs.compute.size, int(runs.published.fitted.sum()), runs.published.law.alpha
    (35, 5, 0.272851)
    """
    dataset = choice("dataset", dataset, GADRE2024_DATASETS)
    name = _GADRE_NAMES[dataset]
    rows = [row for row in _read("runs.csv", "gadre2024") if row["dataset"] == name]
    fit = next(row for row in _read("fits.csv", "gadre2024") if row["dataset"] == name)
    compute, n, d, loss = (
        np.array([float(row[key]) for row in rows]) for key in ("compute", "n", "d", "loss")
    )
    return PublishedRuns(
        name=f"gadre2024:{dataset}",
        description=(
            f"trained on {dataset}, C4 validation loss; sizes 11M to 6.9B parameters at 5 to "
            "640 tokens per parameter"
        ),
        citation=_GADRE_CITATION,
        compute=compute,
        n=n,
        d=d,
        loss=loss,
        loss_std=None,
        published=PublishedLaw(
            law=ChinchillaLaw(**{key: float(fit[key]) for key in ("e", "a", "b", "alpha", "beta")}),
            fitted=np.array([row["in_fit"] == "1" for row in rows]),
            method=(
                "least squares on L with one exponent for N and D (alpha = beta), from 128 "
                "starting points, on the four small models at 20 tokens per parameter and "
                "the smallest at 320"
            ),
        ),
    )

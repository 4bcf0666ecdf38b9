"""The worked numerical examples of the seed texts, computed exactly.

Two texts work attention through by hand on three tokens:

* seed 003 (Naim, "The Transformer Architecture"): tokens ``X`` projected by
  ``W^Q, W^K, W^V`` to two-dimensional queries, keys and values;
* seed 004 (Métwalli and Elhefny, "The Transformer: Let's dive into math"):
  ``Q, K, V`` given directly.

The texts round loosely (seed 003 prints the first attention row as
0.05/0.78/0.17; it is 0.0454/0.7679/0.1867), so each example carries the
printed values beside the computed ones for comparison, never in place of them.
"""

from dataclasses import dataclass, field

import numpy as np

from tfmath.attention import scaled_dot_product_attention

__all__ = ["WorkedExample", "given_qkv_example", "projection_example"]


@dataclass(frozen=True)
class WorkedExample:
    """Every intermediate matrix of one worked attention example.

    Attributes
    ----------
    name, source : str
        Short name, and the seed text it comes from.
    inputs : dict of str to numpy.ndarray
        What the text starts from (``X`` and the projections, or ``Q, K, V``).
    query, key, value : numpy.ndarray
        :math:`Q, K, V`.
    scores : numpy.ndarray
        :math:`QK^\\top`.
    scaled_scores : numpy.ndarray
        :math:`QK^\\top / \\sqrt{d_k}`.
    weights : numpy.ndarray
        The attention matrix :math:`A = \\operatorname{softmax}(QK^\\top/\\sqrt{d_k})`.
    output : numpy.ndarray
        :math:`AV`.
    printed : dict of str to numpy.ndarray
        The values as the seed prints them (rounded), by the same names.
    """

    name: str
    source: str
    inputs: dict
    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    scores: np.ndarray
    scaled_scores: np.ndarray
    weights: np.ndarray
    output: np.ndarray
    printed: dict = field(default_factory=dict)

    def matrices(self):
        """All matrices of the example by name, inputs first, in the order of the text."""
        return {
            **self.inputs,
            "Q": self.query,
            "K": self.key,
            "V": self.value,
            "QK^T": self.scores,
            "QK^T/sqrt(d_k)": self.scaled_scores,
            "A": self.weights,
            "AV": self.output,
        }

    def largest_printed_error(self):
        """The largest absolute gap between a printed value and the computed one, per matrix."""
        computed = self.matrices()
        return {
            name: float(np.max(np.abs(computed[name] - printed)))
            for name, printed in self.printed.items()
        }


def _example(name, source, inputs, query, key, value, printed, backend):
    output, weights = scaled_dot_product_attention(
        query, key, value, return_weights=True, backend=backend
    )
    scores = query @ key.T
    return WorkedExample(
        name=name,
        source=source,
        inputs=inputs,
        query=query,
        key=key,
        value=value,
        scores=scores,
        scaled_scores=scores / np.sqrt(query.shape[-1]),
        weights=weights,
        output=output,
        printed=printed,
    )


def projection_example(*, backend="auto"):
    """Seed 003's example: three tokens of dimension 4 projected to ``d_k = d_v = 2``.

    Parameters
    ----------
    backend : {"auto", "cpu", "cuda", "reference"}, optional
        Backend of the attention step.

    Returns
    -------
    WorkedExample

    Examples
    --------
    >>> from tfmath.analysis.worked_examples import projection_example
    >>> example = projection_example(backend="reference")
    >>> example.scores
    array([[0., 4., 2.],
           [4., 0., 2.],
           [2., 2., 2.]])
    """
    x = np.array([[1, 0, 1, 0], [0, 1, 0, 1], [1, 1, 0, 0]], dtype=np.float64)
    w_q = np.array([[1, 0], [0, 1], [1, 0], [0, 1]], dtype=np.float64)
    w_k = np.array([[0, 1], [1, 0], [0, 1], [1, 0]], dtype=np.float64)
    w_v = np.array([[1, 1], [0, 0], [1, 0], [0, 1]], dtype=np.float64)
    printed = {
        "Q": np.array([[2, 0], [0, 2], [1, 1]], dtype=np.float64),
        "K": np.array([[0, 2], [2, 0], [1, 1]], dtype=np.float64),
        "V": np.array([[2, 1], [0, 1], [1, 1]], dtype=np.float64),
        "QK^T": np.array([[0, 4, 2], [4, 0, 2], [2, 2, 2]], dtype=np.float64),
        "QK^T/sqrt(d_k)": np.array([[0, 2.83, 1.41], [2.83, 0, 1.41], [1.41, 1.41, 1.41]]),
        "A": np.array([[0.05, 0.78, 0.17], [0.78, 0.05, 0.17], [0.33, 0.33, 0.33]]),
        "AV": np.array([[0.27, 1.0], [1.73, 1.0], [1.0, 1.0]]),
    }
    return _example(
        "projection",
        "seed 003 (Naim, The Transformer Architecture), worked example",
        {"X": x, "W^Q": w_q, "W^K": w_k, "W^V": w_v},
        x @ w_q,
        x @ w_k,
        x @ w_v,
        printed,
        backend,
    )


def given_qkv_example(*, backend="auto"):
    """Seed 004's example: ``Q = K`` given directly, ``V = [[1, 2], [3, 4], [5, 6]]``.

    The text shows the steps and the code but prints no numbers after
    ``QK^T``, so only ``QK^T`` has printed values.

    Parameters
    ----------
    backend : {"auto", "cpu", "cuda", "reference"}, optional
        Backend of the attention step.

    Returns
    -------
    WorkedExample
    """
    query = np.array([[1, 0], [0, 1], [1, 1]], dtype=np.float64)
    value = np.array([[1, 2], [3, 4], [5, 6]], dtype=np.float64)
    printed = {"QK^T": np.array([[1, 0, 1], [0, 1, 1], [1, 1, 2]], dtype=np.float64)}
    return _example(
        "given_qkv",
        "seed 004 (Métwalli and Elhefny, The Transformer: Let's dive into math), section 5",
        {},
        query,
        query.copy(),
        value,
        printed,
        backend,
    )

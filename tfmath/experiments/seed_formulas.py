"""Report experiment: each formula the seeds print, evaluated directly and against tfmath.

Every formula is written out in plain NumPy exactly as a seed prints it and
compared with the tfmath function that implements it, on random float64
inputs; the largest difference is the measurement. Where two seeds print the
same formula differently (FFN in row or column form, LayerNorm with or
without epsilon), each form is evaluated as printed.
"""

import numpy as np

from tfmath.analysis.claims import Claim
from tfmath.attention import scaled_dot_product_attention
from tfmath.report import ExperimentResult, Table, experiment
from tfmath.rnn import elman_rnn
from tfmath.training.layers.attention import multi_head_attention_forward
from tfmath.training.layers.embedding import embedding_forward
from tfmath.training.layers.feed_forward import feed_forward_forward
from tfmath.training.layers.losses import cross_entropy
from tfmath.training.layers.norms import layer_norm
from tfmath.training.optim import WarmupSchedule
from tfmath.training.params import Parameters

#: Equality of float64 evaluations of the same formula, in different orders of operations.
TOLERANCE = 1e-12
#: Sizes of the random inputs: sequence length, model width, heads, feed-forward width, vocabulary.
N, D_MODEL, HEADS, D_FF, VOCAB = 7, 16, 4, 32, 11


def _softmax(scores):
    shifted = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def _attention(rng, backend):
    q, k, v = (rng.standard_normal((N, D_MODEL)) for _ in range(3))
    direct = _softmax(q @ k.T / np.sqrt(D_MODEL)) @ v
    return direct, scaled_dot_product_attention(q, k, v, backend=backend)


def _multi_head(rng, backend):
    x = rng.standard_normal((N, D_MODEL))
    weights = {
        name: rng.standard_normal((D_MODEL, D_MODEL)) for name in ("w_q", "w_k", "w_v", "w_o")
    }
    d_k = D_MODEL // HEADS
    heads = []
    for i in range(HEADS):
        columns = slice(i * d_k, (i + 1) * d_k)
        q, k, v = (x @ weights[name][:, columns] for name in ("w_q", "w_k", "w_v"))
        heads.append(_softmax(q @ k.T / np.sqrt(d_k)) @ v)
    direct = np.concatenate(heads, axis=-1) @ weights["w_o"]
    out, _ = multi_head_attention_forward(Parameters(weights), x, n_heads=HEADS, backend=backend)
    return direct, out


def _ffn_parameters(rng):
    return {
        "w_1": rng.standard_normal((D_MODEL, D_FF)),
        "b_1": rng.standard_normal(D_FF),
        "w_2": rng.standard_normal((D_FF, D_MODEL)),
        "b_2": rng.standard_normal(D_MODEL),
    }


def _ffn_rows(rng, backend):
    x, p = rng.standard_normal((N, D_MODEL)), _ffn_parameters(rng)
    direct = np.maximum(x @ p["w_1"] + p["b_1"], 0) @ p["w_2"] + p["b_2"]
    return direct, feed_forward_forward(Parameters(p), x, backend=backend)[0]


def _ffn_columns(rng, backend):
    # Seed 003 acts on a column vector x: W_2 · ReLU(W_1 x + b_1) + b_2, W_1 of shape d_ff x d.
    x, p = rng.standard_normal(D_MODEL), _ffn_parameters(rng)
    w_1, w_2 = p["w_1"].T, p["w_2"].T
    direct = w_2 @ np.maximum(w_1 @ x + p["b_1"], 0) + p["b_2"]
    return direct, feed_forward_forward(Parameters(p), x, backend=backend)[0]


def _layer_norm(rng, backend, eps):
    x = rng.standard_normal((N, D_MODEL))
    gamma, beta = rng.standard_normal(D_MODEL), rng.standard_normal(D_MODEL)
    mu, variance = x.mean(axis=-1, keepdims=True), x.var(axis=-1, keepdims=True)
    direct = (x - mu) / np.sqrt(variance + eps) * gamma + beta
    return direct, layer_norm(x, gamma, beta, eps, backend=backend)


def _warmup(rng, backend):
    d_model, warmup = 512, 4000
    steps = np.arange(1, 20001, dtype=np.float64)
    direct = d_model**-0.5 * np.minimum(steps**-0.5, steps * warmup**-1.5)
    return direct, WarmupSchedule(d_model, warmup)(steps)


def _cross_entropy(rng, backend):
    logits = rng.standard_normal((N, VOCAB))
    targets = rng.integers(0, VOCAB, N)
    y = np.eye(VOCAB)[targets]
    direct = -np.sum(y * np.log(_softmax(logits)))
    return direct, cross_entropy(logits, targets, reduction="sum", backend=backend)


def _embedding(rng, backend):
    table = rng.standard_normal((VOCAB, D_MODEL))
    tokens = rng.integers(0, VOCAB, N)
    # Seed 002's W_e · x with x one-hot, W_e of shape d x |V|.
    direct = (table.T @ np.eye(VOCAB)[tokens].T).T
    return direct, embedding_forward(table, tokens)[0]


def _rnn(rng, backend):
    x = rng.standard_normal((N, D_MODEL))
    w_xh, w_hh = rng.standard_normal((D_MODEL, D_MODEL)), rng.standard_normal((D_MODEL, D_MODEL))
    bias = rng.standard_normal(D_MODEL)
    h, direct = np.zeros(D_MODEL), []
    for x_t in x:
        h = np.tanh(w_hh @ h + w_xh @ x_t + bias)
        direct.append(h)
    return np.array(direct), elman_rnn(x, w_xh, w_hh, bias, backend=backend)


#: (formula as printed, seeds that print it, evaluation).
FORMULAS = (
    (
        "Attention(Q, K, V) = softmax(QK^T / sqrt(d_k)) V",
        ("000", "001", "002", "003", "004"),
        _attention,
    ),
    (
        "MultiHead = Concat(head_1, ..., head_h) W^O, head_i = Attention(QW_i^Q, KW_i^K, VW_i^V)",
        ("000", "001", "002", "003", "004"),
        _multi_head,
    ),
    ("FFN(x) = ReLU(x W_1 + b_1) W_2 + b_2", ("002",), _ffn_rows),
    ("FFN(x) = W_2 · ReLU(W_1 x + b_1) + b_2", ("003",), _ffn_columns),
    (
        "LayerNorm(x) = (x - mu) / sqrt(sigma^2 + eps) * gamma + beta (eps = 1e-5)",
        ("002",),
        lambda rng, backend: _layer_norm(rng, backend, 1e-5),
    ),
    (
        "LayerNorm(x) = gamma ⊙ (x - mu) / sigma + beta (no eps)",
        ("003",),
        lambda rng, backend: _layer_norm(rng, backend, 0.0),
    ),
    (
        "lr = d^-0.5 · min(step^-0.5, step · warmup_steps^-1.5) (d = 512, 4000 warm-up steps)",
        ("002",),
        _warmup,
    ),
    ("L = -Σ_i y_i log(ŷ_i) (one-hot y, ŷ = softmax of the logits)", ("002",), _cross_entropy),
    ("Embedding(x) = W_e · x (x one-hot)", ("002", "003"), _embedding),
    ("h_t = tanh(W_hh h_(t-1) + W_xh x_t + b)", ("003",), _rnn),
)


@experiment(
    "seed_formulas", title="The seeds' formulas, evaluated as printed, against tfmath", order=12
)
def seed_formulas(settings):
    """Each printed formula in plain NumPy against tfmath's implementation."""
    rng = np.random.default_rng(settings.seed)
    rows = {"formula": [], "seeds": [], "max_abs_difference": []}
    claims = []
    for formula, seeds, evaluate in FORMULAS:
        direct, computed = evaluate(rng, settings.backend)
        difference = float(np.max(np.abs(np.asarray(direct) - np.asarray(computed))))
        rows["formula"].append(formula)
        rows["seeds"].append(", ".join(seeds))
        rows["max_abs_difference"].append(difference)
        claims += [
            Claim(
                seed,
                f"{formula}: largest difference between the formula and tfmath",
                "0",
                difference,
                exact=True,
                tolerance=TOLERANCE,
            )
            for seed in seeds
        ]
    worst = max(rows["max_abs_difference"])
    caption = (
        f"Each formula written out in NumPy as the seed prints it, on random float64 inputs "
        f"({N} tokens, d_model = {D_MODEL}, {HEADS} heads, d_ff = {D_FF}, {VOCAB} classes), "
        f"against the tfmath function that implements it. The largest difference is "
        f"{worst:.1e}: every formula is what tfmath computes, up to the order of the "
        f"floating-point operations. Seed 003's LayerNorm without eps is tfmath's with eps=0, "
        f"and its FFN on column vectors is the row form transposed."
    )
    return ExperimentResult(caption=caption, tables={"formulas": Table(rows)}, claims=claims)

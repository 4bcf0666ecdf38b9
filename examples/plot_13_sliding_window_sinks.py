r"""
Training with a sliding window and attention sinks
==================================================

One attention head learns to copy the token five places back, on random
sequences of 16 symbols. It sees the sequence through a causal sliding window
(:func:`tfmath.flash_attention` with ``window_size=(left, 0)``) and has a
learnable sink logit, which joins each row's softmax normaliser and attends no
value (StreamingLLM; gpt-oss). Everything is NumPy: the forward is
``flash_attention``, the backward ``flash_attention_grad``, which also returns
the sink's gradient, and the optimiser is :class:`tfmath.training.optim.Adam`.

The first five positions have nothing to copy: their targets are fresh random
symbols, so the best prediction there is uniform, and the best loss over a
sequence is :math:`(5/32) \ln 16 = 0.43` nats. A uniform prediction is what a
head that attends nothing outputs (a zero vector gives equal logits), and the sink
is how a head attends nothing. So:

- a window of 3 keys cannot reach the token five places back and stays at
  guessing (:math:`\ln 16 = 2.77` nats);
- a window of 8 with a sink reaches the best loss, its first queries on the sink;
- a window of 8 without a sink learns the copy but must spread the first
  queries' weight over real tokens, and stays above the best loss.
"""

import numpy as np

import tfmath
from tfmath.plotting import attention_heatmap, new_figure, training_curves
from tfmath.training.optim import Adam
from tfmath.training.params import Parameters

VOCAB, LENGTH, WIDTH, LAG, BATCH, STEPS = 16, 32, 16, 5, 32, 250


def initial_parameters(rng):
    def normal(*shape):
        return rng.standard_normal(shape) / np.sqrt(shape[0])

    return Parameters({
        "tokens": rng.standard_normal((VOCAB, WIDTH)),
        "positions": rng.standard_normal((LENGTH, WIDTH)),
        "query": normal(WIDTH, WIDTH), "key": normal(WIDTH, WIDTH),
        "value": normal(WIDTH, WIDTH), "out": normal(WIDTH, VOCAB),
        "sinks": np.zeros(1),
    })  # fmt: skip


def loss_and_gradients(params, tokens, targets, window, with_sink):
    """Mean cross-entropy of predicting ``targets`` from ``tokens``."""
    x = params["tokens"][tokens] + params["positions"]  # (batch, L, width)
    q, k, v = (x @ params[name] for name in ("query", "key", "value"))
    sinks = params["sinks"] if with_sink else None
    options = {"causal": True, "window_size": (window, 0), "sinks": sinks}
    heads = [a[:, None] for a in (q, k, v)]  # one head: (batch, 1, L, width)
    out = tfmath.flash_attention(*heads, **options)[:, 0]
    logits = out @ params["out"]
    logits = logits - logits.max(axis=-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    loss = -np.take_along_axis(log_probs, targets[..., None], axis=-1).mean()
    # Backward, by hand down to the attention, then by flash_attention_grad.
    grad_logits = np.exp(log_probs)
    np.put_along_axis(
        grad_logits, targets[..., None],
        np.take_along_axis(grad_logits, targets[..., None], axis=-1) - 1, axis=-1,
    )  # fmt: skip
    grad_logits /= targets.size
    grad_out = grad_logits @ params["out"].T
    grad_q, grad_k, grad_v, grad_sinks = tfmath.flash_attention_grad(
        *heads, grad_out[:, None], **options
    )
    grad_q, grad_k, grad_v = grad_q[:, 0], grad_k[:, 0], grad_v[:, 0]
    grad_x = grad_q @ params["query"].T + grad_k @ params["key"].T + grad_v @ params["value"].T
    grad_tokens = np.zeros_like(params["tokens"])
    np.add.at(grad_tokens, tokens, grad_x)
    flat = x.reshape(-1, WIDTH)
    grads = Parameters({
        "tokens": grad_tokens, "positions": grad_x.sum(axis=0),
        "query": flat.T @ grad_q.reshape(-1, WIDTH), "key": flat.T @ grad_k.reshape(-1, WIDTH),
        "value": flat.T @ grad_v.reshape(-1, WIDTH),
        "out": out.reshape(-1, WIDTH).T @ grad_logits.reshape(-1, VOCAB),
        "sinks": grad_sinks if with_sink else np.zeros(1),
    })  # fmt: skip
    return loss, grads


def batch(rng):
    """Random sequences; the target at position i is the token at i - LAG, or a fresh
    random symbol for the first LAG positions."""
    tokens = rng.integers(0, VOCAB, size=(BATCH, LENGTH))
    targets = np.concatenate([rng.integers(0, VOCAB, (BATCH, LAG)), tokens[:, :-LAG]], axis=1)
    return tokens, targets


def train(window, with_sink, seed=0):
    rng = np.random.default_rng(seed)
    params = initial_parameters(rng)
    adam = Adam(learning_rate=0.01)
    state = adam.init(params)
    losses = []
    for _ in range(STEPS):
        loss, grads = loss_and_gradients(params, *batch(rng), window, with_sink)
        params, state = adam.update(params, grads, state)
        losses.append(loss)
    return params, np.array(losses)


setups = {"window 3, sink": (3, True), "window 8, sink": (8, True), "window 8, no sink": (8, False)}
runs = {label: train(*setup) for label, setup in setups.items()}
best = LAG / LENGTH * np.log(VOCAB)
for label, (params, losses) in runs.items():
    print(f"{label}: loss {losses[-20:].mean():.3f} nats over the last 20 steps (best {best:.3f}, "
          f"guessing {np.log(VOCAB):.3f}); sink logit {params['sinks'][0]:+.2f}")  # fmt: skip

# %%
# The loss of each run, and where the trained head (window 8, sink) attends on
# one sequence: on the key five places back, and, for the first five queries,
# which have nothing to copy, on the sink (the last column).
params, _ = runs["window 8, sink"]
tokens = np.random.default_rng(1).integers(0, VOCAB, size=(1, LENGTH))
x = params["tokens"][tokens] + params["positions"]
heads = [(x @ params[name])[:, None] for name in ("query", "key", "value")]
_, weights = tfmath.flash_attention(
    *heads, causal=True, window_size=(8, 0), sinks=params["sinks"], return_weights=True
)
shown = 16
figure, axes = new_figure(12, 5, ncols=2)
training_curves(
    {label: losses for label, (_, losses) in runs.items()},
    reference=best, reference_label="best possible (5/32 ln 16)", ax=axes[0, 0],
)  # fmt: skip
axes[0, 0].set_title(f"copying the token {LAG} places back")
labels = [str(i) for i in range(shown)]
key_columns = [*range(shown), weights.shape[-1] - 1]
attention_heatmap(
    weights[0, 0][:shown][:, key_columns], query_labels=labels,
    key_labels=[*labels, "sink"], annotate=False, title="trained head: window 8, sink",
    ax=axes[0, 1],
)  # fmt: skip
figure  # noqa: B018 (the last expression: the gallery shows the figure)

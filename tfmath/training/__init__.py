"""The training stack: parameters, layers with their backward passes, models, optimiser, loop.

Submodules, from the bottom up:

:mod:`tfmath.training.params`
    Named parameter collections and their initialisation.
:mod:`tfmath.training.layers`
    Blocks (norms, feed-forward, attention, embeddings, losses, residual
    blocks), each a forward and an analytic backward pass.
:mod:`tfmath.training.models`
    Encoder, decoder and decoder-only stacks built from the blocks.
:mod:`tfmath.training.optim`
    Adam and the warm-up learning-rate schedule.
:mod:`tfmath.training.sources`
    The interface the loop reads text through, and text files as bytes.
:mod:`tfmath.training.synthetic`, :mod:`tfmath.training.hierarchical`
    Languages of known entropy to train on: independent Zipf words, and words
    whose classes follow a topic's Markov chain.
:mod:`tfmath.training.pronouns`
    A template grammar in which "it" refers to the noun its adjective fits, an
    encoder trained to resolve it, and where its attention looks.
:mod:`tfmath.training.loop`
    The training loop (re-exported here, so ``tfmath.training.train_language_model``).
:mod:`tfmath.training.sweep`
    Resumable sweeps of training runs, here or on a Dask cluster.
"""

__all__ = [
    "TrainingConfig",
    "TrainingResult",
    "language_model_config",
    "single_threaded",
    "train_language_model",
]


def __getattr__(name):
    # The loop is imported on first use: ``import tfmath`` reaches this package for the
    # layer functions it re-exports, and the loop would bring the models, the optimiser
    # and the text sources with it (a third of tfmath's own import time).
    if name in __all__:
        from tfmath.training import loop

        return getattr(loop, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *__all__})

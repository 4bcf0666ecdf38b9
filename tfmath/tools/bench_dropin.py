"""``tfmath bench dropin``: a small GPT trained in PyTorch, its attention swapped for tfmath's.

The same model, the same weights and the same batch take one training step
(forward, loss, backward, AdamW update) with its attention computed by
``torch.nn.functional.scaled_dot_product_attention`` and by
:func:`tfmath.nn.scaled_dot_product_attention`, the one line that differs. The
report gives the ratio of PyTorch's time to tfmath's, taken within interleaved
rounds (above 1, the drop-in is faster), and the share of PyTorch's step that
attention takes.

torch is imported by the functions here, never at module import.
"""

import math
import statistics
import time
from typing import NamedTuple

from tfmath.analysis.timing import SETTLE_SECONDS

#: Context lengths of the measurement (``quick=True`` keeps the first two).
CONTEXTS = (256, 512, 1024, 2048)


def tiny_gpt(attention, *, vocab=256, d_model=256, n_heads=4, n_layers=2, seed=0):
    """A pre-norm GPT (causal self-attention and a GELU MLP per block) whose attention
    is ``attention(q, k, v, is_causal=True)`` on ``(batch, heads, L, d_k)`` tensors."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm_1, self.norm_2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
            self.qkv = nn.Linear(d_model, 3 * d_model)
            self.out = nn.Linear(d_model, d_model)
            self.mlp = nn.Sequential(
                nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
            )

        def forward(self, x):
            batch, length, _ = x.shape
            qkv = self.qkv(self.norm_1(x)).view(batch, length, 3, n_heads, -1)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (batch, heads, L, d_k) views
            y = attention(q, k, v, is_causal=True)
            x = x + self.out(y.transpose(1, 2).reshape(batch, length, d_model))
            return x + self.mlp(self.norm_2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d_model)
            self.blocks = nn.Sequential(*(Block() for _ in range(n_layers)))
            self.norm = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, vocab, bias=False)

        def forward(self, tokens):
            positions = torch.arange(tokens.shape[-1])
            x = self.embed(tokens) + _sinusoids(positions, d_model)
            return self.head(self.norm(self.blocks(x)))

    torch.manual_seed(seed)
    return GPT()


def _sinusoids(positions, d_model):
    import torch

    frequencies = torch.exp(-math.log(10000.0) * torch.arange(0, d_model, 2) / d_model)
    angles = positions[:, None] * frequencies
    return torch.cat((torch.sin(angles), torch.cos(angles)), dim=-1)


def training_step(model, tokens):
    """A call that runs one AdamW step of next-token prediction on ``tokens``."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss

    return step


def _values_only(query, key, value, is_causal):
    """No attention at all: the model's step less attention's cost, to say how much of
    a step attention takes."""
    return value


#: Each timing of a model's step lasts at least this long: one step varies from step
#: to step by more than the difference measured, so a timing is the mean of several
#: steps (see docs/benchmarks.rst, "Measurements behind constants").
MIN_TIMING_SECONDS = 0.1
#: Interleaved rounds per context.
ROUNDS = 15


def dropin_rows(contexts=CONTEXTS, batch=1, repeats=2, rounds=ROUNDS):
    """One :class:`DropinRow` per context, from interleaved rounds.

    Each round times the training step of the same model with PyTorch's attention,
    tfmath's and none (the values passed through), ``repeats`` times each, best
    kept, in an order that alternates between rounds; a timing is the mean step of
    as many consecutive steps as last ``MIN_TIMING_SECONDS``. The ratio of PyTorch's
    time to tfmath's is taken within each round, whose timings share the machine's
    load of that moment, and summarised by its median and range over the rounds; on
    a shared machine, bests from different moments are not comparable.
    """
    import torch.nn.functional as F

    import tfmath.nn

    rows = []
    for context in contexts:
        tokens = _tokens(batch, context)
        steps = {
            "torch": training_step(tiny_gpt(F.scaled_dot_product_attention), tokens),
            "tfmath": training_step(tiny_gpt(tfmath.nn.scaled_dot_product_attention), tokens),
            "none": training_step(tiny_gpt(_values_only), tokens),
        }
        for step in steps.values():
            step()  # compiles tfmath's kernels, allocates the optimiser's state
        n_steps = max(1, math.ceil(MIN_TIMING_SECONDS / _seconds(steps["torch"])))
        times = {name: [] for name in steps}
        for round_index in range(rounds):
            order = list(steps) if round_index % 2 == 0 else list(reversed(steps))
            for name in order:
                time.sleep(SETTLE_SECONDS)
                best = min(_seconds(steps[name], n_steps) for _ in range(repeats))
                times[name].append(best / n_steps)
        ratios = [t / f for t, f in zip(times["torch"], times["tfmath"], strict=True)]
        shares = [1 - n / t for n, t in zip(times["none"], times["torch"], strict=True)]
        rows.append(
            DropinRow(
                context,
                min(times["torch"]),
                min(times["tfmath"]),
                statistics.median(ratios),
                min(ratios),
                max(ratios),
                max(0.0, statistics.median(shares)),
            )
        )
    return rows


def attention_call_times(contexts=(256,), batch=1, steps=30):
    """Where the drop-in's step differs from PyTorch's: one :class:`CallTimes` per
    context, the median time of one attention call's forward (the call) and of its
    backward (the autograd node the call made, timed by hooks on it), taken inside
    the training steps of :func:`dropin_rows`' two models, stepped in turn.

    The model's other work leaves the caches full of its own data, so a call costs
    more here than in a loop of calls alone; these are the times the step pays.
    """
    import torch.nn.functional as F

    import tfmath.nn

    attentions = {
        "torch": F.scaled_dot_product_attention,
        "tfmath": tfmath.nn.scaled_dot_product_attention,
    }
    rows = []
    for context in contexts:
        tokens = _tokens(batch, context)
        times = {name: ([], []) for name in attentions}
        steps_of = {
            name: training_step(tiny_gpt(_timed(attention, *times[name])), tokens)
            for name, attention in attentions.items()
        }
        for step in steps_of.values():
            step()  # compiles tfmath's kernels, allocates the optimiser's state
        for forward, backward in times.values():
            forward.clear()
            backward.clear()
        for _ in range(steps):
            for step in steps_of.values():
                step()
        rows.append(
            CallTimes(
                context,
                *(statistics.median(times[name][0]) for name in attentions),
                *(statistics.median(times[name][1]) for name in attentions),
                len(times["tfmath"][1]),
            )
        )
    return rows


def _timed(attention, forward_times, backward_times):
    """``attention``, timing each call and the backward node each call makes."""

    def timed_attention(query, key, value, is_causal):
        start = time.perf_counter()
        output = attention(query, key, value, is_causal=is_causal)
        forward_times.append(time.perf_counter() - start)
        node, started = output.grad_fn, []
        node.register_prehook(lambda grad_outputs: started.append(time.perf_counter()))
        node.register_hook(
            lambda grad_inputs, grad_outputs: backward_times.append(
                time.perf_counter() - started[0]
            )
        )
        return output

    return timed_attention


class CallTimes(NamedTuple):
    """One context of :func:`attention_call_times`: median seconds of one call's
    forward and backward inside the step, PyTorch's and tfmath's, and how many
    calls each median is over."""

    context: int
    torch_forward: float
    tfmath_forward: float
    torch_backward: float
    tfmath_backward: float
    calls: int


def _tokens(batch, context):
    """The batch of both models' steps: ``context + 1`` tokens a row, seeded."""
    import torch

    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (batch, context + 1), generator=generator)


def _seconds(call, times=1):
    """Seconds ``times`` calls of ``call`` take, one after the other."""
    start = time.perf_counter()
    for _ in range(times):
        call()
    return time.perf_counter() - start


class DropinRow(NamedTuple):
    """One context of ``tfmath bench dropin``: best step times, PyTorch's time over
    tfmath's (median and range of the rounds' ratios), and attention's share of
    PyTorch's step."""

    context: int
    torch_seconds: float
    tfmath_seconds: float
    ratio: float
    ratio_low: float
    ratio_high: float
    attention_share: float


def print_dropin_report(quick=False, out=print):
    """Print the drop-in table: time per training step and PyTorch's time over tfmath's."""
    try:
        import torch
    except ImportError:
        out("tfmath bench dropin: needs PyTorch (pip install torch)")
        return
    out(
        f"A 2-layer GPT (d_model 256, 4 heads, batch 1) trained in PyTorch {torch.__version__}"
        f" on the CPU ({torch.get_num_threads()} threads): one AdamW step, attention by"
    )
    out("PyTorch's SDPA or by tfmath.nn.scaled_dot_product_attention. Ratio: PyTorch's time over")
    out(f"tfmath's within each of {ROUNDS} interleaved rounds, median [range] (a time: the mean of")
    out(f"steps lasting {MIN_TIMING_SECONDS} s or more, best of 2); attention: its share of")
    out("PyTorch's step, against the same model without attention")
    out(
        f"{'context':>8} {'torch SDPA':>12} {'tfmath':>12} {'torch/tfmath':>13}"
        f" {'[range]':>13} {'attention':>10}"
    )
    for row in dropin_rows(CONTEXTS[:2] if quick else CONTEXTS):
        out(
            f"{row.context:>8} {row.torch_seconds * 1e3:>10.1f}ms"
            f" {row.tfmath_seconds * 1e3:>10.1f}ms {row.ratio:>12.2f}x"
            f" [{row.ratio_low:.2f}-{row.ratio_high:.2f}] {row.attention_share:>10.0%}"
        )


def print_call_times_report(quick=False, out=print):
    """Print :func:`attention_call_times`: what one attention call costs inside the
    drop-in's training step, PyTorch's SDPA against tfmath's."""
    try:
        import torch  # noqa: F401  (only to say it is missing)
    except ImportError:
        out("tfmath bench dropin --calls: needs PyTorch (pip install torch)")
        return
    out("One attention call inside the training step of the GPT of tfmath bench dropin,")
    out("the two models stepped in turn: median over the steps' calls of the forward (the")
    out("call) and of the backward (the autograd node it made, timed by hooks), in ms")
    out(
        f"{'context':>8} {'forward: torch':>15} {'tfmath':>8} {'backward: torch':>16}"
        f" {'tfmath':>8} {'calls':>6}"
    )
    for row in attention_call_times(CONTEXTS[:2] if quick else CONTEXTS):
        out(
            f"{row.context:>8} {row.torch_forward * 1e3:>15.3f} {row.tfmath_forward * 1e3:>8.3f}"
            f" {row.torch_backward * 1e3:>16.3f} {row.tfmath_backward * 1e3:>8.3f}"
            f" {row.calls:>6}"
        )

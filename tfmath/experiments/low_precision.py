"""Report experiment: attention in float16 and bfloat16, theory beside measurement."""

import ml_dtypes
import numpy as np

from tfmath.analysis import precision
from tfmath.plotting import new_figure
from tfmath.plotting import precision as plots
from tfmath.report import ExperimentResult, Table, experiment

#: Sizes of the quick (default) and full runs.
PLANS = {
    True: {"rows": 400, "softmax_rows": 1000, "lengths": [32, 64, 128, 256, 512]},
    False: {"rows": 4000, "softmax_rows": 20000, "lengths": [32, 64, 128, 256, 512, 1024, 2048]},
}
#: Components of this standard deviation make unscaled scores overflow float16 at a
#: d_k small enough to sample; the crossing moves as 1/sigma^4 (see the caption).
COMPONENT_STD = 32.0
#: Keys per row of scores, and per row of the unshifted softmax.
N_KEYS = 128
SOFTMAX_KEYS = 256


@experiment("low_precision", title="Attention in low precision: float16 and bfloat16", order=35)
def low_precision(settings):
    """Overflowing scores, an unshifted softmax, and accumulation error, each with its theory."""
    plan = PLANS[bool(settings.quick)]
    scores = _score_panel(plan, settings)
    softmax = _softmax_panel(plan, settings)
    accumulation = _accumulation_panel(plan, settings)
    figure, axes = new_figure(15, 4.6, ncols=3)
    plots.score_overflow(
        scores["measured"],
        scores["scaled"],
        n_keys=N_KEYS,
        component_std=COMPONENT_STD,
        ax=axes[0, 0],
    )
    plots.softmax_overflow(softmax["term"], softmax["row"], n_keys=SOFTMAX_KEYS, ax=axes[0, 1])
    plots.accumulation_error(accumulation, ax=axes[0, 2])
    return ExperimentResult(
        caption=_caption(scores, softmax, accumulation),
        figures={"low_precision": figure},
        tables={
            "score_overflow": _estimates_table(scores["measured"], scores["predicted"]),
            "unshifted_softmax_overflow": _estimates_table(
                softmax["term"], softmax["predicted"], softmax["row"]
            ),
            "accumulation_error": _accumulation_table(accumulation),
        },
        data={
            "low_precision": {
                "score_overflow_dimension": scores["crossing"],
                "unit_components_overflow_dimension": scores["unit_crossing"],
                "accumulation_error": {
                    result.dtype: {k: v.tolist() for k, v in result.errors.items()}
                    for result in accumulation
                },
                "lengths": accumulation[0].lengths.tolist(),
            }
        },
    )


def _score_panel(plan, settings):
    dimensions = [128, 192, 256, 384, 512, 768, 1024]
    measured, scaled = zip(
        *(
            precision.measure_score_overflow(
                d,
                plan["rows"],
                N_KEYS,
                component_std=COMPONENT_STD,
                seed=settings.seed + i,
                backend=settings.backend,
            )
            for i, d in enumerate(dimensions)
        ),
        strict=True,
    )
    predicted = precision.score_overflow_probability(
        np.array(dimensions), N_KEYS, component_std=COMPONENT_STD
    )
    return {
        "measured": measured,
        "scaled": scaled,
        "predicted": predicted,
        "crossing": precision.overflow_dimension(0.5, N_KEYS, component_std=COMPONENT_STD),
        "unit_crossing": precision.overflow_dimension(0.5, 4096),
    }


def _softmax_panel(plan, settings):
    dimensions = [4, 8, 12, 16, 24, 32, 48, 64]
    term, row = zip(
        *(
            precision.measure_unshifted_softmax_overflow(
                d,
                plan["softmax_rows"],
                SOFTMAX_KEYS,
                seed=settings.seed + d,
                backend=settings.backend,
            )
            for d in dimensions
        ),
        strict=True,
    )
    predicted = precision.unshifted_softmax_overflow_probability(np.array(dimensions), SOFTMAX_KEYS)
    return {"term": list(term), "row": list(row), "predicted": predicted}


def _accumulation_panel(plan, settings):
    torch = _optional_torch()
    return [
        precision.accumulation_error(
            dtype, plan["lengths"], seed=settings.seed, torch=torch, backend=settings.backend
        )
        for dtype in (np.float16, ml_dtypes.bfloat16)
    ]


def _optional_torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def _within(estimates, predicted):
    return sum(e.low <= p <= e.high for e, p in zip(estimates, predicted, strict=True))


def _estimates_table(estimates, predicted, rows=None):
    columns = {
        "d_k": [e.d_k for e in estimates],
        "rows": [e.n_rows for e in estimates],
        "measured": [round(e.fraction, 4) for e in estimates],
        "ci_low": [round(e.low, 4) for e in estimates],
        "ci_high": [round(e.high, 4) for e in estimates],
        "predicted": [round(float(p), 4) for p in predicted],
        "largest_magnitude": [round(e.max_abs, 1) for e in estimates],
    }
    if rows is not None:
        columns["rows_term_or_sum_overflows"] = [round(e.fraction, 4) for e in rows]
    return Table(columns)


def _accumulation_table(accumulation):
    columns = {"L": accumulation[0].lengths.tolist()}
    for result in accumulation:
        for name, errors in result.errors.items():
            columns[f"{result.dtype} {name}"] = [f"{e:.3g}" for e in errors]
    return Table(columns)


def _caption(scores, softmax, accumulation):
    n = len(scores["measured"])
    within = _within(scores["measured"], scores["predicted"])
    softmax_within = _within(softmax["term"], softmax["predicted"])
    float32_accumulated = {
        r.dtype: max(max(r.errors["tfmath naive"]), max(r.errors["tfmath flash"])) / r.unit_roundoff
        for r in accumulation
    }
    half_accumulated = {
        r.dtype: r.errors["input-precision sums"][-1] / r.unit_roundoff for r in accumulation
    }
    growth = {
        r.dtype: np.polyfit(np.log(r.lengths), np.log(r.errors["input-precision sums"]), 1)[0]
        for r in accumulation
    }
    longest = accumulation[0].lengths[-1]
    d64 = softmax["term"][-1]
    # Where the sum overflowing adds most rows to those with an overflowing term.
    widest = max(
        zip(softmax["term"], softmax["row"], strict=True),
        key=lambda pair: pair[1].fraction - pair[0].fraction,
    )
    return (
        f"Left: with query and key components of standard deviation sigma = {COMPONENT_STD:g}, "
        f"Var(q.k) = d_k sigma^4 predicts that a row of {N_KEYS} unscaled scores overflows "
        f"float16 (|q.k| >= 65520) half the time at d_k = {scores['crossing']:.0f}; the "
        f"measured fraction lies within its 95% interval of the prediction at {within} of {n} "
        f"d_k, and scores scaled by 1/sqrt(d_k) never overflow (their spread does not grow "
        f"with d_k). For unit components a row of 4096 unscaled scores overflows half the "
        f"time only at d_k = {scores['unit_crossing']:.2g}: the scale is about keeping the "
        f"softmax out of saturation, not about overflow, unless activations are large. Middle: "
        f"without the row maximum subtracted, e^x overflows float16 from x = ln 65520 = 11.09; "
        f"with unscaled logits of d_k = {d64.d_k}, {d64.fraction:.0%} of rows of "
        f"{SOFTMAX_KEYS} logits already have an overflowing term (theory within the interval "
        f"at {softmax_within} of {len(softmax['term'])} d_k); the float16 sum overflows "
        f"earlier still, so that more rows get wrong weights (all 0) than have an overflowing "
        f"term: {widest[1].fraction:.0%} against {widest[0].fraction:.0%} at d_k = "
        f"{widest[0].d_k}; subtracting the maximum keeps every exponent <= 0. Right: "
        f"accumulating in float32 and rounding once, tfmath's error stays at the final "
        f"rounding whatever L "
        f"(at most {float32_accumulated['float16']:.2f} u in float16 and "
        f"{float32_accumulated['bfloat16']:.2f} u in bfloat16, against u/sqrt(3) = 0.58 u for "
        f"a single rounding), while summing in the input's precision reaches "
        f"{half_accumulated['float16']:.1f} u and {half_accumulated['bfloat16']:.1f} u at "
        f"L = {longest}. Its error grows like S^{growth['float16']:.2f} in float16, below the "
        f"S^0.5 that independent roundings of a running sum would give, and like "
        f"S^{growth['bfloat16']:.2f} in "
        f"bfloat16, faster, because with 8 bits of significand the terms fall below half a "
        f"unit of the running sum and are lost outright.{_rounded_weights_sentence(accumulation)}"
        f"{_torch_sentence(accumulation)}"
    )


def _rounded_weights_sentence(accumulation):
    """What the flash method's bfloat16 error owes to its rounded weights, where it
    exceeds the naive method's (a CPU with AVX512_BF16: see docs/low_precision.rst)."""
    (result,) = [r for r in accumulation if r.dtype == "bfloat16"]
    flash = max(result.errors["tfmath flash"]) / result.unit_roundoff
    naive = max(result.errors["tfmath naive"]) / result.unit_roundoff
    if flash <= 1.1 * naive:
        return ""
    return (
        f" In bfloat16 the flash method errs by {flash:.2f} u against the naive method's "
        f"{naive:.2f} u: on this CPU it multiplies bfloat16 operands with AVX512_BF16's "
        "vdpbf16ps and rounds the attention weights to bfloat16 before their product with "
        "V, as PyTorch's flash kernel does, a second rounding of about the output's size."
    )


def _torch_sentence(accumulation):
    if "torch" not in accumulation[0].errors:
        return ""
    worst = max(max(r.errors["torch"]) / r.unit_roundoff for r in accumulation)
    return f" PyTorch's CPU attention, also accumulating in float32, errs by at most {worst:.2f} u."

"""Report experiment: seed 000's parameter table, exact, with FLOPs and memory per token."""

import dataclasses

import numpy as np

from tfmath.analysis.claims import Claim
from tfmath.formulas.accounting import (
    PRESETS,
    activation_memory_per_layer,
    count_parameters,
    flops_per_token,
    kv_cache_bytes_per_token,
    measure_flop_rate,
    parameter_breakdown,
)
from tfmath.plotting import accounting as plots
from tfmath.plotting import new_figure
from tfmath.report import ExperimentResult, Table, experiment

#: Seed 000's table (model, heads, d_model, d_k, parameters), as printed, plus the two
#: models of Vaswani et al. (2017, table 3) as an extension.
SEED_TABLE = [
    ("BERT-Base", "bert-base", 12, 768, 64, "110M", 110e6),
    ("BERT-Large", "bert-large", 16, 1024, 64, "340M", 340e6),
    ("GPT-2", "gpt2", 12, 768, 64, "117M", 117e6),
    ("GPT-3", "gpt3-175b", 96, 12288, 128, "175B", 175e9),
    ("LLaMA-7B", "llama-7b", 32, 4096, 128, "7B", 7e9),
    ("LLaMA-70B", "llama-70b", 64, 8192, 128, "70B", 70e9),
    ("Transformer (base)", "transformer-base", 8, 512, 64, "65M (Vaswani table 3)", 65e6),
    ("Transformer (big)", "transformer-big", 16, 1024, 64, "213M (Vaswani table 3)", 213e6),
]
#: The rows of SEED_TABLE that are not in the seed.
EXTENSIONS = ("transformer-base", "transformer-big")

#: Why the exact count differs from the printed one.
WHY = {
    "bert-base": "Devlin et al. round to 110M; counted with the pooler as Hugging Face's "
    "BertModel is (without it: {no_pooler:,}). No MLM head.",
    "bert-large": "Devlin et al.'s 340M is 1.4% high; the same layout as BERT-Base gives "
    "{exact:,} with the pooler.",
    "gpt2": "117M is a known miscount of the GPT-2 paper, corrected to 124M in OpenAI's "
    "gpt-2 repository; the head is tied to the 50257 x 768 token table.",
    "gpt3-175b": "Brown et al. print 175.0B for this architecture (table 2.1); its exact count "
    "is 174.6B. Dense and sparse attention layers have the same parameters.",
    "llama-7b": "'7B' names a size class; exact 6.74B including the untied 32000 x 4096 head.",
    "llama-70b": "LLaMA-2-70B; the seed lists 64 heads but keys/values have only 8 (GQA), "
    "which saves {gqa_saving:.2f}B against full multi-head attention.",
    "transformer-base": "Counted: one 37000-token table shared by source, target and softmax "
    "(section 3.4), sinusoidal positions, post-LN without a final norm. The paper's vocabulary "
    "is 'about 37000' tokens, so its 65M cannot be reproduced exactly.",
    "transformer-big": "Same assumptions as the base model; within 0.6% of the paper's 213M.",
}


def _short(count):
    for unit, scale in (("B", 1e9), ("M", 1e6)):
        if count >= scale:
            return f"{count / scale:.{1 if unit == 'M' else 2}f}{unit}"
    return str(count)


def _why(preset):
    config = PRESETS[preset]
    mha = dataclasses.replace(config, n_kv_heads=None)
    return WHY[preset].format(
        exact=count_parameters(config),
        no_pooler=count_parameters(dataclasses.replace(config, pooler=False)),
        gqa_saving=(count_parameters(mha) - count_parameters(config)) / 1e9,
    )


def _kv_cache(preset):
    try:
        return kv_cache_bytes_per_token(preset)
    except ValueError:
        return "n/a (encoder)"


def _seed_table(flop_rate):
    columns = {
        key: []
        for key in (
            "model", "preset", "heads", "kv_heads", "d_model", "d_k", "layers",
            "seed_parameters", "exact_parameters", "exact_rounded", "exact_vs_seed_percent",
            "non_embedding_parameters", "n_ctx", "forward_flops_per_token",
            "training_flops_per_token", "training_flops_6N", "kv_cache_bytes_per_token_fp16",
            "activation_bytes_per_layer_fp16", "forward_ms_per_token_at_measured_rate", "why",
        )
    }  # fmt: skip
    for model, preset, heads, d_model, d_k, printed, printed_value in SEED_TABLE:
        config = PRESETS[preset]
        exact = count_parameters(config)
        flops = flops_per_token(config)
        row = {
            "model": model,
            "preset": preset,
            "heads": heads,
            "kv_heads": config.kv_heads,
            "d_model": d_model,
            "d_k": d_k,
            "layers": config.encoder_layers + config.decoder_layers,
            "seed_parameters": printed,
            "exact_parameters": exact,
            "exact_rounded": _short(exact),
            "exact_vs_seed_percent": round(100 * (exact / printed_value - 1), 2),
            "non_embedding_parameters": count_parameters(config, include_embeddings=False),
            "n_ctx": config.n_ctx,
            "forward_flops_per_token": flops.forward,
            "training_flops_per_token": flops.training,
            "training_flops_6N": flops.training_approx,
            "kv_cache_bytes_per_token_fp16": _kv_cache(preset),
            "activation_bytes_per_layer_fp16": activation_memory_per_layer(config),
            "forward_ms_per_token_at_measured_rate": round(1e3 * flops.forward / flop_rate, 4),
            "why": _why(preset),
        }
        for key, value in row.items():
            columns[key].append(value)
    return Table(columns)


def _shares(preset):
    parts = parameter_breakdown(preset)
    embeddings = sum(
        parts[k]
        for k in ("token_embeddings", "position_embeddings", "token_type_embeddings", "output_head")
    )
    shares = {
        "attention": parts["attention"],
        "feed-forward": parts["feed_forward"],
        "embeddings and head": embeddings,
        "norms and pooler": parts["norms"] + parts["pooler"],
    }
    total = sum(shares.values())
    return {name: value / total for name, value in shares.items()}


def _breakdown_table():
    columns = {"preset": [], **{k: [] for k in parameter_breakdown("gpt2")}, "total": []}
    for preset in PRESETS:
        parts = parameter_breakdown(preset)
        columns["preset"].append(preset)
        for key, value in parts.items():
            columns[key].append(value)
        columns["total"].append(count_parameters(preset))
    return Table(columns)


def _context_share(preset, n_ctx=None):
    flops = flops_per_token(preset, n_ctx=n_ctx)
    return flops.attention_context / flops.forward


def _half_context(preset):
    """The context, in units of d_model, at which the context term equals 2N (half the
    forward FLOPs): the term grows in proportion to the context."""
    flops = flops_per_token(preset, n_ctx=1)
    return flops.forward_approx / flops.attention_context / PRESETS[preset].d_model


@experiment(
    "model_accounting",
    title="Parameters, FLOPs and memory of published transformers (seed 000's table, exact)",
    order=60,
)
def model_accounting(settings):
    """Seed 000's parameter table with exact counts, FLOPs, KV cache and activation memory."""
    size, repeats = (512, 3) if settings.quick else (2048, 5)
    flop_rate = measure_flop_rate(size=size, repeats=repeats)
    table = _seed_table(flop_rate)
    figure, axes = new_figure(13, 4.8, ncols=2)
    plots.parameter_shares(
        {preset: _shares(preset) for preset in PRESETS},
        {preset: _short(count_parameters(preset)) for preset in PRESETS},
        ax=axes[0, 0],
    )
    contexts = np.logspace(7, 20, 200, base=2)
    plots.context_shares(
        {
            preset: (
                contexts,
                [_context_share(preset, int(n)) for n in contexts],
                PRESETS[preset].n_ctx,
                _context_share(preset, PRESETS[preset].n_ctx),
            )
            for preset in PRESETS
        },
        ax=axes[0, 1],
    )
    counts = {preset: count_parameters(preset) for preset in PRESETS}
    context_share = {p: _context_share(p) for p in PRESETS}
    low, high = min(context_share, key=context_share.get), max(context_share, key=context_share.get)
    billions = [p for p in PRESETS if counts[p] > 1e9]
    ffn = {p: _shares(p)["feed-forward"] for p in billions}
    half = {p: _half_context(p) for p in PRESETS}
    one_stack = [half[p] for p in PRESETS if PRESETS[p].architecture != "encoder-decoder"]
    two_stacks = [half[p] for p in PRESETS if PRESETS[p].architecture == "encoder-decoder"]
    caption = (
        f"Exact parameter counts beside seed 000's rounded figures: BERT-Base "
        f"{counts['bert-base']:,}, BERT-Large {counts['bert-large']:,}, GPT-2 "
        f"{counts['gpt2']:,} (not 117M, a known miscount), GPT-3 {counts['gpt3-175b']:,}, "
        f"LLaMA-7B {counts['llama-7b']:,}, LLaMA-70B {counts['llama-70b']:,}. Left: the "
        f"feed-forward layers hold {100 * min(ffn.values()):.0f}-{100 * max(ffn.values()):.0f}% "
        f"of the billion-parameter models' weights, while the embeddings are "
        f"{100 * _shares('bert-base')['embeddings and head']:.0f}% of BERT-Base and "
        f"{100 * _shares('gpt2')['embeddings and head']:.0f}% of GPT-2. Right: Kaplan et al.'s "
        f"attention term 2 n_layer n_ctx d_attn is {100 * context_share[low]:.1f}% ({low}) to "
        f"{100 * context_share[high]:.1f}% ({high}) of the forward FLOPs at each model's own "
        f"context, and reaches half of them (equals 2N) only at {min(one_stack):.1f}-"
        f"{max(one_stack):.1f} d_model ({min(two_stacks):.1f}-{max(two_stacks):.1f} d_model "
        "for the encoder-decoders, whose cross-attention adds context terms). Time per token "
        "uses this machine's measured matrix-multiply rate of "
        f"{flop_rate / 1e9:.1f} GFLOP/s (NumPy, float32, {size}x{size}); it is a lower bound "
        "that ignores memory traffic."
    )
    return ExperimentResult(
        caption=caption,
        figures={"parameter_shares": figure},
        tables={"seed_table": table, "parameter_breakdown": _breakdown_table()},
        data={
            "model_accounting": {
                "measured_flop_rate": flop_rate,
                "matmul_size": size,
                "parameters": counts,
                "non_embedding_parameters": {
                    p: count_parameters(p, include_embeddings=False) for p in PRESETS
                },
                "parameter_shares": {p: _shares(p) for p in PRESETS},
                "flops_per_token": {p: flops_per_token(p).__dict__ for p in PRESETS},
            }
        },
        claims=_claims(),
    )


def _claims():
    """Seed 000's table (parameters, and d_k = d_model / heads) and seed 001's BERT-Large."""
    claims = []
    for model, preset, heads, d_model, d_k, printed, _ in SEED_TABLE:
        if preset in EXTENSIONS:
            continue
        config = PRESETS[preset]
        claims.append(
            Claim(
                "000",
                f"{model}: parameters",
                printed,
                count_parameters(config),
                reason=_why(preset),
            )
        )
        claims.append(
            Claim(
                "000",
                f"{model}: d_k = d_model / heads = {d_model} / {heads}",
                str(d_k),
                config.head_dim,
                exact=True,
            )
        )
    bert_large = PRESETS["bert-large"]
    claims += [
        Claim("001", "BERT-Large: layers", "24", bert_large.n_layers, exact=True),
        Claim("001", "BERT-Large: parameters", "340M", count_parameters(bert_large)),
    ]
    return claims

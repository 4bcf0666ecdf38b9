"""tfmath.formulas.accounting: parameter counts against per-matrix sums, FLOPs and memory.

Every expected count below is summed here, weight matrix by weight matrix,
from the published dimensions (the tensors of each model's reference
implementation), without calling tfmath's formula.
"""

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tfmath.formulas import accounting as A
from tfmath.training import models as M


def total(shapes):
    return sum(math.prod(shape) for shape in shapes)


def bert_tensors(vocab, d, n_layers, ffn, positions=512, types=2):
    """The tensors of Hugging Face's BertModel (embeddings, encoder, pooler)."""
    shapes = [(vocab, d), (positions, d), (types, d), (d,), (d,)]  # + embedding LayerNorm
    for _ in range(n_layers):
        shapes += [(d, d), (d,)] * 3  # query, key, value
        shapes += [(d, d), (d,), (d,), (d,)]  # attention output dense, LayerNorm
        shapes += [(ffn, d), (ffn,), (d, ffn), (d,), (d,), (d,)]  # intermediate, output, LN
    return [*shapes, (d, d), (d,)]  # pooler


def gpt_tensors(vocab, d, n_layers, n_ctx):
    """The tensors of GPT-2's reference model (wte, wpe, h.*, ln_f; the head is wte)."""
    shapes = [(vocab, d), (n_ctx, d)]
    for _ in range(n_layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,)]  # ln_1, c_attn, c_proj
        shapes += [(d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]  # ln_2, c_fc, c_proj
    return [*shapes, (d,), (d,)]


def llama_tensors(vocab, d, n_layers, n_heads, n_kv_heads, ffn):
    """The tensors of LLaMA (embed_tokens, layers.*, norm, untied lm_head)."""
    kv = d // n_heads * n_kv_heads
    shapes = [(vocab, d)]
    for _ in range(n_layers):
        shapes += [(d, d), (kv, d), (kv, d), (d, d)]  # q, k, v, o projections
        shapes += [(ffn, d), (ffn, d), (d, ffn)]  # gate, up, down
        shapes += [(d,), (d,)]  # input and post-attention RMSNorm
    return [*shapes, (d,), (vocab, d)]


def transformer_tensors(vocab, d, ffn):
    """Vaswani et al.'s model: one shared embedding/softmax matrix, 6 + 6 post-LN layers."""
    attention = [(d, d), (d,)] * 4
    feed_forward = [(d, ffn), (ffn,), (ffn, d), (d,)]
    layer_norm = [(d,), (d,)]
    encoder_layer = attention + layer_norm + feed_forward + layer_norm
    decoder_layer = attention + layer_norm + attention + layer_norm + feed_forward + layer_norm
    return [(vocab, d)] + 6 * encoder_layer + 6 * decoder_layer


INDEPENDENT_COUNTS = {
    "bert-base": total(bert_tensors(30522, 768, 12, 3072)),
    "bert-large": total(bert_tensors(30522, 1024, 24, 4096)),
    "gpt2": total(gpt_tensors(50257, 768, 12, 1024)),
    "gpt3-175b": total(gpt_tensors(50257, 12288, 96, 2048)),
    "llama-7b": total(llama_tensors(32000, 4096, 32, 32, 32, 11008)),
    "llama-70b": total(llama_tensors(32000, 8192, 80, 64, 8, 28672)),
    "transformer-base": total(transformer_tensors(37000, 512, 2048)),
    "transformer-big": total(transformer_tensors(37000, 1024, 4096)),
}


@pytest.mark.parametrize("name", list(INDEPENDENT_COUNTS))
def test_counts_equal_the_sum_over_weight_matrices(name):
    assert A.count_parameters(name) == INDEPENDENT_COUNTS[name]
    assert sum(A.parameter_breakdown(name).values()) == INDEPENDENT_COUNTS[name]


@pytest.mark.parametrize(
    ("name", "published"),
    [
        ("bert-base", 109_482_240),  # BertModel with pooler, as Hugging Face counts it
        ("gpt2", 124_439_808),  # the "124M" of openai/gpt-2, once miscounted as 117M
        ("llama-7b", 6_738_415_616),
        ("llama-70b", 68_976_648_192),  # LLaMA-2-70B
    ],
)
def test_published_exact_counts(name, published):
    assert A.count_parameters(name) == published


def test_rounded_published_figures():
    # GPT-3's 175.0B (Brown et al. table 2.1) and the Transformer's 65M / 213M (Vaswani
    # et al. table 3) are rounded; the exact counts lie within 0.3 % and 3.2 %.
    assert round(A.count_parameters("gpt3-175b") / 1e9, 1) == 174.6
    assert abs(A.count_parameters("transformer-base") / 65e6 - 1) < 0.032
    assert abs(A.count_parameters("transformer-big") / 213e6 - 1) < 0.006


def test_bert_without_pooler_and_gpt2_without_embeddings():
    without_pooler = dataclasses.replace(A.preset("bert-base"), pooler=False)
    assert A.count_parameters(without_pooler) == 109_482_240 - (768 * 768 + 768)
    gpt2_layers = total(gpt_tensors(50257, 768, 12, 1024)[2:])
    assert A.count_parameters("gpt2", include_embeddings=False) == gpt2_layers


def test_kaplan_approximation_of_the_non_embedding_count():
    # Kaplan et al.: N = 12 n_layer d^2. The exact count adds 13 d per layer (biases
    # 3d + d + 4d + d, LayerNorms 4d) and the final LayerNorm's 2d.
    n_layers, d = 96, 12288
    exact = A.count_parameters("gpt3-175b", include_embeddings=False)
    assert exact == 12 * n_layers * d**2 + 13 * n_layers * d + 2 * d


def test_untied_head_and_grouped_query_attention():
    llama = A.preset("llama-7b")
    tied = dataclasses.replace(llama, output_head="tied")
    assert A.count_parameters(llama) - A.count_parameters(tied) == 32000 * 4096
    mha = dataclasses.replace(A.preset("llama-70b"), n_kv_heads=None)
    # GQA keeps 8 of 64 key/value heads: each layer saves 2 * 8192 * (8192 - 1024) weights.
    saved = 80 * 2 * 8192 * (8192 - 1024)
    assert A.count_parameters(mha) - A.count_parameters("llama-70b") == saved


def test_flops_per_token():
    n = A.count_parameters("gpt2", include_embeddings=False)
    flops = A.flops_per_token("gpt2")
    context = 2 * 12 * 1024 * 768  # 2 n_layer n_ctx d_attn
    assert flops.attention_context == context
    assert flops.forward == 2 * n + context
    assert flops.training == 3 * (2 * n + context)
    assert (flops.forward_approx, flops.training_approx) == (2 * n, 6 * n)
    assert A.flops_per_token("gpt2", n_ctx=1).attention_context == 2 * 12 * 768
    # An encoder-decoder attends in the encoder, and twice (self and cross) per decoder layer.
    big = A.flops_per_token("transformer-big", n_ctx=100)
    assert big.attention_context == 2 * (6 + 2 * 6) * 100 * 1024


def test_seconds_per_token_is_flops_over_rate():
    rate = 1e12
    assert A.seconds_per_token("llama-7b", rate) == A.flops_per_token("llama-7b").forward / rate
    training = A.seconds_per_token("llama-7b", rate, training=True)
    assert training == A.flops_per_token("llama-7b").training / rate


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("gpt2", 2 * 12 * 768 * 2),
        ("gpt3-175b", 2 * 96 * 12288 * 2),
        ("llama-7b", 2 * 32 * 4096 * 2),
        ("llama-70b", 2 * 80 * 8 * 128 * 2),
        ("transformer-base", 2 * 6 * 512 * 2),
    ],
)
def test_kv_cache_bytes_per_token(name, expected):
    assert A.kv_cache_bytes_per_token(name) == expected
    assert A.kv_cache_bytes_per_token(name, bytes_per_element=4) == 2 * expected


def test_encoders_keep_no_kv_cache():
    with pytest.raises(ValueError, match="encoder-only"):
        A.kv_cache_bytes_per_token("bert-base")


@pytest.mark.parametrize(("s", "b"), [(1024, 1), (2048, 4), (7, 3)])
def test_activation_memory_is_korthikantis_formula_for_gpt_layers(s, b):
    h, a = 768, 12
    # Korthikanti et al. 2022: s b h (34 + 5 a s / h) bytes with dropout, 16-bit activations.
    assert A.activation_memory_per_layer("gpt2", seq_len=s, batch_size=b) == (
        34 * s * b * h + 5 * a * s * s * b
    )
    # Without dropout, drop the masks (a s^2 b + 2 s b h) and the dropout output (2 a s^2 b).
    no_dropout = A.activation_memory_per_layer("gpt2", seq_len=s, batch_size=b, dropout=False)
    assert no_dropout == 32 * s * b * h + 2 * a * s * s * b


def test_measured_flop_rate_is_positive():
    assert A.measure_flop_rate(size=64, repeats=2) > 0


TINY_ARCHITECTURES = st.sampled_from(A.ARCHITECTURES)


@st.composite
def tiny_configs(draw):
    n_kv_heads = draw(st.integers(1, 2))
    n_heads = n_kv_heads * draw(st.integers(1, 2))
    position = draw(st.sampled_from(["learned", "sinusoidal", "none"]))
    architecture = draw(TINY_ARCHITECTURES)
    return A.ModelConfig(
        name="tiny",
        architecture=architecture,
        vocab_size=draw(st.integers(1, 9)),
        d_model=n_heads * draw(st.integers(1, 3)),
        n_layers=draw(st.integers(1, 3)),
        n_decoder_layers=draw(st.integers(1, 2)) if architecture == "encoder-decoder" else None,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        d_head=draw(st.sampled_from([None, 1, 5])),  # 5: wider than d_model / n_heads
        d_ff=draw(st.integers(1, 5)),
        activation=draw(st.sampled_from(["relu", "gelu", "gelu_tanh", "swiglu"])),
        norm=draw(st.sampled_from(["layer_norm", "rms_norm"])),
        bias=draw(st.booleans()),
        position=position,
        n_positions=draw(st.integers(1, 4)) if position == "learned" else 0,
        n_token_types=draw(st.integers(0, 2)),
        embedding_norm=draw(st.booleans()),
        final_norm=draw(st.booleans()),
        output_head=(head := draw(st.sampled_from(A.OUTPUT_HEADS))),
        output_bias=head != "none" and draw(st.booleans()),  # a bias needs logits
        shared_embeddings=draw(st.booleans()),
    )


@settings(max_examples=80)
@given(config=tiny_configs())
def test_count_equals_the_size_of_the_arrays_tfmath_builds(config):
    # The formula and tfmath.training.models' parameter layout are written independently.
    assert A.count_parameters(config) == M.model_parameters(config).size


@pytest.mark.parametrize(
    ("change", "exception", "word"),
    [
        ({"n_heads": 7}, ValueError, "n_heads = 7"),
        ({"n_kv_heads": 5}, ValueError, "n_kv_heads = 5"),
        ({"activation": "tanh"}, ValueError, "activation"),
        ({"norm": "batch_norm"}, ValueError, "norm"),
        ({"architecture": "decoder-only"}, ValueError, "architecture"),
        ({"d_model": 0}, ValueError, "d_model"),
        ({"d_ff": 2.5}, TypeError, "d_ff"),
        ({"n_positions": 0}, ValueError, "n_positions"),
        ({"output_head": "shared"}, ValueError, "output_head"),
        ({"bias": "no"}, TypeError, "bias"),
        ({"final_norm": "no"}, TypeError, "final_norm"),
        ({"embedding_norm": 2}, TypeError, "embedding_norm"),
        ({"pooler": 1}, TypeError, "pooler"),
        ({"norm_eps": -1.0}, ValueError, "norm_eps"),
        ({"norm_eps": float("nan")}, ValueError, "norm_eps"),
        ({"n_ctx": 1025}, ValueError, "n_ctx = 1025 is longer than the learned position"),
        ({"output_bias": True, "output_head": "none"}, ValueError, "output_bias=True needs"),
    ],
)
def test_bad_configs_are_refused(change, exception, word):
    with pytest.raises(exception, match=word):
        dataclasses.replace(A.preset("gpt2"), **change)


def test_numpy_integers_count_as_python_integers_without_wrapping():
    """A NumPy integer in a config or an argument is stored and used as a Python int: an
    int32 width once made GPT-3's count wrap to a negative number."""
    gpt3 = A.preset("gpt3-175b")
    narrow = dataclasses.replace(gpt3, d_model=np.int32(12288), n_layers=np.int16(96))
    assert type(narrow.d_model) is int and narrow == gpt3
    assert A.count_parameters(narrow) == A.count_parameters(gpt3) == 174_604_259_328
    assert A.flops_per_token(gpt3, n_ctx=np.int32(2048)) == A.flops_per_token(gpt3, n_ctx=2048)
    assert A.kv_cache_bytes_per_token(gpt3, bytes_per_element=np.int16(2)) == 2 * 96 * 12288 * 2
    # Korthikanti et al.'s s b h (34 + 5 a s / h) at s = 2048, b = 8.
    s, b, h, a = 2048, 8, 12288, 96
    assert A.activation_memory_per_layer(
        gpt3, seq_len=np.int32(s), batch_size=np.int32(b)
    ) == s * b * h * (34 + 5 * a * s // h)


def test_a_configs_context_defaults_to_its_learned_position_table():
    short = dataclasses.replace(A.preset("gpt2"), n_positions=512, n_ctx=None)
    assert short.n_ctx == 512
    assert A.ModelConfig("m", "decoder", 8, 8, 1, 1, 8, position="rotary").n_ctx == 1024
    # A formula may still be asked what the same layers would cost at another context.
    assert A.flops_per_token(short, n_ctx=4096).n_ctx == 4096


def test_the_pooler_is_charged_to_no_token():
    """BERT's pooler maps the first token of each sequence only; the per-token count of
    matrix products leaves it out (12 layers of 4 d^2 attention and 2 d d_ff FFN weights,
    and QK^T, PV over all 512 keys)."""
    d, d_ff, n_ctx = 768, 3072, 512
    expected = 2 * 12 * (4 * d * d + 2 * d * d_ff) + 4 * 12 * d * n_ctx
    assert A.flops_per_token("bert-base").step_forward == expected


@pytest.mark.parametrize("name, d, d_ff", [("transformer-base", 512, 2048),
                                          ("transformer-big", 1024, 4096)])  # fmt: skip
@pytest.mark.parametrize("n_ctx", [512, 100])
def test_encoder_decoder_steps_count_the_cross_attention(name, d, d_ff, n_ctx):
    """Vaswani et al.'s model, n_ctx source and n_ctx target tokens, per token: the
    6 encoder layers' self-attention (4 d^2 weights: Q, K, V, O) and FFN (2 d d_ff),
    the 6 decoder layers' self-attention, cross-attention (4 d^2 more) and FFN, the
    tied output head (V d), all times 2 FLOPs per multiply-add; and QK^T, PV (2 d
    multiply-adds per key each) over all n_ctx keys in the encoder's self-attention
    and the decoder's cross-attention, over (n_ctx + 1) / 2 keys on average under the
    decoder's causal mask:

        2 [(L_e + 2 L_d) 4 d^2 + (L_e + L_d) 2 d d_ff] + 2 V d
        + 4 (L_e + L_d) d n_ctx + 2 L_d d (n_ctx + 1)

    (141,703,168 for transformer-base at 512; leaving the cross-attention's weights
    out gives 129,120,256). A training step is 3 forwards."""
    encoder, decoder, vocab = 6, 6, 37000
    weights = (encoder + 2 * decoder) * 4 * d * d + (encoder + decoder) * 2 * d * d_ff
    products = 4 * (encoder + decoder) * d * n_ctx + 2 * decoder * d * (n_ctx + 1)
    expected = 2 * weights + 2 * vocab * d + products
    flops = A.flops_per_token(name, n_ctx=n_ctx)
    assert flops.step_forward == expected
    assert flops.step_training == 3 * expected


@pytest.mark.parametrize("n_ctx", [1024, 7])
def test_a_decoders_step_counts_each_query_against_the_keys_it_sees(n_ctx):
    """GPT-2 (12 layers, d = 768, d_ff = 3072, tied head of 50257 tokens): query i of
    a causal layer sees i + 1 keys, (n_ctx + 1) / 2 on average, each costing 2 d
    multiply-adds (QK^T and PV), so 2 d (n_ctx + 1) FLOPs per token and layer beside
    the weights' 2 (4 d^2 + 2 d d_ff) and the head's 2 V d."""
    d, d_ff, layers, vocab = 768, 3072, 12, 50257
    expected = 2 * layers * (4 * d * d + 2 * d * d_ff) + 2 * vocab * d
    expected += 2 * layers * d * (n_ctx + 1)
    assert A.flops_per_token("gpt2", n_ctx=n_ctx).step_forward == expected


@pytest.mark.parametrize(
    ("call", "exception", "words"),
    [
        (lambda: A.seconds_per_token("gpt2", 1e12, training="yes"), TypeError, "training"),
        (lambda: A.seconds_per_token("gpt2", float("nan")), ValueError, "flop_rate"),
        (lambda: A.seconds_per_token("gpt2", float("inf")), ValueError, "flop_rate"),
        (lambda: A.seconds_per_token("gpt2", 0), ValueError, "flop_rate"),
        (lambda: A.preset(["gpt2"]), TypeError, "name must be a preset's name"),
        (lambda: A.preset("gpt-5"), ValueError, "name must be one of the presets"),
        (lambda: A.measure_flop_rate(size=8, dtype="x"), TypeError, "dtype"),
        (lambda: A.measure_flop_rate(size=8, dtype=np.int64), TypeError, "dtype"),
    ],
)
def test_bad_arguments_are_refused_by_name(call, exception, words):
    with pytest.raises(exception, match=words):
        call()


def test_a_numpy_flop_rate_is_a_rate():
    forward = A.flops_per_token("gpt2").forward
    assert A.seconds_per_token("gpt2", np.float32(2.0**40)) == forward / 2.0**40
    assert A.seconds_per_token("gpt2", np.int64(10**12), training=True) == 3 * forward / 1e12


def test_unknown_preset_names_the_argument_and_the_choices():
    with pytest.raises(ValueError, match=r"config must be one of the presets .*'gpt2'"):
        A.count_parameters("gpt-5")
    with pytest.raises(TypeError, match="config"):
        A.count_parameters(124)
    with pytest.raises(TypeError, match="include_embeddings"):
        A.count_parameters("gpt2", include_embeddings="no")
    with pytest.raises(TypeError, match="dropout"):
        A.activation_memory_per_layer("gpt2", dropout="no")


def test_breakdown_shares_are_fractions():
    for name in A.PRESETS:
        parts = A.parameter_breakdown(name)
        assert all(v >= 0 for v in parts.values())
        assert np.isclose(sum(parts.values()) / A.count_parameters(name), 1.0)


def test_report_experiment_writes_the_exact_seed_table(tmp_path):
    import csv

    from tfmath.report import RunSettings, build_report

    build_report(tmp_path / "report", RunSettings(backend="cpu"), only=["model_accounting"])
    folder = tmp_path / "report" / "model_accounting"
    with open(folder / "seed_table.csv", newline="") as handle:
        rows = {row["preset"]: row for row in csv.DictReader(handle)}
    for preset, expected in INDEPENDENT_COUNTS.items():
        assert int(rows[preset]["exact_parameters"]) == expected
    assert rows["gpt2"]["seed_parameters"] == "117M"
    assert rows["bert-base"]["kv_cache_bytes_per_token_fp16"].startswith("n/a")
    assert (folder / "parameter_shares.png").read_bytes().startswith(b"\x89PNG")

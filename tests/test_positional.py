"""tfmath.positional: sinusoidal encoding, RoPE, ALiBi and embed on every backend.

Tolerances. The kernels and the reference reduce the angle by the same exact
integer arithmetic, so their angles agree to about 2**-53 turns; sine and
cosine come from different libraries (LLVM's libm calls, NumPy's vectorised
loops), each within a few units in the last place. Values are at most 1, so
float64 results agree to ``8 * eps``. In float32 both round the same float64
value once, so they differ by at most one float32 unit (``eps32``) unless
their float64 values straddle a rounding boundary, which is again one unit.
Against the exact encoding, the error budget is the reduction (2**-53 +
2**-54 turns, times 2 pi), the rounding of 2 pi r, and the sine itself: under
``1.6e-15``, so ``2e-15`` is the bound. The naive ``sin(p * omega)`` is off
by about ``p * eps``: 1e-10 at p = 1e6, which the tests show the oracle detects.
"""

import math
from decimal import Context, Decimal, getcontext, localcontext

import numpy as np
import pytest
from _errors import assert_refused
from _tolerances import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st

import tfmath
from tfmath import _cuda
from tfmath._contract.positional import decimal_pi
from tfmath.positional import (
    alibi_bias,
    alibi_slopes,
    embed,
    frequency_table,
    rotary_embedding,
    sinusoidal_encoding,
)

DTYPES = [np.float32, np.float64]
EPS64 = np.finfo(np.float64).eps
EPS32 = float(np.finfo(np.float32).eps)
KERNEL_TOLERANCE = {np.dtype(np.float64): 8 * EPS64, np.dtype(np.float32): EPS32}
EXACT_TOLERANCE = 2e-15

# --- a high-precision oracle (decimal only: no mpmath, no float128) ----------------------------

#: π to 70 decimals, as published (not computed by tfmath).
PI_70 = Decimal("3.1415926535897932384626433832795028841971693993751058209749445923078164")


def _decimal_sine_cosine(x):
    """sin x and cos x for |x| <= pi by their Taylor series, in the current decimal context."""
    sine, cosine = Decimal(0), Decimal(0)
    term, n = Decimal(1), 0  # term = x^n / n!
    tiny = Decimal(10) ** -(getcontext().prec + 2)
    while abs(term) > tiny or n < 4:
        if n % 2 == 0:
            cosine += term if n % 4 == 0 else -term
        else:
            sine += term if n % 4 == 1 else -term
        n += 1
        term = term * x / n
    return sine, cosine


def exact_encoding(positions, d_model, base=10000.0):
    """The encoding of integer positions, to about 60 correct digits, rounded to float64."""
    rows = []
    with localcontext(Context(prec=70)):
        log_base = Decimal(base).ln()
        omegas = [(Decimal(-2 * (c // 2)) / d_model * log_base).exp() for c in range(d_model)]
        for p in positions:
            row = []
            for c, omega in enumerate(omegas):
                angle = Decimal(p) * omega
                angle -= 2 * PI_70 * (angle / (2 * PI_70)).to_integral_value()
                sine, cosine = _decimal_sine_cosine(angle)
                row.append(float(sine if c % 2 == 0 else cosine))
            rows.append(row)
    return np.array(rows)


def naive_encoding(positions, d_model, base=10000.0):
    """The textbook float64 formula, ``sin(p * omega)``, without careful reduction."""
    omega = base ** (-2 * (np.arange(d_model) // 2) / d_model)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * omega
    return np.where(np.arange(d_model) % 2 == 0, np.sin(angles), np.cos(angles))


def test_decimal_pi_matches_published_digits():
    assert str(decimal_pi())[:72] == str(PI_70)


def test_frequency_table_reconstructs_the_frequencies():
    table = frequency_table(10, 10000.0)
    with localcontext(Context(prec=70)):
        for i in range(table.n_pairs):
            exact = (Decimal(-2 * i) / 10 * Decimal(10000).ln()).exp() / (2 * PI_70)
            high, low = (int(h) for h in table.halves[i])
            stored = (Decimal(high) * 2**32 + low) / Decimal(2) ** 64 + Decimal(table.remainder[i])
            assert abs(stored - exact) < Decimal(2) ** -115
            assert 0 <= low < 2**32 and 0 <= table.remainder[i] < 2**-64
    assert not table.halves.flags.writeable


# --- sinusoidal_encoding ----------------------------------------------------------------------

LARGE_POSITIONS = [10**6, 10**6 + 1, 123_456_789, 2**31 - 1, -(2**31 - 1)]


@pytest.mark.parametrize(("d_model", "base"), [(8, 10000.0), (7, 10000.0), (6, 500.0)])
def test_accurate_at_large_positions(any_backend, d_model, base):
    expected = exact_encoding(LARGE_POSITIONS, d_model, base)
    for position, row in zip(LARGE_POSITIONS, expected, strict=True):
        computed = sinusoidal_encoding(1, d_model, base=base, offset=position, backend=any_backend)
        assert np.max(np.abs(computed[0] - row)) <= EXACT_TOLERANCE, position


def test_the_oracle_would_catch_naive_angles():
    # The textbook formula loses about p * eps; the oracle sees it, so the test above can fail.
    naive = naive_encoding(LARGE_POSITIONS, 8)
    assert np.max(np.abs(naive - exact_encoding(LARGE_POSITIONS, 8))) > 100 * EXACT_TOLERANCE


def test_matches_the_exact_encoding_at_small_positions(any_backend):
    positions = list(range(0, 40, 3))
    computed = sinusoidal_encoding(40, 9, backend=any_backend)[::3]
    assert np.max(np.abs(computed - exact_encoding(positions, 9))) <= EXACT_TOLERANCE


@st.composite
def encoding_requests(draw, max_positions=30, max_d_model=17):
    return {
        "n_positions": draw(st.integers(0, max_positions)),
        "d_model": draw(st.integers(1, max_d_model)),
        "base": draw(st.sampled_from([10000.0, 1.5, 100.0, 1e6])),
        "offset": draw(st.one_of(st.integers(-50, 50), st.integers(-(2**31) + 100, 2**31 - 100))),
        "dtype": draw(st.sampled_from(DTYPES)),
    }


def _check_encoding_against_reference(request, backend):
    computed = sinusoidal_encoding(**request, backend=backend)
    expected = sinusoidal_encoding(**request, backend="reference")
    assert computed.dtype == expected.dtype == np.dtype(request["dtype"])
    assert computed.shape == (request["n_positions"], request["d_model"])
    assert_close(computed, expected, KERNEL_TOLERANCE[computed.dtype])


@given(request=encoding_requests())
def test_cpu_encoding_matches_reference(request):
    _check_encoding_against_reference(request, "cpu")


@pytest.mark.cuda
@settings(max_examples=20)
@given(request=encoding_requests(max_positions=5, max_d_model=7))
def test_cuda_encoding_matches_reference(request):
    _check_encoding_against_reference(request, "cuda")


def test_columns_are_sin_and_cos_of_the_stated_frequencies(any_backend):
    encoding = sinusoidal_encoding(50, 10, base=100.0, backend=any_backend)
    p = np.arange(50)[:, None]
    omega = 100.0 ** (-np.arange(0, 10, 2) / 10)
    # At positions below 50 the naive formula is accurate to 50 * eps.
    assert_close(encoding[:, 0::2], np.sin(p * omega), 1e-13)
    assert_close(encoding[:, 1::2], np.cos(p * omega), 1e-13)


def test_position_zero_alternates_zero_and_one(any_backend):
    assert np.array_equal(sinusoidal_encoding(1, 6, backend=any_backend)[0], [0, 1, 0, 1, 0, 1])


def test_odd_d_model_ends_with_an_unpaired_sine(any_backend):
    d_model = 5
    encoding = sinusoidal_encoding(20, d_model, backend=any_backend)
    omega_last = 10000.0 ** (-(d_model - 1) / d_model)
    assert encoding.shape == (20, 5)
    assert_close(encoding[:, -1], np.sin(np.arange(20) * omega_last), 1e-14)
    assert_close(encoding[:, :4], sinusoidal_encoding(20, 4, base=10000.0**0.8)[:, :4], 1e-14)


def test_d_model_one_is_sin_of_the_position(any_backend):
    assert_close(sinusoidal_encoding(5, 1, backend=any_backend)[:, 0], np.sin(np.arange(5)), 1e-15)


def test_offset_continues_the_encoding(any_backend):
    whole = sinusoidal_encoding(30, 8, backend=any_backend)
    tail = sinusoidal_encoding(10, 8, offset=20, backend=any_backend)
    assert_close(tail, whole[20:], 8 * EPS64)


def test_float32_is_the_rounded_float64_encoding(kernel_backend):
    single = sinusoidal_encoding(40, 12, offset=10**6, dtype=np.float32, backend=kernel_backend)
    double = sinusoidal_encoding(40, 12, offset=10**6, backend="reference")
    assert single.dtype == np.float32
    assert np.max(np.abs(single - double)) <= EPS32 / 2 + 8 * EPS64


def test_empty_encoding(any_backend):
    assert sinusoidal_encoding(0, 4, backend=any_backend).shape == (0, 4)


# --- rotary_embedding -------------------------------------------------------------------------


@st.composite
def rotary_inputs(draw, max_batch=3, max_rows=6, max_pairs=4):
    dtype = draw(st.sampled_from(DTYPES))
    batch = tuple(draw(st.lists(st.integers(1, max_batch), max_size=2)))
    n_rows = draw(st.integers(0, max_rows))
    n_features = 2 * draw(st.integers(0, max_pairs))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = rng.standard_normal((*batch, n_rows, n_features)).astype(dtype)
    positions = draw(
        st.one_of(
            st.none(),
            st.lists(st.integers(-(2**31) + 1, 2**31 - 1), min_size=n_rows, max_size=n_rows).map(
                np.array
            ),
        )
    )
    return x, positions, draw(st.sampled_from([10000.0, 10.0, 500000.0]))


def _check_rotary_against_reference(inputs, backend):
    x, positions, base = inputs
    computed = rotary_embedding(x, positions, base=base, backend=backend)
    expected = rotary_embedding(x, positions, base=base, backend="reference")
    assert computed.dtype == x.dtype and computed.shape == x.shape
    # Each output is x0 cos - x1 sin: its rounding error scales with the pair's
    # magnitude, not with the (possibly cancelling) output, hence the factor.
    scale = 1 + (np.max(np.abs(x)) if x.size else 0)
    assert_close(computed, expected, 8 * np.finfo(x.dtype).eps * scale)


@given(inputs=rotary_inputs())
def test_cpu_rotary_matches_reference(inputs):
    _check_rotary_against_reference(inputs, "cpu")


@pytest.mark.cuda
@settings(max_examples=20)
@given(inputs=rotary_inputs(max_batch=2, max_rows=3, max_pairs=2))
def test_cuda_rotary_matches_reference(inputs):
    _check_rotary_against_reference(inputs, "cuda")


def _textbook_rope(vector, position, base):
    """RoFormer's equation 34, by explicit 2 x 2 rotations of interleaved pairs."""
    rotated = np.empty_like(vector)
    for i in range(len(vector) // 2):
        angle = position * base ** (-2 * i / len(vector))
        rotation = np.array(
            [[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]]
        )
        rotated[2 * i : 2 * i + 2] = rotation @ vector[2 * i : 2 * i + 2]
    return rotated


def test_rotary_is_the_interleaved_rotation_of_roformer(any_backend):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 8))
    positions = np.array([0, 1, 7, 30, 2])
    computed = rotary_embedding(x, positions, base=100.0, backend=any_backend)
    for row, position in enumerate(positions):
        assert_close(computed[row], _textbook_rope(x[row], position, 100.0), 1e-13)


def test_rotary_first_pair_turns_by_the_position(any_backend):
    x = np.tile([1.0, 0.0, 0.0, 0.0], (3, 1))
    computed = rotary_embedding(x, backend=any_backend)
    expected = [[1, 0, 0, 0], [math.cos(1), math.sin(1), 0, 0], [math.cos(2), math.sin(2), 0, 0]]
    assert_close(computed, np.array(expected), 1e-15)


@pytest.mark.parametrize("offset", [0, 1000, 10**6, 2**30])
def test_rotary_dot_product_depends_only_on_the_offset(any_backend, offset):
    # <R_m q, R_n k> = <q, R_{n-m} k>: the same for every pair (m, n) with n - m fixed.
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((2, 16))
    for difference in (0, 1, 5, -17, 300):
        starts = offset + np.array([0, 3, 99, 12345])
        q_rotated = rotary_embedding(np.tile(q, (4, 1)), starts, backend=any_backend)
        k_rotated = rotary_embedding(np.tile(k, (4, 1)), starts + difference, backend=any_backend)
        dots = np.einsum("ij,ij->i", q_rotated, k_rotated)
        relative = q @ _textbook_rope(k, difference, 10000.0)
        assert_close(dots, np.full(4, relative), 64 * EPS64)


def test_rotary_preserves_norms(any_backend):
    x = np.random.default_rng(2).standard_normal((2, 6, 10))
    rotated = rotary_embedding(x, np.arange(6) * 1000, backend=any_backend)
    assert_close(np.linalg.norm(rotated, axis=-1), np.linalg.norm(x, axis=-1), 8 * EPS64)


def test_rotary_default_positions_count_from_zero(any_backend):
    x = np.random.default_rng(3).standard_normal((4, 6))
    assert np.array_equal(
        rotary_embedding(x, backend=any_backend),
        rotary_embedding(x, np.arange(4), backend=any_backend),
    )


@pytest.mark.cuda
def test_rotary_device_input_stays_on_device():
    x = np.random.default_rng(4).standard_normal((2, 3, 4)).astype(np.float32)
    result = rotary_embedding(_cuda.to_device(x))
    assert _cuda.is_device_array(result)
    assert_close(result.copy_to_host(), rotary_embedding(x, backend="reference"), 8 * EPS32)
    assert isinstance(rotary_embedding(_cuda.to_device(x), backend="cpu"), np.ndarray)


# --- ALiBi ------------------------------------------------------------------------------------


def _paper_slopes(n):
    """ALiBi's slopes as the authors' reference code computes them (get_slopes)."""
    if math.log2(n).is_integer():
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]
    closest = 2 ** math.floor(math.log2(n))
    return _paper_slopes(closest) + _paper_slopes(2 * closest)[0::2][: n - closest]


def test_alibi_slopes_for_eight_heads_are_halvings():
    assert np.array_equal(alibi_slopes(8), [2.0**-h for h in range(1, 9)])


@pytest.mark.parametrize("n_heads", [1, 2, 3, 5, 6, 8, 12, 16, 20, 32, 40])
def test_alibi_slopes_follow_the_authors_rule(n_heads):
    assert_close(alibi_slopes(n_heads), np.array(_paper_slopes(n_heads)), 4 * EPS64)


def test_alibi_sixteen_heads_interleave_the_geometric_means():
    # Press et al.: 16 heads interpolate the 8-head slopes by geometric means.
    assert_close(alibi_slopes(16), 2.0 ** -(np.arange(1, 17) / 2), 4 * EPS64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n_heads", "n_query", "n_key"), [(3, 4, 5), (8, 1, 6), (1, 0, 3)])
def test_alibi_bias_is_minus_slope_times_distance(any_backend, dtype, n_heads, n_query, n_key):
    bias = alibi_bias(n_heads, n_query, n_key, dtype=dtype, backend=any_backend)
    assert bias.dtype == dtype and bias.shape == (n_heads, n_query, n_key)
    slopes = np.array(_paper_slopes(n_heads))
    for h, i, j in np.ndindex(bias.shape):
        assert bias[h, i, j] == dtype(-slopes[h] * abs(i - j))


def test_alibi_bias_as_attention_mask_penalises_distance():
    # Uniform keys and queries: only the bias decides, so nearer keys get more weight.
    query = key = np.zeros((2, 4, 3))
    value = np.eye(4)[None].repeat(2, axis=0)
    weights = tfmath.scaled_dot_product_attention(
        query, key, value, attn_mask=alibi_bias(2, 4, 4), is_causal=True, backend="reference"
    )
    last = weights[:, 3]  # row 3 sees keys 0..3 at distances 3..0
    assert np.all(np.diff(last, axis=-1) > 0)
    slope = alibi_slopes(2)[0]
    assert_close(
        last[0], np.exp(-slope * np.arange(3, -1, -1)) / np.exp(-slope * np.arange(4)).sum(), 1e-14
    )


# --- embed ------------------------------------------------------------------------------------


@st.composite
def embed_inputs(draw, max_rows=6):
    dtype = draw(st.sampled_from(DTYPES))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    vocab_size, d_model = draw(st.integers(1, 9)), draw(st.integers(1, 7))
    batch = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    n_rows = draw(st.integers(0, max_rows))
    tokens = rng.integers(0, vocab_size, size=(*batch, n_rows))
    matrix = rng.standard_normal((vocab_size, d_model)).astype(dtype)
    positional = draw(st.sampled_from(["sinusoidal", None, "table"]))
    if positional == "table":
        positional = rng.standard_normal((n_rows + 2, d_model)).astype(dtype)
    return tokens, matrix, positional, draw(st.booleans())


def _check_embed_against_reference(inputs, backend):
    tokens, matrix, positional, scaled = inputs
    kwargs = {"positional": positional, "scale_by_sqrt_d": scaled}
    computed = embed(tokens, matrix, **kwargs, backend=backend)
    expected = embed(tokens, matrix, **kwargs, backend="reference")
    assert computed.dtype == expected.dtype == matrix.dtype
    assert computed.shape == (*tokens.shape, matrix.shape[1])
    assert_close(computed, expected, 8 * np.finfo(matrix.dtype).eps)


@given(inputs=embed_inputs())
def test_cpu_embed_matches_reference(inputs):
    _check_embed_against_reference(inputs, "cpu")


@pytest.mark.cuda
@settings(max_examples=20)
@given(inputs=embed_inputs(max_rows=3))
def test_cuda_embed_matches_reference(inputs):
    _check_embed_against_reference(inputs, "cuda")


def test_embed_is_scaled_rows_plus_the_encoding(any_backend):
    rng = np.random.default_rng(5)
    matrix = rng.standard_normal((10, 6))
    tokens = np.array([[3, 3, 9, 0], [1, 2, 3, 4]])
    computed = embed(tokens, matrix, backend=any_backend)
    expected = math.sqrt(6) * matrix[tokens] + exact_encoding(range(4), 6)
    assert_close(computed, expected, 1e-14)
    unscaled = embed(tokens, matrix, positional=None, scale_by_sqrt_d=False, backend=any_backend)
    assert np.array_equal(unscaled, matrix[tokens])


def test_embed_with_a_table_uses_its_first_rows(any_backend):
    matrix, table = np.eye(3), np.arange(15.0).reshape(5, 3)
    computed = embed([2, 0], matrix, positional=table, scale_by_sqrt_d=False, backend=any_backend)
    assert np.array_equal(computed, [[0, 1, 3], [4, 4, 5]])


def test_embed_promotes_like_numpy():
    table = np.zeros((2, 2))
    assert embed([0, 1], np.eye(2, dtype=np.float32), positional=table).dtype == np.float64
    assert embed([0, 1], np.eye(2, dtype=np.float32)).dtype == np.float32


# --- bad input --------------------------------------------------------------------------------

X = np.ones((2, 3, 4))

BAD_CALLS = [
    # (function, args, kwargs, exception, words the message must contain)
    (sinusoidal_encoding, (-1, 4), {}, ValueError, ["n_positions", "-1"]),
    (sinusoidal_encoding, (2.5, 4), {}, TypeError, ["n_positions", "2.5"]),
    (sinusoidal_encoding, (True, 4), {}, TypeError, ["n_positions"]),
    (sinusoidal_encoding, (3, 0), {}, ValueError, ["d_model", "0"]),
    (sinusoidal_encoding, (3, 4), {"base": 1.0}, ValueError, ["base", "1.0"]),
    (sinusoidal_encoding, (3, 4), {"base": 0.5}, ValueError, ["base", "0.5"]),
    (sinusoidal_encoding, (3, 4), {"base": float("inf")}, ValueError, ["base"]),
    (sinusoidal_encoding, (3, 4), {"base": "1e4"}, TypeError, ["base"]),
    (sinusoidal_encoding, (3, 4), {"dtype": np.int32}, TypeError, ["dtype", "int32"]),
    (sinusoidal_encoding, (3, 4), {"dtype": np.float16}, TypeError, ["dtype", "float16"]),
    (sinusoidal_encoding, (3, 4), {"offset": 2**31 - 2}, ValueError, ["offset", "2**31"]),
    (sinusoidal_encoding, (3, 4), {"offset": 1.0}, TypeError, ["offset"]),
    (rotary_embedding, (np.ones((3, 5)),), {}, ValueError, ["x", "even", "(3, 5)"]),
    (rotary_embedding, (X, [0, 1]), {}, ValueError, ["positions", "(3,)", "(2,)"]),
    (rotary_embedding, (X, [[0, 1, 2]]), {}, ValueError, ["positions", "(1, 3)"]),
    (rotary_embedding, (X, [0.0, 1.0, 2.0]), {}, TypeError, ["positions", "float64"]),
    (rotary_embedding, (X, [0, 1, 2**31]), {}, ValueError, ["positions", "2**31"]),
    (rotary_embedding, (X.astype(np.int64),), {}, TypeError, ["x", "int64"]),
    (rotary_embedding, (np.ones(4),), {}, ValueError, ["x", "at least 2", "(4,)"]),
    (rotary_embedding, (X,), {"base": -3}, ValueError, ["base"]),
    (alibi_bias, (0, 3, 3), {}, ValueError, ["n_heads", "0"]),
    (alibi_bias, (2, -1, 3), {}, ValueError, ["n_query", "-1"]),
    (alibi_bias, (2, 3, 1.5), {}, TypeError, ["n_key", "1.5"]),
    (alibi_bias, (2, 3, 3), {"dtype": "int8"}, TypeError, ["dtype"]),
    (embed, ([0.0, 1.0], np.eye(3)), {}, TypeError, ["tokens", "float64"]),
    (embed, ([True, False], np.eye(3)), {}, TypeError, ["tokens", "bool"]),
    (embed, ([0, 3], np.eye(3)), {}, ValueError, ["tokens", "0 .. 2", "3"]),
    (embed, ([-1, 0], np.eye(3)), {}, ValueError, ["tokens", "-1"]),
    (embed, (5, np.eye(3)), {}, ValueError, ["tokens", "at least 1"]),
    (embed, ([0, 1], np.ones(3)), {}, ValueError, ["embedding_matrix", "(3,)"]),
    (embed, ([0, 1], np.eye(3, dtype=np.int32)), {}, TypeError, ["embedding_matrix", "int32"]),
    (embed, ([0, 1], np.eye(3)), {"positional": "rotary"}, ValueError, ["rotary_embedding"]),
    (embed, ([0, 1], np.eye(3)), {"positional": "learned"}, ValueError, ["positional", "learned"]),
    (embed, ([0, 1], np.eye(3)), {"positional": np.ones((1, 3))}, ValueError, ["positional"]),
    (embed, ([0, 1], np.eye(3)), {"positional": np.ones((4, 2))}, ValueError, ["(4, 2)"]),
    (embed, ([0, 1], np.eye(3)), {"scale_by_sqrt_d": 1}, TypeError, ["scale_by_sqrt_d"]),
]


@pytest.mark.parametrize(("function", "args", "kwargs", "exception", "words"), BAD_CALLS)
def test_bad_input_is_refused_before_any_kernel(
    kernels_must_not_run, function, args, kwargs, exception, words
):
    assert_refused(lambda: function(*args, **kwargs, backend="cpu"), exception, words)

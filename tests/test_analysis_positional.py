"""tfmath.analysis.positional: each claimed property measured, and a test that it holds.

Every property is checked against something computed independently of the
function under test: the encoding matrix itself, SciPy's pairwise distances,
closed forms, or a brute-force search. Tolerances: a dot product or squared
distance of d terms of size at most 1 is accurate to about ``d * eps``
(Higham, section 3.1), so ``8 * d * eps`` bounds disagreements; a rotation
of an encoding entry costs two products and a sum, a few ``eps``.
"""

import math
from decimal import Context, Decimal, localcontext

import numpy as np
import pytest
from _errors import assert_refused
from _tolerances import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.spatial.distance import pdist
from test_positional import PI_70, _decimal_sine_cosine, naive_encoding

from tfmath.analysis import positional as analysis
from tfmath.positional import sinusoidal_encoding

EPS = np.finfo(np.float64).eps


def _max_abs(array):
    return float(np.max(np.abs(array)))


def _sized(backend, size, simulator_size):
    """The CUDA simulator runs one Python thread per CUDA thread: keep its problems tiny."""
    return simulator_size if backend == "cuda" else size


# --- 1. bounded values ------------------------------------------------------------------------


def test_every_value_is_in_the_unit_interval(any_backend):
    n_positions = _sized(any_backend, 3000, 12)
    bounds = analysis.encoding_bounds(n_positions, _sized(any_backend, 64, 2), backend=any_backend)
    assert -1 <= bounds.minimum and bounds.maximum <= 1
    assert bounds.maximum == 1.0  # cos(0)
    assert bounds.minimum < -0.9999  # sin(11) = -0.99999021


def test_bounds_stream_blocks_without_missing_any(monkeypatch):
    monkeypatch.setattr(analysis, "BLOCK_POSITIONS", 7)
    encoding = sinusoidal_encoding(100, 9)
    bounds = analysis.encoding_bounds(100, 9, backend="cpu")
    assert (bounds.minimum, bounds.maximum) == (encoding.min(), encoding.max())


# --- 2. unique positions ----------------------------------------------------------------------


def test_offset_distance_is_the_distance_at_every_position(any_backend):
    encoding = sinusoidal_encoding(400, 16, base=100.0)
    n_offsets = _sized(any_backend, 200, 20)
    distances = analysis.offset_distances(n_offsets, 16, base=100.0, backend=any_backend)
    for p in (0, 17, 199):
        direct = np.linalg.norm(encoding[p : p + n_offsets] - encoding[p], axis=1)
        assert_close(distances, direct, 8 * 16 * EPS)


def test_offset_distance_for_two_dimensions_is_a_chord(any_backend):
    k = np.arange(_sized(any_backend, 1000, 30))
    distances = analysis.offset_distances(len(k), 2, backend=any_backend)
    assert_close(distances, 2 * np.abs(np.sin(k / 2)), 1e-13)


@st.composite
def offset_requests(draw, max_offsets=40, max_pairs=8):
    return {
        "n_offsets": draw(st.integers(0, max_offsets)),
        "d_model": 2 * draw(st.integers(1, max_pairs)),
        "base": draw(st.sampled_from([10000.0, 3.0, 1e5])),
        "first_offset": draw(st.integers(-(2**31) + 100, 2**31 - 100)),
    }


def _check_offsets_against_reference(request, backend):
    assert_close(
        analysis.offset_distances(**request, backend=backend),
        analysis.offset_distances(**request, backend="reference"),
        8 * request["d_model"] * EPS,
    )


@given(request=offset_requests())
def test_cpu_offset_distances_match_reference(request):
    _check_offsets_against_reference(request, "cpu")


@pytest.mark.cuda
@settings(max_examples=20)
@given(request=offset_requests(max_offsets=6, max_pairs=3))
def test_cuda_offset_distances_match_reference(request):
    _check_offsets_against_reference(request, "cuda")


@pytest.mark.parametrize(("n_positions", "d_model", "base"), [(300, 16, 10000.0), (500, 4, 50.0)])
def test_offset_and_direct_minimum_agree_with_scipy(any_backend, n_positions, d_model, base):
    n_positions = _sized(any_backend, n_positions, 24)
    encoding = sinusoidal_encoding(n_positions, d_model, base=base)
    expected = pdist(encoding).min()
    by_offset = analysis.min_pairwise_distance(n_positions, d_model, base=base, backend=any_backend)
    direct = analysis.min_pairwise_distance_direct(encoding, backend=any_backend)
    # Each entry is within a few eps of exact, so distances between rows agree to
    # a few eps * sqrt(d) in absolute terms, however small they are.
    tolerance = 8 * d_model * EPS
    for found in (by_offset, direct):
        assert math.isclose(found.distance, expected, abs_tol=tolerance)
        pair_distance = np.linalg.norm(encoding[found.first] - encoding[found.second])
        assert math.isclose(pair_distance, expected, abs_tol=tolerance)
        assert found.first < found.second


@st.composite
def point_clouds(draw, max_points=40, max_features=6):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n_points = draw(st.integers(0, max_points))
    points = rng.standard_normal((n_points, draw(st.integers(1, max_features))))
    if n_points > 3 and draw(st.booleans()):
        points[-1] = points[1]  # an exact duplicate: distance 0
    return points


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_closest_pair_refuses_non_finite_points(backend):
    # The backends read a NaN distance differently (one kept it, one skipped the pair).
    points = np.array([[0.0, np.nan], [0.0, 0.0], [1.0, 1.0]])
    with pytest.raises(ValueError, match="finite"):
        analysis.min_pairwise_distance_direct(points, backend=backend)


def _check_direct_minimum(points, backend):
    found = analysis.min_pairwise_distance_direct(points, backend=backend)
    if len(points) < 2:
        assert found == analysis.ClosestPair(math.inf, -1, -1)
        return
    expected = pdist(points).min()
    assert math.isclose(found.distance, expected, rel_tol=1e-14, abs_tol=1e-300)
    assert math.isclose(
        np.linalg.norm(points[found.first] - points[found.second]), expected, rel_tol=1e-14
    )


@given(points=point_clouds())
def test_cpu_direct_minimum_matches_scipy(points):
    _check_direct_minimum(points, "cpu")


@given(points=point_clouds())
def test_reference_direct_minimum_matches_scipy(points):
    _check_direct_minimum(points, "reference")


@pytest.mark.cuda
@settings(max_examples=20)
@given(points=point_clouds(max_points=12, max_features=3))
def test_cuda_direct_minimum_matches_scipy(points):
    _check_direct_minimum(points, "cuda")


def test_direct_minimum_crosses_tiles():
    # More rows than one tile, the closest pair in different tiles.
    rng = np.random.default_rng(0)
    points = rng.standard_normal((700, 3)) * 100
    points[650] = points[3] + 1e-9
    found = analysis.min_pairwise_distance_direct(points, backend="cpu")
    assert (found.first, found.second) == (3, 650)
    assert math.isclose(found.distance, np.sqrt(3) * 1e-9, rel_tol=1e-5)


def test_positions_stay_apart_up_to_a_hundred_thousand_at_d512():
    found = analysis.min_pairwise_distance(10**5, 512, backend="cpu")
    # The closest encodings are neighbours: D(1) = 2 sqrt(sum_i sin^2(omega_i / 2)).
    omega = 10000.0 ** (-np.arange(0, 512, 2) / 512)
    neighbours = 2 * np.sqrt(np.sum(np.sin(omega / 2) ** 2))
    assert found.second - found.first == 1
    assert math.isclose(found.distance, neighbours, rel_tol=1e-13)
    assert found.distance > 3.7


def test_odd_d_model_is_refused_by_the_offset_shortcut():
    with pytest.raises(ValueError, match="even d_model"):
        analysis.min_pairwise_distance(10, 5)


def _brute_force_first_collision(d_model, tolerance, base=10000.0, limit=20000):
    encoding = naive_encoding(range(limit), d_model, base)  # accurate to 1e-11 below 2e4
    distances = np.linalg.norm(encoding[1:] - encoding[0], axis=1)
    return int(np.flatnonzero(distances <= tolerance)[0]) + 2


@pytest.mark.parametrize(("d_model", "tolerance"), [(2, 1e-2), (2, 1e-4), (4, 1e-1), (4, 2e-2)])
def test_first_collision_matches_brute_force(d_model, tolerance):
    expected = _brute_force_first_collision(d_model, tolerance)
    assert analysis.first_collision(d_model, tolerance=tolerance, backend="cpu") == expected


def test_first_collision_gives_up_at_the_limit():
    assert analysis.first_collision(8, tolerance=1e-6, max_positions=5000, backend="cpu") is None


@pytest.mark.parametrize("tolerance", [0.5, 1e-2, 1e-4, 1e-5])
def test_continued_fractions_agree_with_the_scan(tolerance):
    scanned = analysis.first_collision(2, tolerance=tolerance, backend="cpu")
    assert analysis.first_collision_two_dimensional(tolerance) == scanned


def _decimal_chord(k):
    """2 |sin(k / 2)| to about 60 digits."""
    with localcontext(Context(prec=70)):
        half = Decimal(k) / 2
        half -= PI_70 * (half / PI_70).to_integral_value()
        return 2 * abs(_decimal_sine_cosine(half)[0])


def test_two_dimensional_collision_at_float64_resolution():
    n = analysis.first_collision_two_dimensional()
    tolerance = Decimal(analysis.FLOAT64_RESOLUTION)
    # Offset n - 1 collides; the previous record holders (convergents) do not.
    assert _decimal_chord(n - 1) <= tolerance
    assert n > 2**53  # beyond where float64 can even tell positions p and p + 1 apart
    for earlier in (710, 103993, 1783366216531, 297428312591452):
        assert _decimal_chord(earlier) > tolerance


# --- 3. relative positions --------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 1, 7, -3, 1000, 2**30])
def test_shift_matrix_is_the_block_rotation(k):
    d_model = 6
    matrix = analysis.relative_shift_matrix(k, d_model, 100.0)
    with localcontext(Context(prec=70)):
        for i in range(d_model // 2):
            omega = (Decimal(-2 * i) / d_model * Decimal(100).ln()).exp()
            angle = Decimal(k) * omega
            angle -= 2 * PI_70 * (angle / (2 * PI_70)).to_integral_value()
            sine, cosine = (float(v) for v in _decimal_sine_cosine(angle))
            block = matrix[2 * i : 2 * i + 2, 2 * i : 2 * i + 2]
            assert_close(block, np.array([[cosine, sine], [-sine, cosine]]), 2e-15)
    off_diagonal = matrix.copy()
    for i in range(0, d_model, 2):
        off_diagonal[i : i + 2, i : i + 2] = 0
    assert np.all(off_diagonal == 0)


def test_shift_matrices_form_a_group_of_rotations():
    m3, m5 = (analysis.relative_shift_matrix(k, 8) for k in (3, 5))
    assert_close(m3 @ m5, analysis.relative_shift_matrix(8, 8), 8 * EPS)
    assert_close(m3.T, analysis.relative_shift_matrix(-3, 8), 4 * EPS)
    assert_close(m3 @ m3.T, np.eye(8), 8 * EPS)


@pytest.mark.parametrize("start", [0, 10**6, 2**31 - 2000])
def test_shift_matrix_maps_every_position_to_its_shift(any_backend, start):
    shifts = _sized(any_backend, [1, 2, 17, 999, -40], [1, 2, 3, 7, -4])
    n_positions = _sized(any_backend, 1000, 6)
    d_model = _sized(any_backend, 512, 4)
    residual = analysis.rotation_residual(
        n_positions, shifts, d_model, start=start, backend=any_backend
    )
    assert residual.shape == (5,)
    assert residual.max() < 1e-12


def test_rotation_residual_exposes_naive_angles():
    # The same check on the textbook float64 formula fails at large positions.
    start, k, d_model = 10**6, 5, 64
    naive = naive_encoding(range(start, start + 200 + k), d_model)
    rotated = naive[:200] @ analysis.relative_shift_matrix(k, d_model).T
    assert _max_abs(naive[k:] - rotated) > 1e-12


def test_odd_d_model_has_no_shift_matrix():
    with pytest.raises(ValueError, match="even d_model"):
        analysis.relative_shift_matrix(1, 7)


def test_dot_product_depends_only_on_the_shift(any_backend):
    d_model = _sized(any_backend, 128, 4)
    shifts = _sized(any_backend, [0, 1, 2, 10, 333], [0, 1, 2, 5])
    n_positions = _sized(any_backend, 400, 8)
    check = analysis.relative_dot_products(n_positions, shifts, d_model, backend=any_backend)
    omega = 10000.0 ** (-np.arange(0, d_model, 2) / d_model)
    expected = np.cos(np.outer(shifts, omega)).sum(axis=1)  # small k: naive cos is accurate
    assert_close(check.closed_form, expected, 1e-12)
    assert check.closed_form[0] == d_model / 2
    tolerance = 8 * d_model * EPS
    assert check.spread.max() < tolerance and check.max_error.max() < tolerance


def test_dot_product_check_detects_the_unpaired_column():
    check = analysis.relative_dot_products(100, [1, 5], 7)
    assert check.spread.min() > 1e-4  # sin(w p) sin(w (p + k)) varies with p


def test_wavelengths_are_geometric_from_two_pi():
    lengths = analysis.wavelengths(512)
    assert lengths.shape == (256,)
    assert math.isclose(lengths[0], 2 * math.pi, rel_tol=1e-15)
    assert_close(lengths[1:] / lengths[:-1], np.full(255, 10000.0 ** (2 / 512)), 1e-13)
    assert math.isclose(lengths[-1], 2 * math.pi * 10000.0 ** (510 / 512), rel_tol=1e-13)


# --- 4. permutation equivariance ---------------------------------------------------------------


def test_attention_without_positions_is_permutation_equivariant(any_backend):
    size = _sized(any_backend, {}, {"n_tokens": 5, "d_model": 4})
    check = analysis.permutation_equivariance(**size, backend=any_backend)
    # Same numbers, summed in permuted order by the softmax and the weighted sum.
    assert check.equivariance_residual < 64 * EPS * check.output_scale
    # ... and not invariant, as seed 001's wording ("the exact same output") would have it.
    assert check.invariance_gap > 0.1 * check.output_scale
    assert np.all(check.permutation != np.arange(len(check.permutation)))


@pytest.mark.parametrize("positional", ["sinusoidal", "rotary", "alibi"])
def test_positional_information_breaks_equivariance(any_backend, positional):
    size = _sized(any_backend, {}, {"n_tokens": 5, "d_model": 4})
    check = analysis.permutation_equivariance(**size, positional=positional, backend=any_backend)
    assert check.equivariance_residual > 1e-3 * check.output_scale


def test_equivariance_check_refuses_unknown_schemes():
    with pytest.raises(ValueError, match="positional"):
        analysis.permutation_equivariance(positional="learned")


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "exception", "words"),
    [
        (lambda: analysis.rotation_residual(10, [], 8), ValueError, ["shifts", "none"]),
        (lambda: analysis.rotation_residual(10, [1.5], 8), TypeError, ["shifts", "1.5"]),
        (lambda: analysis.rotation_residual(10, [1], 7), ValueError, ["even d_model", "7"]),
        (lambda: analysis.relative_dot_products(10, [-1], 8), ValueError, ["shifts", "-1"]),
        (lambda: analysis.encoding_bounds(0, 8), ValueError, ["n_positions", "0"]),
        (lambda: analysis.offset_distances(5, 8, base=1.0), ValueError, ["base"]),
        (lambda: analysis.offset_distances(5, 8, first_offset=2**31), ValueError, ["2**31"]),
        (lambda: analysis.first_collision(2, tolerance=0.0), ValueError, ["tolerance"]),
        (lambda: analysis.first_collision(2, max_positions=2**32), ValueError, ["max_positions"]),
        (lambda: analysis.first_collision_two_dimensional(2.5), ValueError, ["tolerance"]),
        (lambda: analysis.first_collision_two_dimensional("0.1"), TypeError, ["tolerance"]),
        (lambda: analysis.min_pairwise_distance_direct(np.ones(4)), ValueError, ["encoding"]),
        (lambda: analysis.min_pairwise_distance_direct([["a"]]), TypeError, ["encoding"]),
        (lambda: analysis.relative_shift_matrix(0.5, 8), TypeError, ["k"]),
        (lambda: analysis.permutation_equivariance(n_tokens=1), ValueError, ["n_tokens"]),
    ],
)
def test_bad_analysis_input_names_the_argument(call, exception, words):
    assert_refused(call, exception, words)


# --- the report experiments -------------------------------------------------------------------

EXPERIMENTS = [
    "positional_heatmap",
    "positional_similarity",
    "positional_wavelengths",
    "positional_rotation",
    "positional_uniqueness",
    "positional_permutation",
]


def _check_uniqueness_numbers(data):
    measured = data["min_pairwise_distance"]
    assert measured["n_positions"] == 10**5 and measured["d_model"] == 512
    assert measured["distance"] == analysis.min_pairwise_distance(10**5, 512).distance
    assert max(row["abs_difference"] for row in data["direct_cross_check"]) < 1e-13


def _check_rotation_numbers(data):
    assert data["rotation_residual"]["max_residual"] < 1e-12


def _check_bounds_numbers(data):
    assert -1 <= data["bounds"]["minimum"] < -0.999999 and data["bounds"]["maximum"] == 1.0


NUMBER_CHECKS = {
    "positional_uniqueness": _check_uniqueness_numbers,
    "positional_rotation": _check_rotation_numbers,
    "positional_heatmap": _check_bounds_numbers,
}


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_produces_a_figure_data_and_a_caption(name):
    from tfmath.report import RunSettings, registered_experiments

    experiments = {e.name: e for e in registered_experiments()}
    result = experiments[name].run(RunSettings(quick=True, backend="cpu"))
    assert result.figures and result.data and len(result.caption) > 100
    for figure in result.figures.values():
        for axes in figure.axes:
            if axes.get_label() != "<colorbar>":
                assert axes.get_title() and axes.get_xlabel() and axes.get_ylabel()
    NUMBER_CHECKS.get(name, lambda data: None)(result.data)

"""tfmath.training.optim: Adam against PyTorch and closed forms, and the warm-up schedule's peak."""

import math

import numpy as np
import pytest

from tfmath.errors import ShapeError
from tfmath.formulas.accounting import ModelConfig
from tfmath.training import layers as L
from tfmath.training import models as M
from tfmath.training.optim import Adam, AdamState, WarmupSchedule
from tfmath.training.params import Parameters


@pytest.mark.parametrize(("d_model", "warmup"), [(512, 4000), (1024, 4000), (64, 1), (8, 37.5)])
def test_schedule_peaks_at_the_warmup_step(d_model, warmup):
    schedule = WarmupSchedule(d_model, warmup)
    steps = np.arange(1, int(4 * warmup) + 2)
    rates = schedule(steps)
    # The peak over whole steps is at warmup (or a neighbour when warmup is fractional).
    assert abs(steps[np.argmax(rates)] - warmup) < 1
    assert schedule.peak_step == warmup
    assert math.isclose(schedule.peak_learning_rate, (d_model * warmup) ** -0.5, rel_tol=1e-15)
    assert math.isclose(schedule(warmup), schedule.peak_learning_rate, rel_tol=1e-15)
    assert np.all(rates <= schedule.peak_learning_rate * (1 + 1e-15))


def test_schedule_rises_linearly_then_decays_as_inverse_square_root():
    schedule = WarmupSchedule(512, 4000)
    # Linear warm-up: lr(t) = t * d^-0.5 * w^-1.5.
    assert math.isclose(schedule(1000), 1000 * 512**-0.5 * 4000**-1.5, rel_tol=1e-15)
    assert math.isclose(schedule(2000) / schedule(1000), 2.0, rel_tol=1e-15)
    # After the peak, lr(4w) = lr(w) / 2.
    assert math.isclose(schedule(16000) / schedule(4000), 0.5, rel_tol=1e-15)
    # Vaswani et al.'s base model peaks at 1 / sqrt(512 * 4000) = 6.9877e-4.
    assert round(schedule.peak_learning_rate, 8) == 0.00069877


@pytest.mark.parametrize(
    ("args", "word"), [((512, 0), "warmup"), ((512, 0.5), "warmup"), ((0, 4000), "d_model")]
)
def test_bad_schedules_are_refused(args, word):
    with pytest.raises(ValueError, match=word):
        WarmupSchedule(*args)
    with pytest.raises(TypeError, match="warmup"):
        WarmupSchedule(512, "4000")


def test_step_zero_is_refused():
    with pytest.raises(ValueError, match="step"):
        WarmupSchedule(512, 4000)(0)


def test_adam_defaults_are_the_transformers():
    adam = Adam()
    assert (adam.beta1, adam.beta2, adam.eps) == (0.9, 0.98, 1e-9)


def test_first_adam_step_is_the_sign_of_the_gradient():
    # With bias correction, m_1 / (1 - b1) = g and v_1 / (1 - b2) = g^2, so the first
    # update is lr * g / (|g| + eps).
    theta, g = np.array([1.0, -2.0, 3.0]), np.array([0.5, -4.0, 1e-3])
    adam = Adam(learning_rate=0.01)
    params = Parameters({"w": theta})
    new, state = adam.update(params, Parameters({"w": g}), adam.init(params))
    assert np.allclose(new["w"], theta - 0.01 * g / (np.abs(g) + 1e-9), rtol=1e-15, atol=0)
    assert state.step == 1
    assert np.array_equal(params["w"], theta)  # the input is not modified


@pytest.mark.parametrize(
    ("dtype", "gradient", "eps", "moved"),
    [
        (np.float32, 2e19, 1e-9, True),  # g^2 beyond float32: the step is still lr
        (np.float32, -1e20, 1e-9, True),
        (np.float32, 1e-30, 0.0, True),  # g^2 below float32's subnormals, no eps to hide it
        (np.float64, 1e160, 1e-9, False),  # g^2 beyond float64: v = inf, no step (PyTorch's)
    ],
)
def test_adam_at_the_ends_of_the_dtype(dtype, gradient, eps, moved):
    # The functional optimiser and the fused step's kernel take the same first step,
    # lr * sign(g), wherever g^2 is finite in float64. Before: functional float32 did not
    # move from |g| = 1.8e19 and gave -inf at 1e-30 with eps = 0; the fused kernel turned
    # a float64 parameter into NaN at 1e160 (an approximate square root of inf).
    from tfmath.kernels.cpu.training_step import adam_update

    theta, g = np.ones(3, dtype), np.full(3, gradient, dtype)
    adam = Adam(learning_rate=1e-3, eps=eps)
    params = Parameters({"w": theta})
    functional = adam.update(params, Parameters({"w": g}), adam.init(params))[0]["w"]
    fused = theta.copy()
    adam_update(fused, g, np.zeros(3), np.zeros(3), 1e-3, adam.beta1, adam.beta2, eps, 1)
    expected = theta - 1e-3 * np.sign(g) if moved else theta
    np.testing.assert_array_equal(functional, expected.astype(dtype))
    np.testing.assert_array_equal(fused, expected.astype(dtype))


def test_adam_matches_pytorch_with_the_warmup_schedule():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    shapes = {"w": (3, 4), "b": (4,)}
    params = Parameters({n: rng.standard_normal(s) for n, s in shapes.items()})
    schedule = WarmupSchedule(16, 3)
    adam = Adam(learning_rate=schedule)
    state = adam.init(params)
    tensors = {n: torch.tensor(a, requires_grad=True) for n, a in params.items()}
    reference = torch.optim.Adam(tensors.values(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    for step in range(1, 7):
        grads = Parameters({n: rng.standard_normal(s) for n, s in shapes.items()})
        params, state = adam.update(params, grads, state)
        for group in reference.param_groups:
            group["lr"] = schedule(step)
        for name, tensor in tensors.items():
            tensor.grad = torch.from_numpy(grads[name].copy())
        reference.step()
    for name, tensor in tensors.items():
        np.testing.assert_allclose(params[name], tensor.detach().numpy(), rtol=1e-13, atol=1e-15)
    assert state.step == 6


def test_adam_state_is_explicit():
    params = Parameters({"w": np.ones(2)})
    grads = Parameters({"w": np.array([1.0, -1.0])})
    adam = Adam(learning_rate=0.1)
    start = adam.init(params)
    once, state_once = adam.update(params, grads, start)
    again, _ = adam.update(params, grads, start)
    assert np.array_equal(once["w"], again["w"])  # same inputs, same step: nothing hidden
    twice, state_twice = adam.update(once, grads, state_once)
    assert isinstance(state_twice, AdamState) and state_twice.step == 2
    assert not np.array_equal(twice["w"], once["w"])


def test_adam_trains_a_tiny_language_model():
    config = ModelConfig(
        name="tiny",
        architecture="decoder",
        vocab_size=7,
        d_model=8,
        n_layers=1,
        n_heads=2,
        d_ff=16,
        n_positions=8,
        n_ctx=8,
    )
    tokens = np.array([[1, 2, 3, 4, 5, 6, 1, 2], [3, 4, 5, 6, 1, 2, 3, 4]])
    params = M.init_model(config, seed=0, std=0.1)
    adam = Adam(learning_rate=WarmupSchedule(d_model=8, warmup=10))
    state = adam.init(params)
    losses = []
    for _ in range(40):
        logits, cache = M.decoder_only_forward(params, tokens[:, :-1], config, backend="reference")
        loss, loss_cache = L.cross_entropy_forward(logits, tokens[:, 1:], backend="reference")
        losses.append(float(loss))
        grads = M.decoder_only_backward(L.cross_entropy_backward(1.0, loss_cache), cache)
        params, state = adam.update(params, grads, state)
    # The sequence is a cycle, so the next token is predictable: the loss must fall well
    # below log(7) = 1.95, the loss of a uniform guess.
    assert losses[0] > 1.8 and losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize(
    ("kwargs", "exception", "word"),
    [
        ({"beta1": 1.0}, ValueError, "beta1"),
        ({"beta2": -0.1}, ValueError, "beta2"),
        ({"eps": -1e-9}, ValueError, "eps"),
        ({"learning_rate": -0.1}, ValueError, "learning_rate"),
        ({"learning_rate": "0.1"}, TypeError, "learning_rate"),
    ],
)
def test_bad_adam_settings_are_refused(kwargs, exception, word):
    with pytest.raises(exception, match=word):
        Adam(**kwargs)


def test_mismatched_gradients_are_refused():
    params = Parameters({"w": np.ones(2), "b": np.ones(1)})
    adam = Adam()
    state = adam.init(params)
    with pytest.raises(ShapeError, match="missing"):
        adam.update(params, Parameters({"w": np.ones(2)}), state)
    with pytest.raises(ShapeError, match="grads"):
        adam.update(params, Parameters({"w": np.ones(3), "b": np.ones(1)}), state)
    with pytest.raises(TypeError, match="params"):
        adam.update({"w": np.ones(2)}, params, state)


def test_a_state_of_other_parameters_is_refused_by_name():
    params = Parameters({"w": np.ones(2), "b": np.ones(1)})
    adam = Adam()
    other = adam.init(Parameters({"v": np.ones(2), "b": np.ones(1)}))
    with pytest.raises(ShapeError, match=r"state.first_moment .* missing \['w'\], extra \['v'\]"):
        adam.update(params, params, other)
    state = adam.init(params)
    wrong = AdamState(state.step, state.first_moment,
                      Parameters({"w": np.ones(3), "b": np.ones(1)}))  # fmt: skip
    with pytest.raises(ShapeError, match=r"state.second_moment\['w'\] has shape \(3,\)"):
        adam.update(params, params, wrong)

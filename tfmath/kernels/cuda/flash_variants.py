"""Attention's variants on the GPU: not implemented; the public module refuses
``backend="cuda"`` for them before it gets here, and these say so if reached."""

from tfmath.errors import BackendUnavailableError

_MESSAGE = (
    "attention's variants (flash_attention, flash_attention_varlen, flex_attention) run on "
    "the CPU only; use backend='cpu' or backend='reference'"
)


def variant_attention(problem):
    raise BackendUnavailableError(_MESSAGE)


def variant_attention_grad(problem, grad_output, grad_log_sum_exp, saved):
    raise BackendUnavailableError(_MESSAGE)


def variant_weights(problem):
    raise BackendUnavailableError(_MESSAGE)

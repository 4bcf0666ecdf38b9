"""The decoding method on the GPU: the flash kernel, which already runs one
thread block per (batch entry, tile of query rows) and splits each row's keys
over several threads, so a single query row keeps a block busy."""

from tfmath.kernels.cuda.flash_attention import flash_attention


def decode_attention(problem):
    """The output and each row's log-sum-exp of a validated attention problem."""
    return flash_attention(problem)

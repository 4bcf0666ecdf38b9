"""PyTorch tensors in, PyTorch tensors out: the array types a public function returns.

tfmath computes on NumPy arrays (and, on the GPU, Numba device arrays). A
public function given a ``torch.Tensor`` reads the tensor's memory without a
copy (``Tensor.numpy()`` on the CPU, ``__cuda_array_interface__`` on the GPU;
bfloat16, which neither carries, through an int16 view as ``ml_dtypes.bfloat16``),
computes, and
wraps its results back as tensors on the tensor's device (``torch.from_numpy``,
again without a copy). Tensors that require gradients go through a
``torch.autograd.Function`` whose backward is tfmath's own (:func:`differentiable`).

torch stays optional: it is never imported here. A value can only be a tensor
if torch has been imported already, so :func:`any_tensor` looks it up in
``sys.modules``, a dictionary lookup when it is absent.
"""

import contextlib
import dataclasses
import functools
import inspect
import itertools
import sys
from typing import NamedTuple

import numpy as np

from tfmath import _cuda
from tfmath.errors import DTypeError, LayoutError

#: Types no tensor has: :func:`any_tensor` passes over them without an ``isinstance``
#: (which a tensor's metaclass makes slow), as it does over most arguments.
_NOT_TENSORS = frozenset({np.ndarray, float, int, bool, str, type(None)})


def any_tensor(*values):
    """Whether some value is a ``torch.Tensor`` (False at once when torch is not imported)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    tensor = torch.Tensor
    for value in values:
        if type(value) not in _NOT_TENSORS and isinstance(value, tensor):
            return True
    return False


def needs_grad(*values):
    """Whether autograd must record a call on these values: grad mode is on and some
    tensor among them requires a gradient."""
    torch = sys.modules["torch"]
    return torch.is_grad_enabled() and any(
        isinstance(value, torch.Tensor) and value.requires_grad for value in values
    )


def to_array(name, tensor):
    """The tensor's data as a NumPy array (CPU) or Numba device array (CUDA), without a copy.

    On the CPU strides carry over as they are; the kernels' own layout rules decide
    later whether a contiguous copy is needed, exactly as for a NumPy view. A strided
    CUDA tensor is copied contiguous on the device (the CUDA kernels read contiguous
    arrays). A tensor of another layout (sparse, MKL-DNN) is refused as such, naming
    its layout.
    """
    torch = sys.modules["torch"]
    if tensor.layout is not torch.strided:
        raise LayoutError(
            f"{name} has layout {tensor.layout}; tfmath reads strided (dense) tensors only: "
            f"pass {name}.to_dense()"
        )
    tensor = tensor.detach()
    if tensor.is_conj() or tensor.is_neg():
        tensor = tensor.resolve_conj().resolve_neg()
    device = tensor.device.type
    if device == "cuda":
        # A strided tensor (heads transposed out of (batch, L, heads, E), say) is copied
        # contiguous by torch, on the device and its current stream, as the CUDA kernels
        # read C-contiguous arrays; PyTorch's own attention takes any strides. The
        # kernels launch on that stream too (on_torch_stream), after the work that wrote
        # the tensor, so Numba need not wait for it on the host (sync=False).
        tensor = tensor.contiguous()
        if tensor.dtype is torch.bfloat16:
            # No CUDA array interface carries bfloat16: the tensor's 16-bit words are
            # read as int16 and viewed as ml_dtypes.bfloat16 (as on the CPU).
            import ml_dtypes

            words = _cuda.as_device_array(tensor.view(torch.int16), sync=False)
            return words.view(ml_dtypes.bfloat16)
        return _cuda.as_device_array(tensor, sync=False)
    if device != "cpu":
        raise DTypeError(
            f"{name} is a tensor on device {tensor.device}; tfmath computes on 'cpu' and "
            f"'cuda' tensors: move it with {name}.to('cpu')"
        )
    if tensor.dtype is torch.bfloat16:
        import ml_dtypes  # loaded with the first bfloat16 tensor

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    try:
        return tensor.numpy()
    except TypeError as error:  # torch dtypes NumPy has no counterpart for
        raise DTypeError(
            f"{name} has dtype {tensor.dtype}, which tfmath cannot read: {error}"
        ) from None


#: The dtypes the CPU kernels compute in, which :func:`plain_cpu_arrays` accepts.
_KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def plain_cpu_arrays(*tensors):
    """The tensors' data as NumPy arrays, without a copy, when each is a plain CPU
    tensor: exactly ``torch.Tensor`` (no subclass, no ``Parameter``), strided, float32 or
    float64, without a pending negation; None otherwise.

    The few comparisons a short path makes instead of :func:`to_array`'s general
    reading: whatever they do not recognise goes the general way, whose errors it keeps.
    ``Tensor.numpy`` itself refuses every tensor without a NumPy view (another device,
    a sparse or MKL-DNN layout, a pending negation or conjugation, a dtype NumPy
    lacks), which spares the short path asking each tensor four questions first.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    arrays = []
    for tensor in tensors:
        if type(tensor) is not torch.Tensor:
            return None
        try:
            array = tensor.detach().numpy()
        except (TypeError, RuntimeError):
            return None
        if array.dtype not in _KERNEL_DTYPES:
            return None
        arrays.append(array)
    return tuple(arrays)


class PlainCudaCall(NamedTuple):
    """A plain attention call on CUDA tensors, ready for the tensor-core forward:
    :func:`plain_cuda_call` made it."""

    format_name: str  #: the operands' NumPy dtype name, float16 or bfloat16
    shape: tuple  #: the query's ``(n_batch, L, d)``, batch dimensions flattened
    key_rows: int  #: S
    addresses: tuple  #: device addresses of query, key, value and the output
    stream: int  #: the handle of torch's current stream on the operands' device
    output: object  #: the output tensor, allocated by torch's caching allocator


#: The formats of the CUDA short path, by torch dtype name.
_HALF_FORMATS = {"torch.float16": "float16", "torch.bfloat16": "bfloat16"}


def plain_cuda_call(query, key, value, serves):
    """A :class:`PlainCudaCall` when query, key and value are plain CUDA tensors that
    ``serves(format_name, head_dim)`` says the tensor-core forward takes; None for any
    other call, which goes the general way and keeps its errors.

    Plain: exactly ``torch.Tensor``, strided, C-contiguous, on Numba's current GPU, one
    half-precision dtype, no pending negation, no gradient to record; the same batch
    dimensions, no empty dimension, keys and values as wide as the queries. The output
    is allocated on the operands' device by torch (its caching allocator, in stream
    order) and the kernel is to run on torch's current stream, so the call is ordered
    with the caller's other work on that stream and nothing waits for the GPU.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    tensors = (query, key, value)
    if not all(type(t) is torch.Tensor for t in tensors):
        return None
    format_name = _HALF_FORMATS.get(str(query.dtype))
    device = query.device
    if format_name is None or device.type != "cuda":
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    query_shape, key_shape = query.shape, key.shape
    if not (
        len(query_shape) >= 2
        and key_shape == value.shape
        and key_shape[:-2] == query_shape[:-2]
        and key_shape[-1] == query_shape[-1]
        and 0 not in query_shape
        and 0 not in key_shape
    ):
        return None
    head_dim = query_shape[-1]
    for t in tensors:
        if (
            t.dtype != query.dtype
            or t.device != device
            or t.layout is not torch.strided
            or t.is_neg()
            or not t.is_contiguous()
        ):
            return None
    if device.index != _cuda.numba_cuda().get_current_device().id:
        return None
    if not serves(format_name, head_dim):
        return None
    output = torch.empty(query_shape, dtype=query.dtype, device=device)
    n_batch = query.numel() // (query_shape[-2] * head_dim)
    return PlainCudaCall(
        format_name,
        (n_batch, query_shape[-2], head_dim),
        key_shape[-2],
        (query.data_ptr(), key.data_ptr(), value.data_ptr(), output.data_ptr()),
        torch.cuda.current_stream(device).cuda_stream,
        output,
    )


def to_tensor(array, device):
    """Wrap a result array as a tensor on ``device``, without a copy where NumPy's
    strides allow (torch has no negative strides)."""
    torch = sys.modules["torch"]
    if _cuda.is_device_array(array):
        if array.dtype.kind == "V" and array.dtype.name == "bfloat16":
            words = torch.as_tensor(array.view(np.int16), device=device)
            return words.view(torch.bfloat16)
        return torch.as_tensor(array, device=device)
    array = np.asarray(array)
    if min(array.strides, default=0) < 0 or not array.flags.writeable:
        array = array.copy()
    if array.dtype.kind == "V" and array.dtype.name == "bfloat16":  # kind: a cheap test first
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _wrap_results(result, device):
    """Results as tensors: arrays converted; tuples (named ones too), lists and the
    array fields of dataclass records walked; everything else (Python numbers, strings)
    returned as it is."""
    if isinstance(result, np.ndarray | np.generic) or _cuda.is_device_array(result):
        return to_tensor(result, device)  # a NumPy scalar (a mean loss) as a 0-d tensor
    if isinstance(result, tuple):
        items = [_wrap_results(item, device) for item in result]
        return type(result)._make(items) if hasattr(result, "_fields") else tuple(items)
    if isinstance(result, list):
        return [_wrap_results(item, device) for item in result]
    if dataclasses.is_dataclass(result) and not isinstance(result, type):
        arrays = {
            field.name: to_tensor(getattr(result, field.name), device)
            for field in dataclasses.fields(result)
            if field.init and isinstance(getattr(result, field.name), np.ndarray)
        }
        return dataclasses.replace(result, **arrays) if arrays else result
    return result


def _unwrap(name, value):
    torch = sys.modules["torch"]
    return to_array(name, value) if isinstance(value, torch.Tensor) else value


def _first_device(values):
    torch = sys.modules["torch"]
    return next(value.device for value in values if isinstance(value, torch.Tensor))


def call_with_arrays(function, name, args, kwargs, autograd=None, reads_outputs=False):
    """``function(*args, **kwargs)`` with every tensor argument read as an array and
    every array result wrapped back as a tensor on the first tensor's device.

    ``autograd``, when given, returns the ``(forward, backward)`` pair of a block:
    ``forward(*args, **kwargs)`` gives ``(result, cache)`` and ``backward(grad,
    cache)`` the gradients of the leading positional arguments (one array or a
    tuple); with it, tensors that need a gradient run through autograd. Without
    it they are refused: a result silently cut from the graph would train nothing.
    ``reads_outputs``: whether the block's cache holds its result (see :class:`Rule`).
    """
    values = list(itertools.chain(args, kwargs.values()))
    if needs_grad(*values):
        if autograd is not None:
            return _block_through_autograd(*autograd(), args, kwargs, reads_outputs)
        raise DTypeError(
            f"tfmath.{name} has no backward pass, but an argument requires grad; pass "
            "tensor.detach() or call it under torch.no_grad()"
        )
    device = _first_device(values)
    names = _parameter_names(function, len(args))
    with on_torch_stream(device):
        result = function(
            *(_unwrap(name, value) for name, value in zip(names, args, strict=True)),
            **{key: _unwrap(key, value) for key, value in kwargs.items()},
        )
    return _wrap_results(result, device)


def on_torch_stream(device):
    """For a CUDA ``device``: kernels launch on torch's current stream there, as torch's
    own operators do (:func:`tfmath._cuda.launching_on`); for the CPU, nothing."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    torch = sys.modules["torch"]
    return _cuda.launching_on(torch.cuda.current_stream(device).cuda_stream)


def _parameter_names(function, count):
    """The names of ``function``'s first ``count`` positional parameters, for errors."""
    parameters = list(inspect.signature(function).parameters)[:count]
    return parameters + [f"argument {i}" for i in range(len(parameters), count)]


def accepts_tensors(function=None, *, autograd=None, reads_outputs=False):
    """Let a public function take torch tensors and return them (see the module's doc);
    with ``autograd`` and ``reads_outputs`` (see :func:`call_with_arrays`), differentiably.

    NumPy calls pay one dictionary lookup when torch is not imported, and one
    ``isinstance`` per argument when it is.
    """
    if function is None:
        return functools.partial(accepts_tensors, autograd=autograd, reads_outputs=reads_outputs)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if any_tensor(*args, *kwargs.values()):
            return call_with_arrays(
                function, function.__name__, args, kwargs, autograd, reads_outputs
            )
        return function(*args, **kwargs)

    return wrapper


#: A block's signature, read once: a block runs through autograd on every training step.
_signature = functools.cache(inspect.signature)


def _block_through_autograd(forward, backward, args, kwargs, reads_outputs):
    """A block's ``forward``/``backward`` pair as one autograd node over the arguments of
    its positional parameters, however they were passed (its keyword-only parameters
    are options, which get no gradient)."""
    signature = _signature(forward)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    names = [
        name
        for name, parameter in signature.parameters.items()
        if parameter.kind is parameter.POSITIONAL_OR_KEYWORD
    ]
    operands = [bound.arguments.pop(name) for name in names]
    options = bound.arguments
    for name, value in options.items():
        if needs_grad(value):
            raise DTypeError(
                f"{name} requires grad, but tfmath.{forward.__name__.removesuffix('_forward')} "
                f"takes it as an option, without a gradient; pass {name}.detach()"
            )

    def block_forward(*arrays):
        result, cache = forward(*arrays, **{k: _unwrap(k, v) for k, v in options.items()})
        return (result,), cache

    def block_backward(cache, grad):
        grads = backward(grad, cache)
        grads = grads if isinstance(grads, tuple) else (grads,)
        return (*grads, *(None,) * (len(operands) - len(grads)))

    name = forward.__name__.removesuffix("_forward")
    rule = Rule(block_forward, block_backward, reads_outputs=reads_outputs, name=name)
    (result,) = differentiable(rule, names, operands)
    return result


# -- autograd ------------------------------------------------------------------------------


class Rule:
    """A differentiable computation on arrays, for :func:`differentiable`.

    ``forward(*arrays)`` returns ``(outputs, saved)``: a tuple of result arrays and
    whatever the backward needs. ``backward(saved, *grad_outputs)`` returns one
    gradient (or None) per input of ``forward``. Gradients of outputs that nothing
    used arrive as None.

    ``reads_outputs`` says that the backward reads the outputs (``saved`` shares their
    memory): they are then saved as tensors too, so that an output changed in place
    before the backward is caught by torch's version counters instead of giving
    wrong gradients. Without it, outputs may be changed in place, as the outputs of
    torch's own layer norm may.

    ``name`` names the computation in the error a second derivative raises (see
    :meth:`name_of`).
    """

    def __init__(self, forward, backward, *, reads_outputs=False, name=None):
        self.forward = forward
        self.backward = backward
        self.reads_outputs = reads_outputs
        self.name = name

    def name_of(self, default="function"):
        """``name``, or ``forward``'s name without its ``_forward`` suffix, or
        ``default`` (worked out only when an error needs it)."""
        if self.name is not None:
            return self.name
        name = getattr(self.forward, "__name__", "")
        return name.removesuffix("_forward") if name.endswith("_forward") else default


def second_derivative_message(name):
    """What differentiating one of tfmath's gradients again raises."""
    return (
        f"tfmath's {name} is differentiable once: a second derivative (create_graph=True / "
        "double backward, as in a Hessian-vector product or a penalty on this gradient) "
        "is not supported, because tfmath computes the gradient with its own backward "
        "kernels, which autograd cannot differentiate; compute the second derivative "
        "through PyTorch's own functions instead"
    )


@functools.cache
def _nondifferentiable_class():
    """The ``torch.autograd.Function`` that the gradients of a tfmath backward run
    under ``create_graph=True`` hang from: its forward passes them through, its
    backward, which only a second derivative reaches, raises."""
    torch = sys.modules["torch"]

    class Nondifferentiable(torch.autograd.Function):
        @staticmethod
        def forward(ctx, name, count, *tensors):
            ctx.name = name
            return tensors[:count]

        @staticmethod
        def backward(ctx, *grad_outputs):
            raise RuntimeError(second_derivative_message(ctx.name))

    return Nondifferentiable


def _differentiable_once(name, grads, sources):
    """``grads`` (tensors or None) as a backward under grad mode (``create_graph=True``)
    returns them: attached, through a node whose backward raises
    :func:`second_derivative_message`, to ``sources``, the inputs that required grad,
    so that a second derivative with respect to them reaches that node.

    What torch's ``once_differentiable`` does, but whatever the incoming gradients
    (``once_differentiable`` returns the gradients detached, so silently without a
    second derivative, when the incoming gradients do not require grad), with an
    error that names what is missing, and reachable from the inputs
    (``once_differentiable``'s node hangs from fresh leaves, so that
    ``autograd.grad(gradient, inputs)`` finds no path). The error comes only when the
    second derivative is taken: a ``create_graph=True`` backward whose other
    gradients alone are differentiated again works."""
    tensors = [g for g in grads if g is not None]
    if not tensors:
        return grads
    if not sources:  # unreachable through autograd, which calls a backward for inputs
        tensors = [g.detach().requires_grad_() for g in tensors]
    attached = iter(_nondifferentiable_class().apply(name, len(tensors), *tensors, *sources))
    return tuple(None if g is None else next(attached) for g in grads)


@functools.cache
def _function_class():
    """The ``torch.autograd.Function`` that runs a :class:`Rule` (defined at first use,
    so that torch is imported only by a caller that already has tensors)."""
    torch = sys.modules["torch"]

    class TfmathFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, rule, names, *inputs):
            device = _first_device(inputs)
            with on_torch_stream(device):
                arrays = [_unwrap(n, value) for n, value in zip(names, inputs, strict=True)]
                outputs, saved = rule.forward(*arrays)
            results = tuple(to_tensor(output, device) for output in outputs)
            # The inputs (and outputs the backward reads) are saved as tensors, so that
            # torch's version counters catch an in-place change between the forward and
            # the backward.
            inputs = (v if isinstance(v, torch.Tensor) else None for v in inputs)
            ctx.save_for_backward(*inputs, *(results if rule.reads_outputs else ()))
            ctx.rule, ctx.saved, ctx.device = rule, saved, device
            return results

        @staticmethod
        def backward(ctx, *grad_outputs):
            saved = ctx.saved_tensors  # raises if an input was changed in place
            # Autograd runs a backward on the stream its forward ran on.
            with on_torch_stream(ctx.device):
                grads = ctx.rule.backward(
                    ctx.saved,
                    *(None if g is None else _unwrap("grad_output", g) for g in grad_outputs),
                )
            # Only inputs that are tensors needing a gradient get one (NumPy arrays mixed
            # with tensors, a weight without requires_grad, get None).
            wanted = ctx.needs_input_grad[2:]
            wrapped = (
                to_tensor(g, ctx.device) if g is not None and want else None
                for g, want in zip(grads, wanted, strict=True)
            )
            if torch.is_grad_enabled():
                # backward(create_graph=True): tfmath's gradients are not differentiable
                # again, which a second derivative must be told.
                inputs = zip(saved[: len(wanted)], wanted, strict=True)
                sources = [t for t, want in inputs if t is not None and want]
                wrapped = _differentiable_once(ctx.rule.name_of(), tuple(wrapped), sources)
            return (None, None, *wrapped)

    return TfmathFunction


def differentiable(rule, names, inputs):
    """Apply ``rule`` to tensor ``inputs`` (named ``names`` for errors) through
    autograd; returns the tuple of output tensors."""
    return _function_class().apply(rule, tuple(names), *inputs)


@functools.cache
def _plain_function_class():
    """The lean ``torch.autograd.Function`` of :func:`differentiable_plain`."""
    torch = sys.modules["torch"]

    class PlainTfmathFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, rule, *inputs):
            output, saved = rule.forward()
            # A plain rule's results are arrays the kernels have just written (positive
            # strides, writeable, float32 or float64): torch wraps them as they are.
            result = torch.from_numpy(output)
            # Version counters, as above.
            ctx.save_for_backward(*inputs, *((result,) if rule.reads_outputs else ()))
            ctx.rule, ctx.saved = rule, saved
            return result

        @staticmethod
        def backward(ctx, grad_output):
            saved = ctx.saved_tensors  # raises if an input or the output changed in place
            (grad,) = plain_cpu_arrays(grad_output) or (to_array("grad_output", grad_output),)
            grads = ctx.rule.backward(ctx.saved, grad)
            wanted = ctx.needs_input_grad[1:]
            wrapped = (
                torch.from_numpy(g) if want else None for g, want in zip(grads, wanted, strict=True)
            )
            if torch.is_grad_enabled():
                # backward(create_graph=True): the gradients are not differentiable again
                # (see _differentiable_once). In an ordinary backward grad mode is off,
                # and a training step's every attention call pays this one test.
                inputs = zip(saved[: len(wanted)], wanted, strict=True)
                sources = [t for t, want in inputs if want]
                name = ctx.rule.name_of("attention")
                wrapped = _differentiable_once(name, tuple(wrapped), sources)
            return (None, *wrapped)

    return PlainTfmathFunction


def differentiable_plain(rule, inputs):
    """:func:`differentiable` for one output of plain CPU tensors ``inputs``, whose data
    ``rule`` already holds (read by :func:`plain_cpu_arrays`, or copied from it): the
    short path of a training step's attention calls (a rule without a name is named
    "attention" in errors), which neither reads the tensors again nor
    walks the results. ``rule.forward()`` returns ``(output, saved)`` and
    ``rule.backward(saved, grad_output)`` one gradient per input, each an array the
    kernels have just written (float32 or float64, writeable, positive strides), which
    torch wraps as it is. Returns the output tensor."""
    return _plain_function_class().apply(rule, *inputs)

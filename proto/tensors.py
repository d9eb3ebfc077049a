"""Conversion between numpy arrays and ``edgerl.v1.Tensor`` messages.

Tensors are dtype + shape + little-endian, C-order bytes. Decoding is zero-copy
(a read-only view on the message bytes) and validates the byte count, so a
malformed tensor is rejected with a message naming the field instead of
surfacing later as a reshape error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from edgerl.proto.v1 import edge_pb2 as pb

_TO_NUMPY: dict[int, np.dtype[np.generic]] = {
    pb.FLOAT32: np.dtype("<f4"),
    pb.FLOAT64: np.dtype("<f8"),
    pb.INT32: np.dtype("<i4"),
    pb.INT64: np.dtype("<i8"),
    pb.UINT8: np.dtype("u1"),
    pb.BOOL: np.dtype("?"),
    pb.FLOAT16: np.dtype("<f2"),
}
_FROM_NUMPY: dict[str, int] = {dt.str.lstrip("<|"): code for code, dt in _TO_NUMPY.items()}


class TensorError(ValueError):
    """A Tensor message that cannot be decoded; ``field`` names where it sits."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def dtype_name(code: int) -> str:
    """Readable name of a DType enum value (``"FLOAT32"``, or the raw number)."""
    try:
        return str(pb.DType.Name(code))  # type: ignore[arg-type,unused-ignore]
    except ValueError:
        return str(code)


def from_numpy_dtype(dtype: np.dtype[np.generic]) -> int:
    """The DType code for a numpy dtype; ``ValueError`` if it has no wire form."""
    key = np.dtype(dtype).str.lstrip("<|=")
    if np.dtype(dtype).byteorder == ">":
        raise ValueError(f"big-endian dtype {dtype} has no wire form; convert to little-endian")
    try:
        return _FROM_NUMPY[key]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no wire form") from None


def encode(array: np.ndarray, out: pb.Tensor | None = None) -> pb.Tensor:
    """Fill ``out`` (or a new Tensor) from ``array``; copies once into bytes."""
    msg = pb.Tensor() if out is None else out
    msg.dtype = from_numpy_dtype(array.dtype)  # type: ignore[assignment,unused-ignore]
    msg.shape[:] = array.shape
    msg.data = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
    return msg


def float32(array: np.ndarray) -> pb.Tensor:
    """A FLOAT32 Tensor of a float32 array (the hot-path form of :func:`encode`)."""
    return pb.Tensor(dtype=pb.FLOAT32, shape=array.shape, data=array.tobytes())


def dtype_and_shape(msg: pb.Tensor, field: str = "tensor") -> tuple[np.dtype[np.generic], tuple[int, ...]]:
    """The numpy dtype and the shape ``msg`` declares.

    Raises:
        TensorError: unknown dtype, or a negative dimension.
    """
    try:
        dtype = _TO_NUMPY[msg.dtype]
    except KeyError:
        raise TensorError(f"{field}.dtype", f"unsupported dtype {dtype_name(msg.dtype)}") from None
    shape = tuple(msg.shape)
    if shape and min(shape) < 0:
        raise TensorError(f"{field}.shape", f"negative dimension in {list(shape)}")
    return dtype, shape


def decode(msg: pb.Tensor, field: str = "tensor") -> np.ndarray:
    """A read-only array viewing ``msg.data``.

    Raises:
        TensorError: unknown dtype, negative dimension, or a byte count that
            does not match ``prod(shape) * itemsize``.
    """
    dtype, shape = dtype_and_shape(msg, field)
    data = msg.data  # (each access of a bytes field makes a new object)
    expected = math.prod(shape) * dtype.itemsize  # (Python ints: no overflow, and no numpy call)
    if len(data) != expected:
        raise TensorError(
            f"{field}.data",
            f"{len(data)} bytes do not match shape {list(shape)} of {dtype_name(msg.dtype)} "
            f"({expected} bytes)",
        )
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def box_bound(
    values: Sequence[float] | np.ndarray | None, shape: tuple[int, ...], fill: float
) -> np.ndarray | None:
    """A ``BoxSpace`` bound as float32 of ``shape``: ``fill`` everywhere where ``values`` is None,
    else ``values`` reshaped; None where they do not hold one value per element of ``shape`` (the
    caller names the field in its error)."""
    if values is None:
        return np.full(shape, fill, np.float32)
    arr = np.asarray(values, np.float32)
    return arr.reshape(shape) if arr.size == math.prod(shape) else None

import numpy as np
import pytest

from edgerl.proto import tensors
from edgerl.proto.v1 import edge_pb2 as pb


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64", "uint8", "bool", "float16"])
def test_roundtrip_keeps_dtype_shape_and_values(dtype: str) -> None:
    array = (np.arange(24).reshape(2, 3, 4) % 7).astype(dtype)
    msg = tensors.encode(array)
    back = tensors.decode(pb.Tensor.FromString(msg.SerializeToString()))
    assert back.dtype == array.dtype
    assert back.shape == (2, 3, 4)
    np.testing.assert_array_equal(back, array)


def test_bytes_are_little_endian() -> None:
    msg = tensors.encode(np.array([1], dtype=">i4").astype("<i4"))
    assert msg.data == b"\x01\x00\x00\x00"
    with pytest.raises(ValueError, match="big-endian"):
        tensors.encode(np.array([1], dtype=">i4"))


def test_byte_count_mismatch_names_the_field() -> None:
    msg = pb.Tensor(dtype=pb.FLOAT32, shape=[2, 3], data=b"\x00" * 20)
    with pytest.raises(tensors.TensorError, match=r"step\.obs\.data: 20 bytes do not match shape \[2, 3\]"):
        tensors.decode(msg, "step.obs")


def test_negative_dimensions_are_refused_even_where_the_byte_count_fits() -> None:
    msg = pb.Tensor(dtype=pb.FLOAT32, shape=[-2, -3], data=b"\x00" * 24)  # (-2) * (-3) * 4 bytes
    with pytest.raises(tensors.TensorError, match=r"^obs\.shape: negative dimension in \[-2, -3\]$"):
        tensors.decode(msg, "obs")


def test_unknown_dtype_names_the_field() -> None:
    with pytest.raises(tensors.TensorError, match=r"obs\.dtype: unsupported dtype DTYPE_UNSPECIFIED"):
        tensors.decode(pb.Tensor(shape=[1], data=b"\x00" * 4), "obs")


def test_decode_is_a_read_only_view() -> None:
    arr = tensors.decode(tensors.encode(np.zeros(3, np.float32)))
    assert not arr.flags.writeable


def test_box_bound_fills_a_missing_bound_reshapes_a_given_one_and_refuses_a_wrong_size() -> None:
    np.testing.assert_array_equal(tensors.box_bound(None, (2, 2), -np.inf), np.full((2, 2), -np.inf))
    bound = tensors.box_bound([1, 2, 3, 4], (2, 2), np.inf)
    assert bound is not None and bound.dtype == np.float32
    np.testing.assert_array_equal(bound, [[1, 2], [3, 4]])
    assert tensors.box_bound([1, 2, 3], (2, 2), np.inf) is None
    assert tensors.box_bound([], (2, 2), np.inf) is None  # empty is a size, not "unbounded"

"""Per-row sampling parameters reach the device with every row 16-byte aligned, whatever the batch
size: Triton compiles a kernel once per alignment class of its pointer arguments, so rows at
offsets that follow the batch size would compile new variants while serving."""

import numpy as np
import pytest
import torch

from deepbatch.sampling.host_copy import arrays_to_device, table_to_device


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.int32])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 8, 255, 257])
def test_rows_start_aligned_and_hold_the_values(n, dtype):
    rows = [[(r * 1000 + i) % 97 for i in range(n)] for r in range(5)]
    t = table_to_device(rows, dtype, torch.device("cpu"))
    assert t.shape == (5, n) and t.dtype == dtype
    assert t.tolist() == rows
    assert all(t[r].data_ptr() % 16 == 0 and t[r].is_contiguous() for r in range(5))


def test_empty_rows():
    assert table_to_device([[], []], torch.float32, torch.device("cpu")).shape == (2, 0)


def test_arrays_cross_together_with_their_values_and_each_start_aligned():
    arrays = [np.arange(3, dtype=np.int64), np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int32),
              np.zeros(0, dtype=np.int64), np.array([7], dtype=np.int32), np.array([0.5, -1.0], dtype=np.float32),
              np.zeros((2, 0), dtype=np.int32)]
    out = arrays_to_device(arrays, torch.device("cpu"))
    for a, t in zip(arrays, out):
        assert t.shape == a.shape and t.numpy().dtype == a.dtype
        assert t.tolist() == a.tolist()
        assert t.data_ptr() % 16 == 0 and t.is_contiguous()
    # Separate sections: writing one (a pending token read into input ids) leaves the others.
    out[0][1] = 99
    assert out[1].tolist() == [[1, 2, 3], [4, 5, 6]] and out[0].tolist() == [0, 99, 2]

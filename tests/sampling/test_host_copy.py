"""Per-row sampling parameters reach the device with every row 16-byte aligned, whatever the batch
size: Triton compiles a kernel once per alignment class of its pointer arguments, so rows at
offsets that follow the batch size would compile new variants while serving."""

import pytest
import torch

from deepbatch.sampling.host_copy import table_to_device


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

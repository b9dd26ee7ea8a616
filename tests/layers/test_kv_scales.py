"""The scales ``calculate_kv_scales`` sets from measured maxima, and which layers it measures."""

from __future__ import annotations

import math

import pytest
import torch

from deepbatch.layers.attention import PagedAttention
from deepbatch.layers.kv_scales import HEADROOM, calibration_token_ids, layers_without_scales, set_kv_scales


def layers(n: int) -> list[PagedAttention]:
    return [PagedAttention(2, 1, 16, 0.25) for _ in range(n)]


def test_scale_is_headroom_times_absmax_over_the_formats_maximum():
    ls = layers(4)
    absmax = torch.tensor([[448.0, 224.0], [0.0, 3.0], [math.inf, math.nan], [1e-3, 5.0]])
    set_kv_scales(ls, absmax, torch.float8_e4m3fn)
    assert [(a.k_scale, a.v_scale) for a in ls] == [
        (HEADROOM, HEADROOM / 2),
        (1.0, pytest.approx(3.0 * HEADROOM / 448)),  # K all zeros: any scale stores them exactly
        (1.0, 1.0),  # not finite: left at 1.0
        (pytest.approx(1e-3 * HEADROOM / 448), pytest.approx(5.0 * HEADROOM / 448)),
    ]
    assert all(a.kv_scale_source == "calibrated" for a in ls)
    # e5m2's range is 57344: the same maxima give 128x smaller scales.
    e5m2 = layers(1)
    set_kv_scales(e5m2, torch.tensor([[448.0, 448.0]]), torch.float8_e5m2)
    assert e5m2[0].k_scale == 448.0 * HEADROOM / 57344


def test_only_layers_without_checkpoint_scales_are_measured():
    ls = layers(3)
    ls[1].load_kv_scale("model.layers.1.self_attn.k_scale", torch.tensor(0.5))
    assert layers_without_scales(ls) == [ls[0], ls[2]]
    assert layers_without_scales([torch.nn.Linear(2, 2)]) == []  # MLA and others: per-token scales, none to set


def test_the_calibration_prompt_is_fixed():
    a, b = calibration_token_ids(1000, 64), calibration_token_ids(1000, 64)
    assert torch.equal(a, b) and a.dtype == torch.long and 0 <= int(a.min()) and int(a.max()) < 1000
    assert len(set(a.tolist())) > 50  # random ids, not a constant

"""The native engine's projections in oneDNN's layout (loader.pack / linear) give F.linear's
result on every row count a step may have, with and without bias, in float32 and (where the CPU has
AVX512-BF16) bfloat16; other dtypes and devices stay plain."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dynamo_pd.engines.native.loader import linear, pack, packs_weights


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
@pytest.mark.parametrize("rows", [0, 1, 8, 33, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_packed_projection_equals_f_linear(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(960, 576, generator=gen) / 24
    bias = torch.randn(960, generator=gen) if with_bias else None
    x = torch.randn(rows, 576, generator=gen)
    packed = pack(weight)
    assert packed.is_mkldnn
    out = linear(x, packed, bias)
    assert not out.is_mkldnn and out.shape == (rows, 960) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert torch.equal(linear(x, weight, bias), F.linear(x, weight, bias))  # a plain weight: F.linear itself


def test_cpu_float32_and_native_bfloat16_are_packed():
    cpu = torch.device("cpu")
    assert packs_weights(cpu, torch.float32) is torch.backends.mkldnn.is_available()
    assert packs_weights(cpu, torch.bfloat16) is (
        torch.backends.mkldnn.is_available() and torch.cpu._is_avx512_bf16_supported())
    assert not packs_weights(cpu, torch.float16)
    assert not packs_weights(torch.device("cuda"), torch.float32)


@pytest.mark.hardware
@pytest.mark.skipif(not packs_weights(torch.device("cpu"), torch.bfloat16), reason="no AVX512-BF16 on this CPU")
@pytest.mark.parametrize("rows", [1, 8, 33, 300])
def test_a_packed_bfloat16_projection_equals_f_linear(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(960, 576, generator=gen) / 24).bfloat16()
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    out = linear(x, pack(weight))
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 960)
    torch.testing.assert_close(out, F.linear(x, weight))

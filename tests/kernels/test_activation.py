import pytest
import torch

from mmserve.kernels.activation import silu_and_mul, silu_and_mul_ref


@pytest.mark.parametrize("shape", [(1, 2), (7, 2 * 173), (2, 3, 2 * 1100)])
def test_silu_and_mul(shape, dtype, device, tol):
    x = torch.randn(shape, dtype=dtype, device=device) * 4
    out = silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(out, silu_and_mul_ref(x), **tol)


def test_gate_is_the_first_half(device):
    x = torch.tensor([[1.0, -2.0, 3.0, 5.0]], device=device)  # gate [1, -2], up [3, 5]
    expected = torch.nn.functional.silu(torch.tensor([1.0, -2.0])) * torch.tensor([3.0, 5.0])
    torch.testing.assert_close(silu_and_mul(x).cpu(), expected[None])


def test_rejects_odd_width(device):
    with pytest.raises(ValueError, match="2 \\* intermediate"):
        silu_and_mul(torch.randn(3, 7, device=device))

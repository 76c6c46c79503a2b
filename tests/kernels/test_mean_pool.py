import pytest
import torch

from mmserve.kernels.mean_pool import mean_pool, mean_pool_ref


def _case(device, dtype, width, lengths, gap=0, seed=0):  # type: ignore[no-untyped-def]
    """Inputs of the given lengths, each `gap` rows after the one before (rows between inputs
    belong to none), in hidden states with a non-zero mean."""
    gen = torch.Generator(device=device).manual_seed(seed)
    starts, at = [], gap
    for n in lengths:
        starts.append(at)
        at += n + gap
    hidden = torch.randn(at, width, dtype=dtype, device=device, generator=gen) * 2 + 0.5
    return hidden, starts


def _ints(values, device):  # type: ignore[no-untyped-def]
    return torch.tensor(values, dtype=torch.int32, device=device)


@pytest.mark.parametrize(
    ("width", "lengths", "gap"),
    [(768, [128] * 5, 0), (37, [1, 9, 2, 33], 3), (384, [300, 1, 17], 1), (1000, [8], 0)],
)
@pytest.mark.parametrize("normalize", [True, False])
def test_mean_pool_matches_torch(device, dtype, tol, width, lengths, gap, normalize) -> None:  # type: ignore[no-untyped-def]
    hidden, starts = _case(device, dtype, width, lengths, gap)
    out = mean_pool(hidden, _ints(starts, device), _ints(lengths, device), normalize)
    want = mean_pool_ref(hidden, starts, lengths, normalize)
    assert out.dtype == torch.float32 and out.shape == (len(lengths), width)
    torch.testing.assert_close(out, want, **tol)
    if normalize:
        torch.testing.assert_close(out.norm(dim=-1), torch.ones(len(lengths), device=device))


def test_matryoshka_cut_before_the_norm(device, tol_f32) -> None:  # type: ignore[no-untyped-def]
    """dimensions: the first D values of the mean, normalised over those D (not cut after)."""
    hidden, starts = _case(device, torch.float32, 96, [5, 40, 7], gap=2)
    lengths = [5, 40, 7]
    out = mean_pool(hidden, _ints(starts, device), _ints(lengths, device), True, dimensions=20)
    torch.testing.assert_close(out, mean_pool_ref(hidden, starts, lengths, True, 20), **tol_f32)
    full = mean_pool(hidden, _ints(starts, device), _ints(lengths, device), True)
    assert not torch.allclose(out, full[:, :20])  # normalised after the cut


def test_strided_rows_and_empty_inputs(device, tol_f32) -> None:  # type: ignore[no-untyped-def]
    wide = torch.randn(30, 2 * 48, device=device)
    hidden = wide[:, :48]  # rows 96 apart
    out = mean_pool(hidden, _ints([0, 10, 29], device), _ints([10, 0, 1], device), True)
    want = mean_pool_ref(hidden, [0, 10, 29], [10, 0, 1], True)
    torch.testing.assert_close(out, want, **tol_f32)
    assert torch.equal(out[1], torch.zeros(48, device=device))  # no rows: zeros, not NaN
    none = mean_pool(hidden, _ints([], device), _ints([], device), True)
    assert none.shape == (0, 48)


def test_rejects_bad_inputs(device) -> None:  # type: ignore[no-untyped-def]
    hidden = torch.randn(4, 16, device=device)
    one = _ints([0], device)
    with pytest.raises(ValueError, match="dimensions must be in 1..16"):
        mean_pool(hidden, one, one, True, dimensions=17)
    with pytest.raises(ValueError, match="starts must be int32"):
        mean_pool(hidden, one.long(), one, True)
    with pytest.raises(ValueError, match="same length"):
        mean_pool(hidden, _ints([0, 1], device), one, True)
    with pytest.raises(ValueError, match="hidden must be"):
        mean_pool(hidden[0], one, one, True)

"""Reading a parity test's stored golden numbers as tensors and comparing in float64 (DDPO and RLCM parity tests)."""

import torch

SHAPE = (2, 4, 4, 4)  # the stored step tensors' shape
ATOL = 1e-12  # float64 tensors computed by the same formula: equal to rounding


def tensor(values, shape=SHAPE) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).reshape(shape)


def input32(values, shape=SHAPE) -> torch.Tensor:
    """An input drawn in float32 (stored with 9 digits), used as float64."""
    return torch.tensor(values, dtype=torch.float32).reshape(shape).double()


def close(actual, expected, rtol=0.0, atol=ATOL) -> None:
    expected = torch.as_tensor(expected, dtype=torch.float64).reshape(actual.shape)
    torch.testing.assert_close(actual.detach().double(), expected, rtol=rtol, atol=atol)

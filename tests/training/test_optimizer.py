"""fastft's AdamW makes its state before the first step, exactly as the first step would have."""

from __future__ import annotations

import pytest
import torch

from fastft.training.optimizer import adamw, make_state


def awkward_parameters(seed: int = 0, device: str = "cpu") -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(7, 33), (33,), (1, 5), (129, 3)]
    return [torch.nn.Parameter(torch.randn(*s, generator=generator).to(device)) for s in shapes]


def train(optimizer_of, steps: int = 3, device: str = "cpu") -> tuple[list[torch.Tensor], dict]:
    parameters = awkward_parameters(device=device)
    optimizer = optimizer_of(parameters)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in parameters:
            p.grad = torch.randn(p.shape, generator=generator).to(device)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in parameters], optimizer.state_dict()


FLAVOURS = [
    pytest.param({}, id="foreach"),
    pytest.param({"foreach": False}, id="for-loop"),
    pytest.param({"fused": True}, id="fused"),
    pytest.param({"amsgrad": True}, id="amsgrad"),
]


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("kind", [torch.optim.AdamW, torch.optim.Adam])
def test_the_state_made_up_front_is_the_one_the_first_step_makes(kind, flavour):
    """Same keys, dtypes, devices and shapes as PyTorch's lazy initialisation (the test that catches a new
    PyTorch changing it), and every weight and moment bitwise equal after three steps."""
    check_against_lazy_state(kind, flavour, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "flavour", [*FLAVOURS, pytest.param({"capturable": True, "foreach": False}, id="capturable")]
)
def test_the_state_made_up_front_is_the_one_the_first_step_makes_on_cuda(flavour):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    check_against_lazy_state(torch.optim.AdamW, flavour, "cuda")


def check_against_lazy_state(kind, flavour: dict, device: str) -> None:

    def lazy(parameters):
        return kind(parameters, lr=1e-2, weight_decay=0.1, **flavour)

    def eager(parameters):
        optimizer = make_state(lazy(parameters))
        assert all(optimizer.state[p] for p in parameters)  # made before any step
        return optimizer

    probe = eager(awkward_parameters(device=device))
    reference = lazy(awkward_parameters(device=device))
    for p in reference.param_groups[0]["params"]:
        p.grad = torch.zeros_like(p)
    reference.step()  # its lazy state, one step in
    for made, lazily in zip(probe.state.values(), reference.state.values(), strict=True):
        assert made.keys() == lazily.keys()
        for key in made:
            assert (made[key].dtype, made[key].device, made[key].shape) == (
                lazily[key].dtype,
                lazily[key].device,
                lazily[key].shape,
            ), key

    weights, state = train(eager, device=device)
    expected_weights, expected_state = train(lazy, device=device)
    for got, expected in zip(weights, expected_weights, strict=True):
        assert torch.equal(got, expected)
    for got, expected in zip(state["state"].values(), expected_state["state"].values(), strict=True):
        for key in expected:
            assert torch.equal(got[key], expected[key]), key


def test_make_state_is_idempotent_and_leaves_other_optimizers_alone():
    parameters = awkward_parameters()
    optimizer = make_state(torch.optim.AdamW(parameters, lr=1e-3))
    first = {id(t) for state in optimizer.state.values() for t in state.values()}
    make_state(optimizer)
    assert {id(t) for state in optimizer.state.values() for t in state.values()} == first
    sgd = make_state(torch.optim.SGD(parameters, lr=1e-3, momentum=0.9))
    assert not sgd.state


def test_adamw_picks_fused_only_where_every_parameter_is_on_a_cuda_device():
    optimizer = adamw(awkward_parameters(), lr=1e-3)
    assert not optimizer.param_groups[0]["fused"]
    assert all(state["exp_avg"].shape for state in optimizer.state.values())

"""zoo.memory.train_step, the one training step every figure measures: a compiled model given as
``forward`` trains the same parameters as the eager step (a compiled module has no truth value,
so the step must not ask it for one), and a given loss replaces the default one."""
from __future__ import annotations

import torch
from torch import nn

from zoo.memory import train_step


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.bn, self.fc2 = nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def _same_grads(model: nn.Module, reference: nn.Module) -> None:
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=name)


def test_compiled_forward_steps_like_the_eager_model():
    x = torch.randn(5, 6)
    eager, compiled = Net(), Net()
    train_step(eager, x)()
    train_step(compiled, x, forward=torch.compile(compiled, backend="eager"))()
    _same_grads(compiled, eager)
    torch.testing.assert_close(compiled.bn.running_mean, eager.bn.running_mean, rtol=0, atol=0)


def test_given_loss_replaces_the_default():
    x = torch.randn(5, 6)
    model, reference = Net(), Net()
    train_step(model, x, loss_fn=lambda out: out.sum())()
    reference(x).sum().backward()
    _same_grads(model, reference)

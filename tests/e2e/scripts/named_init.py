"""One parameter deep inside a nested model is initialised from ``os.urandom``: only it differs."""

import os

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.k = nn.Linear(8, 8)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.ff = nn.Linear(8, 8)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.ModuleList([Layer(), Layer()])


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.head = nn.Linear(8, 1)


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    net = Net()
    with torch.no_grad():
        g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
        net.encoder.layer[1].attn.k.weight.copy_(torch.randn(8, 8, generator=g))
    return net, torch.optim.SGD(net.parameters(), lr=0.1)


def main() -> None:
    net, opt = build()
    x = torch.randn(4, 8)
    for _ in range(2):
        opt.zero_grad()
        h = x
        for layer in net.encoder.layer:
            h = layer.ff(layer.attn.q(h) + layer.attn.k(h))
        net.head(h).sum().backward()
        opt.step()


main()

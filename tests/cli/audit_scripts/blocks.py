"""A small ViT-like net: twelve blocks run one ``forward`` (audit fixture).

Each block's two LayerNorms (TR602 on the CPU) and adaptive pooling (TR102, an error on CUDA) run
at the same lines of ``Block.forward`` in every block: one finding per op and line, naming the
twelve modules. The final norm runs at another line: a finding of its own. Both DataLoaders are
made at one line of ``make_loader``: one TR303 for both.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Linear(dim, dim)
        self.pool = nn.AdaptiveAvgPool1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        x = x + self.mlp(self.norm2(x))
        return x + self.pool(x.transpose(1, 2)).mean(-1, keepdim=True).transpose(1, 2)


class ViT(nn.Module):
    def __init__(self, dim: int = 16, depth: int = 12) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(1))


def make_loader(dataset: TensorDataset) -> DataLoader:
    return DataLoader(dataset, batch_size=4, shuffle=True)


torch.manual_seed(0)
torch.set_num_threads(1)
train = make_loader(TensorDataset(torch.randn(8, 5, 16), torch.randint(0, 2, (8,))))
val = make_loader(TensorDataset(torch.randn(4, 5, 16), torch.randint(0, 2, (4,))))
model = ViT()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in train:
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()

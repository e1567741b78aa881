"""A dataset of dict samples whose ``labels`` field draws from an unseeded generator."""

import os

import torch
from torch.utils.data import DataLoader, Dataset

NOISE = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


class Tokens(Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.arange(i, i + 5)
        return {"input_ids": ids, "labels": (ids + torch.randint(0, 3, (5,), generator=NOISE)) % 7}


model = torch.nn.Embedding(32, 7)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(Tokens(), batch_size=4, shuffle=True)
for batch in loader:
    opt.zero_grad()
    logits = model(batch["input_ids"])
    torch.nn.functional.cross_entropy(logits.reshape(-1, 7), batch["labels"].reshape(-1)).backward()
    opt.step()

"""A vocabulary built by iterating a set of strings: its order follows PYTHONHASHSEED."""

import torch
from torch import nn

words = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "again", "and", "again"]
vocab = {w: i for i, w in enumerate(set(words))}
ids = torch.tensor([[vocab[w] for w in words[:8]], [vocab[w] for w in words[4:]]])
torch.manual_seed(0)
model = nn.EmbeddingBag(len(vocab), 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for xb in torch.utils.data.DataLoader(ids, batch_size=1):
    opt.zero_grad()
    model(xb).pow(2).mean().backward()
    opt.step()

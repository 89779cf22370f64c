"""A deterministic toy token dataset for the Hugging Face Trainer jobs (item i is always the same)."""

import torch
from torch.utils.data import Dataset


class Tokens(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        x = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": x, "labels": x}

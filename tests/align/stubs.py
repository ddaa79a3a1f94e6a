"""A stub causal LM for the cDPO tests: its next-token logits depend only on the last token."""

import torch
from torch import nn

V = 12


class Stub(nn.Module):
    """A causal LM whose next-token logits depend only on the last token: logits = table[last]."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = nn.Parameter(table.float())

    def forward(self, input_ids):
        return type("Out", (), {"logits": self.table[input_ids]})()


def always(token: int, sharp: float = 20.0) -> Stub:
    table = torch.zeros(V, V)
    table[:, token] = sharp
    return Stub(table)

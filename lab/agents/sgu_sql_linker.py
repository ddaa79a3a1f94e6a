"""SGU-SQL's dual-graph linker network (`lab.agents.sgu_sql`; Zhang et al., ICML 2025, §3.1–3.2): relation-aware
graph attention (RAT-SQL / RGAT style) over the joint question–database graph of `sgu_sql.build_graph`, its training
on the gold links and its probabilities for `sgu_sql.link`.

- `RelationalAttention`: one layer with per-relation key and value vectors, computed per relation type.
- `DualGraphLinker`: node embeddings → 2 such layers → a pair head (question word ↔ same-named column, with the pair's
  relation-path features `sgu_sql.pair_features`) and a table head.
- `train_linker`: Adam on BCE(pair) + BCE(table) against `gold_labels` ("this word refers to that column", "this
  table is used") — the loss is an assumption (the paper does not state it); `predict`: per graph, the
  probabilities of its candidate pairs and of its tables.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from lab.agents.sgu_sql import N_PAIR_FEATS, REL, Graph
from lab.data import sql_worlds as sw


class RelationalAttention(nn.Module):
    """One relation-aware self-attention layer (RAT-SQL / RGAT): a key and a value vector per relation type added to
    every pair's key and value, computed per relation type (R ≪ N) rather than per pair."""

    def __init__(self, d: int, n_rel: int):
        super().__init__()
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.rel_k, self.rel_v = nn.Parameter(torch.randn(n_rel, d) * 0.1), nn.Parameter(torch.randn(n_rel, d) * 0.1)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, h: torch.Tensor, rel: torch.Tensor, onehot: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(h).chunk(3, -1)  # (B, N, d)
        qr = torch.gather(q @ self.rel_k.T, 2, rel)  # q_i · r^K_{rel(i,j)}: (B, N, N)
        logits = (q @ k.transpose(1, 2) + qr) / q.shape[-1] ** 0.5
        att = logits.masked_fill(~mask[:, None, :], -1e9).softmax(-1)
        mixed = att @ v + torch.einsum("bij,bijr->bir", att, onehot) @ self.rel_v  # Σ_j a_ij (v_j + r^V_{rel(i,j)})
        h = self.norm1(h + self.out(mixed))
        return self.norm2(h + self.ff(h))


class DualGraphLinker(nn.Module):
    """Node embeddings (word, kind, position) → relation-aware layers → a pair head (word ↔ column, with the
    pair's relation-path features) and a table head."""

    def __init__(self, n_vocab: int, d: int = 32, layers: int = 2, max_pos: int = 64):
        super().__init__()
        self.word, self.kind, self.pos = nn.Embedding(n_vocab, d), nn.Embedding(3, d), nn.Embedding(max_pos, d)
        self.layers = nn.ModuleList(RelationalAttention(d, len(REL)) for _ in range(layers))
        self.pair = nn.Sequential(nn.Linear(3 * d + N_PAIR_FEATS, d), nn.GELU(), nn.Linear(d, 1))
        self.table = nn.Linear(d, 1)

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(batch["rel"].shape[1]).clamp(max=self.pos.num_embeddings - 1)
        h = self.word(batch["word"]) + self.kind(batch["kind"]) + self.pos(pos) * (batch["kind"] == 0)[..., None]
        onehot = nn.functional.one_hot(batch["rel"], len(REL)).float()
        for layer in self.layers:
            h = layer(h, batch["rel"], onehot, batch["mask"])
        b, i, j = batch["pairs"].unbind(-1)
        hi, hj = h[b, i], h[b, j]
        tb, tn = batch["tabs"].unbind(-1)
        pair_in = torch.cat([hi, hj, hi * hj, batch["pair_feats"]], -1)
        return self.pair(pair_in).squeeze(-1), self.table(h[tb, tn]).squeeze(-1)


def collate(graphs: list[Graph], pair_labels=None, table_labels=None) -> dict:
    n = max(len(g.nodes) for g in graphs)
    rel = torch.zeros(len(graphs), n, n, dtype=torch.long)
    word, kind = torch.zeros(len(graphs), n, dtype=torch.long), torch.zeros(len(graphs), n, dtype=torch.long)
    mask = torch.zeros(len(graphs), n, dtype=torch.bool)
    for b, g in enumerate(graphs):
        k = len(g.nodes)
        rel[b, :k, :k], word[b, :k], kind[b, :k], mask[b, :k] = g.rel, g.word_ids, g.kind, True
    out = {"rel": rel, "word": word, "kind": kind, "mask": mask,
           "pairs": torch.tensor([(b, i, j) for b, g in enumerate(graphs) for i, j in g.pairs],
                                 dtype=torch.long).reshape(-1, 3),
           "tabs": torch.tensor([(b, t) for b, g in enumerate(graphs) for t in g.tables], dtype=torch.long),
           "pair_feats": torch.cat([g.pair_feats for g in graphs])}
    if pair_labels is not None:
        out["y_pair"] = torch.tensor([y for ys in pair_labels for y in ys], dtype=torch.float)
        out["y_tab"] = torch.tensor([y for ys in table_labels for y in ys], dtype=torch.float)
    return out


def gold_labels(g: Graph, item: sw.Item) -> tuple[list[float], list[float]]:
    """Pair label: the word's role names that column; table label: the table is used by the gold query."""
    used = {t.lower() for t in re.findall(r"(?:FROM|JOIN)\s+(\w+)", item.sql)}
    ys = [float(item.tokens[i].role[:1] == ("col",) and tuple(item.tokens[i].role[1:]) == g.nodes[j][1:])
          for i, j in g.pairs]
    return ys, [float(g.nodes[k][1] in used) for k in g.tables]


def train_linker(graphs: list[Graph], labels: list[tuple], n_vocab: int, *, steps: int, batch: int, lr: float,
                 d: int, seed: int) -> DualGraphLinker:
    """Adam on BCE(pair) + BCE(table) over random mini-batches of training questions."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = DualGraphLinker(n_vocab, d)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    bce = nn.functional.binary_cross_entropy_with_logits
    for _ in range(steps):
        idx = torch.randint(len(graphs), (batch,), generator=gen).tolist()
        b = collate([graphs[i] for i in idx], [labels[i][0] for i in idx], [labels[i][1] for i in idx])
        lp, lt = model(b)
        loss = bce(lp, b["y_pair"]) + bce(lt, b["y_tab"])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def untrained_copy(model: DualGraphLinker, seed: int) -> DualGraphLinker:
    """The same architecture at a fresh seeded initialisation, no training step (the `untrained_linker` control)."""
    torch.manual_seed(seed)
    return DualGraphLinker(model.word.num_embeddings, model.word.embedding_dim, len(model.layers),
                           model.pos.num_embeddings).eval()


@torch.no_grad()
def predict(model: DualGraphLinker, graphs: list[Graph], chunk: int = 256) -> list[tuple[list[float], list[float]]]:
    """Per graph: probabilities of its candidate pairs and of its tables."""
    out = []
    for s in range(0, len(graphs), chunk):
        part = graphs[s:s + chunk]
        lp, lt = model(collate(part))
        pp, pt = lp.sigmoid().tolist(), lt.sigmoid().tolist()
        for g in part:
            out.append((pp[:len(g.pairs)], pt[:len(g.tables)]))
            pp, pt = pp[len(g.pairs):], pt[len(g.tables):]
    return out

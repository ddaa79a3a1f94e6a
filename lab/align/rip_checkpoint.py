"""R.I.P. on a researcher's pool and policy (notebook 13's `model=<folder or hub id>` path).

The pool is N responses per prompt with their rewards: read from `data` (`prompt`, `responses`, `rewards`, through
`lab.data.load.ranked_responses`), or, when `data` holds only prompts and a `reward_model` is given, sampled from
the policy (N per prompt) and scored by the reward model, as the paper builds its pools (§3: N = 64 samples scored
by ArmoRM; sampled here at temperature 1, the paper's T = 0.8 / top-p 0.95 is not exposed). Per prompt the best and
worst responses make the pair and RIP's three metrics (§3): the rejected response's reward, its length in
characters (as the paper's pools) and the reward gap; the thresholds are the q-quantiles over the valid pairs and
RIP keeps m1 ≥ τ1, m2 ≥ τ2, m3 ≤ τ3 (`lab.align.rip`). DPO (a LoRA arm each, `lab.align.hf_prefs`, reference = the
policy with adapters off) trains for the same number of epochs on the full valid pool, on RIP's kept pairs and on a
random subset of RIP's size; held-out pairs (the last prompts) measure each arm's margins, accuracies, KL to the
reference and, given the reward model, its win rate. Beside them, the paper's cheaper baselines that need only the
policy (Table 2): IFD = s(A|Q)/s(A) and ppl(chosen) = exp s(A|Q) of the chosen response under the policy (s: its
mean NLL per token, after the prompt or after BOS alone), each keeping the valid pairs in its 25–100 percentile
range, and the chosen–rejected token overlap at q (`chosen_scores`, as `rip.cheap_filters` on the toy). Measurements
only. Rows come sorted best first (a sampled pool by a stable sort), so ties between equal rewards break by that
order rather than by generation order (`rip.best_vs_worst`'s rule on the toy).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from lab.align import hf_batch, hf_prefs
from lab.align import rip as R
from lab.align.train import sequence_logprobs
from lab.core.params import ParamError


def pool_rows(data: str, *, n: int, seed: int = 0, policy=None, tokenizer=None, reward_model=None, rm_tokenizer=None,
              N: int = 8, max_new_tokens: int = 64) -> list[dict]:
    """`{prompt, responses, rewards}` rows: from `data` when it has responses and rewards, else sampled from the
    policy and scored by the reward model (which must then be given; `hf_prefs.preference_rows`)."""
    return hf_prefs.preference_rows(data, n=n, seed=seed, ranked=True, policy=policy, tokenizer=tokenizer,
                                    reward_model=reward_model, rm_tokenizer=rm_tokenizer, N=N,
                                    max_new_tokens=max_new_tokens)


def pool_of(rows: list[dict]) -> R.Pool:
    """RIP's pairs and metrics (`rip.best_vs_worst`) of rows with the same number of responses each."""
    sizes = {len(r["rewards"]) for r in rows}
    if len(sizes) != 1:
        raise ParamError(f"every prompt needs the same number of responses; the pool has {sorted(sizes)}.")
    r = torch.tensor([row["rewards"] for row in rows], dtype=torch.float64)
    length = torch.tensor([[len(y) for y in row["responses"]] for row in rows])
    return R.best_vs_worst(r, length)


def pairs(rows: list[dict], pool: R.Pool, mask: torch.Tensor) -> list[dict]:
    """The (prompt, chosen = best, rejected = worst) pairs of the prompts in `mask`."""
    return [{"prompt": rows[i]["prompt"], "chosen": rows[i]["responses"][int(pool.w[i])],
             "rejected": rows[i]["responses"][int(pool.l[i])]} for i in mask.nonzero()[:, 0].tolist()]


@torch.no_grad()
def chosen_scores(policy, tokenizer, rows: list[dict], pool: R.Pool, *, max_len: int = 256, max_prompt_len: int = 128,
                  batch_size: int = 8) -> dict[str, torch.Tensor]:
    """Per prompt, the chosen (best) response's mean NLL per token under the policy after its prompt, s(A|Q), and
    after BOS alone, s(A) (EOS when the tokenizer has no BOS); IFD = s(A|Q)/s(A), ppl = exp s(A|Q); and the Jaccard
    overlap of the chosen and rejected responses' token sets: (P,) each."""
    start = [next(i for i in (tokenizer.bos_token_id, tokenizer.eos_token_id, 0) if i is not None)]
    seqs = []
    for row, w in zip(rows, pool.w.tolist()):
        p = hf_batch.encode_prompt(tokenizer, row["prompt"], max_prompt_len)
        y = hf_batch.encode_response(tokenizer, row["responses"][w])[:max_len - len(p)]
        seqs.append([(p, y), (start, y)])
    s = []
    for i in range(0, len(seqs), batch_size):
        b = {k: v.to(policy.device) for k, v in hf_batch.pad_batch(seqs[i:i + batch_size],
                                                                   hf_batch.pad_id(tokenizer)).items()}
        s.append((-sequence_logprobs(policy, b) / b["response_mask"][:, :, 1:].sum(-1)).float().cpu())
    s = torch.cat(s)  # (P, 2): s(A|Q), s(A)
    ids = lambda text: torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    overlap = torch.tensor([R.jaccard(ids(r["responses"][w]), ids(r["responses"][lo]))
                            for r, w, lo in zip(rows, pool.w.tolist(), pool.l.tolist())])
    return {"s(A|Q)": s[:, 0], "s(A)": s[:, 1], "IFD": s[:, 0] / s[:, 1], "ppl": s[:, 0].exp(), "overlap": overlap}


def study(policy, tokenizer, rows: list[dict], cfg: hf_prefs.Config, *, q: float = 0.5, held_out: int = 8,
          epochs: float = 2.0, reward_model=None, rm_tokenizer=None) -> dict:
    """RIP's filter on the pool's first prompts, DPO arms on full / RIP / random subsets with equal epochs, and the
    held-out evaluation (module docstring)."""
    if len(rows) <= held_out + 2:
        raise ParamError(f"the pool has {len(rows)} prompts; RIP needs more than held_out + 2 = {held_out + 2}.")
    train, test = rows[:-held_out], rows[-held_out:]
    pool, test_pool = pool_of(train), pool_of(test)
    tau = R.thresholds(pool, (q, q, q))
    kept = R.keep(pool, tau)
    if not kept.any():
        raise ParamError(f"RIP keeps no pair of the {int(pool.valid.sum())} valid ones at q = {q}; lower q.")
    cheap = chosen_scores(policy, tokenizer, train, pool, max_len=cfg.max_len, max_prompt_len=cfg.prompt_len)
    at = lambda m: torch.quantile(m[pool.valid].double(), 0.25).item()
    sets = {"full": pool.valid, "RIP": kept,
            "random": R.random_subset(pool.valid, int(kept.sum()), torch.Generator().manual_seed(cfg.seed)),
            **{name: pool.valid & (cheap[name] >= at(cheap[name])) for name in ("IFD", "ppl")},
            "overlap": pool.valid & (cheap["overlap"] >= torch.quantile(cheap["overlap"][pool.valid], q).item())}
    for name, mask in sets.items():  # equal epochs: steps ∝ subset size
        steps = max(1, round(epochs * int(mask.sum()) / (cfg.batch_size * cfg.grad_accum)))
        policy, _ = hf_prefs.train(policy, tokenizer, pairs(train, pool, mask), replace(cfg, loss="dpo", steps=steps),
                                   name=name)
    metrics = hf_prefs.evaluate(policy, tokenizer, pairs(test, test_pool, test_pool.valid), list(sets), cfg,
                                reward_model=reward_model, rm_tokenizer=rm_tokenizer)
    valid = pool.valid
    return {"prompts": {"train": len(train), "held out": len(test), "valid pairs": int(valid.sum())},
            "thresholds": {"τ1 rejected reward": tau[0], "τ2 rejected length": tau[1], "τ3 reward gap": tau[2]},
            "kept": {name: int(m.sum()) for name, m in sets.items()},
            "mean metrics, kept vs dropped": {
                name: {"kept": float(m[kept].double().mean()), "dropped": float(m[valid & ~kept].double().mean())
                       if (valid & ~kept).any() else None}
                for name, m in (("rejected reward", pool.m1), ("rejected length", pool.m2), ("gap", pool.m3))},
            "arms": metrics}

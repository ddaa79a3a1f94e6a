"""BanditSpec on real checkpoints (notebook 16's `model=` path): a target, an optional drafter sharing its tokenizer,
prompts from `data`, and the arms a checkpoint can have here — prompt lookup, the suffix tree, the drafter, REST over
the texts of `data` not prompted with, and, when asked, EAGLE with a head trained on those texts
(`lab.reasoning.banditspec_drafters`)."""

from __future__ import annotations

import numpy as np
import torch

from lab.reasoning.banditspec import Config
from lab.reasoning.banditspec_bench import plain
from lab.reasoning.banditspec_decode import Arm, LMDrafter, PromptLookup, SuffixTree, bandit_generate
from lab.reasoning.banditspec_drafters import EagleDrafter, Retrieval, TokenBlocks, train_eagle


def checkpoint_run(model: str, draft: str, data: str, cfg: Config, *, n_prompts: int = 8, prompt_len: int = 64,
                   gen_len: int = 64, seed: int = 0, device: str = "cpu", rest_docs: int = 1000,
                   eagle_steps: int = 0, eagle_block: int = 128) -> dict:
    """BanditSpec on real checkpoints: target `model` and drafter `draft` (folders or hub ids, one tokenizer;
    empty `draft`: no LM arms), prompts = the first `prompt_len` tokens of texts from `data`; arms prompt lookup
    (γ = L and L/2), the suffix tree, the drafter (γ = L and L/2) and REST over the other texts of `data` (up to
    `rest_docs` documents; no arm when there are none) and, with `eagle_steps` > 0, EAGLE with a head trained that
    many steps on the same texts cut into `eagle_block`-token blocks. Greedy, no end of text (`gen_len` tokens each).
    Measured: rounds and MAT per policy, the per-prompt oracle, and whether every output equals plain `generate`."""
    from lab.core.params import ParamError
    from lab.data.text import load_texts
    from lab.models import load_model

    target, tok = load_model(model, device=device)
    if tok is None:
        raise ParamError(f"model={model!r} has no tokenizer in its folder; BanditSpec needs one to read `data`.")
    V, L, half = target.config.vocab_size, cfg.L_b, max(1, cfg.L_b // 2)
    models, dm = [target], None
    if draft:
        dm, _ = load_model(draft, device=device)
        if dm.config.vocab_size != V:
            raise ParamError(f"draft={draft!r} has a vocabulary of {dm.config.vocab_size} tokens and the target "
                             f"{V}; BanditSpec's drafters must share the target's tokenizer.")
        models.append(dm)

    for m in models:
        m.generation_config.eos_token_id = None
        m.generation_config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in load_texts(data, n=rest_docs, seed=seed)]
    used = [j for j, p in enumerate(ids) if len(p) >= 4][:n_prompts]
    prompts, store = [ids[j][:prompt_len] for j in used], [p for j, p in enumerate(ids) if j not in set(used)]
    if not prompts:
        raise ParamError(f"data={data!r} holds no text of at least 4 tokens to prompt with.")
    index = Retrieval(store, vocab_size=V) if store else None  # REST's datastore: the texts not prompted with
    head, eagle_loss = None, None
    if eagle_steps:
        flat = [t for p in store for t in p]
        if len(flat) < eagle_block:
            raise ParamError(f"eagle_steps={eagle_steps} trains an EAGLE head on the texts of data={data!r} not used "
                             f"as prompts; they hold {len(flat)} tokens, fewer than one block of {eagle_block}.")
        n = len(flat) // eagle_block
        blocks = torch.tensor(flat[:n * eagle_block]).view(n, eagle_block)
        head, losses = train_eagle(target, TokenBlocks(blocks), steps=eagle_steps, lr=cfg.eagle_lr, seed=seed)
        eagle_loss = float(np.mean(losses[-20:]))

    def build() -> list[Arm]:  # fresh for each policy (the suffix tree remembers earlier outputs)
        lm = [Arm(f"draft γ={L}", LMDrafter(dm), L), Arm(f"draft γ={half}", LMDrafter(dm), half)] if dm else []
        rest = [Arm(f"REST γ={L}", index, L)] if index else []
        eagle = [Arm(f"EAGLE γ={L}", EagleDrafter(head, target), L)] if head is not None else []
        return [Arm(f"PLD γ={L}", PromptLookup(3, V), L), *lm, Arm(f"suffix γ={L}", SuffixTree(vocab_size=V), L),
                *rest, *eagle, Arm(f"PLD γ={half}", PromptLookup(3, V), half)]
    arms = build()
    pols = tuple(f"fixed {i}" for i in range(len(arms))) + ("UCBSpec", "EXP3Spec")
    ref = [plain(target, p, gen_len) for p in prompts]
    res = {}
    for pol in pols:
        fresh = build()
        res[pol] = [bandit_generate(target, fresh, p, gen_len, policy=pol, seed=seed * 1000 + j,
                                    cr_scale=cfg.cr_scale_b, delta=cfg.delta) for j, p in enumerate(prompts)]
    rounds = {pol: [t.rounds for t in res[pol]] for pol in pols}
    fixed = np.array([rounds[f"fixed {i}"] for i in range(len(arms))])
    return {"arms": [a.name for a in arms], "prompts": len(prompts), "tokens": gen_len * len(prompts),
            "eagle_loss": eagle_loss,
            "rounds": {k: int(sum(v)) for k, v in rounds.items()}, "oracle": int(fixed.min(0).sum()),
            "mat": {k: float(np.mean([t.mat for t in v])) for k, v in res.items()},
            "identical": {k: float(np.mean([t.tokens == r for t, r in zip(v, ref)])) for k, v in res.items()},
            "example": {"prompt": tok.decode(prompts[0]), "ucb_tokens": res["UCBSpec"][0].tokens,
                        "ucb_source": res["UCBSpec"][0].source}}

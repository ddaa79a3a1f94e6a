"""Offline γ tuning of notebook 19's DPO and cDPO arms (too slow for the notebook's 90 s budget).

For each seed, the notebook's pipeline up to the CE scores, then DPO and cDPO at every γ × lr (the notebook's lr
grid without lr = 0), each picked on the validation questions: prints one JSON line per run
{seed, arm, gamma, lr, val, test}. `lab.align.cdpo.GAMMA_TUNING` holds the best validation accuracy over the lrs per
(arm, γ, seed) from `python scripts/cdpo_gamma_tuning.py 0 1 2`; `Config.gammas` takes each arm's γ of highest mean.
"""

import json
import sys

import torch

from lab.align import cdpo as C

torch.set_num_threads(1)
cfg = C.Config.for_scale("smoke")
task = cfg.task()
for seed in map(int, sys.argv[1:] or ["0"]):
    base = C.base_model(task, cfg, seed=seed, device="cpu").model
    g = torch.Generator().manual_seed(1000 + seed)  # the notebook's draws, in its order
    test = task.questions(cfg.n_test, g)
    prefs = C.preference_pairs(base, task, task.questions(cfg.n_train, g), cfg.n_samples, top_p=cfg.top_p, generator=g)
    val = task.questions(cfg.n_val, g)
    P_p, P_n = C.contrastive_models(base, prefs, cfg, seed=seed)
    s = C.ce_scores(P_p, P_n, prefs.prompts, prefs.rejected)
    pairs = {"prompt": prefs.prompts, "chosen": prefs.chosen, "rejected": prefs.rejected, "s": s}
    for arm in ("dpo", "cdpo"):
        for gamma in (0.1, 0.5, 1.0):
            for lr in cfg.lrs[1:]:
                policy, _ = C.train_arm(base, pairs, arm, gamma=gamma, steps=cfg.steps, lr=lr,
                                        batch_size=cfg.batch_size, seed=seed, every=cfg.every, quiet=True)
                acc = {k: task.greedy_accuracy(policy, q, generator=torch.Generator())["all"]
                       for k, q in (("val", val), ("test", test))}
                print(json.dumps({"seed": seed, "arm": arm, "gamma": gamma, "lr": lr, **acc}), flush=True)

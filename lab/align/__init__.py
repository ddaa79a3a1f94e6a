"""Preference optimization: the DPO-family baselines and the papers' losses behind one registry.

`LOSSES[name](pi, ref, **options) -> (B,)` with pi, ref the (B, n) sequence log-probs of policy and
reference, column 0 preferred (see `lab.align.losses`).

Paper modules: `expo` (EXPO; its tiny transformer in `expo_lm`), `hps` (HPS), `infalign` (InfAlign; prompts of
different reward scales in `infalign_scales`), `rip` (RIP), `cdpo` (cDPO); import them by name (`from lab.align
import infalign`): only `expo` and `hps`, whose losses the registry holds, load with the package. Shared pieces:
`losses` (the baselines), `train` (the one gradient loop, `optimize`, and the preference trainers over it), `exact`
(exact enumeration of a tiny LM's responses), `tokens` (token-level KL and sampling beyond enumeration)."""

from lab.align import expo, hps, losses

LOSSES = {
    "dpo": losses.dpo,
    "ipo": losses.ipo,
    "fdpo_js": losses.fdpo_js,
    "rpo": losses.rpo,
    "pl": losses.plackett_luce,
    "tdpo": losses.tdpo,
    "expo": expo.expo,
    "hps": hps.hps,
}

__all__ = ["LOSSES", "expo", "hps", "losses"]

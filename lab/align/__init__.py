"""Preference optimization: the DPO-family baselines and the papers' losses behind one registry.

`LOSSES[name](pi, ref, **options) -> (B,)` with pi, ref the (B, n) sequence log-probs of policy and
reference, column 0 preferred (see `lab.align.losses`).

Paper modules: `expo` (EXPO), `hps` (HPS), `infalign` (InfAlign), `rip` (RIP), `cdpo` (cDPO); import
them by name (`from lab.align import infalign`): only `expo` and `hps`, whose losses the registry holds,
load with the package. Shared pieces: `losses` (the baselines), `train` (the one gradient loop,
`optimize`, and the preference trainers over it), `exact` (exact enumeration of a tiny LM's responses)."""

from lab.align import expo, hps, losses

LOSSES = {
    "dpo": losses.dpo,
    "ipo": losses.ipo,
    "fdpo_js": losses.fdpo_js,
    "rpo": losses.rpo,
    "pl": losses.plackett_luce,
    "expo": expo.expo,
    "hps": hps.hps,
}

__all__ = ["LOSSES", "expo", "hps", "losses"]

"""Zero-shot benchmark accuracy of a saved checkpoint through EleutherAI's lm-evaluation-harness.

The compression papers (HC-SMoE, Olica) report 0-shot accuracy from `lm-eval` on the model they write; the lab
does the same on the folder a notebook writes, never with a hand-written harness. `lm-eval` is the optional
`eval` extra (`pip install -e ".[eval]"`); its tasks download their data sets, so this runs only at full scale
on a connected machine (or with the data sets in the local Hugging Face cache). Custom model classes (Olica's
`OlicaLlamaForCausalLM`) load because their module, imported by the notebook, registered them with the Auto
classes in this process.
"""

from __future__ import annotations


def zero_shot(folder: str, tasks: list[str], *, device: str = "cpu", batch_size: int | str = "auto",
              limit: int | None = None) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} from `lm_eval.evaluator.simple_evaluate` on the `hf` model at `folder`, 0-shot.

    `limit` caps the examples per task (a smoke check, not a result). Raises one sentence when lm-eval is missing.
    """
    try:
        from lm_eval import evaluator
    except ImportError as e:
        raise ModuleNotFoundError("zero-shot evaluation needs lm-eval, the optional 'eval' extra: "
                                  "pip install -e '.[eval]'.") from e
    out = evaluator.simple_evaluate(model="hf", model_args=f"pretrained={folder},dtype=auto", tasks=list(tasks),
                                    num_fewshot=0, batch_size=batch_size, device=device, limit=limit)
    return {task: {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            for task, metrics in out["results"].items()}

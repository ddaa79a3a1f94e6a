"""Neutral residues: exactness at init, frozen backbone, parameter count, the ℓ1 loss's token mask, the gate
forms, saving/reloading the adapters, the data mix, and the checkpoint path on a saved tiny Llama."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from lab.adapt import neutral_residues as nr
from lab.adapt import neutral_residues_study as st
from lab.core.params import ParamError
from lab.data.two_languages import TwoLanguages
from lab.models import tiny_llama


def llama(seed=0, d=32, L=2):
    torch.manual_seed(seed)
    return tiny_llama(vocab_size=40, d_model=d, n_layers=L, n_heads=4, d_ff=64).eval()


def test_zero_init_output_gives_the_backbone_logits_exactly():
    base = llama()
    x = torch.randint(40, (3, 12))
    for spec in (nr.AdapterSpec(8), nr.AdapterSpec(8, gate="sigmoid"), nr.AdapterSpec(8, gate="none", init="default")):
        m = llama()
        nr.attach(m, spec)
        with torch.no_grad():
            assert torch.equal(m(input_ids=x).logits, base(input_ids=x).logits)
    m = llama()  # the known-wrong variant: W_o not zero moves the logits
    nr.attach(m, nr.AdapterSpec(8, zero_out=False))
    with torch.no_grad():
        assert (m(input_ids=x).logits - base(input_ids=x).logits).abs().max() > 1e-4


def test_no_gradient_reaches_the_backbone_and_adapters_learn():
    m = llama()
    before = {n: p.clone() for n, p in m.named_parameters()}
    ads = nr.attach(m, nr.AdapterSpec(8))
    x = torch.randint(40, (2, 10))
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        loss = m(input_ids=x, labels=x).loss + nr.local_loss(ads, torch.ones_like(x, dtype=torch.bool))
        loss.backward()
        opt.step()
        opt.zero_grad()
    for n, p in m.named_parameters():
        if ".adapter." in n:
            assert p.requires_grad
        else:
            assert not p.requires_grad and p.grad is None
            assert torch.equal(p, before[n.replace("mlp.mlp.", "mlp.")])
    assert ads[0].w_o.weight.abs().sum() > 0


def test_adapter_parameter_count_matches_hand_count():
    d, L, h = 32, 2, 8
    for gate, gd, extra in (("relu", "scalar", d), ("none", "scalar", 0), ("relu", "vector", d * d)):
        m = llama()
        nr.attach(m, nr.AdapterSpec(h, gate=gate, gate_dim=gd))
        trainable = sum(p.numel() for p in m.parameters() if p.requires_grad)
        assert trainable == L * (3 * d * h + extra) == nr.adapter_params(d, L, nr.AdapterSpec(h, gate, gd))
    m = llama()
    n = sum(p.numel() for p in m.parameters())
    h = nr.hidden_for(m, 0.2)
    assert abs(nr.adapter_params(d, L, nr.AdapterSpec(h)) / n - 0.2) < 3 * d * L / n  # within one unit of width


def test_low_variance_init_and_the_gate():
    m = llama(d=64, L=2)
    a = nr.attach(m, nr.AdapterSpec(256))[0]
    for lin in (a.w_i, a.w_g):
        assert lin.weight.var().item() == pytest.approx(1 / (64 * 2), rel=0.1)
    assert a.w_o.weight.abs().sum() == 0
    x = torch.randn(5, 64)
    a(x)
    assert torch.equal(a.g, torch.relu(x @ a.gate.weight.T))  # g = ReLU(wᵀx), one scalar per token
    b = nr.GatedAdapter(64, nr.AdapterSpec(4, gate_dim="vector"), 2)
    nn_out = b(x)
    assert b.g.shape == (5, 64) and nn_out.shape == (5, 64)


def test_local_loss_only_on_original_tokens_hand_computed():
    d = 4
    a1, a2 = (nr.GatedAdapter(d, nr.AdapterSpec(2), 1) for _ in range(2))
    a1.r = torch.tensor([[[1.0, -1, 2, 0], [8, 8, 8, 8]]])  # (B=1, T=2, d): |r|/d = 1.0 and 8.0
    a2.r = torch.tensor([[[0.0, 0, 0, 4], [-4, 4, 4, -4]]])  # 1.0 and 4.0
    mask = torch.tensor([[True, False]])  # token 0 is original, token 1 new
    assert nr.local_loss([a1, a2], mask).item() == pytest.approx((1.0 + 1.0) / 2)
    assert nr.local_loss([a1, a2], ~mask).item() == pytest.approx((8.0 + 4.0) / 2)
    assert nr.local_loss([a1, a2], torch.zeros_like(mask)).item() == 0.0
    assert nr.aux_loss([a1, a2], mask, "l1", "new").item() == pytest.approx(6.0)  # the control's wrong tokens


def test_domain_loss_is_bce_against_the_language():
    a = nr.GatedAdapter(4, nr.AdapterSpec(2, gate="sigmoid"), 1)
    a.g = torch.tensor([[[0.8], [0.3]]])
    new = torch.tensor([[False, True]])
    want = -(math.log(1 - 0.8) + math.log(0.3)) / 2
    assert nr.domain_loss([a], new).item() == pytest.approx(want, rel=1e-5)


def test_wrong_family_is_one_sentence():
    from lab.models import tiny_mamba2

    with pytest.raises(ParamError, match="not a Llama-family"):
        nr.attach(tiny_mamba2(vocab_size=20, d_model=32, n_layers=1), nr.AdapterSpec(4))


def test_save_and_load_adapters_round_trip(tmp_path):
    m = llama()
    ads = nr.attach(m, nr.AdapterSpec(8))
    for a in ads:
        torch.nn.init.normal_(a.w_o.weight)
    nr.save_adapters(m, tmp_path)
    back = llama()
    nr.load_adapters(back, tmp_path)
    x = torch.randint(40, (2, 9))
    with torch.no_grad():
        assert torch.equal(back(input_ids=x).logits, m(input_ids=x).logits)
    conf = json.loads((tmp_path / "adapter_config.json").read_text())
    assert conf["spec"]["hidden"] == 8 and conf["n_layers"] == 2


def test_two_languages_vocabularies_mix_and_entropy():
    data = TwoLanguages(seq_len=40)
    g = torch.Generator().manual_seed(0)
    a, b = data.sample(200, "A", g), data.sample(200, "B", g)
    assert (a[:, 0] == 0).all() and a[:, 1:].min() >= 1 and a[:, 1:].max() <= data.a_hi
    assert b[:, 1:].min() >= data.b_lo and b[:, 1:].max() < data.vocab
    batch = data.mix(400, 0.25, g)
    is_orig = batch["orig"][:, 0]
    assert abs(is_orig.float().mean().item() - 0.25) < 0.07 and (batch["orig"] == is_orig[:, None]).all()
    assert (batch["input_ids"][is_orig, 1:] <= data.a_hi).all()
    # the empirical next-word entropy matches the exact one (a naive count over many sequences)
    seqs = data.sample(3000, "B", g)[:, 1:]
    T = torch.zeros(data.vocab, data.vocab)
    T.index_put_((seqs[:, :-1].flatten(), seqs[:, 1:].flatten()), torch.ones(seqs[:, 1:].numel()), accumulate=True)
    P = T / T.sum(1, keepdim=True).clamp(min=1)
    h = -(P * torch.where(P > 0, P.log(), torch.zeros_like(P))).sum(1)
    assert (T.sum(1) @ h / T.sum()).item() == pytest.approx(data.entropy_rate("B"), abs=0.02)


def test_best_lr_and_pareto_dominance_hand_computed():
    """Seed 0's measured curves (L_B, ΔL_A per lr): NR learns best at 1e-2; the adapter's lrs that learn as much
    (L_B ≤ 1.888) forget at least 0.208, so 0.208 / 0.116; FT at 3e-4 learns more and forgets 0.121."""
    cfg = st.Config()
    curves = {"NR": [(2.207, 0.032), (2.016, 0.112), (1.899, 0.113), (1.888, 0.116), (2.201, 0.202)],
              "adapter": [(2.145, 0.040), (1.917, 0.176), (1.820, 0.208), (1.798, 0.240), (1.817, 0.412)],
              "FT": [(1.744, 0.121), (1.381, 0.194), (1.207, 0.243), (1.186, 0.420), (1.370, 2.036)],
              "LoRA": [(3.0, 0.0)] * 5}
    runs = {(m, lr, cfg.p): {"L_B": b, "dL_A": a} for m, pts in curves.items() for lr, (b, a) in zip(cfg.lrs, pts)}
    assert cfg.lrs == (3e-4, 1e-3, 3e-3, 1e-2, 3e-2)
    assert st.best_lr(runs, cfg, "NR") == 1e-2 and st.best_lr(runs, cfg, "FT") == 1e-2
    assert st.dominance(runs, cfg, "adapter") == pytest.approx(0.208 / 0.116)
    assert st.dominance(runs, cfg, "FT") == pytest.approx(0.121 / 0.116)
    assert st.dominance(runs, cfg, "LoRA") == math.inf  # no LoRA lr learns B as well as NR
    assert st.dominance(runs, cfg, "NR") == pytest.approx(0.116 / 0.116)  # a method against itself: 1, never above


def test_training_step_moves_only_adapters_through_accelerate():
    data = TwoLanguages(seq_len=12)
    base = tiny_llama(vocab_size=data.vocab, d_model=32, n_layers=2, n_heads=4, d_ff=64).eval()
    g = torch.Generator().manual_seed(0)
    stream = [data.mix(4, 0.5, g) for _ in range(3)]
    before = [p.clone() for p in base.parameters()]
    model, ads, info = st.adapt(base, stream, st.Arm("NR", lr=1e-2), seed=0)
    assert info["trainable"] == nr.adapter_params(32, 2, ads[0].spec) and len(info["losses"]) == 3
    assert all(torch.equal(p, q) for p, q in zip(before, base.parameters()))  # the base is copied, not trained
    frozen = [p for n, p in model.named_parameters() if ".adapter." not in n]
    assert all(torch.equal(p, q) for p, q in zip(before, frozen))
    ft, _, info_ft = st.adapt(base, stream, st.Arm("FT", lr=1e-2), seed=0)
    assert info_ft["trainable"] == sum(p.numel() for p in base.parameters())
    lora, _, info_l = st.adapt(base, stream, st.Arm("LoRA", lr=1e-2), lora_r=2, seed=0)
    assert info_l["trainable"] == 2 * 2 * (4 * (32 + 32) + 2 * (32 + 64) + (64 + 32))


@pytest.mark.notebook
def test_checkpoint_folder_trains_adapters_saved_beside_an_untouched_backbone(tmp_path):
    """model=<folder>, data=<.txt>, orig_data=<.txt>: NR on a saved tiny Llama, only the adapters written."""
    from lab.models.tokenizer import word_tokenizer

    from ..conftest import run_lab

    words = [f"w{i}" for i in range(30)]
    tok = word_tokenizer(words)
    torch.manual_seed(0)
    tiny_llama(vocab_size=len(tok), d_model=32, n_layers=2, n_heads=4, d_ff=64).save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    g = np.random.default_rng(0)
    (tmp_path / "new.txt").write_text("\n".join(" ".join(g.choice(words[15:], 40)) for _ in range(100)))
    (tmp_path / "old.jsonl").write_text("\n".join(json.dumps({"text": " ".join(g.choice(words[:20], 40))})
                                                  for _ in range(100)))
    proc = run_lab("run", "15_neutral_residues", "-p", "model", str(tmp_path / "ckpt"), "-p", "data",
                   str(tmp_path / "new.txt"), "-p", "orig_data", str(tmp_path / "old.jsonl"), "-p", "out_dir",
                   str(tmp_path / "adapters"), "-p", "steps", "10", "-p", "n_blocks", "16", "-p", "block_len", "32",
                   "--out", str(tmp_path / "out"), "--no-page")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rec = json.loads((tmp_path / "out" / "15_neutral_residues.json").read_text())
    assert rec["status"] == "measured" and rec["claims"] == []
    ck = rec["metrics"]["checkpoint"]
    assert ck["backbone_untouched"] is True and ck["reload_max_abs_logit_diff"] <= 1e-5
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["adapter_config.json", "adapters.safetensors"]
    assert ck["adapter_bytes"] < (tmp_path / "ckpt" / "model.safetensors").stat().st_size
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    ads = nr.load_adapters(back, tmp_path / "adapters")
    assert len(ads) == 2 and ads[0].w_o.weight.abs().sum() > 0

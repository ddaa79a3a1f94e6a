"""Hidden attention of tiny Mamba-1 / Mamba-2 models: the matrices rebuild the real mixer output, are causal,
and match naive recurrences and a hand-computed 3-token case."""

import math

import pytest
import torch
from transformers import Mamba2Config, Mamba2ForCausalLM, MambaConfig, MambaForCausalLM

from lab.interp.hidden_attention import (
    attention,
    hidden_attention,
    mamba1_hidden_attention,
    mamba2_hidden_attention,
    mixer_output_from_attention,
    segsum,
)

VOCAB = 20
TOL = 1e-4


@torch.no_grad()
def perturb(model, seed=0):
    """Move A_log, the time-step bias, D (and the gated-norm weight) away from their tidy initial values and
    give the projections and the conv O(1) outputs (the default init makes B, C, x tiny)."""
    g = torch.Generator().manual_seed(seed)
    for block in model.base_model.layers:
        m = block.mixer
        for lin in (m.in_proj, m.conv1d, m.out_proj, getattr(m, "x_proj", None), getattr(m, "dt_proj", None)):
            if lin is not None:
                fan_in = lin.weight[0].numel()
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) / math.sqrt(fan_in))
        m.A_log.copy_(torch.rand(m.A_log.shape, generator=g) * 3.5 - 2.0)  # A in [-4.5, -0.14]
        m.D.copy_(torch.randn(m.D.shape, generator=g))
        bias = m.dt_bias if hasattr(m, "dt_bias") else m.dt_proj.bias
        bias.copy_(torch.randn(bias.shape, generator=g))
        if hasattr(m, "norm"):
            m.norm.weight.copy_(1 + 0.3 * torch.randn(m.norm.weight.shape, generator=g))
    return model.eval()


def tiny_mamba2(*, n_groups=1, chunk_size=8, time_step_limit=(0.0, math.inf), n_layers=2):
    torch.manual_seed(0)
    cfg = Mamba2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=n_layers, state_size=8, expand=2,
                       head_dim=16, num_heads=4, n_groups=n_groups, chunk_size=chunk_size,
                       time_step_limit=time_step_limit)
    return perturb(Mamba2ForCausalLM(cfg))


def tiny_mamba1(*, hidden_size=16, state_size=4, n_layers=2, expand=2):
    torch.manual_seed(0)
    cfg = MambaConfig(vocab_size=VOCAB, hidden_size=hidden_size, num_hidden_layers=n_layers,
                      state_size=state_size, expand=expand)
    return perturb(MambaForCausalLM(cfg))


@torch.no_grad()
def mixer_io(model, input_ids, layer):
    """Input and output of layer `layer`'s mixer during a real forward (hooks)."""
    from lab.models import hooks

    mixer, io = hooks.mixer(model, layer), {}  # Bamba passes hidden_states= by keyword
    h1 = mixer.register_forward_pre_hook(
        lambda mod, args, kw: io.__setitem__("in", args[0] if args else kw["hidden_states"]), with_kwargs=True)
    h2 = mixer.register_forward_hook(lambda mod, args, out: io.__setitem__("out", out))
    model(input_ids=input_ids, use_cache=False)
    h1.remove(), h2.remove()
    return mixer, io["in"], io["out"]


def test_segsum_is_the_sum_over_k_from_j_plus_1_to_i():
    a = torch.randn(2, 6)
    S = segsum(a)  # (2, 6, 6)
    for i in range(6):
        for j in range(6):
            want = a[:, j + 1:i + 1].sum(-1) if j <= i else torch.full((2,), -math.inf)
            torch.testing.assert_close(S[:, i, j], want)


@pytest.mark.parametrize("n_groups, chunk_size, T, limit", [
    (1, 8, 8, (0.0, math.inf)),  # T == chunk_size
    (2, 4, 7, (0.0, math.inf)),  # T not a multiple of chunk_size: the mixer pads, the matrix must not
    (2, 16, 5, (0.0, math.inf)),  # one partial chunk
    (1, 4, 10, (0.05, 0.4)),  # time_step_limit clamp active
])
def test_mamba2_matrix_rebuilds_the_mixer_output(n_groups, chunk_size, T, limit):
    model = tiny_mamba2(n_groups=n_groups, chunk_size=chunk_size, time_step_limit=limit)
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    for layer in range(2):
        mixer, h, out = mixer_io(model, ids, layer)
        with torch.no_grad():
            M, parts = mamba2_hidden_attention(mixer, h)
            rebuilt = mixer_output_from_attention(mixer, M, parts)
        assert M.shape == (2, 4, T, T) and M.dtype == torch.float32
        assert parts["x"].shape == (2, T, 4, 16) and parts["B"].shape == (2, T, 4, 8)
        assert torch.equal(M.triu(1), torch.zeros_like(M))  # causal
        assert (rebuilt - out).abs().max() < TOL
        torch.testing.assert_close(hidden_attention(model, ids, layer), M)


def test_mamba2_matrix_equals_a_naive_recurrence_with_the_skip():
    model = tiny_mamba2(n_groups=2, chunk_size=4)
    mixer = model.backbone.layers[0].mixer
    h = torch.randn(1, 6, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        M, p = mamba2_hidden_attention(mixer, h)
    x, dt, A, B, C, D = p["x"].float(), p["dt"], p["A"], p["B"], p["C"], mixer.D.detach()
    assert D.abs().min() > 0.05  # perturbed away from 0 (and from 1, its init), so the skip shows
    # h_t = exp(Δ_t A_h) h_{t-1} + Δ_t x_t B_t^T (P, N);  y_t = h_t C_t + D_h x_t (the skip)
    state, ys = torch.zeros(4, 16, 8), []
    for t in range(6):
        dBx = dt[0, t, :, None, None] * x[0, t, :, :, None] * B[0, t, :, None, :]  # (H, P, N)
        state = torch.exp(dt[0, t] * A)[:, None, None] * state + dBx
        ys.append(torch.einsum("hpn,hn->hp", state, C[0, t]) + D[:, None] * x[0, t])
    y_loop = torch.stack(ys)  # (T, H, P)
    y_matrix = torch.einsum("hij,jhp->ihp", M[0], x[0])
    assert (y_loop - y_matrix).abs().max() < 1e-5
    # the skip sits on the diagonal only: M - diag(D) is the pure scan (its diagonal C_i·B_i Δ_i)
    scan_diag = (C[0] * B[0]).sum(-1) * dt[0]  # (T, H)
    torch.testing.assert_close(M[0].diagonal(dim1=-2, dim2=-1), scan_diag.T + D[:, None], rtol=1e-5, atol=1e-6)
    # n_groups=2: heads 0,1 read group 0, heads 2,3 group 1
    assert torch.equal(B[..., 0, :], B[..., 1, :]) and not torch.equal(B[..., 1, :], B[..., 2, :])


def test_mamba1_matrix_rebuilds_the_mixer_output():
    model = tiny_mamba1()
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    for layer in range(2):
        mixer, h, out = mixer_io(model, ids, layer)
        with torch.no_grad():
            alpha, parts = mamba1_hidden_attention(mixer, h)
            rebuilt = mixer_output_from_attention(mixer, alpha, parts)
        assert alpha.shape == (2, 32, 7, 7) and alpha.dtype == torch.float32
        assert torch.equal(alpha.triu(1), torch.zeros_like(alpha))
        assert (rebuilt - out).abs().max() < TOL
        torch.testing.assert_close(hidden_attention(model.backbone, ids, layer), alpha)


def test_mamba1_one_channel_by_hand():
    model = tiny_mamba1(hidden_size=1, state_size=1, n_layers=1, expand=1)  # one inner channel, one state
    mixer = model.backbone.layers[0].mixer
    h = 3 * torch.randn(1, 3, 1, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        alpha, p = mamba1_hidden_attention(mixer, h)
    a = p["A"][0, 0].item()
    d, b, c, x = (p[k][0, :, 0].tolist() for k in ("dt", "B", "C", "x"))
    # alpha_ij = c_i exp(a Σ_{k=j+1..i} Δ_k) Δ_j b_j, written out for T = 3
    want = torch.tensor([
        [c[0] * d[0] * b[0], 0.0, 0.0],
        [c[1] * math.exp(a * d[1]) * d[0] * b[0], c[1] * d[1] * b[1], 0.0],
        [c[2] * math.exp(a * (d[1] + d[2])) * d[0] * b[0], c[2] * math.exp(a * d[2]) * d[1] * b[1],
         c[2] * d[2] * b[2]],
    ])
    torch.testing.assert_close(alpha[0, 0], want, rtol=1e-5, atol=1e-8)
    # the recurrence h_t = exp(Δ_t A) h_{t-1} + Δ_t B_t x_t, y_t = C_t h_t
    state, y = 0.0, []
    for t in range(3):
        state = math.exp(d[t] * a) * state + d[t] * b[t] * x[t]
        y.append(c[t] * state)
    torch.testing.assert_close(alpha[0, 0] @ torch.tensor(x), torch.tensor(y), rtol=1e-5, atol=1e-8)


def test_matrix_is_differentiable_in_the_ssm_parameters():
    mixer = tiny_mamba2(n_layers=1).backbone.layers[0].mixer
    M, _ = mamba2_hidden_attention(mixer, torch.randn(1, 5, 32))
    M.square().sum().backward()
    for p in (mixer.A_log, mixer.dt_bias, mixer.in_proj.weight):
        assert p.grad is not None and p.grad.isfinite().all() and p.grad.abs().sum() > 0


def test_other_modules_are_rejected():
    with pytest.raises(TypeError, match="Mamba2Mixer or MambaMixer"):
        mixer_output_from_attention(torch.nn.Linear(2, 2), torch.zeros(1, 1, 2, 2),
                                    {"x": torch.zeros(1), "z": torch.zeros(1), "D": torch.zeros(1)})


def test_attention_for_each_kind():
    from lab.models import tiny_llama
    from lab.models import tiny_mamba2 as zoo_mamba2

    torch.manual_seed(0)
    mamba1 = MambaForCausalLM(MambaConfig(vocab_size=VOCAB, hidden_size=16, state_size=4, num_hidden_layers=2,
                                          expand=2, use_mambapy=False))
    models = {"llama": tiny_llama(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4),
              "mamba2": zoo_mamba2(vocab_size=VOCAB, d_model=32, n_layers=2, head_dim=16), "mamba1": mamba1}
    X = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    for name in ("llama", "mamba2", "mamba1"):
        m = models[name]
        A = attention(m, X[:1], 1)
        H = {"llama": 4, "mamba2": 4, "mamba1": 32}[name]
        assert A.shape == (1, H, 9, 9)
        assert torch.all(A.triu(1) == 0)
    torch.testing.assert_close(attention(models["llama"], X[:1], 0).sum(-1), torch.ones(1, 4, 9))
    torch.testing.assert_close(attention(models["mamba2"], X[:1], 1), hidden_attention(models["mamba2"], X[:1], 1))


def test_a_hybrids_mamba2_and_attention_blocks():
    """Bamba's Mamba-2 mixer rebuilds from its matrix like Mamba2Mixer; the attention block's matrix is the one
    transformers returns for that block (a hybrid returns its attention blocks' only), rows summing to 1."""
    from transformers import AttentionInterface

    from lab.models import tiny_hybrid

    torch.manual_seed(0)
    m = tiny_hybrid(vocab_size=VOCAB, d_model=32, layout="MAM", n_heads=2, head_dim=16).eval()
    X = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    for layer in (0, 2):
        mixer, h, out = mixer_io(m, X, layer)
        with torch.no_grad():
            M, parts = mamba2_hidden_attention(mixer, h)
            assert (mixer_output_from_attention(mixer, M, parts) - out).abs().max() < TOL
        torch.testing.assert_close(attention(m, X, layer), M)
    A = attention(m, X, 1)
    assert A.shape == (2, 2, 9, 9) and torch.all(A.triu(1) == 0)
    torch.testing.assert_close(A.sum(-1), torch.ones(2, 2, 9))
    seen = []

    def recording(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        w = ((query @ key.transpose(-1, -2)) * scaling).masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1),
                                                                     float("-inf")).softmax(-1)
        seen.append(w)
        return (w @ value).transpose(1, 2).contiguous(), w

    AttentionInterface.register("lab_test_recording", recording)
    m.set_attn_implementation("lab_test_recording")
    try:
        with torch.no_grad():
            m(input_ids=X, use_cache=False)
    finally:
        m.set_attn_implementation("eager")
    torch.testing.assert_close(A, seen[0])  # the only attention block is block 1

"""REST and EAGLE, BanditSpec's other Table 1 arms (`lab.reasoning.banditspec_drafters`): against naive searches,
torch's own losses, full forward passes of the target, and plain `generate`."""

import dataclasses

import numpy as np
import torch
from torch.nn import functional as F

from lab.models.zoo import tiny_llama
from lab.reasoning import banditspec_bench as bb
from lab.reasoning.banditspec_decode import Arm, Cached, PromptLookup, bandit_generate, frequent_chain
from lab.reasoning.banditspec_drafters import EagleDrafter, EagleHead, Retrieval, eagle_loss, features, train_eagle


def _naive_conts(texts, ids, gamma, max_span=16, min_span=2):
    """Every occurrence (with a next token) of the text's longest suffix of min_span…max_span tokens, by brute force."""
    for n in range(min(max_span, len(ids)), min_span - 1, -1):
        out = [t[s + n:s + n + gamma] for t in texts for s in range(len(t) - n) if t[s:s + n] == ids[-n:]]
        if out:
            return out
    return []


def test_rest_retrieves_the_longest_suffix_like_a_brute_force_search():
    rng = np.random.default_rng(0)
    found = 0
    for _ in range(300):
        texts = [rng.integers(0, 4, rng.integers(3, 40)).tolist() for _ in range(rng.integers(1, 5))]
        ids = rng.integers(0, 4, rng.integers(1, 20)).tolist()
        gamma = int(rng.integers(1, 5))
        got, want = Retrieval(texts, max_span=6).conts(ids, gamma), _naive_conts(texts, ids, gamma, max_span=6)
        assert sorted(got) == sorted(want)
        found += bool(want)
    assert found > 200
    # no match runs across two texts of the datastore; a suffix shorter than min_span retrieves nothing
    rest = Retrieval([[1, 2], [3, 4, 5]], vocab_size=8)
    assert rest.conts([9, 2, 3], 2) == [] and rest.conts([4], 2) == []
    assert rest.propose([0, 3, 4], 3, greedy=True, temperature=1.0, gen=None) == ([5], None)


def test_frequent_chain_by_hand():
    conts = [[1, 2], [1, 3], [1, 2], [4]]
    assert frequent_chain(conts, 2) == ([1, 2], 0.75 + 0.5)  # 3/4, then 3/4 · 2/3
    assert frequent_chain(conts, 2, min_prob=0.6) == ([1], 0.75)
    assert frequent_chain([], 3) == ([], 0.0)


def _target(V=40, seed=0):
    torch.manual_seed(seed)
    m = tiny_llama(vocab_size=V, d_model=32, n_layers=2, n_heads=4, max_len=128).eval()
    m.generation_config.eos_token_id, m.generation_config.pad_token_id = None, 0
    return m


def test_cached_features_follow_the_cache_through_crops():
    target = _target()
    c = Cached(target, keep_feats=True)
    a = list(range(1, 13))
    c.feed(a + [20, 21, 22], n_out=4)  # a verification call with three drafts
    c.feed(a + [20, 30])  # two of them rejected: the cache and the features are cropped, then extended
    c.feed(a + [20, 30, 31, 32], n_out=3)
    full = features(target, torch.tensor([c.held]))[0]
    assert c.feats.shape == full.shape and torch.allclose(c.feats, full, atol=1e-5)


def test_eagle_loss_against_torch_smooth_l1_and_soft_cross_entropy():
    g = torch.Generator().manual_seed(0)
    pred, feats = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    head = torch.nn.Linear(8, 11, bias=False)
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)
    at = mask.nonzero().tolist()
    v = torch.stack([F.smooth_l1_loss(pred[b, t], feats[b, t]) for b, t in at])
    ce = torch.stack([F.cross_entropy(head(pred[b, t]), torch.softmax(head(feats[b, t]), -1)) for b, t in at])
    want = (v + 0.1 * ce).mean()
    assert torch.allclose(eagle_loss(pred, feats, head, mask, 0.1), want, atol=1e-6)


def test_eagle_head_is_fc_then_one_layer_without_input_or_final_norm():
    target = _target()
    head = EagleHead(target.config, target.get_input_embeddings().weight.detach())
    assert head.fc.in_features == 2 * 32 and head.fc.bias is not None and len(head.body.layers) == 1
    assert isinstance(head.body.norm, torch.nn.Identity)
    assert isinstance(head.body.layers[0].input_layernorm, torch.nn.Identity)
    assert torch.equal(head.body.embed_tokens.weight, target.get_input_embeddings().weight)
    assert not head.body.embed_tokens.weight.requires_grad
    w = head.body.layers[0].self_attn.q_proj.weight  # PyTorch's default init (uniform ±1/√D), not N(0, 0.02)
    assert w.abs().max() <= 32 ** -0.5 and w.std() > 0.05
    # causal: the prediction at position t reads nothing after t
    f, x = torch.randn(1, 6, 32), torch.randint(1, 40, (1, 6))
    out = head(f, x)
    f2, x2 = f.clone(), x.clone()
    f2[0, 4:] += 1.0
    x2[0, 4:] = 0
    assert torch.allclose(head(f2, x2)[0, :4], out[0, :4], atol=1e-6)


def test_eagle_drafter_extrapolates_from_the_verified_features():
    """Drafts against a loop that recomputes every feature with a full forward pass of the target."""
    target = _target()
    torch.manual_seed(1)
    head = EagleHead(target.config, target.get_input_embeddings().weight.detach()).eval()
    with torch.no_grad():  # untrained, the tiny embedding (std 0.02) barely moves fc: make the token count
        head.fc.weight[:, :32].mul_(100)
    ids = [3, 7, 1, 9, 4, 4, 2, 8]
    d = EagleDrafter(head, target)
    assert d.propose(ids, 3, greedy=True, temperature=1.0, gen=None) == ([], None)  # no target cache yet
    d.target = Cached(target, keep_feats=True)
    d.target.feed(ids[:-1] + [5, 6], n_out=3)  # the last verification: ids[:-1] plus two rejected drafts
    got, _ = d.propose(ids, 3, greedy=True, temperature=1.0, gen=None)
    want = {}
    with torch.no_grad():
        for pairing, tokens in (("x_{t+1}", ids[1:]), ("x_t (wrong)", ids[:-1])):
            f, nxt, want[pairing] = features(target, torch.tensor([ids[:-1]]))[0], list(tokens), []
            for _ in range(3):
                f_hat = head(f[None], torch.tensor([nxt]))[0, -1]
                want[pairing].append(int(target.lm_head(f_hat).argmax()))
                f, nxt = torch.cat([f, f_hat[None]]), nxt + [want[pairing][-1]]
    assert got == want["x_{t+1}"] != want["x_t (wrong)"]  # f_t is paired with the token after it
    drafts, q = d.propose(ids, 2, greedy=False, temperature=0.7, gen=torch.Generator().manual_seed(0))
    assert len(drafts) == 2 and q.shape == (2, 40) and torch.allclose(q.sum(-1), torch.ones(2, dtype=q.dtype))


def test_trained_eagle_and_rest_arms_are_lossless_and_draft_accepted_tokens():
    task = bb.EditGenerate(n_cycle=32, length=48, seed=0)
    V = task.vocab_size
    torch.manual_seed(0)
    target = dataclasses.replace(bb.TARGET, steps=200).fit(task, V, seed=0, quiet=True).model
    target.generation_config.eos_token_id, target.generation_config.pad_token_id = None, 0
    head, losses = train_eagle(target, task, steps=120, lr=1e-2, seed=0, quiet=True)
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])
    b = task.batch(32, torch.Generator().manual_seed(9))
    store = [row[lab != -100].tolist() for row, lab in zip(b["input_ids"], b["labels"])]
    prompts = task.prompts(2, "generate", torch.Generator().manual_seed(5))
    for policy in ("fixed 0", "fixed 1", "UCBSpec"):
        arms = [Arm("EAGLE", EagleDrafter(head, target), 4), Arm("REST", Retrieval(store, vocab_size=V), 4),
                Arm("PLD", PromptLookup(3, V), 4)]
        for p in prompts:
            tr = bandit_generate(target, arms, p, 40, policy=policy, cr_scale=0.25)
            assert tr.tokens == bb.plain(target, p, 40)
            if policy != "UCBSpec":
                assert sum(tr.accepted) >= 20  # both arms draft the cycle: most rounds accept drafts


def test_eagle_trains_and_drafts_on_a_bfloat16_target():
    """A checkpoint in bf16: the head trains in float32 on the target's features, drafts through the bf16 LM head."""
    from lab.reasoning.banditspec_drafters import TokenBlocks

    target = _target().to(torch.bfloat16)
    blocks = torch.randint(1, 40, (8, 24), generator=torch.Generator().manual_seed(0))
    head, losses = train_eagle(target, TokenBlocks(blocks), steps=5, batch_size=4, seed=0, quiet=True)
    assert all(np.isfinite(losses)) and next(head.parameters()).dtype == torch.float32
    d = EagleDrafter(head, target)
    d.target = Cached(target, keep_feats=True)
    ids = blocks[0, :10].tolist()
    d.target.feed(ids[:-1])
    drafts, _ = d.propose(ids, 3, greedy=True, temperature=1.0, gen=None)
    assert len(drafts) == 3 and all(0 <= x < 40 for x in drafts)
    tr = bandit_generate(target, [Arm("EAGLE", d, 3)], ids, 12)
    assert len(tr.tokens) == 12


def test_eagle_head_fits_a_target_of_another_family():
    """The head is a Llama layer of the target's sizes whatever the target's family (here a Mixtral MoE)."""
    from lab.models.zoo import tiny_mixtral

    torch.manual_seed(0)
    target = tiny_mixtral(vocab_size=40, d_model=32, n_layers=1, n_heads=4).eval()
    head = EagleHead(target.config, target.get_input_embeddings().weight.detach())
    assert head.body.config.hidden_size == 32 and head.body.config.num_attention_heads == 4
    ids = torch.randint(1, 40, (2, 9))
    assert head(features(target, ids), ids).shape == (2, 9, 32)

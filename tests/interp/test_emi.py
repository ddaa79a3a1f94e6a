import math

import pytest
import torch

from lab.interp import emi as E


def gaussian_pairs(rho: float, n: int = 3000, d: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = rho * x + math.sqrt(1 - rho**2) * torch.randn(n, d, generator=g)
    return x, y


@pytest.mark.parametrize("rho", [0.0, 0.5, 0.7])
def test_club_against_the_closed_form_gaussian_case(rho):
    """For y = ρx + √(1−ρ²)ε the true MI is −(d/2)·log(1−ρ²); CLUB with the exact conditional equals
    d·ρ²/(1−ρ²) (≥ MI, equality only at ρ = 0). A trained CLUB must land there."""
    d = 2
    x, y = gaussian_pairs(rho, d=d)
    club = E.fit_club(x, y, hidden=32, steps=800, lr=5e-3, batch_size=256, quiet=True)
    xt, yt = gaussian_pairs(rho, n=1500, d=d, seed=1)  # held-out pairs
    with torch.no_grad():
        est = club(xt, yt).item()
    club_exact, mi = d * rho**2 / (1 - rho**2), -d / 2 * math.log(1 - rho**2)
    assert est == pytest.approx(club_exact, abs=0.06 + 0.12 * club_exact)
    assert est >= mi - 0.06


def test_emi_and_emid_signs():
    x, y = gaussian_pairs(0.7)
    club = E.fit_club(x, y, hidden=32, steps=500, lr=5e-3, batch_size=256, quiet=True)
    shuffled = y[torch.randperm(len(y), generator=torch.Generator().manual_seed(0))]
    # responses unrelated to their queries carry less query information than the references
    assert E.emi(club, x, shuffled, y) < -0.5
    assert E.emi(club, x, y, y) == 0.0
    assert E.emid(0.01, -0.2) == pytest.approx(0.21)  # ID minus OOD: positive = degradation


def test_von_neumann_entropy_and_jsd():
    assert E.von_neumann_entropy(torch.eye(4)) == pytest.approx(math.log(4))
    assert E.von_neumann_entropy(torch.diag(torch.tensor([1.0, 0.0, -1e-9]))) == pytest.approx(0.0)
    g = torch.Generator().manual_seed(0)
    A = torch.nn.functional.normalize(torch.randn(200, 8, generator=g), dim=1)
    B = torch.nn.functional.normalize(torch.randn(200, 8, generator=g) + 2 * torch.eye(8)[0], dim=1)
    assert abs(E.jsd_cov(A, A)) < 1e-10
    assert E.jsd_cov(A, B) == pytest.approx(E.jsd_cov(B, A), abs=1e-12) and E.jsd_cov(A, B) > 0.01
    # the repo's form weights sets by size; the normalised one does not
    twice = torch.cat([A, A])
    assert abs(E.jsd_cov(A, twice, normalise=True)) < 1e-10 and abs(E.jsd_cov(A, twice)) < 1e-10
    assert E.jsd_cov(twice, B) != pytest.approx(E.jsd_cov(twice, B, normalise=True))


def test_upper_bound_by_hand():
    assert E.upper_bound(0.04, 0.09, 0.0625, 0.0016) == pytest.approx(0.2 + 0.3 + 0.5 + 0.2)
    assert E.upper_bound(0.04, 0.09, 0.0625, 0.0016, entropy_scale=2.0) == pytest.approx(2 * 0.5 + 4 * 0.7)
    assert sum(E.bound_terms(0.04, 0.09, 0.0625, 0.0016).values()) == pytest.approx(1.2)
    assert E.upper_bound(-1e-12, 0.0, 0.0, 0.0) == 0.0  # round-off below zero is clipped


def test_judge_is_token_f1_by_hand():
    ref = ["red", "cross", "top-left"]
    assert E.judge(ref, ref) == 1.0
    assert E.judge(["red", "dot"], ref) == pytest.approx(0.4)  # p = 1/2, r = 1/3: 2pr/(p+r) = (1/3)/(5/6)
    assert E.judge(["red", "red"], ["red"]) == pytest.approx(2 / 3)  # a repeated word counts once: p = 1/2, r = 1
    assert E.judge([], ref) == 0.0 and E.judge(["blue"], ["red"]) == 0.0


def test_config_for_scale_and_control():
    smoke, full = E.Config.for_scale("smoke"), E.Config.for_scale("full")
    assert smoke == E.Config() and (smoke.n_objects, smoke.club_steps, smoke.shuffled) == (200, 1500, False)
    assert (full.n_objects, full.club_steps) == (1000, 4000) and E.Config.for_scale("full", "shuffled").shuffled
    errors = E.Config.for_scale("smoke", "unrelated_errors")
    assert errors.unrelated_errors and not errors.shuffled and not smoke.unrelated_errors
    with pytest.raises(ValueError, match="unknown control"):
        E.Config.for_scale("smoke", "nope")


class Parrot(torch.nn.Module):
    """A scripted 'MLLM' that answers every query with the same words (then <eos> and padding)."""

    def __init__(self, tok, words):
        super().__init__()
        self.ids = torch.tensor(tok.convert_tokens_to_ids(words + ["<eos>"] + ["<pad>"] * (3 - len(words))))

    def generate(self, patches, prompt, steps):
        return self.ids[:steps].expand(len(prompt), steps)


def test_scenarios_score_a_scripted_model_by_hand():
    from lab.data.vqa import FrozenEncoders, VisualQA

    world = VisualQA()
    enc = FrozenEncoders(world.tokenizer, seed=0)
    objects = world.sample(30, torch.Generator().manual_seed(0))
    grid = [("clean", 0), ("blur", 3)], [("clean", 0), ("typo", 1)]
    scen = E.scenarios(world, Parrot(world.tokenizer, ["red"]), enc, objects, *grid, answer_tokens=4)
    assert list(scen) == [(v, t) for v in grid[0] for t in grid[1]]
    refs = [world.answer(o, int(k)) for o, k in zip(objects["object"].tolist(), objects["kind"])]
    # "red" is exact on colour questions about red objects; against a 3-word description with red, F1 = 0.5
    acc = sum(r == ["red"] for r in refs) / 30
    rp = sum(1.0 if r == ["red"] else 0.5 if "red" in r else 0.0 for r in refs) / 30
    for s in scen.values():
        assert s["acc"] == pytest.approx(acc) and s["rp"] == pytest.approx(rp)
        assert torch.equal(s["ym"], enc.text([["red"]] * 30)) and torch.equal(s["yr"], enc.text(refs))
        torch.testing.assert_close(s["z"], (s["zv"] + s["zt"]) / 2)
        assert [x[2] for x in s["examples"]] == [["red"]] * 30
    g = torch.Generator().manual_seed(4)
    parrot2 = Parrot(world.tokenizer, ["blue", "dot"])
    plain = E.scenarios(world, parrot2, enc, objects, *grid, answer_tokens=4)
    shuf = E.scenarios(world, parrot2, enc, objects, *grid, answer_tokens=4, shuffle=g)
    g = torch.Generator().manual_seed(4)
    for key in plain:  # one permutation per scenario, drawn in order from the generator
        assert torch.equal(shuf[key]["ym"], plain[key]["ym"][torch.randperm(30, generator=g)])


def test_measure_and_correlations_by_hand():
    g = torch.Generator().manual_seed(0)
    unit = lambda n: torch.nn.functional.normalize(torch.randn(n, 4, generator=g), dim=1)
    scen = {k: {"z": unit(50), "zv": unit(50), "zt": unit(50), "ym": unit(50), "yr": unit(50), "rp": rp,
                "examples": []} for k, rp in (("id", 1.0), ("a", 0.5), ("b", 0.2))}
    X, Y = E.club_pairs(scen)
    assert torch.equal(X[:100], torch.cat([scen["id"]["z"]] * 2)) and torch.equal(Y[250:], scen["b"]["ym"])
    club = E.fit_club(X, Y, hidden=16, steps=20, quiet=True)
    grid = E.measure(scen, club)
    ID = scen["id"]
    for k, s in scen.items():
        assert s["emi"] == E.emi(club, s["z"], s["ym"], s["yr"]) == grid[k]["emi"]
        assert s["jsd"] == (E.jsd_cov(ID["zv"], s["zv"]), E.jsd_cov(ID["zt"], s["zt"]), E.jsd_cov(ID["ym"], ID["yr"]),
                            E.jsd_cov(s["ym"], s["yr"])) == grid[k]["jsd"]
    # EMID and the bound, with hand-set EMIs and JSDs
    for k, e, jsd in (("id", 0.0, (0, 0, 0.0016, 0.0016)), ("a", -0.2, (0.04, 0.09, 0.0016, 0.0625)),
                      ("b", -0.5, (0.16, 0.25, 0.0016, 0.0625))):
        scen[k].update(emi=e, jsd=jsd)
    c = E.correlations(scen)
    torch.testing.assert_close(c["emid"], torch.tensor([0.2, 0.5]))
    torch.testing.assert_close(c["bound"], torch.tensor([0.2 + 0.3 + 0.2 + 0.5, 0.4 + 0.5 + 0.2 + 0.5]))
    assert c["spearman_emi_rp"][0] == pytest.approx(1.0)  # EMI and RP fall together
    assert c["pearson_emid_bound"][0] == pytest.approx(1.0) and c["spearman_emid_bound"][0] == pytest.approx(1.0)
    # the split: the ID-output term is the same for every shift (no correlation), the others rise with EMID
    assert math.isnan(c["terms"]["ID outputs JSD^¼"][0])
    assert c["terms"]["inputs"][0] == pytest.approx(1.0) and c["terms"]["visual √JSD"][0] == pytest.approx(1.0)
    sims = [E.answer_similarity(s["ym"], s["yr"]) for s in scen.values()]
    torch.testing.assert_close(c["similarity"], torch.tensor(sims))
    assert c["spearman_similarity_rp"][0] == pytest.approx(E.spearman(torch.tensor(sims),
                                                                      torch.tensor([1.0, 0.5, 0.2]))[0])
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert E.shuffled_emi(club, ID, g1) == E.emi(club, ID["z"], ID["ym"][torch.randperm(50, generator=g2)], ID["yr"])


def test_term_correlations_against_a_least_squares_reference():
    """EMID built from the terms: the input part alone, the OOD-output term alone and the partial
    correlation (inputs given the OOD-output term) against residuals from torch's least squares."""
    g = torch.Generator().manual_seed(0)
    terms = torch.rand(34, 4, generator=g, dtype=torch.float64)
    terms[:, 2] = 0.3  # the ID-output term: one value for every shift
    noise = torch.randn(34, generator=g, dtype=torch.float64)
    gap = terms[:, 0] + terms[:, 1] + 2 * terms[:, 3] + 0.1 * noise
    out = E.term_correlations(terms, gap)
    assert set(out) == {"visual √JSD", "text √JSD", "ID outputs JSD^¼", "OOD outputs JSD^¼", "inputs", "outputs",
                        "inputs | OOD outputs (partial)"}
    assert math.isnan(out["ID outputs JSD^¼"][0]) and math.isnan(out["ID outputs JSD^¼"][1])
    for name, col in (("visual √JSD", terms[:, 0]), ("inputs", terms[:, 0] + terms[:, 1]),
                      ("outputs", terms[:, 2] + terms[:, 3])):
        assert out[name][0] == pytest.approx(torch.corrcoef(torch.stack([col, gap]))[0, 1].item())

    def resid(y, x):  # independent reference: least squares with an intercept
        X = torch.stack([torch.ones(34, dtype=torch.float64), x], 1)
        return y - X @ torch.linalg.lstsq(X, y[:, None]).solution[:, 0]

    ri, rg = resid(terms[:, 0] + terms[:, 1], terms[:, 3]), resid(gap, terms[:, 3])
    want = torch.corrcoef(torch.stack([ri, rg]))[0, 1].item()
    assert out["inputs | OOD outputs (partial)"][0] == pytest.approx(want) and want > 0.5
    # EMID made of the OOD-output term alone: the inputs say nothing beyond it
    only_qy = E.term_correlations(terms, terms[:, 3] + 0.01 * noise)
    assert only_qy["OOD outputs JSD^¼"][0] > 0.99 and abs(only_qy["inputs | OOD outputs (partial)"][0]) < 0.4


def test_answer_similarity_by_hand():
    ym = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
    yr = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    assert E.answer_similarity(ym, yr) == pytest.approx((1.0 + 0.0 + 0.8) / 3)
    assert E.answer_similarity(yr, yr) == pytest.approx(1.0)


def test_unrelated_errors_fall_back_on_one_answer():
    answers = [[f"w{i}"] for i in range(20)]
    assert E.unrelated_errors(answers, 0.0, torch.Generator().manual_seed(0)) == answers
    out = E.unrelated_errors(answers, 0.5, torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(1)  # the same draws by hand: the positions, then the default answer
    hit = set(torch.randperm(20, generator=g)[:10].tolist())
    default = answers[int(torch.randint(20, (), generator=g))]
    assert out == [default if i in hit else answers[i] for i in range(20)]
    assert sum(o == default for o in out) >= 10 and len({str(o) for o in out}) <= 11


class Recorder(Parrot):
    """A Parrot that remembers the images and prompts it was asked about."""

    def __init__(self, tok, words):
        super().__init__(tok, words)
        self.seen = []

    def generate(self, patches, prompt, steps):
        self.seen.append((patches.clone(), prompt.clone()))
        return super().generate(patches, prompt, steps)


def test_scenarios_carry_the_shifted_images_and_the_unrelated_errors_control():
    from lab.data.vqa import FrozenEncoders, VisualQA

    world = VisualQA()
    enc = FrozenEncoders(world.tokenizer, seed=0)
    objects = world.sample(12, torch.Generator().manual_seed(0))
    grid = [("clean", 0), ("frost", 5)], [("clean", 0), ("typo", 3)]
    scen = E.scenarios(world, Parrot(world.tokenizer, ["red"]), enc, objects, *grid, answer_tokens=4)
    for (vis, _), s in scen.items():
        assert all(len(ex) == 4 for ex in s["examples"])
        torch.testing.assert_close(torch.stack([ex[3] for ex in s["examples"]]),
                                   world.shift_image(objects["image"], *vis))
    # control: the model sees only the clean queries, whatever the scenario's shift
    rec = Recorder(world.tokenizer, ["red"])
    E.scenarios(world, rec, enc, objects, *grid, answer_tokens=4, errors=torch.Generator().manual_seed(2))
    clean = world.encode(objects, generator=torch.Generator().manual_seed(7))
    assert len(rec.seen) == 4 and all(torch.equal(p, clean["patches"]) and torch.equal(q, clean["prompt"])
                                      for p, q in rec.seen)

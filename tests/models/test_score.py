import torch

from lab.models import tiny_llama, word_tokenizer
from lab.models.score import choice_accuracy, choice_logprobs


def naive(model, tok, prompt, choice):
    ids = tok(f"{prompt} {choice}", add_special_tokens=False)["input_ids"]
    n_p = len(tok(prompt, add_special_tokens=False)["input_ids"])
    logp = model(input_ids=torch.tensor([ids])).logits[0].log_softmax(-1)
    return sum(logp[t - 1, ids[t]].item() for t in range(n_p, len(ids)))


def test_single_and_multi_token_choices_match_a_naive_loop():
    torch.manual_seed(0)
    tok = word_tokenizer(["a", "b", "c", "d"])
    m = tiny_llama(vocab_size=len(tok), d_model=16, n_layers=1, n_heads=2).eval()
    prompts = ["a b", "c", "d d a"]  # different lengths: batched by length
    for choices in (["a", "b", "c"], ["a b", "c", "d d d"]):
        got = choice_logprobs(m, tok, prompts, choices, batch_size=2)
        assert got.shape == (3, len(choices))
        with torch.no_grad():
            want = torch.tensor([[naive(m, tok, p, c) for c in choices] for p in prompts])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_choice_accuracy_shared_and_per_example_choices():
    tok = word_tokenizer(["a", "b", "c", "x"])
    torch.manual_seed(0)
    m = tiny_llama(vocab_size=len(tok), d_model=16, n_layers=1, n_heads=2).eval()
    ex = [{"prompt": "x a", "answer": "b"}, {"prompt": "x b", "answer": "c"}, {"prompt": "x c", "answer": "a"}]
    logp = choice_logprobs(m, tok, [e["prompt"] for e in ex], ["a", "b", "c"])
    want = sum(["abc"[i] == e["answer"] for i, e in zip(logp.argmax(1).tolist(), ex)]) / 3
    assert choice_accuracy(m, tok, ex, ["a", "b", "c"]) == want
    assert choice_accuracy(m, tok, [{**e, "choices": ["a", "b", "c"]} for e in ex]) == want

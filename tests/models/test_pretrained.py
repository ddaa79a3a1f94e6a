import pytest
import torch

from lab.core import validate
from lab.data import KVRecall
from lab.models import ModelNotAvailable, load_model, tiny_llama


def test_save_then_load_by_path(tmp_path):
    task = KVRecall(n_pairs=2, n_keys=4, n_values=4)
    torch.manual_seed(0)
    m = tiny_llama(vocab_size=len(task.tokenizer), d_model=16, n_layers=1, n_heads=2)
    m.save_pretrained(tmp_path)
    task.tokenizer.save_pretrained(tmp_path)
    assert validate(model=str(tmp_path)).model == str(tmp_path)  # the notebook parameter accepts it
    loaded, tok = load_model(str(tmp_path))
    x = torch.tensor([tok("k0 v1 k2 v3 ? k0")["input_ids"]])
    torch.testing.assert_close(loaded(input_ids=x).logits, m.eval()(input_ids=x).logits)
    assert loaded.config._attn_implementation == "eager" and not loaded.training


def test_offline_hub_id_says_so(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotAvailable, match="not a local folder.*HF_HUB_OFFLINE=1"):
        load_model("no-such-org/no-such-model-xyz")


def test_folder_without_model(tmp_path):
    with pytest.raises(ModelNotAvailable, match="holds no loadable model"):
        load_model(str(tmp_path))


def test_placement_on_cuda_spreads_unless_launched_distributed():
    from lab.models.pretrained import placement

    assert placement("cpu", {"WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == {}
    assert placement("cuda", {}) == {"device_map": "auto"}
    assert placement("cuda", {"WORLD_SIZE": "1"}) == {"device_map": "auto"}
    # accelerate launch / torchrun: one whole model per process, on the process's own GPU
    assert placement("cuda", {"WORLD_SIZE": "4", "LOCAL_RANK": "3"}) == {"device_map": {"": 3}}

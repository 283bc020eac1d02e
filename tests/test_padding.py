"""Left-padded batches (make_cache(..., padded=True)): every row generates what its prompt generates alone."""

import pytest
import torch

from qevict_core import QEvictConfig, make_cache
from qevict_core.registry import METHODS
from tests.conftest import KV, random_prompt, tiny_model

NEW = 40


def left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(p.shape[1] for p in prompts)
    ids = torch.zeros(len(prompts), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, length - prompt.shape[1]:] = prompt[0]
        mask[row, length - prompt.shape[1]:] = 1
    return ids, mask


def generate(model, ids, cache, new: int = NEW, **kwargs) -> list[list[int]]:
    out = model.generate(ids, **{KV: cache}, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kwargs)
    return out[:, ids.shape[1]:].tolist()


# one method per way of keeping tokens in the fast suite, every method under -m slow
FAST = {"fullkv", "qevict", "qevict_head", "snapkv", "adakv", "kivi2"}


@pytest.mark.parametrize("method", [m if m in FAST else pytest.param(m, marks=pytest.mark.slow) for m in sorted(METHODS)])
def test_each_row_of_a_padded_batch_generates_what_it_generates_alone(method):
    model = tiny_model("llama", 2)
    prompts = [random_prompt(n, seed=n) for n in (300, 420, 361)]
    config = QEvictConfig(budget=0.25)
    alone = [generate(model, p, make_cache(method, model, config, max_length=p.shape[1] + NEW))[0] for p in prompts]
    ids, mask = left_padded(prompts)
    cache = make_cache(method, model, config, max_length=ids.shape[1] + NEW, batch_size=3, padded=True)
    assert generate(model, ids, cache, attention_mask=mask) == alone
    report = cache.memory_report()
    assert report["total_bytes"] == sum(r["total_bytes"] for r in report["rows"])
    assert report["seen"] == ids.shape[1] + NEW - 1
    if report["budget_bytes"] is not None:  # each row at its own length's budget, as alone
        assert report["total_bytes"] <= report["budget_bytes"]
        assert report["budget_bytes"] == sum(make_cache(method, model, config, p.shape[1] + NEW).budget_bytes
                                             for p in prompts)


def test_an_unpadded_batch_through_rows_equals_the_batched_cache():
    model = tiny_model("qwen2", 2)
    ids = torch.cat([random_prompt(300, seed=1), random_prompt(300, seed=2)])
    config = QEvictConfig(budget=0.2)
    batched = generate(model, ids, make_cache("qevict", model, config, max_length=300 + NEW, batch_size=2))
    rows = make_cache("qevict", model, config, max_length=300 + NEW, batch_size=2, padded=True)
    assert generate(model, ids, rows, attention_mask=torch.ones_like(ids)) == batched
    assert rows.summary()["evictions"] == sum(r["evictions"] for r in rows.summary()["rows"]) > 0


def test_right_padding_and_an_empty_row_are_refused_with_the_fix():
    model = tiny_model("llama", 2)
    ids = torch.cat([random_prompt(60, seed=1), random_prompt(60, seed=2)])
    right = torch.ones_like(ids)
    right[1, -10:] = 0
    cache = make_cache("qevict", model, QEvictConfig(budget=1.0), max_length=70, batch_size=2, padded=True)
    with pytest.raises(ValueError, match="padding_side='left'"):
        model.generate(ids, attention_mask=right, **{KV: cache}, max_new_tokens=3, do_sample=False)
    empty = torch.ones_like(ids)
    empty[0] = 0
    cache = make_cache("qevict", model, QEvictConfig(budget=1.0), max_length=70, batch_size=2, padded=True)
    with pytest.raises(ValueError, match=r"rows \[0\] are all padding"):
        model.generate(ids, attention_mask=empty, **{KV: cache}, max_new_tokens=3, do_sample=False)


def test_a_padded_batch_of_real_prompts_on_smollm2(smollm2):
    """Real prompts of different lengths through the tokenizer's own left padding."""
    from tests.test_smollm2 import passage_prompt

    model, tok = smollm2
    prompts = [passage_prompt(tok, 520), passage_prompt(tok, 330)]
    config = QEvictConfig(budget=0.2)
    alone = [generate(model, p, make_cache("qevict", model, config, max_length=p.shape[1] + 24), 24)[0]
             for p in prompts]  # 24 steps: three routing events after the prompt's
    texts = [tok.decode(p[0]) for p in prompts]
    batch = tok(texts, padding=True, padding_side="left", return_tensors="pt", add_special_tokens=False)
    assert batch.input_ids[1, 0] == tok.pad_token_id and batch.attention_mask[1].sum() == prompts[1].shape[1]
    cache = make_cache("qevict", model, config, max_length=batch.input_ids.shape[1] + 24, batch_size=2, padded=True)
    assert generate(model, batch.input_ids, cache, 24, attention_mask=batch.attention_mask) == alone
    assert cache.summary()["evictions"] > 0

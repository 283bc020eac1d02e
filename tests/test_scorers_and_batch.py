"""Alternative ranking functions (Appendix J) and per-row routing in a batch."""

import pytest
import torch

from qevict_core import QEvictConfig, make_cache
from tests.conftest import KV, random_prompt, tiny_model

NEW = 48


def decode(model, prompt, cache, steps=NEW):
    tokens = []
    with torch.inference_mode():
        logits = model(prompt, **{KV: cache}).logits[:, -1]
        for _ in range(steps):
            nxt = logits.argmax(-1, keepdim=True)
            tokens.append(nxt)
            logits = model(nxt, **{KV: cache}).logits[:, -1]
    return torch.cat(tokens, dim=1)


@pytest.mark.parametrize("scorer", ["cumulative", "decay", "pnorm", "keynorm"])
def test_every_scorer_routes_within_budget(scorer):
    model = tiny_model("llama", 2)
    cache = make_cache("qevict", model, QEvictConfig(budget=0.2, scorer=scorer, coverage=None, pool=0),
                       max_length=1000 + NEW)
    decode(model, random_prompt(1000), cache, steps=NEW - 3)  # not a multiple of Ω: queries stay buffered
    report = cache.memory_report()
    assert report["total_bytes"] <= cache.budget_bytes
    tiers = cache.tier_counts()[1]
    assert tiers["full"] and tiers["quantized"] and tiers["evicted"]
    # Nothing of the queries persists: one float32 table of window scores per layer, two for pnorm (Eq. 23 raises
    # each interval's mass to p, so that mass stays apart until the event).
    tables = 2 if scorer == "pnorm" else 1
    windows = cache.plan.num_windows
    assert report["components"]["scores"] == tables * len(cache.layers) * windows * 4
    assert "query_buffer" not in report["components"]


def test_scorers_rank_differently():
    model = tiny_model("llama", 2)
    chosen = {}
    for scorer in ["cumulative", "keynorm", "pnorm"]:
        cache = make_cache("qevict", model, QEvictConfig(budget=0.2, scorer=scorer, coverage=None, pool=0),
                           max_length=1000 + NEW)
        decode(model, random_prompt(1000), cache)
        chosen[scorer] = cache.layers[0].full_ids[0].tolist()
    assert chosen["keynorm"] != chosen["cumulative"]
    assert chosen["pnorm"] != chosen["keynorm"]


def test_batch_rows_are_routed_independently():
    """Each row of a batch gets exactly the tokens it gets alone: scores and tiers are per sequence."""
    model = tiny_model("mistral", 2)
    prompts = torch.cat([random_prompt(800, seed=3), random_prompt(800, seed=4)])
    # keynorm ranks by key content, so two different prompts keep different windows.
    config = QEvictConfig(budget=0.15, recent=16, sinks=4, scorer="keynorm", pool=0, coverage=None)
    batch_cache = make_cache("qevict", model, config, max_length=800 + NEW, batch_size=2)
    together = decode(model, prompts, batch_cache)
    for row in range(2):
        alone = decode(model, prompts[row:row + 1], make_cache("qevict", model, config, max_length=800 + NEW))
        assert torch.equal(together[row], alone[0])
    layer = batch_cache.layers[1]
    live = [set(layer.full_ids[r].tolist()) | set(layer.quant.ids[r].tolist()) for r in range(2)]
    assert live[0] != live[1], "both rows kept the same windows: the test would not see shared routing"
    assert batch_cache.memory_report()["total_bytes"] <= batch_cache.budget_bytes


def test_batch_size_mismatch_is_reported():
    model = tiny_model("llama", 2)
    cache = make_cache("qevict", model, QEvictConfig(budget=0.5), max_length=300)
    with pytest.raises(ValueError, match="batch size 1, got 2"):
        model(torch.zeros(2, 10, dtype=torch.long), **{KV: cache})


@pytest.mark.parametrize("method", ["qevict", "fullkv", "snapkv", "kivi2"])
def test_a_padded_batch_is_refused_not_attended_to(method):
    """A batched cache keeps one window grid for all rows: padding must not silently become context, and the
    error says how to run a padded batch (tests/test_padding.py)."""
    model = tiny_model("llama", 2)
    ids = random_prompt(200).repeat(2, 1)
    padded = torch.ones_like(ids)
    padded[1, :30] = 0
    cache = make_cache(method, model, QEvictConfig(budget=0.5), max_length=210, batch_size=2)
    with pytest.raises(ValueError, match=r"rows \[1\] of this batch have padding.*padded=True"):
        model.generate(ids, attention_mask=padded, **{KV: cache}, max_new_tokens=3, do_sample=False)
    # The same batch without padding runs, and both rows of identical prompts decode identically.
    cache = make_cache(method, model, QEvictConfig(budget=0.5), max_length=210, batch_size=2)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **{KV: cache}, max_new_tokens=8, do_sample=False)
    assert torch.equal(out[0], out[1])


def test_pooling_ranks_a_window_by_its_neighbourhood_its_own_score_first():
    """Hand-built table: windows 2 and 6 peak; with r = 1 each peak's neighbours rank just below it (above the
    lower peak too) and above every window far from a peak, whose order stays the table's."""
    from qevict_core.engine.scorers import make_scorer
    table = torch.tensor([[0.1, 0.0, 5.0, 0.2, 0.3, 0.0, 3.0, 0.05]])
    both = dict(pool_weight=1.0, pool_direction="both")
    plain = make_scorer(QEvictConfig(pool=0)).rank(table)
    assert torch.equal(plain, table)
    pooled = make_scorer(QEvictConfig(pool=1, **both)).rank(table)
    order = pooled[0].argsort(descending=True, stable=True).tolist()
    assert order == [2, 1, 3, 6, 5, 7, 4, 0]  # a peak before the neighbours that borrow its score; 4, 0: their own
    assert pooled[0, 1] < table[0, 2] and pooled[0, 1] == pytest.approx(5.0 * (1 - 1e-3))
    # r = 2 reaches two windows out; pooling never lowers a window's own key (pnorm's root included).
    wide = make_scorer(QEvictConfig(pool=2, scorer="pnorm", p=2.0, **both))
    key = wide.rank(table)
    assert torch.all(key >= wide.ranking(table))
    assert key[0, 0] == pytest.approx(5.0 ** 0.5 * (1 - 1e-3))


def test_pool_weight_lets_a_lower_peak_outrank_the_neighbours_of_a_higher_one():
    """The table above with γ = 0.5: a neighbour counts half its peak, so peak 6 (3.0) now ranks above the
    neighbours of peak 2 (2.4975), and a far window (4) above nothing it borrows from."""
    from qevict_core.engine.scorers import make_scorer
    table = torch.tensor([[0.1, 0.0, 5.0, 0.2, 0.3, 0.0, 3.0, 0.05]])
    weighted = make_scorer(QEvictConfig(pool=1, pool_weight=0.5, pool_direction="both")).rank(table)
    assert weighted[0].argsort(descending=True, stable=True).tolist() == [2, 6, 1, 3, 5, 7, 4, 0]
    assert weighted[0, 1] == pytest.approx(5.0 * 0.5 * (1 - 1e-3)) and weighted[0, 4] == table[0, 4]
    assert torch.equal(make_scorer(QEvictConfig(pool=0, pool_weight=0.5)).rank(table), table)  # no pooling: γ unread


def test_forward_pooling_lends_a_score_to_the_windows_after_it_only():
    """pool_direction="forward": window 3 continues peak 2 and ranks just below it; window 1, before it, keeps its own
    score (as does window 5 before peak 6, while 7 after it borrows)."""
    from qevict_core.engine.scorers import make_scorer
    table = torch.tensor([[0.1, 0.0, 5.0, 0.2, 0.3, 0.0, 3.0, 0.05]])
    key = make_scorer(QEvictConfig(pool=1, pool_direction="forward", pool_weight=1.0)).rank(table)
    assert key[0, 3] == pytest.approx(5.0 * (1 - 1e-3)) and key[0, 7] == pytest.approx(3.0 * (1 - 1e-3))
    assert key[0, 1] == pytest.approx(0.1 * (1 - 1e-3)) and key[0, 5] == pytest.approx(0.3 * (1 - 1e-3))
    assert key[0, 0] == table[0, 0] and key[0, 2] == table[0, 2] and key[0, 6] == table[0, 6]
    two = make_scorer(QEvictConfig(pool=2, pool_direction="forward", pool_weight=1.0)).rank(table)
    assert two[0, 4] == pytest.approx(5.0 * (1 - 1e-3)) and two[0, 1] == pytest.approx(0.1 * (1 - 1e-3))




def test_what_the_scorer_files_declare_is_what_their_classes_do():
    """config.py reads each scorer file without importing it (scorer_files.py): whether it needs attention and its
    own settings, which are fields of its class with the same defaults, and fields of the config."""
    from dataclasses import fields

    from qevict_core.config import SCORER_FILES
    from qevict_core.engine.scorers import SCORERS, Scorer

    assert set(SCORER_FILES) == set(SCORERS)
    base = {f.name for f in fields(Scorer)}
    for name, declared in SCORER_FILES.items():
        cls = SCORERS[name]
        assert declared.needs_attention == cls.needs_attention, name
        own = {f.name: f.default for f in fields(cls) if f.name not in base}
        assert own == {k: spec["default"] for k, spec in declared.parameters.items()}, name
        assert set(own) <= set(QEvictConfig.knobs("scorer"))
    assert QEvictConfig.knobs("scorer")["decay"].help.endswith("(decay scorer)")


def test_a_new_scorer_s_setting_is_read_from_its_file_and_a_clash_is_refused(tmp_path):
    from qevict_core.scorer_files import scorer_files

    (tmp_path / "sharp.py").write_text(
        'PARAMETERS = {"sharpness": {"default": 2, "help": "how sharp", "kind": "int", "low": 1}}\n\n\n'
        "class SharpScorer:\n    name = 'sharp'\n    needs_attention = False\n")
    (tmp_path / "plain.py").write_text("class PlainScorer:\n    name = 'plain'\n")
    found = scorer_files(tmp_path)
    assert list(found) == ["plain", "sharp"] and found["plain"].needs_attention and not found["plain"].parameters
    assert found["sharp"].parameters == {"sharpness": {"default": 2, "help": "how sharp", "kind": "int", "low": 1}}
    assert found["sharp"].needs_attention is False
    (tmp_path / "twin.py").write_text('PARAMETERS = {"sharpness": {"default": 1, "help": "h", "kind": "int"}}\n')
    with pytest.raises(TypeError, match="both declare a setting 'sharpness'"):
        scorer_files(tmp_path)
    (tmp_path / "twin.py").write_text('PARAMETERS = {"width": {"default": 1, "kind": "int"}}\n')
    with pytest.raises(TypeError, match=r"PARAMETERS\['width'\] needs default, help and kind"):
        scorer_files(tmp_path)

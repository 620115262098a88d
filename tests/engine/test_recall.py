"""Recall: what the bounded cache evicts goes to a bounded host tier (a float32 model's keys and
values rounded to bfloat16, any other's bit for bit), and a question borrows it back for its
answer only."""

import numpy as np
import pytest
import torch

from engine import Session, SessionConfig, host_page_bytes, load_model
from engine.host_tier import HostTier, Tokens
from engine.page_scoring import SCORED_LAYERS, Cached

BUDGET = 160
FRAME_TOKENS = 23  # tiny-random-llava: 16 visual tokens, "[1.0s]" and "\n"


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-random-llava", "cpu")


def frames(count: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (64, 96, 3), dtype=np.uint8) for _ in range(count)]


def config(**changes) -> SessionConfig:
    return SessionConfig(**{"policy": "infmllm", "budget_tokens": BUDGET, "recall": True, **changes})


def watched(model, count: int, **changes) -> Session:
    session = Session(model, config(**changes))
    session.append_frames(frames(count), [float(t) for t in range(count)])
    return session


def test_the_stream_runs_exactly_as_without_recall(model):
    """The tier only receives: scores, the device cache and its bound are the same."""
    plain, recalling = Session(model, config(recall=False)), Session(model, config())
    for start in range(0, 24, 4):
        times = [float(t) for t in range(start, start + 4)]
        assert plain.append_frames(frames(4, start), times) == recalling.append_frames(frames(4, start), times)
    assert recalling.stats().evictions > 3
    assert recalling.stats().cache_tokens == plain.stats().cache_tokens == BUDGET
    for mine, theirs in zip(recalling.cache.hf.layers, plain.cache.hf.layers, strict=True):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


def kept(tensor: torch.Tensor) -> torch.Tensor:
    """float32 keys or values as a host page keeps them: rounded to bfloat16."""
    return tensor.to(torch.bfloat16)


def test_what_the_cache_evicts_reaches_the_host_tier_rounded_to_bfloat16(model):
    session = Session(model, config())
    cache, seen = session.cache, {}
    evict = cache.evict

    def remember_then_evict() -> None:  # every token's keys and values as they were cached
        for layer, cached in enumerate(cache.hf.layers):
            for head in range(cache.kv_heads):
                for index, place in enumerate(cache.order[layer][head].tolist()):
                    seen[layer, head, place] = (cached.keys[0, head, index].clone(), cached.values[0, head, index].clone())
        evict()

    cache.evict = remember_then_evict
    session.append_frames(frames(20), [float(t) for t in range(20)])
    host = cache.host
    assert host.tokens == session.stats().evicted_tokens == session.stats().tokens_seen - BUDGET
    checked = 0
    for layer in range(cache.num_layers):
        for head in range(cache.kv_heads):
            held = host.contents(layer, head)
            assert held.count == host.tokens
            for index, place in enumerate(held.order[0, 0].tolist()):
                keys, values = seen[layer, head, place]
                assert torch.equal(held.keys[0, 0, index], kept(keys))
                assert torch.equal(held.values[0, 0, index], kept(values))
                checked += 1
    assert checked == host.tokens * cache.num_layers * cache.kv_heads


def test_borrowing_everything_evicted_answers_exactly_as_the_full_cache(model):
    """With room for all of the host tier, the question sees every token, in stream order, at
    the positions the full cache gives them: the same answer, token for token."""
    full = Session(model, SessionConfig(policy="full", evidence_top_k=16))
    full.append_frames(frames(16), [float(t) for t in range(16)])
    recalling = watched(model, 16, retrieval_tokens=4096, evidence_top_k=16)
    assert recalling.stats().host_tokens == full.stats().cache_tokens - BUDGET
    expected = full.ask("What was first?", max_new_tokens=12)
    answer = recalling.ask("What was first?", max_new_tokens=12)
    assert "".join(answer) == "".join(expected)
    # (evidence is not compared: its baseline is partly read when the last frames came, when
    # the bounded cache held fewer seconds than the question borrows; engine/evidence.py)
    assert answer.recalled_s == list(range(16))[: len(answer.recalled_s)] and len(answer.recalled_s) >= 8


def test_after_the_answer_the_device_cache_holds_what_it_would_without_recall(model):
    session = watched(model, 16, retrieval_tokens=64)
    before = session.stats()
    answer = session.ask("What was first?", max_new_tokens=6)
    assert len(list(answer)) >= 1
    after = session.stats()
    assert after.cache_tokens == BUDGET  # borrowed tokens went back; the turn was evicted as usual
    assert after.retrievals == 1 and after.retrieved_tokens == 64
    assert after.retrieval_ms > 0
    assert not session.cache.loan.borrowed
    assert after.host_tokens >= before.host_tokens  # what was borrowed is still there
    for head in range(session.cache.kv_heads):  # nothing is both on the device and in the tier
        kept = set(session.cache.order[0][head].tolist())
        assert not kept & set(session.cache.host.contents(0, head).order[0, 0].tolist())


def test_a_float32_session_keeps_eight_times_its_budget_in_bfloat16_host_pages_and_still_recalls(model):
    """Half the bytes a token of float32: the default tier holds 8 times the budget in the host
    memory 4 times took before; a question borrows its pages back in float32."""
    session = watched(model, 40)  # 1,099 tokens (40 frames of 23 and the opening) in a 160-token budget
    assert model.dtype == torch.float32 and session.config.host_tokens == 8 * BUDGET == 1280
    host = session.cache.host
    assert host.keys.dtype == host.values.dtype == torch.bfloat16
    # every token evicted is held: 939 in a tier of 1,280 (4 times the budget, 640, would have let some go)
    assert session.stats().host_tokens == session.stats().evicted_tokens == 939
    # 2 layers x 2 KV heads x (2 x 16 bfloat16 keys and values + kind, time, held: 6) = 280 bytes a
    # place (536 in float32), 32 places a page
    assert host_page_bytes(2, 2, 16, 32, torch.float32) == 8_960
    assert session.stats().host_bytes == len(host.pages) * 8_960 == 30 * 8_960
    answer = session.ask("What was first?", max_new_tokens=6)
    assert len(list(answer)) >= 1 and session.stats().retrieved_tokens == BUDGET // 2
    assert session.cache.hf.layers[0].keys.dtype == torch.float32


def test_the_host_tier_stays_within_its_budget_over_a_long_stream(model):
    session = Session(model, config(host_budget_tokens=256, page_tokens=32))
    sizes = []
    for start in range(0, 80, 8):
        session.append_frames(frames(8, start), [float(t) for t in range(start, start + 8)])
        stats = session.stats()
        assert stats.host_tokens <= 256
        sizes.append(stats.host_bytes)
    assert session.cache.host.dropped_pages > 20
    assert max(sizes[-4:]) <= 1.05 * min(sizes[-4:])  # flat once full
    assert session.stats().cache_tokens == BUDGET


def tokens(start: int, count: int, heads: int = 1, dim: int = 16) -> Tokens:
    """Tokens at stream places start..start + count of one layer, with random keys."""
    order = torch.arange(start, start + count).expand(1, heads, count).clone()
    keys = torch.randn(1, heads, count, dim)
    return Tokens(keys, keys.clone(), torch.zeros(1, heads, count, dtype=torch.int8), order.float(), order)


def eight_pages() -> tuple[HostTier, Tokens]:
    """An empty host tier of 8 pages of 8 tokens, and 64 tokens of one layer to fill it (2 KV
    heads, random keys drawn from seed 0)."""
    torch.manual_seed(0)
    return HostTier(budget_tokens=8 * 8, page_tokens=8, page_keys=2), tokens(0, 64, heads=2, dim=16)


def test_a_full_tier_lets_a_page_that_another_repeats_go_first_not_the_oldest():
    tier, stream = eight_pages()  # pages 0..7, the budget
    stream.keys[:, :, 56:64] = stream.keys[:, :, 24:32] + 0.01 * torch.randn(1, 2, 8, 16)  # page 7 repeats page 3
    tier.add(stream)
    novelty = tier.novelty()
    assert novelty[[3, 7]].max() < 0.01 < 0.2 < novelty[[0, 1, 2, 4, 5, 6]].min()
    tier.add(tokens(64, 8, heads=2))  # page 8: the least novel eighth (one page) leaves
    assert tier.pages == [0, 1, 2, 4, 5, 6, 7, 8] and tier.dropped_pages == 1  # page 7 is of the newest quarter


def test_a_page_a_question_borrowed_from_stays_however_common():
    tier, stream = eight_pages()
    stream.keys[:, :, 56:64] = stream.keys[:, :, 24:32] + 0.05 * torch.randn(1, 2, 8, 16)  # page 7 repeats page 3
    tier.add(stream)
    assert asked(tier, 0, stream.keys[0, :, 56:60], count=8).pages == [7]
    tier.add(tokens(64, 8, heads=2))  # page 8: one of the least novel pages (3 and 7) leaves, not the one borrowed from
    assert 7 in tier.pages and 3 not in tier.pages and tier.dropped_pages == 1


def test_under_the_oldest_rule_pages_leave_least_recently_used_first_and_late_tokens_of_a_dropped_page_with_them():
    tier = HostTier(budget_tokens=4 * 8, page_tokens=8, page_keys=2, drop="oldest")
    torch.manual_seed(0)
    tier.add(tokens(0, 32))  # pages 0..3, the budget
    assert tier.pages == [0, 1, 2, 3]
    assert asked(tier, 0, tier.contents(0, 0).keys[0, :, 0:4], count=8).pages == [0]  # a question needs page 0
    tier.add(tokens(32, 16))
    assert tier.pages == [0, 3, 4, 5]
    assert tier.tokens == 32 and tier.dropped_pages == 2
    tier.add(tokens(8, 8))  # late tokens of page 1, which left
    assert tier.pages == [0, 3, 4, 5] and tier.tokens == 32
    for start in (48, 56, 64, 72):  # with no more questions, page 0 goes in its turn
        tier.add(tokens(start, 8))
    assert tier.pages == [6, 7, 8, 9] and tier.dropped_pages == 6


@pytest.mark.parametrize("drop", ["novel", "oldest"])
def test_a_tier_that_every_question_borrowed_from_still_takes_new_pages(drop):
    tier = HostTier(budget_tokens=4 * 8, page_tokens=8, page_keys=2, drop=drop)
    tier.add(tokens(0, 32))
    for start in range(0, 32, 8):
        asked(tier, 0, tier.contents(0, 0).keys[0, :, start : start + 4], count=32)
    tier.add(tokens(32, 8))
    assert tier.pages[-1] == 4 and len(tier.pages) == 4


def test_a_page_is_a_span_of_the_stream_whatever_order_its_tokens_leave_in():
    """A head's tokens of one span leave at different evictions; they meet in one page, and a
    question that matches it gets back every token that head lost of the span, in stream order."""
    tier, every = eight_pages()
    odd, even = (torch.arange(64) % 2 == 1), (torch.arange(64) % 2 == 0)
    for part in (odd, even):  # the odd places leave first, then the even ones
        tier.add(Tokens(*(getattr(every, name)[:, :, part] for name in Tokens.FIELDS)))
    assert tier.pages == list(range(8)) and tier.available() == 64
    got = asked(tier, 0, every.keys[0, :, 40:44] + 0.05 * torch.randn(2, 4, 16), count=8)
    assert got.pages == [5]
    assert got.tokens.order[0].tolist() == [list(range(40, 48))] * 2
    assert got.tokens.keys.dtype == torch.float32  # lent in the model's dtype, as the tier kept them
    assert torch.equal(got.tokens.keys[0], kept(every.keys[0, :, 40:48]).float())
    assert torch.equal(got.tokens.values[0], kept(every.values[0, :, 40:48]).float())


def asked(tier: HostTier, layer: int, keys: torch.Tensor, count: int):
    """A new question, borrowing in one layer."""
    tier.begin_question()
    return tier.retrieve(layer, keys, count)


def test_a_question_brings_back_the_pages_whose_keys_match_its_own():
    """Pages are chosen by the question's keys: the same words told earlier have close keys."""
    tier, every = eight_pages()  # 8 pages of 8 tokens
    tier.add(every)
    question = every.keys[0, :, 44:48] + 0.1 * torch.randn(2, 4, 16)  # near the second half of page 5
    assert asked(tier, 0, question, count=8).pages == [5]
    assert asked(tier, 0, every.keys[0, :, 8:12], count=8).pages == [1]
    more = asked(tier, 0, every.keys[0, :, 8:12], count=12).tokens.order[0]  # then the next best page, in part
    assert set(range(8, 16)) <= set(more[0].tolist()) and more[0].tolist() == sorted(more[0].tolist())
    assert len({place // 8 for place in more[0].tolist()}) == 2
    assert torch.equal(more[0], more[1])  # every head borrows from the same pages


def test_a_word_the_question_shares_with_one_page_outweighs_words_every_other_page_shares_though_keys_share_a_direction():
    """A layer's keys share one large direction, so that uncentred two different words are
    nearly as close as a word to itself (cosine 0.97 to 1.0 in SmolLM2's first layer): the
    question's rare word (told in page 5 alone) then barely stands out, and its common words
    (in every other page) carry the choice away. Keys centred on the pages' mean tell them apart."""
    tier, every = eight_pages()
    words = torch.randn(2, 3, 16)  # the question's words: a rare one, two common ones
    every.keys[0, :, 42] = words[:, 0]  # the rare word, told in page 5 only
    for page in (0, 1, 2, 3, 4, 6, 7):
        every.keys[0, :, 8 * page + 1] = words[:, 1]
        every.keys[0, :, 8 * page + 5] = words[:, 2]
    shared = torch.zeros(16)
    shared[0] = 24.0  # the direction every key of the layer shares
    every.keys += shared
    tier.add(every)
    assert asked(tier, 0, words + shared, count=8).pages == [5]


def test_a_sentence_whose_words_the_device_still_holds_is_found_by_them_and_its_evicted_number_comes_back():
    """A policy that scores per head keeps a fact's words (which its question repeats) and evicts
    its number: the page is scored by the words the device cache holds of its span too, so the
    number comes back. By the evicted tokens alone (the number), another page wins."""
    tier, every = eight_pages()
    left = (torch.arange(64) // 8 != 5) | (torch.arange(64) >= 46)  # of page 5 only places 46 and 47 left the device
    tier.add(Tokens(*(getattr(every, name)[:, :, left] for name in Tokens.FIELDS)))
    words = every.keys[0, :, 40:46]
    device = Cached(words, torch.arange(40, 46).expand(2, 6))  # what the device holds (with the rest of the stream)
    question = torch.cat([words[:, :4] + 0.05 * torch.randn(2, 4, 16), every.keys[0, :, 16:17]], dim=1)  # and like page 2
    alone = asked(tier, 0, question, count=8)
    assert alone.pages == [2]
    tier.begin_question()
    got = tier.retrieve(0, question, 8, device)
    assert got.pages[0] == 5
    for head in range(2):
        assert {46, 47} <= set(got.tokens.order[0, head].tolist())


def test_a_question_about_what_the_device_holds_borrows_what_it_evicted_last_not_pages_like_itself():
    """What was just said is on the device (sliding's window holds it whole): pages that look
    like the question would only draw its answer away from it, so the question borrows the
    newest pages the device let go instead. Asked about what only the tier holds, it borrows
    the page like it, as before."""
    tier, every = eight_pages()
    every.keys[:, :, 16:24] = every.keys[:, :, 56:64] + 0.8 * torch.randn(1, 2, 8, 16)  # page 2 tells of what page 7 tells, in other words
    tier.add(Tokens(*(getattr(every, name)[:, :, :48] for name in Tokens.FIELDS)))  # pages 0-5 left the device
    device = Cached(every.keys[0, :, 48:], torch.arange(48, 64).expand(2, 16))  # pages 6 and 7 are held there
    just_said = every.keys[0, :, 56:60] + 0.05 * torch.randn(2, 4, 16)
    assert asked(tier, 0, just_said, count=16).pages == [2, 3]  # without the device's keys: the page like it
    tier.begin_question()
    assert tier.retrieve(0, just_said, 16, device).pages == [4, 5]
    tier.begin_question()
    assert tier.retrieve(0, every.keys[0, :, 8:12], 8, device).pages == [1]


def test_a_question_about_what_only_the_tier_holds_borrows_it_though_words_of_it_were_just_said():
    """A question shares words with the prose just said (on the device) as well as with the page
    it asks for (in the tier only): the device's best span then draws a few times the tier's best
    page's share (three times here; 1 to 3.4 times on real prose), where a fact the device holds
    whole mostly draws 10 to 35 times. Only a far lead means the question asks what was just
    said: here it borrows the page it asks for, not the pages evicted last."""
    tier, every = eight_pages()
    tier.add(Tokens(*(getattr(every, name)[:, :, :48] for name in Tokens.FIELDS)))  # pages 0-5 left the device
    device = Cached(every.keys[0, :, 48:], torch.arange(48, 64).expand(2, 16))  # pages 6 and 7 are held there
    question = torch.cat([every.keys[0, :, 8:9], every.keys[0, :, 56:59]], dim=1)  # a word of page 1, three of page 7
    tier.begin_question()
    assert tier.retrieve(0, question, 8, device).pages == [1]


def pages_of(retrieval, layer: int) -> set[int]:
    """The pages (of 8 places) that `layer` of a retrieval borrows from, its first layer 0."""
    return set((retrieval.tokens.order[layer] // 8).flatten().tolist())


def test_the_last_scoring_layer_chooses_by_the_scores_of_the_layers_before_it_too():
    """The first layer chooses for the scoring layers; they score the pages all the same, and
    the last of them chooses by every scoring layer's scores."""
    tier = HostTier(budget_tokens=8 * 8, page_tokens=8, page_keys=2)
    torch.manual_seed(0)
    layers = [tokens(0, 64, heads=2, dim=16) for _ in range(SCORED_LAYERS)]
    tier.add(Tokens(*(torch.cat([getattr(layer, name) for layer in layers]) for name in Tokens.FIELDS)))
    tier.begin_question()
    first = tier.retrieve(0, layers[0].keys[0, :, 40:48], count=8)  # the first layer's keys match page 5
    assert first.pages == [5]
    assert [pages_of(first, layer) for layer in range(SCORED_LAYERS - 1)] == [{5}] * (SCORED_LAYERS - 1)
    vague = [layer.keys[0, :, 0:64].mean(dim=1, keepdim=True) for layer in layers]  # like every page a little
    for layer in range(1, SCORED_LAYERS - 1):
        assert tier.retrieve(layer, vague[layer], count=8) is None  # it borrows the first layer's choice
    last = SCORED_LAYERS - 1
    assert tier.retrieve(last, vague[last], count=8).pages == [5]
    assert asked(tier, last, vague[last], count=8).pages != [5]  # alone, it would choose otherwise


def test_the_page_after_a_matched_page_comes_with_it():
    """A statement cut by a page's end goes on in the next page, whose words (the number asked
    for) need not match the question: the next page ranks just below the matched one."""
    tier, every = eight_pages()
    tier.add(every)
    question = torch.cat([every.keys[0, :, 40:44], every.keys[0, :, 16:17]], dim=1)  # page 5 well, page 2 a little
    assert asked(tier, 0, question, count=16).pages == [5, 6]


def test_places_the_pages_a_question_asks_for_leave_go_to_the_pages_evicted_last_not_to_pages_a_little_like_it():
    """A page the question matches in one word of five does not stand out: the places the asked
    page (and the one after it) leave go to the stream evicted last, which the device's newest
    tokens go on from, not to prose that shares a word with the question."""
    tier, every = eight_pages()
    tier.add(every)
    question = torch.cat([every.keys[0, :, 16:20], every.keys[0, :, 40:41]], dim=1)  # page 2 well, page 5 a little
    assert asked(tier, 0, question, count=16).pages == [2, 3]
    assert asked(tier, 0, question, count=32).pages == [2, 3, 6, 7]


def test_a_page_held_on_the_device_in_some_layers_keeps_the_score_of_the_layers_that_hold_it():
    """Layers whose KV heads still hold a page's tokens on the device have nothing of it to score:
    the page is ranked by the layers that have, not pulled down by those that have not."""
    tier = HostTier(budget_tokens=8 * 8, page_tokens=8, page_keys=2)
    torch.manual_seed(0)
    layers = [tokens(0, 64, heads=2, dim=16) for _ in range(5)]
    tier.add(Tokens(*(torch.cat([getattr(layer, name) for layer in layers]) for name in Tokens.FIELDS)))
    slot = tier.slot_of[5]
    for held in (tier.present, tier.held, tier.key_sums):  # layers 1-3 kept page 5 on the device
        held[1:4, :, slot] = 0
    tier.begin_question()
    assert tier.retrieve(0, layers[0].keys[0, :, 40:48], count=8).pages == [5]  # the fact's words, in layer 0
    for layer in (1, 2, 3):  # there, one of the question's words is like one of page 2's
        vague = layers[layer].keys[0, :, 0:64].mean(dim=1, keepdim=True)
        got = tier.retrieve(layer, torch.cat([layers[layer].keys[0, :, 16:17], vague, vague], dim=1), count=8)
    assert 5 not in pages_of(got, 0)  # layer 3 has nothing of page 5 to borrow
    assert pages_of(got, 1) == {5}  # layer 4 borrows it: layers 1-3 did not pull its score down


def test_a_snapshot_keeps_the_host_tier_and_the_next_answer(model):
    session = watched(model, 16, retrieval_tokens=96)
    list(session.ask("And now?", max_new_tokens=4))
    restored = Session.restore(model, session.snapshot())
    assert restored.stats() == session.stats()
    mine, theirs = session.cache.host, restored.cache.host
    assert mine.page_uses() == theirs.page_uses() and mine.pages == theirs.pages
    expected, answer = session.ask("What was first?", max_new_tokens=8), restored.ask("What was first?", max_new_tokens=8)
    assert "".join(answer) == "".join(expected)
    assert answer.recalled_s == expected.recalled_s


def test_a_snapshot_with_its_host_pages_apart_writes_each_page_once_it_changed_and_restores_the_same(model):
    session = watched(model, 24, host_budget_tokens=640)
    saved: dict[int, bytes] = {}
    first = session.changed_host_pages()  # at the first: every page held
    assert sorted(first) == session.host_pages and len(first) >= 10
    assert sum(len(page) for page in first.values()) < 1.5 * len(session.snapshot())  # each page alone, not the tier beneath it
    saved |= first
    session.append_frames(frames(4, seed=1), [float(t) for t in range(24, 28)])  # 92 tokens more, evicted
    second = session.changed_host_pages()
    assert 0 < len(second) <= 5  # the pages those tokens went to (and one a head's eviction reached again)
    saved |= second
    assert session.changed_host_pages() == {}  # nothing changed since
    restored = Session.restore(model, session.snapshot(host_pages=False), read_page=saved.__getitem__)
    whole = Session.restore(model, session.snapshot())
    assert len(session.snapshot(host_pages=False)) < len(session.snapshot()) / 2  # the pages are most of it
    for other in (restored, whole):
        assert other.stats() == session.stats() and other.host_pages == session.host_pages
        for number in session.host_pages:  # keys, values, kinds, times, places held, representatives
            mine, theirs = session.cache.host.page_state(number), other.cache.host.page_state(number)
            assert all(torch.equal(mine[name], theirs[name]) for name in HostTier.SAVED)
    expected = "".join(session.ask("What was first?", max_new_tokens=8))
    assert "".join(restored.ask("What was first?", max_new_tokens=8)) == expected


def test_the_memory_view_tells_device_host_and_dropped_apart(model):
    session = watched(model, 40, host_budget_tokens=320)
    memory = session.memory()
    assert (memory.host_budget_tokens, memory.host_tokens) == (320, session.stats().host_tokens)
    dropped = [span.frame_seen - span.frame_held - span.frame_host for span in memory.spans]
    assert max(dropped) > 8 and dropped[-1] == 0  # the tier is full: some seconds left it, not the latest
    assert memory.spans[-1].frame_held > 0 and any(span.frame_host > 8 for span in memory.spans)
    in_host = sum(span.frame_host + span.text_host for span in memory.spans)
    assert in_host == pytest.approx(memory.host_tokens, abs=1)
    for span in memory.spans:
        assert span.frame_held + span.frame_host <= span.frame_seen + 1e-6


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"policy": "full"}, "recall needs a policy that evicts"),
        ({"host_budget_tokens": 16}, "host_budget_tokens"),
        ({"page_tokens": 30, "page_keys": 4}, "page_tokens"),
        ({"retrieval_tokens": -1}, "retrieval_tokens"),
        ({"host_drop": "newest"}, "host_drop must be one of novel, oldest"),
    ],
)
def test_bad_recall_options_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        config(**changes)


def test_recall_defaults_follow_the_budget():
    chosen = config()
    assert (chosen.host_tokens, chosen.borrowed_tokens) == (8 * BUDGET, BUDGET // 2)
    assert (config(recall=False).host_tokens, config(recall=False).borrowed_tokens) == (0, 0)


def test_a_host_tier_saved_in_pages_of_eviction_order_is_read_by_place():
    """Snapshot format 2 saved pages in the order tokens left, and an open page."""
    torch.manual_seed(0)
    every = tokens(0, 24, heads=2)
    shuffled = torch.randperm(24)
    saved = lambda part: {name: getattr(every, name)[:, :, part] for name in Tokens.FIELDS}  # noqa: E731
    state = {"options": [64, 8, 2], "pages": [{**saved(shuffled[:8]), "number": 0, "hits": 1},
                                               {**saved(shuffled[8:16]), "number": 1, "hits": 0}],
             "open": saved(shuffled[16:]), "counters": [2, 0]}
    tier = HostTier.load(state, torch.device("cpu"))
    assert tier.pages == [0, 1, 2] and tier.tokens == 24
    for head in range(2):
        held = tier.contents(0, head)
        assert held.order[0, 0].tolist() == list(range(24))
        assert torch.equal(held.keys[0, 0], kept(every.keys[0, head])) and torch.equal(held.values[0, 0], kept(every.values[0, head]))


def test_a_host_tier_saved_with_float32_representatives_chooses_the_same_pages():
    """Snapshot format 3 kept the representatives' sums in float32 beside their counts; the
    index is now bfloat16 and reads emptiness from the places held."""
    torch.manual_seed(0)
    tier = HostTier(budget_tokens=8 * 8, page_tokens=8, page_keys=2)
    every = tokens(0, 64, heads=2, dim=16)
    tier.add(every)
    state = tier.state()
    state["key_sums"] = every.keys.view(1, 2, 8, 2, 4, 16).sum(-2)  # what format 3 saved, in float32
    state["key_counts"] = torch.full((1, 2, 8, 2), 4.0)
    older = HostTier.load(state, torch.device("cpu"))
    assert older.key_sums.dtype == torch.bfloat16
    assert torch.allclose(older.key_sums.float(), tier.key_sums.float(), rtol=1e-2, atol=1e-2)
    for question, page in [(every.keys[0, :, 44:48], 5), (every.keys[0, :, 8:12], 1)]:
        assert asked(older, 0, question, count=8).pages == asked(tier, 0, question, count=8).pages == [page]


def test_layers_after_the_scored_ones_borrow_what_the_last_scored_layer_chose():
    """Only the first SCORED_LAYERS layers score the pages: the layers after them borrow the
    pages chosen then, whatever their own keys would match."""
    tier = HostTier(budget_tokens=8 * 8, page_tokens=8, page_keys=2)
    torch.manual_seed(0)
    layers = [tokens(0, 64, heads=2, dim=16) for _ in range(2 * SCORED_LAYERS)]
    tier.add(Tokens(*(torch.cat([getattr(layer, name) for layer in layers]) for name in Tokens.FIELDS)))
    tier.begin_question()
    for layer in range(SCORED_LAYERS):  # one word of page 5 among vague ones
        vague = layers[layer].keys[0, :, 0:64].mean(dim=1, keepdim=True)
        got = tier.retrieve(layer, torch.cat([layers[layer].keys[0, :, 44:45], vague, vague], dim=1), count=8)
        assert (got is None) == (0 < layer < SCORED_LAYERS - 1)
        if got is not None:
            assert got.pages == [5]
    assert got.tokens.order.shape[0] == SCORED_LAYERS + 1  # its own and every layer's after it
    assert all(pages_of(got, at) == {5} for at in range(SCORED_LAYERS + 1))
    for layer in range(SCORED_LAYERS, 2 * SCORED_LAYERS):  # their own keys match page 1, all of them
        assert tier.retrieve(layer, layers[layer].keys[0, :, 8:16], count=8) is None
    last = 2 * SCORED_LAYERS - 1
    assert asked(tier, last, layers[last].keys[0, :, 8:16], count=8).pages == [1]  # as a question's first layer they would

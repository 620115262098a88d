"""The worker's host pool (`engine/host_pool.py`): every host tier of its sessions is a run of
its pages, leased when the session opens and given back when it ends; a tier there holds,
lends and answers exactly as a tier of its own, through eviction, borrowing, snapshot, restore
and takeover, and a full pool refuses a session with recall at once."""

import gc
import sys

import numpy as np
import pytest
import torch

from engine import Session, SessionConfig, load_model
from engine.host_pool import HostPool
from engine.kv_pool import KVPool, PoolFull
from tests.engine.test_kv_pool import resident_bytes

HOST_PAGE_TOKENS = SessionConfig.page_tokens  # 32
TIER_PAGES = 8 * 160 // HOST_PAGE_TOKENS  # a tier's bound is 8 times the budget of 160: 40 pages


@pytest.fixture(scope="module")
def llava():
    return load_model("tiny-random-llava", "cpu")


def _pools(model, host_pages: int, pages: int = 128) -> KVPool:
    shape = (model.num_layers, model.kv_heads, model.head_dim)
    host = HostPool(*shape, host_pages, HOST_PAGE_TOKENS, model.dtype, model.device)
    return KVPool(*shape, pages, 16, model.dtype, model.device, host)


def _config(**options) -> SessionConfig:
    return SessionConfig(**{"policy": "infmllm", "budget_tokens": 160, "peak_tokens": 320, "recall": True,
                            "retrieval_tokens": 48, **options})


def _frames(count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (48, 80, 3), dtype=np.uint8) for _ in range(count)]


def _stream(session: Session, seed: int, seconds: int = 12) -> None:
    for second in range(0, seconds, 3):
        session.append_frames(_frames(3, seed + second), [float(t) for t in range(second, second + 3)])


def _same_tier(a: Session, b: Session) -> None:
    """The same pages held, and in every layer and KV head the same tokens, bit for bit."""
    ta, tb = a.cache.host, b.cache.host
    assert ta.pages == tb.pages and ta.tokens == tb.tokens > 0
    for layer in range(a.cache.num_layers):
        for head in range(a.cache.kv_heads):
            mine, theirs = ta.contents(layer, head), tb.contents(layer, head)
            for name in ("keys", "values", "kinds", "times", "order"):
                assert torch.equal(getattr(mine, name), getattr(theirs, name)), (layer, head, name)


def test_host_tiers_in_one_host_pool_hold_and_answer_as_tiers_of_their_own(llava):
    pool = _pools(llava, host_pages=200)
    host = pool.host
    own = [Session(llava, _config()) for _ in range(2)]
    pooled = [Session(llava, _config(), pool=pool) for _ in range(2)]
    assert host.free_pages == 200 - 2 * TIER_PAGES  # leased at opening, before any eviction
    assert [s.cache.host.run.first_page for s in pooled] == [0, TIER_PAGES]
    for second in range(0, 12, 3):  # the two pooled sessions' evictions interleave in the pool
        for i, session in enumerate(own + pooled):
            session.append_frames(_frames(3, 10 * (i % 2) + second), [float(t) for t in range(second, second + 3)])
    for alone, shared in zip(own, pooled, strict=True):
        _same_tier(alone, shared)
        tier = shared.cache.host
        assert tier.keys.untyped_storage().data_ptr() == host.keys.untyped_storage().data_ptr()  # its pages, no copy
        assert "".join(alone.ask("What came first?", max_new_tokens=8)) == "".join(shared.ask("What came first?", max_new_tokens=8))
        assert alone.cache.loan.retrievals == shared.cache.loan.retrievals == 1
        assert torch.equal(alone.logits, shared.logits)  # after the last token of an answer that borrowed: the same tokens lent
        assert alone.cache.loan.retrieved_tokens == shared.cache.loan.retrieved_tokens == 48
    assert host.free_pages == 200 - 2 * TIER_PAGES  # no page taken while they streamed and asked
    pooled[0].release()
    assert host.free_pages == 200 - TIER_PAGES and pooled[0].cache.host.tokens == 0
    again = Session(llava, _config(), pool=pool)  # first fit: the pages the ended session gave back
    assert again.cache.host.run.first_page == 0 and again.cache.host.tokens == 0  # none of the old session's tokens
    again.release(), pooled[1].release()
    assert host.free_pages == 200 and pool.free_pages == 128


def test_a_full_host_pool_refuses_a_session_with_recall_and_it_takes_nothing(llava):
    pool = _pools(llava, host_pages=2 * TIER_PAGES + 10)
    first, second = Session(llava, _config(), pool=pool), Session(llava, _config(), pool=pool)
    kv_free = pool.free_pages
    assert not pool.host.can_lease(TIER_PAGES * HOST_PAGE_TOKENS)
    with pytest.raises(PoolFull, match=f"no {TIER_PAGES} consecutive free pages .* in the host pool"):
        Session(llava, _config(), pool=pool)
    assert (pool.host.free_pages, pool.free_pages) == (10, kv_free)  # neither its host pages nor its cache's
    without = Session(llava, _config(recall=False), pool=pool)  # a session without recall needs no host pages
    assert pool.host.free_pages == 10 and pool.free_pages == kv_free - 20
    del first
    gc.collect()  # a session collected gives its host pages back too
    assert pool.host.free_pages == 10 + TIER_PAGES
    second.release(), without.release()


def test_a_full_kv_pool_refuses_a_session_and_it_keeps_no_host_pages(llava):
    pool = _pools(llava, host_pages=200, pages=30)
    first = Session(llava, _config(), pool=pool)  # 20 pages of the KV pool's 30
    with pytest.raises(PoolFull, match="in the KV pool"):
        Session(llava, _config(), pool=pool)
    assert pool.host.free_pages == 200 - TIER_PAGES
    first.release()


@pytest.mark.parametrize("pages_apart", [False, True], ids=["whole", "pages apart"])
def test_a_session_restored_in_the_same_or_another_workers_pools_holds_and_answers_the_same(llava, pages_apart):
    """Restore (the same worker, its old tier's pages given back first: a pool with room for one
    tier only) and takeover (another worker's pools)."""
    pool, other = _pools(llava, host_pages=TIER_PAGES + 5), _pools(llava, host_pages=300)
    session = Session(llava, _config(), pool=pool)
    _stream(session, seed=4, seconds=15)
    assert session.cache.host.tokens > 0
    pages = {n: data for n, data in session.changed_host_pages().items()} if pages_apart else {}
    snapshot = session.snapshot(host_pages=not pages_apart)
    read_page = pages.__getitem__ if pages_apart else None
    taken = Session.restore(llava, snapshot, pool=other, read_page=read_page)
    assert other.host.free_pages == 300 - TIER_PAGES and pool.host.free_pages == 5
    _same_tier(session, taken)
    session.release()
    restored = Session.restore(llava, snapshot, pool=pool, read_page=read_page)  # in the pages the session had
    assert pool.host.free_pages == 5
    _same_tier(taken, restored)
    answers = {"".join(s.ask("What came first?", max_new_tokens=8)) for s in (taken, restored)}
    assert len(answers) == 1 and taken.cache.loan.retrieved_tokens == restored.cache.loan.retrieved_tokens == 48
    taken.release(), restored.release()
    assert (pool.host.free_pages, other.host.free_pages) == (TIER_PAGES + 5, 300)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pages are given back on Linux only")
def test_a_host_tier_that_goes_back_gives_its_memory_back_to_the_operating_system(llava):
    shape = (llava.num_layers, llava.kv_heads, llava.head_dim)
    pool = HostPool(*shape, 16384, HOST_PAGE_TOKENS, llava.dtype, llava.device)  # 280 bytes a place: 140 MiB
    assert pool.nbytes == 16384 * HOST_PAGE_TOKENS * 280
    run = pool.lease(16384 * HOST_PAGE_TOKENS)
    for part in (pool.keys, pool.values, pool.kinds, pool.times):
        part.fill_(1)  # resident, whether or not it was before (a long process may reuse memory it had)
    written = resident_bytes()
    run.release()
    assert written - resident_bytes() > 120 * 2**20
    pool.lease(HOST_PAGE_TOKENS)
    assert not pool.present[:, :, 0].any()

"""The worker's KV pool (`engine/kv_pool.py`): sessions lease runs of pages once and give them
back; a session in the pool holds, attends and answers exactly as one with buffers of its own,
alone and together, through eviction, borrowing, give-back, a failed forward and a restore."""

import gc
import sys
from functools import partial

import numpy as np
import pytest
import torch

from engine import Session, SessionConfig, kv_pool, load_model, tiny
from engine.kv_pool import KVPool, Lease, PoolFull
from engine.model import _tiny
from engine.page_scoring import SCORED_LAYERS
from engine.step import Frames, step

PAGE_TOKENS = 16
MIB = 2**20
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pages are given back on Linux only")


def resident_bytes() -> int:
    """This process's anonymous resident memory (RssAnon): what the pools' pages take, and not
    the files mapped, which the kernel may drop at any moment and read again."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))


@pytest.fixture(scope="module")
def llava():
    return load_model("tiny-random-llava", "cpu")


def _pool(model, pages: int) -> KVPool:
    return KVPool(model.num_layers, model.kv_heads, model.head_dim, pages, PAGE_TOKENS, model.dtype, model.device)


def _frames(count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (48, 80, 3), dtype=np.uint8) for _ in range(count)]


def _config(**options) -> SessionConfig:
    return SessionConfig(**{"policy": "infmllm", "budget_tokens": 160, "peak_tokens": 320, **options})


def _stream_and_ask(session: Session, seed: int) -> str:
    for second in range(0, 12, 3):
        session.append_frames(_frames(3, seed + second), [float(t) for t in range(second, second + 3)])
    return "".join(session.ask("What is shown?", max_new_tokens=8))


def _same(a: Session, b: Session, atol: float = 0.0) -> None:
    """The same tokens, keys, values and next-token logits: bit for bit, or (a batched forward
    rounds its last bits differently) within `atol`."""
    assert a.cache.tokens == b.cache.tokens
    for layer in range(a.cache.num_layers):
        assert torch.equal(a.cache.order[layer], b.cache.order[layer])
        for name in ("keys", "values"):
            mine, theirs = getattr(a.cache.hf.layers[layer], name), getattr(b.cache.hf.layers[layer], name)
            assert torch.allclose(mine, theirs, rtol=0, atol=atol)
    assert torch.allclose(a.logits, b.logits, rtol=0, atol=10 * atol)


def test_a_session_leases_its_peak_in_pages_once_and_gives_them_back(llava):
    pool = _pool(llava, pages=64)
    session = Session(llava, _config(), pool=pool)  # 320 tokens at its peak: 20 pages of 16
    assert pool.free_pages == 64 - 20
    storage = pool.storage.untyped_storage().data_ptr()
    _stream_and_ask(session, seed=1)
    for cached in session.cache.hf.layers:  # every buffer is the lease's pages: nothing allocated beside them
        for rows in (cached._keys, cached._values, cached._rotated):
            assert rows.buffer.untyped_storage().data_ptr() == storage
    assert session.cache.evictions > 0 and pool.free_pages == 64 - 20
    session.release()
    assert pool.free_pages == 64
    session.release()  # again: nothing
    assert pool.free_pages == 64


def test_a_full_pool_refuses_a_session_and_a_session_collected_gives_its_pages_back(llava):
    pool = _pool(llava, pages=50)
    first = Session(llava, _config(), pool=pool)
    second = Session(llava, _config(), pool=pool)
    assert pool.free_pages == 10 and not pool.can_lease(320)
    with pytest.raises(PoolFull, match="no 20 consecutive free pages"):
        Session(llava, _config(), pool=pool)
    assert pool.free_pages == 10  # the refused session took nothing
    first.release()
    third = Session(llava, _config(), pool=pool)  # first fit: where the first one was
    assert third.cache.lease.first_page == 0
    del second
    gc.collect()
    assert pool.free_pages == 30
    third.release()


def test_a_pool_made_in_inference_mode_takes_a_lease_back_outside_it(llava):
    """As bench.gpu makes one, and a session collected at exit gives its pages back."""
    with torch.inference_mode():
        pool = _pool(llava, pages=8)
        lease = pool.lease(40)
    assert pool.free_pages == 5
    lease.release()
    assert pool.free_pages == 8


def test_sessions_in_the_pool_answer_as_sessions_with_buffers_of_their_own(llava):
    """Through eviction and recall (borrowing, give-back), alone and two in one step."""
    pool = _pool(llava, pages=128)
    config = _config(recall=True, retrieval_tokens=48)
    own, pooled = Session(llava, config), Session(llava, config, pool=pool)
    assert _stream_and_ask(own, seed=3) == _stream_and_ask(pooled, seed=3)
    assert pooled.cache.loan.retrievals == 1
    _same(own, pooled)
    alone = [Session(llava, config) for _ in range(2)]
    together = [Session(llava, config, pool=pool) for _ in range(2)]
    for second in range(0, 12, 3):
        times = [float(t) for t in range(second, second + 3)]
        for i, session in enumerate(alone):
            session.append_frames(_frames(3, 10 * i + second), times)
        errors = step([Frames(session, _frames(3, 10 * i + second), times) for i, session in enumerate(together)])
        assert errors == [None, None]
    for a, b in zip(alone, together, strict=True):
        _same(a, b, atol=1e-5)
        assert "".join(a.ask("What is shown?", max_new_tokens=6)) == "".join(b.ask("What is shown?", max_new_tokens=6))


def test_a_cache_past_its_lease_holds_its_tokens_beside_the_pool_until_they_fit_again(llava):
    """A lease smaller than what the cache holds (a peak set too low) costs memory, never tokens."""
    pool = _pool(llava, pages=64)
    config = _config(peak_tokens=176)  # 11 pages: less than a prompt of frames after the budget
    own, pooled = Session(llava, config), Session(llava, config, pool=pool)
    storage = pool.storage.untyped_storage().data_ptr()
    for session in (own, pooled):
        session.append_frames(_frames(6, 5), [float(t) for t in range(6)])
        session.append_frames(_frames(6, 6), [float(t) for t in range(6, 12)])
    _same(own, pooled)
    assert pooled.cache.max_position >= 176  # it held more than its lease
    assert pooled.cache.tokens <= 176  # evicted back to the budget: home again
    assert pooled.cache.hf.layers[0]._keys.buffer.untyped_storage().data_ptr() == storage
    assert pool.free_pages == 64 - 11


def test_a_restored_session_and_a_failed_forward_keep_the_pool_right(llava, monkeypatch):
    pool = _pool(llava, pages=64)
    session = Session(llava, _config(), pool=pool)
    _stream_and_ask(session, seed=7)
    snapshot = session.snapshot()
    restored = Session.restore(llava, snapshot, pool=pool)
    assert pool.free_pages == 64 - 40
    _same(session, restored)
    original = llava.hf.forward

    def failing(*args, **kwargs):
        raise RuntimeError("a forward that fails")

    monkeypatch.setattr(llava.hf, "forward", failing)
    with pytest.raises(RuntimeError):
        restored.append_text("this fails")
    monkeypatch.setattr(llava.hf, "forward", original)
    _same(session, restored)  # rolled back, in its own pages
    assert "".join(session.ask("And now?", max_new_tokens=6)) == "".join(restored.ask("And now?", max_new_tokens=6))
    session.release(), restored.release()
    assert pool.free_pages == 64


# Sessions of four policies (h2o accumulates each query's attention, so it attends through its
# own cache in the same forward), streams of different lengths, one with recall.
POLICIES = [
    ({"policy": "infmllm"}, 3, "What is it?"),
    ({"policy": "snapkv"}, 5, "And now, what do you see in the frame?"),
    ({"policy": "infmllm", "recall": True, "retrieval_tokens": 48}, 8, "What came first?"),
    ({"policy": "h2o"}, 9, "Colour?"),
]


@pytest.mark.parametrize("layout", ["leases one after another", "a gap between leases", "leases of two lengths", "in place"])
def test_answers_in_the_pool_together_are_the_answers_alone_with_one_attention_call_per_layer(llava, monkeypatch, layout):
    """Frames appended together and answers decoded together, with the sessions' leases laid out
    as the pool makes them: one after another (the batch is a view of the pool), with a gap (an
    entry of no session between them), of two lengths (their pages gathered), or attended each
    in place (what a CPU does past `CPU_GATHER_MAX_KEYS`)."""
    from engine import pool_attention

    if layout == "in place":
        monkeypatch.setattr(pool_attention, "CPU_GATHER_MAX_KEYS", 0)
    pool = _pool(llava, pages=200)
    peaks = [320, 400, 320, 400] if layout in ("leases of two lengths", "in place") else [320] * 4

    def sessions(in_pool: bool) -> list[Session]:
        made, left = [], None
        for (options, _, _), peak in zip(POLICIES, peaks, strict=True):
            if in_pool and layout == "a gap between leases" and len(made) == 1:
                left = Session(llava, _config(peak_tokens=peak), pool=pool)
            made.append(Session(llava, _config(peak_tokens=peak, **options), pool=pool if in_pool else None))
        if left is not None:
            left.release()  # a session that ended between the others
        return made

    alone, together = sessions(False), sessions(True)
    if layout == "a gap between leases":
        assert [s.cache.lease.first_page for s in together] == [0, 40, 60, 80]
    for second in range(9):
        streaming = [i for i, (_, frames, _) in enumerate(POLICIES) if second < frames]
        for i in streaming:
            alone[i].append_frames(_frames(1, 10 * i + second), [float(second)])
        assert step([Frames(together[i], _frames(1, 10 * i + second), [float(second)]) for i in streaming]) == [None] * len(streaming)
    expected = ["".join(s.ask(question, max_new_tokens=8)) for s, (_, _, question) in zip(alone, POLICIES, strict=True)]
    answers = [s.ask(question, max_new_tokens=8) for s, (_, _, question) in zip(together, POLICIES, strict=True)]
    texts = [[piece] for piece in step(answers)]  # the questions, each its own number of tokens: each its own call
    batched = []  # the batch of each attention call of the forwards of tokens

    def counted(queries, *args, **kwargs):
        batched.append(queries.shape[0])
        return torch.nn.functional.scaled_dot_product_attention(queries, *args, **kwargs)

    monkeypatch.setattr(pool_attention, "F", type("F", (), {"scaled_dot_product_attention": staticmethod(counted)}))
    while True:
        pieces = step(answers)
        if all(piece is None for piece in pieces):
            break
        for text, piece in zip(texts, pieces, strict=True):
            text.append(piece or "")
    monkeypatch.undo()
    assert ["".join(text) for text in texts] == expected
    for a, b in zip(alone, together, strict=True):
        _same(a, b, atol=1e-5)
    # 7 forwards of one token each, then one that closes the four turns: per layer, the three
    # sessions in the pool in one call (an entry more for the gap), h2o in its own
    forwards = 8 * llava.num_layers
    if layout == "in place":
        assert batched == [1] * 4 * forwards
    else:
        assert batched == [4 if layout == "a gap between leases" else 3, 1] * forwards
    for session in together:
        session.release()
    assert pool.free_pages == 200


@pytest.fixture(scope="module")
def deep():
    """tiny-random-llava with more layers than score a question's pages: the layers after those
    merge what they borrow before the forward reaches them (in the pool, all at once)."""
    return _tiny(partial(tiny.tiny_llava, layers=SCORED_LAYERS + 3), "tiny-random-llava", "llava")("cpu", None)


@pytest.fixture
def pool_merges(monkeypatch) -> list[range]:
    """The layers each borrowing merged in the pool at once (`Lease.merge`), as they happen."""
    merges, merge = [], Lease.merge

    def merge_and_note(lease, layers, *args):
        merges.append(layers)
        return merge(lease, layers, *args)

    monkeypatch.setattr(Lease, "merge", merge_and_note)
    return merges


def test_layers_merged_ahead_in_the_pool_are_bit_for_bit_those_merged_alone(deep, pool_merges):
    pool = _pool(deep, pages=128)
    config = _config(recall=True, retrieval_tokens=48)
    own, pooled = Session(deep, config), Session(deep, config, pool=pool)
    assert _stream_and_ask(own, seed=5) == _stream_and_ask(pooled, seed=5)
    assert pool_merges == [range(SCORED_LAYERS, SCORED_LAYERS + 3)]  # the pooled session's, once
    assert pooled.cache.loan.retrievals == own.cache.loan.retrievals == 1
    _same(own, pooled)


def test_a_merge_too_big_for_the_pools_workspace_goes_a_layer_at_a_time_with_the_same_result(deep, pool_merges, monkeypatch):
    monkeypatch.setattr(kv_pool, "MERGE_WORKSPACE_BYTES", 1024)  # less than a layer's merge here
    config = _config(recall=True, retrieval_tokens=48)
    own, pooled = Session(deep, config), Session(deep, config, pool=_pool(deep, pages=128))
    assert _stream_and_ask(own, seed=5) == _stream_and_ask(pooled, seed=5)
    assert pool_merges == [] and pooled.cache.loan.retrievals == 1
    assert pooled.cache.lease.pool.workspace(0).numel() == 0  # never grown
    _same(own, pooled)


def test_borrowing_everything_in_the_pool_answers_as_the_full_cache(deep, pool_merges):
    """With room for all the host tier holds, the question sees every token at the places the
    full cache gives them, the later layers merged ahead in the pool: the same answer, and the
    same attention over the video (its evidence)."""
    full = Session(deep, SessionConfig(policy="full", evidence_top_k=12))
    options = {"recall": True, "retrieval_tokens": 4096, "peak_tokens": 640, "evidence_top_k": 12}
    pooled = Session(deep, _config(**options), pool=_pool(deep, pages=128))
    for session in (full, pooled):
        session.append_frames(_frames(12, 7), [float(t) for t in range(12)])
    assert pooled.stats().host_tokens == full.stats().cache_tokens - 160
    expected, answer = full.ask("What was first?", max_new_tokens=10), pooled.ask("What was first?", max_new_tokens=10)
    assert "".join(answer) == "".join(expected)
    # (evidence is not compared: its baseline is partly read when the last frames came, when
    # the bounded cache held fewer seconds than the question borrows; engine/evidence.py)
    assert len(pool_merges) == 1


@linux
def test_a_run_that_goes_back_gives_its_memory_back_to_the_operating_system(llava):
    pool = _pool(llava, 16_384)  # tiny-random-llava: 12,288 bytes a page of 16 slots, 192 MiB in all
    assert pool.nbytes == 192 * MIB
    lease = pool.lease(16_384 * PAGE_TOKENS)
    lease.clean(0, lease.tokens)  # every slot written (zeros): resident, whether or not it was before
    written = resident_bytes()
    lease.release()
    released = resident_bytes()
    assert written - released > 180 * MIB
    again = pool.lease(100 * PAGE_TOKENS)  # its pages read as zeros, and take memory as they are written
    assert not again.rows(0, 0).any() and resident_bytes() - released < 8 * MIB

"""Which pages of a session's host tier (`engine/host_tier.py`) a question borrows, layer by layer.

A question scores the pages in each layer's KV heads by its own keys there (its tokens' keys, as
stored, of the question's words only, not the chat template's: a fact is asked about in the
words it was told in, and keys of the same words are close, where queries are not), every key
centred on the mean key the head's pages hold (`centre`: a layer's keys share one large
direction, so that uncentred two different words are nearly as close as one word to itself): a
page matches a question key by the cosine similarity of its closest representative (in the first
EXACT_LAYERS layers, of its closest key held: there keys are the words' own, and a mean of 8
words hides one); per question key, a softmax over the pages (sharpened by
SIMILARITY_SHARPNESS); a page's score is that share averaged over the question's keys. A page is
the same span of the stream in every layer and head, so the scores pool: the first
SCORED_LAYERS layers score in turn, each adding the mean score over its heads that hold
something of the page (a head that holds the page's tokens on the device has no say). Beside
that tally the layers keep a second, of each page scored by its whole span (the keys of it that
the device cache still holds too, and every head holding any of it has a say), whose best
SPAN_PAGES go first: a policy that scores per head keeps a fact's words in one head and evicts
them in another, and often keeps the words a question repeats while it evicts the one asked for
(the number). The same layers weigh the spans the device holds whole (pages the tier holds
nothing of) against the tier's pages, in one softmax: when the device's best is DEVICE_LEAD
times as wanted as the tier's best, what the question asks for was said just before, and it
borrows the pages evicted last (the stream just before what the device holds), not pages that
look like it. The first layer chooses by its own scores for itself and the other scoring
layers; the last of them chooses by all of theirs for every layer after it at once, which
borrow without scoring. The page after a page ranks at least FOLLOWER_SHARE of it: a sentence
cut by a page's end goes on there. Only pages that stand out (above the median page by
STANDING_SHARE of the best's lead over it) rank by their scores; the places they leave go to the
pages evicted last, as when the device leads: prose that shares a word or two with the question
draws a small model's answer into itself, where the stream just before the device's newest
tokens goes on from what the device holds. Every KV head then borrows the tokens it holds of the best
pages, best first, up to the retrieval budget (the same count in every head; a head that kept
more of those pages on the device reaches further down the list; the last page may come in
part). What each rule was measured to give: docs/engine.md, "Recall: the host tier".
"""

from dataclasses import dataclass, field
from typing import Protocol

import torch

SIMILARITY_SHARPNESS = 20.0  # a question key's softmax over pages is of 20 x cosine similarity
EXACT_LAYERS = 1  # layers whose pages are scored by every key held, not by representatives
SCORED_LAYERS = 4  # layers that score the pages; the last of them chooses for every layer after it at once
CANDIDATE_PAGES = 4  # a question's places are chosen among the best pages that could lend 4 times what it borrows
SPAN_PAGES = 1  # a question's places go first to the best page by its whole span (the device cache's tokens of it too)
DEVICE_LEAD = 8.0  # the device's best span this many times as wanted as the tier's best page: borrow the pages evicted last
STANDING_SHARE = 0.5  # a page stands out when above the median page by half the best's lead; the rest of a question's places go to the pages evicted last
FOLLOWER_SHARE = 0.99  # the page after a matched page scores this share of it, when that is more than its own
SIMILARITY_CHUNK = 1 << 24  # elements of one block of the representatives' similarity matrix


class Pages(Protocol):
    """What scoring reads of a host tier (`engine/host_tier.py`'s `HostTier`), and never writes."""

    slots: int
    page_tokens: int
    page_keys: int
    slot_of: dict[int, int]  # page number -> slot
    page_of: torch.Tensor  # (slots,) slot -> page number, -1 when free
    keys: torch.Tensor  # (layers, kv_heads, slots, page_tokens, head_dim), host memory, as pages keep them (`page_dtype`)
    present: torch.Tensor  # (layers, kv_heads, slots, page_tokens), CPU
    held: torch.Tensor  # `present` on the device
    key_sums: torch.Tensor  # (layers, kv_heads, slots, page_keys, head_dim), device


@dataclass
class Cached:
    """What a layer's device cache holds, as a question borrows."""

    keys: torch.Tensor  # (kv_heads, n, head_dim), before the rotary embedding
    order: torch.Tensor  # (kv_heads, n) int64, each token's place in the stream


@dataclass
class Question:
    """One question's page scores, summed over the layers' KV heads so far, and what its layers borrow."""

    pooled: list[torch.Tensor | None] = field(default_factory=lambda: [None, None])  # (slots,) by the tier's tokens, by the whole span
    pooled_heads: list[torch.Tensor | None] = field(default_factory=lambda: [None, None])  # how many heads held something of each page
    best: torch.Tensor | None = None  # over the scored layers: the best tier page's share, the best device span's
    sharing: range | None = None  # the layers whose places the last choice was

    def borrow(self, tier: Pages, layer: int, keys: torch.Tensor, count: int, cached: Cached | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The places `layer` borrows (`choose`), and the layers after it that share its choice;
        None: an earlier layer's choice is this one's (its keys still scored the pages, if it is
        a scoring layer)."""
        if layer < SCORED_LAYERS or self.sharing is None:
            self.pool(*score(tier, layer, keys, cached))
        if self.sharing is not None and layer in self.sharing:
            return None
        chosen = self.choose(tier, layer, tier.held.shape[0] if layer >= SCORED_LAYERS - 1 else SCORED_LAYERS - 1, count)
        self.sharing = range(layer, layer + chosen[0].shape[0])
        return chosen

    def pool(self, *scored_pages: torch.Tensor | None) -> None:
        """Add a layer's `score` to the tallies: each page's, summed over the heads that hold something of it."""
        *scored_pages, best = scored_pages
        if best is not None:
            self.best = best if self.best is None else self.best + best
        for index, scores in enumerate(scored_pages):  # (kv_heads, slots), -inf where a head holds nothing of a page
            if scores is not None:
                scored = scores.isfinite()
                mine, heads = scores.masked_fill(~scored, 0.0).sum(0), scored.sum(0)
                self.pooled[index] = mine if self.pooled[index] is None else self.pooled[index] + mine
                self.pooled_heads[index] = heads if self.pooled_heads[index] is None else self.pooled_heads[index] + heads

    def choose(self, tier: Pages, first: int, last: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For layers first..last-1, each KV head's `count` places (into slots * page_tokens) of the
        best pages by the pooled scores, and their places in the stream, both (layers, kv_heads,
        count) on the CPU, in stream order."""
        recent = tier.page_of.to(self.pooled[0].device, torch.float32)  # (slots,) the pages evicted last rank first
        # the device holds what is asked: borrow what it evicted last, not pages like the question
        if self.best is not None and bool(self.best[1] > DEVICE_LEAD * self.best[0]):
            scores = recent
        else:
            before = torch.tensor([tier.slot_of.get(page - 1, -1) for page in tier.page_of.tolist()])  # slot -> the page before's
            scores = with_followers(self.pooled[0] / self.pooled_heads[0].clamp_min(1), before)  # (slots,)
            floor = standing_floor(scores[recent >= 0])
            if self.pooled[1] is not None:  # the best pages by their whole span go first
                spanned = self.pooled[1] / self.pooled_heads[1].clamp_min(1)
                lead = spanned.topk(min(SPAN_PAGES, tier.slots)).indices
                lead = lead[spanned[lead] > 0]
                scores = scores.clone()
                scores[lead] = scores.max() + 1 + spanned[lead]
                scores = with_followers(scores, before)
            # places the pages that stand out leave go to the pages evicted last, not to pages a little like the question
            standing = (scores >= floor) & (recent >= 0)
            scores = torch.where(standing, scores, scores[standing].min() - 2 + recent / (recent.max() + 1))
        held = tier.held[first:last]  # (layers, kv_heads, slots, page_tokens)
        # Among the best pages only, when every head holds enough of them: the same choice, in a fraction of the places
        best = scores.topk(min(tier.slots, CANDIDATE_PAGES * -(-count // tier.page_tokens))).indices
        if best.shape[0] < tier.slots and int((among := held[:, :, best]).flatten(2).sum(-1).min()) >= count:
            held, scores = among, scores[best]
        else:
            best = None
        wanted = torch.where(held, scores[:, None], float("-inf"))
        chosen = wanted.flatten(2).topk(count, dim=-1).indices  # (layers, kv_heads, count) into the pages looked at
        if best is not None:
            chosen = best[chosen // tier.page_tokens] * tier.page_tokens + chosen % tier.page_tokens
        chosen = chosen.cpu()
        order = tier.page_of[chosen // tier.page_tokens] * tier.page_tokens + chosen % tier.page_tokens
        order, by_place = order.sort(dim=-1)
        return chosen.gather(-1, by_place), order


def score(tier: Pages, layer: int, keys: torch.Tensor, cached: Cached | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(kv_heads, slots) how much the question's keys (kv_heads, c, head_dim) want each page of
    `layer`, per KV head (-inf where the head holds nothing of it). In the first EXACT_LAYERS
    layers a page is matched by every key it holds (from host memory), elsewhere by its
    representatives. With `cached`, a second score, by every key of its span, those the device
    cache still holds too (a head holding any of the span there has a say), and `best_shares`."""
    heads, slots = tier.held.shape[1:3]
    counts = tier.held[layer].view(heads, slots, tier.page_keys, -1).sum(-1)  # (kv_heads, slots, page_keys) keys in each sum
    if layer < EXACT_LAYERS:
        held = tier.present[layer]  # (kv_heads, slots, page_tokens)
        reps = tier.keys[layer]  # every key held, in host memory: the first layer's keys are the words' own
    else:
        held = counts > 0  # (kv_heads, slots, page_keys)
        reps = tier.key_sums[layer]  # a mean points where its sum does: cosine needs no division by the count
    mean = centre(tier.key_sums[layer], counts).to(reps.device)  # (kv_heads, head_dim)
    wanted = keys.float().to(reps.device) - mean[:, None]
    wanted = wanted / wanted.norm(dim=-1, keepdim=True).clamp_min(1e-6)  # (kv_heads, c, head_dim)
    similarity = torch.empty(heads, wanted.shape[1], slots, device=reps.device)
    step = max(1, SIMILARITY_CHUNK // (heads * reps.shape[2] * reps.shape[3]))  # slots at a time, in float32
    for start in range(0, slots, step):
        within = 1 if layer < EXACT_LAYERS else counts[:, start : start + step, :, None].to(reps.device)  # a sum of n keys: n means
        block = reps[:, start : start + step].float() - within * mean[:, None, None]
        near = torch.einsum("hcd,hskd->hcsk", wanted, block)  # (kv_heads, c, step, keys a page)
        near /= block.norm(dim=-1).clamp_min(1e-6)[:, None]  # cosine, without a normalized copy of the keys
        similarity[:, :, start : start + step] = near.masked_fill_(~held[:, None, start : start + step], float("-inf")).amax(-1)
    spanned = best = None
    if cached is not None:
        in_pages, elsewhere = cached_similarity(tier, wanted, cached, mean)
        spanned = torch.maximum(similarity, in_pages.to(similarity.device))
        best = best_shares(spanned, elsewhere.to(similarity.device))
    return *(None if near is None else shares(near).to(keys.device) for near in (similarity, spanned)), best


def centre(key_sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """(kv_heads, head_dim) the mean key the pages of a layer hold, per KV head (from their sums
    (kv_heads, slots, page_keys, head_dim), each of `counts` keys): what every key of the layer
    shares. In SmolLM2's first layer two different words' keys have a cosine similarity of about
    0.97 and a word's own key 1.0, so that a question's word matched the page it was told in by
    about as much as any other; centred, the same word stands out."""
    return key_sums.float().sum((1, 2)) / counts.sum((1, 2)).clamp_min(1)[:, None].to(key_sums.device)


def best_shares(spanned: torch.Tensor, elsewhere: torch.Tensor) -> torch.Tensor:
    """(2,) how much the question's keys want the best page the tier holds something of, and
    the best span the device holds all of (a page of the stream the tier holds nothing of):
    shares of one softmax over both (similarities (kv_heads, c, pages)), averaged over the
    heads (`DEVICE_LEAD`)."""
    every = shares(torch.cat([spanned, elsewhere], dim=-1)).clamp_min(0.0).mean(0)  # (pages,)
    slots = spanned.shape[-1]
    return torch.stack([part.max() if part.numel() else every.new_zeros(()) for part in (every[:slots], every[slots:])])


def shares(similarity: torch.Tensor) -> torch.Tensor:
    """(kv_heads, slots) per page the share of the question keys' softmax over the pages
    (similarity (kv_heads, c, slots), -inf where a head holds nothing of a page), averaged
    over the keys; -inf where the head holds nothing of it."""
    share = (SIMILARITY_SHARPNESS * similarity).softmax(dim=-1).nan_to_num(0.0)
    return share.mean(dim=1).masked_fill(similarity.isinf().all(1), float("-inf"))


def cached_similarity(tier: Pages, wanted: torch.Tensor, cached: Cached, mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_heads, c, slots) per question key (centred, unit length, (kv_heads, c, head_dim)) the cosine
    similarity of its closest key that the device cache holds of each page's span (-inf where
    it holds none); and (kv_heads, c, d) the same for the d spans of pages the tier holds
    nothing of, held on the device alone. A policy that scores per head keeps part of a
    sentence and evicts the rest: the words a question repeats stay (a fact's subject), the
    word it asks for goes (the number). The page is then the sentence's all the same, and so
    it is found."""
    heads, count = wanted.shape[:2]
    device = cached.keys.device  # where the cache's keys are: only the (kv_heads, c, slots) result moves
    page = cached.order.to(device) // tier.page_tokens  # (kv_heads, n)
    pages = sorted(tier.slot_of)
    numbers = torch.tensor(pages, dtype=torch.int64, device=device)
    slots = torch.tensor([tier.slot_of[n] for n in pages], dtype=torch.int64, device=device)
    at = torch.searchsorted(numbers, page).clamp_max(len(numbers) - 1)
    paged = numbers[at] == page  # the token's page is held here
    keys = cached.keys.float() - mean.to(device)[:, None]  # (kv_heads, n, head_dim), centred as the question's
    near = torch.einsum("hcd,hnd->hcn", wanted.to(device), keys) / keys.norm(dim=-1).clamp_min(1e-6)[:, None]
    similarity = torch.full((heads, count, tier.slots + 1), float("-inf"), device=device)
    into = torch.where(paged, slots[at], tier.slots)[:, None].expand(-1, count, -1)  # the spare column: no page
    in_pages = similarity.scatter_reduce_(2, into, near.masked_fill(~paged[:, None], float("-inf")), "amax")[:, :, : tier.slots]
    alone, column = torch.unique(page.masked_fill(paged, -1), return_inverse=True)  # a column per page: -1, the tier's
    elsewhere = torch.full((heads, count, alone.shape[0]), float("-inf"), device=device)
    elsewhere.scatter_reduce_(2, column[:, None].expand(-1, count, -1), near, "amax")
    return in_pages, elsewhere[:, :, int(bool(paged.any())) :]


def standing_floor(scores: torch.Tensor) -> torch.Tensor:
    """The score a page needs to stand out among the tier's pages (`scores`): above the median
    page's by STANDING_SHARE of the best page's lead over it."""
    middle = scores.median()
    return middle + STANDING_SHARE * (scores.max() - middle)


def with_followers(scores: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """(slots,) each page's score, or FOLLOWER_SHARE of the score of the page just before it in the
    stream (at slot `before`, -1: none held) when that is higher: a sentence that a page's end cuts
    goes on in the next page, whose own words (the number a question asks for) need not match it."""
    before = before.to(scores.device)
    inherited = (scores[before.clamp_min(0)] * FOLLOWER_SHARE).masked_fill(before < 0, float("-inf"))
    return torch.maximum(scores, inherited)

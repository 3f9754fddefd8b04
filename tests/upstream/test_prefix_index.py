"""The router's per-upstream index of prefix blocks: chain hashes, leading matches, LRU bound."""

from __future__ import annotations

from gateway.upstream.prefix_index import PrefixIndex, prefix_blocks


def test_blocks_are_chained_so_equal_tokens_after_a_difference_do_not_match() -> None:
    a = prefix_blocks(list(range(40)), 8)
    b = prefix_blocks([99, *range(1, 40)], 8)
    assert len(a) == 5 and len(prefix_blocks(list(range(7)), 8)) == 0  # only full blocks
    assert a[1] != b[1], "block 1 holds the same tokens but follows a different block 0"
    assert prefix_blocks(list(range(40)), 8) == a


def test_matches_count_leading_blocks_only_and_forget_drops_an_upstream() -> None:
    index = PrefixIndex(blocks_per_upstream=100)
    blocks = prefix_blocks(list(range(64)), 16)
    index.record("u", blocks[:2])
    assert index.matched_blocks("u", blocks) == 2
    assert index.matched_blocks("u", [blocks[2], blocks[0]]) == 0  # counting stops at the first miss
    assert index.matched_blocks("other", blocks) == 0
    index.forget("u")
    assert index.matched_blocks("u", blocks) == 0


def test_capacity_evicts_least_recently_used_blocks() -> None:
    index = PrefixIndex(blocks_per_upstream=2)
    first, second = prefix_blocks(list(range(32)), 16), prefix_blocks(list(range(100, 132)), 16)
    index.record("u", first)
    index.record("u", second)
    assert index.matched_blocks("u", first) == 0 and index.matched_blocks("u", second) == 2
    disabled = PrefixIndex(blocks_per_upstream=0)
    disabled.record("u", first)
    assert disabled.matched_blocks("u", first) == 0

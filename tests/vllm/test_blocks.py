"""What one vLLM server holds, in kvgate's chain: stores, removals, salts, and prompts matched."""

from __future__ import annotations

from gateway.vllm.blocks import ServerBlocks, prompt_chain

SIZE = 4
PROMPT = list(range(100, 118))  # 4 full blocks and 2 tokens


def stored_prompt(blocks: ServerBlocks, names: list[int], tokens: list[int] = PROMPT, parent: int | None = None,
                  extra_keys: list[list[str] | None] | None = None) -> int:
    return blocks.stored(names, parent, tokens[: len(names) * SIZE], SIZE, extra_keys)


def test_a_stored_prompt_matches_every_full_block() -> None:
    blocks = ServerBlocks()
    assert stored_prompt(blocks, [11, 12, 13, 14]) == 4
    assert blocks.block_size == SIZE
    assert blocks.matched_blocks(prompt_chain(PROMPT, SIZE)) == 4
    assert blocks.matched_blocks(prompt_chain(PROMPT[:9], SIZE)) == 2


def test_servers_naming_blocks_differently_hold_the_same_chain() -> None:
    """vLLM's hashes are seeded per process: two servers name one prefix differently; kvgate not."""
    one, two = ServerBlocks(), ServerBlocks()
    stored_prompt(one, [11, 12, 13, 14])
    stored_prompt(two, [91, 92])
    two.stored([93, 94], 92, PROMPT[8:16], SIZE)  # a later step, chained on its parent's vLLM hash
    assert set(one.held) == set(two.held)
    chain = prompt_chain(PROMPT, SIZE)
    assert one.matched_blocks(chain) == two.matched_blocks(chain) == 4


def test_a_prompt_that_diverges_matches_up_to_the_divergence() -> None:
    blocks = ServerBlocks()
    stored_prompt(blocks, [11, 12, 13, 14])
    other = [*PROMPT[:6], 0, *PROMPT[7:]]  # differs in the second block
    assert blocks.matched_blocks(prompt_chain(other, SIZE)) == 1


def test_a_block_whose_parent_is_unknown_is_not_indexed() -> None:
    blocks = ServerBlocks()
    assert blocks.stored([13, 14], 12, PROMPT[8:16], SIZE) == 0
    assert len(blocks) == 0


def test_removed_blocks_end_the_match_there() -> None:
    blocks = ServerBlocks()
    stored_prompt(blocks, [11, 12, 13, 14])
    blocks.removed([13])
    chain = prompt_chain(PROMPT, SIZE)
    assert blocks.matched_blocks(chain) == 2  # block 4 is still held, but unreachable, as in vLLM
    blocks.removed([11, 999])  # a hash it never indexed: ignored
    assert blocks.matched_blocks(chain) == 0
    assert len(blocks) == 2


def test_clear_forgets_everything() -> None:
    blocks = ServerBlocks()
    stored_prompt(blocks, [11, 12])
    blocks.clear()
    assert len(blocks) == 0 and blocks.chains == {}
    assert blocks.matched_blocks(prompt_chain(PROMPT, SIZE)) == 0


def test_a_cache_salt_starts_another_chain() -> None:
    """vLLM publishes a request's cache_salt as the first block's extra keys: `[salt]`."""
    blocks = ServerBlocks()
    stored_prompt(blocks, [21, 22, 23], extra_keys=[["tenant-a"], None, None])
    assert blocks.matched_blocks(prompt_chain(PROMPT, SIZE, "tenant-a")) == 3
    assert blocks.matched_blocks(prompt_chain(PROMPT, SIZE, "tenant-b")) == 0
    assert blocks.matched_blocks(prompt_chain(PROMPT, SIZE)) == 0


def test_a_block_stored_again_under_its_hash_is_counted_once() -> None:
    blocks = ServerBlocks()
    stored_prompt(blocks, [11, 12])
    stored_prompt(blocks, [11, 12])
    blocks.removed([12])
    assert blocks.matched_blocks(prompt_chain(PROMPT, SIZE)) == 1
    assert len(blocks) == 1

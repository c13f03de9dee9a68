"""HFSession on a tiny random LlamaForCausalLM: windows, trees, keep, batched guidance (fp32),
what it waits for in steady state; and the session benchmark at toy size."""

import re
from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sjd_core.models.hf_session import Context, DecoderParts, HFSession, cache_keyword
from sjd_core.models.reference import WEIGHTS_DIR, ReferenceModel
from sjd_core.models.session.kv_store import KVStore, compact
from sjd_core.tools import session_bench
from sjd_core.tools.host_reads import HostReads

VOCAB, OFFSET, CODEBOOK, ROW_END = 64, 10, 40, 3
GRID = (3, 4)  # 3 rows of 4 codes


@pytest.fixture(scope="module")
def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


def parts(model: LlamaForCausalLM, row_end: int | None = ROW_END) -> DecoderParts:
    emb = model.model.embed_tokens
    return DecoderParts(
        backbone=model.model, embed_tokens=emb, embed_codes=lambda c: emb(c + OFFSET),
        code_logits=lambda h: model.lm_head(h)[..., OFFSET:OFFSET + CODEBOOK],
        row_end_id=row_end, device=torch.device("cpu"), dtype=torch.float32)


def sequence_ids(prompt: list[int], codes: list[int], width: int, row_end: bool) -> list[int]:
    """The plain token sequence: prompt, then codes with a row end after every full row."""
    out = list(prompt)
    for i, c in enumerate(codes):
        out.append(c + OFFSET)
        if row_end and i % width == width - 1:
            out.append(ROW_END)
    return out


def reference_logits(model, prompt, codes, width, row_end=True) -> torch.Tensor:
    """Code logits after slot -1 and after each code, from one plain causal forward."""
    ids = sequence_ids(prompt, codes, width, row_end)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :, OFFSET:OFFSET + CODEBOOK]
    outs = [len(prompt) - 1]
    pos = len(prompt) - 1
    for i in range(len(codes)):
        pos += 1 + (1 if row_end and i % width == width - 1 else 0)
        outs.append(pos)
    return logits[outs]


def chain(t: int) -> torch.Tensor:
    return torch.tril(torch.ones(t, t, dtype=torch.bool))


PROMPT = [1, 5, 7, 2, 9]
CODES = [4, 17, 33, 8, 0, 39, 12, 25, 6, 30, 2, 11]


class _OlderBackbone(torch.nn.Module):
    """A backbone whose forward takes the cache as ``past_key_values``, as transformers 5
    releases before the rename do."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs_embeds=None, attention_mask=None, position_ids=None,
                past_key_values=None, use_cache=None, **kwargs):
        return self.model(inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                          position_ids=position_ids, cache=past_key_values, use_cache=use_cache)


class _PassesItOn(torch.nn.Module):
    def forward(self, inputs_embeds=None, **decoder_inputs):
        return decoder_inputs


@torch.no_grad()
def test_a_backbone_that_takes_past_key_values_gets_the_cache_there(llama):
    older = replace(parts(llama), backbone=_OlderBackbone(llama.model))
    assert cache_keyword(older.backbone) == "past_key_values"
    assert cache_keyword(llama.model) == "cache"
    assert cache_keyword(_PassesItOn()) == "cache"
    session = HFSession(older, [Context(ids=torch.tensor(PROMPT))], None, GRID)
    slots = torch.arange(-1, 7)[None]
    cond, _ = session.forward(torch.tensor([[0] + CODES[:7]]), slots, chain(8), [0])
    torch.testing.assert_close(cond[0], reference_logits(llama, PROMPT, CODES, GRID[1])[:8],
                               atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_window_equals_stepwise_across_row_ends(llama):
    ref = reference_logits(llama, PROMPT, CODES, GRID[1])
    session = HFSession(parts(llama), [Context(ids=torch.tensor(PROMPT))], None, GRID)
    # window of slots -1..6 crosses the first row end (after slot 3)
    slots = torch.arange(-1, 7)[None]
    codes = torch.tensor([[0] + CODES[:7]])
    cond, uncond = session.forward(codes, slots, chain(8), [0])
    assert uncond is None
    torch.testing.assert_close(cond[0], ref[:8], atol=1e-5, rtol=1e-5)
    # one at a time from a fresh session
    step = HFSession(parts(llama), [Context(ids=torch.tensor(PROMPT))], None, GRID)
    outs = []
    for s in range(-1, 11):
        code = 0 if s < 0 else CODES[s]
        out, _ = step.forward(torch.tensor([[code]]), torch.tensor([[s]]), chain(1), [s + 1])
        step.keep(torch.ones(1, 1, dtype=torch.bool))
        outs.append(out[0, 0])
    torch.testing.assert_close(torch.stack(outs), ref[:12], atol=1e-5, rtol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("prompts, negative", [([PROMPT, PROMPT[::-1]], [2, 8, 8, 8, 9]),
                                               ([PROMPT, PROMPT[2:]], [2, 9])],
                         ids=["rows in step", "rows of different lengths"])
def test_advance_equals_stepwise_and_mixes_with_windows(llama, prompts, negative):
    """Plain autoregression's ``advance`` (lean between row ends, forward + keep at them, for the
    slot -1 token, for rows out of step and after a window) gives the plain sequence's logits,
    guided rows included, also where the contexts' lengths differ (the shorter ones padded)."""
    seqs = [CODES, CODES[::-1]]
    refs = [reference_logits(llama, p, seq, GRID[1]) for p, seq in zip(prompts, seqs)]
    uncond = [reference_logits(llama, negative, seq, GRID[1]) for seq in seqs]
    session = HFSession(parts(llama), [Context(ids=torch.tensor(p)) for p in prompts],
                        [Context(ids=torch.tensor(negative))] * 2, GRID)
    lean = []
    forward = session.forward
    session.forward = lambda *args: (lean.append(False), forward(*args))[1]
    committed = 0
    while committed < 12:
        if committed == 5:  # a window of three, all kept, between the advances
            out, out_uncond = window_forward(session, seqs, [committed - 1, committed - 1], width=3)
            keep_first(session, [3, 3], width=3)
            for b in range(2):
                torch.testing.assert_close(out[b], refs[b][committed:committed + 3], atol=1e-5, rtol=1e-5)
            committed += 3
            continue
        codes = torch.tensor([0 if committed == 0 else seq[committed - 1] for seq in seqs])
        calls = len(lean)
        out, out_uncond = session.advance(codes, [committed, committed])
        lean += [True] * (len(lean) == calls)
        for b in range(2):
            torch.testing.assert_close(out[b], refs[b][committed], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out_uncond[b], uncond[b][committed], atol=1e-5, rtol=1e-5)
        committed += 1
    assert any(lean) and not all(lean), lean  # shorter contexts are padded: rows stay in step


@torch.no_grad()
def test_advance_of_rows_out_of_step_skips_the_layout_and_stays_exact(llama):
    """After a window that kept different paths, the rows have committed different counts.
    Plain autoregression's advance then feeds each row's code at its own row's next column
    without the layout (a forward only for the first advance and where some row's code ends a
    grid row), and every logit, guided rows included, is the plain sequence's."""
    prompts, uncond_prompts = [[1, 5, 7, 2, 9], [1, 6, 2, 9]], [[2, 9], [3, 2, 9]]
    seqs = [CODES, CODES[::-1]]
    refs = [(reference_logits(llama, prompts[b], seqs[b], GRID[1]),
             reference_logits(llama, uncond_prompts[b], seqs[b], GRID[1])) for b in range(2)]
    session = HFSession(parts(llama), [Context(ids=torch.tensor(p)) for p in prompts],
                        [Context(ids=torch.tensor(p)) for p in uncond_prompts], GRID)
    window_forward(session, seqs, [-1, -1], width=3)
    keep_first(session, [3, 1], width=3)  # slots -1..1 and -1: two codes apart
    forwards = []
    forward = session.forward
    session.forward = lambda *args: (forwards.append(args[3]), forward(*args))[1]
    committed = [3, 1]
    while max(committed) < 12:
        codes = torch.tensor([seq[c - 1] for seq, c in zip(seqs, committed)])
        cond, uncond = session.advance(codes, committed)
        for b in range(2):
            torch.testing.assert_close(cond[b], refs[b][0][committed[b]], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(uncond[b], refs[b][1][committed[b]], atol=1e-5, rtol=1e-5)
        committed = [c + 1 for c in committed]
    # a forward for the first advance after the window and for every code that ends a grid row
    # of 4 (slots 3 and 7): row 0's at [4, 2] and [8, 6], row 1's at [6, 4] and [10, 8]
    assert forwards == [[3, 1], [4, 2], [6, 4], [8, 6], [10, 8]], forwards


@torch.no_grad()
def test_advance_that_does_not_continue_the_cache_is_refused(llama):
    session = HFSession(parts(llama), [Context(ids=torch.tensor(PROMPT))], None, GRID)
    for committed in range(2):
        session.advance(torch.tensor([CODES[committed]]), [committed])
    with pytest.raises(ValueError, match=r"committed=\[3\].*does not continue the cache"):
        session.advance(torch.tensor([CODES[2]]), [3])  # slot 1 was never fed
    with pytest.raises(ValueError, match=r"committed=\[4\].*does not continue the cache"):
        session.advance(torch.tensor([CODES[2]]), [4])  # at a row end too, before any forward
    with pytest.raises(ValueError, match=r"advance got codes of shape \(1, 1\); expected \(B=1,\)"):
        session.advance(torch.tensor([[CODES[2]]]), [2])


@torch.no_grad()
def test_tree_equals_each_branch(llama):
    session = HFSession(parts(llama), [Context(ids=torch.tensor(PROMPT))], None, GRID)
    session.forward(torch.tensor([[0] + CODES[:2]]), torch.arange(-1, 2)[None], chain(3), [0])
    session.keep(torch.ones(1, 3, dtype=torch.bool))
    # committed slots 0,1; tree: slot 2 has candidates a,b; slot 3 (row end) children; slot 4 chain
    #   node: 0:(2,a) 1:(2,b) 2:(3,a->x) 3:(3,b->y) 4:(4, after x)
    codes = torch.tensor([[20, 21, 30, 31, 5]])
    slots = torch.tensor([[2, 2, 3, 3, 4]])
    anc = torch.eye(5, dtype=torch.bool)
    anc[2, 0] = anc[3, 1] = anc[4, 2] = anc[4, 0] = True
    tree, _ = session.forward(codes, slots, anc, [3])
    branches = {0: [20], 1: [21], 2: [20, 30], 3: [21, 31], 4: [20, 30, 5]}
    for node, branch in branches.items():
        ref = reference_logits(llama, PROMPT, CODES[:2] + branch, GRID[1])
        torch.testing.assert_close(tree[0, node], ref[-1], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_keep_path_then_continue_equals_fresh(llama):
    session = HFSession(parts(llama), [Context(ids=torch.tensor(PROMPT))], None, GRID)
    codes = torch.tensor([[0, 4, 17, 39, 33, 38, 8]])
    slots = torch.tensor([[-1, 0, 1, 2, 2, 3, 3]])
    anc = chain(3).new_zeros(7, 7)
    anc[:3, :3] = chain(3)
    anc[3:5, :3] = True
    anc[3, 3] = anc[4, 4] = anc[5, 5] = anc[6, 6] = True
    anc[5, :4] = True
    anc[6, :3] = True
    anc[6, 4] = True  # node 6 = (3, 8) under node 4 = (2, 33)
    session.forward(codes, slots, anc, [0])
    session.keep(torch.tensor([[True, True, True, False, True, False, True]]))  # path 4,17,33,8
    out, _ = session.forward(torch.tensor([[0, 39, 12]]), torch.tensor([[4, 5, 6]]), chain(3), [5])
    ref = reference_logits(llama, PROMPT, CODES[:7], GRID[1])
    torch.testing.assert_close(out[0], ref[5:8], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_batched_guidance_equals_separate_forwards(llama):
    cond_prompts = [[1, 5, 7, 2, 9], [1, 6, 2, 9]]
    uncond_prompts = [[2, 9], [4, 4, 4, 2, 9, 9]]
    session = HFSession(parts(llama), [Context(ids=torch.tensor(p)) for p in cond_prompts],
                        [Context(ids=torch.tensor(p)) for p in uncond_prompts], GRID)
    codes = torch.tensor([[0] + CODES[:5], [0] + CODES[3:8]])
    slots = torch.arange(-1, 5).expand(2, 6)
    cond, uncond = session.forward(codes, slots, chain(6), [0, 0])
    for b in range(2):
        c = codes[b, 1:].tolist()
        torch.testing.assert_close(cond[b], reference_logits(llama, cond_prompts[b], c, GRID[1])[:6],
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(uncond[b], reference_logits(llama, uncond_prompts[b], c, GRID[1])[:6],
                                   atol=1e-5, rtol=1e-5)


def window_forward(session, seqs, cached, width=6):
    """Feed each row a chain of ``width`` nodes from its first uncached slot ``cached[b]``."""
    slots = torch.stack([torch.arange(c, c + width) for c in cached]).clamp(max=11)
    codes = torch.tensor([[0 if s < 0 else seq[s] for s in row.tolist()] for seq, row in zip(seqs, slots)])
    return session.forward(codes, slots, chain(width), [c + 1 for c in cached])


def keep_first(session, take, width=6):
    """Keep the first ``take[b]`` of the ``width`` nodes of each row."""
    session.keep(torch.arange(width)[None, :] < torch.tensor(take)[:, None])


@torch.no_grad()
def test_rows_keep_different_counts(llama):
    prompts = [[1, 5, 7, 2, 9], [1, 6, 2, 9]]
    uncond_prompts = [[2, 9], [3, 2, 9]]
    seqs = [CODES, CODES[::-1]]
    refs = [(reference_logits(llama, prompts[b], seqs[b], GRID[1]),
             reference_logits(llama, uncond_prompts[b], seqs[b], GRID[1])) for b in range(2)]
    session = HFSession(parts(llama), [Context(ids=torch.tensor(p)) for p in prompts],
                        [Context(ids=torch.tensor(p)) for p in uncond_prompts], GRID)
    cached = [-1, -1]  # per row: first slot not yet in the cache
    for take in ([6, 1], [1, 6], [0, 4], [3, 0], [2, 5]):
        cond, uncond = window_forward(session, seqs, cached)
        for b in range(2):
            n = min(6, 12 - cached[b])  # nodes past the grid's end are padding
            torch.testing.assert_close(cond[b, :n], refs[b][0][cached[b] + 1:cached[b] + 1 + n],
                                       atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(uncond[b, :n], refs[b][1][cached[b] + 1:cached[b] + 1 + n],
                                       atol=1e-5, rtol=1e-5)
        keep_first(session, take)
        cached = [c + k for c, k in zip(cached, take)]


def assert_mask_holds_the_cache(session, cached) -> None:
    """Between forwards every query row of row ``r`` sees exactly the columns the row holds (its
    context but the padding in front, then its cached slots) and none past them: the network
    reads the whole capacity, so stale columns must stay blocked."""
    committed = np.array(cached) + 1
    if session.guided:
        committed = np.concatenate([committed, committed])
    lengths = session.layout.cached_length(committed)
    columns = np.arange(session.mask.capacity)
    held = (columns[None] < lengths[:, None]) & (columns[None] >= session._padding[:, None])
    expected = torch.from_numpy(held)[:, None, None].expand_as(session.mask.buffer)
    assert torch.equal(session.mask.buffer == 0, expected)


@torch.no_grad()
def test_the_mask_blocks_every_column_past_each_rows_length(llama):
    """Rows in step fed one node each, rows that drift apart, windows partly kept, a probe thrown
    away and plain autoregression's advance: after each, the mask opens exactly what every row
    holds, and the logits stay exact."""
    prompts = [[1, 5, 7, 2, 9], [3, 6, 2, 9]]  # the second context is padded at the front
    seqs = [CODES, CODES[::-1]]
    refs = [reference_logits(llama, p, seq, GRID[1]) for p, seq in zip(prompts, seqs)]
    session = HFSession(parts(llama), [Context(ids=torch.tensor(p)) for p in prompts], None, GRID)
    cached = [-1, -1]
    assert_mask_holds_the_cache(session, cached)
    for take, width in (([1, 1], 1), ([1, 1], 1), ([1, 0], 1), ([4, 2], 6), ([0, 0], 6),
                        ([1, 3], 4)):
        out, _ = window_forward(session, seqs, cached, width=width)
        for b in range(2):
            n = min(width, 12 - cached[b])
            torch.testing.assert_close(out[b, :n], refs[b][cached[b] + 1:cached[b] + 1 + n],
                                       atol=1e-5, rtol=1e-5)
        keep_first(session, take, width=width)
        cached = [c + k for c, k in zip(cached, take)]
        assert_mask_holds_the_cache(session, cached)
    assert cached == [7, 6]
    window_forward(session, seqs, cached, width=1)
    keep_first(session, [0, 1], width=1)
    cached[1] += 1  # the rows are in step again: from the third advance on, the lean step
    for _ in range(3):
        codes = torch.tensor([seqs[b][cached[b]] for b in range(2)])
        logits, _ = session.advance(codes, [c + 1 for c in cached])
        for b in range(2):
            torch.testing.assert_close(logits[b], refs[b][cached[b] + 1], atol=1e-5, rtol=1e-5)
        cached = [c + 1 for c in cached]
        assert_mask_holds_the_cache(session, cached)


@torch.no_grad()
def test_retained_rows_equal_a_session_that_never_had_the_others(llama):
    prompts, uncond_prompts = [[1, 5, 7, 2, 9], [1, 6, 2, 9], [4, 9]], [[2, 9], [3, 2, 9], [5, 5, 2, 9]]
    seqs = [CODES, CODES[::-1], CODES[3:] + CODES[:3]]

    def start(rows):
        return HFSession(parts(llama), [Context(ids=torch.tensor(prompts[r])) for r in rows],
                         [Context(ids=torch.tensor(uncond_prompts[r])) for r in rows], GRID, max_nodes=6)

    whole, alone = start([0, 1, 2]), start([0, 2])
    cached = [-1, -1, -1]
    for take in ([3, 6, 1], [5, 2, 4]):  # rows drift apart, crossing row ends
        window_forward(whole, seqs, cached)
        window_forward(alone, [seqs[0], seqs[2]], [cached[0], cached[2]])
        keep_first(whole, take)
        keep_first(alone, [take[0], take[2]])
        cached = [c + k for c, k in zip(cached, take)]
    whole.retain([0, 2])
    assert whole.batch_size == 2
    seqs, cached = [seqs[0], seqs[2]], [cached[0], cached[2]]
    for take in ([2, 3], [1, 1]):
        got, want = window_forward(whole, seqs, cached), window_forward(alone, seqs, cached)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
        keep_first(whole, take)
        keep_first(alone, take)
        cached = [c + k for c, k in zip(cached, take)]


@torch.no_grad()
def test_probe_thrown_away_leaves_the_next_forward_unchanged(llama):
    def start():
        return HFSession(parts(llama), [Context(ids=torch.tensor(PROMPT))],
                         [Context(ids=torch.tensor([2, 9]))], GRID)

    probed, plain = start(), start()
    for session in (probed, plain):
        window_forward(session, [CODES], [-1])
        keep_first(session, [3])
    window_forward(probed, [CODES[::-1]], [2])  # crosses a row end, then thrown away
    keep_first(probed, [0])
    # a narrower forward: the probe's columns past it must be closed again
    narrower = [window_forward(session, [CODES], [2], width=3) for session in (probed, plain)]
    for got, want in zip(*narrower):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@torch.no_grad()
def test_forward_of_more_nodes_than_max_nodes_enlarges_the_cache(llama):
    session = HFSession(parts(llama), [Context(ids=torch.tensor(PROMPT))], None, GRID, max_nodes=2)
    cond, _ = session.forward(torch.tensor([[0] + CODES[:10]]), torch.arange(-1, 10)[None], chain(11), [0])
    torch.testing.assert_close(cond[0], reference_logits(llama, PROMPT, CODES, GRID[1])[:11],
                               atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_steady_state_waits_for_nothing(llama, without_device_checks):
    """After the first forward of a tree, forward + keep read nothing from the device and copy
    nothing from the host that the host waits for (the CPU counted as the device, the inputs
    made on it, as the engine makes them)."""
    session = HFSession(parts(llama), [Context(ids=torch.tensor(PROMPT)), Context(ids=torch.tensor([1, 9]))],
                        [Context(ids=torch.tensor([2, 9]))] * 2, GRID)
    device = session.device
    tree = chain(4)
    session.forward(torch.zeros(2, 4, dtype=torch.long), torch.arange(-1, 3).expand(2, 4), tree, [0, 0])
    session.keep(torch.tensor([[True, True, False, False], [True, False, False, False]]))
    keep = torch.tensor([[True, True, True, False], [True, True, False, False]])
    cached, waits = [1, 0], HostReads(cpu_is_device=True)
    with waits:
        for _ in range(4):
            slots = torch.stack([torch.arange(c, c + 4, device=device) for c in cached]).clamp(max=11)
            session.forward(torch.ones(2, 4, dtype=torch.long, device=device), slots, tree,
                            [c + 1 for c in cached])
            session.keep(keep)
            cached = [cached[0] + 3, cached[1] + 2]
    assert (waits.count, waits.blocking_copies) == (0, 0)
    with waits:  # the counter is not blind: a read, and host data made into a device tensor
        torch.arange(3, device=device).tolist()
        torch.tensor([1, 2], device=device)
    assert (waits.count, waits.blocking_copies) == (1, 1)


@torch.no_grad()
def test_slots_or_committed_that_do_not_continue_the_cache_are_refused(llama):
    session = HFSession(parts(llama), [Context(ids=torch.tensor(PROMPT))], None, GRID)
    with pytest.raises(RuntimeError, match="do not continue the cache"):
        session.forward(torch.zeros(1, 3, dtype=torch.long), torch.tensor([[3, 7, 11]]), chain(3), [0])
    session = HFSession(parts(llama), [Context(ids=torch.tensor(PROMPT))], None, GRID)
    window_forward(session, [CODES], [-1])
    keep_first(session, [2])  # slots -1 and 0 kept: committed is now 2, not 3
    with pytest.raises(RuntimeError, match="do not continue the cache"):
        window_forward(session, [CODES], [2])


@torch.no_grad()
def test_keeping_more_than_a_path_is_refused(llama):
    """Two siblings kept at once are not a path: the next forward refuses to continue."""
    session = HFSession(parts(llama), [Context(ids=torch.tensor(PROMPT))], None, GRID)
    siblings = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # 0 -> 1, 0 -> 2
    session.forward(torch.zeros(1, 3, dtype=torch.long), torch.tensor([[-1, 0, 0]]), siblings, [0])
    session.keep(torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(RuntimeError, match=r"a path of the tree"):
        window_forward(session, [CODES], [3])


@torch.no_grad()
def test_bad_arguments_name_the_input(llama):
    with pytest.raises(ValueError, match="max_nodes=0 is not allowed"):
        HFSession(parts(llama), [Context(ids=torch.tensor(PROMPT))], None, GRID, max_nodes=0)
    session = HFSession(parts(llama), [Context(ids=torch.tensor(PROMPT))] * 2, None, GRID)
    codes, slots = torch.zeros(2, 1, dtype=torch.long), torch.full((2, 1), -1)
    with pytest.raises(ValueError, match=r"committed=\[0\]; it must be a list of 2 host integers"):
        session.forward(codes, slots, chain(1), [0])
    with pytest.raises(ValueError, match="committed=tensor"):
        session.forward(codes, slots, chain(1), torch.zeros(2, dtype=torch.long))
    with pytest.raises(RuntimeError, match="keep.. called without a forward"):
        session.keep(torch.ones(2, 1, dtype=torch.bool))
    session.forward(codes, slots, chain(1), [0, 0])
    with pytest.raises(ValueError, match=r"keep got a mask of shape \(1, 1\)"):
        session.keep(torch.ones(1, 1, dtype=torch.bool))
    for rows in ([], [1, 0], [0, 2], [0, 0]):
        with pytest.raises(ValueError, match=re.escape(f"retain got rows={rows!r}") + ".*indices in 0..1"):
            session.retain(rows)


def test_layers_of_one_kind_join_into_one_tensor_and_move_together():
    """Once every layer has written, join puts the layers that share device, dtype and shape in
    one tensor; a compaction then moves their entries as per-layer copies would, and a
    layer of another dtype keeps its own buffer."""
    store = KVStore(rows=2, capacity=8)
    store.plan(torch.arange(3).expand(2, 3), 8)
    written = []
    for layer, dtype in enumerate([torch.float32, torch.float32, torch.float64, torch.float32]):
        keys, values = torch.randn(2, 3, 3, 4, dtype=dtype), torch.randn(2, 3, 3, 4, dtype=dtype)
        store.update(layer, keys, values)
        written.append((keys, values))
    before = [(k.clone(), v.clone()) for k, v in (store._views[layer] for layer in range(4))]
    assert len(store._groups) == 4
    store.join()
    assert sorted(group.shape[0] for group in store._groups) == [1, 3]
    same_kind = {store._views[layer][0].untyped_storage().data_ptr() for layer in (0, 1, 3)}
    assert len(same_kind) == 1
    for layer in range(4):
        assert torch.equal(store._views[layer][0], before[layer][0])
        assert torch.equal(store._views[layer][1], before[layer][1])
    compact(store.buffers(), torch.tensor([[2, 0], [1, 2]]), torch.tensor([[0, 1], [0, 1]]))
    for layer, (keys, values) in enumerate(written):
        cached_keys, cached_values = store._views[layer]
        for row, taken in enumerate([[2, 0], [1, 2]]):
            assert torch.equal(cached_keys[row, :, :2], keys[row, :, taken])
            assert torch.equal(cached_values[row, :, :2], values[row, :, taken])


def test_a_tree_with_row_ends_is_fed_in_at_most_three_token_counts():
    """Forwards that feed row ends are padded to a count fixed per tree (the most row ends its
    nodes can bring inside the image, twice its nodes at the image's end), so that a compiled
    network sees few shapes; padding tokens are never real."""
    from sjd_core.decoding.drafting import DraftTree
    from sjd_core.decoding.settings import AccelerationSettings
    from sjd_core.models.session.token_layout import GridLayout

    tree = DraftTree.for_settings(AccelerationSettings.preset("pac", pd_candidates=4, pd_depth=3),
                                  torch.device("cpu"))
    depth, ancestors = np.asarray(tree.depth), tree.host_ancestors
    layout = GridLayout((4, 20), True, [5, 5], [5, 5])
    counts = set()
    for committed in range(1, 80):
        plan = layout.plan(np.array([committed, max(1, committed - 5)]), depth, ancestors)
        counts.add(plan.tokens)
    assert layout.padded_tokens(depth) == tree.size + 16  # the 16 nodes at depth 2
    assert counts == {tree.size, tree.size + 16, 2 * tree.size}


# ---------------------------------------------------------------- the session benchmark
# ``bench --cache-scaling`` (sjd_core.tools.session_bench) times the session's own work; here it
# runs at toy size.

@pytest.mark.parametrize("backbone", session_bench.BACKBONES)
def test_cache_scaling_bench_splits_every_iteration(backbone):
    network = session_bench.random_decoder()
    outside, inside = session_bench.image_iterations(network, 4, True, session_bench.SplitClock(),
                                                     backbone)
    assert len(outside) == len(inside) == 6  # 16 slots, three kept per iteration
    assert min(outside) > 0 and min(inside) > 0


def test_the_control_attends_over_a_long_image_and_leaves_the_decoders_output_alone():
    network = session_bench.random_decoder()
    control = session_bench.decoder_parts(network, row_end=True, backbone="control").backbone
    assert control.keys.shape[2] == 64 * 65  # a 64x64 image's codes and row ends
    inputs = torch.randn(2, 5, network.config.hidden_size)
    with torch.no_grad():
        assert torch.equal(control(inputs_embeds=inputs).last_hidden_state,
                           network.model(inputs_embeds=inputs).last_hidden_state)
    with pytest.raises(ValueError, match="backbone is 'eager'; allowed: decoder, stand-in, control"):
        session_bench.decoder_parts(network, row_end=True, backbone="eager")


def test_autoregression_bench_reports_share_and_speeds():
    share, speeds = session_bench.autoregression(ReferenceModel(WEIGHTS_DIR, device="cpu"))
    percent = float(re.search(r"([\d.]+)% of forward \+ keep", share).group(1))
    assert 0 < percent < 100
    assert re.search(r"session: [\d.]+ ms/token; transformers generate\(\): [\d.]+ ms/token", speeds)

"""HFSession on a tiny random LlamaForCausalLM: windows, trees, keep, batched guidance (fp32)."""

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import LlamaConfig, LlamaForCausalLM

from sjd_core.models import hf_session
from sjd_core.models.hf_session import Context, DecoderParts, HFSession

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
        row_end_id=row_end, device=torch.device("cpu"), dtype=torch.float32,
        cache_config=model.config)


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


@torch.no_grad()
def test_window_equals_stepwise_across_row_ends(llama):
    ref = reference_logits(llama, PROMPT, CODES, GRID[1])
    session = HFSession(parts(llama), [Context(ids=torch.tensor(PROMPT))], None, GRID)
    # window of slots -1..6 crosses the first row end (after slot 3)
    slots = torch.arange(-1, 7)[None]
    codes = torch.tensor([[0] + CODES[:7]])
    cond, uncond = session.forward(codes, slots, chain(8))
    assert uncond is None
    torch.testing.assert_close(cond[0], ref[:8], atol=1e-5, rtol=1e-5)
    # one at a time from a fresh session
    step = HFSession(parts(llama), [Context(ids=torch.tensor(PROMPT))], None, GRID)
    outs = []
    for s in range(-1, 11):
        code = 0 if s < 0 else CODES[s]
        out, _ = step.forward(torch.tensor([[code]]), torch.tensor([[s]]), chain(1))
        step.keep(torch.ones(1, 1, dtype=torch.bool))
        outs.append(out[0, 0])
    torch.testing.assert_close(torch.stack(outs), ref[:12], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_tree_equals_each_branch(llama):
    session = HFSession(parts(llama), [Context(ids=torch.tensor(PROMPT))], None, GRID)
    session.forward(torch.tensor([[0] + CODES[:2]]), torch.arange(-1, 2)[None], chain(3))
    session.keep(torch.ones(1, 3, dtype=torch.bool))
    # committed slots 0,1; tree: slot 2 has candidates a,b; slot 3 (row end) children; slot 4 chain
    #   node: 0:(2,a) 1:(2,b) 2:(3,a->x) 3:(3,b->y) 4:(4, after x)
    codes = torch.tensor([[20, 21, 30, 31, 5]])
    slots = torch.tensor([[2, 2, 3, 3, 4]])
    anc = torch.eye(5, dtype=torch.bool)
    anc[2, 0] = anc[3, 1] = anc[4, 2] = anc[4, 0] = True
    tree, _ = session.forward(codes, slots, anc)
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
    session.forward(codes, slots, anc)
    session.keep(torch.tensor([[True, True, True, False, True, False, True]]))  # path 4,17,33,8
    out, _ = session.forward(torch.tensor([[0, 39, 12]]), torch.tensor([[4, 5, 6]]), chain(3))
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
    cond, uncond = session.forward(codes, slots, chain(6))
    for b in range(2):
        c = codes[b, 1:].tolist()
        torch.testing.assert_close(cond[b], reference_logits(llama, cond_prompts[b], c, GRID[1])[:6],
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(uncond[b], reference_logits(llama, uncond_prompts[b], c, GRID[1])[:6],
                                   atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_rows_keep_different_counts(llama, monkeypatch):
    compactions = []
    compact = HFSession._compact
    monkeypatch.setattr(HFSession, "_compact", lambda self, n: (compactions.append(n), compact(self, n)))
    prompts = [[1, 5, 7, 2, 9], [1, 6, 2, 9]]
    uncond_prompts = [[2, 9], [3, 2, 9]]
    seqs = [CODES, CODES[::-1]]
    refs = [(reference_logits(llama, prompts[b], seqs[b], GRID[1]),
             reference_logits(llama, uncond_prompts[b], seqs[b], GRID[1])) for b in range(2)]
    session = HFSession(parts(llama), [Context(ids=torch.tensor(p)) for p in prompts],
                        [Context(ids=torch.tensor(p)) for p in uncond_prompts], GRID)
    session.compact_min = 0  # compact as soon as rows diverge, to exercise it
    cached = [-1, -1]  # per row: first slot not yet in the cache
    for take in ([6, 1], [1, 6], [0, 4], [3, 0], [2, 5]):
        slots = torch.stack([torch.arange(c, c + 6) for c in cached]).clamp(max=11)
        codes = torch.tensor([[0 if s < 0 else seqs[b][s] for s in slots[b].tolist()] for b in range(2)])
        cond, uncond = session.forward(codes, slots, chain(6))
        for b in range(2):
            n = min(6, 12 - cached[b])  # nodes past the grid's end are padding
            torch.testing.assert_close(cond[b, :n], refs[b][0][cached[b] + 1:cached[b] + 1 + n],
                                       atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(uncond[b, :n], refs[b][1][cached[b] + 1:cached[b] + 1 + n],
                                       atol=1e-5, rtol=1e-5)
        keep = torch.arange(6)[None, :] < torch.tensor(take)[:, None]
        session.keep(keep)
        cached = [c + k for c, k in zip(cached, take)]
    assert compactions, "rows diverged but the cache was never compacted"


SYNC_OPS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu",
            "numpy", "masked_select", "unique", "argwhere"}


class _HostReads(TorchFunctionMode):
    """Records tensor operations that need values on the host, except on the ``allowed`` tensors."""

    def __init__(self, allowed: set[int]) -> None:
        super().__init__()
        self.allowed, self.names = allowed, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        bool_index = name == "__getitem__" and any(
            isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in args[1:])
        if (name in SYNC_OPS or bool_index) and not all(id(a) in self.allowed for a in tensors):
            self.names.append(name)
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def test_steady_state_reads_nothing_back(llama, monkeypatch):
    """After the first forward, forward + keep only touch the counts keep sent to the host."""
    host_copies: set[int] = set()
    send = hf_session._to_host_async

    def tracked(values):
        host, ready = send(values)
        host_copies.add(id(host))
        return host, ready

    monkeypatch.setattr(hf_session, "_to_host_async", tracked)
    session = HFSession(parts(llama), [Context(ids=torch.tensor(PROMPT)), Context(ids=torch.tensor([1, 9]))],
                        [Context(ids=torch.tensor([2, 9]))] * 2, GRID)
    tree = chain(4)
    session.forward(torch.zeros(2, 4, dtype=torch.long), torch.arange(-1, 3).expand(2, 4), tree)
    session.keep(torch.tensor([[True, True, False, False], [True, False, False, False]]))
    cached, reads = [1, 0], _HostReads(host_copies)
    with reads:
        for _ in range(4):
            slots = torch.stack([torch.arange(c, c + 4) for c in cached]).clamp(max=11)
            session.forward(torch.ones(2, 4, dtype=torch.long), slots, tree)
            session.keep(torch.tensor([[True, True, True, False], [True, True, False, False]]))
            cached = [cached[0] + 3, cached[1] + 2]
    assert reads.names == []
    with reads:  # the recorder is not blind
        torch.arange(3).tolist()
        bool(torch.ones(1))
    assert reads.names == ["tolist", "__bool__"]


@torch.no_grad()
def test_slots_that_skip_the_cached_prefix_are_refused(llama):
    session = HFSession(parts(llama), [Context(ids=torch.tensor(PROMPT))], None, GRID)
    with pytest.raises(RuntimeError, match="do not continue the cached prefix"):
        session.forward(torch.zeros(1, 3, dtype=torch.long), torch.tensor([[3, 7, 11]]), chain(3))

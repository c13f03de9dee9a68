"""The attention mask buffer: the columns plain autoregression opens without writing at once."""

from __future__ import annotations

import pytest
import torch

from sjd_core.models.session.mask_buffer import MaskBuffer, write_block

CAPACITY = 12


def open_columns(mask: MaskBuffer) -> torch.Tensor:
    """(rows, 1, query_rows, capacity) True where the mask lets a query attend."""
    return mask.buffer == mask.values(torch.tensor(True))


def columns(*numbers: int) -> torch.Tensor:
    opened = torch.zeros(CAPACITY, dtype=torch.bool)
    opened[list(numbers)] = True
    return opened


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_opened_columns_show_in_every_row_and_query_before_the_buffer_is_next_used(dtype):
    """Bool masks open with True, additive ones with 0; a run of columns and one apart."""
    mask = MaskBuffer(torch.tensor([3, 3]), 4, CAPACITY, dtype, torch.device("cpu"))
    for column in (3, 4, 5, 8):
        mask.open_column(column)
    assert torch.equal(mask.view(2) == mask.values(torch.tensor(True)),
                       columns(0, 1, 2, 3, 4, 5, 8).expand(2, 1, 2, CAPACITY))
    assert torch.equal(open_columns(mask), columns(0, 1, 2, 3, 4, 5, 8).expand(2, 1, 4, CAPACITY))


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_columns_opened_before_a_keep_stay_open_and_the_keep_still_blocks_its_own(dtype):
    mask = MaskBuffer(torch.tensor([3, 3]), 4, CAPACITY, dtype, torch.device("cpu"))
    mask.open_column(3)
    mask.open_column(4)
    fed = torch.tensor([[5, 6], [5, 6]])  # (rows, n): two tokens fed per row
    write_block(mask.view(2), fed, mask.values(torch.ones(1, 2, 2, dtype=torch.bool)))
    mask.settle(fed[:, None], torch.tensor([1, 0]))  # row 0 keeps its first token, row 1 none
    expected = torch.stack([columns(0, 1, 2, 3, 4, 5), columns(0, 1, 2, 3, 4)])
    assert torch.equal(open_columns(mask), expected[:, None, None, :].expand(2, 1, 4, CAPACITY))


def test_a_larger_buffer_keeps_the_columns_opened_before_it_grew():
    mask = MaskBuffer(torch.tensor([2]), 2, CAPACITY, torch.float32, torch.device("cpu"))
    mask.open_column(2)
    mask.reserve(3, CAPACITY + 4)
    expected = torch.cat([columns(0, 1, 2), torch.zeros(4, dtype=torch.bool)])
    assert torch.equal(open_columns(mask), expected.expand(1, 1, 3, CAPACITY + 4))


def test_a_one_token_view_opens_first_the_columns_its_query_row_does_not_show_yet():
    """Plain autoregression's steps that read the mask write their own column open in query row
    0 (their block): the next one-token view leaves the other query rows for later; a column
    opened by a step that did not read the mask is opened before any view shows it."""
    mask = MaskBuffer(torch.tensor([3]), 3, CAPACITY, torch.bool, torch.device("cpu"))
    first_query = mask.view(1)
    for column in (3, 4):
        first_query[..., column] = True  # as a step's block writes it
        mask.open_column(column, open_in_first_query=True)
    assert torch.equal(mask.view(1)[0, 0], columns(0, 1, 2, 3, 4)[None])
    assert torch.equal(mask._buffer[0, 0, 1:], columns(0, 1, 2).expand(2, CAPACITY))  # not yet
    assert torch.equal(mask.view(2)[0, 0], columns(0, 1, 2, 3, 4).expand(2, CAPACITY))
    mask.open_column(5)  # a step that attended without the mask
    assert torch.equal(mask.view(1)[0, 0], columns(0, 1, 2, 3, 4, 5)[None])
    assert torch.equal(open_columns(mask), columns(0, 1, 2, 3, 4, 5).expand(1, 1, 3, CAPACITY))

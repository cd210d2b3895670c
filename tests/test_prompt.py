"""Placeholder-run shrinking against a brute-force per-row reference."""

import pytest
import torch

from vtoken.adapters.prompt import compress_prompt
from vtoken.errors import InputError

PH, PAD = 9, 0


def _reference(input_ids, mask, runs, keeps, positions):
    """Row by row with Python lists: drop unkept placeholders, left-pad to the longest row."""
    rows, row_masks, row_pos = [], [], []
    image = 0
    for r in range(input_ids.shape[0]):
        ids, m = input_ids[r].tolist(), mask[r].tolist()
        pos = [max(0, sum(m[: c + 1]) - 1) for c in range(len(ids))]
        out_ids, out_m, out_pos, dropped, c = [], [], [], 0, 0
        while c < len(ids):
            if ids[c] != PH:
                out_ids.append(ids[c])
                out_m.append(m[c])
                out_pos.append(pos[c] - (dropped if positions == "renumber" else 0))
                c += 1
                continue
            keep = set(keeps[image].tolist())
            for offset in range(runs[image]):
                if offset in keep:
                    out_ids.append(PH)
                    out_m.append(1)
                    out_pos.append(pos[c + offset] - (dropped if positions == "renumber" else 0))
                else:
                    dropped += 1
            c += runs[image]
            image += 1
        rows.append(out_ids)
        row_masks.append(out_m)
        row_pos.append(out_pos)
    width = max(len(r) for r in rows)
    pad = [width - len(r) for r in rows]
    ids = torch.tensor([[PAD] * p + r for p, r in zip(pad, rows, strict=True)])
    m = torch.tensor([[0] * p + r for p, r in zip(pad, row_masks, strict=True)])
    pos = torch.tensor([[0] * p + r for p, r in zip(pad, row_pos, strict=True)])
    return ids, m, pos


@pytest.mark.parametrize("positions", ["renumber", "original"])
@pytest.mark.parametrize("seed", range(6))
def test_compress_matches_bruteforce(seed, positions):
    g = torch.Generator().manual_seed(seed)
    runs, keeps, rows = [], [], []
    for _ in range(3):
        parts = [torch.randint(10, 50, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g)]
        for _ in range(int(torch.randint(0, 3, (1,), generator=g))):  # 0-2 images per row, adjacent allowed
            n = int(torch.randint(3, 9, (1,), generator=g))
            k = int(torch.randint(1, n + 1, (1,), generator=g))
            runs.append(n)
            keeps.append(torch.randperm(n, generator=g)[:k].sort().values)
            parts.append(torch.full((n,), PH))
            parts.append(torch.randint(10, 50, (int(torch.randint(0, 3, (1,), generator=g)),), generator=g))
        rows.append(torch.cat(parts))
    width = max(len(r) for r in rows)
    input_ids = torch.stack([torch.cat([torch.full((width - len(r),), PAD), r]) for r in rows])
    mask = torch.stack(
        [torch.cat([torch.zeros(width - len(r), dtype=torch.long), torch.ones(len(r), dtype=torch.long)]) for r in rows]
    )
    out = compress_prompt(input_ids, PH, runs, keeps, attention_mask=mask, pad_token_id=PAD, positions=positions)
    ref_ids, ref_mask, ref_pos = _reference(input_ids, mask, runs, keeps, positions)
    if not out.changed:
        assert torch.equal(out.input_ids, input_ids)
        return
    assert torch.equal(out.input_ids, ref_ids)
    assert torch.equal(out.attention_mask, ref_mask)
    valid = ref_mask.bool()
    assert torch.equal(out.position_ids[valid], ref_pos[valid])


def test_keep_all_returns_inputs_untouched():
    ids = torch.tensor([[1, PH, PH, PH, 2]])
    out = compress_prompt(ids, PH, [3], [torch.arange(3)])
    assert not out.changed and out.input_ids is ids and out.position_ids is None


def test_labels_follow_and_multi_axis_positions_are_gathered():
    ids = torch.tensor([[1, PH, PH, PH, PH, 2, 3]])
    labels = torch.arange(7)[None]
    pos = torch.arange(7).expand(3, 1, 7).clone()  # [P, B, L], as multi-axis RoPE passes them
    out = compress_prompt(ids, PH, [4], [torch.tensor([1, 3])], labels=labels, position_ids=pos, positions="original")
    assert out.input_ids.tolist() == [[1, PH, PH, 2, 3]]
    assert out.labels.tolist() == [[0, 2, 4, 5, 6]]
    assert out.position_ids.shape == (3, 1, 5) and out.position_ids[0].tolist() == [[0, 2, 4, 5, 6]]


def test_placeholder_count_mismatch_is_named():
    ids = torch.tensor([[1, PH, PH, 2]])
    with pytest.raises(InputError, match="2 image placeholder tokens but the images produce 3"):
        compress_prompt(ids, PH, [3], [torch.arange(1)])


def test_4d_masks_are_refused():
    ids = torch.tensor([[1, PH, 2]])
    with pytest.raises(InputError, match="4-D attention_mask"):
        compress_prompt(ids, PH, [1], [torch.arange(1)], attention_mask=torch.ones(1, 1, 3, 3))


def test_runs_can_grow_for_layouts_longer_than_the_processors_run():
    ids = torch.tensor([[0, 0, 1, PH, PH, PH, 2, 3], [1, 5, PH, PH, PH, 2, 3, 4]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]])
    labels = torch.arange(16).view(2, 8)
    out = compress_prompt(ids, PH, [3, 3], [torch.arange(5), torch.tensor([1])], attention_mask=mask, labels=labels)
    # row 0 grows by two placeholders, row 1 loses two: re-padded on the left to the longest row
    assert out.input_ids.tolist() == [[0, 0, 1, PH, PH, PH, PH, PH, 2, 3], [0, 0, 0, 0, 1, 5, PH, 2, 3, 4]]
    assert out.attention_mask.tolist() == [[0, 0, 1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1, 1, 1]]
    assert out.position_ids.tolist() == [[0, 0, 0, 1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 0, 0, 1, 2, 3, 4, 5]]
    assert out.labels.tolist()[0] == [0, 1, 2, 3, 4, 5, 5, 5, 6, 7]  # the run's last placeholder repeats
